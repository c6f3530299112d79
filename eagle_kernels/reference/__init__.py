"""Readable PyTorch implementations of every op: the truth the kernels are tested against.

They follow the op contract (docs/ops.md) line by line, run on any device, and compute in
float64 when given float64 inputs. They are slow on purpose: loops over requests and nodes
read like the spec.
"""

from .block_verify import block_verify
from .build_tree import build_tree
from .compact_kv import compact_kv
from .coupled_draft_logits import coupled_draft_logits
from .coupled_noise import coupled_noise
from .cpu_decoder_layer import cpu_decoder_forward, cpu_decoder_layer, cpu_decoder_layers, cpu_head_forward
from .cpu_linear import cpu_linear
from .draft_expand import draft_expand
from .fp8_linear import fp8_linear
from .o_proj_mlp import o_proj_mlp
from .q8_0_linear import q8_0_linear
from .random import philox4x32, uniform
from .rmsnorm import rmsnorm
from .rmsnorm_linear import rmsnorm_linear
from .rmsnorm_qkv_rope import rmsnorm_qkv_rope
from .rope_write_kv import rope_write_kv
from .silu_mul import silu_mul
from .tree_attention import tree_attention
from .verify import verify
from .write_kv import write_kv

__all__ = ["tree_attention", "draft_expand", "build_tree", "verify", "block_verify", "coupled_noise",
           "coupled_draft_logits",
           "compact_kv",
           "write_kv", "cpu_linear",
           "cpu_decoder_layer", "cpu_decoder_layers",
           "cpu_decoder_forward", "cpu_head_forward", "rmsnorm", "rmsnorm_linear", "rmsnorm_qkv_rope", "rope_write_kv",
           "silu_mul", "o_proj_mlp", "q8_0_linear", "fp8_linear", "philox4x32", "uniform"]
