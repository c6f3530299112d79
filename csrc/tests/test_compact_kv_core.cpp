// Unit tests of the torch-free compact_kv core (csrc/core/compact_kv.h): overlapping moves,
// paged addressing, the leading layer dim, word sizes and lane splitting.
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "core/compact_kv.h"
#include "tests/check.h"

namespace kv = eagle::compact_kv;

namespace {

// A float cache [L, outer, pos, H, D] filled with distinct values, plus the Params plumbing.
struct Cache {
  int64_t L, outer, pos, H, D;
  std::vector<float> k, v;
  Cache(int64_t L_, int64_t outer_, int64_t pos_, int64_t H_, int64_t D_)
      : L(L_), outer(outer_), pos(pos_), H(H_), D(D_), k(L_ * outer_ * pos_ * H_ * D_), v(k.size()) {
    std::iota(k.begin(), k.end(), 0.f);
    std::iota(v.begin(), v.end(), 1e6f);
  }
  int64_t index(int64_t l, int64_t o, int64_t p, int64_t h, int64_t d) const {
    return (((l * outer + o) * pos + p) * H + h) * D + d;
  }
  kv::CacheView view(std::vector<float>& data) const {
    const int64_t e = sizeof(float);
    return {reinterpret_cast<char*>(data.data()), outer * pos * H * D * e, pos * H * D * e, H * D * e, D * e};
  }
};

struct Batch {
  std::vector<int32_t> seqlens, nodes, lens, table;
  int64_t A, max_pages;
};

kv::Params make_params(Cache& c, const Batch& bt, int64_t B, bool paged) {
  kv::Params p{};
  p.k = c.view(c.k);
  p.v = c.view(c.v);
  p.num_layers = c.L;
  p.batch = B;
  p.num_heads = c.H;
  p.row_bytes = c.D * static_cast<int64_t>(sizeof(float));
  p.seq_len = c.pos;
  p.paged = paged;
  p.num_pages = paged ? c.outer : 0;
  p.block_table = paged ? bt.table.data() : nullptr;
  p.max_pages = bt.max_pages;
  p.cache_seqlens = bt.seqlens.data();
  p.accept_nodes = bt.nodes.data();
  p.accept_width = bt.A;
  p.accept_len = bt.lens.data();
  return p;
}

template <typename Word>
void run_all(const kv::Params& p, int64_t lanes) {
  // Lanes of one worker are independent, so running them one after another must match.
  for (int64_t w = 0; w < kv::num_workers(p); ++w)
    for (int64_t lane = 0; lane < lanes; ++lane) kv::run_worker<Word>(p, w, lane, lanes);
}

// Expected result, computed from a snapshot of the old cache (no overlap hazards).
void expect_moves(Cache& c, const std::vector<float>& old_k, const std::vector<float>& old_v, const Batch& bt,
                  int64_t B, bool paged, std::vector<float>* ek, std::vector<float>* ev) {
  *ek = old_k;
  *ev = old_v;
  auto loc = [&](int64_t b, int64_t t, int64_t* o, int64_t* p) {
    if (!paged) {
      *o = b;
      *p = t;
      return;
    }
    *o = bt.table[b * bt.max_pages + t / c.pos];
    *p = t % c.pos;
  };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 1; j <= bt.lens[b]; ++j) {
      int64_t so, sp, dout, dp;
      loc(b, bt.seqlens[b] + bt.nodes[b * bt.A + j], &so, &sp);
      loc(b, bt.seqlens[b] + j, &dout, &dp);
      for (int64_t l = 0; l < c.L; ++l)
        for (int64_t h = 0; h < c.H; ++h)
          for (int64_t d = 0; d < c.D; ++d) {
            (*ek)[c.index(l, dout, dp, h, d)] = old_k[c.index(l, so, sp, h, d)];
            (*ev)[c.index(l, dout, dp, h, d)] = old_v[c.index(l, so, sp, h, d)];
          }
    }
}

