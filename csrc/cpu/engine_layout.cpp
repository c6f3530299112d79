// The engines' verify calls on CPU (SGLang's EAGLE tree verify, vLLM's chain rejection sampler), with the layout
// conversion native and fused with our verify (docs/serving.md "Conversion cost"). The torch reference is the adapter's
// own tensor path (eagle_kernels/integrations/sglang.py with eagle_kernels/integrations/_layout.py): these ops compute
// the same trees, the same verify inputs and the same outputs, read on the host (CPU tensors), in one call instead of
// ~30 small tensor ops.
//
// SGLang's layout: node i of request b is row b * N + i of the flattened verify batch;
// retrieve_next_token[b, i] is the first child of i and retrieve_next_sibling[b, i] the next
// sibling (-1: none); node 0 is the root. Our verify needs parents before children: the nodes
// keep their indices when every node's parent has a smaller index (SGLang's own build), else they
// are ordered by depth, then index.
//
// The schemas are defined here (a fragment of the library, CPU kernels only) and copied in
// eagle_kernels/_schemas.py ENGINE_SCHEMAS; the adapters call them for CPU tensors only, and run
// their tensor path on other devices.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/log.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "checks.h"
#include "ops.h"

namespace eagle {
namespace {

void check_index_tensor(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, op, ": ", name,
                    ": expected dtype int32 or int64, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": ", name, ": expected a CPU tensor, got one on ", t.device());
}

at::Tensor as_long(const at::Tensor& t) {
  return t.scalar_type() == at::kLong ? t.contiguous() : t.to(at::kLong).contiguous();
}

// Our verify kernel: every call of this file goes through here.
VerifyTensors run_verify(const at::Tensor& tokens, const at::Tensor& parents, const at::Tensor& logits,
                         int64_t max_depth, const std::optional<at::Tensor>& temperature = std::nullopt,
                         const std::optional<at::Tensor>& top_k = std::nullopt,
                         const std::optional<at::Tensor>& top_p = std::nullopt,
                         const std::optional<at::Tensor>& seed = std::nullopt,
                         const std::optional<at::Tensor>& offset = std::nullopt) {
  // The engines' drafts are deterministic: no draft distributions.
  return verify_cpu(tokens, parents, logits, max_depth, temperature, top_k, top_p, seed, offset, std::nullopt,
                    std::nullopt, std::nullopt, std::nullopt);
}

// Writes int values into an int32 / int64 tensor at a flat element offset (strided tensors).
struct IntOut {
  void* data;
  bool is_long;
  void set(int64_t at, int64_t v) const {
    if (is_long) {
      static_cast<int64_t*>(data)[at] = v;
    } else {
      static_cast<int32_t*>(data)[at] = static_cast<int32_t>(v);
    }
  }
};

IntOut int_out(const at::Tensor& t) { return {t.data_ptr(), t.scalar_type() == at::kLong}; }

// Reads a contiguous int32 / int64 tensor as int64 without a converted copy.
struct IntIn {
  at::Tensor t;  // keeps a contiguous copy alive when the input was not
  const void* data;
  bool is_long;
  explicit IntIn(const at::Tensor& x) : t(x.contiguous()), data(t.data_ptr()), is_long(t.scalar_type() == at::kLong) {}
  int64_t operator[](int64_t i) const {
    return is_long ? static_cast<const int64_t*>(data)[i] : static_cast<const int32_t*>(data)[i];
  }
};

// The SGLang-side inputs shared by both verify calls, checked and read as int64.
struct LinkArgs {
  int64_t B, N, S;
  at::Tensor cand, retrieve, next_token, next_sibling;
};

LinkArgs check_links(const char* op, const at::Tensor& predicts, const at::Tensor& accept_index,
                     const at::Tensor& accept_token_num, const at::Tensor& candidates, const at::Tensor& retrieve_index,
                     const at::Tensor& retrieve_next_token, const at::Tensor& retrieve_next_sibling) {
  check_index_tensor(candidates, op, "candidates");
  check_dim(candidates, op, "candidates", 2, "[B, N]");
  const int64_t B = candidates.size(0), N = candidates.size(1);
  TORCH_CHECK_VALUE(N > 0, op, ": candidates: expected at least one node, got shape ", shape_str(candidates.sizes()));
  check_index_tensor(predicts, op, "predicts");
  check_dim(predicts, op, "predicts", 1, "[B * N]");
  TORCH_CHECK_VALUE(predicts.numel() >= B * N, op, ": predicts: expected at least ", B * N, " entries, got ",
                    predicts.numel());
  check_index_tensor(accept_index, op, "accept_index");
  check_dim(accept_index, op, "accept_index", 2, "[B, depth + 1]");
  TORCH_CHECK_VALUE(accept_index.size(0) == B && accept_index.size(1) >= 1, op, ": accept_index: expected shape (", B,
                    ", depth + 1), got ", shape_str(accept_index.sizes()));
  check_index_tensor(accept_token_num, op, "accept_token_num");
  check_shape(accept_token_num, op, "accept_token_num", {B}, "[B]");
  const char* names[3] = {"retrieve_index", "retrieve_next_token", "retrieve_next_sibling"};
  const at::Tensor* links[3] = {&retrieve_index, &retrieve_next_token, &retrieve_next_sibling};
  for (int i = 0; i < 3; ++i) {
    check_index_tensor(*links[i], op, names[i]);
    check_shape(*links[i], op, names[i], {B, N}, "[B, N]");
  }
  return {B,
          N,
          accept_index.size(1),
          as_long(candidates),
          as_long(retrieve_index),
          as_long(retrieve_next_token),
          as_long(retrieve_next_sibling)};
}

// The trees of a batch from their links, as _layout.parents_from_links and _layout.verify_order
// compute them (flat [B * N] arrays): parent (-1: the root, or no link reaches the node), rank in
// the sibling chain, and the verify order (order[k]: the node at new index k) with the parents in
// new indices. One pass over each node's child chain; a node already placed ends a chain, so
// malformed (cyclic) links terminate.
struct Trees {
  std::vector<int64_t> parent, rank, order;
  std::vector<int32_t> new_parent;
  bool identity = true;  // every request kept its own node order

