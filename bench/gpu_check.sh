#!/usr/bin/env bash
# GPU check for a CUDA machine, all stages within 8 minutes:
#   1. build the native extension in place against the installed torch (sm_90)  -> build.log
#   2. the GPU test subset (pytest -m gpu)                                     -> gpu_tests.log
#   2b. the issues' GPU goals, kernel device times side by side (gpu_goals.py)  -> goals.log, gpu_goals.md
#   3. compute-sanitizer memcheck over a few verify / tree-attention GPU tests -> memcheck.log
#   4. per-op benchmarks at the GPU shapes (needs pytest-benchmark)            -> bench.log, bench.json
#   5. bench/e2e.py --device cuda --quick, when that script exists             -> e2e.log
#   6. summary.md: result and wall time per stage, the ratio tables from the logs
# Every stage has its own timeout, clipped to what is left of the overall budget; a failing
# stage does not stop the later ones. Exit status: 1 if any stage failed, else 0 (skips are
# not failures). Nothing is downloaded.
#
# Usage: bench/gpu_check.sh OUTDIR
# Environment: PYTHON (default: python, else python3), GPU_CHECK_TOTAL_S (default 450: stage
# time in all, leaving margin under 8 minutes), MAX_JOBS (compile jobs, default: all cores).
set -uo pipefail

