"""Input validation and output shapes shared by every backend and by the fake kernels.

Each ``check_<op>`` takes the op's contract signature plus ``values``: whether to run the
checks that read tensor data (they synchronise with the host, so the dispatcher runs them on
CPU tensors by default and on CUDA tensors only with ``EAGLE_KERNELS_CHECK_VALUES=1``). Every
failure is a ``ValueError`` whose message starts with the name of the offending argument.
"""

from __future__ import annotations

import math
import os

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _fail(name: str, expected: str, got) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def is_int(value) -> bool:
    """A Python int and not a bool: ``True`` as a count or a depth is a caller's mistake. Stricter than
    the entry points' ``_inputs._is_int``, which also takes numpy integers: these are the ops' int
    arguments, which the C++ op schemas take as Python ints only."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_tensor(name, t, *, dtype=None, ndim=None, shape=None, device=None):
    """Validate one tensor argument. ``dtype`` may be a dtype or a tuple of dtypes; ``shape``
    entries may be ``None`` for "any size"."""
    if not isinstance(t, torch.Tensor):
        _fail(name, "a torch.Tensor", type(t).__name__)
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in allowed:
            _fail(name, "dtype " + " or ".join(str(d) for d in allowed), t.dtype)
    if ndim is not None and t.dim() != ndim:
        _fail(name, f"{ndim} dimensions", f"shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(e is not None and e != g for e, g in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
            _fail(name, f"shape {want}", f"shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        _fail(name, f"a tensor on {device} like the other inputs", f"one on {t.device}")


def values_checked(device: torch.device) -> bool:
    """Whether data-reading checks run for tensors on ``device``: ``EAGLE_KERNELS_CHECK_VALUES``
    = ``auto`` (default: CPU tensors only), ``1`` (always) or ``0`` (never, e.g. inside a
    decoding loop that must not synchronise)."""
    mode = os.environ.get("EAGLE_KERNELS_CHECK_VALUES", "auto")
    if mode == "auto":
        return device.type == "cpu"
    return mode == "1"


def _check_temperature_values(temperature) -> None:
    """Sampling temperatures: finite and >= 0 (0 is a greedy request)."""
    if bool((~torch.isfinite(temperature) | (temperature < 0)).any()):
        _fail("temperature", "finite values >= 0", temperature.tolist())


def _check_coupled_ids(d2t, n: int, device) -> None:
    """The target ids ``x + d2t[x]`` coupled sampling's stream is keyed by: in [0, 2^32)."""
    ids = torch.arange(n, device=device) + d2t
    if bool(((ids < 0) | (ids >= 1 << 32)).any()):
        _fail("d2t", "token ids x + d2t[x] in [0, 2^32)", ids.tolist())


def mask_words(num_nodes: int) -> int:
    """Number of int64 words per tree-mask row."""
    return (num_nodes + 63) // 64


def kv_capacity(k_cache, block_table, layered: bool = False) -> int:
    """Positions per request a cache can hold (contiguous: S; paged: pages * page_size)."""
    dims = k_cache.shape[1:] if layered else k_cache.shape
    if block_table is None:
        return dims[1]
    return block_table.shape[1] * dims[1]


def _check_kv_layout(k_cache, v_cache, cache_seqlens, block_table, batch, layered, device):
    """Shared by tree_attention (rank 4) and compact_kv (rank 4, or 5 with a layer dim)."""
    ndims = (4, 5) if layered else (4,)
    if k_cache.dim() not in ndims:
        want = " or ".join(str(n) for n in ndims)
        _fail("k_cache", f"{want} dimensions", f"shape {tuple(k_cache.shape)}")
    check_tensor("v_cache", v_cache, dtype=k_cache.dtype, shape=tuple(k_cache.shape), device=device)
    check_tensor("cache_seqlens", cache_seqlens, dtype=torch.int32, ndim=1, device=device)
    if batch is None:
        batch = cache_seqlens.shape[0]
    check_tensor("cache_seqlens", cache_seqlens, shape=(batch,))
    dims = k_cache.shape[1:] if k_cache.dim() == 5 else k_cache.shape
    if block_table is None:
        if dims[0] != batch:
            _fail("k_cache", f"batch dim {batch} (contiguous cache [B, S, Hkv, D])", f"shape {tuple(k_cache.shape)}")
    else:
        check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=device)
        check_tensor("block_table", block_table, shape=(batch, None))
    return batch


