"""tree_attention on the issue's shape grid: every backend against the float64 reference.

test_tree_attention.py checks the reference itself against an independent dense computation;
here the float64 reference is the truth for larger shapes: N in {1, 7, 60, 65, 130}, prefix in
{0, 1, 37, 1000}, (Hq, Hkv) in {(9, 3), (8, 8), (32, 8)}, D in {64, 128}, contiguous and paged
caches (pages of 16 and 64, shuffled block tables), random build_tree trees and causal mode,
fp32/fp16/bf16. The C++ kernel runs the grid; Triton (interpreted, slow) a representative
subset, plus its flash-decoding split path forced on.
"""

import itertools

import pytest
import torch

from eagle_kernels import reference
from helpers import attention_inputs, random_tree

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
NS = [1, 7, 60, 65, 130]
PREFIXES = [0, 1, 37, 1000]
HEADS = [(9, 3), (8, 8), (32, 8)]
LAYOUTS = [None, 16, 64]  # contiguous, or the page size


def layout_id(page):
    return "contiguous" if page is None else f"page{page}"


def check(fn, B, N, prefix, heads, D, dtype, page, causal, seed, sm_scale=None):
    q, k, v, seqlens, table = attention_inputs(B, N, prefix, heads, D, dtype, page, seed)
    mask = None if causal else random_tree(B, N, seed).mask
    out = fn(q, k, v, seqlens, mask, block_table=table, sm_scale=sm_scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    want = reference.tree_attention(q.double(), k.double(), v.double(), seqlens, mask,
                                    block_table=table, sm_scale=sm_scale)
    torch.testing.assert_close(out.double(), want, **TOL[dtype])


# fp32: every (N, prefix, heads) with D, layout and tree/causal cycled through the cases.
FP32_GRID = [
    (N, prefix, heads, (64, 128)[i % 2], LAYOUTS[i % 3], i % 4 == 3)
    for i, (N, prefix, heads) in enumerate(itertools.product(NS, PREFIXES, HEADS))
]


def grid_id(case):
    N, prefix, (hq, hkv), D, page, causal = case
    return f"N{N}-prefix{prefix}-Hq{hq}-Hkv{hkv}-D{D}-{layout_id(page)}-{'causal' if causal else 'tree'}"


@pytest.mark.parametrize("case", FP32_GRID, ids=[grid_id(c) for c in FP32_GRID])
def test_grid_fp32(backend, op_impl, case):
    if backend == "triton":
        pytest.skip("the interpreted Triton kernel runs the TRITON_CASES subset")
    if backend == "reference":
        pytest.skip("the reference is the truth here (checked in test_tree_attention.py)")
    N, prefix, heads, D, page, causal = case
    check(op_impl("tree_attention"), 2, N, prefix, heads, D, torch.float32, page, causal, seed=N * 7 + prefix)


@pytest.mark.parametrize("causal", [False, True], ids=["tree", "causal"])
@pytest.mark.parametrize("page", LAYOUTS, ids=layout_id)
@pytest.mark.parametrize("D", [64, 128], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_low_precision(backend, op_impl, dtype, D, page, causal):
    if backend == "triton":
        pytest.skip("the interpreted Triton kernel runs the TRITON_CASES subset")
    if backend == "reference":
        pytest.skip("the reference is the truth here (checked in test_tree_attention.py)")
    check(op_impl("tree_attention"), 2, 65, 1000, (32, 8), D, dtype, page, causal, seed=D + 1)


TRITON_CASES = [
    # N, prefix, heads, D, dtype, page, causal. The interpreter's cost grows with the number of
    # programs (request, KV head, block of nodes): the two large cases keep the grid's GQA
    # groups (4 and 3) on fewer KV heads than (32, 8) and (9, 3), which the C++ grid runs.
    (130, 37, (8, 2), 64, torch.float32, 64, False),
    (65, 1000, (6, 2), 128, torch.bfloat16, None, False),
    (60, 37, (8, 8), 64, torch.float16, 16, True),
    (1, 1, (9, 3), 64, torch.float32, 16, False),
    (7, 0, (9, 3), 64, torch.float32, None, True),
]


def triton_id(case):
    N, prefix, (hq, hkv), D, dtype, page, causal = case
    name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    return f"N{N}-prefix{prefix}-Hq{hq}-Hkv{hkv}-D{D}-{name}-{layout_id(page)}-{'causal' if causal else 'tree'}"


@pytest.mark.parametrize("case", TRITON_CASES, ids=[triton_id(c) for c in TRITON_CASES])
def test_representative(backend, op_impl, case):
    N, prefix, heads, D, dtype, page, causal = case
    check(op_impl("tree_attention"), 2, N, prefix, heads, D, dtype, page, causal, seed=N + prefix)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_node_that_sees_nothing_gets_zeros(backend, op_impl, dtype):
    """A node with an empty prefix and no bit of its row (outside the contract) gets a zero row on every backend (the
    reference gave softmax's NaN over no entries, the kernels zeros); the other nodes as a valid mask gives them."""
    fn = op_impl("tree_attention")
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 4, 8, generator=g).to(DTYPES[dtype])
    k, v = (torch.randn(2, 5, 2, 8, generator=g).to(DTYPES[dtype]) for _ in range(2))
    seqlens = torch.tensor([0, 2], dtype=torch.int32)
    mask = torch.tensor([[[0], [3], [5]], [[0], [3], [5]]], dtype=torch.int64)  # node 0 of each request: no bit
    out = fn(q, k, v, seqlens, mask)
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))
    want = reference.tree_attention(q.double(), k.double(), v.double(), seqlens, mask)
    assert not want.isnan().any()
    torch.testing.assert_close(out.double(), want, **TOL[DTYPES[dtype]])


