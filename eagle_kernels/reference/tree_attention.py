"""Reference ``tree_attention``: attention of the N tree nodes over the committed prefix and
their own ancestors (SpecInfer, Miao et al. 2024, §4.2 "tree-based parallel decoding")."""

from __future__ import annotations

import torch

from .. import _checks


def gather_positions(cache, block_table, b: int, length: int) -> torch.Tensor:
    """Logical positions ``0..length-1`` of request ``b`` as a [length, Hkv, D] tensor."""
    if block_table is None:
        return cache[b, :length]
    page_size = cache.shape[1]
    positions = torch.arange(length, device=cache.device)
    pages = block_table[b].long()[positions // page_size]
    return cache[pages, positions % page_size]


def tree_visibility(tree_mask, b: int, num_nodes: int, device) -> torch.Tensor:
    """[N, N] bool: node i sees tree slot j (mask bit (i, j), or j <= i when causal)."""
    if tree_mask is None:
        return torch.ones(num_nodes, num_nodes, dtype=torch.bool, device=device).tril()
    j = torch.arange(num_nodes, device=device)
    words = tree_mask[b][:, j // 64]  # [N, N]
    return ((words >> (j % 64)) & 1).bool()


def tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask=None, *, block_table=None,
                   sm_scale=None) -> torch.Tensor:
    """Masked attention for a verify pass (or causal prefill when ``tree_mask`` is None).

    Shapes
    ------
    q [B, N, Hq, D]; k_cache, v_cache [B, S, Hkv, D] or paged [P, page, Hkv, D] with
    block_table int32 [B, max_pages]; cache_seqlens int32 [B]; tree_mask int64 [B, N, W].
    The K/V of tree node i sits at position cache_seqlens[b] + i.

    Returns
    -------
    [B, N, Hq, D] in q.dtype; the softmax is computed in float32 (float64 for float64 q).
    """
    _checks.check_tree_attention(q, k_cache, v_cache, cache_seqlens, tree_mask,
                                 block_table=block_table, sm_scale=sm_scale)
    B, N, Hq, D = q.shape
    group = Hq // k_cache.shape[2]
    scale = D ** -0.5 if sm_scale is None else float(sm_scale)
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.empty_like(q)
    for b in range(B):
        prefix = int(cache_seqlens[b])
        keys = gather_positions(k_cache, block_table, b, prefix + N).to(dtype)
        vals = gather_positions(v_cache, block_table, b, prefix + N).to(dtype)
        keys = keys.repeat_interleave(group, dim=1)  # [T, Hq, D]
        vals = vals.repeat_interleave(group, dim=1)
        visible = torch.cat([torch.ones(N, prefix, dtype=torch.bool, device=q.device),
                             tree_visibility(tree_mask, b, N, q.device)], dim=1)  # [N, T]
        logits = torch.einsum("nhd,thd->hnt", q[b].to(dtype), keys) * scale
        logits = logits.masked_fill(~visible[None], float("-inf"))
        # A node that sees nothing (an empty prefix, no bit of its row set: outside the contract) gets a zero row,
        # as the kernels' empty sums give, rather than softmax's NaN over no entries.
        weights = torch.softmax(logits, dim=-1).masked_fill(~visible.any(dim=1)[None, :, None], 0.0)
        out[b] = torch.einsum("hnt,thd->nhd", weights, vals).to(q.dtype)
    return out
