"""Result types of the ops (NamedTuples, so they unpack like the registered ops' tuples)."""

from typing import NamedTuple

import torch


class Tree(NamedTuple):
    """A verify tree. Shapes: tokens int64 [B, N], parents int32 [B, N],
    depths int32 [B, N], mask int64 [B, N, ceil(N / 64)]."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    mask: torch.Tensor


class DraftCandidates(NamedTuple):
    """One depth of expansion. Shapes: tokens int64 [B, M * top_k],
    scores float32 [B, M * top_k], frontier int32 [B, top_k], logprobs float32 [B, M * top_k]."""

    tokens: torch.Tensor
    scores: torch.Tensor
    frontier: torch.Tensor
    logprobs: torch.Tensor


class DecoderLayersOutput(NamedTuple):
    """``cpu_decoder_layers``' result: ``out`` float32 [B, N, H], the last layer's output, and ``states`` float32
    [len(state_layers), B, N, H], the outputs of the layers asked for in ``state_layers`` (in that order)."""

    out: torch.Tensor
    states: torch.Tensor


class DecoderForwardOutput(NamedTuple):
    """``cpu_decoder_forward``'s result: ``logits`` float32 [B, R, V] (R = N without ``logit_rows``), ``hidden``
    float32 [B, N, H] (the last layer's output, normed) and ``states`` float32 [len(state_layers), B, N, H]."""

    logits: torch.Tensor
    hidden: torch.Tensor
    states: torch.Tensor


class HeadForwardOutput(NamedTuple):
    """``cpu_head_forward``'s result: ``logits`` float32 [B, N, Vd] (the draft logits; [B, N, 0] without an LM head)
    and ``hidden`` float32 [B, N, H] (the head layer's output: the next feature, not normed)."""

    logits: torch.Tensor
    hidden: torch.Tensor


class VerifyOutput(NamedTuple):
    """Verification result. Shapes: accept_len int32 [B], accept_nodes int32
    [B, max_depth + 1], out_tokens int64 [B, max_depth + 1], status int32 [B]."""

    accept_len: torch.Tensor
    accept_nodes: torch.Tensor
    out_tokens: torch.Tensor
    status: torch.Tensor