  Trees(const int64_t* nt, const int64_t* ns, int64_t B, int64_t N)
      : parent(B * N, -1), rank(B * N, 0), order(B * N), new_parent(B * N) {
    std::vector<int64_t> depth, inverse;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t* nt_b = nt + b * N;
      const int64_t* ns_b = ns + b * N;
      int64_t* par = parent.data() + b * N;
      int64_t* rk = rank.data() + b * N;
      bool in_order = true;
      for (int64_t u = 0; u < N; ++u) {
        int64_t r = 0;
        for (int64_t c = nt_b[u]; c > 0 && c < N && par[c] < 0; c = ns_b[c]) {
          par[c] = u;
          rk[c] = r++;
          in_order &= u < c;
        }
      }
      int64_t* ord = order.data() + b * N;
      int32_t* np = new_parent.data() + b * N;
      std::iota(ord, ord + N, int64_t{0});
      np[0] = -1;
      if (in_order) {  // unreached nodes: children of the root
        for (int64_t c = 1; c < N; ++c) np[c] = static_cast<int32_t>(par[c] >= 0 ? par[c] : 0);
        continue;
      }
      identity = false;
      // By depth, then index; unreached nodes at depth 1.
      depth.assign(N, 0);
      inverse.resize(N);
      for (int64_t c = 1; c < N; ++c) {
        int64_t d = 0;
        for (int64_t x = c, step = 0; x != 0 && step <= N; ++step, ++d) x = par[x] >= 0 ? par[x] : 0;
        depth[c] = d;
      }
      std::stable_sort(ord, ord + N, [&](int64_t x, int64_t y) { return depth[x] < depth[y]; });
      for (int64_t k = 0; k < N; ++k) inverse[ord[k]] = k;
      for (int64_t k = 1; k < N; ++k) {
        const int64_t p = par[ord[k]];
        np[k] = static_cast<int32_t>(inverse[p >= 0 ? p : 0]);
      }
    }
  }
};

// SGLang's outputs from verify's (order[b * M + k]: SGLang's node at verify index k of request b): accept_index holds
// the flat row (retrieve_index) of each accepted node, predicts[row] the token that follows that node, accept_token_num
// the count.
void write_results(const LinkArgs& a, const at::Tensor& predicts, const at::Tensor& accept_index,
                   const at::Tensor& accept_token_num, const int64_t* order, int64_t M, const at::Tensor& accept_len,
                   const at::Tensor& accept_nodes, const int64_t* emitted) {
  const int64_t B = a.B, N = a.N, S = a.S;
  const IntOut pred = int_out(predicts), index = int_out(accept_index), count = int_out(accept_token_num);
  const int64_t ps = predicts.stride(0), is0 = accept_index.stride(0), is1 = accept_index.stride(1);
  const int64_t cs = accept_token_num.stride(0);
  const int32_t* nodes = accept_nodes.data_ptr<int32_t>();
  const int32_t* len = accept_len.data_ptr<int32_t>();
  const int64_t* ri = a.retrieve.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t k = 0; k < S; ++k) {
      const int32_t node = nodes[b * S + k];
      if (node < 0) {
        index.set(b * is0 + k * is1, -1);
        continue;
      }
      const int64_t row = ri[b * N + order[b * M + node]];
      index.set(b * is0 + k * is1, row);
      pred.set(row * ps, emitted[b * S + k]);
    }
    count.set(b * cs, len[b]);
  }
}

// verify's inputs for SGLang's greedy walk, over the nodes that walk looks at only: the root, and
// the children of each node it accepts (SGLang's kernel looks at no other node; one-hot rows for
// every node made the conversion ~60% of the call at bs 32 N 64). The walk is made here from the
// links, as SGLang's kernel walks them: from the root, at most `max_depth` times, the first child
// in sibling order whose draft is the target's token at the current node. In verify's inputs over
// 3 classes, the child the walk takes has token 1, every other node token 0, and each row is
// one-hot at 1 (go on to the child with token 1) or at 2 (stop: no child has it); padding nodes
// (requests that looked at fewer nodes) are leaves under the root with token 0, which no row
// selects. So verify's greedy walk is SGLang's for any sibling order, and the nodes keep parents
// before children. A node the walk already looked at ends a chain, so malformed (cyclic) links
// terminate.
// Per-thread scratch of the walk, reused between calls (no allocation per call once warm).
struct WalkScratch {
  std::vector<int64_t> node, count, emitted;
  std::vector<int32_t> par, next;
  std::vector<uint32_t> seen;  // the walk's stamp on the nodes it looked at
  uint32_t stamp = 0;
};

struct GreedyInputs {
  at::Tensor tokens, parents, logits;
  int64_t M = 1;   // verify's nodes per request
  WalkScratch* w;  // w->node[b * N + k]: SGLang's node at verify index k < w->count[b] of request b
};

