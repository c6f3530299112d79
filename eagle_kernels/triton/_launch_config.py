"""Whether a Triton launcher runs its kernels compiled for the GPU or in Triton's interpreter.

Each launcher holds its tuning constants in a frozen configuration object (``GPU_CONFIG``,
``INTERPRETER_CONFIG``) and picks one per launch with ``interpreted``; a private ``_config``
keyword overrides the choice, so the tests run the GPU configuration under the interpreter.
"""

from __future__ import annotations

import torch
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
