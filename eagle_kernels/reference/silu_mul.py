"""Reference ``silu_mul``: the SwiGLU activation of a fused gate/up projection (docs/ops.md §11)."""

from __future__ import annotations

import torch

from .. import _layer_checks


def silu_mul(gate_up):
    """``silu(gate) * up`` for ``[gate, up] = gate_up`` split in halves along the last dim,
    ``silu(g) = g / (1 + exp(-g))``, in fp32 (float64 for float64 input), rounded once.

    Shapes
    ------
    gate_up [..., 2I] (fp32, fp16, bf16 or float64); returns [..., I] in its dtype.
    """
    _layer_checks.check_silu_mul(gate_up)
    wide = gate_up.to(torch.promote_types(gate_up.dtype, torch.float32))
    gate, up = wide.chunk(2, dim=-1)
    return (gate / (1 + torch.exp(-gate)) * up).to(gate_up.dtype)
