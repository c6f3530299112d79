#!/usr/bin/env bash
# GPU check for a CUDA machine (an H200 or an H100), one command, all stages within 10 minutes, the least
# measured first:
#   1. build the native extension in place against the installed torch (sm_90)  -> build.log
#   1b. every end-to-end case once, eight processes side by side: Triton's cache filled ahead -> warm.log
#   2. steady-state end to end, random bf16 weights (bench/gpu_e2e.py --profile): SmolLM2-135M;
#      plain and speculative (6, 8, 60); B 1, 8; T 0, 1; each case's kernels a step  -> e2e_smollm2.log,
#      gpu_e2e_smollm2.md
#      then B 1, T 0 with the layer norms unfused (9 launches a layer): the fused ops' worth
#      end to end                                                              -> e2e_unfused.log
#      then B 1, T 0 without programmatic dependent launch, with it but no weight prefetch,
#      with it but the o / down GEMMs in cuBLAS, and with the layer's o_proj_mlp launch as three
#      rmsnorm_linear launches: what each is worth                             -> e2e_pdl.log
#   3. coupled sampling end to end, SmolLM2-135M shape, T = 1                 -> e2e_coupled.log
#   4. the issues' GPU goals, kernel device times side by side (gpu_goals.py)  -> goals.log, gpu_goals.md
#   5. the same end to end at the Llama-3-8B shape, then B 1, T 0 with 8-bit head GEMMs (Q8_0, fp8)
#      -> e2e_llama3_8b.log, e2e_llama3_8b_q8_0head.log, e2e_llama3_8b_fp8head.log
#   6. the GPU test subset (pytest -m gpu, 8 workers when pytest-xdist is there) -> gpu_tests.log
#   7. compute-sanitizer memcheck over a few verify / tree-attention GPU tests -> memcheck.log
#   8. real-weights SmolLM2 speed, one of (the summary says which; never random weights):
#      - the GGUF carried in parts (bench/model_parts.py, git-ignored bench/.model_parts/,
#        one part per transfer): reassembled, SHA-256 verified, measured          -> real_weights.log
#      - no parts carried: T = 0 estimate, tau measured on a CPU with the same tree and
#        head (bench/results/cpu_tau/) x this GPU's steady-state step rate
#      parts present but incomplete or corrupt: the stage fails, naming them
#   9. compile audit: every Triton kernel compiled for sm_90, registers, spills -> compile_audit.log
#      (the CPU's audit already records it; here it confirms that audit's numbers)
#  10. per-op benchmarks at the GPU shapes (needs pytest-benchmark)            -> bench.log, bench.json;
#      the 8-bit head GEMMs beside cuBLAS                                     -> bench_8bit.log, bench_8bit.json
#  11. modeled vs measured (bench/gpu_model.py calibrate on bench.json; needs no GPU, so
#      GPU_CHECK_SKIP=model and a CPU run on the fetched bench.json save device time) -> model.log
#  12. summary.md: result and wall time per stage, the tables from the logs
# Results of one H200 run (2026-12-04, torch 2.11, triton 3.6) set the stage budgets:
# bench/results/nvidia-h200/gpu_check_2026-12-04.md. Collect OUTDIR as one archive: a device
# session brings back a few files only.
# Every stage has its own timeout, clipped to what is left of the overall budget; a failing
# stage does not stop the later ones. Exit status: 1 if any stage failed, else 0 (skips are
# not failures). Nothing is downloaded.
#
# Usage: bench/gpu_check.sh [--dry-run] OUTDIR
#   --dry-run (any machine, CI): run nothing on a GPU; check that every stage's command and
#   script exists and that the parts logic of bench/model_parts.py round-trips a small file
#   (and rejects a corrupt or missing part); writes OUTDIR/summary.md all the same.
# Environment: GPU_CHECK_SKIP (stage names to skip, space-separated; e.g. "model", which needs
# no GPU and can run on a CPU from bench.json), PYTHON (default: python, else python3), GPU_CHECK_TOTAL_S (default 540: stage
# time in all, under 10 minutes with the machine report), MAX_JOBS (compile jobs, default: all
# cores), MODEL_PARTS (default bench/.model_parts), CPU_TAU (default
# bench/results/cpu_tau/smollm2_eagle3_d6k8n60.json), CPU_TAU_COUPLED (default
# bench/results/cpu_tau/smollm2_eagle3_d6k8n60_t1_coupled_code.json).
set -uo pipefail