GreedyInputs greedy_inputs(const LinkArgs& a, const int64_t* tp, int64_t max_depth) {
  constexpr int64_t V = 3;
  const int64_t B = a.B, N = a.N;
  const int64_t* cand = a.cand.data_ptr<int64_t>();
  const int64_t* nt = a.next_token.data_ptr<int64_t>();
  const int64_t* ns = a.next_sibling.data_ptr<int64_t>();
  // Per request, by verify index: SGLang's node, its verify parent, and the verify index of the
  // child its row selects (-1: the walk stops there).
  thread_local WalkScratch w;
  w.node.resize(B * N);
  w.par.resize(B * N);
  w.next.resize(B * N);
  w.count.resize(B);
  if (static_cast<int64_t>(w.seen.size()) < N || w.stamp > (1u << 31)) {
    w.seen.assign(std::max<size_t>(N, w.seen.size()), 0);
    w.stamp = 0;
  }
  for (int64_t b = 0; b < B; ++b) {
    int64_t* nd = w.node.data() + b * N;
    int32_t* pr = w.par.data() + b * N;
    int32_t* nx = w.next.data() + b * N;
    const int64_t* cand_b = cand + b * N;
    const int64_t* nt_b = nt + b * N;
    const int64_t* ns_b = ns + b * N;
    const uint32_t stamp = ++w.stamp;
    uint32_t* seen = w.seen.data();
    seen[0] = stamp;
    nd[0] = 0;
    pr[0] = -1;
    nx[0] = -1;
    int64_t m = 1;
    for (int64_t k = 0, depth = 0; depth < max_depth; ++depth) {  // k: verify index of the current node
      const int64_t want = tp[b * N + nd[k]];
      int32_t go = -1;
      for (int64_t c = nt_b[nd[k]]; c > 0 && c < N && seen[c] != stamp; c = ns_b[c]) {
        seen[c] = stamp;
        nd[m] = c;
        pr[m] = static_cast<int32_t>(k);
        nx[m] = -1;
        if (go < 0 && cand_b[c] == want) go = static_cast<int32_t>(m);
        ++m;
      }
      nx[k] = go;
      if (go < 0) break;
      k = go;
    }
    w.count[b] = m;
  }
  int64_t M = 1;
  for (int64_t b = 0; b < B; ++b) M = std::max(M, w.count[b]);
  const auto long_opts = a.cand.options().dtype(at::kLong);
  GreedyInputs in;
  in.M = M;
  in.tokens = at::empty({B, M}, long_opts);
  in.parents = at::empty({B, M}, long_opts.dtype(at::kInt));
  in.logits = at::empty({B, M, V}, long_opts.dtype(at::kFloat));
  in.w = &w;
  int64_t* tok = in.tokens.data_ptr<int64_t>();
  int32_t* vp = in.parents.data_ptr<int32_t>();
  float* lg = in.logits.data_ptr<float>();
  std::fill(tok, tok + B * M, 0);
  std::fill(vp, vp + B * M, 0);  // padding: leaves under the root with token 0 that stop
  for (int64_t i = 0; i < B * M; ++i) {
    lg[i * V] = 0.0f;
    lg[i * V + 1] = 0.0f;
    lg[i * V + 2] = 1.0f;
  }
  for (int64_t b = 0; b < B; ++b) {
    const int64_t m = w.count[b];
    const int32_t* pr = w.par.data() + b * N;
    const int32_t* nx = w.next.data() + b * N;
    for (int64_t k = 0; k < m; ++k) {
      vp[b * M + k] = pr[k];
      if (nx[k] >= 0) {
        tok[b * M + nx[k]] = 1;
        float* row = lg + (b * M + k) * V;
        row[1] = 1.0f;
        row[2] = 0.0f;
      }
    }
  }
  return in;
}

LinkArgs check_greedy(const char* op, const at::Tensor& predicts, const at::Tensor& accept_index,
                      const at::Tensor& accept_token_num, const at::Tensor& candidates,
                      const at::Tensor& retrieve_index, const at::Tensor& retrieve_next_token,
                      const at::Tensor& retrieve_next_sibling, const at::Tensor& target_predict, at::Tensor* target) {
  const LinkArgs a = check_links(op, predicts, accept_index, accept_token_num, candidates, retrieve_index,
                                 retrieve_next_token, retrieve_next_sibling);
  check_index_tensor(target_predict, op, "target_predict");
  TORCH_CHECK_VALUE(target_predict.dim() == 2 && target_predict.numel() == a.B * a.N, op, ": target_predict: expected ",
                    a.B * a.N, " entries [B, N], got shape ", shape_str(target_predict.sizes()));
  *target = as_long(target_predict);
  return a;
}

void sglang_verify_greedy_cpu(const at::Tensor& predicts, const at::Tensor& accept_index,
                              const at::Tensor& accept_token_num, const at::Tensor& candidates,
                              const at::Tensor& retrieve_index, const at::Tensor& retrieve_next_token,
                              const at::Tensor& retrieve_next_sibling, const at::Tensor& target_predict) {
  at::Tensor target;
  const LinkArgs a = check_greedy("sglang_verify_greedy", predicts, accept_index, accept_token_num, candidates,
                                  retrieve_index, retrieve_next_token, retrieve_next_sibling, target_predict, &target);
  const int64_t B = a.B, N = a.N, S = a.S;
  const int64_t* tp = target.data_ptr<int64_t>();
  const GreedyInputs in = greedy_inputs(a, tp, S - 1);
  const VerifyTensors out = run_verify(in.tokens, in.parents, in.logits, S - 1);
  // The token that follows each accepted node is the target's prediction at that node.
  const int64_t* order = in.w->node.data();
  std::vector<int64_t>& emitted = in.w->emitted;
  emitted.assign(B * S, 0);
  const int32_t* nodes = std::get<1>(out).data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t k = 0; k < S; ++k) {
      const int32_t node = nodes[b * S + k];
      if (node >= 0) emitted[b * S + k] = tp[b * N + order[b * N + node]];
    }
  }
  write_results(a, predicts, accept_index, accept_token_num, order, N, std::get<0>(out), std::get<1>(out),
                emitted.data());
}

// verify's inputs of sglang_verify_greedy, for tests and for timing verify alone on them (the walk
// at most max_depth deep, -1: unbounded): (tokens int64 [B, M], parents int32 [B, M], logits
// float32 [B, M, 3], order int64 [B, M] with -1 for padding), M <= N the most nodes looked at.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sglang_greedy_verify_inputs_cpu(
    const at::Tensor& candidates, const at::Tensor& retrieve_next_token, const at::Tensor& retrieve_next_sibling,
    const at::Tensor& target_predict, int64_t max_depth) {
  const int64_t B = candidates.dim() == 2 ? candidates.size(0) : 0, N = candidates.dim() == 2 ? candidates.size(1) : 0;
  const at::Tensor predicts = at::empty({B * N}, candidates.options().dtype(at::kLong));
  const at::Tensor accept_index = at::empty({B, 1}, candidates.options().dtype(at::kLong));
  const at::Tensor accept_num = at::empty({B}, candidates.options().dtype(at::kLong));
  at::Tensor target;
  const LinkArgs a =
      check_greedy("sglang_greedy_verify_inputs", predicts, accept_index, accept_num, candidates, retrieve_next_token,
                   retrieve_next_token, retrieve_next_sibling, target_predict, &target);
  GreedyInputs in = greedy_inputs(a, target.data_ptr<int64_t>(), max_depth >= 0 ? max_depth : N);
  at::Tensor order = at::full({B, in.M}, -1, candidates.options().dtype(at::kLong));
  for (int64_t b = 0; b < B; ++b) {
    std::copy_n(in.w->node.data() + b * N, in.w->count[b], order.data_ptr<int64_t>() + b * in.M);
  }
  return {in.tokens, in.parents, in.logits, order};
}

