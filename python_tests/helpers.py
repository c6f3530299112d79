"""Helpers shared by several test modules (tiny models, random trees, naive numpy kernels, fp32
error bounds). Test modules import from here, never from each other."""

import dataclasses
import functools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from eagle_kernels import _dispatch, reference
from eagle_kernels._types import VerifyOutput
from eagle_kernels.decoder import TreeConfig
from eagle_kernels.models.eagle_head import EagleHead
from eagle_kernels.reference.verify import mass_strictly_above, sampling_probs


# -------------------------------------------------------------------------------- models
def tiny_hf_model(dtype, rope_scaling=None, tie=False, seed=0):
    """A 3-layer random Llama of transformers (vocab 97, hidden 64), every weight perturbed."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rope_theta=5000.0,
        rope_scaling=rope_scaling, tie_word_embeddings=tie, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    with torch.no_grad():  # default init leaves norms at 1; make every weight matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


# -------------------------------------------------------------------------------- decoding
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [20, 21, 22, 23, 24, 25, 26]]


def launch_counted_decoder(tree: TreeConfig, coupled_sampling: bool = False):
    """A decoder of a 3-layer bf16 target and a random EAGLE-3 head whose steps the launch counter
    (eagle_kernels/launch_count.py) can run on the GPU code path (``StaticPolicy``, with coupled
    sampling if asked); skips where it cannot (Triton needs TRITON_INTERPRET=1 on CPU tensors, the
    native ops their CPU kernels)."""
    from eagle_kernels.decoder import SpeculativeDecoder
    from eagle_kernels.models import LlamaModel
    from eagle_kernels.policy import StaticPolicy

    if _dispatch.implementation("rmsnorm", "triton", "cpu")[0] is None:
        pytest.skip("triton runs CPU tensors only under TRITON_INTERPRET=1")
    if not _dispatch.HAS_CPP:
        pytest.skip("the native ops run their CPU kernels while counted")
    torch.manual_seed(0)
    target = LlamaModel.from_transformers(tiny_hf_model(torch.float32), dtype=torch.bfloat16)
    head = EagleHead.random(target, "eagle3", draft_vocab_size=60)
    return SpeculativeDecoder(target, head, tree, policy=StaticPolicy(coupled_sampling=coupled_sampling),
                              cuda_graph=False)


def repeat_head(target):
    """An EAGLE-1 head whose output is its input feature: it drafts "the token the target
    predicted for the parent", i.e. a repetition — often right on a tiny random model that
    falls into loops, so acceptance paths get exercised deterministically."""
    head = EagleHead.random(target, "eagle1")
    H = target.config.hidden_size
    w = head.weights
    w["fc.weight"] = torch.cat([torch.zeros(H, H), torch.eye(H)], dim=1).to(w["fc.weight"])
    w["fc.bias"].zero_()
    w["layers.0.self_attn.o_proj.weight"].zero_()
    w["layers.0.mlp.down_proj.weight"].zero_()
    return head


HEADS = {
    "eagle1-random": lambda t: EagleHead.random(t, "eagle1"),
    "eagle3-random": lambda t: EagleHead.random(t, "eagle3", draft_vocab_size=60),
    "eagle1-repeat": repeat_head,
}


TREES = [TreeConfig(3, 3, 8), TreeConfig(4, 2, 7), TreeConfig(2, 2, 3, lookup=4)]


# -------------------------------------------------------------------------------- tree_attention
def random_history(C, gen):
    """A valid candidate history: parents before children, children never outscore parents."""
    parents = torch.empty(C, dtype=torch.int32)
    scores = torch.empty(C, dtype=torch.float32)
    for c in range(C):
        p = (-1 if c == 0 or float(torch.rand(1, generator=gen)) < 0.25
             else int(torch.randint(0, c, (1,), generator=gen)))
        parents[c] = p
        base = 0.0 if p < 0 else float(scores[p])
        scores[c] = base - float(torch.empty(1).exponential_(1.0, generator=gen)) - 1e-3
    return parents, scores


def random_tree(B, N, seed):
    """Tree from ``reference.build_tree`` over a random candidate history of every request."""
    gen = torch.Generator().manual_seed(seed)
    C = max(N - 1, 1) + 16
    histories = [random_history(C, gen) for _ in range(B)]
    cand_parents = torch.stack([h[0] for h in histories])
    cand_scores = torch.stack([h[1] for h in histories])
    cand_tokens = torch.randint(0, 1000, (B, C), generator=gen)
    roots = torch.randint(0, 1000, (B,), generator=gen)
    return reference.build_tree(roots, cand_tokens, cand_scores, cand_parents, N)


# -------------------------------------------------------------------------------- cpu_decoder_layer
def decoder_layer_inputs(B, N, H, num_heads, Hkv, D, inter, capacity, generator, weight_dtype=torch.float32,
                         tree_mask=None, prefix=(2, 5), embed=False, slot_offset=0):
    """Arguments of cpu_decoder_layer: random weights, a cache holding ``prefix`` tokens per
    request, the RoPE angles of positions ``prefix + i``; ``embed``: an EAGLE-3 layer (embedding
    input, 2H-wide q/k/v weight)."""
    g = generator

    def mat(rows, cols):
        return (torch.randn(rows, cols, generator=g) / cols**0.5).to(weight_dtype)

    x = torch.randn(B, N, H, generator=g)
    k = torch.randn(B, capacity, Hkv, D, generator=g)
    v = torch.randn(B, capacity, Hkv, D, generator=g)
    seqlens = torch.tensor(prefix[:B], dtype=torch.int32)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = (seqlens[:, None].double() + torch.arange(N))[..., None] * inv_freq
    angles = torch.cat([angles, angles], -1)
    attn_in = 2 * H if embed else H
    args = (x, 1 + 0.1 * torch.randn(H, generator=g), mat((num_heads + 2 * Hkv) * D, attn_in), mat(H, num_heads * D),
            1 + 0.1 * torch.randn(H, generator=g), mat(2 * inter, H), mat(H, inter), angles.cos().float(),
            angles.sin().float(), k, v, seqlens, tree_mask)
    kwargs = {"num_heads": num_heads, "eps": 1e-5}
    if embed:
        kwargs.update(embed=torch.randn(B, N, H, generator=g), embed_norm=1 + 0.1 * torch.randn(H, generator=g))
    if slot_offset:
        kwargs["slot_offset"] = slot_offset
    return args, kwargs


def decoder_stack_inputs(L, B, N, H, num_heads, Hkv, D, inter, capacity, generator, weight_dtype=torch.float32,
                         tree_mask=None, prefix=(2, 5), state_layers=()):
    """Arguments of cpu_decoder_layers: L layers of :func:`decoder_layer_inputs` (each its own random weights and
    cache), the first one's x, RoPE angles and lengths, the caches stacked into [L, B, S, Hkv, D]."""
    layers = [decoder_layer_inputs(B, N, H, num_heads, Hkv, D, inter, capacity, generator, weight_dtype, tree_mask,
                                   prefix)[0] for _ in range(L)]
    first = layers[0]
    lists = [[layer[i] for layer in layers] for i in range(1, 7)]
    caches = [torch.stack([layer[i] for layer in layers]) for i in (9, 10)]
    args = (first[0], *lists, first[7], first[8], *caches, first[11], tree_mask)
    return args, {"num_heads": num_heads, "eps": 1e-5, "state_layers": list(state_layers)}


