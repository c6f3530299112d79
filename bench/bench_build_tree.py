"""build_tree: EAGLE-2 re-ranking of a depth-6, top-k-8 expansion history into a verify tree.

Providers: ``eagle`` (eagle_kernels.build_tree, backend in extra_info) and ``reference``.
Throughput: candidates re-ranked per second (B * C / mean time).
"""

import pytest
import torch

TOP_K = 8
DEPTH = 6
C = TOP_K + (DEPTH - 1) * TOP_K * TOP_K  # 8 + 5 * 64 = 328 candidates (>= 255 for N = 256)


def expansion_history(B, seed=0):
    """Candidate history shaped like draft_expand's over DEPTH depths: depth 0 has TOP_K
    children of the root, each later depth TOP_K children of each of the TOP_K best
    candidates of the previous depth; scores are cumulative log-probs."""
    gen = torch.Generator().manual_seed(seed)

    def ranked_logp(*shape):
        logits = torch.randn(*shape, 256, generator=gen) * 3
        return torch.log_softmax(logits, -1).topk(TOP_K, dim=-1).values  # [..., TOP_K], sorted

    scores = [ranked_logp(B)]
    parents = [torch.full((B, TOP_K), -1, dtype=torch.int32)]
    offset = 0
    for _ in range(1, DEPTH):
        prev = scores[-1]
        frontier = prev.topk(TOP_K, dim=-1).indices  # [B, TOP_K]
        frontier_scores = torch.gather(prev, 1, frontier)
        scores.append((frontier_scores[..., None] + ranked_logp(B, TOP_K)).reshape(B, -1))
        parents.append((frontier + offset).repeat_interleave(TOP_K, dim=1).to(torch.int32))
        offset += prev.shape[1]
    cand_scores = torch.cat(scores, 1).contiguous()
    cand_parents = torch.cat(parents, 1).contiguous()
    cand_tokens = torch.randint(0, 128256, (B, C), generator=gen)
    root_tokens = torch.randint(0, 128256, (B,), generator=gen)
    assert cand_scores.shape == (B, C)
    return root_tokens, cand_tokens, cand_scores, cand_parents


@pytest.mark.parametrize("N", [16, 60, 256], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("B", [1, 4, 32], ids=lambda b: f"B{b}")
def test_build_tree(measure, provider_op, B, N):
    fn, backend = provider_op("build_tree")
    args = expansion_history(B)
    measure(fn, *args, N, work=B * C, unit="candidates", info={"backend": backend, "B": B, "C": C, "N": N})
