// CPU launcher and kernel of tree_attention (docs/ops.md §1): attention of the N tree nodes over
// the committed prefix (no mask) and over their own ancestors' tree slots (int64 bitmask rows,
// or causal j <= i when tree_mask is None).
//
// Work item = (request b, KV head h, block of nodes). Its rows are (node, query head of the
// group) pairs, so one load (and dtype conversion) of each K/V tile serves every query head
// that shares the KV head (GQA packing). Flash-attention style online softmax (Dao et al.
// 2022, Alg. 1) in float32 over key tiles of TK positions; scores use base 2 (q is pre-scaled
// by sm_scale * log2 e) so that one exp2 per score suffices.
//
// Key tiles follow logical positions: a prefix key's is its cache position, a tree slot's is the prefix length plus
// its node's depth (popcount of its mask row - 1). A tile holds the keys of 64 consecutive logical positions (siblings
// share one, so a tile straddling the prefix's end can hold up to TK + N keys), tree slots in depth order. A node's
// visible keys (the prefix, then its ancestors by depth) then fall in the same tiles, in the same order, as in the
// pass that decodes its token alone once the tree is committed; masked keys in between add exact zeros. So the
// online softmax rescales at the same keys and a verify pass gives each node that decode's bits (greedy speculative
// decoding equals plain decoding bit for bit, also where one flipped bit would flip an 8-bit activation's rounding).
//
// Data layout inside a work item, chosen so that every hot loop is vertical SIMD:
//   Qt [D][Rp]   the rows' queries, transposed once per item (Rp = rows rounded up to the
//                vector width: 16 floats with AVX-512, 8 otherwise)
//   St [TK + N][Rp]  scores, then probabilities, of one key tile
//   acc [R][D]   un-normalised outputs
// so QK^T broadcasts one key element against a vector of rows, the softmax statistics are per-lane,
// and PV broadcasts one probability against a V row; QK and PV are register-blocked like a GEMM
// micro-kernel (several keys / rows per block, 12 or 24 accumulators). Items of few rows (up to
// 8 with AVX-512, 4 with AVX2) compute QK with keys in the lanes instead (K blocks transposed in
// registers), into the same St, bit for bit.
//
// The hot loops (csrc/cpu/tree_attention_loops.h) exist as AVX-512 (fp32, and bf16 operand
// pairs with AVX512_BF16) and AVX2+FMA intrinsics, chosen per call from isa::current() (simd.h:
// avx512-bf16 the bf16 pairs, avx512-ymm and avx512 bf16 inputs widened to fp32), and as a
// portable scalar version, which also serves float64 and head dims not divisible by 16.
#include "simd.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "checks.h"
#include "ops.h"
#include "tree_attention_loops.h"