# -------------------------------------------------------------------------------- draft_expand
# Scores are float32 outputs computed in float32 (float64 for float64 logits); the input dtype
# only quantises the logits, which the naive computation sees identically.
SCORE_TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-5),
    torch.float16: dict(atol=1e-4, rtol=1e-5),
    torch.bfloat16: dict(atol=1e-4, rtol=1e-5),
    torch.float64: dict(atol=1e-5, rtol=1e-6),
}


def naive_log_softmax(row: np.ndarray) -> np.ndarray:
    """float64 log_softmax of one row, -inf entries kept as -inf."""
    row = row.astype(np.float64)
    finite = np.isfinite(row)
    peak = row[finite].max()
    lse = peak + np.log(np.exp(row[finite] - peak).sum())
    return row - lse


def rank_desc(values: np.ndarray) -> np.ndarray:
    """Indices by value descending, ties by smaller index (np.lexsort: last key is primary)."""
    return np.lexsort((np.arange(values.shape[0]), -values))


def naive_draft_expand(logits, frontier_scores, top_k, d2t=None):
    """(tokens int64 [B, M*k], scores float64 [B, M*k], frontier int64 [B, k]) in numpy."""
    x = logits.double().numpy()
    fs = frontier_scores.double().numpy()
    B, M, _ = x.shape
    tokens = np.zeros((B, M * top_k), dtype=np.int64)
    scores = np.zeros((B, M * top_k), dtype=np.float64)
    frontier = np.zeros((B, top_k), dtype=np.int64)
    for b in range(B):
        for m in range(M):
            logp = naive_log_softmax(x[b, m])
            ids = rank_desc(logp)[:top_k]
            tokens[b, m * top_k:(m + 1) * top_k] = ids if d2t is None else ids + d2t.numpy()[ids]
            scores[b, m * top_k:(m + 1) * top_k] = fs[b, m] + logp[ids]
        frontier[b] = rank_desc(scores[b])[:top_k]
    return tokens, scores, frontier


