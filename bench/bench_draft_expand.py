"""draft_expand: one depth of EAGLE-2 expansion, eagle_kernels against the plain torch sequence.

Providers (the names bench/conftest.py pairs in its ratio table):
- ``eagle``: ``eagle_kernels.draft_expand``, backend ``backend_of("draft_expand", device)`` in
  ``extra_info["backend"]`` (cpp on CPU; triton on CUDA unless a CUDA kernel exists);
- ``reference``: here NOT ``eagle_kernels.reference.draft_expand`` (a full sort and a Python
  loop per request) but the stronger baseline an engine would write by hand:
  ``log_softmax`` (fp32) -> ``topk`` -> add the frontier scores -> ``topk`` of the candidates.
  Its tie order among equal scores is torch's, otherwise it computes the same outputs.

Shapes: CPU ``B in {1, 4}``, ``M = 8``, ``V = 49152``, ``top_k = 8``, fp32 and bf16 logits;
CUDA (only with a device) ``B in {1, 8, 32}``, ``M = 8``, ``V in {32000, 128256}``,
``top_k in {8, 10}``, bf16 logits. Throughput: logits bytes read per second
(``B * M * V * element size`` / mean time). CUDA timings synchronise after every call.
Set ``EAGLE_BENCH_THREADS=1`` or ``2`` to compare thread counts.
"""

import pytest
import torch

import eagle_kernels

HAS_CUDA = torch.cuda.is_available()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def torch_sequence(logits, frontier_scores, top_k):
    """The hand-written torch baseline: (tokens [B, M*k], scores [B, M*k], frontier [B, k])."""
    B = logits.shape[0]
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = logp.topk(top_k, dim=-1)
    scores = (frontier_scores[..., None] + values).reshape(B, -1)
    frontier = scores.topk(top_k, dim=-1).indices.to(torch.int32)
    return ids.reshape(B, -1), scores, frontier


def make_inputs(B, M, V, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, M, V, generator=gen) * 3).to(dtype).to(device)
    frontier_scores = (-3 * torch.rand(B, M, generator=gen)).to(device)
    return logits, frontier_scores


def provider_fn(provider, device):
    if provider == "eagle":
        return eagle_kernels.draft_expand, eagle_kernels.backend_of("draft_expand", device)
    return torch_sequence, "torch"


def run_case(measure, provider, B, M, V, top_k, dtype, device):
    fn, backend = provider_fn(provider, device)
    logits, fs = make_inputs(B, M, V, dtype, device)
    if provider == "eagle":  # the comparison is only meaningful if both agree
        want = torch_sequence(logits, fs, top_k)
        got = fn(logits, fs, top_k)
        torch.testing.assert_close(got.scores, want[1], atol=1e-4, rtol=1e-5)
    call = fn
    if device == "cuda":
        def call(*args):
            out = fn(*args)
            torch.cuda.synchronize()
            return out
    nbytes = logits.numel() * logits.element_size()
    measure(call, logits, fs, top_k, work=nbytes, unit="logits_bytes",
            info={"backend": backend, "B": B, "M": M, "V": V, "top_k": top_k,
                  "dtype": str(dtype).removeprefix("torch.")})


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("B", [1, 4], ids=lambda b: f"B{b}")
def test_draft_expand_cpu(measure, provider, B, dtype):
    run_case(measure, provider, B, 8, 49152, 8, dtype, "cpu")


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("top_k", [8, 10], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("V", [32000, 128256], ids=lambda v: f"V{v}")
@pytest.mark.parametrize("B", [1, 8, 32], ids=lambda b: f"B{b}")
def test_draft_expand_cuda(measure, provider, B, V, top_k):
    run_case(measure, provider, B, 8, V, top_k, torch.bfloat16, "cuda")
