"""GpuLayerPath (three to nine launches per decoder layer) against TorchLayerPath, layer by layer, on CPU
tensors with the Triton kernels interpreted; the path's selection. Tests running the path carry
"triton" in their names (slow lane)."""

import contextlib
import os
import warnings

import pytest
import torch

from eagle_kernels import _dispatch
from eagle_kernels.models import LlamaModel
from eagle_kernels.models.eagle_head import EagleHead
from eagle_kernels.models.layers import GpuLayerPath, RopeTables, TorchLayerPath
from helpers import tiny_hf_model

pytestmark = pytest.mark.usefixtures("single_thread")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture
def triton_ops(monkeypatch):
    """``triton_ops(gpu)``: a context in which the model runs the GPU path with the ops on their
    Triton kernels (interpreted), as on a GPU, or (gpu False) TorchLayerPath on the default
    (C++) kernels."""
    if _dispatch.implementation("rmsnorm", "triton", "cpu")[0] is None:
        pytest.skip("triton runs CPU tensors only under TRITON_INTERPRET=1")

    @contextlib.contextmanager
    def context(model, gpu):
        model.layer_paths._gpu_path_on_cpu = gpu
        with monkeypatch.context() as patch, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ops without a Triton kernel run the reference
            if gpu:
                patch.setenv(_dispatch.BACKEND_ENV, "triton")
            yield
    return context


@contextlib.contextmanager
def counting_kernels():
    """Counts the Triton kernels launched inside the block by name (a Counter, filled as they run)."""
    from collections import Counter

    from triton.runtime.interpreter import InterpretedFunction

    launched, run = Counter(), InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launched[self.fn.__name__] += 1
        return run(self, *args, **kwargs)

    InterpretedFunction.run = counted
    try:
        yield launched
    finally:
        InterpretedFunction.run = run


def on_cuda(test):
    """A test of the compiled GPU kernels: marked gpu, run on a CUDA device with Triton compiling."""
    for mark in (pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                    reason="Triton interpreter active: run the GPU tests with TRITON_INTERPRET=0"),
                 pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
                 pytest.mark.gpu):
        test = mark(test)
    return test


def assert_close(got, want, dtype, what):
    """Within the dtype's tolerance, absolute errors relative to the tensor's largest entry."""
    tol = TOLERANCE[dtype]
    scale = max(1.0, float(want.float().abs().max()))
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


def run_target(model):
    """A prefill of 2 x 5 tokens (every layer's output kept), then a 3-node tree pass."""
    tokens = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(2, 12)
    first = model(tokens, cache, feature_layers=(0, 1, 2))
    cache.seqlens += 5
    tree = model(tokens[:, :3], cache, positions=cache.seqlens[:, None].long() + torch.tensor([0, 1, 1]),
                 tree_mask=torch.tensor([[[1], [3], [5]]] * 2))
    return first, tree, cache