def planted_logits(B, M, V, top_k, dtype, seed):
    """Random logits in [-4, 4] with the top ``top_k`` of every row planted at random ids with
    gaps of 0.5 (exact in every dtype), so the per-row ranking is unambiguous."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, M, V, generator=gen, dtype=torch.float64) * 1.5).clamp(-4, 4)
    for b in range(B):
        for m in range(M):
            ids = torch.randperm(V, generator=gen)[:top_k]
            shift = 0.25 * int(torch.randint(0, 4, (1,), generator=gen))
            logits[b, m, ids] = 5.0 + shift + 0.5 * torch.arange(top_k - 1, -1, -1, dtype=torch.float64)
    return logits.to(dtype)


def random_frontier_scores(B, M, seed):
    gen = torch.Generator().manual_seed(seed + 1)
    return -3.0 * torch.rand(B, M, generator=gen, dtype=torch.float32)


def check_invariants(out, frontier_scores, top_k, V, d2t=None):
    tokens, scores, frontier = out[:3]
    B, M = frontier_scores.shape
    assert tokens.dtype == torch.int64 and tokens.shape == (B, M * top_k)
    assert scores.dtype == torch.float32 and scores.shape == (B, M * top_k)
    assert frontier.dtype == torch.int32 and frontier.shape == (B, top_k)
    per_node = scores.view(B, M, top_k)
    finite = per_node.isfinite()
    diffs = per_node[..., 1:] - per_node[..., :-1]
    # Non-increasing along r (compare only where both entries are finite; -inf tails are fine).
    assert bool(((diffs <= 0) | ~(finite[..., 1:] & finite[..., :-1])).all())
    assert bool((per_node <= frontier_scores[..., None] + 1e-5).all())
    if d2t is None:
        assert bool(((tokens >= 0) & (tokens < V)).all())
    assert bool(((frontier >= 0) & (frontier < M * top_k)).all())
    for row in frontier:
        assert len(set(row.tolist())) == top_k


def check_frontier(frontier, scores, naive_scores, top_k, tol):
    """The frontier is the top ``top_k`` of the op's own scores (ties: smaller index), and,
    against the float64 scores, exact wherever no two relevant scores are within ``tol``."""
    for b in range(frontier.shape[0]):
        own = scores[b].double().numpy()
        np.testing.assert_array_equal(frontier[b].numpy(), rank_desc(own)[:top_k])
        exact = naive_scores[b]
        order = rank_desc(exact)
        wanted = order[: min(top_k + 1, len(order))]
        gaps = np.diff(exact[wanted])
        finite_gaps = gaps[np.isfinite(gaps)]
        if np.all(np.abs(finite_gaps) > 10 * tol) and np.all(np.isfinite(exact[wanted])):
            np.testing.assert_array_equal(frontier[b].numpy(), order[:top_k])
        else:
            np.testing.assert_allclose(exact[frontier[b].numpy()], exact[order[:top_k]], atol=tol)


def assert_matches(out, naive, expect_ref, dtype, top_k):
    tokens, scores, frontier = out[:3]
    n_tokens, n_scores, _ = naive
    tol = SCORE_TOL[dtype]
    np.testing.assert_array_equal(tokens.numpy(), n_tokens)
    torch.testing.assert_close(scores.double(), torch.from_numpy(n_scores), **tol)
    check_frontier(frontier, scores, n_scores, top_k, tol["atol"])
    torch.testing.assert_close(tokens, expect_ref.tokens, rtol=0, atol=0)
    torch.testing.assert_close(scores, expect_ref.scores, **tol)


# -------------------------------------------------------------------------------- cpu_linear
ISA_ENV = "EAGLE_KERNELS_CPU_ISA"


WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def avx2_available():
    """Whether the CPU has AVX2+FMA (ATen's own dispatch says so); without them the C++ op
    runs its scalar loops whatever EAGLE_KERNELS_CPU_ISA says."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512", "AVX512_BF16", "AMX")


