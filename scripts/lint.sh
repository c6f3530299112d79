#!/usr/bin/env bash
# Lint: ruff over the Python tree (configuration in pyproject.toml) and clang-format over the
# C++/CUDA sources (.clang-format). With files as arguments, only those are checked; without,
# every tracked file. Installs the pinned tools into the active environment when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
RUFF_VERSION=0.17.6
CLANG_FORMAT_VERSION=23.1.5
python -m ruff --version 2>/dev/null | grep -q "$RUFF_VERSION" ||
  python -m pip install -q "ruff==$RUFF_VERSION"
python -c "import clang_format" 2>/dev/null && clang-format --version | grep -q "$CLANG_FORMAT_VERSION" ||
  python -m pip install -q "clang-format==$CLANG_FORMAT_VERSION"

if [ "$#" -gt 0 ]; then files=("$@"); else mapfile -t files < <(git ls-files); fi
py=() cxx=()
for f in "${files[@]}"; do
  [ -f "$f" ] || continue
  case "$f" in
    eagle_kernels/heads/*) ;;
    *.py) py+=("$f") ;;
    csrc/*.h | csrc/*.cpp | csrc/*.cu | csrc/*.inc | csrc/*.cuh) cxx+=("$f") ;;
  esac
done
status=0
if [ "${#py[@]}" -gt 0 ]; then
  python -m ruff check --no-cache "${py[@]}" || status=1
fi
if [ "${#cxx[@]}" -gt 0 ]; then
  clang-format --dry-run --Werror "${cxx[@]}" || status=1
fi
[ "$status" -eq 0 ] && echo "lint: ${#py[@]} Python and ${#cxx[@]} C++ files clean"
exit "$status"
