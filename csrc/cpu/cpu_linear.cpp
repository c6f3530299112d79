// CPU launcher of cpu_linear: out[m, n] = sum_k x[m, k] * weight[n, k] for a few rows of x
// (decoding, M = 1; a verify pass, M = 16..64), weight fp32, bf16 or fp16, fp32 accumulation.
//
// At small M a linear layer is a stream over the weight: each weight element is used M times.
// The loop order reads every weight row from memory once and applies it to all M rows of x,
// which stay in L1/L2: panels of kPanel weight rows (parallel over panels); within a panel,
// tiles of 4 weight rows x up to 3 rows of x (8 x 1 at M = 1), each (weight row, x row) pair an
// 8-wide fp32 accumulator along K. bf16 weights are widened in registers (zero-extend, shift
// left 16: exact) at every use, fp16 weights likewise (F16C conversion: exact), so a narrow
// weight gives bit for bit the result of its fp32 widening. Widening four rows once into an
// fp32 buffer for the x tiles that reuse them measured 10-25% slower on the 49152 x 576 LM head
// at 7-8 rows and about even at 12-16 (AVX2 Zen 3).
//
// Each output is one fp32 accumulator per lane along K in a fixed order, whatever M and the
// tiling: a row of the output does not depend on the other rows (batch-invariant), so in a
// verify pass the linear layers give a token's row exactly what decoding it alone would.
//
// ISA: the vector path is compiled twice with target regions (no global -march, so the library
// still loads on any x86-64) and chosen at run time: with AVX-512VL where the CPU has AVX-512
// (the same 8-lane AVX2 arithmetic, EVEX-encoded: 32 vector registers let a tile hold 6 rows of
// x instead of 3, so each weight vector is loaded, and a 16-bit one widened, half as often at
// 4-12 rows), else AVX2 + FMA + F16C (every AVX2 CPU has the last). Both give identical bits.
// 16-lane AVX-512 accumulators measured slower at 1 row (bf16 weights, one forward: 13.7
// against 11.0 ms, 1 thread) and would have changed every result's summation order; at 2 or
// more rows the AVX-512 path instead packs two weight rows' 8-lane accumulators into one 16-lane
// register (paired tiles, below): the same bits, half the instructions.
// EAGLE_KERNELS_CPU_ISA (simd.h) caps the path: avx512-ymm keeps the 8-lane tiles, avx2 and
// scalar the paths of those names (tests reach every path on one machine).
#include "simd.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "checks.h"
#include "cpu_linear_impl.h"
#include "ops.h"

namespace eagle {
namespace {

using isa::Level;
using linear_impl::parallel_chunk;

constexpr int64_t kPanel = 8;  // weight rows per panel: the unit of parallel work and prefetch

// ------------------------------------------------------------------------------- scalar path
// Portable fallback: eight partial sums per dot product, as the AVX2 lanes (the compiler
// vectorises them with the baseline ISA). It rounds products separately (no FMA), so it agrees
// with the AVX2 path to fp32 rounding, not bit for bit; rows are batch-invariant here too.
template <typename W>
void panel_scalar(const W* w, int64_t ldw, int64_t rows, const float* x, int64_t ldx, int64_t M, int64_t K, float* out,
                  int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r) {
    const W* wr = w + r * ldw;
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * ldx;
      float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t k = 0;
      for (; k + 8 <= K; k += 8)
        for (int j = 0; j < 8; ++j) part[j] += widen(wr[k + j]) * xm[k + j];
      float sum = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
      for (; k < K; ++k) sum += widen(wr[k]) * xm[k];
      out[m * ldo + r] = sum;
    }
  }
}

#if EAGLE_X86_SIMD
// Weights are read once: the kernel streams them from DRAM, R rows at a time. Hardware
// prefetchers stop at 4 KiB pages and track few streams, so a software prefetch runs
// kPrefetchBytes ahead (the rows of a thread's panels are contiguous), paced by the work done
// rather than by the loads: at M > 1 the lines of the next weight rows arrive while the x tiles
// of the current ones compute, instead of after them. Into L2, where they wait for their turn.
// Measured at M = 1: 5 -> 7-8 GB/s (bf16 and fp32); distances of 16-64 KiB are all close.
constexpr int64_t kPrefetchBytes = 32 * 1024;

struct Ahead {
  const char* next;   // next line to prefetch
  const char* limit;  // end of this thread's weight rows
  int64_t pending;    // bytes of work done since the last prefetch
};

// A tile's share of the prefetch pacing, spread evenly over its K steps: a copy of the cursor
// the tile keeps in registers (a cursor in memory would chain every step through a store).
struct Pace {
  Ahead* ahead;  // nullptr: no prefetching
  const char* next;
  const char* limit;
  int64_t pending, per_step, rest;