def avx512_available():
    """Whether the CPU has AVX-512 F and VL (ATen's AVX512 level requires them)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16", "AMX")


def isa_available(isa):
    """Whether this CPU runs the ``EAGLE_KERNELS_CPU_ISA`` level ``isa`` (scalar: always)."""
    if isa == "avx2":
        return avx2_available()
    return avx512_available() if isa.startswith("avx512") else True


def skip_unavailable_isa(isa):
    if not isa_available(isa):
        pytest.skip("no AVX2+FMA on this CPU (or in this build)" if isa == "avx2" else "no AVX-512 on this CPU")


@functools.cache
def weight(N, K, dtype_name):
    g = torch.Generator().manual_seed(N * 7919 + K)
    return torch.randn(N, K, generator=g).to(WEIGHT_DTYPES[dtype_name])


@functools.cache
def _activations(M, K):
    g = torch.Generator().manual_seed(M * 131 + K)
    return torch.randn(M, K, generator=g)


def activations(M, K):
    """Test rows of x [M, K] (a fresh copy of a cached tensor: tests may write into it)."""
    return _activations(M, K).clone()


# ------------------------------------------------------------------ quantized cpu_linear weights
QUANT_FORMATS = ["q8_0", "q4_1"]
LINEAR_ISAS = ["avx512", "avx512-ymm", "avx2", "scalar"]  # every path of the packed kernels


@functools.cache
def quant_blocks(N, K, fmt):
    """GGML block rows of the test weight [N, K] (cached: the quantizer is slow next to the kernels)."""
    from eagle_kernels.reference.cpu_linear import quantize

    return quantize(weight(N, K, "fp32"), fmt)


def quant_grid(ms, ns, ks):
    """Parametrises a test over the quantized formats and the shapes M (rows of x), N, K, with readable ids."""

    def mark(test):
        for name, values in (("M", ms), ("K", ks), ("N", ns)):
            test = pytest.mark.parametrize(name, values, ids=[f"{name}{v}" for v in values])(test)
        return pytest.mark.parametrize("fmt", QUANT_FORMATS)(test)

    return mark


def native_cpu_linear():
    """The C++ cpu_linear (skips where the extension is not built)."""
    fn, reason = _dispatch.implementation("cpu_linear", "cpp", "cpu")
    if fn is None:
        pytest.skip(reason)
    return fn


def assert_every_isa_gives(want, fn, x, w, isas, monkeypatch):
    """``fn(x, w)`` is ``want`` bit for bit with each of ``isas`` that this CPU has forced (an AVX2 CPU compares its
    AVX2 and scalar paths; skips where fewer than two of them run)."""
    ran = [isa for isa in isas if isa_available(isa)]
    if len(ran) < 2:
        pytest.skip(f"fewer than two of {isas} run on this CPU")
    for isa in ran:
        monkeypatch.setenv(ISA_ENV, isa)
        assert torch.equal(fn(x, w), want), isa


def assert_non_finite_row_stays_alone(linear, w):
    """A row of x [3, K] holding inf gives nan outputs (as the fp32 kernels give non-finite ones); the other rows
    are untouched (the quantized kernels put each row's blocks in their form alone)."""
    x = activations(3, w.shape[2] * 32)
    want = linear(x, w)
    x[1, 50] = float("inf")
    got = linear(x, w)
    assert got[1].isnan().all()
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])