DRY=0
if [ "${1:-}" = "--dry-run" ]; then
  DRY=1
  shift
fi
if [ $# -ne 1 ]; then
  echo "usage: $0 [--dry-run] OUTDIR" >&2
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
MODEL_PARTS=${MODEL_PARTS:-bench/.model_parts}
CPU_TAU=${CPU_TAU:-bench/results/cpu_tau/smollm2_eagle3_d6k8n60.json}
CPU_TAU_COUPLED=${CPU_TAU_COUPLED:-bench/results/cpu_tau/smollm2_eagle3_d6k8n60_t1_coupled_code.json}

TOTAL_S=${GPU_CHECK_TOTAL_S:-540}
START=$(date +%s)
DEADLINE=$((START + TOTAL_S))
NAMES=() RESULTS=() WALLS=() LOGS=()
FAILED=0

record() {  # record NAME RESULT WALL_S LOG
  NAMES+=("$1") RESULTS+=("$2") WALLS+=("$3") LOGS+=("$4")
  echo "[gpu_check] $1: $2 (${3} s)"
}

# dry_check LOG CMD...: the command's program and every argument naming a repository script or
# test file exist, and every pytest node id's test function is defined in its file (nothing runs).
dry_check() {
  local log=$1
  shift
  local args=("$@") i=0 missing=()
  if [ "${args[0]}" = env ]; then
    i=1
    while [[ ${args[$i]} == *=* ]]; do i=$((i + 1)); done
  fi
  local prog=${args[$i]}
  command -v "$prog" >/dev/null 2>&1 || [ -e "$prog" ] || missing+=("$prog")
  local arg test
  for arg in "${args[@]:$i}"; do
    if [[ $arg == *::* ]]; then  # a pytest node id: its file must define the test function
      test=${arg##*::}
      test=${test%%[*}
      grep -q "^def ${test}(" "${arg%%::*}" 2>/dev/null || missing+=("$arg")
    fi
    arg=${arg%%::*}
    case "$arg" in
      *.py | *.sh | python_tests/* | bench/) [ -e "$arg" ] || missing+=("$arg") ;;
    esac
  done
  if ((${#missing[@]})); then
    echo "missing: ${missing[*]}" >>"$log"
    return 1
  fi
  echo "found: $prog and the files it is given" >>"$log"
}

# run_stage NAME BUDGET_S LOG CMD...: CMD under `timeout min(BUDGET_S, time left)`, output to LOG.
run_stage() {
  local name=$1 budget=$2 log=$3
  shift 3
  if ((DRY)); then
    echo "# dry run: $*" >"$log"
    if dry_check "$log" "$@"; then record "$name" "DRY (found)" 0 "$log"; else
      record "$name" "FAIL (dry run: $(tail -1 "$log"))" 0 "$log"
      FAILED=1
    fi
    return
  fi
  if [[ " ${GPU_CHECK_SKIP:-} " == *" $name "* ]]; then
    skip_stage "$name" "GPU_CHECK_SKIP" "$log"
    return
  fi
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
if ((DRY)); then
  echo "dry run on $(uname -n), $(date -u +%FT%TZ): nothing runs on a GPU" >"$OUT/env.log"
else {
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || echo "nvidia-smi: not available"
  timeout 60 "$PY" -c 'import sys, torch; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1
  timeout 30 "$PY" -c 'import triton; print("triton", triton.__version__)' 2>&1
  timeout 30 "$PY" -c 'import pytest_benchmark; print("pytest-benchmark", pytest_benchmark.__version__)' 2>&1
  # Reading the carried GGUF (real-weights stage) goes through transformers and gguf.
  timeout 60 "$PY" -c 'import gguf, transformers; print("gguf", getattr(gguf, "__version__", "installed"), "transformers", transformers.__version__)' 2>&1
  echo "model parts: $([ -f "$MODEL_PARTS/manifest.json" ] && echo "manifest in $MODEL_PARTS" || echo none)"
} >"$OUT/env.log"
fi
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
run_stage build 90 "$OUT/build.log" bash -c build  # 37 s on the H200 (16 jobs)

# ------------------------------------------------------------------ 1b. compile ahead, in parallel
# The 2026-12-04 run spent 55 of its end to end's 70 s compiling Triton kernels, one after another
# in one process, and ran out of time compiling the coupled step. Here the end-to-end stages' cases
# run once each (one timed round, the same shapes, hence the same specialisations), eight processes
# side by side on the machine's cores, and fill Triton's on-disk cache; the timed stages below then
# load their kernels from it. Nothing of this stage is a measurement.
warm_compile() {
  local dir=$1 pids=() rc=0 case
  mkdir -p "$dir"
  local -a cases=(
    "plain:--model smollm2 --modes plain --prompt-tokens 384"
    "spec_b1:--model smollm2 --modes speculative --batches 1 --prompt-tokens 384"
    "spec_b8:--model smollm2 --modes speculative --batches 8 --prompt-tokens 384"
    "unfused:--model smollm2 --unfused --batches 1 --temperatures 0 --prompt-tokens 384"
    "nopdl:--model smollm2 --no-pdl --batches 1 --temperatures 0 --prompt-tokens 384"
    "noprefetch:--model smollm2 --no-prefetch --batches 1 --temperatures 0 --prompt-tokens 384"
    "cublasres:--model smollm2 --cublas-residual --batches 1 --temperatures 0 --prompt-tokens 384"
    "mlpapart:--model smollm2 --mlp-apart --batches 1 --temperatures 0 --prompt-tokens 384"
    "coupled:--model smollm2 --modes plain coupled --temperatures 1"
    "llama:--model llama3-8b --max-new-tokens 64"
    "llama_q8head:--model llama3-8b --max-new-tokens 64 --batches 1 --temperatures 0 --head-weights q8_0"
    "llama_fp8head:--model llama3-8b --max-new-tokens 64 --batches 1 --temperatures 0 --head-weights fp8")
  for case in "${cases[@]}"; do
    # shellcheck disable=SC2086  # the case's arguments are words
    timeout -k 5 95 "$PY" bench/gpu_e2e.py ${case#*:} --rounds 1 --out "$dir/${case%%:*}" \
      >"$dir/${case%%:*}.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  tail -n 3 "$dir"/*.log
  return $rc
}
export -f warm_compile
run_stage warm 100 "$OUT/warm.log" bash -c 'warm_compile "$0"' "$OUT/warm"

# ------------------------------------------------------------------ 2. steady-state end to end
# 70 s on the H200 without the profile, 55 s of it compiling (the Triton cache serves the later stages).
# A 384-token prompt and 128 new tokens: a cache of about 640 entries, where tree_attention splits
# the prefix and merges the splits in their last programs, and the verify pass takes 16-row blocks
# (the 2026-12-04 run had 128-token prompts: a 384-entry cache, no split).
run_stage e2e_smollm2 110 "$OUT/e2e_smollm2.log" "$PY" bench/gpu_e2e.py --model smollm2 --profile \
  --prompt-tokens 384 --out "$OUT"
# The same cases at B 1, T 0 without the fused layer ops (rmsnorm_qkv_rope, o_proj_mlp): whether
# 3 launches a layer beat the 9 of norms, cuBLAS GEMMs, RoPE and SwiGLU apart (the kernel model
# charges a fused launch at one row its chain of dependent loads: docs/gpu_kernels.md).
run_stage e2e_unfused 50 "$OUT/e2e_unfused.log" "$PY" bench/gpu_e2e.py --model smollm2 --unfused \
  --batches 1 --temperatures 0 --prompt-tokens 384 --out "$OUT"
# The same cases with every Triton kernel launched without programmatic dependent launch (on by
# default on sm_90: a kernel's launch overlaps the previous kernel's tail; eagle_kernels/triton/_pdl.py),
# with PDL but no L2 prefetch of the GEMMs' weights before the wait, with PDL but the o and down
# GEMMs in cuBLAS (which breaks the layer's chain of Triton launches twice), and with the o, gate/up
# and down GEMMs as three rmsnorm_linear launches instead of one o_proj_mlp launch (5 launches a
# layer, not 3): what each is worth a step, beside e2e_smollm2's B 1, T 0 rows.
pdl_side_by_side() {
  local flag rc=0
  for flag in --no-pdl --no-prefetch --cublas-residual --mlp-apart; do
    "$PY" bench/gpu_e2e.py --model smollm2 "$flag" --batches 1 --temperatures 0 --prompt-tokens 384 --out "$1" \
      || rc=1
  done
  return $rc
}
export -f pdl_side_by_side
run_stage e2e_pdl 115 "$OUT/e2e_pdl.log" bash -c 'pdl_side_by_side "$0"' "$OUT"

# ------------------------------------------------------------------ 3. coupled sampling
# StaticPolicy(coupled_sampling=True) at T = 1 (the race inside verify, one coupled_draft_logits launch
# per drafting depth).
# With the CPU's tau of the same tree under coupled sampling at T = 1 (CPU_TAU_COUPLED), its real-weights estimate.
coupled_tau=()
[ -f "$CPU_TAU_COUPLED" ] && coupled_tau=(--cpu-tau "$CPU_TAU_COUPLED")
run_stage e2e_coupled 60 "$OUT/e2e_coupled.log" "$PY" bench/gpu_e2e.py --model smollm2 --modes plain coupled \
  --temperatures 1 "${coupled_tau[@]}" --out "$OUT/coupled"

# ------------------------------------------------------------------ 4. goals
# Each row is printed and saved as measured; no case starts after --budget-s.
run_stage goals 90 "$OUT/goals.log" "$PY" bench/gpu_goals.py --budget-s 70 --out "$OUT"

# ------------------------------------------------------------------ 5. Llama-3-8B shape
run_stage e2e_llama3_8b 110 "$OUT/e2e_llama3_8b.log" \
  "$PY" bench/gpu_e2e.py --model llama3-8b --max-new-tokens 64 --out "$OUT"
# The same B 1, T 0 with the head's GEMMs in 8 bits, Q8_0 blocks (q8_0_linear) then fp8 copies
# (fp8_linear): the speculative step / plain step is 1.20-1.23x by bytes in the decoding-step model
# (1.34-1.35x with the bf16 head; goal <= 1.3x), more where the kernels' loops cannot issue fast
# enough to stream their bytes (docs/gpu_model.md, "An 8-bit head").
for head_weights in q8_0 fp8; do
  run_stage "e2e_llama3_8b_${head_weights}head" 60 "$OUT/e2e_llama3_8b_${head_weights}head.log" \
    "$PY" bench/gpu_e2e.py --model llama3-8b --max-new-tokens 64 --batches 1 --temperatures 0 \
    --head-weights "$head_weights" --out "$OUT"
done

# ------------------------------------------------------------------ 6. GPU tests
# Workers compile Triton kernels in parallel (the compile, not the GPU, is what takes the time).
XDIST=()
timeout 60 "$PY" -c "import xdist" >/dev/null 2>&1 && XDIST=(-n 8)  # 4 workers: 135 s
run_stage gpu_tests 150 "$OUT/gpu_tests.log" \
  "$PY" -m pytest python_tests -m gpu -q -rs -p no:cacheprovider "${XDIST[@]}"

# ------------------------------------------------------------------ 7. memcheck
SANITIZER=$(command -v compute-sanitizer || true)
if [ -z "$SANITIZER" ] && [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" ]; then
  SANITIZER="${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer"
fi
MEMCHECK_TESTS=(-m pytest -q -p no:cacheprovider -m gpu
  python_tests/ops/test_tree_attention_backends.py::test_gpu_against_reference
  python_tests/ops/test_tree_attention_backends.py::test_gpu_folded_merge
  python_tests/ops/test_verify_chi2.py::test_verify_gpu_chi2
  python_tests/ops/test_verify_coupled.py::test_gpu_matches_cpp
  python_tests/ops/test_coupled_draft_logits.py::test_gpu_matches_cpp
  python_tests/models/test_gpu_layer_path.py::test_rmsnorm_linear_on_cuda
  python_tests/models/test_gpu_layer_path.py::test_rmsnorm_qkv_rope_on_cuda
  python_tests/models/test_gpu_layer_path.py::test_q8_0_linear_on_cuda
  python_tests/models/test_gpu_layer_path.py::test_rmsnorm_linear_add_on_cuda
  python_tests/models/test_gpu_layer_path.py::test_o_proj_mlp_on_cuda
  -k "B3-N130 or B4-N7 or folded or t0.7-k3 or (49152 and bf16) or test_coupled_draft_logits or rows61-gated or B8-N8-slot3 or (rows40-fc and bf16) or (rows61-down and bf16) or (o_proj_mlp and rows61 and bf16)")
if [ -n "$SANITIZER" ]; then
  # Without torch's caching allocator every tensor is its own allocation, so an access past
  # a tensor's end is reported instead of landing in a neighbour inside a cached block.
  run_stage memcheck 45 "$OUT/memcheck.log" \
    env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
    "$SANITIZER" --tool memcheck --error-exitcode 99 --print-limit 20 "$PY" "${MEMCHECK_TESTS[@]}"
elif ((DRY)); then
  run_stage memcheck 45 "$OUT/memcheck.log" "$PY" "${MEMCHECK_TESTS[@]}"  # checks the test ids only
else
  skip_stage memcheck "compute-sanitizer not found" "$OUT/memcheck.log"
fi

# ------------------------------------------------------------------ 8. real-weights SmolLM2
real_weights() {
  if [ -f "$MODEL_PARTS/manifest.json" ]; then
    echo "method: carried GGUF, parts in $MODEL_PARTS" | tee "$OUT/real_weights_method.txt"
    if ! "$PY" bench/model_parts.py status --dir "$MODEL_PARTS"; then
      echo "ERROR: parts missing or corrupt; carry them (python bench/model_parts.py plan) and run again" \
        | tee -a "$OUT/real_weights_method.txt"
      return 1
    fi
    local gguf
    gguf=$("$PY" bench/model_parts.py join "$MODEL_PARTS" --dir "$MODEL_PARTS") || return 1
    echo "reassembled, SHA-256 verified: $gguf" | tee -a "$OUT/real_weights_method.txt"
    [ -f "$MODEL_PARTS/prompts.json" ] || { echo "ERROR: no prompts.json among the parts"; return 1; }
    local tau=()
    [ -f "$CPU_TAU" ] && tau=(--cpu-tau "$CPU_TAU")
    "$PY" bench/gpu_e2e.py --model smollm2 --gguf "$gguf" --prompts "$MODEL_PARTS/prompts.json" "${tau[@]}" \
      --out "$OUT/real"
  elif [ -f "$CPU_TAU" ]; then
    echo "method: estimate (no parts carried): T = 0 tau measured on a CPU ($CPU_TAU) x this GPU's" \
      "steady-state speculative step rate" | tee "$OUT/real_weights_method.txt"
    "$PY" bench/gpu_e2e.py --model smollm2 --batches 1 --temperatures 0 --cpu-tau "$CPU_TAU" --out "$OUT/real"
  else
    echo "ERROR: no real weights: neither parts in $MODEL_PARTS nor a CPU tau in $CPU_TAU" \
      | tee "$OUT/real_weights_method.txt"
    return 1
  fi
}
export -f real_weights
export OUT MODEL_PARTS CPU_TAU
run_stage real_weights 90 "$OUT/real_weights.log" bash -c real_weights

# ------------------------------------------------------------------ 9. compile audit
# One compile a process, as many processes as cores (the ci grid is about 450 CPU-seconds, one compile at a time).
run_stage compile_audit 60 "$OUT/compile_audit.log" "$PY" bench/compile_audit.py --grid ci --jobs "$(nproc)"

# ------------------------------------------------------------------ 10. per-op benchmarks
if timeout 60 "$PY" -c "import pytest_benchmark" >/dev/null 2>&1; then
  # GPU shapes live in their own test functions (test_*_gpu, test_draft_expand_cuda).
  run_stage bench 50 "$OUT/bench.log" \
    env EAGLE_BENCH_TIME_S="${EAGLE_BENCH_TIME_S:-0.1}" \
    "$PY" -m pytest bench/ --benchmark-only -q -p no:cacheprovider \
    -k "(gpu or cuda) and not q8_0_linear_gpu and not fp8_linear_gpu" --benchmark-json "$OUT/bench.json"
  # The 8-bit head GEMMs beside cuBLAS's bf16 GEMM at a Llama-3-8B head's shapes: whether their loops
  # issue fast enough to stream their bytes (docs/gpu_model.md, "An 8-bit head").
  run_stage bench_8bit 45 "$OUT/bench_8bit.log" \
    env EAGLE_BENCH_TIME_S="${EAGLE_BENCH_TIME_S:-0.1}" \
    "$PY" -m pytest bench/bench_q8_0_linear.py bench/bench_fp8_linear.py --benchmark-only -q -p no:cacheprovider \
    -k gpu --benchmark-json "$OUT/bench_8bit.json"
else
  skip_stage bench "pytest-benchmark not installed" "$OUT/bench.log"
  skip_stage bench_8bit "pytest-benchmark not installed" "$OUT/bench_8bit.log"
fi

# ------------------------------------------------------------------ 11. modeled vs measured
# The cost model (bench/gpu_model.py, calibrated on the first H200 run) beside this run's
# per-op benchmark times: it interprets sampled programs of each benchmarked launch on the CPU
# and prints modeled / measured per case, for this card (an H100 or an H200) as the goals stage
# measured it: its SM count, copy bandwidth and GEMM rate (gpu_goals.json).
if [ -s "$OUT/bench.json" ]; then
  DEVICE_ARGS=()
  [ -s "$OUT/gpu_goals.json" ] && DEVICE_ARGS=(--device-limits "$OUT/gpu_goals.json")
  run_stage model 120 "$OUT/model.log" env PYTHONPATH=. "$PY" bench/gpu_model.py calibrate \
    --bench-json "$OUT/bench.json" --samples 2 --json "$OUT/gpu_model.json" ${DEVICE_ARGS[@]+"${DEVICE_ARGS[@]}"}
else
  skip_stage model "no bench.json from the per-op benchmarks" "$OUT/model.log"
fi

# ------------------------------------------------------------------ dry run: the parts logic
parts_logic() {  # split a small file, plan, join, verify; a corrupt and a missing part must fail
  local dir="$OUT/parts_check" src="$OUT/parts_check_src.bin"
  rm -rf "$dir" && head -c 300000 /dev/urandom >"$src" || return 1
  "$PY" bench/model_parts.py split "$src" --dir "$dir" --part-mib 0.1 || return 1
  "$PY" bench/model_parts.py plan --dir "$dir" || return 1
  "$PY" bench/model_parts.py join "$OUT/parts_check_joined.bin" --dir "$dir" || return 1
  "$PY" -c 'import sys; sys.exit(open(sys.argv[1], "rb").read() != open(sys.argv[2], "rb").read())' \
    "$src" "$OUT/parts_check_joined.bin" || return 1
  # Flip every bit of byte 10 (writing a fixed byte left the part intact whenever it already held that byte).
  "$PY" -c 'import sys; b = bytearray(open(sys.argv[1], "rb").read()); b[10] ^= 0xFF; open(sys.argv[1], "wb").write(b)' \
    "$dir/part-001" || return 1
  if "$PY" bench/model_parts.py join "$OUT/parts_check_bad.bin" --dir "$dir"; then
    echo "ERROR: a corrupt part was accepted"
    return 1
  fi
  rm "$dir/part-001"
  if "$PY" bench/model_parts.py status --dir "$dir"; then
    echo "ERROR: a missing part was not reported"
    return 1
  fi
  rm -rf "$dir" "$src" "$OUT/parts_check_joined.bin"
  echo "parts logic: round trip, corrupt and missing part detected"
}
if ((DRY)); then
  export -f parts_logic
  DRY=0 run_stage parts_logic 60 "$OUT/parts_logic.log" bash -c parts_logic
  for f in bench/gpu_e2e.py bench/model_parts.py bench/gpu_goals.py bench/compile_audit.py bench/gpu_model.py "$CPU_TAU"; do
    if [ ! -f "$f" ]; then
      record "file $f" "FAIL (missing)" 0 /dev/null
      FAILED=1
    fi
  done
fi

# ------------------------------------------------------------------ 12. summary
TOTAL_WALL=$(($(date +%s) - START))
SUMMARY="$OUT/summary.md"
{
  echo "# GPU check $(date -u +%FT%TZ)$( ((DRY)) && echo " (dry run: nothing ran on a GPU)")"
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
  echo "## Compile audit"
  echo '```'
  tail -12 "$OUT/compile_audit.log" 2>/dev/null
  echo '```'
  echo
  echo "## GPU tests"
  echo '```'
  grep -E "^(FAILED|ERROR|SKIPPED)|[0-9]+ (passed|failed|skipped|error)" "$OUT/gpu_tests.log" 2>/dev/null | tail -40
  echo '```'
  echo
  echo "## Steady-state end to end (bench/gpu_e2e.py; CUDA events around replayed steps)"
  for f in "$OUT"/gpu_e2e_smollm2.md "$OUT"/gpu_e2e_smollm2_unfused.md "$OUT"/gpu_e2e_smollm2_nopdl.md \
           "$OUT"/gpu_e2e_smollm2_noprefetch.md "$OUT"/gpu_e2e_smollm2_cublasres.md "$OUT"/gpu_e2e_smollm2_mlpapart.md \
           "$OUT"/gpu_e2e_llama3-8b.md \
           "$OUT"/gpu_e2e_llama3-8b_q8head.md "$OUT"/gpu_e2e_llama3-8b_fp8head.md \
           "$OUT"/coupled/gpu_e2e_smollm2.md; do
    if [ -s "$f" ]; then cat "$f"; else echo "$(basename "$f"): not produced (see the e2e logs)"; fi
    echo
  done
  echo "## Real-weights SmolLM2"
  cat "$OUT/real_weights_method.txt" 2>/dev/null || echo "not run"
  echo
  for f in "$OUT"/real/gpu_e2e_smollm2*.md; do [ -s "$f" ] && cat "$f"; done
  echo
  echo "## Goals (bench/gpu_goals.py)"
  if [ -s "$OUT/gpu_goals.md" ]; then sed -n '3,$p' "$OUT/gpu_goals.md"; else tail -5 "$OUT/goals.log" 2>/dev/null; fi
  echo
  echo "## Modeled vs measured (bench/gpu_model.py)"
  echo '```'; tail -40 "$OUT/model.log" 2>/dev/null; echo '```'
  echo
  echo "## memcheck"
  echo '```'
  grep -E "ERROR SUMMARY|Invalid|[0-9]+ (passed|failed|skipped)|^skipped|^not run" "$OUT/memcheck.log" 2>/dev/null | head -30
  echo '```'
  echo
  echo "## Per-op benchmarks (ratios)"
  echo '```'
  sed -n '/eagle vs reference/,/^$/p' "$OUT/bench.log" 2>/dev/null  # conftest's table, up to its blank line
  grep -E "speedup [0-9.]+x" "$OUT/bench.log" 2>/dev/null
  grep -E "^(skipped|not run)|[0-9]+ (passed|failed)" "$OUT/bench.log" 2>/dev/null | tail -3
  echo '```'
  if [ -s "$OUT/bench.json" ] || [ -s "$OUT/bench_8bit.json" ]; then
    echo
    echo "From bench.json and bench_8bit.json extra_info: ratio_* = eagle / baseline (< 1: eagle faster);" \
      "speedup_* = baseline / eagle (> 1: eagle faster); eagle_gb_per_s: the 8-bit GEMMs' bytes per second."
    echo
    timeout 30 "$PY" - "$OUT/bench.json" "$OUT/bench_8bit.json" <<'EOF'
import json
import os
import sys

rows = []
for path in [p for p in sys.argv[1:] if os.path.exists(p) and os.path.getsize(p)]:
    for b in json.load(open(path))["benchmarks"]:
        info = b.get("extra_info", {})
        for key, value in info.items():
            if key.startswith(("ratio_", "speedup_", "eagle_gb_per_s")):
                rows.append((b["name"], info.get("backend", "?"), b["stats"]["mean"] * 1e3, key, value))
print("| benchmark | backend | eagle mean (ms) | measure | value |")
print("|---|---|---:|---|---:|")
for name, backend, mean, key, value in rows:
    print(f"| {name} | {backend} | {mean:.4f} | {key} | {value:.3f} |")
EOF
  fi
} >"$SUMMARY" 2>&1
echo "[gpu_check] summary: $SUMMARY (total ${TOTAL_WALL} s)"
exit "$FAILED"
