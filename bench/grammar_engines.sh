#!/usr/bin/env bash
# Measure llguidance, xgrammar and outlines-core on this project's tokenizer, each from PyPI in
# a scratch venv outside the project (xgrammar pulls in transformers and triton). Writes
# bench/results/grammar_engines.json.
#
#   VENV=/tmp/gram bash bench/grammar_engines.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/grammar-engines}
[ -x "$VENV/bin/python" ] || python -m venv --system-site-packages "$VENV"
"$VENV/bin/pip" install -q llguidance xgrammar outlines-core
"$VENV/bin/python" bench/grammar_engines.py | tee bench/results/grammar_engines.json