def assert_rows_batch_invariant(fn, x, w):
    """A row of ``fn(x, w)`` does not depend on the other rows: each row alone, and a slice, give the batch's
    bits (a verify pass gives each token what decoding it alone gives)."""
    batch = fn(x, w)
    for m in range(x.shape[0]):
        assert torch.equal(fn(x[m:m + 1], w)[0], batch[m]), m
    assert torch.equal(fn(x[2:7], w), batch[2:7])


def assert_within_fp32_bound(got, x, w):
    """|got - exact| <= (K + 2) u sum_k |x_k w_k| + tiny: the first-order worst case of fp32
    dot products in any order (u = 2^-24), so the check cannot be flaky. bf16 and fp16 weights
    widen exactly, so the exact value uses the widened weight."""
    exact = F.linear(x.double(), w.double())
    K = x.shape[-1]
    bound = (K + 2) * 2.0**-24 * F.linear(x.double().abs(), w.double().abs()) + 1e-30
    err = (got.double() - exact).abs()
    assert got.dtype == torch.float32 and got.shape == exact.shape
    worst = float((err / bound).max()) if err.numel() else 0.0
    assert worst <= 1.0, f"error {worst:.3g} x the fp32 bound"


# -------------------------------------------------------------------------------- build_tree
NAN = float("nan")


NINF = float("-inf")


def mask_of(parents):
    """int64 mask rows [N, W] from a hand-written parent list (ancestors incl. self)."""
    n = len(parents)
    words = (n + 63) // 64
    rows = []
    for i in range(n):
        row = [0] * words
        j = i
        while j >= 0:
            row[j // 64] |= 1 << (j % 64)
            j = parents[j]
        rows.append([w - (1 << 64) if w >= 1 << 63 else w for w in row])
    return rows


def simulate_history(B, depth, top_k, seed, *, nan_prob=0.0, ninf_prob=0.0, quantum=None):
    """EAGLE-2 expansion history as draft_expand + frontier selection would produce it.

    Depth 1 expands the root (score 0) into ``top_k`` candidates; every later depth expands
    the ``top_k`` best candidates of the previous depth (score desc, NaN as -inf, ties by
    index) into ``top_k`` children each. Child score = parent score + logp with logp <= 0
    (float32 addition is monotone, so no child outscores its parent). ``quantum`` rounds logp
    to multiples of it, which makes exact score ties common. NaN / -inf logps propagate to
    the whole subtree, as they do in a real history.
    """
    g = torch.Generator().manual_seed(seed)
    tokens, scores, parents = [], [], []
    frontier = [(-1, torch.zeros(B, dtype=torch.float32))]  # (parent index, score [B])
    level_start = 0
    for d in range(depth):
        level_scores = []
        for m, (parent, pscore) in enumerate(frontier):
            logp = -torch.rand(B, top_k, generator=g, dtype=torch.float32) * 3.0
            if quantum is not None:
                logp = (logp / quantum).round() * quantum
            logp = logp.sort(dim=1, descending=True).values  # r-th most likely first
            special = torch.rand(B, top_k, generator=g)
            logp[special < nan_prob] = NAN
            logp[(special >= nan_prob) & (special < nan_prob + ninf_prob)] = NINF
            child = (pscore[:, None] + logp).to(torch.float32)
            for r in range(top_k):
                parents.append(parent if isinstance(parent, torch.Tensor) else
                               torch.full((B,), parent, dtype=torch.int32))
                scores.append(child[:, r])
                tokens.append(torch.randint(0, 1000, (B,), generator=g))
                level_scores.append(child[:, r])
        if d == depth - 1:
            break
        # Frontier of the next depth: top_k of this level, per request.
        level = torch.stack(level_scores, dim=1)  # [B, len(frontier) * top_k]
        # Not nan_to_num: it would also turn -inf into the lowest finite float.
        key = torch.where(level.isnan(), NINF, level)
        order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :top_k]
        frontier = [((level_start + order[:, m]).to(torch.int32),
                     torch.gather(level, 1, order[:, m:m + 1])[:, 0]) for m in range(top_k)]
        level_start += level.shape[1]
    root = torch.randint(0, 1000, (B,), generator=g)
    return (root, torch.stack(tokens, 1), torch.stack(scores, 1).to(torch.float32),
            torch.stack(parents, 1).to(torch.int32))