namespace eagle {
namespace {

constexpr int TK = 64;              // key positions per tile
constexpr int SPLIT_MIN_ROWS = 16;  // node blocks are not split below this many rows
constexpr int MAX_ROWS = 128;       // rows per work item (bounds the per-thread scratch)
constexpr double LOG2E = 1.4426950408889634;

using namespace tree_attention_loops;

// ------------------------------------------------------------------------------ kernel ops
template <typename T, typename Acc>
struct Ops {
  void (*qk)(const Acc* const*, int, const Acc*, int, int, Acc*) = qk_scalar<Acc>;
  void (*softmax)(Acc*, int, int, Acc*, Acc*, Acc*) = softmax_scalar<Acc>;
  void (*pv)(const Acc*, int, int, int, const Acc* const*, int, Acc*, const Acc*) = pv_scalar<Acc>;
  void (*to_acc)(const T*, Acc*, int) = to_acc_scalar<T, Acc>;
  // QK of work items with at most few_rows rows (a decoded token: one KV head's G rows): keys
  // in the vector lanes instead of padded rows (qk_few in tree_attention_blocks.inc), the same
  // scores bit for bit. 0: qk for every item.
  void (*qk_few)(const Acc* const*, int, const Acc*, int, int, int, Acc*) = nullptr;
  int few_rows = 0;
  // bf16 inputs with AVX512_BF16: QK, softmax and PV from the bf16 operand-pair loops
  // (tree_attention_loops.h) instead of the loops above.
  bool bf16_pairs = false;
  // Rows are padded to a multiple of this: one float vector of the chosen loops (a decoded
  // token of a 3-query-head group is 3 rows of 16 lanes: qk_few computes its QK without the
  // padding; the softmax still runs over the padded lanes).
  int row_pad = 8;
  // Rows of a work item rounded up to row_pad: the scratch is sized and indexed with this.
  int64_t padded_rows(int64_t rows) const { return (rows + row_pad - 1) / row_pad * row_pad; }
};

template <typename T, typename Acc>
Ops<T, Acc> pick_ops(int64_t D) {
  Ops<T, Acc> ops;
#if EAGLE_X86_SIMD
  const isa::Level level = isa::current();
  if constexpr (std::is_same_v<Acc, float>) {
    if (level >= isa::Level::kAvx512Ymm && D % 16 == 0) {
      ops.qk = qk_avx512;
      ops.softmax = softmax_avx512;
      ops.pv = pv_avx512;
      ops.row_pad = 16;
      // At 16 lanes a block of 16 keys x 16 steps costs 80 loads and shuffles + 16 R multiply-adds
      // with keys in the lanes, 256 multiply-adds with rows in the lanes (up to 16 rows).
      ops.qk_few = qk_few_avx512;
      ops.few_rows = 8;
      if constexpr (!std::is_same_v<T, float>) ops.to_acc = to_float_avx512<T>;
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        ops.bf16_pairs = level >= isa::Level::kAvx512Bf16;
        // The pair loops transpose 16 pairs (32 values of d) at a time.
        if (ops.bf16_pairs && D % 32 != 0) ops.few_rows = 0;
      }
    } else if (level >= isa::Level::kAvx2 && D % 16 == 0) {
      ops.qk = qk_avx2;
      ops.softmax = softmax_avx2;
      ops.pv = pv_avx2;
      // 8 x 8 blocks: 32 loads and shuffles + 16 R broadcasts and FMAs, against 128 (up to 8 rows).
      ops.qk_few = qk_few_avx2;
      ops.few_rows = 4;
      if constexpr (!std::is_same_v<T, float>) ops.to_acc = to_float_avx2<T>;
    }
  }
#endif
  return ops;
}

// ---------------------------------------------------------------------------------- launcher
struct Cache {
  const char* base;
  int64_t s_outer, s_pos, s_head;  // bytes
};

struct Problem {
  int64_t B, N, Hq, Hkv, G, D;
  int64_t W;          // mask words per row
  int64_t page_size;  // paged only
  int64_t max_pages;
  bool paged, causal;
  double scale_log2;         // sm_scale * log2(e)
  const char* q;             // [B, N, Hq, D], dense head dim
  int64_t q_sb, q_sn, q_sh;  // its strides (elements)
  Cache k, v;
  const int32_t* seqlens;
  const int32_t* block_table;  // [B, max_pages] or null
  const int64_t* mask;         // [B, N, W] or null
  char* out;                   // [B, N, Hq, D] contiguous
  int64_t node_block;          // nodes per work item
};

template <typename T>
inline const T* cache_row(const Cache& c, const Problem& p, int64_t b, int64_t h, int64_t t) {
  int64_t outer = b, pos = t;
  if (p.paged) {
    outer = p.block_table[b * p.max_pages + t / p.page_size];
    pos = t % p.page_size;
  }
  return reinterpret_cast<const T*>(c.base + outer * c.s_outer + pos * c.s_pos + h * c.s_head);
}

template <typename T, typename Acc>
struct Scratch {
  std::vector<Acc> Qt, St, acc, m, l, alpha, kbuf, vbuf;
  std::vector<const Acc*> krows, vrows;
  std::vector<uint16_t> Qp, Pp, Vp;         // bf16 operand pairs (Ops::bf16_pairs)
  std::vector<const uint16_t*> kraw, vraw;  // bf16 rows as stored (Ops::bf16_pairs)
  std::vector<int64_t> tree_slots;          // the item's tree slots by (depth, slot)
  std::vector<int64_t> slot_depth;          // depth of each tree slot
  std::vector<int64_t> key_slot;            // a tile's keys: tree slot, or -1 for a prefix key
  // keys: the most keys a tile holds (TK + N).
  Scratch(int64_t Rp, int64_t D, int64_t keys, bool bf16_pairs) {
    if (bf16_pairs) {
      Qp.resize(Rp * D);
      Pp.resize((keys + 1) * Rp);
      Vp.resize((keys + 1) * D);
      kraw.resize(keys);
      vraw.resize(keys);
    } else {
      Qt.resize(Rp * D);
      if (!std::is_same_v<T, Acc>) {
        kbuf.resize(keys * D);
        vbuf.resize(keys * D);
      }
      krows.resize(keys);
      vrows.resize(keys);
    }
    key_slot.resize(keys);
    St.resize(keys * Rp);
    acc.resize(Rp * D);
    m.resize(Rp);
    l.resize(Rp);
    alpha.resize(Rp);
  }
};

// The bf16-pair tile steps (the softmax writes its probabilities as bf16 pairs); only bf16
// inputs with float accumulation reach them.
template <typename T, typename Acc>
void qk_pairs(Scratch<T, Acc>& s, int nk, int D, int Rp, int R, bool few, float scale) {
#if EAGLE_X86_SIMD
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<Acc, float>) {
    if (few) {
      qk_few_bf16_pairs(s.kraw.data(), nk, s.Qp.data(), D, Rp, R, scale, s.St.data());
    } else {
      qk_bf16_pairs(s.kraw.data(), nk, s.Qp.data(), D, Rp, scale, s.St.data());
    }
    return;
  }
#endif
  TORCH_CHECK(false, "tree_attention: bf16 pair loops reached without bf16 inputs");
}

