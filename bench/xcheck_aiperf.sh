#!/usr/bin/env bash
# Cross-check bench.loadtest against NVIDIA's aiperf on the same workload and server:
# bench.loadtest, then aiperf, then bench.loadtest again (the spread of the two loadtest runs
# is the machine's own run-to-run variance). Results land in bench/results/xcheck/.
#
#   python -m venv /tmp/xvenv && /tmp/xvenv/bin/pip install aiperf   # once, kept out of the project
#   AIPERF=/tmp/xvenv/bin/aiperf bash bench/xcheck_aiperf.sh
#
# aiperf needs a Hugging Face tokenizer folder: this script makes one from weights/tokenizer.json
# (no hub access needed). Everything runs on 127.0.0.1 and stops by itself.
set -euo pipefail
cd "$(dirname "$0")/.."
AIPERF=${AIPERF:-aiperf}
PORT=${PORT:-8011}
OUT=${OUT:-bench/results/xcheck}
source bench/xcheck_common.sh
start_xcheck_server "$OUT" 64

LOAD=(--concurrency 8 --requests 96 --prompt-tokens 64 --max-tokens 128 --ignore-eos
      --temperature 0.8 --model linear --url "http://127.0.0.1:$PORT")
python -m bench.loadtest "${LOAD[@]}" > /dev/null  # warm-up: the first run on a fresh server is slower
python -m bench.loadtest "${LOAD[@]}" --output "$OUT/loadtest_before.json" | tail -7
"$AIPERF" profile -m linear --tokenizer "$TOK" --endpoint-type completions --streaming \
  --url "127.0.0.1:$PORT" --concurrency 8 --request-count 96 \
  --prompt-input-tokens-mean 64 --prompt-input-tokens-stddev 0 \
  --prompt-output-tokens-mean 128 --prompt-output-tokens-stddev 0 \
  --extra-inputs ignore_eos:true --extra-inputs temperature:0.8 --random-seed 0 \
  --ui-type none --artifact-dir "$OUT/aiperf" > "$OUT/aiperf.log" 2>&1
grep -E "Time to First Token|Request Latency|Inter Token Latency|Output Token Throughput \(" \
  "$OUT/aiperf.log"
python -m bench.loadtest "${LOAD[@]}" --output "$OUT/loadtest_after.json" | tail -7
# Keep the summaries, not aiperf's per-request records and logs.
rm -rf "$OUT/aiperf/logs" "$OUT/aiperf/profile_export.jsonl" "$OUT/aiperf/inputs.json" \
  "$OUT/aiperf/.aiperf_results_ready.json" "$OUT"/aiperf/server_metrics_export.* "$OUT/server.log"