# -------------------------------------------------------------------------------- cpu_decoder_layer
# (num_heads, Hkv, D, H, I): SmolLM2-135M's layer, and a small one with a head dim of 16.
DECODER_LAYERS = {"smollm2": (9, 3, 64, 576, 1536), "small": (4, 2, 16, 40, 24)}


def native_decoder_layer():
    fn, reason = _dispatch.implementation("cpu_decoder_layer", "cpp", "cpu")
    if fn is None:
        pytest.skip(reason)
    return fn


def decoder_layer_case(layer, B, N, prefix, weight_dtype, tree, seed=0, embed=False, slot_offset=0):
    num_heads, Hkv, D, H, inter = DECODER_LAYERS[layer]
    mask = random_tree(B, slot_offset + N, seed).mask if tree else None
    g = torch.Generator().manual_seed(seed)
    return decoder_layer_inputs(B, N, H, num_heads, Hkv, D, inter, capacity=prefix + slot_offset + N + 3,
                                generator=g, weight_dtype=WEIGHT_DTYPES[weight_dtype], tree_mask=mask,
                                prefix=(prefix, max(prefix - 5, 0), prefix + 2)[:B], embed=embed,
                                slot_offset=slot_offset)


def clone_args(args):
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def check_decoder_layer(case, N, slot_offset=0, tol=2e-5):
    """The C++ layer against the reference (output and caches within ``tol``), the cache outside the new slots
    untouched."""
    fn = native_decoder_layer()
    args, kwargs = case
    want_args, original = clone_args(args), clone_args(args)
    got = fn(*args, **kwargs)
    want = reference.cpu_decoder_layer(*want_args, **kwargs)
    assert got.dtype == torch.float32 and got.shape == args[0].shape
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for cache, ref_cache in ((args[9], want_args[9]), (args[10], want_args[10])):
        torch.testing.assert_close(cache, ref_cache, rtol=tol, atol=tol)
    untouched = torch.ones(args[9].shape[:2], dtype=torch.bool)
    for b, start in enumerate(args[11].tolist()):
        untouched[b, start + slot_offset:start + slot_offset + N] = False
    assert torch.equal(args[9][untouched], original[9][untouched])
    assert torch.equal(args[10][untouched], original[10][untouched])


# -------------------------------------------------------------------------------- verify
def top_p_margin(logits, sampling):
    """Smallest |mass strictly above x - top_p| over every row of the sampling requests (the
    reference's probabilities): inputs with a margin below 1e-6 are within rounding of a
    top-p decision and are skipped."""
    margin = np.inf
    for b in range(logits.shape[0]):
        t, k, p = float(sampling["temperature"][b]), int(sampling["top_k"][b]), float(sampling["top_p"][b])
        if t == 0.0 or p >= 1.0:
            continue
        for u in range(logits.shape[1]):
            probs = sampling_probs(logits[b, u], t, k, 1.0)
            margin = min(margin, float((mass_strictly_above(probs) - p).abs().min()))
    return margin


