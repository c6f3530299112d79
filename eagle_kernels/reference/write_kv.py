"""Reference ``write_kv``: store the new tokens' K/V in the cache before a verify pass."""

from __future__ import annotations

from .. import _checks


def write_kv(k_cache, v_cache, k_new, v_new, cache_seqlens, *, block_table=None) -> None:
    """In place: ``cache[position cache_seqlens[b] + i of request b] = new[b, i]`` for both K
    and V, so that tree node ``i`` sits at slot ``cache_seqlens[b] + i`` as tree_attention
    expects. ``cache_seqlens`` is not changed.

    Shapes
    ------
    k_cache, v_cache: [B, S, Hkv, D], or paged [P, page_size, Hkv, D] with block_table int32
    [B, max_pages] (logical position t of request b is row t % page_size of page
    block_table[b, t // page_size]); k_new, v_new: [B, N, Hkv, D], same dtype as the caches;
    cache_seqlens int32 [B]. Requires cache_seqlens[b] + N <= capacity.
    """
    _checks.check_write_kv(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table=block_table)
    B, N = k_new.shape[:2]
    for b in range(B):
        start = int(cache_seqlens[b])
        for i in range(N):
            t = start + i
            if block_table is None:
                index = (b, t)
            else:
                page_size = k_cache.shape[1]
                index = (int(block_table[b, t // page_size]), t % page_size)
            k_cache[index] = k_new[b, i]
            v_cache[index] = v_new[b, i]