// The bits of a float32 coin, as _stream_from_coins reads them.
int64_t coin_bits(const at::Tensor& coins, int64_t at) {
  const float x = coins.scalar_type() == at::kDouble ? static_cast<float>(coins.data_ptr<double>()[at])
                                                     : coins.data_ptr<float>()[at];
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return static_cast<int64_t>(u);
}

// The sampling verify from SGLang's target probabilities (their logarithm is verify's logits,
// temperature 1: one pass over [B * N, V]), or, with `logits_source`, from the logits those
// probabilities were computed from (softmax(logits / temperature), then top-k / top-p renorm), read
// in place with the per-request temperature / top-k / top-p (rows b * N of SGLang's per-row
// tensors): the same law (docs/ops.md §4), no pass over the vocabulary here.
void tree_sampling_impl(const char* op, const at::Tensor& predicts, const at::Tensor& accept_index,
                        const at::Tensor& accept_token_num, const at::Tensor& candidates,
                        const at::Tensor& retrieve_index, const at::Tensor& retrieve_next_token,
                        const at::Tensor& retrieve_next_sibling, const at::Tensor& uniform_samples,
                        const at::Tensor& uniform_samples_for_final_sampling, const at::Tensor& source,
                        bool logits_source, const std::optional<at::Tensor>& temperatures,
                        const std::optional<at::Tensor>& top_ks, const std::optional<at::Tensor>& top_ps) {
  const LinkArgs a = check_links(op, predicts, accept_index, accept_token_num, candidates, retrieve_index,
                                 retrieve_next_token, retrieve_next_sibling);
  const int64_t B = a.B, N = a.N, S = a.S;
  const char* source_name = logits_source ? "logits" : "target_probs";
  check_float_dtype(source, op, source_name);
  TORCH_CHECK_VALUE(source.device().is_cpu(), op, ": ", source_name, ": expected a CPU tensor");
  if (logits_source) {
    TORCH_CHECK_VALUE(source.dim() == 2 && source.size(0) == B * N, op, ": logits: expected shape (", B * N,
                      ", V), got ", shape_str(source.sizes()));
  } else {
    TORCH_CHECK_VALUE(source.dim() == 3 && source.size(0) == B && source.size(1) == N, op,
                      ": target_probs: expected shape (", B, ", ", N, ", V), got ", shape_str(source.sizes()));
  }
  const int64_t V = source.size(source.dim() - 1);
  TORCH_CHECK_VALUE(V > 0, op, ": ", source_name, ": expected a vocabulary of at least one token");
  const char* coin_names[2] = {"uniform_samples", "uniform_samples_for_final_sampling"};
  const at::Tensor* coin_tensors[2] = {&uniform_samples, &uniform_samples_for_final_sampling};
  for (int i = 0; i < 2; ++i) {
    const at::ScalarType dt = coin_tensors[i]->scalar_type();
    TORCH_CHECK_VALUE(dt == at::kFloat || dt == at::kDouble, op, ": ", coin_names[i],
                      ": expected dtype float32 or float64, got ", dt);
    TORCH_CHECK_VALUE(coin_tensors[i]->device().is_cpu(), op, ": ", coin_names[i], ": expected a CPU tensor");
  }
  TORCH_CHECK_VALUE(uniform_samples.dim() == 2 && uniform_samples.size(0) == B && uniform_samples.size(1) >= 1, op,
                    ": uniform_samples: expected shape (", B, ", n), got ", shape_str(uniform_samples.sizes()));
  check_shape(uniform_samples_for_final_sampling, op, "uniform_samples_for_final_sampling", {B}, "[B]");
  const at::Tensor coins = uniform_samples.contiguous();
  const at::Tensor final_coins = uniform_samples_for_final_sampling.contiguous();
  const int64_t* cand = a.cand.data_ptr<int64_t>();

  const auto long_opts = a.cand.options().dtype(at::kLong);
  at::Tensor tokens = at::empty({B, N}, long_opts);
  at::Tensor parents = at::empty({B, N}, long_opts.dtype(at::kInt));
  at::Tensor seed = at::empty({B}, long_opts);
  at::Tensor offset = at::empty({B}, long_opts);
  int64_t* tok = tokens.data_ptr<int64_t>();
  int32_t* par = parents.data_ptr<int32_t>();
  Trees t(a.next_token.data_ptr<int64_t>(), a.next_sibling.data_ptr<int64_t>(), B, N);
  std::vector<int64_t> rows(B * N);
  bool all_reached = true;
  const int64_t n_coins = coins.size(1);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t k = 0; k < N; ++k) {
      const int64_t node = t.order[b * N + k];
      const bool reached = node == 0 || t.parent[b * N + node] >= 0;
      all_reached &= reached;
      // A node no link reaches gets token V, a column of probability 0: it is never accepted.
      tok[b * N + k] = reached ? cand[b * N + node] : V;
      rows[b * N + k] = b * N + node;
    }
    // Our counter-based stream from SGLang's coins for this step (_stream_from_coins).
    seed.data_ptr<int64_t>()[b] = (coin_bits(coins, b * n_coins) << 32) | coin_bits(final_coins, b);
    offset.data_ptr<int64_t>()[b] = coin_bits(coins, b * n_coins + n_coins - 1);
  }
  std::copy(t.new_parent.begin(), t.new_parent.end(), par);
  const std::vector<int64_t>& order = t.order;
  const bool identity = t.identity;
  // Verify's logits in its node order: one view when SGLang's order is already a valid one and
  // every node is reached; else the rows gathered, with a column of probability 0 (token V).
  at::Tensor logits;
  const at::Tensor rows2d = source.reshape({B * N, V});
  if (identity && all_reached) {
    logits = logits_source ? rows2d.view({B, N, V}) : at::log(rows2d.to(at::kFloat)).view({B, N, V});
  } else {
    logits = at::empty({B * N, V + 1}, rows2d.options().dtype(logits_source ? rows2d.scalar_type() : at::kFloat));
    logits.select(1, V).fill_(-std::numeric_limits<float>::infinity());
    at::Tensor index = at::empty({B * N}, long_opts);
    std::copy(rows.begin(), rows.end(), index.data_ptr<int64_t>());
    at::Tensor body = logits.narrow(1, 0, V);
    if (logits_source) {
      body.copy_(at::index_select(rows2d, 0, index));
    } else {
      at::log_out(body, at::index_select(rows2d, 0, index).to(at::kFloat));
    }
    logits = logits.view({B, N, V + 1});
  }
  // Per-request sampling parameters from SGLang's per-row ones (row b * N is request b's first).
  at::Tensor temperature = at::empty({B}, long_opts.dtype(at::kFloat)).fill_(1.0);
  std::optional<at::Tensor> top_k, top_p;
  auto per_request = [&](const std::optional<at::Tensor>& t, const char* name) {
    TORCH_CHECK_VALUE(t->numel() == B * N && t->device().is_cpu(), op, ": ", name, ": expected ", B * N,
                      " per-row values on the CPU, got shape ", shape_str(t->sizes()));
    return t->reshape({B * N}).to(at::kDouble).contiguous();
  };
  if (temperatures.has_value()) {
    const at::Tensor v = per_request(temperatures, "temperatures");
    for (int64_t b = 0; b < B; ++b) temperature.data_ptr<float>()[b] = static_cast<float>(v.data_ptr<double>()[b * N]);
  }
  if (top_ks.has_value()) {
    const at::Tensor v = per_request(top_ks, "top_ks");
    top_k = at::empty({B}, long_opts.dtype(at::kInt));
    for (int64_t b = 0; b < B; ++b) {
      const double k = v.data_ptr<double>()[b * N];  // k <= 0 or k >= V: no filter
      top_k->data_ptr<int32_t>()[b] = k <= 0 || k >= static_cast<double>(V) ? 0 : static_cast<int32_t>(k);
    }
  }
  if (top_ps.has_value()) {
    const at::Tensor v = per_request(top_ps, "top_ps");
    top_p = at::empty({B}, long_opts.dtype(at::kFloat));
    for (int64_t b = 0; b < B; ++b) top_p->data_ptr<float>()[b] = static_cast<float>(v.data_ptr<double>()[b * N]);
  }
  const VerifyTensors out = run_verify(tokens, parents, logits, S - 1, temperature, top_k, top_p, seed, offset);
  const at::Tensor& out_tokens = std::get<2>(out);
  std::vector<int64_t> emitted(B * S);
  const int64_t* ot = out_tokens.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * S; ++i) emitted[i] = std::max<int64_t>(ot[i], 0);
  write_results(a, predicts, accept_index, accept_token_num, order.data(), N, std::get<0>(out), std::get<1>(out),
                emitted.data());
}