@pytest.mark.parametrize("splits", [2, 5], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("prefix", [0, 300], ids=lambda p: f"prefix{p}")
def test_triton_split_kv(backend, prefix, splits):
    """Flash-decoding path forced on (it is chosen only for CUDA tensors): splits that get no
    prefix key (prefix 0, or fewer tiles than splits) must merge to the exact answer."""
    if backend != "triton":
        pytest.skip("Triton-specific path")
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 on CPU")
    from eagle_kernels.triton.tree_attention import _launch

    fn = lambda *a, **kw: _launch(*a, num_splits=splits, **kw)  # noqa: E731
    check(fn, 2, 20, prefix, (8, 2), 64, torch.float32, 16, False, seed=prefix + splits)


@pytest.mark.parametrize("magnitude", [1.0, 1e6], ids=lambda m: f"v{m:g}")
def test_triton_split_kv_bf16(backend, magnitude):
    """bf16 splits keep their partials in fp16 scaled per row: values far beyond fp16's range
    (|v| ~ 1e6) merge to the reference like unit ones, and the split output stays within the
    bf16 tolerance of the unsplit one."""
    if backend != "triton":
        pytest.skip("Triton-specific path")
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 on CPU")
    from eagle_kernels.triton.tree_attention import _launch

    q, k, v, seqlens, table = attention_inputs(1, 9, 200, (4, 2), 64, torch.bfloat16, 16, 11)
    v = (v.float() * magnitude).to(torch.bfloat16)
    mask = random_tree(1, 9, 11).mask
    want = reference.tree_attention(q.double(), k.double(), v.double(), seqlens, mask, block_table=table)
    split = _launch(q, k, v, seqlens, mask, block_table=table, num_splits=3)
    whole = _launch(q, k, v, seqlens, mask, block_table=table, num_splits=1)
    assert torch.isfinite(split).all()
    torch.testing.assert_close(split.double() / magnitude, want / magnitude, **TOL[torch.bfloat16])
    torch.testing.assert_close(split.double() / magnitude, whole.double() / magnitude, **TOL[torch.bfloat16])


@pytest.mark.parametrize("case,name", [
    ("heads_mismatch", "k_cache"),
    ("head_dim_mismatch", "k_cache"),
    ("mask_width", "tree_mask"),
    ("seqlens_beyond_cache", "cache_seqlens"),
    ("seqlens_negative", "cache_seqlens"),
    ("page_id_out_of_pool", "block_table"),
    ("v_cache_dtype", "v_cache"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_bad_input(backend, op_impl, case, name):
    fn = op_impl("tree_attention")
    page = 16 if case == "page_id_out_of_pool" else None
    q, k, v, seqlens, table = attention_inputs(2, 130, 5, (32, 8), 64, torch.float32, page, seed=0)
    mask = random_tree(2, 130, 0).mask
    if case == "heads_mismatch":
        k, v = k[:, :, :3].contiguous(), v[:, :, :3].contiguous()
    elif case == "head_dim_mismatch":
        k, v = k[..., :48].contiguous(), v[..., :48].contiguous()
    elif case == "mask_width":
        mask = mask[..., :2].contiguous()  # N = 130 needs 3 words
    elif case == "seqlens_beyond_cache":
        seqlens = seqlens.clone()
        seqlens[0] = k.shape[1] - 130 + 1
    elif case == "seqlens_negative":
        seqlens = seqlens.clone()
        seqlens[1] = -2
    elif case == "page_id_out_of_pool":
        table = table.clone()
        table[0, 0] = k.shape[0]
    elif case == "v_cache_dtype":
        v = v.half()
    with pytest.raises(ValueError, match=name):
        fn(q, k, v, seqlens, mask, block_table=table)


# ------------------------------------------------------------------------------ GPU (CUDA)
GPU_CASES = [
    # B, N, prefix, heads, D, dtype, page, causal
    (2, 65, 1000, (32, 8), 128, torch.bfloat16, 16, False),
    (3, 130, 37, (9, 3), 64, torch.float16, None, False),
    (1, 64, 4096, (32, 8), 128, torch.bfloat16, 64, False),   # split-KV
    (8, 60, 1000, (32, 8), 256, torch.bfloat16, None, True),
    (2, 256, 500, (8, 8), 64, torch.float32, 16, False),
    (4, 7, 0, (32, 8), 128, torch.float16, 64, True),
    (1, 1, 3000, (9, 3), 64, torch.bfloat16, None, True),  # SmolLM2 decode: the splits' merge folded
    (1, 61, 1500, (9, 3), 64, torch.bfloat16, 16, False),  # SmolLM2 verify pass: 32-row blocks, folded splits
    (1, 61, 250, (9, 3), 64, torch.bfloat16, None, False),  # the same on a short cache: 16-row blocks, no split
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES,
                         ids=lambda c: f"B{c[0]}-N{c[1]}-prefix{c[2]}-D{c[4]}-{c[5]}-{layout_id(c[6])}")
def test_gpu_against_reference(gpu_op_impl, case):
    B, N, prefix, heads, D, dtype, page, causal = case
    fn = gpu_op_impl("tree_attention")
    q, k, v, seqlens, table = attention_inputs(B, N, prefix, heads, D, dtype, page, seed=N + D)
    mask = None if causal else random_tree(B, N, 1).mask
    to = lambda t: None if t is None else t.cuda()  # noqa: E731
    out = fn(to(q), to(k), to(v), to(seqlens), to(mask), block_table=to(table))
    want = reference.tree_attention(q.double(), k.double(), v.double(), seqlens, mask, block_table=table)
    torch.testing.assert_close(out.cpu().double(), want, **TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("N,prefix", [(1, 3000), (61, 1500)], ids=["N1-prefix3000", "N61-prefix1500"])
def test_gpu_folded_merge(N, prefix):
    """On the device: the splits merged by each block's last program (memory ordering through
    the ticket's acquire-release) against the reference and against the merge launch, the
    tickets zero after every launch, and a repeated launch bit-identical."""
    from eagle_kernels.triton import tree_attention as tta
    from eagle_kernels.triton._launch_config import tickets

    q, k, v, seqlens, table = attention_inputs(1, N, prefix, (9, 3), 64, torch.bfloat16, None, seed=N)
    mask = None if N == 1 else random_tree(1, N, 2).mask
    cuda = [t if t is None else t.cuda() for t in (q, k, v, seqlens, mask)]
    folded = tta._launch(*cuda, num_splits=12, fold_merge=True)
    assert not tickets(folded.device, 64)[:64].any()
    want = reference.tree_attention(q.double(), k.double(), v.double(), seqlens, mask)
    torch.testing.assert_close(folded.cpu().double(), want, **TOL[torch.bfloat16])
    launched = tta._launch(*cuda, num_splits=12, fold_merge=False)
    torch.testing.assert_close(folded, launched, atol=1e-3, rtol=2**-7)
    for _ in range(3):
        assert torch.equal(tta._launch(*cuda, num_splits=12, fold_merge=True), folded)


ISA_CASES = [
    # N, prefix, heads, D, dtype, page, causal
    (65, 37, (9, 3), 64, torch.float32, 16, False),
    (130, 1000, (32, 8), 128, torch.bfloat16, None, False),
    (60, 1, (8, 8), 64, torch.float16, 64, True),
    (7, 37, (9, 3), 40, torch.float32, None, False),  # D % 16 != 0: scalar loops at any cap
    (1, 1000, (9, 3), 64, torch.float32, None, True),  # a decoded token: 3 rows, keys in the QK lanes
    (2, 100, (9, 3), 64, torch.bfloat16, 16, False),  # 6 rows: keys in the lanes with AVX-512
]


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512-ymm", "avx512", "avx512-bf16"])
@pytest.mark.parametrize("case", ISA_CASES, ids=[triton_id(c) for c in ISA_CASES])
def test_cpp_instruction_sets(backend, op_impl, monkeypatch, isa, case):
    """EAGLE_KERNELS_CPU_ISA caps the C++ kernel's instruction set (a cap above what the CPU
    has runs the best available variant), so every variant is checked on one machine."""
    if backend != "cpp":
        pytest.skip("C++-specific switch")
    monkeypatch.setenv("EAGLE_KERNELS_CPU_ISA", isa)
    N, prefix, heads, D, dtype, page, causal = case
    check(op_impl("tree_attention"), 2, N, prefix, heads, D, dtype, page, causal, seed=N + D)


@pytest.mark.parametrize("isa", ["avx2", "avx512", "avx512-bf16"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cpp_rows_independent_of_node_count(backend, op_impl, monkeypatch, isa, dtype):
    """A row's output does not depend on the other rows of its call, bit for bit: the first nodes
    of a causal call alone (1-3 nodes: work items of few rows, whose QK puts keys in the lanes)
    equal the same nodes within a call of 12 (rows in the lanes). Greedy speculative decoding
    equals plain decoding through this."""
    if backend != "cpp":
        pytest.skip("C++-specific switch")
    monkeypatch.setenv("EAGLE_KERNELS_CPU_ISA", isa)
    fn = op_impl("tree_attention")
    for heads, D in [((9, 3), 64), ((4, 1), 128), ((8, 8), 64)]:
        q, k, v, seqlens, _ = attention_inputs(2, 12, 70, heads, D, DTYPES[dtype], None, seed=D + heads[0])
        want = fn(q, k, v, seqlens)
        for n in (1, 2, 3):
            got = fn(q[:, :n].contiguous(), k, v, seqlens)
            assert torch.equal(got, want[:, :n]), (heads, D, n)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512", "avx512-bf16"])
@pytest.mark.parametrize("prefix", [37, 100, 1000])
def test_cpp_node_equals_its_decode(backend, op_impl, monkeypatch, isa, prefix, dtype):
    """Each node of a tree gives, bit for bit, what the pass decoding its token alone gives once its ancestors are
    committed (the prefix, then its ancestors at consecutive positions): the key tiles follow logical positions,
    so tree slots that cross a 64-position tile boundary at other places than their depths change no rounding.
    Greedy speculative decoding equals plain decoding through this, also where one flipped bit would flip the
    rounding of an 8-bit activation (cpu_linear's int8 arithmetic)."""
    if backend != "cpp":
        pytest.skip("C++-specific switch")
    monkeypatch.setenv("EAGLE_KERNELS_CPU_ISA", isa)
    fn = op_impl("tree_attention")
    N = 60
    tree = random_tree(1, N, seed=prefix)
    q, k, v, seqlens, _ = attention_inputs(1, N, prefix, (9, 3), 64, DTYPES[dtype], None, seed=prefix)
    out = fn(q, k, v, seqlens, tree.mask)
    deep = 0
    for i in range(N):
        row = int(tree.mask[0, i, 0]) & ((1 << 64) - 1)
        path = [j for j in range(N) if row >> j & 1]  # ancestors and itself, in slot (= depth) order
        deep += path[-1] >= 64 - prefix % 64 > len(path) - 1  # its slot, not its depth, crosses a tile boundary
        kc, vc = k.clone(), v.clone()
        kc[0, prefix:prefix + len(path)] = k[0, [prefix + j for j in path]]
        vc[0, prefix:prefix + len(path)] = v[0, [prefix + j for j in path]]
        decode = fn(q[:, i:i + 1].contiguous(), kc, vc, seqlens + len(path) - 1)
        assert torch.equal(decode[0, 0], out[0, i]), (i, path)
    assert prefix % 64 + N <= 64 or deep > 0  # the tree does cross a tile boundary away from the depths