@pytest.mark.parametrize("form", ["o_proj_mlp", "rmsnorm_linear", "unfused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])  # fp16: the op tests
def test_gpu_path_triton_matches_torch_path_target(dtype, form, triton_ops, monkeypatch):
    """Every form of the path: small matrices with the layer after attention in one o_proj_mlp launch, the same as
    three rmsnorm_linear launches (O_PROJ_MLP_IN_ONE_LAUNCH off), and the norm, cuBLAS and silu_mul apart (matrices
    above FUSED_NORM_MAX_MATRIX_BYTES)."""
    from eagle_kernels.models import layers

    if form == "unfused":
        monkeypatch.setattr(layers, "FUSED_NORM_MAX_MATRIX_BYTES", 0)
    if form == "rmsnorm_linear":
        monkeypatch.setattr(layers, "O_PROJ_MLP_IN_ONE_LAUNCH", False)
    model = LlamaModel.from_transformers(tiny_hf_model(torch.float32), dtype=dtype)
    with triton_ops(model, False):
        want, want_tree, want_cache = run_target(model)
    with triton_ops(model, True), counting_kernels() as launched:
        got, got_tree, got_cache = run_target(model)
    fused = form != "unfused"
    assert (launched["_o_proj_mlp_kernel"] > 0) == (form == "o_proj_mlp")
    assert (launched["_rmsnorm_linear_kernel"] > 0) == (form == "rmsnorm_linear")
    assert (launched["_silu_mul_kernel"] > 0) != fused
    assert (launched["_rmsnorm_qkv_rope_kernel"] > 0) == fused and (launched["_rope_write_kv_kernel"] > 0) != fused
    for layer in range(3):
        assert_close(got.layer_states[layer], want.layer_states[layer], dtype, f"layer {layer}")
    assert_close(got.hidden, want.hidden, dtype, "final norm")
    assert_close(got.logits, want.logits, dtype, "logits")
    assert_close(got_tree.logits, want_tree.logits, dtype, "tree logits")
    assert_close(got_cache.k, want_cache.k, dtype, "k cache")
    assert_close(got_cache.v, want_cache.v, dtype, "v cache")
    assert got.logits.dtype == want.logits.dtype and got.hidden.dtype == dtype


@pytest.mark.parametrize("kind,dtype", [("eagle1", torch.float32), ("eagle3", torch.bfloat16)],
                         ids=["eagle1-fp32", "eagle3-bf16"])
def test_gpu_path_triton_matches_torch_path_head(kind, dtype, triton_ops):
    """A head's prefill, then a drafting pass at slot offset 1 (a depth-2 frontier of 2 nodes), and its draft
    logits (EAGLE-3 on the GPU path: its final norm and draft LM head as one rmsnorm_linear launch)."""
    target = LlamaModel.from_transformers(tiny_hf_model(torch.float32), dtype=dtype)
    head = EagleHead.random(target, kind, **({"draft_vocab_size": 60} if kind == "eagle3" else {}))
    out = target(torch.randint(0, 97, (2, 7)), target.new_cache(2, 16), feature_layers=(0, 1, 2))
    features = head.target_features(out)
    tokens = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(2))
    results = []
    for gpu in (False, True):
        with triton_ops(head, gpu):
            cache = head.new_cache(2, 24)
            first = head(tokens, features, cache)
            cache.seqlens += 7
            draft = head(tokens[:, :2], features[:, :2], cache, positions=cache.seqlens[:, None].long() + 1,
                         tree_mask=torch.tensor([[[1], [2], [7]]] * 2), slot_offset=1)
            with counting_kernels() as launched:
                logits = head.logits(draft)
            if gpu and kind == "eagle3":
                assert dict(launched) == {"_rmsnorm_linear_kernel": 1}, dict(launched)
            results.append((first, draft, logits, cache.k, cache.v))
    for what, want, got in zip(["prefill", "draft", "logits", "k cache", "v cache"], *results):
        assert_close(got, want, dtype, what)


def test_gpu_path_triton_q8_0_head(triton_ops):
    """An EAGLE-3 head with Q8_0 matrices on the bf16 GPU path: every GEMM (fc, q/k/v, o, gate/up, down, the draft
    LM head) is one q8_0_linear launch, the residual adds in its epilogue, norms apart; results follow the torch
    path over the same blocks (exactly dequantized per call) within bf16's tolerance, and the head with the 16-bit
    matrices the blocks came from within the quantization's."""
    target = LlamaModel.from_transformers(tiny_hf_model(torch.float32), dtype=torch.bfloat16)
    head = EagleHead.random(target, "eagle3", draft_vocab_size=60, weight_dtype="q8_0")
    plain = EagleHead.random(target, "eagle3", draft_vocab_size=60)
    assert head.weight_format == "q8_0" and head.weights["lm_head.weight"].dtype == torch.int8
    out = target(torch.randint(0, 97, (2, 7)), target.new_cache(2, 16), feature_layers=(0, 1, 2))
    tokens = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(2))
    results = []
    for model, gpu in ((head, False), (head, True), (plain, True)):
        with triton_ops(model, gpu), counting_kernels() as launched:
            cache = model.new_cache(2, 24)
            hidden, logits = model.run(tokens, model.feature_rows(out), cache, fc=True, logits=True)
        if gpu and model is head:
            assert launched["_q8_0_linear_kernel"] == 6 and launched["_rmsnorm_linear_kernel"] == 0, dict(launched)
            assert launched["_silu_mul_kernel"] == 1 and launched["_rope_write_kv_kernel"] == 1, dict(launched)
        results.append((hidden, logits, cache.k))
    for what, want, got in zip(["hidden", "logits", "k cache"], results[0], results[1]):
        assert_close(got, want, torch.bfloat16, what)
    scale = float(results[2][1].float().abs().max())
    assert (results[1][1].float() - results[2][1].float()).abs().max() < 0.1 * scale  # Q8_0 against bf16 matrices


