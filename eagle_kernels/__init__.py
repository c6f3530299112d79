"""eagle_kernels: kernels for EAGLE-style speculative decoding.

Ten ops (contract in docs/ops.md, readable truth in eagle_kernels/reference): ``tree_attention``,
``draft_expand``, ``build_tree``, ``verify``, ``block_verify`` (a chain of drafts verified as one
block), ``compact_kv``, ``write_kv`` (stores the new
tokens' K/V before a verify pass), ``cpu_linear`` (the few-row linear layers of a CPU
model, fp32, bf16 or fp16 weights, row-major or packed by ``cpu_linear_pack``) and
``cpu_decoder_layer`` (a whole Llama decoder layer of such a model in one call), with
``cpu_decoder_layers`` (a model's whole stack of them), ``cpu_decoder_forward`` (a whole
forward pass, token ids to logits) and ``cpu_head_forward`` (an EAGLE-3 head's pass); and the
eight ops of the GPU decoder layer, ``rmsnorm``, ``rope_write_kv``, ``silu_mul``,
``rmsnorm_linear`` (a norm and the GEMM after it in one launch), ``rmsnorm_qkv_rope`` (with
RoPE and the KV write in its epilogue), ``o_proj_mlp`` (the layer after its attention in one
launch), ``q8_0_linear`` and ``fp8_linear`` (GEMMs over 8-bit
weights: a draft head's passes at about half the bytes). Each
dispatches by device to the
C++/CUDA kernels, the Triton kernels or the PyTorch reference; ``backend_of(op, device)``
says which.

``SpeculativeDecoder`` runs the whole decoding loop over a Llama target and an EAGLE head
(``TreeConfig`` / ``default_tree``: the draft shape); see docs/decoding.md.
"""

import warnings

from . import _dispatch, _registration, reference
from ._dispatch import backend_of
from ._types import DecoderForwardOutput, DecoderLayersOutput, DraftCandidates, HeadForwardOutput, Tree, VerifyOutput
from .decoder import SpeculativeDecoder
from .expansion import Expansion, expand_tree
from .ops import (
    block_verify,
    build_tree,
    compact_kv,
    coupled_draft_logits,
    coupled_noise,
    cpu_decoder_forward,
    cpu_decoder_layer,
    cpu_decoder_layers,
    cpu_head_forward,
    cpu_linear,
    cpu_linear_pack,
    draft_expand,
    fp8_linear,
    o_proj_mlp,
    q8_0_linear,
    rmsnorm,
    rmsnorm_linear,
    rmsnorm_qkv_rope,
    rope_write_kv,
    silu_mul,
    tree_attention,
    verify,
    write_kv,
)
from .trees import TreeConfig, default_tree

__version__ = "0.1.0"

if not _dispatch.HAS_CPP:
    warnings.warn(
        "eagle_kernels: the C++ extension eagle_kernels._C is not available "
        f"({_dispatch.CPP_IMPORT_ERROR}); every op without a Triton kernel runs on the "
        "PyTorch reference path. Reinstall with a C++ compiler to get the native kernels.",
        RuntimeWarning,
        stacklevel=2,
    )

_registration.register()

__all__ = [
    "tree_attention", "draft_expand", "build_tree", "verify", "block_verify", "coupled_noise", "coupled_draft_logits",
    "compact_kv",
    "write_kv", "cpu_linear", "cpu_linear_pack", "cpu_decoder_layer", "cpu_decoder_layers", "cpu_decoder_forward",
    "cpu_head_forward", "rmsnorm", "rmsnorm_linear", "rmsnorm_qkv_rope", "rope_write_kv",
    "silu_mul", "o_proj_mlp", "q8_0_linear", "fp8_linear", "Tree",
    "DraftCandidates", "VerifyOutput", "DecoderLayersOutput", "DecoderForwardOutput", "HeadForwardOutput",
    "backend_of",
    "reference", "expand_tree", "Expansion", "SpeculativeDecoder", "TreeConfig", "default_tree",
]
