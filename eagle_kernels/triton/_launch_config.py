"""Whether a Triton launcher runs its kernels compiled for the GPU or in Triton's interpreter.

Each launcher holds its tuning constants in a frozen configuration object (``GPU_CONFIG``,
``INTERPRETER_CONFIG``) and picks one per launch with ``interpreted``; a private ``_config``
keyword overrides the choice, so the tests run the GPU configuration under the interpreter.
"""

from __future__ import annotations

from triton.runtime.interpreter import InterpretedFunction


def interpreted(kernel) -> bool:
    """True when ``kernel`` runs in Triton's interpreter: ``triton.jit`` returns an
    interpreted function when TRITON_INTERPRET=1 is set as the kernel's module is imported,
    and that choice holds for the kernel's lifetime."""
    return isinstance(kernel, InterpretedFunction)
