#!/usr/bin/env bash
# Syntax-check the C++ sources against the installed torch's headers as C++17: torch 2.11 (the
# GPU machine's) builds extensions with -std=c++17, newer ones with C++20, which accepts more
# (a call like f<A, B>(x) found only by argument-dependent lookup compiles under C++20 alone).
# -Wno-c++20-extensions: torch 2.13's own headers use C++20 bit-field initialisers (a warning each).
# The torch-free .cu files are nvcc_check.sh's.
set -euo pipefail

cd "$(dirname "$0")/.."
CXX="${CXX:-c++}"
includes=$(python -c "import sysconfig, torch.utils.cpp_extension as e; \
print(' '.join('-I' + p for p in e.include_paths() + [sysconfig.get_paths()['include']]))")
shopt -s nullglob
# Every C++ source, or the ones named: .ci/run names only torch_bindings.cpp, whose Python-module
# part (EAGLE_PYTHON_MODULE) is the one piece its C++17 CMake build does not compile.
if [ $# -gt 0 ]; then sources=("$@"); else sources=(csrc/*.cpp csrc/cpu/*.cpp); fi
status=0
# Two at a time (the CI machine's cores); each file prints its errors and fails the check.
printf '%s\n' "${sources[@]}" | xargs -P 2 -I{} sh -c \
  "$CXX -std=c++17 -Wno-c++20-extensions -fsyntax-only -fopenmp -DEAGLE_PYTHON_MODULE -Icsrc $includes {} || { echo 'cxx17_check: FAILED: {}'; exit 255; }" \
  || status=1
echo "cxx17_check: ${#sources[@]} files as C++17: $([ $status -eq 0 ] && echo ok || echo FAILED)"
exit $status