template <typename T, typename Acc>
void softmax_pv_pairs(Scratch<T, Acc>& s, int nk, int D, int Rp, int R) {
#if EAGLE_X86_SIMD
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<Acc, float>) {
    softmax_pack_bf16(s.St.data(), nk, Rp, s.m.data(), s.l.data(), s.alpha.data(), s.Pp.data());
    pack_values_bf16(s.vraw.data(), nk, D, s.Vp.data());
    pv_bf16_pairs(s.Pp.data(), (nk + 1) / 2, Rp, R, s.Vp.data(), D, s.acc.data(), s.alpha.data());
    return;
  }
#endif
  TORCH_CHECK(false, "tree_attention: bf16 pair loops reached without bf16 inputs");
}

template <typename T, typename Acc>
void run_item(const Problem& p, const Ops<T, Acc>& ops, Scratch<T, Acc>& s, int64_t item) {
  const int64_t blocks = (p.N + p.node_block - 1) / p.node_block;
  const int64_t nb_idx = item % blocks;
  const int64_t h = (item / blocks) % p.Hkv;
  const int64_t b = item / (blocks * p.Hkv);
  const int64_t n0 = nb_idx * p.node_block;
  const int64_t n1 = std::min(p.N, n0 + p.node_block);
  const int R = static_cast<int>((n1 - n0) * p.G);
  const int Rp = static_cast<int>(ops.padded_rows(R));
  const int D = static_cast<int>(p.D);
  const bool few = R <= ops.few_rows;
  const int64_t prefix = p.seqlens[b];
  const Acc ninf = -std::numeric_limits<Acc>::infinity();

  // Qt[d][r], r = (node - n0) * G + g, pre-scaled; padding rows are zero.
  // With bf16 pairs: Qp[d / 2][r][d % 2], the bf16 bits unscaled (the scale goes on the scores).
  const T* q = reinterpret_cast<const T*>(p.q);
  if (ops.bf16_pairs) {
    std::fill(s.Qp.begin(), s.Qp.begin() + static_cast<int64_t>(Rp) * D, uint16_t{0});
  } else {
    std::fill(s.Qt.begin(), s.Qt.begin() + static_cast<int64_t>(Rp) * D, Acc(0));
  }
  const Acc q_scale = static_cast<Acc>(p.scale_log2);
  for (int r = 0; r < R; ++r) {
    const int64_t i = n0 + r / p.G;
    const int64_t head = h * p.G + r % p.G;
    const T* qr = q + b * p.q_sb + i * p.q_sn + head * p.q_sh;
    if (ops.bf16_pairs) {
      uint16_t* dst = s.Qp.data() + static_cast<int64_t>(r) * 2;
      for (int d = 0; d < D; ++d)
        std::memcpy(dst + static_cast<int64_t>(d / 2) * Rp * 2 + d % 2, qr + d, sizeof(uint16_t));
    } else {
      Acc* dst = s.Qt.data() + r;
      for (int d = 0; d < D; ++d) dst[static_cast<int64_t>(d) * Rp] = static_cast<Acc>(qr[d]) * q_scale;
    }
  }
  std::fill(s.acc.begin(), s.acc.begin() + static_cast<int64_t>(R) * D, Acc(0));
  std::fill(s.m.begin(), s.m.begin() + Rp, ninf);
  std::fill(s.l.begin(), s.l.begin() + Rp, Acc(0));

  // Tree slots j <= i only (ancestors precede their descendants), so no row of this block
  // sees a slot past n1 - 1. Those slots by (depth, slot): a counting sort by depth.
  s.slot_depth.assign(n1, 0);
  int64_t max_depth = 0;
  for (int64_t j = 0; j < n1; ++j) {
    int64_t bits = 0;
    if (p.causal) {
      bits = j + 1;
    } else {
      const int64_t* words = p.mask + (b * p.N + j) * p.W;
      for (int64_t w = 0; w < p.W; ++w) bits += __builtin_popcountll(static_cast<uint64_t>(words[w]));
    }
    s.slot_depth[j] = std::max<int64_t>(0, bits - 1);
    max_depth = std::max(max_depth, s.slot_depth[j]);
  }
  s.tree_slots.clear();
  if (p.causal) {
    for (int64_t j = 0; j < n1; ++j) s.tree_slots.push_back(j);
  } else {
    std::vector<int64_t>& order = s.tree_slots;
    order.resize(n1);
    std::vector<int64_t> start(max_depth + 2, 0);
    for (int64_t j = 0; j < n1; ++j) ++start[s.slot_depth[j] + 1];
    for (int64_t d = 0; d <= max_depth; ++d) start[d + 1] += start[d];
    for (int64_t j = 0; j < n1; ++j) order[start[s.slot_depth[j]]++] = j;
  }
  const int64_t end = prefix + (n1 > 0 ? max_depth + 1 : 0);  // logical positions
  size_t next_slot = 0;
  for (int64_t t0 = 0; t0 < end; t0 += TK) {
    // The tile's keys: prefix positions [t0, t0 + TK), then the tree slots of those logical positions.
    int nk = 0;
    for (int64_t t = t0; t < std::min(t0 + TK, prefix); ++t) s.key_slot[nk++] = -1;
    const int prefix_keys = nk;
    while (next_slot < s.tree_slots.size() && prefix + s.slot_depth[s.tree_slots[next_slot]] < t0 + TK)
      s.key_slot[nk++] = s.tree_slots[next_slot++];
    if (nk == 0) continue;  // a mask that is not a tree can leave depths unused
    for (int k = 0; k < nk; ++k) {
      const int64_t position = k < prefix_keys ? t0 + k : prefix + s.key_slot[k];
      const T* kr = cache_row<T>(p.k, p, b, h, position);
      const T* vr = cache_row<T>(p.v, p, b, h, position);
      if constexpr (std::is_same_v<T, Acc>) {
        s.krows[k] = kr;
        s.vrows[k] = vr;
      } else if (ops.bf16_pairs) {
        s.kraw[k] = reinterpret_cast<const uint16_t*>(kr);
        s.vraw[k] = reinterpret_cast<const uint16_t*>(vr);
      } else {
        Acc* kd = s.kbuf.data() + static_cast<int64_t>(k) * D;
        Acc* vd = s.vbuf.data() + static_cast<int64_t>(k) * D;
        ops.to_acc(kr, kd, D);
        ops.to_acc(vr, vd, D);
        s.krows[k] = kd;
        s.vrows[k] = vd;
      }
    }
    // The next tile's K and V rows are fetched while this one computes: the hardware
    // prefetcher does not follow 2 x TK strided rows, and with few rows per item the loads
    // stall the FMAs (B 4, N 16, prefix 2048, 1 thread: 115 -> 149 GFLOP/s).
    const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
    for (int64_t t = t0 + TK; t < std::min(prefix, t0 + 2 * TK); ++t) {
      const char* kr = reinterpret_cast<const char*>(cache_row<T>(p.k, p, b, h, t));
      const char* vr = reinterpret_cast<const char*>(cache_row<T>(p.v, p, b, h, t));
      for (int64_t off = 0; off < row_bytes; off += 64) {
        __builtin_prefetch(kr + off, 0, 3);
        __builtin_prefetch(vr + off, 0, 3);
      }
    }
    if (ops.bf16_pairs) {
      qk_pairs(s, nk, D, Rp, R, few, static_cast<float>(p.scale_log2));
    } else if (few) {
      ops.qk_few(s.krows.data(), nk, s.Qt.data(), D, Rp, R, s.St.data());
    } else {
      ops.qk(s.krows.data(), nk, s.Qt.data(), D, Rp, s.St.data());
    }
    if (nk > prefix_keys) {  // the tile holds tree slots: apply the mask
      // Node by node (the G rows of a node share its mask row), slot by slot.
      for (int64_t i = n0; i < n1; ++i) {
        const int64_t* words = p.causal ? nullptr : p.mask + (b * p.N + i) * p.W;
        Acc* scores = s.St.data() + (i - n0) * p.G;
        for (int k = prefix_keys; k < nk; ++k) {
          const int64_t j = s.key_slot[k];
          const bool visible = p.causal ? j <= i : ((static_cast<uint64_t>(words[j >> 6]) >> (j & 63)) & 1u) != 0;
          if (visible) continue;
          for (int64_t g = 0; g < p.G; ++g) scores[static_cast<int64_t>(k) * Rp + g] = ninf;
        }
      }
    }
    if (ops.bf16_pairs) {
      softmax_pv_pairs(s, nk, D, Rp, R);
    } else {
      ops.softmax(s.St.data(), nk, Rp, s.m.data(), s.l.data(), s.alpha.data());
      ops.pv(s.St.data(), nk, Rp, R, s.vrows.data(), D, s.acc.data(), s.alpha.data());
    }
  }

  T* out = reinterpret_cast<T*>(p.out);
  for (int r = 0; r < R; ++r) {
    const int64_t i = n0 + r / p.G;
    const int64_t head = h * p.G + r % p.G;
    T* orow = out + ((b * p.N + i) * p.Hq + head) * p.D;
    // A row with no visible key (only possible with a mask lacking the node's own bit and an
    // empty prefix) outputs zeros rather than NaN.
    const Acc inv = s.l[r] > Acc(0) ? Acc(1) / s.l[r] : Acc(0);
    const Acc* a = s.acc.data() + static_cast<int64_t>(r) * D;
    for (int d = 0; d < D; ++d) orow[d] = static_cast<T>(a[d] * inv);
  }
}

