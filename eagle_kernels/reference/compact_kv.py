"""Reference ``compact_kv``: move the accepted path's K/V next to the committed prefix."""

from __future__ import annotations

from .. import _checks


def physical_rows(cache, block_table, b: int, positions):
    """Index tuples (into a rank-4 cache) of logical ``positions`` of request ``b``."""
    if block_table is None:
        return [(b, t) for t in positions]
    page_size = cache.shape[1]
    return [(int(block_table[b, t // page_size]), t % page_size) for t in positions]


def compact_kv(k_cache, v_cache, cache_seqlens, accept_nodes, accept_len, *, block_table=None) -> None:
    """In place: for ``1 <= j <= accept_len[b]`` copy position ``cache_seqlens[b] +
    accept_nodes[b, j]`` to ``cache_seqlens[b] + j``, in every layer.

    Shapes
    ------
    k_cache, v_cache: [B, S, Hkv, D] or [L, B, S, Hkv, D]; paged [P, page, Hkv, D] or
    [L, P, page, Hkv, D] with block_table int32 [B, max_pages]; cache_seqlens int32 [B];
    accept_nodes int32 [B, max_depth + 1]; accept_len int32 [B].

    Increasing ``j`` is safe although sources and destinations overlap: the destination of
    step ``j`` is never the source of a later step ``j' > j``, because along a path
    ``accept_nodes[j'] > accept_nodes[j] >= j``.
    """
    _checks.check_compact_kv(k_cache, v_cache, cache_seqlens, accept_nodes, accept_len,
                             block_table=block_table)
    layers = [(k_cache, v_cache)] if k_cache.dim() == 4 else list(zip(k_cache, v_cache))
    for b in range(accept_nodes.shape[0]):
        start = int(cache_seqlens[b])
        count = int(accept_len[b])
        sources = [start + int(accept_nodes[b, j]) for j in range(1, count + 1)]
        targets = [start + j for j in range(1, count + 1)]
        for k_layer, v_layer in layers:
            src_rows = physical_rows(k_layer, block_table, b, sources)
            dst_rows = physical_rows(k_layer, block_table, b, targets)
            for src, dst in zip(src_rows, dst_rows):
                k_layer[dst] = k_layer[src]
                v_layer[dst] = v_layer[src]
