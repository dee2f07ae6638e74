# Shared by the cross-check scripts (sourced, not run): a Hugging Face tokenizer folder made
# from weights/tokenizer.json (outside tools want one; no hub access needed), and a server
# on 127.0.0.1:$PORT that is stopped, with the folder removed, when the script exits.
#   start_xcheck_server OUT_DIR MAX_RUNNING   -> sets TOK (the folder) and SRV (the pid)
start_xcheck_server() {
  local out=$1 max_running=$2
  TOK=$(mktemp -d)
  mkdir -p "$out"
  cp weights/tokenizer.json "$TOK/"
  cat > "$TOK/tokenizer_config.json" <<'JSON'
{"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
 "bos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "model_max_length": 1000000}
JSON
  linserve serve --port "$PORT" --max-running "$max_running" > "$out/server.log" 2>&1 &
  SRV=$!
  trap 'kill $SRV 2>/dev/null; rm -rf "$TOK"' EXIT
  for _ in $(seq 120); do curl -sf "127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
}
