#!/usr/bin/env bash
# Compile-check every csrc/cuda/*.cu for sm_80 and sm_90 (no GPU needed, no torch headers:
# the .cu files only see csrc/core and csrc/cuda/launch.h). Skips, successfully, when nvcc is
# missing. Extra nvcc flags: NVCC_FLAGS="...".
set -euo pipefail

cd "$(dirname "$0")/.."

NVCC="${NVCC:-}"
if [[ -z "$NVCC" ]]; then
  if command -v nvcc >/dev/null 2>&1; then
    NVCC="$(command -v nvcc)"
  elif [[ -x /usr/local/cuda/bin/nvcc ]]; then
    NVCC=/usr/local/cuda/bin/nvcc
  fi
fi
if [[ -z "$NVCC" ]]; then
  echo "nvcc_check: SKIPPED: nvcc not found (PATH, /usr/local/cuda/bin); set NVCC=/path/to/nvcc"
  exit 0
fi

echo "nvcc_check: using $NVCC ($("$NVCC" --version | tail -n 1))"
shopt -s nullglob
sources=(csrc/cuda/*.cu)
if [[ ${#sources[@]} -eq 0 ]]; then
  echo "nvcc_check: no csrc/cuda/*.cu files" >&2
  exit 1
fi

status=0
for src in "${sources[@]}"; do
  # shellcheck disable=SC2086
  if "$NVCC" -c -o /dev/null -std=c++17 -O3 -I csrc \
      -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
      -Werror all-warnings -Xcompiler -Wall,-Wextra ${NVCC_FLAGS:-} "$src"; then
    echo "nvcc_check: OK   $src"
  else
    echo "nvcc_check: FAIL $src" >&2
    status=1
  fi
done
exit $status