# -------------------------------------------------------------------------------- tree_attention (paged)
def attention_inputs(B, N, prefix, heads, D, dtype, page, seed):
    """Requests at different committed lengths; paged caches use a shuffled block table over a
    pool with spare pages, and every position no request may read holds NaN."""
    Hq, Hkv = heads
    gen = torch.Generator().manual_seed(seed)
    seqlens = torch.tensor([max(prefix - 3 * b, 0) for b in range(B)], dtype=torch.int32)
    seqlens[-1] = prefix
    capacity = prefix + N + 5
    q = torch.randn(B, N, Hq, D, generator=gen).to(dtype)
    if page is None:
        shape = (B, capacity, Hkv, D)
        table = None
    else:
        pages = math.ceil(capacity / page)
        pool = B * pages + 3
        shape = (pool, page, Hkv, D)
        table = torch.randperm(pool, generator=gen)[: B * pages].view(B, pages).to(torch.int32)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    keep = torch.zeros(shape[:2], dtype=torch.bool)
    for b in range(B):
        t = torch.arange(int(seqlens[b]) + N)
        if table is None:
            keep[b, t] = True
        else:
            keep[table[b].long()[t // page], t % page] = True
    k[~keep] = float("nan")
    v[~keep] = float("nan")
    return q, k, v, seqlens, table


# ---------------------------------------------------------------- verify (the random stream on Python ints)
_M32 = 0xFFFFFFFF


def philox_py(counter, key):
    """Philox4x32-10 on Python ints, written from docs/design.md independently of the reference."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for round_index in range(10):
        if round_index:
            k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & _M32, (p0 >> 32) ^ c3 ^ k1, p0 & _M32
    return c0, c1, c2, c3


def uniform_py(seed, offset, node, draw):
    """The stream's U for one (seed, offset, node, draw), as a 0-d float64 tensor like
    reference.uniform; about 200x faster than the reference's tensor arithmetic on scalars."""
    seed, offset = int(seed), int(offset)
    w0, w1, _, _ = philox_py((offset & _M32, (offset >> 32) & _M32, int(node), int(draw)),
                             (seed & _M32, (seed >> 32) & _M32))
    return torch.tensor(((w0 >> 5) * 2**26 + (w1 >> 6)) * 2.0**-53, dtype=torch.float64)


def softmax_np(z):
    """float64 softmax of a numpy vector, -inf entries giving 0."""
    z = np.asarray(z, dtype=np.float64)
    e = np.exp(z - z[np.isfinite(z)].max())
    return e / e.sum()


def assert_same(a, b, what=""):
    """Two VerifyOutputs equal field by field, dtypes included."""
    for name, x, y in zip(VerifyOutput._fields, a, b):
        assert x.dtype == y.dtype and torch.equal(x, y), (what, name, x, y)


def triton_verify():
    """``eagle_kernels.triton.verify``, or a skip where Triton cannot run verify here."""
    fn, reason = _dispatch.implementation("verify", "triton", "cpu")
    if fn is None:
        pytest.skip(reason)
    from eagle_kernels.triton import verify

    return verify


def check_all_rows(tokens, parents, logits, max_depth, args=None, config=None, what=""):
    """Triton verify (``config``, or the launch's own) equal to the reference and to the walk alone
    (the all-rows kernels' byte limits at 0), field by field; returns the Triton output."""
    tv = triton_verify()
    args = args or {}
    got = tv.verify(tokens, parents, logits, max_depth=max_depth, **args, _config=config)
    assert_same(got, reference.verify(tokens, parents, logits, max_depth=max_depth, **args), what)
    walk_only = dataclasses.replace(config or tv.launch_config(), greedy_max_bytes=0, temperature_max_bytes=0)
    assert_same(got, tv.verify(tokens, parents, logits, max_depth=max_depth, **args, _config=walk_only),
                (what, "walk"))
    return got


def filtered_probs(logits, temperature, top_k, top_p):
    """The contract's p_u in float64 numpy, written independently of the reference."""
    z = np.asarray(logits, dtype=np.float64) / float(np.float32(temperature))
    if top_k > 0:
        strictly_larger = (z[None, :] > z[:, None]).sum(1)
        z = np.where(strictly_larger < top_k, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        mass_above = np.where(p[None, :] > p[:, None], p[None, :], 0.0).sum(1)
        p = np.where(mass_above < float(np.float32(top_p)), p, 0.0)
        p /= p.sum()
    return p