def wide_bf16_target():
    """A 3-layer random bf16 Llama whose head's matrices all have K a multiple of 128 (hidden 128, MLP 256)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    from gpu_e2e import random_llama

    from eagle_kernels.models.llama import LlamaConfig

    return random_llama(LlamaConfig(97, 128, 256, 3, 4, 2, 32), torch.bfloat16, "cpu")


def test_gpu_path_triton_fp8_head(triton_ops):
    """An EAGLE-3 head with weight_dtype "fp8" on the bf16 GPU path: every GEMM is one fp8_linear launch over fp8
    copies of its bf16 matrices (the residual adds in its epilogue, norms apart); the results follow the same head
    on the torch path (bf16 matrices) within fp8's precision; the CPU path is untouched."""
    target = wide_bf16_target()
    head = EagleHead.random(target, "eagle3", draft_vocab_size=60, weight_dtype="fp8")
    assert head.weight_format == "fp8" and head.weights["lm_head.weight"].dtype == torch.bfloat16
    out = target(torch.randint(0, 97, (2, 7)), target.new_cache(2, 16), feature_layers=(0, 1, 2))
    tokens = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(2))
    results = []
    for gpu in (False, True):
        with triton_ops(head, gpu), counting_kernels() as launched:
            cache = head.new_cache(2, 24)
            hidden, logits = head.run(tokens, head.feature_rows(out), cache, fc=True, logits=True)
        if gpu:
            assert launched["_fp8_linear_kernel"] == 6 and launched["_rmsnorm_linear_kernel"] == 0, dict(launched)
        results.append((hidden, logits))
    for what, want, got in zip(["hidden", "logits"], *results):
        scale = float(want.float().abs().max())
        assert (got.float() - want.float()).abs().max() < 0.1 * scale, what
    assert len(head.packed._fp8) == 6  # fc, q/k/v, o, gate/up, down, the LM head


def test_q8_0_split_copies_follow_their_matrix():
    """A head's split copies are made once per matrix, kept apart from the CPU's packed copies, and remade after
    an in-place change."""
    from eagle_kernels.models.cpu_weights import PackedWeights
    from eagle_kernels.reference.cpu_linear import quantize

    blocks = quantize(torch.randn(32, 64), "q8_0")
    store = PackedWeights()
    first = store.q8_0_split(blocks)
    assert store.q8_0_split(blocks) is first and blocks not in store
    blocks[0, 2] += 1
    again = store.q8_0_split(blocks)
    assert again is not first and again[0][0, 0] == first[0][0, 0] + 1
    with pytest.raises(ValueError, match="^blocks:"):
        store.q8_0_split(torch.zeros(32, 64, dtype=torch.uint8))


def test_path_selection():
    model = LlamaModel.from_transformers(tiny_hf_model(torch.float32))
    x = torch.zeros(1, 2, 64)
    cache = model.new_cache(1, 8)
    layer = lambda: model.layer_weights(0)  # noqa: E731
    paths = model.layer_paths
    assert not isinstance(paths.pick(x, cache, model.weights, layer=layer), GpuLayerPath)  # CPU default
    paths._gpu_path_on_cpu = True
    assert isinstance(paths.pick(x, cache, model.weights, layer=layer), GpuLayerPath)
    assert not isinstance(paths.pick(x, cache, model.weights), GpuLayerPath)  # no layer to check
    assert isinstance(paths.pick(x.double(), model.new_cache(1, 8, dtype=torch.float64), model.weights, layer=layer),
                      TorchLayerPath)  # float64
    assert not isinstance(paths.pick(x, model.new_cache(1, 8, dtype=torch.bfloat16), model.weights, layer=layer),
                          GpuLayerPath)  # a cache in another dtype
    narrow = LlamaModel.from_transformers(tiny_hf_model(torch.float32), weight_dtype=torch.bfloat16)
    narrow.layer_paths._gpu_path_on_cpu = True
    assert not isinstance(narrow.layer_paths.pick(x, cache, narrow.weights, layer=lambda: narrow.layer_weights(0)),
                          GpuLayerPath)  # bf16 matrices of an fp32 model
    model.weights["model.norm.weight"].requires_grad_(True)
    with torch.enable_grad():
        assert isinstance(paths.pick(x, cache, model.weights, layer=layer), TorchLayerPath)  # autograd


