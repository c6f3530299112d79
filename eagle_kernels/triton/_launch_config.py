"""Whether a Triton launcher runs its kernels compiled for the GPU or in Triton's interpreter.

Each launcher holds its tuning constants in a frozen configuration object (``GPU_CONFIG``,
``INTERPRETER_CONFIG``) and picks one per launch with ``interpreted``; a private ``_config``
keyword overrides the choice, so the tests run the GPU configuration under the interpreter.
Kernels whose last program of a group finishes the group's work (draft_expand's merge,
tree_attention's folded split merge) take their tickets from ``tickets``.
"""

from __future__ import annotations

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction


def interpreted(kernel) -> bool:
    """True when ``kernel`` runs in Triton's interpreter: ``triton.jit`` returns an
    interpreted function when TRITON_INTERPRET=1 is set as the kernel's module is imported,
    and that choice holds for the kernel's lifetime."""
    return isinstance(kernel, InterpretedFunction)


def dot_mode(kernel, dtype: torch.dtype) -> tuple[bool, str]:
    """``(UPCAST, DOT_PRECISION)`` for ``kernel``'s ``tl.dot`` over ``dtype`` inputs: the
    interpreter's 16-bit dot is wrong, so interpreted 16-bit inputs are upcast to fp32; fp32
    (and upcast) dots are exact fp32 ("ieee"), 16-bit ones run on the tensor cores (the
    precision then means nothing)."""
    upcast = interpreted(kernel) and dtype != torch.float32
    return upcast, "ieee" if (dtype == torch.float32 or upcast) else "tf32"


# Per device: one int32 ticket counter per program group, zero between launches. A kernel that
# hands out tickets has the program drawing a group's last ticket reset that counter, so no
# launch zeroes them and CUDA-graph replays find them zero. Every such kernel uses counters
# [0, groups) of the one buffer: launches on one device must not run concurrently (the decoder
# issues them on one stream). Buffers are never freed: a captured graph keeps the address it
# was captured with.
_TICKETS: dict = {}
_OLD_TICKETS: list = []


def tickets(device: torch.device, n: int) -> torch.Tensor:
    """The device's ticket counters, at least ``n`` of them, all zero between launches."""
    buf = _TICKETS.get(device)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _OLD_TICKETS.append(buf)
        buf = torch.zeros(max(1024, triton.next_power_of_2(n)), dtype=torch.int32, device=device)
        _TICKETS[device] = buf
    return buf


def gpu_sms(device: torch.device) -> int | None:
    """The SMs of a CUDA ``device``, or None elsewhere (CPU tensors: the interpreter's launches)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
