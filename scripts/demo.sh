#!/usr/bin/env bash
# Set up the environment (idempotent) and run the demo: SmolLM2-135M, plain vs speculative.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV=${EAGLE_VENV:-.venv}
exec "$VENV/bin/python" -m eagle_kernels demo "$@"