  EAGLE_TARGET_AVX2 Pace(Ahead* a, int64_t bytes, int64_t K) : ahead(a), next(nullptr), limit(nullptr), pending(0) {
    const int64_t steps = (K + 7) / 8;
    per_step = a != nullptr ? bytes / steps : 0;
    rest = a != nullptr ? bytes - per_step * steps : 0;
    if (a != nullptr) {
      next = a->next;
      limit = a->limit;
      pending = a->pending;
    }
  }
  // One prefetch per 64 bytes of weights worked through.
  EAGLE_TARGET_AVX2 inline void consume(int64_t bytes) {
    for (pending += bytes; pending >= 64; pending -= 64, next += 64)
      if (next < limit) _mm_prefetch(next, _MM_HINT_T1);
  }
  EAGLE_TARGET_AVX2 inline void step() {
    if (ahead != nullptr) consume(per_step);
  }
  EAGLE_TARGET_AVX2 inline void finish() {
    if (ahead == nullptr) return;
    consume(rest);
    *ahead = Ahead{next, limit, pending};
  }
};

// The vector path, compiled twice from cpu_linear_tiles.inc inside target regions (simd.h).
EAGLE_TARGET_PUSH(EAGLE_ISA_AVX2)
namespace avx2 {
constexpr int64_t kMaxXTile = 3;  // 4 x 3 accumulators + 3 + 1 = 16 registers
#include "cpu_linear_tiles.inc"
}  // namespace avx2
EAGLE_TARGET_POP
EAGLE_TARGET_PUSH(EAGLE_ISA_AVX512)
namespace avx512 {
constexpr int64_t kMaxXTile = 6;  // 4 x 6 accumulators + 6 + 1 = 31 of 32 registers
#include "cpu_linear_tiles.inc"

// Paired tiles (M >= 2; one row takes panel()'s 8 x 1 tile): one 16-lane register holds the 8-lane accumulators of two
// weight rows, lanes 0-7 for the first and 8-15 for the second, against an x vector broadcast to both halves. Each lane
// does exactly the multiply-adds of its 8-lane counterpart in the same order, and the halves are reduced by hsum4 as
// before, so the bits are those of the 8-lane tiles; a CPU with two 512-bit FMA units (Intel Xeon) does twice the
// multiply-adds per instruction. Measured on an Intel Xeon with AVX-512 (2 threads, weights resident in cache, against
// the 8-lane tiles): 1.3-1.45x at 9-12 rows on SmolLM2's layer shapes, about even at 2-4 rows; a whole 12-row verify
// pass 1.1x (there the weights stream from DRAM). On a CPU that splits 512-bit operations in two (AMD Zen 4) the
// multiply-adds cost the same either way. EAGLE_KERNELS_CPU_ISA=avx512-ymm keeps the 8-lane tiles (comparisons, tests).
constexpr int kMaxPairXTile = 12;  // 2 x 12 accumulators + 2 weight pairs + 1 x = 27 registers

inline __m512 join(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}
inline __m256i join(__m128i lo, __m128i hi) { return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1); }
inline __m256 low_half(__m512 v) { return _mm512_castps512_ps256(v); }
inline __m256 high_half(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }
inline __m512 both_halves(__m256 v) { return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(v))); }

// Eight elements of weight row a in lanes 0-7 and of row b in lanes 8-15, widened to fp32.
inline __m512 pair8(const float* a, const float* b) { return join(load8(a), load8(b)); }

inline __m512 pair8(const Bf16Bits* a, const Bf16Bits* b) {
  const __m256i h =
      join(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a)), _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m512 pair8(const Fp16Bits* a, const Fp16Bits* b) {
  return _mm512_cvtph_ps(
      join(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a)), _mm_loadu_si128(reinterpret_cast<const __m128i*>(b))));
}