void sglang_tree_sampling_cpu(const at::Tensor& predicts, const at::Tensor& accept_index,
                              const at::Tensor& accept_token_num, const at::Tensor& candidates,
                              const at::Tensor& retrieve_index, const at::Tensor& retrieve_next_token,
                              const at::Tensor& retrieve_next_sibling, const at::Tensor& uniform_samples,
                              const at::Tensor& uniform_samples_for_final_sampling, const at::Tensor& target_probs) {
  tree_sampling_impl("sglang_tree_sampling", predicts, accept_index, accept_token_num, candidates, retrieve_index,
                     retrieve_next_token, retrieve_next_sibling, uniform_samples, uniform_samples_for_final_sampling,
                     target_probs, false, std::nullopt, std::nullopt, std::nullopt);
}

void sglang_tree_sampling_logits_cpu(const at::Tensor& predicts, const at::Tensor& accept_index,
                                     const at::Tensor& accept_token_num, const at::Tensor& candidates,
                                     const at::Tensor& retrieve_index, const at::Tensor& retrieve_next_token,
                                     const at::Tensor& retrieve_next_sibling, const at::Tensor& uniform_samples,
                                     const at::Tensor& uniform_samples_for_final_sampling, const at::Tensor& logits,
                                     const std::optional<at::Tensor>& temperatures,
                                     const std::optional<at::Tensor>& top_ks, const std::optional<at::Tensor>& top_ps) {
  tree_sampling_impl("sglang_tree_sampling_logits", predicts, accept_index, accept_token_num, candidates,
                     retrieve_index, retrieve_next_token, retrieve_next_sibling, uniform_samples,
                     uniform_samples_for_final_sampling, logits, true, temperatures, top_ks, top_ps);
}