template <typename T, typename Acc>
void run(const Problem& p) {
  const Ops<T, Acc> ops = pick_ops<T, Acc>(p.D);
  const int64_t blocks = (p.N + p.node_block - 1) / p.node_block;
  const int64_t items = p.B * p.Hkv * blocks;
  // Work of one item ~ rows * keys * D multiply-adds (x2 for QK and PV). Chunks of at least
  // 2^19 (tens of microseconds): short problems run inline, where waking a second thread costs
  // more than it saves, while one decoded token over a long prefix (3 items of ~2^17 per 1k
  // keys for SmolLM2) spreads over the threads: prefix 2048, 2 threads, 340 -> 210-255 us
  // (2^21 kept it on one thread up to ~5k keys).
  int64_t max_prefix = 0;
  for (int64_t b = 0; b < p.B; ++b) max_prefix = std::max<int64_t>(max_prefix, p.seqlens[b]);
  const int64_t item_work = std::max<int64_t>(1, p.node_block * p.G * (max_prefix + p.N) * p.D);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 19) / item_work);
  const int64_t Rp = ops.padded_rows(p.node_block * p.G);
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    Scratch<T, Acc> scratch(Rp, p.D, TK + p.N, ops.bf16_pairs);
    for (int64_t item = begin; item < end; ++item) run_item<T, Acc>(p, ops, scratch, item);
  });
}

