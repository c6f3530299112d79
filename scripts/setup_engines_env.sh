#!/usr/bin/env bash
# Create (or reuse) the engine test environment: SGLang and vLLM at the versions the adapters in
# eagle_kernels/integrations/ are tested against, in a venv of their own (default
# build/engines-venv, git-ignored through build/).
#
# The engines pin other torch/transformers builds (CUDA ones); here they are installed with
# --no-deps next to the project's CPU torch, plus the pure-Python packages their speculative
# modules import on the way. What is only needed at import time and would pull native builds
# (IPython, torchvision, tvm_ffi, sentencepiece, xgrammar, llguidance, sgl_kernel) is stubbed by
# python_tests/integrations/conftest.py, not here. The wheels come from the package index on each
# run; the whole setup takes about a minute with a warm pip cache.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${EAGLE_ENGINES_VENV:-build/engines-venv}
SGLANG_VERSION=0.5.23
VLLM_VERSION=0.33.0
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip >/dev/null
# torch, triton and the test tools come from the project venv (scripts/setup_env.sh) when it has
# the pinned torch: its site-packages is appended to this venv's path (a .pth line; packages
# installed here come first), which saves installing torch a second time. Otherwise they are
# installed here. torch==2.13.0 is pinned on purpose: a bare `torch` (or the engines' own pins)
# pulls a CUDA build.
BASE=${EAGLE_VENV:-.venv}
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if [ -x "$BASE/bin/python" ] && "$BASE/bin/python" -c "import torch, triton, pytest, scipy; assert torch.__version__.startswith('2.13.0')" 2>/dev/null; then
  "$BASE/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$SITE/eagle_project_venv.pth"
else
  rm -f "$SITE/eagle_project_venv.pth"
  "$PY" -m pip install -q --no-compile torch==2.13.0 triton==3.9.0 numpy scipy pytest setuptools wheel
fi
# The engines and two of their pinned pure-Python dependencies, without their dependency trees.
# --no-compile (every install here): no byte-compiling of the engines' thousands of modules (about
# 20 s); the tests import few of them.
"$PY" -m pip install -q --no-compile --no-deps "sglang==$SGLANG_VERSION" "vllm==$VLLM_VERSION" \
  compressed-tensors==0.18.0 gguf==0.19.0
# What the import chains of sglang.srt.speculative.eagle_utils / spec_utils and of vLLM's
# rejection samplers need (none of these depends on torch).
"$PY" -m pip install -q --no-compile transformers==5.19.0 pydantic==2.14.4 orjson==3.13.0 psutil==7.2.2 \
  pybase64==1.5.1 requests pillow starlette msgspec==0.23.0 pyzmq==27.3.0 tqdm aiohttp zstandard \
  dill loguru PyYAML cbor2 openai==3.57.0 cachetools cloudpickle uvloop py-cpuinfo prometheus_client \
  fastapi openai-harmony==0.0.8 partial-json-parser einops
# eagle_kernels itself, editable, so that its entry points (sglang.srt.plugins,
# vllm.general_plugins) are visible to the engines' plugin loaders. The native extension is the
# one built by scripts/setup_env.sh in the source tree (same torch), so no build here.
EAGLE_KERNELS_NO_EXT=1 "$PY" -m pip install -q --no-deps --no-build-isolation -e .
"$PY" - <<'PY'
import sys
from importlib.metadata import version

import eagle_kernels

print("engines env: sglang", version("sglang"), "vllm", version("vllm"), "torch", version("torch"),
      "eagle_kernels native:", eagle_kernels._dispatch.HAS_CPP, file=sys.stderr)
PY