def test_rope_tables_grow_and_keep_outgrown():
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    tables = RopeTables()
    cos, sin = tables(inv_freq, 10)
    assert cos.shape == (64, 8) and cos.dtype == torch.float32
    assert tables(inv_freq, 64)[0] is cos
    bigger = tables(inv_freq, 65)[0]
    assert bigger.shape == (128, 8) and tables._outgrown[0][0] is cos
    angles = torch.arange(128, dtype=torch.float64)[:, None] * inv_freq
    torch.testing.assert_close(bigger, angles.cos().float(), rtol=0, atol=0)
    torch.testing.assert_close(tables(inv_freq, 100)[1], angles.sin().float(), rtol=0, atol=0)


@pytest.mark.parametrize("head_dim", [64, 128, 6])
def test_rope_table_rows_equal_the_formula(head_dim):
    """RopeTables.rows (the CPU fused path's RoPE rows where the cache capacity bounds the positions) gives
    rope_cos_sin_rows' values bit for bit: positions of a pass, of a tree, broadcast per request (a draft depth),
    int32, and past a regrowth of the tables."""
    from eagle_kernels.models.layers import rope_cos_sin_rows

    inv_freq = 1.0 / 500000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    tables = RopeTables()
    g = torch.Generator().manual_seed(head_dim)
    cases = [(torch.randint(0, 200, (3, 7), generator=g), 200), (torch.arange(5)[None] + 4090, 4100),
             (torch.tensor([[17], [3]], dtype=torch.int32), 40), (torch.randint(0, 9000, (2, 12), generator=g), 9000)]
    for positions, capacity in cases:
        B, N = positions.shape[0], 4 if positions.shape[1] == 1 else positions.shape[1]
        got = tables.rows(inv_freq, capacity, positions.expand(B, N))
        want = rope_cos_sin_rows(inv_freq, positions, B, N, torch.float32)
        for g_, w_ in zip(got, want):
            assert g_.shape == (B, N, head_dim) and torch.equal(g_, w_)


@on_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,K,N,residual", [(8, 8192, 6144, False), (7, 4096, 4096, True), (1, 576, 960, False),
                                               (40, 12288, 4096, False)],
                         ids=["rows8-qkv", "rows7-o-residual", "rows1-smollm2", "rows40-fc"])
def test_q8_0_linear_on_cuda(dtype, rows, K, N, residual):
    """The compiled kernel at a Llama-3-8B head's shapes (64- and 32-column blocks, 256-k steps, three row
    blocks) and SmolLM2's (64-k steps) against the reference on the same inputs."""
    from eagle_kernels import reference
    from eagle_kernels.reference.cpu_linear import quantize
    from eagle_kernels.reference.q8_0_linear import split_q8_0
    from eagle_kernels.triton.q8_0_linear import q8_0_linear

    g = torch.Generator().manual_seed(rows)
    quants, scales = split_q8_0(quantize(torch.randn(N, K, generator=g) / K ** 0.5, "q8_0"))
    x = torch.randn(rows, K, generator=g).to(dtype)
    add = torch.randn(rows, N, generator=g).to(dtype) if residual else None
    want = reference.q8_0_linear(x, quants, scales, residual=add)
    got = q8_0_linear(x.cuda(), quants.cuda(), scales.cuda(), residual=None if add is None else add.cuda())
    tol = TOLERANCE[dtype] if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=tol, atol=tol)


@on_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,K,N,residual", [(8, 8192, 6144, False), (7, 4096, 4096, True), (40, 640, 960, False)],
                         ids=["rows8-qkv", "rows7-o-residual", "rows40-K640"])
def test_fp8_linear_on_cuda(dtype, rows, K, N, residual):
    """The compiled kernel (the hardware's fp32 -> e4m3 conversion, the fp8 MMA) against the reference."""
    from eagle_kernels import reference
    from eagle_kernels.reference.fp8_linear import quantize_fp8
    from eagle_kernels.triton.fp8_linear import fp8_linear

    g = torch.Generator().manual_seed(rows)
    weight, scale = quantize_fp8(torch.randn(N, K, generator=g) / K ** 0.5)
    x = (torch.randn(rows, K, generator=g) * 3).to(dtype)
    add = torch.randn(rows, N, generator=g).to(dtype) if residual else None
    want = reference.fp8_linear(x, weight, scale, residual=add)
    got = fp8_linear(x.cuda(), weight.cuda(), scale.cuda(), residual=None if add is None else add.cuda())
    tol = TOLERANCE[dtype] if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=tol, atol=tol)