// Nodes per work item: at most MAX_ROWS rows, small enough that the items keep every thread
// busy (each item re-reads the request's K/V for its KV head), and balanced across blocks.
int64_t choose_node_block(int64_t B, int64_t N, int64_t Hkv, int64_t G) {
  int64_t nb = std::max<int64_t>(1, std::min<int64_t>(N, MAX_ROWS / std::max<int64_t>(G, 1)));
  const int64_t threads = at::get_num_threads();
  while (nb > 1 && nb * G > SPLIT_MIN_ROWS && B * Hkv * ((N + nb - 1) / nb) < 2 * threads) { nb = (nb + 1) / 2; }
  // The same number of blocks, of equal size: with few items per thread, a short last block
  // (e.g. 42 + 18 nodes) leaves one thread idle for the difference.
  const int64_t blocks = (N + nb - 1) / nb;
  return (N + blocks - 1) / blocks;
}

void check_values(const Problem& p, int64_t capacity, int64_t num_pages) {
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t len = p.seqlens[b];
    TORCH_CHECK_VALUE(len >= 0, "tree_attention: cache_seqlens: expected non-negative lengths, got ", "cache_seqlens[",
                      b, "] = ", len);
    TORCH_CHECK_VALUE(len + p.N <= capacity, "tree_attention: cache_seqlens: expected cache_seqlens + N ",
                      "<= cache capacity ", capacity, ", got ", len + p.N, " for request ", b);
    if (!p.paged) continue;
    for (int64_t slot = 0; slot * p.page_size < len + p.N; ++slot) {
      const int64_t page = p.block_table[b * p.max_pages + slot];
      TORCH_CHECK_VALUE(page >= 0 && page < num_pages, "tree_attention: block_table: expected page ids in [0, ",
                        num_pages, ") for the pages in use, got block_table[", b, ", ", slot, "] = ", page);
    }
  }
}

}  // namespace