// SGLang's tree build (build_tree_kernel_efficient_func: outputs written in place), as the adapter's
// tensor path computes it (eagle_kernels/integrations/sglang.py build_tree with
// _layout.tree_from_selection and _layout.first_child_next_sibling): node j + 1 of request b is
// the selected candidate top_scores_index[b, j]; its parent is the node of the first selected
// position holding candidate parent_list[b, s // topk] (the root when s // topk == 0); a node whose
// parent candidate was not selected is left out of the links and masked as a child of the root.
// Ancestors and depths by walking each node up at most spec_steps levels; links: the first child
// is the smallest child index, siblings follow in increasing index. The adapter has checked the
// arguments (a failed check falls back to SGLang's own kernel); these checks name the tensor.
void sglang_build_tree_cpu(const at::Tensor& parent_list, const at::Tensor& top_scores_index,
                           const at::Tensor& seq_lens, const at::Tensor& tree_mask, const at::Tensor& positions,
                           const at::Tensor& retrieve_index, const at::Tensor& retrieve_next_token,
                           const at::Tensor& retrieve_next_sibling, int64_t topk, int64_t spec_steps,
                           int64_t num_verify_tokens, int64_t tree_mask_mode) {
  const char* op = "sglang_build_tree";
  const int64_t N = num_verify_tokens;
  TORCH_CHECK_VALUE(topk > 0 && spec_steps > 0 && N > 0, op,
                    ": topk, spec_steps, num_verify_tokens: expected > 0, got ", topk, ", ", spec_steps, ", ", N);
  TORCH_CHECK_VALUE(tree_mask_mode >= 0 && tree_mask_mode <= 2, op, ": tree_mask_mode: unknown mode ", tree_mask_mode);
  check_index_tensor(seq_lens, op, "seq_lens");
  check_dim(seq_lens, op, "seq_lens", 1, "[B]");
  const int64_t B = seq_lens.size(0), M = N - 1;
  check_index_tensor(top_scores_index, op, "top_scores_index");
  check_shape(top_scores_index, op, "top_scores_index", {B, M}, "[B, N - 1]");
  check_index_tensor(parent_list, op, "parent_list");
  check_dim(parent_list, op, "parent_list", 2, "[B, P]");
  TORCH_CHECK_VALUE(parent_list.size(0) == B, op, ": parent_list: expected ", B, " rows, got shape ",
                    shape_str(parent_list.sizes()));
  const char* names[3] = {"retrieve_index", "retrieve_next_token", "retrieve_next_sibling"};
  const at::Tensor* links[3] = {&retrieve_index, &retrieve_next_token, &retrieve_next_sibling};
  for (int i = 0; i < 3; ++i) {
    check_index_tensor(*links[i], op, names[i]);
    check_shape(*links[i], op, names[i], {B, N}, "[B, N]");
  }
  check_index_tensor(positions, op, "positions");
  check_shape(positions, op, "positions", {B * N}, "[B * N]");
  TORCH_CHECK_VALUE(tree_mask.dim() == 1 && tree_mask.is_contiguous() && tree_mask.device().is_cpu(), op,
                    ": tree_mask: expected a contiguous 1-D CPU tensor");
  const IntIn sel(top_scores_index), plist(parent_list), seq(seq_lens);
  const int64_t P = parent_list.size(1);

  std::vector<int64_t> parent(N), first(N);
  std::vector<uint8_t> linked(N);
  // anc[(b * N + i) * N + j]: j is i or an ancestor of i (the root included).
  std::vector<uint8_t> anc(B * N * N, 0);
  const IntOut ri = int_out(retrieve_index), nt = int_out(retrieve_next_token), ns = int_out(retrieve_next_sibling);
  const IntOut pos = int_out(positions);
  const int64_t r0 = retrieve_index.stride(0), r1 = retrieve_index.stride(1);
  const int64_t t0 = retrieve_next_token.stride(0), t1 = retrieve_next_token.stride(1);
  const int64_t s0 = retrieve_next_sibling.stride(0), s1 = retrieve_next_sibling.stride(1);
  const int64_t ps = positions.stride(0);
  for (int64_t b = 0; b < B; ++b) {
    bool sorted = true;
    for (int64_t j = 1; j < M; ++j) sorted &= sel[b * M + j - 1] <= sel[b * M + j];
    parent[0] = -1;
    linked[0] = 1;
    for (int64_t j = 0; j < M; ++j) {
      const int64_t s = sel[b * M + j];
      const int64_t tb = s >= 0 ? s / topk : -((-s + topk - 1) / topk);  // floor division
      if (tb == 0) {
        parent[j + 1] = 0;
        linked[j + 1] = 1;
        continue;
      }
      const int64_t want = P > 0 ? plist[b * P + std::clamp<int64_t>(tb, 0, P - 1)] : -1;
      int64_t q = -1;
      if (sorted) {
        int64_t lo = 0, hi = M;  // the first position holding `want`
        while (lo < hi) {
          const int64_t mid = (lo + hi) / 2;
          if (sel[b * M + mid] < want) {
            lo = mid + 1;
          } else {
            hi = mid;
          }
        }
        if (lo < M && sel[b * M + lo] == want) q = lo;
      } else {
        for (int64_t x = 0; x < M && q < 0; ++x) {
          if (sel[b * M + x] == want) q = x;
        }
      }
      parent[j + 1] = q >= 0 ? q + 1 : 0;
      linked[j + 1] = q >= 0;
    }
    uint8_t* anc_b = anc.data() + b * N * N;
    for (int64_t i = 0; i < N; ++i) {
      int64_t c = i, d = 0;
      anc_b[i * N] = 1;
      for (int64_t step = 0; step < spec_steps; ++step) {
        if (c > 0) {
          anc_b[i * N + c] = 1;
          ++d;
        }
        c = parent[c] >= 0 ? parent[c] : 0;
      }
      ri.set(b * r0 + i * r1, b * N + i);
      pos.set((b * N + i) * ps, seq[b] + d);
    }
    // Links, children in decreasing index: each child's next sibling is the one placed before it.
    std::fill(first.begin(), first.end(), -1);
    for (int64_t c = N - 1; c >= 1; --c) {
      const int64_t p = parent[c];
      if (!linked[c] || p < 0 || p >= N) {
        ns.set(b * s0 + c * s1, -1);
        continue;
      }
      ns.set(b * s0 + c * s1, first[p]);
      first[p] = c;
    }
    ns.set(b * s0, -1);
    for (int64_t u = 0; u < N; ++u) nt.set(b * t0 + u * t1, first[u]);
  }

  const at::Tensor anc_t = at::from_blob(anc.data(), {B * N * N}, at::TensorOptions().dtype(at::kBool));
  if (tree_mask_mode == 1) {  // QLEN_ONLY: [B, N, N]
    TORCH_CHECK_VALUE(tree_mask.numel() >= B * N * N, op, ": tree_mask: expected at least ", B * N * N,
                      " entries, got ", tree_mask.numel());
    tree_mask.narrow(0, 0, B * N * N).copy_(anc_t);
  } else if (tree_mask_mode == 2) {  // QLEN_ONLY_BITPACKING: N bits per row in 1, 2 or 4 bytes
    TORCH_CHECK_VALUE(N <= 32, op, ": tree_mask_mode QLEN_ONLY_BITPACKING: needs num_verify_tokens <= 32, got ", N);
    const int64_t width = N > 16 ? 4 : (N > 8 ? 2 : 1);
    const at::Tensor raw = tree_mask.view(at::kByte);
    TORCH_CHECK_VALUE(raw.numel() >= B * N * width, op, ": tree_mask: expected at least ", B * N * width,
                      " bytes, got ", raw.numel());
    uint8_t* out = raw.data_ptr<uint8_t>();
    for (int64_t r = 0; r < B * N; ++r) {
      uint32_t word = 0;
      for (int64_t j = 0; j < N; ++j) word |= static_cast<uint32_t>(anc[r * N + j]) << j;
      for (int64_t k = 0; k < width; ++k) out[r * width + k] = static_cast<uint8_t>(word >> (8 * k));
    }
  } else {  // FULL_MASK: request b's rows follow the requests before it, N * (seq_len + N) entries each
    int64_t prefix = 0;
    std::vector<int64_t> index(B * N * N);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t L = seq[b];
      for (int64_t i = 0; i < N; ++i) {
        const int64_t start = N * N * b + prefix * N + i * (L + N) + L;
        for (int64_t j = 0; j < N; ++j) index[(b * N + i) * N + j] = start + j;
      }
      prefix += L;
    }
    const int64_t last = B > 0 ? index.back() : -1;
    TORCH_CHECK_VALUE(last < tree_mask.numel(), op, ": tree_mask: expected at least ", last + 1, " entries, got ",
                      tree_mask.numel());
    const at::Tensor index_t = at::from_blob(index.data(), {B * N * N}, at::TensorOptions().dtype(at::kLong));
    tree_mask.index_put_({index_t}, anc_t.to(tree_mask.scalar_type()));
  }
}