@on_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,N,slot_offset", [(1, 1, 0), (1, 61, 0), (8, 8, 3)], ids=["B1-N1", "B1-N61", "B8-N8-slot3"])
def test_rmsnorm_qkv_rope_on_cuda(dtype, B, N, slot_offset):
    """The compiled kernel at SmolLM2's attention widths (K 576, 9 q / 3 KV heads of 64) against the reference on
    the same inputs: q, both caches (the rows written and no other), the copy."""
    from eagle_kernels import reference
    from eagle_kernels.triton.rmsnorm_qkv_rope import rmsnorm_qkv_rope

    g = torch.Generator().manual_seed(B * N)
    x = torch.randn(B, N, 576, generator=g).to(dtype)
    weight = (torch.randn(15 * 64, 576, generator=g) / 24).to(dtype)
    norm_weight = (1 + 0.2 * torch.randn(576, generator=g)).to(dtype)
    angles = torch.arange(128, dtype=torch.float64)[:, None] / 1e5 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    cos, sin = angles.cos().float(), angles.sin().float()
    positions = torch.randint(0, 128, (B, N), generator=g)
    seqlens = torch.randint(0, 20, (B,), generator=g, dtype=torch.int32)
    k_cache, v_cache = (torch.randn(B, 40, 3, 64, generator=g).to(dtype) for _ in range(2))
    k_want, v_want = k_cache.clone(), v_cache.clone()
    want, _ = reference.rmsnorm_qkv_rope(x, weight, norm_weight, 1e-5, positions, cos, sin, k_want, v_want, seqlens,
                                         num_heads=9, slot_offset=slot_offset)
    k_got, v_got = k_cache.cuda(), v_cache.cuda()
    got, residual = rmsnorm_qkv_rope(x.cuda(), weight.cuda(), norm_weight.cuda(), 1e-5, positions.cuda(), cos.cuda(),
                                     sin.cuda(), k_got, v_got, seqlens.cuda(), num_heads=9, slot_offset=slot_offset)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for got_t, want_t in ((got, want), (k_got, k_want), (v_got, v_want)):
        torch.testing.assert_close(got_t.cpu().float(), want_t.float(), rtol=tol, atol=tol)
    assert torch.equal(residual.cpu(), x)


@on_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,gated", [(1, False), (61, True), (488, True)], ids=["rows1", "rows61-gated",
                                                                                  "rows488-gated"])
def test_rmsnorm_linear_on_cuda(dtype, rows, gated):
    """The compiled kernel at SmolLM2's widths (K 576; q/k/v 960, gate/up 2 x 1536) against the reference on the
    same inputs: a GPU rounds to nearest, so bf16 within one or two steps."""
    from eagle_kernels import reference
    from eagle_kernels.triton.rmsnorm_linear import rmsnorm_linear

    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g).to(dtype)
    weight = (torch.randn(3072 if gated else 960, 576, generator=g) / 24).to(dtype)
    norm_weight = (1 + 0.2 * torch.randn(576, generator=g)).to(dtype)
    want, _ = reference.rmsnorm_linear(x, weight, norm_weight, 1e-5, gated=gated)
    got, residual = rmsnorm_linear(x.cuda(), weight.cuda(), norm_weight.cuda(), 1e-5, gated=gated)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(residual.cpu(), x)


@on_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,K", [(1, 576), (61, 1536)], ids=["rows1-o", "rows61-down"])
def test_rmsnorm_linear_add_on_cuda(dtype, rows, K):
    """The o / down form (no norm, the residual added before the rounding) compiled, at SmolLM2's widths."""
    from eagle_kernels import reference
    from eagle_kernels.triton.rmsnorm_linear import rmsnorm_linear

    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, K, generator=g).to(dtype)
    weight = (torch.randn(576, K, generator=g) / K ** 0.5).to(dtype)
    add = torch.randn(rows, 576, generator=g).to(dtype)
    want, _ = reference.rmsnorm_linear(x, weight, None, 1e-5, add=add)
    got, _ = rmsnorm_linear(x.cuda(), weight.cuda(), None, 1e-5, add=add.cuda())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=tol, atol=tol)


