#!/usr/bin/env bash
# Set up the environment (idempotent) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV=${EAGLE_VENV:-.venv}
# One worker per core (at most 4), a test file per worker at a time: its module fixtures load once.
# Files go out in the order python_tests/conftest.py gives them (the longest first), not
# pytest-xdist's own (the most tests first), which left the five-minute compile audit for last.
WORKERS=$(nproc 2>/dev/null || echo 1)
WORKERS=$(( WORKERS > 4 ? 4 : WORKERS ))
exec "$VENV/bin/python" -m pytest python_tests -q -n "$WORKERS" --dist loadfile --no-loadscope-reorder "$@"