// vLLM's V1 rejection sampler on chains, as eagle_kernels/integrations/vllm.py full_chains
// computes it for a batch of full chains: the L drafts of a chain are verified against its L rows
// of target_logits, read in place as verify's [G, L, V] logits; the chain is the root and the
// first L - 1 drafts, and the last draft is accepted iff the token verify draws at node L - 1
// equals it (see there); then the bonus token. Full chains (every request with L = max_spec_len
// drafts) take one verify call; ragged batches one call per request (its rows, no copy; a request
// without drafts emits its bonus token). Returns int32 [B, max_spec_len + 1] padded with -1.
struct ChainArgs {
  const IntIn& drafts;
  const IntIn& bonus;
  const double* temperature;  // nullptr: greedy batch
  const double* uniform;
  at::TensorOptions long_opts;
  int32_t* out;
  int64_t out_width;
};

// Requests b0 .. b0 + G - 1, each with L >= 1 drafts starting at row starts[b].
void verify_chains(const ChainArgs& c, const at::Tensor& logits, int64_t b0, int64_t G, int64_t L,
                   const int64_t* starts) {
  at::Tensor tokens = at::empty({G, L}, c.long_opts);
  at::Tensor parents = at::empty({G, L}, c.long_opts.dtype(at::kInt));
  int64_t* tok = tokens.data_ptr<int64_t>();
  int32_t* par = parents.data_ptr<int32_t>();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t d = starts[b0 + g];
    tok[g * L] = 0;  // the root's token is not read
    par[g * L] = -1;
    for (int64_t j = 1; j < L; ++j) {
      tok[g * L + j] = c.drafts[d + j - 1];
      par[g * L + j] = static_cast<int32_t>(j - 1);
    }
  }
  std::optional<at::Tensor> temp, seed, offset;
  if (c.temperature != nullptr) {
    temp = at::empty({G}, c.long_opts.dtype(at::kFloat));
    seed = at::empty({G}, c.long_opts);
    offset = at::empty({G}, c.long_opts);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t start = starts[b0 + g];
      // The logits are already divided by the temperature (greedy rows: 0).
      temp->data_ptr<float>()[g] = c.temperature[b0 + g] != 0.0 ? 1.0f : 0.0f;
      // The stream: the float64 bits of the request's first and last uniforms (vllm._stream).
      std::memcpy(seed->data_ptr<int64_t>() + g, c.uniform + start, sizeof(int64_t));
      std::memcpy(offset->data_ptr<int64_t>() + g, c.uniform + start + L - 1, sizeof(int64_t));
    }
  }
  const VerifyTensors out = run_verify(tokens, parents, logits, L - 1, temp, std::nullopt, std::nullopt, seed, offset);
  const int32_t* len = std::get<0>(out).data_ptr<int32_t>();
  const int64_t* ot = std::get<2>(out).data_ptr<int64_t>();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t b = b0 + g, a = len[g];
    const bool last = a == L - 1 && ot[g * L + L - 1] == c.drafts[starts[b] + L - 1];
    int32_t* r = c.out + b * c.out_width;
    for (int64_t j = 0; j <= a; ++j) r[j] = static_cast<int32_t>(ot[g * L + j]);
    if (last) r[L] = static_cast<int32_t>(c.bonus[b]);
  }
}

