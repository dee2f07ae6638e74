#!/usr/bin/env bash
# Install the project with its dev extras, then lint, type-check and run the tests.
# Set LINSERVE_FULL=1 for the full-length slow tests (soak, long generation).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[dev]"
python -m ruff check .
python -m mypy
python -m pytest "$@"