// Four weight rows (two pairs) times C rows of x: out[c * ldo + r], as tile<4, C>.
template <int C, typename W>
void pair_tile(const W* const* w, int64_t rows, Pace pace, const float* x, int64_t ldx, int64_t K, float* out,
               int64_t ldo) {
  __m512 acc01[C], acc23[C];
  EAGLE_UNROLL
  for (int c = 0; c < C; ++c) acc01[c] = acc23[c] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    pace.step();
    const __m512 w01 = pair8(w[0] + k, w[1] + k);
    const __m512 w23 = pair8(w[2] + k, w[3] + k);
    EAGLE_UNROLL
    for (int c = 0; c < C; ++c) {
      const __m512 xv = both_halves(_mm256_loadu_ps(x + c * ldx + k));
      acc01[c] = _mm512_fmadd_ps(w01, xv, acc01[c]);
      acc23[c] = _mm512_fmadd_ps(w23, xv, acc23[c]);
    }
  }
  if (k < K) {  // K tail, in the same accumulators
    const int64_t rem = K - k;
    pace.step();
    const __m512 w01 = join(load8_tail(w[0] + k, rem), load8_tail(w[1] + k, rem));
    const __m512 w23 = join(load8_tail(w[2] + k, rem), load8_tail(w[3] + k, rem));
    EAGLE_UNROLL
    for (int c = 0; c < C; ++c) {
      const __m512 xv = both_halves(load8_tail(x + c * ldx + k, rem));
      acc01[c] = _mm512_fmadd_ps(w01, xv, acc01[c]);
      acc23[c] = _mm512_fmadd_ps(w23, xv, acc23[c]);
    }
  }
  pace.finish();
  EAGLE_UNROLL
  for (int c = 0; c < C; ++c) {
    const __m128 sums = hsum4(low_half(acc01[c]), high_half(acc01[c]), low_half(acc23[c]), high_half(acc23[c]));
    float* dst = out + c * ldo;
    if (rows >= 4) {
      _mm_storeu_ps(dst, sums);
    } else {
      alignas(16) float part[4];
      _mm_store_ps(part, sums);
      for (int64_t r = 0; r < rows; ++r) dst[r] = part[r];
    }
  }
}

// The paired tiles as panel() takes them: x tiles of up to kMaxPairXTile rows.
struct PairTiles {
  static constexpr int kMaxC = kMaxPairXTile;
  template <int C, typename W>
  static void run(const W* const* w, int64_t rows, Pace pace, const float* x, int64_t ldx, int64_t K, float* out,
                  int64_t ldo) {
    pair_tile<C>(w, rows, pace, x, ldx, K, out, ldo);
  }
};
}  // namespace avx512
EAGLE_TARGET_POP
#endif  // EAGLE_X86_SIMD

template <typename W>
void run(const W* w, int64_t ldw, int64_t N, const float* x, int64_t ldx, int64_t M, int64_t K, float* out, int64_t ldo,
         Level level) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const int64_t grain = std::max<int64_t>(1, parallel_chunk() / (kPanel * K * std::max<int64_t>(M, 8)));
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
#if EAGLE_X86_SIMD
    const char* first = reinterpret_cast<const char*>(w + begin * kPanel * ldw);
    Ahead ahead{first + kPrefetchBytes, reinterpret_cast<const char*>(w + std::min(end * kPanel, N) * ldw), 0};
#endif
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n = p * kPanel;
      const int64_t rows = std::min(kPanel, N - n);
#if EAGLE_X86_SIMD
      if (level >= Level::kAvx2) {
        const W* rowp[kPanel];
        for (int64_t r = 0; r < kPanel; ++r) rowp[r] = w + (n + std::min(r, rows - 1)) * ldw;
        if (level >= Level::kAvx512) {
          avx512::panel<avx512::PairTiles, W>(rowp, rows, &ahead, x, ldx, M, K, out + n, ldo);
        } else if (level == Level::kAvx512Ymm) {
          avx512::panel<avx512::QuadTiles, W>(rowp, rows, &ahead, x, ldx, M, K, out + n, ldo);
        } else {
          avx2::panel<avx2::QuadTiles, W>(rowp, rows, &ahead, x, ldx, M, K, out + n, ldo);
        }
        continue;
      }
#endif
      panel_scalar<W>(w + n * ldw, ldw, rows, x, ldx, M, K, out + n, ldo);
    }
  });
}

}  // namespace