def _check_dense_head_dim(k_cache, v_cache):
    """The caches of tree_attention, write_kv and compact_kv: the head dim dense (stride 1), as their kernels
    read and write it (docs/ops.md §0); the native kernels raise the same."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.shape[-1] > 1 and cache.stride(-1) != 1:
            _fail(name, "a dense last (head) dim", f"strides {tuple(cache.stride())}")


def _check_kv_values(k_cache, cache_seqlens, block_table, needed, name_needed):
    """``needed`` [B]: positions each request must be able to address."""
    layered = k_cache.dim() == 5
    capacity = kv_capacity(k_cache, block_table, layered)
    if bool((cache_seqlens < 0).any()):
        _fail("cache_seqlens", "non-negative lengths", cache_seqlens.tolist())
    if bool((needed > capacity).any()):
        _fail("cache_seqlens", f"{name_needed} <= cache capacity {capacity}", needed.tolist())
    if block_table is not None:
        num_pages = k_cache.shape[1] if layered else k_cache.shape[0]
        page_size = k_cache.shape[2] if layered else k_cache.shape[1]
        # Pages of no positions hold nothing: capacity 0, so nothing may be needed (checked above).
        pages_used = (needed + page_size - 1) // page_size if page_size else torch.zeros_like(needed)
        cols = torch.arange(block_table.shape[1], device=block_table.device)
        used = cols[None, :] < pages_used[:, None]
        bad = used & ((block_table < 0) | (block_table >= num_pages))
        if bool(bad.any()):
            _fail("block_table", f"page ids in [0, {num_pages}) for the pages in use", block_table.tolist())


# --------------------------------------------------------------------------- tree_attention
def check_tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask=None, *, block_table=None,
                         sm_scale=None, values=True):
    check_tensor("q", q, dtype=FLOAT_DTYPES, ndim=4)
    device = q.device
    B, N, Hq, D = q.shape
    check_tensor("k_cache", k_cache, dtype=q.dtype, ndim=4, device=device)
    _check_kv_layout(k_cache, v_cache, cache_seqlens, block_table, B, False, device)
    _check_dense_head_dim(k_cache, v_cache)
    Hkv = k_cache.shape[2]
    if Hkv == 0 or Hq % Hkv != 0:
        _fail("k_cache", f"a KV head count dividing Hq = {Hq}", Hkv)
    if k_cache.shape[3] != D:
        _fail("k_cache", f"head dim {D} as in q", k_cache.shape[3])
    if tree_mask is not None:
        check_tensor("tree_mask", tree_mask, dtype=torch.int64, shape=(B, N, mask_words(N)), device=device)
    if sm_scale is not None and not isinstance(sm_scale, (float, int)):
        _fail("sm_scale", "a float or None", type(sm_scale).__name__)
    if sm_scale is not None and not math.isfinite(sm_scale):
        _fail("sm_scale", "a finite number", sm_scale)
    if values and values_checked(device):
        _check_kv_values(k_cache, cache_seqlens, block_table, cache_seqlens.long() + N,
                         "cache_seqlens + N")


def tree_attention_shape(q, *args, **kwargs):
    return q.shape


# ----------------------------------------------------------------------------- draft_expand
def check_draft_expand(logits, frontier_scores, top_k, *, d2t=None, temperature=None, seed=None, offset=None,
                       depth=0, values=True):
    check_tensor("logits", logits, dtype=FLOAT_DTYPES, ndim=3)
    B, M, V = logits.shape
    device = logits.device
    check_tensor("frontier_scores", frontier_scores, dtype=torch.float32, shape=(B, M), device=device)
    if not is_int(top_k) or not 1 <= top_k <= V:
        _fail("top_k", f"an int in [1, V = {V}]", top_k)
    if M == 0 or V == 0:
        _fail("logits", "at least one frontier node and one vocabulary entry", f"shape {tuple(logits.shape)}")
    if d2t is not None:
        check_tensor("d2t", d2t, dtype=torch.int64, shape=(V,), device=device)
    for name, t, dtype in (("temperature", temperature, torch.float32), ("seed", seed, torch.int64),
                           ("offset", offset, torch.int64)):
        if t is not None:
            check_tensor(name, t, dtype=dtype, shape=(B,), device=device)
    # The Gumbel draws' counter holds depth and the frontier row in 32 bits (docs/ops.md §2).
    if not is_int(depth) or not 0 <= depth < DRAFT_DEPTH_LIMIT:
        _fail("depth", f"an int in [0, {DRAFT_DEPTH_LIMIT})", depth)
    if M > DRAFT_ROW_LIMIT:
        _fail("logits", f"at most {DRAFT_ROW_LIMIT} frontier nodes (M)", f"shape {tuple(logits.shape)}")
    if temperature is not None and values and values_checked(device):
        _check_temperature_values(temperature)


DRAFT_DEPTH_LIMIT = 65535
DRAFT_ROW_LIMIT = 65536


def draft_expand_shapes(logits, frontier_scores, top_k, **_):
    """Shapes of (tokens, scores, frontier, logprobs)."""
    B, M, _V = logits.shape
    return (B, M * top_k), (B, M * top_k), (B, top_k), (B, M * top_k)


# ------------------------------------------------------------------------------- build_tree
def check_build_tree(root_tokens, cand_tokens, cand_scores, cand_parents, num_nodes, *, values=True):
    check_tensor("cand_tokens", cand_tokens, dtype=torch.int64, ndim=2)
    B, C = cand_tokens.shape
    device = cand_tokens.device
    check_tensor("root_tokens", root_tokens, dtype=torch.int64, shape=(B,), device=device)
    check_tensor("cand_scores", cand_scores, dtype=torch.float32, shape=(B, C), device=device)
    check_tensor("cand_parents", cand_parents, dtype=torch.int32, shape=(B, C), device=device)
    if not is_int(num_nodes) or num_nodes < 1:
        _fail("num_nodes", "an int >= 1", num_nodes)
    if num_nodes - 1 > C:
        _fail("num_nodes", f"num_nodes - 1 <= C = {C} candidates in cand_tokens", num_nodes)
    if values and values_checked(device) and C > 0:
        index = torch.arange(C, device=device, dtype=torch.int32)
        if bool(((cand_parents < -1) | (cand_parents >= index)).any()):
            _fail("cand_parents", "-1 <= cand_parents[b, c] < c", cand_parents.tolist())
        # The contract's closure argument (selection contains every selected node's
        # ancestors) needs children never to outscore their parents.
        scores = torch.where(cand_scores.isnan(), float("-inf"), cand_scores)
        parent_scores = torch.gather(scores, 1, cand_parents.clamp(min=0).long())
        outscores = (cand_parents >= 0) & (scores > parent_scores)
        if bool(outscores.any()):
            b, c = (int(i) for i in outscores.nonzero()[0])
            _fail("cand_scores", "no candidate scoring above its parent",
                  f"candidate {c} of request {b} above its parent {int(cand_parents[b, c])}")


def build_tree_shapes(root_tokens, cand_tokens, cand_scores, cand_parents, num_nodes):
    B = cand_tokens.shape[0]
    return (B, num_nodes), (B, num_nodes), (B, num_nodes), (B, num_nodes, mask_words(num_nodes))


# ----------------------------------------------------------------------------------- verify
def _check_sampling_values(temperature, top_k, top_p):
    """Per-request sampling parameters of verify and block_verify: temperatures >= 0 (finite),
    top_k >= 0, top_p in (0, 1]."""
    if temperature is not None:
        _check_temperature_values(temperature)
    if top_k is not None and bool((top_k < 0).any()):
        _fail("top_k", "values >= 0", top_k.tolist())
    if top_p is not None and bool(((top_p <= 0) | (top_p > 1) | torch.isnan(top_p)).any()):
        _fail("top_p", "values in (0, 1]", top_p.tolist())


def _check_draft_rows(draft_probs, d2t, B, N, V, device, draft_sampled=None):
    """The draft rows of verify (§4) and block_verify (§21): ``draft_probs`` float32 [B, N, Vd] with
    ``Vd = V`` unless ``d2t`` int64 [Vd] maps them; ``d2t`` (and verify's ``draft_sampled`` bool
    [B, N]) only with them."""
    if draft_probs is None:
        for name, t in (("draft_sampled", draft_sampled), ("d2t", d2t)):
            if t is not None:
                _fail(name, "None when draft_probs is None (it qualifies the draft distributions)",
                      f"a {type(t).__name__}")
        return
    check_tensor("draft_probs", draft_probs, dtype=torch.float32, ndim=3, device=device)
    if tuple(draft_probs.shape[:2]) != (B, N):
        _fail("draft_probs", f"shape [B = {B}, N = {N}, Vd]", f"shape {tuple(draft_probs.shape)}")
    Vd = draft_probs.shape[2]
    if d2t is None and Vd != V:
        _fail("draft_probs", f"Vd = V = {V} (the target vocabulary) without d2t", f"shape {tuple(draft_probs.shape)}")
    if Vd == 0:
        _fail("draft_probs", "at least one draft vocabulary entry", f"shape {tuple(draft_probs.shape)}")
    if d2t is not None:
        check_tensor("d2t", d2t, dtype=torch.int64, shape=(Vd,), device=device)
    if draft_sampled is not None:
        check_tensor("draft_sampled", draft_sampled, dtype=torch.bool, shape=(B, N), device=device)


def check_verify(tokens, parents, target_logits, *, max_depth, temperature=None, top_k=None,
                 top_p=None, seed=None, offset=None, draft_probs=None, draft_sampled=None, d2t=None, positions=None,
                 values=True):
    check_tensor("target_logits", target_logits, dtype=FLOAT_DTYPES, ndim=3)
    B, N, V = target_logits.shape
    device = target_logits.device
    check_tensor("tokens", tokens, dtype=torch.int64, shape=(B, N), device=device)
    check_tensor("parents", parents, dtype=torch.int32, shape=(B, N), device=device)
    # accept_len (int32) holds up to max_depth accepted nodes
    if not is_int(max_depth) or not 0 <= max_depth <= 2**31 - 1:
        _fail("max_depth", "an int in [0, 2**31 - 1]", max_depth)
    if N == 0 or V == 0:
        _fail("target_logits", "at least one node and one vocabulary entry", f"shape {tuple(target_logits.shape)}")
    optional = (("temperature", temperature, torch.float32), ("top_k", top_k, torch.int32),
                ("top_p", top_p, torch.float32), ("seed", seed, torch.int64),
                ("offset", offset, torch.int64), ("positions", positions, torch.int64))
    for name, t, dtype in optional:
        if t is not None:
            check_tensor(name, t, dtype=dtype, shape=(B,), device=device)
    _check_draft_rows(draft_probs, d2t, B, N, V, device, draft_sampled=draft_sampled)
    if not (values and values_checked(device)):
        return
    index = torch.arange(N, device=device, dtype=torch.int32)
    if bool((parents[:, 0] != -1).any()):
        _fail("parents", "parents[:, 0] == -1 (node 0 is the root)", parents[:, 0].tolist())
    if N > 1 and bool(((parents[:, 1:] < 0) | (parents[:, 1:] >= index[1:])).any()):
        _fail("parents", "0 <= parents[b, i] < i for i >= 1", parents.tolist())
    if N > 1 and bool(((tokens[:, 1:] < 0) | (tokens[:, 1:] >= V)).any()):
        _fail("tokens", f"draft tokens in [0, V = {V})", tokens.tolist())
    _check_sampling_values(temperature, top_k, top_p)


def check_block_verify(tokens, target_logits, draft_probs=None, *, num_drafts=None, temperature=None, top_k=None,
                       top_p=None, seed=None, offset=None, d2t=None, values=True):
    check_tensor("target_logits", target_logits, dtype=FLOAT_DTYPES, ndim=3)
    B, N, V = target_logits.shape
    device = target_logits.device
    check_tensor("tokens", tokens, dtype=torch.int64, shape=(B, N), device=device)
    if N == 0 or V == 0:
        _fail("target_logits", "at least one node and one vocabulary entry", f"shape {tuple(target_logits.shape)}")
    optional = (("num_drafts", num_drafts, torch.int32), ("temperature", temperature, torch.float32),
                ("top_k", top_k, torch.int32), ("top_p", top_p, torch.float32), ("seed", seed, torch.int64),
                ("offset", offset, torch.int64))
    for name, t, dtype in optional:
        if t is not None:
            check_tensor(name, t, dtype=dtype, shape=(B,), device=device)
    _check_draft_rows(draft_probs, d2t, B, N, V, device)
    if not (values and values_checked(device)):
        return
    if num_drafts is not None and bool(((num_drafts < 0) | (num_drafts > N - 1)).any()):
        _fail("num_drafts", f"values in [0, N - 1 = {N - 1}]", num_drafts.tolist())
    if N > 1:
        drafted = torch.arange(1, N, device=device)[None, :] <= (
            N - 1 if num_drafts is None else num_drafts[:, None])
        if bool((drafted & ((tokens[:, 1:] < 0) | (tokens[:, 1:] >= V))).any()):
            _fail("tokens", f"draft tokens in [0, V = {V}) in nodes 1 .. num_drafts", tokens.tolist())
    _check_sampling_values(temperature, top_k, top_p)


def block_verify_shapes(tokens, target_logits, *_, **__):
    B, N = target_logits.shape[:2]
    return (B,), (B, N), (B, N), (B,)


def check_coupled_noise(seed, positions, num_tokens, *, d2t=None, values=True):
    check_tensor("seed", seed, dtype=torch.int64, ndim=1)
    B, device = seed.shape[0], seed.device
    check_tensor("positions", positions, dtype=torch.int64, ndim=2, device=device)
    if positions.shape[0] != B:
        _fail("positions", f"shape [B = {B}, W]", f"shape {tuple(positions.shape)}")
    if not is_int(num_tokens) or not 1 <= num_tokens <= 1 << 32:
        _fail("num_tokens", "an int in [1, 2^32]", num_tokens)
    if d2t is not None:
        check_tensor("d2t", d2t, dtype=torch.int64, shape=(num_tokens,), device=device)
        if values and values_checked(device):
            _check_coupled_ids(d2t, num_tokens, device)


def coupled_noise_shape(seed, positions, num_tokens, **_):
    return (seed.shape[0], positions.shape[1], num_tokens)


DRAFT_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_coupled_draft_logits(logits, temperature, seed, positions, *, d2t=None, values=True):
    check_tensor("logits", logits, dtype=DRAFT_LOGIT_DTYPES, ndim=3)
    B, n, device = logits.shape[0], logits.shape[2], logits.device
    if n == 0:
        _fail("logits", "a vocabulary of at least one entry [B, M, n >= 1]", f"shape {tuple(logits.shape)}")
    check_tensor("temperature", temperature, dtype=torch.float32, shape=(B,), device=device)
    check_tensor("seed", seed, dtype=torch.int64, shape=(B,), device=device)
    check_tensor("positions", positions, dtype=torch.int64, shape=(B,), device=device)
    if d2t is not None:
        check_tensor("d2t", d2t, dtype=torch.int64, shape=(n,), device=device)
    if not (values and values_checked(device)):
        return
    _check_temperature_values(temperature)
    if d2t is not None:
        _check_coupled_ids(d2t, n, device)


def verify_shapes(tokens, parents, target_logits, *, max_depth, **_):
    B = target_logits.shape[0]
    return (B,), (B, max_depth + 1), (B, max_depth + 1), (B,)


# ------------------------------------------------------------------------------- compact_kv
def check_compact_kv(k_cache, v_cache, cache_seqlens, accept_nodes, accept_len, *, block_table=None,
                     values=True):
    check_tensor("k_cache", k_cache, dtype=FLOAT_DTYPES)
    device = k_cache.device
    check_tensor("accept_nodes", accept_nodes, dtype=torch.int32, ndim=2, device=device)
    B, A = accept_nodes.shape
    if A < 1:
        _fail("accept_nodes", "shape [B, max_depth + 1] with max_depth >= 0", f"shape {tuple(accept_nodes.shape)}")
    check_tensor("accept_len", accept_len, dtype=torch.int32, shape=(B,), device=device)
    _check_kv_layout(k_cache, v_cache, cache_seqlens, block_table, B, True, device)
    _check_dense_head_dim(k_cache, v_cache)
    if not (values and values_checked(device)):
        return
    if bool(((accept_len < 0) | (accept_len >= A)).any()):
        _fail("accept_len", f"values in [0, {A - 1}]", accept_len.tolist())
    steps = torch.arange(A, device=device)
    on_path = steps[None, :] <= accept_len[:, None]
    nodes = accept_nodes.long()
    if bool((on_path[:, 0] & (nodes[:, 0] != 0)).any()):
        _fail("accept_nodes", "accept_nodes[:, 0] == 0 (the root)", accept_nodes.tolist())
    rising = nodes[:, 1:] > nodes[:, :-1]
    if A > 1 and bool((on_path[:, 1:] & ~rising).any()):
        _fail("accept_nodes", "strictly increasing node indices along the accepted path", accept_nodes.tolist())
    last = torch.gather(nodes, 1, accept_len.long()[:, None])[:, 0]
    _check_kv_values(k_cache, cache_seqlens, block_table, cache_seqlens.long() + last + 1,
                     "cache_seqlens + accept_nodes[accept_len] + 1")


# --------------------------------------------------------------------------------- write_kv
def check_write_kv(k_cache, v_cache, k_new, v_new, cache_seqlens, *, block_table=None, values=True):
    check_tensor("k_new", k_new, dtype=FLOAT_DTYPES, ndim=4)
    device = k_new.device
    B, N, Hkv, D = k_new.shape
    check_tensor("v_new", v_new, dtype=k_new.dtype, shape=tuple(k_new.shape), device=device)
    check_tensor("k_cache", k_cache, dtype=k_new.dtype, ndim=4, device=device)
    _check_kv_layout(k_cache, v_cache, cache_seqlens, block_table, B, False, device)
    _check_dense_head_dim(k_cache, v_cache)
    if tuple(k_cache.shape[2:]) != (Hkv, D):
        _fail("k_cache", f"heads and head dim [*, *, {Hkv}, {D}] as in k_new", f"shape {tuple(k_cache.shape)}")
    if values and values_checked(device):
        _check_kv_values(k_cache, cache_seqlens, block_table, cache_seqlens.long() + N,
                         "cache_seqlens + N")


# ------------------------------------------------------------------------------- cpu_linear
PACK_WIDTH = 32  # output columns per group of a packed cpu_linear weight


QUANT_ROW_BYTES = {torch.int8: 34, torch.uint8: 20}  # GGML Q8_0 / Q4_1 bytes per block of 32 (block rows)
QUANT_PACKED_BYTES = {torch.int8: 544, torch.uint8: 320}  # per block of a half of a packed group
QUANT_NAMES = {torch.int8: "Q8_0", torch.uint8: "Q4_1"}
LINEAR_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8)


def check_quant_rows(name, blocks):
    """Quantized block rows: int8 (Q8_0) [N, K / 32 * 34] or uint8 (Q4_1) [N, K / 32 * 20], contiguous."""
    check_tensor(name, blocks, dtype=(torch.int8, torch.uint8), ndim=2)
    per = QUANT_ROW_BYTES[blocks.dtype]
    if blocks.shape[1] % per or blocks.shape[1] == 0:
        _fail(name, f"{QUANT_NAMES[blocks.dtype]} block rows [N, K / 32 * {per}]", f"shape {tuple(blocks.shape)}")


def _check_quant_packed(name, weight, rows, K):
    """A quantized packed weight [rows / 32, 2, K / 32, bytes], or for 8-bit activations [rows / 32, 2, K / 32,
    bytes / 32, 32] (rows None: any N)."""
    fmt, per = QUANT_NAMES[weight.dtype], QUANT_PACKED_BYTES[weight.dtype]
    int8 = weight.dim() == 5
    tail = (per // 32, 32) if int8 else (per,)
    if weight.dim() not in (4, 5):
        _fail(name, f"a {fmt} weight packed by cpu_linear_pack, 4-D [N / 32, 2, K / 32, {per}] (or, for 8-bit "
              f"activations, 5-D [N / 32, 2, K / 32, {per // 32}, 32])",
              f"{weight.dim()}-D shape {tuple(weight.shape)}")
    if K % 32:
        _fail(name, f"a {fmt} weight for K (from x) a multiple of 32", f"K = {K}")
    n = "N" if rows is None else rows
    if (tuple(weight.shape[1:]) != (2, K // 32, *tail)
            or (rows is not None and (rows % PACK_WIDTH or weight.shape[0] != rows // PACK_WIDTH))):
        what = " (8-bit activations)" if int8 else ""
        _fail(name, f"packed {fmt}{what} shape [{n} / 32, 2, K / 32 = {K // 32}, {', '.join(map(str, tail))}]",
              f"shape {tuple(weight.shape)}")
    if not weight.is_contiguous():
        _fail(name, "a contiguous packed weight", f"strides {tuple(weight.stride())}")


def is_pair_packed(weight) -> bool:
    """A bf16 weight packed in pairs of k steps, [N / 32, 2, K / 2, 16, 2] (cpu_linear_pack, K even)."""
    return weight.dim() == 5 and weight.dtype == torch.bfloat16


def _check_packed_float(name, weight, rows, K):
    """A packed fp32 / bf16 / fp16 weight [rows / 32, 2, K, 16], or bf16 pairs [rows / 32, 2, K / 2, 16, 2] (rows
    None: any N)."""
    n = "N" if rows is None else rows
    rows_fit = rows is None or (rows % PACK_WIDTH == 0 and weight.shape[0] == rows // PACK_WIDTH)
    if is_pair_packed(weight):
        if K % 2 or not rows_fit or tuple(weight.shape[1:]) != (2, K // 2, PACK_WIDTH // 2, 2):
            _fail(name, f"bf16 pair-packed shape [{n} / 32, 2, K / 2, 16, 2] for K = {K} (K even)",
                  f"shape {tuple(weight.shape)}")
    elif weight.dim() != 4 or not rows_fit or tuple(weight.shape[1:]) != (2, K, PACK_WIDTH // 2):
        _fail(name, f"packed shape [{n} / 32, 2, K = {K}, 16]", f"shape {tuple(weight.shape)}")
    if not weight.is_contiguous():
        _fail(name, "a contiguous packed weight", f"strides {tuple(weight.stride())}")


def check_linear_weight_layout(name, weight, K, device):
    """A cpu_linear weight: [N, K] with a dense last dim, or packed [N / 32, 2, K, 16] contiguous, or quantized
    packed blocks."""
    check_tensor(name, weight, dtype=LINEAR_DTYPES, device=device)
    if weight.dtype in QUANT_NAMES:
        _check_quant_packed(name, weight, None, K)
        return
    if weight.dim() == 4 or is_pair_packed(weight):
        _check_packed_float(name, weight, None, K)
        return
    if weight.dim() != 2:
        _fail(name, "2-D [N, K] or packed 4-D [N / 32, 2, K, 16] (bf16 with K even: 5-D [N / 32, 2, K / 2, 16, 2]; "
              "cpu_linear_pack)", f"{weight.dim()}-D shape {tuple(weight.shape)}")
    N = weight.shape[0]
    if weight.shape[1] != K:
        _fail(name, f"shape [N, K = {K}] (K from x)", f"shape {tuple(weight.shape)}")
    # A transposed weight would need a full copy per call: rejected rather than copied silently.
    if weight.stride(1) != 1 and K > 1 and N > 0:
        _fail(name, "a dense last dim (stride 1)", f"strides {tuple(weight.stride())}")


def linear_out_features(weight) -> int:
    """N of a cpu_linear weight, row-major [N, K] or packed [N / 32, ...]."""
    return weight.shape[0] * PACK_WIDTH if weight.dim() in (4, 5) else weight.shape[0]


def check_cpu_linear(x, weight, *, values=True):
    check_tensor("x", x, dtype=torch.float32)
    if x.dim() < 1:
        _fail("x", "at least 1 dimension [..., K]", f"shape {tuple(x.shape)}")
    check_linear_weight_layout("weight", weight, x.shape[-1], x.device)


PACK_ACTIVATIONS = ("fp32", "int8")  # cpu_linear_pack(activations=): the arithmetic the packed layout is for


def check_cpu_linear_pack(weight, activations="fp32"):
    if activations not in PACK_ACTIVATIONS:
        raise ValueError(f"activations: expected one of {PACK_ACTIVATIONS}, got {activations!r}")
    check_tensor("weight", weight, dtype=LINEAR_DTYPES, ndim=2)
    if weight.dtype in QUANT_NAMES:
        check_quant_rows("weight", weight)
    elif activations == "int8":
        _fail("weight", "Q8_0 / Q4_1 block rows (int8 / uint8) for activations='int8' (8-bit activations need "
              "quantized weights)", f"dtype {weight.dtype}")
    if weight.shape[0] % PACK_WIDTH:
        _fail("weight", f"[N, K] with N a multiple of {PACK_WIDTH}", f"shape {tuple(weight.shape)}")


def cpu_linear_shape(x, weight):
    return (*x.shape[:-1], linear_out_features(weight))


# ------------------------------------------------------------------------ cpu_decoder_layer
def _check_linear_weight(name, weight, rows, cols, layout, device):
    check_tensor(name, weight, dtype=LINEAR_DTYPES, device=device)
    if weight.dtype in QUANT_NAMES:
        _check_quant_packed(name, weight, rows, cols)
        return
    if weight.dim() == 4 or is_pair_packed(weight):  # packed (cpu_linear_pack); rows not a multiple of 32 fail
        _check_packed_float(name, weight, rows, cols)
        return
    if tuple(weight.shape) != (rows, cols):
        _fail(name, f"shape {layout} = [{rows}, {cols}]", f"shape {tuple(weight.shape)}")
    if weight.stride(1) != 1 and cols > 1:
        _fail(name, "a dense last dim (stride 1)", f"strides {tuple(weight.stride())}")


def check_eps(eps) -> None:
    """The eps of a norm: a number >= 0 (a negative or NaN one gives NaN rows)."""
    if not isinstance(eps, (float, int)) or not eps >= 0:
        _fail("eps", "a number >= 0", eps if isinstance(eps, (float, int)) else type(eps).__name__)


def _check_layer(x, input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight, cos, sin, k_cache,
                 v_cache, cache_seqlens, tree_mask, num_heads, eps, embed, embed_norm, slot_offset, suffix=""):
    """One layer's arguments (k_cache [B, S, Hkv, D]); ``suffix`` follows the names of the per-layer tensors
    (``"[3]"``: layer 3 of a cpu_decoder_layers call)."""
    check_tensor("x", x, dtype=torch.float32, ndim=3)
    device = x.device
    B, N, H = x.shape
    check_tensor("k_cache", k_cache, dtype=(torch.float32, torch.bfloat16, torch.float16), ndim=4, device=device)
    _check_kv_layout(k_cache, v_cache, cache_seqlens, None, B, False, device)
    Hkv, D = k_cache.shape[2], k_cache.shape[3]
    if not is_int(num_heads) or num_heads < 1 or Hkv < 1 or num_heads % Hkv:
        _fail("num_heads", f"a positive multiple of the KV head count {Hkv}", num_heads)
    if D % 2:
        _fail("k_cache", "an even head dim (RoPE)", D)
    check_tensor("input_norm" + suffix, input_norm, dtype=torch.float32, shape=(H,), device=device)
    check_tensor("post_norm" + suffix, post_norm, dtype=torch.float32, shape=(H,), device=device)
    if (embed is None) != (embed_norm is None):
        _fail("embed_norm", "embed and embed_norm together", "embed only" if embed is not None else "embed_norm only")
    if embed is not None:
        check_tensor("embed", embed, dtype=torch.float32, shape=(B, N, H), device=device)
        check_tensor("embed_norm", embed_norm, dtype=torch.float32, shape=(H,), device=device)
    attn_in = H if embed is None else 2 * H
    _check_linear_weight("qkv_weight" + suffix, qkv_weight, (num_heads + 2 * Hkv) * D, attn_in,
                         "[(num_heads + 2 Hkv) D, H]" if embed is None else "[(num_heads + 2 Hkv) D, 2 H]", device)
    _check_linear_weight("o_weight" + suffix, o_weight, H, num_heads * D, "[H, num_heads D]", device)
    if not isinstance(gate_up_weight, torch.Tensor):
        _fail("gate_up_weight" + suffix, "a torch.Tensor", type(gate_up_weight).__name__)
    if gate_up_weight.dim() not in (2, 4, 5) or linear_out_features(gate_up_weight) % 2:
        _fail("gate_up_weight" + suffix, "2-D [2 I, H] (gate rows, then up rows) or its packed form",
              f"shape {tuple(gate_up_weight.shape)}")
    I = linear_out_features(gate_up_weight) // 2
    _check_linear_weight("gate_up_weight" + suffix, gate_up_weight, 2 * I, H, "[2 I, H]", device)
    _check_linear_weight("down_weight" + suffix, down_weight, H, I, "[H, I]", device)
    check_tensor("cos", cos, dtype=torch.float32, shape=(B, N, D), device=device)
    check_tensor("sin", sin, dtype=torch.float32, shape=(B, N, D), device=device)
    if not is_int(slot_offset) or slot_offset < 0:
        _fail("slot_offset", "a non-negative int", slot_offset)
    slots = slot_offset + N
    if tree_mask is not None:
        check_tensor("tree_mask", tree_mask, dtype=torch.int64, shape=(B, slots, mask_words(slots)), device=device)
    check_eps(eps)


def _check_row_counts(row_counts, x, k_cache, cache_seqlens, slots, values):
    B, N = x.shape[:2]
    if row_counts is not None:
        check_tensor("row_counts", row_counts, dtype=torch.int64, shape=(B,), device=x.device)
    if values and values_checked(x.device):
        _check_kv_values(k_cache, cache_seqlens, None, cache_seqlens.long() + slots, "cache_seqlens + slot_offset + N")
        if row_counts is not None and bool(((row_counts < 0) | (row_counts > N)).any()):
            _fail("row_counts", f"values in [0, N = {N}]", row_counts.tolist())


def check_cpu_decoder_layer(x, input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight, cos, sin,
                            k_cache, v_cache, cache_seqlens, tree_mask=None, *, num_heads, eps, embed=None,
                            embed_norm=None, slot_offset=0, row_counts=None, values=True):
    _check_layer(x, input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight, cos, sin, k_cache,
                 v_cache, cache_seqlens, tree_mask, num_heads, eps, embed, embed_norm, slot_offset)
    _check_row_counts(row_counts, x, k_cache, cache_seqlens, slot_offset + x.shape[1], values)


DECODER_LAYER_LISTS = ("input_norm", "qkv_weight", "o_weight", "post_norm", "gate_up_weight", "down_weight")


def check_cpu_decoder_layers(x, input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight, cos, sin,
                             k_cache, v_cache, cache_seqlens, tree_mask=None, *, num_heads, eps, state_layers=(),
                             row_counts=None, values=True):
    check_tensor("x", x, dtype=torch.float32, ndim=3)
    device = x.device
    check_tensor("k_cache", k_cache, dtype=(torch.float32, torch.bfloat16, torch.float16), ndim=5, device=device)
    _check_kv_layout(k_cache, v_cache, cache_seqlens, None, x.shape[0], True, device)
    L = k_cache.shape[0]
    lists = (input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight)
    for name, tensors in zip(DECODER_LAYER_LISTS, lists):
        if not isinstance(tensors, (list, tuple)) or len(tensors) != L:
            got = f"{len(tensors)} tensors" if isinstance(tensors, (list, tuple)) else type(tensors).__name__
            _fail(name, f"one tensor per layer of k_cache (L = {L})", got)
    for layer in state_layers:
        if not is_int(layer) or not 0 <= layer < L:
            _fail("state_layers", f"layer indices in [0, L = {L})", layer)
    for layer in range(L):
        _check_layer(x, *(tensors[layer] for tensors in lists), cos, sin, k_cache[layer], v_cache[layer],
                     cache_seqlens, tree_mask, num_heads, eps, None, None, 0, suffix=f"[{layer}]")
    _check_row_counts(row_counts, x, k_cache, cache_seqlens, x.shape[1], values)


def _check_tokens_and_table(tokens, embed_table, values):
    """Token ids int64 [B, N] in [0, V) and an embedding table [V, H] (float32/bfloat16/float16, dense rows);
    returns an empty float32 [B, N, H] standing for the embedded rows, and whether values are checked."""
    check_tensor("tokens", tokens, dtype=torch.int64, ndim=2)
    check_values = values and values_checked(tokens.device)
    check_tensor("embed_table", embed_table, dtype=(torch.float32, torch.bfloat16, torch.float16), ndim=2,
                 device=tokens.device)
    if embed_table.stride(1) != 1 and embed_table.shape[1] > 1:
        _fail("embed_table", "a dense last dim (stride 1)", f"strides {tuple(embed_table.stride())}")
    (B, N), (V, H) = tokens.shape, embed_table.shape
    if check_values and tokens.numel() and bool(((tokens < 0) | (tokens >= V)).any()):
        _fail("tokens", f"ids in [0, V = {V}) (embed_table rows)", tokens.tolist())
    return embed_table.new_empty((B, N, H), dtype=torch.float32), check_values


def _check_rope_tables(rope_cos, rope_sin, D, device) -> int:
    """Contiguous float32 [P, D / 2] cos and sin tables with the same P; returns P."""
    for name, table in (("rope_cos", rope_cos), ("rope_sin", rope_sin)):
        check_tensor(name, table, dtype=torch.float32, ndim=2, device=device)
        if table.shape[1] * 2 != D or not table.is_contiguous():
            _fail(name, f"a contiguous [P, D / 2 = {D // 2}] table",
                  f"shape {tuple(table.shape)} and strides {tuple(table.stride())}")
    P = rope_cos.shape[0]
    if rope_sin.shape[0] != P:
        _fail("rope_sin", f"P = {P} rows (as rope_cos)", rope_sin.shape[0])
    return P


def _check_final_norm_and_lm_head(final_norm, lm_head, H, device):
    check_tensor("final_norm", final_norm, dtype=torch.float32, shape=(H,), device=device)
    if not isinstance(lm_head, torch.Tensor) or lm_head.dim() < 2:
        _fail("lm_head", "[V, H] or its packed form", getattr(lm_head, "shape", type(lm_head).__name__))
    _check_linear_weight("lm_head", lm_head, linear_out_features(lm_head), H, "[V, H]", device)


def check_cpu_decoder_forward(tokens, embed_table, rope_cos, rope_sin, positions, input_norm, qkv_weight, o_weight,
                              post_norm, gate_up_weight, down_weight, final_norm, lm_head, k_cache, v_cache,
                              cache_seqlens, tree_mask=None, *, num_heads, eps, state_layers=(), row_counts=None,
                              logit_rows=None, values=True):
    x, check_values = _check_tokens_and_table(tokens, embed_table, values)  # x: the stack's input, for its checks
    device, (B, N), H = tokens.device, tokens.shape, embed_table.shape[1]
    check_tensor("k_cache", k_cache, dtype=(torch.float32, torch.bfloat16, torch.float16), ndim=5, device=device)
    _check_kv_layout(k_cache, v_cache, cache_seqlens, None, B, True, device)
    D = k_cache.shape[-1]
    P = _check_rope_tables(rope_cos, rope_sin, D, device)
    if positions is not None:
        check_tensor("positions", positions, dtype=torch.int64, shape=(B, N), device=device)
        if check_values and positions.numel() and bool(((positions < 0) | (positions >= P)).any()):
            _fail("positions", f"values in [0, P = {P}) (rope_cos rows)", positions.tolist())
    elif check_values and B and bool((cache_seqlens.long() + N > P).any()):
        _fail("rope_cos", "a row per position up to cache_seqlens + N - 1 (positions None)", f"P = {P} rows")
    rows = x.new_empty((B, N, D))
    check_cpu_decoder_layers(x, input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight, rows, rows,
                             k_cache, v_cache, cache_seqlens, tree_mask, num_heads=num_heads, eps=eps,
                             state_layers=state_layers, row_counts=row_counts, values=values)
    _check_final_norm_and_lm_head(final_norm, lm_head, H, device)
    if logit_rows is not None:
        check_tensor("logit_rows", logit_rows, dtype=torch.int64, ndim=2, device=device)
        if logit_rows.shape[0] != B:
            _fail("logit_rows", f"shape [B = {B}, R]", f"shape {tuple(logit_rows.shape)}")
        if check_values and logit_rows.numel() and bool(((logit_rows < 0) | (logit_rows >= N)).any()):
            _fail("logit_rows", f"values in [0, N = {N})", logit_rows.tolist())


def check_cpu_head_forward(tokens, embed_table, features, fc_weight, rope_cos, rope_sin, positions, input_norm,
                           embed_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight, final_norm,
                           lm_head, k_cache, v_cache, cache_seqlens, tree_mask=None, *, num_heads, eps, slot_offset=0,
                           values=True):
    embed, check_values = _check_tokens_and_table(tokens, embed_table, values)  # the layer's embedding input
    device, (B, N), H = tokens.device, tokens.shape, embed_table.shape[1]
    check_tensor("features", features, dtype=torch.float32, ndim=3, device=device)
    if tuple(features.shape[:2]) != (B, N):
        _fail("features", f"shape [B = {B}, N = {N}, F]", f"shape {tuple(features.shape)}")
    if fc_weight is not None:
        if not isinstance(fc_weight, torch.Tensor) or fc_weight.dim() < 2:
            _fail("fc_weight", "[H, F] or its packed form", getattr(fc_weight, "shape", type(fc_weight).__name__))
        _check_linear_weight("fc_weight", fc_weight, H, features.shape[2], "[H, F]", device)
    elif features.shape[2] != H:
        _fail("features", f"F = H = {H} (no fc_weight: the features are the layer's input)",
              f"shape {tuple(features.shape)}")
    check_tensor("k_cache", k_cache, dtype=(torch.float32, torch.bfloat16, torch.float16), ndim=4, device=device)
    D = k_cache.shape[-1]
    P = _check_rope_tables(rope_cos, rope_sin, D, device)
    check_tensor("positions", positions, dtype=torch.int64, shape=(B, N), device=device)
    if check_values and positions.numel() and bool(((positions < 0) | (positions >= P)).any()):
        _fail("positions", f"values in [0, P = {P}) (rope_cos rows)", positions.tolist())
    rows = embed.new_empty((B, N, D))
    check_cpu_decoder_layer(embed, input_norm, qkv_weight, o_weight, post_norm, gate_up_weight, down_weight, rows,
                            rows, k_cache, v_cache, cache_seqlens, tree_mask, num_heads=num_heads, eps=eps,
                            embed=embed, embed_norm=embed_norm, slot_offset=slot_offset, values=values)
    if (final_norm is None) != (lm_head is None):
        _fail("lm_head", "final_norm and lm_head together",
              "lm_head only" if lm_head is not None else "final_norm only")
    if lm_head is not None:
        _check_final_norm_and_lm_head(final_norm, lm_head, H, device)


# ------------------------------------------------------------------- native scalar arguments
# The C++ CPU kernels of _dispatch.NATIVE_VALIDATION repeat the tensor checks above, but their
# Python scalars pass the operator schema first, which raises a RuntimeError for a float where
# it takes an int (and converts a numpy scalar or a one-element tensor that the checks above
# reject). So before such a native call the dispatcher asks ``NATIVE_SCALAR_TYPES[op]`` whether
# every scalar has a plain type the checks above accept (a type test per scalar, nothing read
# from a tensor); when one does not, it runs the op's full check, which raises the ValueError
# every other backend raises. Each takes the op's contract signature.
_NUMBER_TYPES = (float, int)


def _tree_attention_scalars(q, k_cache, v_cache, cache_seqlens, tree_mask=None, *, block_table=None,
                            sm_scale=None):
    return sm_scale is None or type(sm_scale) in _NUMBER_TYPES


def _draft_expand_scalars(logits, frontier_scores, top_k, *, depth=0, **_):
    return type(top_k) is int and type(depth) is int


def _build_tree_scalars(root_tokens, cand_tokens, cand_scores, cand_parents, num_nodes):
    return type(num_nodes) is int


def _verify_scalars(tokens, parents, target_logits, *, max_depth, **_):
    return type(max_depth) is int


def _layer_scalars(*_, num_heads, eps, slot_offset=0, **__):
    return type(num_heads) is int and type(eps) in _NUMBER_TYPES and type(slot_offset) is int


def _stack_scalars(*_, num_heads, eps, state_layers=(), **__):
    return (type(num_heads) is int and type(eps) in _NUMBER_TYPES
            and all(type(layer) is int for layer in state_layers))


NATIVE_SCALAR_TYPES = {
    "tree_attention": _tree_attention_scalars,
    "draft_expand": _draft_expand_scalars,
    "build_tree": _build_tree_scalars,
    "verify": _verify_scalars,
    "cpu_decoder_layer": _layer_scalars,
    "cpu_decoder_layers": _stack_scalars,
    "cpu_decoder_forward": _stack_scalars,
    "cpu_head_forward": _layer_scalars,
}
