// CPU kernel of the decoder's token bookkeeping after a step (eagle_kernels/bookkeeping.py, `commit` without the
// head's hidden state): append each active request's accepted tokens to its output (and its lookup history), stop
// at an EOS or the token limit, advance the caches' lengths, the step count, the root token and the random-stream
// offset. The torch path is about twenty small operator calls, ~0.25 ms of a decoding step on a 2-core CPU (their
// state is out of cache after the step's weight stream); this is one call over a few dozen integers. It computes
// what the torch path computes, write for write (python_tests/decoding/test_commit_native.py compares them),
// including the torch path's order of writes where the output is full (positions clamped to its last column, each
// write putting back the value read before the first one unless its token is emitted).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "checks.h"

namespace eagle {
namespace {

constexpr const char* kOp = "decoder_commit";

void check_vector(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t B) {
  check_dtype(t, kOp, name, dtype);
  check_shape(t, kOp, name, {B}, "[B]");
  check_device(t, kOp, name, at::Device(at::kCPU));
}

void check_matrix(const at::Tensor& t, const char* name, int64_t B) {
  check_dtype(t, kOp, name, at::kLong);
  check_dim(t, kOp, name, 2, "[B, W]");
  check_shape(t, kOp, name, {B, t.size(1)}, "[B, W]");
  check_device(t, kOp, name, at::Device(at::kCPU));
}

// Writes row b's tokens [0, W) at columns min(start + j, limit) + shift of `buffer`, token j only where
// emitted[j], else the value the column held before the first write (the torch path's gather then scatter).
void write_row(const at::Tensor& buffer, const char* name, int64_t b, int64_t start, int64_t last_column, int64_t shift,
               const int64_t* row, const std::vector<char>& emitted, std::vector<int64_t>& before) {
  const int64_t W = static_cast<int64_t>(emitted.size());
  int64_t* data = buffer.data_ptr<int64_t>();
  const int64_t s0 = buffer.stride(0), s1 = buffer.stride(1);
  const auto column = [&](int64_t j) { return std::min(start + j, last_column) + shift; };
  for (int64_t j = 0; j < W; ++j) {
    const int64_t c = column(j);
    TORCH_CHECK_VALUE(c >= 0 && c < buffer.size(1), kOp, ": ", name, ": expected room for column ", c, " of request ",
                      b, ", got width ", buffer.size(1));
    before[j] = data[b * s0 + c * s1];
  }
  for (int64_t j = 0; j < W; ++j) data[b * s0 + column(j) * s1] = emitted[j] ? row[j] : before[j];
}

void decoder_commit_cpu(const at::Tensor& tokens_in, const std::optional<at::Tensor>& accept_len,
                        const at::Tensor& done, const at::Tensor& out, const at::Tensor& out_len,
                        const at::Tensor& steps, const at::Tensor& root, const at::Tensor& offset, int64_t limit,
                        int64_t eos, const std::optional<at::Tensor>& history,
                        const std::optional<at::Tensor>& prompt_len, const at::Tensor& target_seqlens,
                        const std::optional<at::Tensor>& head_seqlens) {
  check_dim(tokens_in, kOp, "tokens", 2, "[B, W]");
  const int64_t B = tokens_in.size(0), W = tokens_in.size(1);
  check_matrix(tokens_in, "tokens", B);
  if (accept_len.has_value()) check_vector(*accept_len, "accept_len", at::kInt, B);
  check_vector(done, "done", at::kBool, B);
  check_matrix(out, "out", B);
  TORCH_CHECK_VALUE(out.size(1) >= 1, kOp, ": out: expected at least one column, got shape ", shape_str(out.sizes()));
  for (const auto& [t, name] : {std::pair{&out_len, "out_len"}, std::pair{&steps, "steps"}, std::pair{&root, "root"},
                                std::pair{&offset, "offset"}})
    check_vector(*t, name, at::kLong, B);
  TORCH_CHECK_VALUE(history.has_value() == prompt_len.has_value(), kOp,
                    ": prompt_len: expected history and prompt_len together");
  if (history.has_value()) {
    check_matrix(*history, "history", B);
    check_vector(*prompt_len, "prompt_len", at::kLong, B);
  }
  check_vector(target_seqlens, "target_seqlens", at::kInt, B);
  if (head_seqlens.has_value()) check_vector(*head_seqlens, "head_seqlens", at::kInt, B);
  const at::Tensor tokens = tokens_in.contiguous();
  const int64_t* token = tokens.data_ptr<int64_t>();
  if (accept_len.has_value())
    for (int64_t b = 0; b < B; ++b) {
      const int32_t a = accept_len->data_ptr<int32_t>()[b * accept_len->stride(0)];
      TORCH_CHECK_VALUE(a >= 0 && a < W, kOp, ": accept_len: expected values in [0, W = ", W, "), got ", a,
                        " for request ", b);
    }

  const auto at_b = [](const at::Tensor& t, int64_t b) -> int64_t& { return t.data_ptr<int64_t>()[b * t.stride(0)]; };
  bool* done_data = done.data_ptr<bool>();
  int32_t* target_len = target_seqlens.data_ptr<int32_t>();
  std::vector<char> emitted(W);
  std::vector<int64_t> before(W);
  for (int64_t b = 0; b < B; ++b) {
    const bool active = !done_data[b * done.stride(0)];
    const int64_t last = accept_len.has_value() ? accept_len->data_ptr<int32_t>()[b * accept_len->stride(0)] : 0;
    const int64_t* row = token + b * W;
    if (accept_len.has_value()) {
      const int32_t advance = static_cast<int32_t>((last + 1) * (active ? 1 : 0));
      target_len[b * target_seqlens.stride(0)] += advance;
      if (head_seqlens.has_value()) head_seqlens->data_ptr<int32_t>()[b * head_seqlens->stride(0)] += advance;
    } else {
      target_len[b * target_seqlens.stride(0)] += active ? 1 : 0;  // a plain step advances the target only
    }
    // Emitted: j <= last of an active request, up to and including its first EOS among those.
    int64_t end = active ? last + 1 : 0;
    bool hit_eos = false;
    if (eos >= 0)
      for (int64_t j = 0; j < end; ++j)
        if (row[j] == eos) {
          end = j + 1;
          hit_eos = true;
          break;
        }
    for (int64_t j = 0; j < W; ++j) emitted[j] = j < end;
    int64_t& length = at_b(out_len, b);
    write_row(out, "out", b, length, out.size(1) - 1, 0, row, emitted, before);
    if (history.has_value())
      write_row(*history, "history", b, length, out.size(1) - 1, at_b(*prompt_len, b), row, emitted, before);
    length += end;
    at_b(steps, b) += active ? 1 : 0;
    if (active) at_b(root, b) = row[last];
    if (length >= limit || hit_eos) done_data[b * done.stride(0)] = true;
    at_b(offset, b) += 1;
  }
}

}  // namespace
}  // namespace eagle

TORCH_LIBRARY_FRAGMENT(eagle_kernels, m) {
  m.def(
      "decoder_commit(Tensor tokens, Tensor? accept_len, Tensor(a!) done, Tensor(b!) out, Tensor(c!) out_len, "
      "Tensor(d!) steps, Tensor(e!) root, Tensor(f!) offset, int limit, int eos, Tensor(g!)? history, "
      "Tensor? prompt_len, Tensor(h!) target_seqlens, Tensor(i!)? head_seqlens) -> ()");
}

TORCH_LIBRARY_IMPL(eagle_kernels, CPU, m) { m.impl("decoder_commit", &eagle::decoder_commit_cpu); }