namespace linear_impl {
// Parallel tasks get at least this many multiply-adds (weights x max(M, 8): at M <= 8 the
// stream, not the arithmetic, sets the time). 2^20 (about 0.1 ms on one core) splits every
// SmolLM2 layer over two threads: with the cores to itself, two threads read the weights at
// 12-14 GB/s against 8-9 GB/s for one (one forward's 540 MB of fp32 weights: 38-44 ms against
// 58-65 ms at 1 to 12 rows, AMD EPYC, 2 cores). A parallel region waits for its slowest thread,
// though, and on cores shared with other busy processes that thread can wait a scheduler time
// slice per region: there 2^18 took 650-1600 ms per token where 2^23 (only the LM head splits)
// took 160-170 ms. EAGLE_KERNELS_CPU_LINEAR_CHUNK sets the number (e.g. 8388608 on such a
// machine); read per call, like EAGLE_KERNELS_CPU_ISA.
constexpr int64_t kDefaultParallelChunk = int64_t{1} << 20;

bool is_quantized(const at::Tensor& w) { return w.scalar_type() == at::kChar || w.scalar_type() == at::kByte; }

QuantFormat quant_format(const at::Tensor& w) {
  const bool q8 = w.scalar_type() == at::kChar;
  if (w.dim() == 5) return q8 ? QuantFormat::kQ8_0Int8 : QuantFormat::kQ4_1Int8;
  return q8 ? QuantFormat::kQ8_0 : QuantFormat::kQ4_1;
}

QuantFormat check_quantized(const at::Tensor& w, const char* op, const char* name, int64_t rows, int64_t K) {
  const QuantFormat format = quant_format(w);
  const bool q8 = w.scalar_type() == at::kChar;
  const bool int8 = w.dim() == 5;
  const char* fmt = q8 ? "Q8_0" : "Q4_1";
  const int64_t bytes = q8 ? kQ8BlockBytes : kQ41BlockBytes;
  const int64_t lines = bytes / kDotLineBytes;
  TORCH_CHECK_VALUE(w.dim() == 4 || w.dim() == 5, op, ": ", name, ": a ", fmt, " weight (dtype ", w.scalar_type(),
                    ") must be packed by cpu_linear_pack as 4-D [N / 32, 2, K / 32, ", bytes,
                    "] (or, for 8-bit activations, 5-D [N / 32, 2, K / 32, ", lines, ", 32]), got ", w.dim(),
                    "-D shape ", shape_str(w.sizes()));
  TORCH_CHECK_VALUE(K % kQuantBlock == 0, op, ": ", name, ": a ", fmt, " weight needs K (", K, ") to be a multiple of ",
                    kQuantBlock);
  const bool tail = int8 ? w.size(3) == lines && w.size(4) == kDotLineBytes : w.size(3) == bytes;
  const std::string want_tail = int8 ? std::to_string(lines) + ", 32" : std::to_string(bytes);
  TORCH_CHECK_VALUE(w.size(1) == 2 && w.size(2) == K / kQuantBlock && tail &&
                        (rows < 0 || (rows % kPackWidth == 0 && w.size(0) == rows / kPackWidth)),
                    op, ": ", name, ": expected packed ", fmt, int8 ? " (8-bit activations)" : "", " shape [",
                    rows < 0 ? std::string("N") : std::to_string(rows), " / 32, 2, K / 32 = ", K / kQuantBlock, ", ",
                    want_tail, "], got ", shape_str(w.sizes()));
  TORCH_CHECK_VALUE(w.is_contiguous(), op, ": ", name, ": expected a contiguous packed weight, got strides ",
                    shape_str(w.strides()));
  return format;
}

void check_packed_float(const at::Tensor& w, const char* op, const char* name, int64_t rows, int64_t K) {
  constexpr int64_t half = kPackWidth / 2;
  const bool pairs = is_pair_packed(w);
  const std::string n = rows < 0 ? std::string("N") : std::to_string(rows);
  const bool rows_fit = rows < 0 || (rows % kPackWidth == 0 && w.size(0) == rows / kPackWidth);
  if (pairs) {
    TORCH_CHECK_VALUE(
        K % 2 == 0 && rows_fit && w.size(1) == 2 && w.size(2) == K / 2 && w.size(3) == half && w.size(4) == 2, op, ": ",
        name, ": expected bf16 pair-packed shape [", n, " / 32, 2, K / 2, 16, 2] for K = ", K, " (K even), got ",
        shape_str(w.sizes()));
  } else {
    TORCH_CHECK_VALUE(w.dim() == 4 && rows_fit && w.size(1) == 2 && w.size(2) == K && w.size(3) == half, op, ": ", name,
                      ": expected packed shape [", n, " / 32, 2, K = ", K, ", 16], got ", shape_str(w.sizes()));
  }
  TORCH_CHECK_VALUE(w.is_contiguous(), op, ": ", name, ": expected a contiguous packed weight, got strides ",
                    shape_str(w.strides()));
}

int64_t parallel_chunk() {
  const char* env = std::getenv("EAGLE_KERNELS_CPU_LINEAR_CHUNK");
  if (env == nullptr || *env == '\0') return kDefaultParallelChunk;
  char* end = nullptr;
  const long long value = std::strtoll(env, &end, 10);
  TORCH_CHECK_VALUE(end != env && *end == '\0' && value > 0,
                    "EAGLE_KERNELS_CPU_LINEAR_CHUNK: expected a positive integer, got '", env, "'");
  return static_cast<int64_t>(value);
}

void linear_rows(const at::Tensor& weight, const float* x, int64_t ldx, int64_t M, int64_t K, float* out, int64_t ldo,
                 Level level) {
  if (is_quantized(weight)) {
    const QuantFormat format = quant_format(weight);
    const auto* packed = static_cast<const uint8_t*>(weight.data_ptr());
    if (format == QuantFormat::kQ8_0Int8 || format == QuantFormat::kQ4_1Int8)
      dot_linear(packed, format, weight.size(0), x, ldx, M, K, out, ldo, level);
    else
      quant_linear(packed, format, weight.size(0), x, ldx, M, K, out, ldo, level);
  } else if (weight.dim() >= 4) {
    packed_linear(weight.data_ptr(), weight.scalar_type(), is_pair_packed(weight), weight.size(0), x, ldx, M, K, out,
                  ldo, level);
  } else {
    const int64_t N = weight.size(0);
    const int64_t ldw = N > 1 ? weight.stride(0) : K;
    const at::ScalarType wtype = weight.scalar_type();
    if (wtype == at::kFloat) {
      run<float>(weight.data_ptr<float>(), ldw, N, x, ldx, M, K, out, ldo, level);
    } else if (wtype == at::kBFloat16) {
      run<Bf16Bits>(reinterpret_cast<const Bf16Bits*>(weight.data_ptr<at::BFloat16>()), ldw, N, x, ldx, M, K, out, ldo,
                    level);
    } else {
      run<Fp16Bits>(reinterpret_cast<const Fp16Bits*>(weight.data_ptr<at::Half>()), ldw, N, x, ldx, M, K, out, ldo,
                    level);
    }
  }
}

}  // namespace linear_impl

