"""SGLang's published golden cases and a generator of EAGLE draft histories in SGLang's layout."""

from __future__ import annotations

import torch

# sgl-kernel's greedy tree verify test (two 6-node trees). Target logits are one-hot: the listed
# (request, node, token) entries, token 18 on every other row.
GREEDY_CANDIDATES = [[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]]
GREEDY_RETRIEVE_INDEX = [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
GREEDY_NEXT_TOKEN = [[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]]
GREEDY_NEXT_SIBLING = [[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]]
GREEDY_TARGET_HOT = {(0, 0): 3, (0, 3): 4, (0, 4): 5, (1, 0): 11, (1, 4): 12}
GREEDY_OTHER_TOKEN = 18
GREEDY_NUM_SPEC_TOKENS = 4
GREEDY_PREDICTS = [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18]
GREEDY_ACCEPT_INDEX = [[0, 3, 4, 5], [6, 10, 11, -1]]
GREEDY_ACCEPT_NUM = [3, 2]


def greedy_target_predict() -> torch.Tensor:
    predict = torch.full((2, 6), GREEDY_OTHER_TOKEN, dtype=torch.int64)
    for (b, node), token in GREEDY_TARGET_HOT.items():
        predict[b, node] = token
    return predict


# SGLang's build-tree test (topk 4, depth 4, 8 verify tokens, two requests).
BUILD_VERIFIED_ID = [29974, 13]
BUILD_SCORES = [
    [[[7.1127e-01, 2.8292e-01, 2.2995e-03, 1.7357e-03]], [[9.7476e-01, 2.2219e-02, 6.5031e-04, 1.3212e-04]]],
    [[[6.9142e-01, 1.2863e-02, 1.6873e-03, 1.1871e-03], [2.4787e-01, 1.8818e-02, 1.4204e-02, 9.2235e-04],
      [2.2971e-03, 1.6700e-06, 1.8737e-07, 8.3146e-08], [1.2771e-03, 2.4374e-04, 1.7832e-04, 1.1947e-05]],
     [[8.4832e-02, 6.6068e-02, 5.8304e-02, 5.7851e-02], [2.3616e-03, 1.1243e-03, 5.4368e-04, 2.7768e-04],
      [2.5286e-04, 1.5578e-04, 2.8817e-05, 1.2888e-05], [1.2834e-04, 2.5417e-06, 1.1279e-06, 1.6088e-08]]],
    [[[6.6438e-01, 2.6997e-02, 2.4236e-05, 4.0821e-06], [2.4402e-01, 2.8409e-03, 5.0935e-04, 2.9022e-04],
      [1.6178e-02, 2.0567e-03, 4.5892e-04, 3.0034e-05], [1.3023e-02, 5.0497e-04, 3.6371e-04, 8.7750e-05]],
     [[2.3263e-02, 2.0054e-02, 9.3990e-03, 2.7783e-03], [6.4156e-02, 5.5506e-04, 1.0429e-04, 9.7211e-05],
      [4.9950e-02, 5.0630e-03, 9.0068e-04, 3.3656e-04], [7.5817e-03, 8.5731e-04, 6.9972e-04, 6.0793e-04]]],
    [[[6.6420e-01, 1.0525e-04, 6.5864e-05, 1.2253e-06], [1.3019e-01, 1.0461e-01, 5.2083e-03, 1.6777e-03],
      [2.0103e-02, 6.7335e-03, 1.2625e-04, 1.0364e-05], [1.5142e-02, 7.0819e-04, 9.6595e-05, 8.7951e-05]],
     [[5.8608e-02, 1.8840e-03, 7.8535e-04, 4.4400e-04], [1.2185e-02, 2.0684e-03, 1.7418e-03, 1.4327e-03],
      [6.2455e-03, 6.1487e-03, 2.6862e-03, 1.8034e-03], [1.8590e-03, 1.6151e-03, 1.2481e-03, 3.6038e-04]]],
]
BUILD_TOKENS = [
    [[29896, 29906, 29900, 29945], [13, 2, 29871, 28956]],
    [[29889, 29974, 29945, 29900, 29974, 29922, 29930, 29958, 29889, 29974, 29930, 29945, 29974, 29922, 29930, 29958],
     [22550, 4136, 16492, 8439, 29871, 2, 3001, 13, 2, 13, 29906, 29946, 2, 13, 29871, 259]],
    [[29946, 29945, 29953, 29906, 29896, 29945, 29900, 29906, 29896, 29945, 29906, 29953, 29896, 29945, 29906, 29946],
     [29871, 2, 29901, 29889, 29871, 2, 395, 259, 29901, 29871, 2, 29889, 3001, 1234, 7146, 2186]],
    [[29946, 29974, 29945, 29930, 29889, 29922, 29974, 29930, 29974, 29946, 29930, 29922, 29889, 29974, 29945, 29922],
     [29941, 29906, 2, 29946, 29871, 450, 319, 14990, 29946, 29941, 2, 29906, 29871, 2, 3001, 13]],
]
BUILD_PARENTS = [
    [[-1, 0, 1, 2, 3], [-1, 0, 1, 2, 3]],
    [[4, 8, 9, 10], [4, 5, 6, 7]],
    [[20, 24, 21, 28], [24, 28, 20, 21]],
    [[36, 40, 41, 44], [36, 40, 44, 45]],
]
BUILD_SEQ_LENS = [5, 10]
BUILD_TOPK, BUILD_DEPTH, BUILD_NUM_DRAFT = 4, 4, 8
BUILD_POSITIONS = [5, 6, 6, 7, 7, 8, 8, 9, 10, 11, 12, 12, 12, 12, 13, 14]
BUILD_RETRIEVE_INDEX = [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]
BUILD_NEXT_TOKEN = [[1, 3, 4, 5, 6, 7, -1, -1], [1, 2, -1, 6, -1, -1, 7, -1]]
BUILD_NEXT_SIBLING = [[-1, 2, -1, -1, -1, -1, -1, -1], [-1, -1, 3, 4, 5, -1, -1, -1]]
BUILD_DRAFT_TOKENS = [29974, 29896, 29906, 29889, 29974, 29946, 29896, 29946,
                      13, 13, 22550, 4136, 16492, 8439, 29871, 29941]


def golden_build_inputs():
    """``(score_list, token_list, parents_list)`` of the build-tree golden case, as SGLang's draft
    loop hands them to ``organize_draft_results``."""
    scores = [torch.tensor(s, dtype=torch.float32) for s in BUILD_SCORES]
    tokens = [torch.tensor(t, dtype=torch.int64) for t in BUILD_TOKENS]
    parents = [torch.tensor(p, dtype=torch.int64) for p in BUILD_PARENTS]
    return scores, tokens, parents


def random_draft(batch: int, topk: int, depth: int, vocab: int, generator: torch.Generator):
    """An EAGLE draft history in SGLang's layout, as its draft loop builds it: ``depth`` steps,
    each frontier node proposing ``topk`` tokens with cumulative log-probability scores, the best
    ``topk`` of each step becoming the next frontier. Returns ``(score_list, token_list,
    parents_list)`` for ``organize_draft_results``."""
    logp = torch.log_softmax(torch.randn(batch, topk, generator=generator) * 2, -1)
    first = torch.sort(logp, -1, descending=True).values
    score_list = [first[:, None, :]]
    token_list = [torch.randint(0, vocab, (batch, topk), generator=generator)]
    parents_list = [torch.arange(-1, topk).expand(batch, topk + 1).clone()]
    frontier = first
    for step in range(1, depth):
        step_logp = torch.log_softmax(torch.randn(batch, topk, topk, generator=generator) * 2, -1)
        step_logp = torch.sort(step_logp, -1, descending=True).values
        scores = frontier[:, :, None] + step_logp  # [B, topk (frontier), topk (proposals)]
        score_list.append(scores)
        token_list.append(torch.randint(0, vocab, (batch, topk * topk), generator=generator))
        best = torch.topk(scores.flatten(1), topk, dim=-1)
        frontier = best.values
        offset = topk * topk * (step - 1) + topk
        parents_list.append(best.indices + offset)
    return score_list, token_list, parents_list
