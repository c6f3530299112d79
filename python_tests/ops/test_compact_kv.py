"""compact_kv (contract §5): golden overlapping moves, backend == reference on random caches
(hypothesis; contiguous and paged, with and without the layer dim, several dtypes), and bad
input.

A move is a plain copy, so every comparison is exact (``torch.equal``), in every dtype.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eagle_kernels import reference

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
          "fp64": torch.float64}


# ------------------------------------------------------------------------------------ helpers
def random_paths(B, A, num_nodes, g, *, lens=None):
    """accept_nodes int32 [B, A] (0, then strictly increasing draft nodes < num_nodes, then -1)
    and accept_len int32 [B]."""
    nodes = torch.full((B, A), -1, dtype=torch.int32)
    nodes[:, 0] = 0
    out_lens = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        most = min(A - 1, num_nodes - 1)
        n = int(torch.randint(0, most + 1, (1,), generator=g)) if lens is None else lens[b]
        picks = torch.randperm(num_nodes - 1, generator=g)[:n] + 1
        nodes[b, 1:n + 1] = picks.sort().values.to(torch.int32)
        out_lens[b] = n
    return nodes, out_lens


def make_case(*, B, A, num_nodes, H, D, dtype, layers, paged, page_size=4, seed=0,
              strided=False, lens=None):
    """Random caches + a valid compaction request. Returns (args, kwargs)."""
    g = torch.Generator().manual_seed(seed)
    seqlens = torch.randint(0, 9, (B,), generator=g, dtype=torch.int32)
    need = int(seqlens.max()) + num_nodes  # positions the tree occupies
    if paged:
        max_pages = -(-need // page_size) + 1
        num_pages = B * max_pages + 3
        # Every request owns its own pages, shuffled over the pool.
        table = torch.randperm(num_pages, generator=g)[:B * max_pages].view(B, max_pages)
        table = table.to(torch.int32)
        shape = (num_pages, page_size, H, D)
        kw = {"block_table": table}
    else:
        shape = (B, need + int(torch.randint(0, 3, (1,), generator=g)), H, D)
        kw = {}
    if layers:
        shape = (layers,) + shape
    if strided:
        # K and V as views of one [..., 2, ...] buffer: not contiguous (layer / outer stride).
        kv = torch.randn(*shape[:-3], 2, *shape[-3:], generator=g, dtype=torch.float64).to(dtype)
        k, v = kv.select(-4, 0), kv.select(-4, 1)
    else:
        k = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
        v = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    nodes, lens = random_paths(B, A, num_nodes, g, lens=lens)
    return (k, v, seqlens, nodes, lens), kw


def run_both(fn, args, kwargs):
    """(backend result, reference result): each on its own clone of the caches."""
    k, v, *rest = args
    kb, vb = k.clone(), v.clone()
    kr, vr = k.clone(), v.clone()
    assert fn(kb, vb, *rest, **kwargs) is None
    reference.compact_kv(kr, vr, *rest, **kwargs)
    return (kb, vb), (kr, vr)


# ------------------------------------------------------------------------------------- golden
@pytest.mark.parametrize("layers", [0, 2], ids=["no_layer", "L2"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_golden_overlapping_path(op_impl, layers, paged):
    """Path 0 -> 2 -> 3 at cache_seqlens 5: position 7 -> 6, then 8 -> 7 (the destination of
    the first move is the source of none; the source of the second was not yet overwritten).
    Request 1 accepts nothing; request 2 accepts 0 -> 1 -> 4 (1 stays, 4 -> 2)."""
    B, S, H, D = 3, 12, 2, 3
    base = torch.arange(B * S, dtype=torch.float32).view(B, S, 1, 1).expand(B, S, H, D)
    k = base + 0.25 * torch.arange(H).view(1, 1, H, 1)
    v = -k
    if layers:
        k = torch.stack([k + 1000 * l for l in range(layers)])
        v = torch.stack([v - 1000 * l for l in range(layers)])
    expect_k = k.clone()
    moves = {0: [(7, 6), (8, 7)], 2: [(3 + 4, 3 + 2)]}
    for b, pairs in moves.items():
        for src, dst in pairs:
            expect_k[..., b, dst, :, :] = k[..., b, src, :, :]
    seqlens = torch.tensor([5, 2, 3], dtype=torch.int32)
    nodes = torch.tensor([[0, 2, 3, -1], [0, -1, -1, -1], [0, 1, 4, -1]], dtype=torch.int32)
    lens = torch.tensor([2, 0, 2], dtype=torch.int32)
    kwargs = {}
    if paged:  # same logical content, scattered over shuffled pages of 4 rows
        page, max_pages = 4, 3
        table = torch.tensor([[4, 0, 7], [2, 8, 5], [6, 1, 3]], dtype=torch.int32)

        def to_pages(x):
            out = torch.zeros(*x.shape[:-4], 9, page, H, D, dtype=x.dtype)
            for b in range(B):
                for p in range(max_pages):
                    out[..., int(table[b, p]), :, :, :] = x[..., b, p * page:(p + 1) * page, :, :]
            return out

        k, v, expect_k = to_pages(k), to_pages(v), to_pages(expect_k)
        kwargs = {"block_table": table}
    k, v = k.contiguous(), v.contiguous()
    op_impl("compact_kv")(k, v, seqlens, nodes, lens, **kwargs)
    assert torch.equal(k, expect_k)
    assert torch.equal(v, -expect_k)


# ------------------------------------------------------------------------ against the reference
CONFIGS = [
    pytest.param(dict(paged=False, layers=0), id="contiguous"),
    pytest.param(dict(paged=False, layers=3), id="contiguous_L3"),
    pytest.param(dict(paged=True, layers=0), id="paged"),
    pytest.param(dict(paged=True, layers=2), id="paged_L2"),
    pytest.param(dict(paged=False, layers=2, strided=True), id="contiguous_L2_kv_views"),
    pytest.param(dict(paged=True, layers=0, strided=True), id="paged_kv_views"),
]


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("config", CONFIGS)
def test_matches_reference_grid(op_impl, config, dtype):
    fn = op_impl("compact_kv")
    args, kwargs = make_case(B=3, A=5, num_nodes=10, H=2, D=8, dtype=dtype, seed=1, **config)
    got, want = run_both(fn, args, kwargs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@st.composite
def cases(draw):
    paged = draw(st.booleans())
    config = dict(
        B=draw(st.integers(1, 4)),
        A=draw(st.integers(1, 8)),
        num_nodes=draw(st.integers(1, 24)),
        H=draw(st.integers(1, 3)),
        D=draw(st.sampled_from([1, 3, 8, 64])),  # odd row sizes exercise narrow copy words
        dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
        layers=draw(st.sampled_from([0, 1, 3])),
        paged=paged,
        page_size=draw(st.sampled_from([1, 3, 4, 16])) if paged else 4,
        strided=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )
    return config


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(config=cases())
def test_matches_reference(op_impl, backend, config):
    if backend == "reference":
        pytest.skip("compared against itself")
    args, kwargs = make_case(**config)
    got, want = run_both(op_impl("compact_kv"), args, kwargs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_accept_len_zero_is_noop(op_impl, paged):
    args, kwargs = make_case(B=2, A=4, num_nodes=6, H=1, D=4, dtype=torch.float16, layers=2,
                             paged=paged, seed=3, lens=[0, 0])
    k0, v0 = args[0].clone(), args[1].clone()
    op_impl("compact_kv")(*args, **kwargs)
    assert torch.equal(args[0], k0) and torch.equal(args[1], v0)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_full_chain_accepted(op_impl, paged):
    """Path 0 -> 1 -> ... -> A-1: every move is onto itself, nothing changes."""
    args, kwargs = make_case(B=2, A=5, num_nodes=5, H=2, D=4, dtype=torch.float32, layers=0,
                             paged=paged, seed=4, lens=[4, 4])
    k0 = args[0].clone()
    op_impl("compact_kv")(*args, **kwargs)
    assert torch.equal(args[0], k0)


# ---------------------------------------------------------------------------------- bad input
def good_args(paged=False):
    args, kwargs = make_case(B=2, A=4, num_nodes=8, H=2, D=4, dtype=torch.float32, layers=2,
                             paged=paged, seed=5, lens=[3, 1])
    return list(args), dict(kwargs)


def _edit(fn, paged=False):
    def make():
        args, kwargs = good_args(paged)
        fn(args, kwargs)
        return args, kwargs
    return make


def _set(index, value):
    def fn(args, kwargs):
        args[index] = value(args[index])
    return fn


def _nodes(b, j, value):
    def fn(args, kwargs):
        args[3][b, j] = value
    return fn


def _table(b, p, value):
    def fn(args, kwargs):
        kwargs["block_table"][b, p] = value
    return fn


def _overflow(args, kwargs):
    args[2][0] = args[0].shape[2]  # cache_seqlens at the capacity S


def _caches_as(dtype):
    """Both caches of a non-float dtype: rows the copy could move, but not a K/V cache (the C++ op moved them)."""
    def fn(args, kwargs):
        args[0], args[1] = (args[i].mul(8).to(dtype) for i in (0, 1))
    return fn


BAD = [
    pytest.param(_edit(_set(2, lambda t: t.long())), "cache_seqlens", id="seqlens_int64"),
    pytest.param(_edit(_set(3, lambda t: t.long())), "accept_nodes", id="nodes_int64"),
    pytest.param(_edit(_set(4, lambda t: t.long())), "accept_len", id="len_int64"),
    pytest.param(_edit(_set(3, lambda t: t[0])), "accept_nodes", id="nodes_rank1"),
    pytest.param(_edit(_set(4, lambda t: t[:1])), "accept_len", id="len_batch"),
    pytest.param(_edit(_set(2, lambda t: t[:1])), "cache_seqlens", id="seqlens_batch"),
    pytest.param(_edit(_set(0, lambda t: t[0, 0])), "k_cache", id="k_rank3"),
    pytest.param(_edit(_caches_as(torch.int32)), "k_cache: expected dtype", id="caches_int32"),
    pytest.param(_edit(_caches_as(torch.int16), paged=True), "k_cache: expected dtype", id="caches_int16_paged"),
    pytest.param(_edit(_caches_as(torch.uint8)), "k_cache: expected dtype", id="caches_uint8"),
    pytest.param(_edit(_set(1, lambda t: t[..., :2].contiguous())), "v_cache", id="v_shape"),
    pytest.param(_edit(_set(1, lambda t: t.double())), "v_cache", id="v_dtype"),
    pytest.param(_edit(lambda a, kw: a.__setitem__(slice(0, 2), [a[0][:, :1], a[1][:, :1]])),
                 "k_cache", id="cache_batch"),
    pytest.param(_edit(_set(4, lambda t: torch.tensor([4, 1], dtype=torch.int32))),
                 "accept_len", id="len_gt_max_depth"),
    pytest.param(_edit(_set(4, lambda t: torch.tensor([-1, 1], dtype=torch.int32))),
                 "accept_len", id="len_negative"),
    pytest.param(_edit(_nodes(0, 2, 0)), "accept_nodes", id="nodes_not_increasing"),
    pytest.param(_edit(_nodes(0, 0, 1)), "accept_nodes", id="nodes_root_not_0"),
    pytest.param(_edit(_set(2, lambda t: torch.tensor([-1, 0], dtype=torch.int32))),
                 "cache_seqlens", id="seqlens_negative"),
    pytest.param(_edit(_overflow), "cache_seqlens", id="past_capacity"),
    pytest.param(_edit(_table(0, 0, 10_000), paged=True), "block_table", id="page_out_of_range"),
    pytest.param(_edit(_table(1, 0, -1), paged=True), "block_table", id="page_negative"),
    pytest.param(_edit(lambda a, kw: kw.update(block_table=kw["block_table"].long()), paged=True),
                 "block_table", id="table_int64"),
]


@pytest.mark.parametrize("make,name", BAD)
def test_bad_input(op_impl, make, name):
    fn = op_impl("compact_kv")
    args, kwargs = make()
    k0 = args[0].clone() if args[0].dim() else None
    with pytest.raises(ValueError, match=name):
        fn(*args, **kwargs)
    if k0 is not None:
        assert torch.equal(args[0], k0), "a rejected call must not move anything"


@pytest.mark.parametrize("make,name", BAD)
def test_bad_input_registered_op(make, name):
    """``torch.ops.eagle_kernels.compact_kv`` on CPU tensors (the C++ kernel when built, which
    validates on its own, without the Python checks in front)."""
    args, kwargs = make()
    with pytest.raises(ValueError, match=name):
        torch.ops.eagle_kernels.compact_kv(*args, **kwargs)


@pytest.mark.gpu
def test_device_mismatch(op_impl):
    args, kwargs = good_args()
    args[3] = args[3].cuda()
    with pytest.raises(ValueError, match="accept_nodes"):
        op_impl("compact_kv")(*args, **kwargs)