template <typename Word>
void check_case(int64_t L, int64_t B, bool paged, int64_t lanes) {
  // Request 0: path 0 -> 2 -> 3 (moves 2 -> 1, then 3 -> 2: overlapping).
  // Request 1: path 0 -> 1 -> 4 -> 6 -> 7 (1 stays; 4 -> 2, 6 -> 3, 7 -> 4).
  // Request 2 (if any): accept_len 0, nothing moves.
  Batch bt;
  bt.A = 5;
  bt.seqlens = {3, 6, 2};
  bt.nodes = {0, 2, 3, -1, -1, 0, 1, 4, 6, 7, 0, -1, -1, -1, -1};
  bt.lens = {2, 4, 0};
  const int64_t page = 4, S = 16;
  int64_t outer = B, pos = S;
  if (paged) {
    // 4 pages of 4 rows per request, shuffled over 3 * 4 = 12 physical pages.
    bt.max_pages = 4;
    bt.table = {7, 2, 11, 0, 5, 9, 1, 4, 3, 10, 6, 8};
    outer = 12;
    pos = page;
  } else {
    bt.max_pages = 0;
  }
  Cache c(L, outer, pos, 2, 4);
  const std::vector<float> old_k = c.k, old_v = c.v;
  std::vector<float> ek, ev;
  expect_moves(c, old_k, old_v, bt, B, paged, &ek, &ev);
  run_all<Word>(make_params(c, bt, B, paged), lanes);
  EXPECT(c.k == ek);
  EXPECT(c.v == ev);
  EXPECT(c.k != old_k);  // something moved
}

void test_contiguous_overlap() {
  check_case<uint32_t>(1, 3, false, 1);
  check_case<uint32_t>(3, 3, false, 1);
}

void test_paged_shuffled() {
  check_case<uint32_t>(1, 3, true, 1);
  check_case<uint32_t>(2, 3, true, 1);
}

void test_word_sizes_and_lanes() {
  for (bool paged : {false, true}) {
    check_case<uint8_t>(2, 3, paged, 1);
    check_case<uint16_t>(2, 3, paged, 3);
    check_case<uint64_t>(2, 3, paged, 2);
    check_case<kv::Word16>(2, 3, paged, 1);
    check_case<uint8_t>(1, 2, paged, 16);  // more lanes than words
  }
}

void test_pick_word_bytes() {
  const int64_t a[] = {256, 512, 0};
  EXPECT_EQ(kv::pick_word_bytes(a, 3), 16);
  const int64_t b[] = {24, 48};
  EXPECT_EQ(kv::pick_word_bytes(b, 2), 8);
  const int64_t c[] = {256, 6};
  EXPECT_EQ(kv::pick_word_bytes(c, 2), 2);
  const int64_t d[] = {3};
  EXPECT_EQ(kv::pick_word_bytes(d, 1), 1);
}

void test_out_of_range_rows_skipped() {
  // Destination/source beyond S (contiguous) or an invalid page id: skipped, no access.
  Batch bt;
  bt.A = 3;
  bt.seqlens = {14};
  bt.nodes = {0, 1, 5};  // source 14 + 5 = 19 >= S = 16
  bt.lens = {2};
  bt.max_pages = 0;
  Cache c(1, 1, 16, 1, 2);
  const std::vector<float> old_k = c.k;
  run_all<uint32_t>(make_params(c, bt, 1, false), 1);
  EXPECT(c.k == old_k);

  Batch pb;
  pb.A = 2;
  pb.seqlens = {0};
  pb.nodes = {0, 2};
  pb.lens = {1};
  pb.max_pages = 1;
  pb.table = {-1};
  Cache pc(1, 2, 4, 1, 2);
  const std::vector<float> old_pk = pc.k;
  run_all<uint32_t>(make_params(pc, pb, 1, true), 1);
  EXPECT(pc.k == old_pk);
  int64_t o = -1, p = -1;
  const kv::Params params = make_params(pc, pb, 1, true);
  EXPECT(!kv::locate(params, 0, 1, &o, &p));
  EXPECT(!kv::locate(params, 0, 4, &o, &p));  // past max_pages * page_size
}

}  // namespace

int main() {
  RUN(test_contiguous_overlap);
  RUN(test_paged_shuffled);
  RUN(test_word_sizes_and_lanes);
  RUN(test_pick_word_bytes);
  RUN(test_out_of_range_rows_skipped);
  TEST_MAIN_END();
}