at::Tensor vllm_chains_cpu(const at::Tensor& draft_token_ids, const at::Tensor& cu_num_draft_tokens,
                           const at::Tensor& target_logits, const at::Tensor& bonus_token_ids, int64_t max_spec_len,
                           const std::optional<at::Tensor>& temperature, const std::optional<at::Tensor>& uniform) {
  const char* op = "vllm_chains";
  check_float_dtype(target_logits, op, "target_logits");
  check_dim(target_logits, op, "target_logits", 2, "[num_tokens, vocab]");
  TORCH_CHECK_VALUE(target_logits.device().is_cpu(), op, ": target_logits: expected a CPU tensor");
  check_index_tensor(draft_token_ids, op, "draft_token_ids");
  check_index_tensor(cu_num_draft_tokens, op, "cu_num_draft_tokens");
  check_index_tensor(bonus_token_ids, op, "bonus_token_ids");
  const int64_t T = target_logits.size(0), V = target_logits.size(1), B = bonus_token_ids.numel();
  const int64_t L = max_spec_len;
  TORCH_CHECK_VALUE(L >= 0, op, ": max_spec_len: expected >= 0, got ", L);
  TORCH_CHECK_VALUE(draft_token_ids.dim() == 1 && draft_token_ids.numel() == T, op,
                    ": draft_token_ids: expected shape [", T, "], got ", shape_str(draft_token_ids.sizes()));
  check_shape(cu_num_draft_tokens, op, "cu_num_draft_tokens", {B}, "[B]");
  TORCH_CHECK_VALUE(target_logits.stride(1) == 1 || V <= 1, op, ": target_logits: expected contiguous rows");
  const IntIn drafts(draft_token_ids), bonus(bonus_token_ids), ends(cu_num_draft_tokens);
  const auto long_opts = target_logits.options().dtype(at::kLong);
  std::vector<int64_t> starts(B), counts(B);
  bool full = B > 0;
  for (int64_t b = 0; b < B; ++b) {
    starts[b] = b == 0 ? 0 : ends[b - 1];
    counts[b] = ends[b] - starts[b];
    TORCH_CHECK_VALUE(counts[b] >= 0 && counts[b] <= L && ends[b] <= T, op,
                      ": cu_num_draft_tokens: expected non-decreasing ends <= ", T, " with at most ", L,
                      " drafts per request, got ", ends[b], " at ", b);
    full &= counts[b] == L;
  }
  ChainArgs c{drafts, bonus, nullptr, nullptr, long_opts, nullptr, L + 1};
  at::Tensor t64, u64;
  if (temperature.has_value()) {
    TORCH_CHECK_VALUE(uniform.has_value(), op, ": uniform: expected vLLM's uniforms with a temperature");
    TORCH_CHECK_VALUE(temperature->numel() == B && temperature->device().is_cpu(), op, ": temperature: expected ", B,
                      " entries on the CPU, got ", shape_str(temperature->sizes()));
    TORCH_CHECK_VALUE(uniform->numel() == T && uniform->device().is_cpu() && uniform->is_floating_point(), op,
                      ": uniform: expected ", T, " floats on the CPU, got ", shape_str(uniform->sizes()));
    t64 = temperature->to(at::kDouble).contiguous();
    u64 = uniform->to(at::kDouble).contiguous();
    c.temperature = t64.data_ptr<double>();
    c.uniform = u64.data_ptr<double>();
  }
  at::Tensor result = at::empty({B, L + 1}, long_opts.dtype(at::kInt));
  c.out = result.data_ptr<int32_t>();
  std::fill(c.out, c.out + B * (L + 1), -1);
  if (full && L >= 1) {
    verify_chains(c, target_logits.view({B, L, V}), 0, B, L, starts.data());
    return result;
  }
  for (int64_t b = 0; b < B; ++b) {
    if (counts[b] == 0) {
      c.out[b * (L + 1)] = static_cast<int32_t>(c.bonus[b]);
      continue;
    }
    verify_chains(c, target_logits.narrow(0, starts[b], counts[b]).view({1, counts[b], V}), b, 1, counts[b],
                  starts.data());
  }
  return result;
}

}  // namespace
}  // namespace eagle

TORCH_LIBRARY_FRAGMENT(eagle_kernels, m) {
  m.def(
      "sglang_build_tree(Tensor parent_list, Tensor top_scores_index, Tensor seq_lens, Tensor(a!) tree_mask, "
      "Tensor(b!) positions, Tensor(c!) retrieve_index, Tensor(d!) retrieve_next_token, "
      "Tensor(e!) retrieve_next_sibling, int topk, int spec_steps, int num_verify_tokens, int tree_mask_mode) -> ()");
  m.def(
      "sglang_verify_greedy(Tensor(a!) predicts, Tensor(b!) accept_index, Tensor(c!) accept_token_num, "
      "Tensor candidates, Tensor retrieve_index, Tensor retrieve_next_token, Tensor retrieve_next_sibling, "
      "Tensor target_predict) -> ()");
  m.def(
      "sglang_greedy_verify_inputs(Tensor candidates, Tensor retrieve_next_token, Tensor retrieve_next_sibling, "
      "Tensor target_predict, int max_depth=-1) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "sglang_tree_sampling_logits(Tensor(a!) predicts, Tensor(b!) accept_index, Tensor(c!) accept_token_num, "
      "Tensor candidates, Tensor retrieve_index, Tensor retrieve_next_token, Tensor retrieve_next_sibling, "
      "Tensor uniform_samples, Tensor uniform_samples_for_final_sampling, Tensor logits, Tensor? temperatures=None, "
      "Tensor? top_ks=None, Tensor? top_ps=None) -> ()");
  m.def(
      "vllm_chains(Tensor draft_token_ids, Tensor cu_num_draft_tokens, Tensor target_logits, "
      "Tensor bonus_token_ids, int max_spec_len, Tensor? temperature=None, Tensor? uniform=None) -> Tensor");
  m.def(
      "sglang_tree_sampling(Tensor(a!) predicts, Tensor(b!) accept_index, Tensor(c!) accept_token_num, "
      "Tensor candidates, Tensor retrieve_index, Tensor retrieve_next_token, Tensor retrieve_next_sibling, "
      "Tensor uniform_samples, Tensor uniform_samples_for_final_sampling, Tensor target_probs) -> ()");
}

TORCH_LIBRARY_IMPL(eagle_kernels, CPU, m) {
  m.impl("sglang_build_tree", &eagle::sglang_build_tree_cpu);
  m.impl("sglang_verify_greedy", &eagle::sglang_verify_greedy_cpu);
  m.impl("sglang_greedy_verify_inputs", &eagle::sglang_greedy_verify_inputs_cpu);
  m.impl("sglang_tree_sampling", &eagle::sglang_tree_sampling_cpu);
  m.impl("sglang_tree_sampling_logits", &eagle::sglang_tree_sampling_logits_cpu);
  m.impl("vllm_chains", &eagle::vllm_chains_cpu);
}