@on_cuda
def test_gpu_path_on_cuda_bf16():
    """On CUDA a bf16 model takes the GPU layer path; its logits follow an fp32 CPU copy within
    bf16's tolerance; a decoding pass launches the path's Triton kernels once per layer
    (rmsnorm_qkv_rope, tree_attention, o_proj_mlp; the first layer's input norm inside
    token_rows; the attention's flash-decoding merge at most once; rmsnorm for the final norm
    alone, no rope_write_kv, silu_mul nor rmsnorm_linear) and no more than 4 kernels per layer in
    all (the op-by-op path launched ~33)."""
    from torch.profiler import ProfilerActivity, profile

    hf = tiny_hf_model(torch.float32)
    reference = LlamaModel.from_transformers(hf)
    model = LlamaModel.from_transformers(hf, dtype=torch.bfloat16, device="cuda")
    tokens = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    cache = model.new_cache(2, 32)
    assert isinstance(model.layer_paths.pick(torch.zeros(2, 9, 64, dtype=torch.bfloat16, device="cuda"), cache,
                                             model.weights, layer=lambda: model.layer_weights(0)), GpuLayerPath)
    got = model(tokens.cuda(), cache).logits.cpu()
    want = reference(tokens, reference.new_cache(2, 32)).logits
    assert_close(got, want, torch.bfloat16, "logits")
    cache.seqlens += 9
    step = tokens[:, :1].cuda()
    model(step, cache)  # warm: compiled kernels
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model(step, cache)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    layers = model.config.num_layers

    def launched(name):
        return sum(name in k for k in kernels)

    # The first layer's input norm is token_rows' (embedding, norm, positions in one launch); the final norm one more.
    assert launched("_token_rows_kernel") == 1 and launched("_rmsnorm_kernel") == 1, kernels
    assert launched("_o_proj_mlp_kernel") == launched("_rmsnorm_qkv_rope_kernel") == layers, kernels
    assert launched("_rmsnorm_linear_kernel") == 0, kernels
    assert launched("_silu_mul_kernel") == launched("_rope_write_kv_kernel") == 0, kernels
    assert launched("_tree_attention_kernel") == layers and launched("_tree_attention_merge_kernel") <= layers
    assert len(kernels) <= 4 * layers + 10, kernels


@on_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 61, 488], ids=["rows1", "rows61", "rows488"])
def test_o_proj_mlp_on_cuda(dtype, rows):
    """The compiled one-launch layer tail at SmolLM2's widths: its programs hand the three GEMM phases to each other
    through the ticket counters, so it must give the three rmsnorm_linear launches' bits on every call: 50 calls in a
    row, then as a captured CUDA graph replayed 50 times (488 rows: more items than programs, each program takes
    several); within bf16's rounding of the reference; the counters zero afterwards."""
    from eagle_kernels import reference
    from eagle_kernels.triton import _launch_config
    from eagle_kernels.triton.o_proj_mlp import o_proj_mlp
    from eagle_kernels.triton.rmsnorm_linear import rmsnorm_linear

    g = torch.Generator().manual_seed(rows)
    host = [torch.randn(rows, 576, generator=g), torch.randn(rows, 576, generator=g),
            torch.randn(576, 576, generator=g) / 24, 1 + 0.2 * torch.randn(576, generator=g),
            torch.randn(3072, 576, generator=g) / 24, torch.randn(576, 1536, generator=g) / 1536 ** 0.5]
    host = [t.to(dtype) for t in host]
    attention, residual, o_weight, norm_weight, gate_up, down = (t.cuda() for t in host)
    mid, _ = rmsnorm_linear(attention, o_weight, None, 1e-5, add=residual)
    act, _ = rmsnorm_linear(mid, gate_up, norm_weight, 1e-5, gated=True)
    three, _ = rmsnorm_linear(act, down, None, 1e-5, add=mid)
    args = (attention, residual, o_weight, norm_weight, gate_up, down, 1e-5)
    for _ in range(50):
        assert torch.equal(o_proj_mlp(*args), three)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = o_proj_mlp(*args)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(50):
        out.zero_()
        graph.replay()
        assert torch.equal(out, three)
    want = reference.o_proj_mlp(*host, 1e-5)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(three.cpu().float(), want.float(), rtol=tol, atol=tol)
    torch.cuda.synchronize()
    assert not _launch_config.tickets(attention.device, 64).any()
