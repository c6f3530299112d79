#!/usr/bin/env bash
# Set up the engine test environment (scripts/setup_engines_env.sh, idempotent) and run the
# adapter tests against SGLang's and vLLM's own code on CPU (python_tests/integrations/).
# The native extension must already be built in the source tree (scripts/setup_env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_engines_env.sh
VENV=${EAGLE_ENGINES_VENV:-build/engines-venv}
export TRITON_INTERPRET=1
exec "$VENV/bin/python" -m pytest python_tests/integrations -q -p no:cacheprovider "$@"