at::Tensor tree_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& tree_mask,
                              const std::optional<at::Tensor>& block_table, std::optional<double> sm_scale) {
  const char* op = "tree_attention";
  // Same order and wording as eagle_kernels/_checks.py::check_tree_attention.
  check_float_dtype(q_in, op, "q");
  check_dim(q_in, op, "q", 4, "[B, N, Hq, D]");
  const at::Device dev = q_in.device();
  TORCH_CHECK_VALUE(dev.is_cpu(), op, ": q: expected device cpu, got ", dev);
  const int64_t B = q_in.size(0), N = q_in.size(1), Hq = q_in.size(2), D = q_in.size(3);
  const bool paged = block_table.has_value();
  const char* layout = paged ? "[P, page_size, Hkv, D]" : "[B, S, Hkv, D]";
  check_dtype(k_cache, op, "k_cache", q_in.scalar_type());
  check_dim(k_cache, op, "k_cache", 4, layout);
  check_device(k_cache, op, "k_cache", dev);
  const int64_t max_pages = check_kv_cache_args(op, k_cache, v_cache, cache_seqlens, block_table, B, 0, layout, dev);
  const at::Tensor table = paged ? block_table->contiguous() : at::Tensor();
  const int64_t Hkv = k_cache.size(2);
  TORCH_CHECK_VALUE(Hkv > 0 && Hq % Hkv == 0, op, ": k_cache: expected a KV head count dividing Hq = ", Hq, ", got ",
                    Hkv);
  TORCH_CHECK_VALUE(k_cache.size(3) == D, op, ": k_cache: expected head dim ", D, " as in q, got ", k_cache.size(3));
  at::Tensor mask;
  if (tree_mask.has_value()) {
    check_dtype(*tree_mask, op, "tree_mask", at::kLong);
    check_shape(*tree_mask, op, "tree_mask", {B, N, (N + 63) / 64}, "[B, N, ceil(N / 64)]");
    check_device(*tree_mask, op, "tree_mask", dev);
    mask = tree_mask->contiguous();
  }
  TORCH_CHECK_VALUE(!sm_scale.has_value() || std::isfinite(*sm_scale), op, ": sm_scale: expected a finite number, got ",
                    sm_scale.has_value() ? *sm_scale : 0.0);
  check_dense_head_dim(op, k_cache, v_cache);

  // q is read in place when its head dim is dense (e.g. the query columns of a fused q/k/v projection).
  const at::Tensor q = q_in.stride(3) == 1 ? q_in : q_in.contiguous();
  const at::Tensor seqlens = cache_seqlens.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options());

  Problem p;
  p.B = B;
  p.N = N;
  p.Hq = Hq;
  p.Hkv = Hkv;
  p.G = Hq / Hkv;
  p.D = D;
  p.W = (N + 63) / 64;
  p.paged = paged;
  p.page_size = paged ? k_cache.size(1) : 0;
  p.max_pages = max_pages;
  p.causal = !tree_mask.has_value();
  p.scale_log2 = (sm_scale.has_value() ? *sm_scale : 1.0 / std::sqrt(static_cast<double>(D))) * LOG2E;
  p.q = static_cast<const char*>(q.data_ptr());
  p.q_sb = q.stride(0);
  p.q_sn = q.stride(1);
  p.q_sh = q.stride(2);
  const int64_t es = static_cast<int64_t>(k_cache.element_size());
  p.k = {static_cast<const char*>(k_cache.data_ptr()), k_cache.stride(0) * es, k_cache.stride(1) * es,
         k_cache.stride(2) * es};
  p.v = {static_cast<const char*>(v_cache.data_ptr()), v_cache.stride(0) * es, v_cache.stride(1) * es,
         v_cache.stride(2) * es};
  p.seqlens = seqlens.data_ptr<int32_t>();
  p.block_table = paged ? table.data_ptr<int32_t>() : nullptr;
  p.mask = tree_mask.has_value() ? mask.data_ptr<int64_t>() : nullptr;
  p.out = static_cast<char*>(out.data_ptr());
  const int64_t capacity = paged ? max_pages * k_cache.size(1) : k_cache.size(1);
  check_values(p, capacity, paged ? k_cache.size(0) : 0);
  if (out.numel() == 0) return out;
  p.node_block = choose_node_block(B, N, Hkv, p.G);

  switch (q.scalar_type()) {
    case at::kFloat:
      run<float, float>(p);
      break;
    case at::kHalf:
      run<c10::Half, float>(p);
      break;
    case at::kBFloat16:
      run<c10::BFloat16, float>(p);
      break;
    case at::kDouble:
      run<double, double>(p);
      break;
    default:
      TORCH_CHECK_VALUE(false, op, ": q: unsupported dtype ", q.scalar_type());
  }
  return out;
}

}  // namespace eagle
