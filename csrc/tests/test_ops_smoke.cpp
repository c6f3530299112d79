// Smoke test of the libtorch-linked library built by CMake: the schemas are registered, the
// CPU kernels run through the dispatcher, and bad input raises c10::ValueError.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include "ops.h"
#include "tests/check.h"

namespace {

void test_build_tree_dispatch() {
  auto op = c10::Dispatcher::singleton()
                .findSchemaOrThrow("eagle_kernels::build_tree", "")
                .typed<eagle::TreeTensors(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                          int64_t)>();
  const at::Tensor root = at::tensor({7}, at::kLong);
  const at::Tensor tok = at::tensor({10, 11, 12, 13}, at::kLong).view({1, 4});
  const at::Tensor score = at::tensor({-0.5f, -1.0f, -0.7f, -2.0f}).view({1, 4});
  const at::Tensor par = at::tensor({-1, -1, 0, 1}, at::kInt).view({1, 4});
  const auto [tokens, parents, depths, mask] = op.call(root, tok, score, par, 4);
  EXPECT(at::equal(tokens, at::tensor({7, 10, 11, 12}, at::kLong).view({1, 4})));
  EXPECT(at::equal(parents, at::tensor({-1, 0, 0, 1}, at::kInt).view({1, 4})));
  EXPECT(at::equal(depths, at::tensor({0, 1, 1, 2}, at::kInt).view({1, 4})));
  EXPECT(at::equal(mask, at::tensor({1, 3, 5, 11}, at::kLong).view({1, 4, 1})));

  bool raised = false;
  try {
    op.call(root, tok, score, par, 6);
  } catch (const c10::ValueError& e) { raised = std::string(e.what()).find("num_nodes") != std::string::npos; }
  EXPECT(raised);
}

void test_compact_kv_dispatch() {
  // torch_bindings.cpp's ops and one of each other file that registers some (decoder_commit.cpp, engine_layout.cpp):
  // the library globs csrc/cpu, as setup.py does.
  for (const char* name : {"tree_attention", "draft_expand", "verify", "block_verify", "compact_kv", "write_kv",
                           "cpu_linear", "cpu_decoder_layer", "decoder_commit", "sglang_build_tree", "vllm_chains"})
    EXPECT(c10::Dispatcher::singleton().findSchema({std::string("eagle_kernels::") + name, ""}).has_value());
  at::Tensor k = at::arange(2 * 8 * 1 * 2, at::kFloat).view({2, 8, 1, 2});
  at::Tensor v = -k.clone();
  const at::Tensor seqlens = at::tensor({1, 2}, at::kInt);
  const at::Tensor nodes = at::tensor({0, 2, 3, 0, 1, -1}, at::kInt).view({2, 3});
  const at::Tensor lens = at::tensor({2, 0}, at::kInt);
  at::Tensor expect = k.clone();
  expect[0][2] = k[0][3].clone();
  expect[0][3] = k[0][4].clone();
  eagle::compact_kv_cpu(k, v, seqlens, nodes, lens, std::nullopt);
  EXPECT(at::equal(k, expect));
  EXPECT(at::equal(v, -expect));
}

void test_cpu_linear_dispatch() {
  auto op = c10::Dispatcher::singleton()
                .findSchemaOrThrow("eagle_kernels::cpu_linear", "")
                .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  const at::Tensor x = at::randn({5, 37});
  const at::Tensor w = at::randn({11, 37});
  const at::Tensor want = at::matmul(x.to(at::kDouble), w.to(at::kDouble).t());
  EXPECT(at::allclose(op.call(x, w).to(at::kDouble), want, 1e-5, 1e-5));
  const at::Tensor wb = w.to(at::kBFloat16);
  const at::Tensor want_bf16 = at::matmul(x.to(at::kDouble), wb.to(at::kDouble).t());
  EXPECT(at::allclose(op.call(x, wb).to(at::kDouble), want_bf16, 1e-5, 1e-5));

  bool raised = false;
  try {
    op.call(x, w.narrow(1, 0, 36).contiguous());
  } catch (const c10::ValueError& e) { raised = std::string(e.what()).find("weight") != std::string::npos; }
  EXPECT(raised);
}

// A layer with zero o_proj and down_proj weights passes x through unchanged (both residual
// branches are zero) and writes zero K/V (zero q/k/v weights) at the new slots only.
void test_cpu_decoder_layer_dispatch() {
  const int64_t B = 2, N = 3, H = 8, Hq = 2, Hkv = 1, D = 4, I = 6, S = 10;
  const at::Tensor x = at::randn({B, N, H});
  const at::Tensor norm = at::ones({H});
  at::Tensor k = at::randn({B, S, Hkv, D});
  at::Tensor v = at::randn({B, S, Hkv, D});
  const at::Tensor k_before = k.clone();
  const at::Tensor seqlens = at::tensor({2, 5}, at::kInt);
  const at::Tensor cos = at::ones({B, N, D});
  const at::Tensor sin = at::zeros({B, N, D});
  const at::Tensor out = eagle::cpu_decoder_layer_cpu(
      x, norm, at::zeros({(Hq + 2 * Hkv) * D, H}), at::zeros({H, Hq * D}), norm, at::zeros({2 * I, H}),
      at::zeros({H, I}), cos, sin, k, v, seqlens, std::nullopt, Hq, 1e-5, std::nullopt, std::nullopt, 0, std::nullopt);
  EXPECT(at::equal(out, x));
  EXPECT(at::equal(k[0].narrow(0, 2, N), at::zeros({N, Hkv, D})));
  EXPECT(at::equal(v[1].narrow(0, 5, N), at::zeros({N, Hkv, D})));
  EXPECT(at::equal(k[0].narrow(0, 0, 2), k_before[0].narrow(0, 0, 2)));
  EXPECT(at::equal(k[1].narrow(0, 8, 2), k_before[1].narrow(0, 8, 2)));
  EXPECT(c10::Dispatcher::singleton().findSchema({"eagle_kernels::cpu_decoder_layer", ""}).has_value());
}

}  // namespace

int main() {
  RUN(test_build_tree_dispatch);
  RUN(test_compact_kv_dispatch);
  RUN(test_cpu_linear_dispatch);
  RUN(test_cpu_decoder_layer_dispatch);
  TEST_MAIN_END();
}
