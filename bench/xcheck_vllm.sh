#!/usr/bin/env bash
# Cross-check the HTTP path's throughput with vLLM's own load generator, `vllm bench serve`,
# on the workload of BENCHMARKS.md's HTTP-efficiency figure: 64 concurrent streaming
# /v1/completions, 16-token prompts, 256 output tokens with ignore_eos, temperature 0.8.
# Runs bench.loadtest, then vllm bench serve, then bench.loadtest again (the spread of the two
# loadtest runs is the machine's own run-to-run variance). Results in bench/results/xcheck_vllm/.
#
# vLLM goes in a venv of its own, kept out of the project. Its client runs on the CPU torch
# this project uses (the wheel's own pins would pull a CUDA torch of several GB):
#   python -m venv /tmp/vllmvenv && /tmp/vllmvenv/bin/pip install "torch==2.13.0"
#   /tmp/vllmvenv/bin/pip install --no-deps vllm
#   /tmp/vllmvenv/bin/pip install "transformers>=5.16.1,<5.21" aiohttp tqdm numpy pillow \
#     pydantic requests cbor2 psutil pyzmq openai_harmony openai msgspec cloudpickle pybase64 \
#     cachetools uvloop py-cpuinfo fastapi prometheus_client partial_json_parser uvicorn \
#     xgrammar llguidance watchfiles orjson
#   VLLM=/tmp/vllmvenv/bin/vllm bash bench/xcheck_vllm.sh
#
# The tokenizer folder is made from weights/tokenizer.json (no hub access). Everything runs
# on 127.0.0.1 and stops by itself.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM=${VLLM:-vllm}
PORT=${PORT:-8012}
CLIENTS=${CLIENTS:-64}
REQUESTS=${REQUESTS:-320}
OUT=${OUT:-bench/results/xcheck_vllm}
source bench/xcheck_common.sh
start_xcheck_server "$OUT" "$CLIENTS"
uptime | tee "$OUT/uptime.txt"

LOAD=(--concurrency "$CLIENTS" --requests "$REQUESTS" --prompt-tokens 16 --max-tokens 256
      --ignore-eos --temperature 0.8 --model linear --url "http://127.0.0.1:$PORT")
python -m bench.loadtest "${LOAD[@]}" --requests "$CLIENTS" > /dev/null  # warm-up
python -m bench.loadtest "${LOAD[@]}" --output "$OUT/loadtest_before.json" | tail -7
"$VLLM" bench serve --backend openai --base-url "http://127.0.0.1:$PORT" \
  --endpoint /v1/completions --model linear --tokenizer "$TOK" --dataset-name random \
  --random-input-len 16 --random-output-len 256 --random-range-ratio 0 \
  --num-prompts "$REQUESTS" --max-concurrency "$CLIENTS" --ignore-eos --temperature 0.8 \
  --seed 0 --disable-tqdm --save-result --result-dir "$OUT" --result-filename vllm.json \
  > "$OUT/vllm.log" 2>&1
grep -E "Output token throughput|Mean TTFT|Median TTFT|P99 TTFT|Mean ITL|Median ITL|P99 ITL|Successful|Failed" \
  "$OUT/vllm.log"
python -m bench.loadtest "${LOAD[@]}" --output "$OUT/loadtest_after.json" | tail -7
rm -f "$OUT/server.log" "$OUT/vllm.log"  # vllm.json keeps its figures