at::Tensor cpu_linear_cpu(const at::Tensor& x, const at::Tensor& weight) {
  // Same order and wording as eagle_kernels/_checks.py::check_cpu_linear.
  const char* op = "cpu_linear";
  check_dtype(x, op, "x", at::kFloat);
  TORCH_CHECK_VALUE(x.dim() >= 1, op, ": x: expected at least 1 dimension [..., K], got shape ", shape_str(x.sizes()));
  const at::Device dev = x.device();
  TORCH_CHECK_VALUE(dev.is_cpu(), op, ": x: expected device cpu, got ", dev);
  const at::ScalarType wtype = weight.scalar_type();
  const int64_t K = x.size(-1);
  int64_t N;
  if (linear_impl::is_quantized(weight)) {
    check_device(weight, op, "weight", dev);
    linear_impl::check_quantized(weight, op, "weight", -1, K);
    N = weight.size(0) * linear_impl::kPackWidth;
  } else {
    TORCH_CHECK_VALUE(wtype == at::kFloat || wtype == at::kBFloat16 || wtype == at::kHalf, op,
                      ": weight: expected dtype float32, bfloat16, float16, int8 (packed Q8_0) or uint8 (packed "
                      "Q4_1), got ",
                      wtype);
    TORCH_CHECK_VALUE(weight.dim() == 2 || weight.dim() == 4 || linear_impl::is_pair_packed(weight), op,
                      ": weight: expected 2-D [N, K] or packed 4-D [N / 32, 2, K, 16] (bf16 with K even: 5-D [N / 32, "
                      "2, K / 2, 16, 2]; cpu_linear_pack), got ",
                      weight.dim(), "-D shape ", shape_str(weight.sizes()));
    check_device(weight, op, "weight", dev);
    const bool packed = weight.dim() >= 4;
    N = packed ? weight.size(0) * linear_impl::kPackWidth : weight.size(0);
    if (packed) {
      linear_impl::check_packed_float(weight, op, "weight", -1, K);
    } else {
      TORCH_CHECK_VALUE(weight.size(1) == K, op, ": weight: expected shape [N, K = ", K, "] (K from x), got ",
                        shape_str(weight.sizes()));
      TORCH_CHECK_VALUE(weight.stride(1) == 1 || K <= 1 || N == 0, op,
                        ": weight: expected a dense last dim (stride 1), got strides ", shape_str(weight.strides()));
    }
  }

  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor out = at::empty(out_shape, x.options());
  const int64_t M = x.numel() / std::max<int64_t>(K, 1);
  if (out.numel() == 0) return out;
  if (K == 0) return out.zero_();

  at::Tensor x2 = x.reshape({M, K});
  if (x2.stride(1) != 1 || x2.stride(0) < K) x2 = x2.contiguous();  // x is small: copy is cheap
  linear_impl::linear_rows(weight, x2.data_ptr<float>(), x2.stride(0), M, K, out.data_ptr<float>(), N, isa::current());
  return out;
}

}  // namespace eagle
