#!/usr/bin/env bash
# Set up the environment (idempotent) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV=${EAGLE_VENV:-.venv}
exec "$VENV/bin/python" -m pytest python_tests -q "$@"
