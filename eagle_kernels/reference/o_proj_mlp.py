"""Reference ``o_proj_mlp``: a decoder layer after its attention, the o projection added into the
residual stream and the gated MLP added after it (docs/ops.md §22)."""

from __future__ import annotations

from .. import _layer_checks
from .rmsnorm_linear import rmsnorm_linear


def o_proj_mlp(attention, residual, o_weight, norm_weight, gate_up_weight, down_weight, eps):
    """``out = mid + act @ down_weight.T`` with ``mid = residual + attention @ o_weight.T`` and
    ``act = silu(gate) * up`` over ``[gate, up] = norm(mid) @ gate_up_weight.T``: three §17
    ``rmsnorm_linear`` calls, each rounding once to the inputs' dtype (``mid`` and ``act`` are
    rounded where the calls round them).

    Shapes
    ------
    attention [..., Ka] (the attention output, heads concatenated); residual [..., H]; o_weight
    [H, Ka]; norm_weight [H]; gate_up_weight [2I, H] (gate rows, then up rows); down_weight
    [H, I]; one dtype (fp32, fp16, bf16 or float64). Returns out [..., H], a new tensor.
    """
    _layer_checks.check_o_proj_mlp(attention, residual, o_weight, norm_weight, gate_up_weight, down_weight, eps)
    mid, _ = rmsnorm_linear(attention, o_weight, None, eps, add=residual)
    act, _ = rmsnorm_linear(mid, gate_up_weight, norm_weight, eps, gated=True)
    out, _ = rmsnorm_linear(act, down_weight, None, eps, add=mid)
    return out