if [ $# -ne 1 ]; then
  echo "usage: $0 OUTDIR" >&2
  exit 2
fi
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2

PY=${PYTHON:-$(command -v python || command -v python3)}
export PY
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # the in-place build is imported from here
# python_tests/conftest.py defaults TRITON_INTERPRET to 1 for the CPU suite; on the GPU the
# Triton kernels must be compiled (the interpreter would also copy CUDA tensors to the host).
export TRITON_INTERPRET=0
export TORCH_CUDA_ARCH_LIST=9.0
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export EAGLE_KERNELS_REQUIRE_EXT=1  # a failed extension build fails the stage, no silent fallback

TOTAL_S=${GPU_CHECK_TOTAL_S:-450}
START=$(date +%s)
DEADLINE=$((START + TOTAL_S))
NAMES=() RESULTS=() WALLS=() LOGS=()
FAILED=0

record() {  # record NAME RESULT WALL_S LOG
  NAMES+=("$1") RESULTS+=("$2") WALLS+=("$3") LOGS+=("$4")
  echo "[gpu_check] $1: $2 (${3} s)"
}

# run_stage NAME BUDGET_S LOG CMD...: CMD under `timeout min(BUDGET_S, time left)`, output to LOG.
run_stage() {
  local name=$1 budget=$2 log=$3
  shift 3
  local left=$((DEADLINE - $(date +%s)))
  local limit=$((budget < left ? budget : left))
  if ((limit < 15)); then
    echo "not run: the overall budget of ${TOTAL_S} s is spent" >"$log"
    record "$name" "FAIL (no time left)" 0 "$log"
    FAILED=1
    return
  fi
  local t0
  t0=$(date +%s)
  {
    echo "# $*"
    echo "# timeout ${limit} s, started $(date -u +%FT%TZ)"
  } >"$log"
  echo "[gpu_check] $name: running (timeout ${limit} s) ..."
  timeout -k 5 "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  local wall=$(($(date +%s) - t0))
  echo "# exit status $rc after ${wall} s" >>"$log"
  if ((rc == 0)); then
    record "$name" PASS "$wall" "$log"
  elif ((rc == 124 || rc == 137)); then
    record "$name" "FAIL (timed out after ${limit} s)" "$wall" "$log"
    FAILED=1
  else
    record "$name" "FAIL (exit $rc)" "$wall" "$log"
    FAILED=1
  fi
}

skip_stage() {  # skip_stage NAME REASON LOG
  echo "skipped: $2" >"$3"
  record "$1" "SKIP ($2)" 0 "$3"
}

# ------------------------------------------------------------------ 0. machine (not a stage)
{
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || echo "nvidia-smi: not available"
  timeout 60 "$PY" -c 'import sys, torch; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1
  timeout 30 "$PY" -c 'import triton; print("triton", triton.__version__)' 2>&1
  timeout 30 "$PY" -c 'import pytest_benchmark; print("pytest-benchmark", pytest_benchmark.__version__)' 2>&1
} >"$OUT/env.log"
cat "$OUT/env.log"

# ------------------------------------------------------------------ 1. build
build() {
  echo "== python setup.py build_ext --inplace (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS)"
  if ! "$PY" setup.py build_ext --inplace; then
    echo "== build_ext failed; trying pip install --no-build-isolation --no-deps -e ."
    "$PY" -m pip install --no-build-isolation --no-deps -e . || return 1
  fi
  echo "== import check"
  "$PY" - <<'EOF'
import eagle_kernels
from eagle_kernels import _dispatch
from eagle_kernels._schemas import OPS

print("native extension:", _dispatch.HAS_CPP, _dispatch.CPP_IMPORT_ERROR or "")
for op in OPS:
    print(f"  {op:<15} cuda backend: {eagle_kernels.backend_of(op, 'cuda')}")
missing = [op for op in ("build_tree", "compact_kv") if (op, "cuda") not in _dispatch.NATIVE_KERNELS]
if missing:
    raise SystemExit(f"no native CUDA kernel registered for {missing}: not a CUDA build")
EOF
}
export -f build
run_stage build 140 "$OUT/build.log" bash -c build

# ------------------------------------------------------------------ 2. GPU tests
run_stage gpu_tests 120 "$OUT/gpu_tests.log" \
  "$PY" -m pytest python_tests -m gpu -q -rs -p no:cacheprovider

# ------------------------------------------------------------------ 2b. goals
run_stage goals 120 "$OUT/goals.log" "$PY" bench/gpu_goals.py --out "$OUT"

# ------------------------------------------------------------------ 3. memcheck
SANITIZER=$(command -v compute-sanitizer || true)
if [ -z "$SANITIZER" ] && [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" ]; then
  SANITIZER="${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer"
fi
if [ -n "$SANITIZER" ]; then
  # Without torch's caching allocator every tensor is its own allocation, so an access past
  # a tensor's end is reported instead of landing in a neighbour inside a cached block.
  run_stage memcheck 60 "$OUT/memcheck.log" \
    env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
    "$SANITIZER" --tool memcheck --error-exitcode 99 --print-limit 20 \
    "$PY" -m pytest -q -p no:cacheprovider -m gpu \
    python_tests/ops/test_tree_attention_backends.py::test_gpu_against_reference \
    python_tests/ops/test_verify.py::test_verify_gpu_chi2 \
    -k "B3-N130 or B4-N7 or t0.7-k3"
else
  skip_stage memcheck "compute-sanitizer not found" "$OUT/memcheck.log"
fi

# ------------------------------------------------------------------ 4. per-op benchmarks
if timeout 60 "$PY" -c "import pytest_benchmark" >/dev/null 2>&1; then
  # GPU shapes live in their own test functions (test_*_gpu, test_draft_expand_cuda).
  run_stage bench 70 "$OUT/bench.log" \
    env EAGLE_BENCH_TIME_S="${EAGLE_BENCH_TIME_S:-0.1}" \
    "$PY" -m pytest bench/ --benchmark-only -q -p no:cacheprovider -k "gpu or cuda" \
    --benchmark-json "$OUT/bench.json"
else
  skip_stage bench "pytest-benchmark not installed" "$OUT/bench.log"
fi

# ------------------------------------------------------------------ 5. end to end
if [ -f bench/e2e.py ]; then
  run_stage e2e 90 "$OUT/e2e.log" "$PY" bench/e2e.py --device cuda --quick --trees 6,8,60 6,8,60,4 \
    --providers ours-plain hf-generate hf-lookup eagle ours-lookup --out "$OUT"
else
  skip_stage e2e "bench/e2e.py not present" "$OUT/e2e.log"
fi

# ------------------------------------------------------------------ 6. summary
TOTAL_WALL=$(($(date +%s) - START))
SUMMARY="$OUT/summary.md"
{
  echo "# GPU check $(date -u +%FT%TZ)"
  echo
  echo '```'
  cat "$OUT/env.log"
  echo '```'
  echo
  echo "| stage | result | wall (s) | log |"
  echo "|---|---|---:|---|"
  for i in "${!NAMES[@]}"; do
    echo "| ${NAMES[$i]} | ${RESULTS[$i]} | ${WALLS[$i]} | $(basename "${LOGS[$i]}") |"
  done
  echo
  echo "Total wall time: ${TOTAL_WALL} s. Overall: $([ "$FAILED" = 0 ] && echo PASS || echo FAIL)."
  echo
  echo "## GPU tests"
  echo '```'
  grep -E "^(FAILED|ERROR|SKIPPED)|[0-9]+ (passed|failed|skipped|error)" "$OUT/gpu_tests.log" | tail -40
  echo '```'
  echo
  echo "## Goals (bench/gpu_goals.py)"
  if [ -s "$OUT/gpu_goals.md" ]; then sed -n '3,$p' "$OUT/gpu_goals.md"; else tail -5 "$OUT/goals.log"; fi
  echo
  echo "## memcheck"
  echo '```'
  grep -E "ERROR SUMMARY|Invalid|[0-9]+ (passed|failed|skipped)|^skipped|^not run" "$OUT/memcheck.log" | head -30
  echo '```'
  echo
  echo "## Per-op benchmarks (ratios)"
  echo '```'
  sed -n '/eagle vs reference/,/^$/p' "$OUT/bench.log"  # conftest's table, up to its blank line
  grep -E "speedup [0-9.]+x" "$OUT/bench.log"
  grep -E "^(skipped|not run)|[0-9]+ (passed|failed)" "$OUT/bench.log" | tail -3
  echo '```'
  if [ -s "$OUT/bench.json" ]; then
    echo
    echo "From bench.json extra_info: ratio_* = eagle / baseline (< 1: eagle faster);" \
      "speedup_* = baseline / eagle (> 1: eagle faster)."
    echo
    timeout 30 "$PY" - "$OUT/bench.json" <<'EOF'
import json
import sys

rows = []
for b in json.load(open(sys.argv[1]))["benchmarks"]:
    info = b.get("extra_info", {})
    for key, value in info.items():
        if key.startswith("ratio_") or key.startswith("speedup_"):
            rows.append((b["name"], info.get("backend", "?"), b["stats"]["mean"] * 1e3, key, value))
print("| benchmark | backend | eagle mean (ms) | measure | value |")
print("|---|---|---:|---|---:|")
for name, backend, mean, key, value in rows:
    print(f"| {name} | {backend} | {mean:.4f} | {key} | {value:.3f} |")
EOF
  fi
  echo
  echo "## End to end"
  echo '```'
  grep -iE "ratio|speedup|tok(ens)?/s|tau" "$OUT/e2e.log" | head -40
  tail -5 "$OUT/e2e.log"
  echo '```'
} >"$SUMMARY" 2>&1
echo "[gpu_check] summary: $SUMMARY (total ${TOTAL_WALL} s)"
exit "$FAILED"
