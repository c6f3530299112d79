// compact_kv core: move the accepted path's K/V rows next to the committed prefix.
//
// For 1 <= j <= accept_len[b] the row at logical position seqlen + accept_nodes[b, j] moves to
// seqlen + j, for every layer and KV head, in K and V. Sources and destinations overlap (path
// 0 -> 2 -> 3 moves 2 -> 1, then 3 -> 2). Because accept_nodes is strictly increasing along the
// path, accept_nodes[j] >= j, so each source is read before any later step overwrites it: one
// worker per (layer, request, head) runs j in increasing order, and lanes inside a worker split
// the row into words (word w of a destination only ever comes from word w of a source, so a
// lane needs no synchronisation with the others).
//
// Dtype-agnostic: rows are copied as raw words of 1, 2, 4, 8 or 16 bytes (pick_word_bytes).
#pragma once

#include "core/common.h"

namespace eagle {
namespace compact_kv {

// One cache tensor: base pointer and strides in bytes. For a contiguous cache [L, B, S, H, D]
// `outer` is the request dim and `pos` the sequence dim; for a paged cache [L, P, ps, H, D]
// `outer` is the page dim and `pos` the row within a page. No layer dim: stride_layer = 0.
struct CacheView {
  char* base;
  int64_t stride_layer;
  int64_t stride_outer;
  int64_t stride_pos;
  int64_t stride_head;
};

struct Params {
  CacheView k;
  CacheView v;
  int64_t num_layers;  // 1 without a layer dim
  int64_t batch;
  int64_t num_heads;
  int64_t row_bytes;  // D * element size (the D dim is dense)
  int64_t seq_len;    // contiguous: S; paged: page_size
  bool paged;
  int64_t num_pages;           // paged only: P
  const int32_t* block_table;  // paged only: [B, max_pages], dense
  int64_t max_pages;
  const int32_t* cache_seqlens;  // [B]
  const int32_t* accept_nodes;   // [B, A], dense
  int64_t accept_width;          // A
  const int32_t* accept_len;     // [B]
};

struct alignas(16) Word16 {
  uint64_t lo, hi;
};

template <int kBytes>
struct WordOf;
template <>
struct WordOf<1> {
  using type = uint8_t;
};
template <>
struct WordOf<2> {
  using type = uint16_t;
};
template <>
struct WordOf<4> {
  using type = uint32_t;
};
template <>
struct WordOf<8> {
  using type = uint64_t;
};
template <>
struct WordOf<16> {
  using type = Word16;
};

// Largest word size (<= 16) dividing every value: row size, strides and base addresses.
HOST_DEVICE inline int pick_word_bytes(const int64_t* values, int n) {
  int bytes = 16;
  for (int i = 0; i < n; ++i)
    while (bytes > 1 && values[i] % bytes != 0) bytes >>= 1;
  return bytes;
}

// Where logical position t of request b lives: (outer index, pos index), or false when it is
// outside the cache (only possible for unvalidated input: the CUDA path does not read values
// on the host, so it skips such rows instead of faulting).
HOST_DEVICE inline bool locate(const Params& p, int64_t b, int64_t t, int64_t* outer, int64_t* pos) {
  if (t < 0) return false;
  if (!p.paged) {
    if (t >= p.seq_len) return false;
    *outer = b;
    *pos = t;
    return true;
  }
  const int64_t slot = t / p.seq_len;
  if (slot >= p.max_pages) return false;
  const int64_t page = p.block_table[b * p.max_pages + slot];
  if (page < 0 || page >= p.num_pages) return false;
  *outer = page;
  *pos = t % p.seq_len;
  return true;
}

HOST_DEVICE inline char* row_ptr(const CacheView& v, int64_t layer, int64_t outer, int64_t pos, int64_t head) {
  return v.base + layer * v.stride_layer + outer * v.stride_outer + pos * v.stride_pos + head * v.stride_head;
}

// Worker (layer, b, head), lane `lane` of `num_lanes`: copies words lane, lane + num_lanes, ...
// of every moved row, for j ascending.
template <typename Word>
HOST_DEVICE inline void compact_worker(const Params& p, int64_t layer, int64_t b, int64_t head, int64_t lane,
                                       int64_t num_lanes) {
  int64_t len = p.accept_len[b];
  if (len > p.accept_width - 1) len = p.accept_width - 1;
  const int64_t base = p.cache_seqlens[b];
  const int32_t* nodes = p.accept_nodes + b * p.accept_width;
  const int64_t n_words = p.row_bytes / static_cast<int64_t>(sizeof(Word));
  for (int64_t j = 1; j <= len; ++j) {
    const int64_t node = nodes[j];
    if (node == j) continue;
    int64_t so, sp, dout, dp;
    if (!locate(p, b, base + node, &so, &sp) || !locate(p, b, base + j, &dout, &dp)) continue;
    const Word* ks = reinterpret_cast<const Word*>(row_ptr(p.k, layer, so, sp, head));
    Word* kd = reinterpret_cast<Word*>(row_ptr(p.k, layer, dout, dp, head));
    const Word* vs = reinterpret_cast<const Word*>(row_ptr(p.v, layer, so, sp, head));
    Word* vd = reinterpret_cast<Word*>(row_ptr(p.v, layer, dout, dp, head));
    for (int64_t w = lane; w < n_words; w += num_lanes) {
      kd[w] = ks[w];
      vd[w] = vs[w];
    }
  }
}

HOST_DEVICE inline int64_t num_workers(const Params& p) { return p.num_layers * p.batch * p.num_heads; }

// Worker index -> (layer, b, head), head fastest so neighbouring workers touch neighbouring
// memory.
template <typename Word>
HOST_DEVICE inline void run_worker(const Params& p, int64_t worker, int64_t lane, int64_t num_lanes) {
  const int64_t head = worker % p.num_heads;
  const int64_t rest = worker / p.num_heads;
  const int64_t b = rest % p.batch;
  const int64_t layer = rest / p.batch;
  compact_worker<Word>(p, layer, b, head, lane, num_lanes);
}

}  // namespace compact_kv
}  // namespace eagle
