"""Inference mode, and the tensors that outlive one call.

``SpeculativeDecoder.generate`` runs under ``torch.inference_mode()``: its tensors then carry no
version counter and no autograd metadata, which takes about 3% off a CPU decoding step of
SmolLM2-135M (a step is a few hundred small torch ops around the native calls; docs/decoding.md,
"One call").

Two things follow, and serving code that wraps everything in ``torch.inference_mode()`` (vLLM
does; SGLang can) meets them too:

- A tensor made under inference mode has no version counter (``t._version`` raises). The caches
  keyed by a matrix's version (packed copies, the per-pass weight lists) read it through
  :func:`versions`, which gives an inference tensor the version 0: such a tensor cannot be
  changed in place outside inference mode, and a change inside it is not seen (replace the
  matrix under its name instead, which is).
- A tensor made under inference mode cannot be saved for backward or changed in place outside
  it. The caches that models keep across calls (packed and fused matrices, RoPE tables) are
  therefore built under :func:`kept_tensors`: normal tensors, without autograd history, whether
  the first call that needs them is a ``generate`` or a training step.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterable, Iterator

import torch

_VERSION = operator.attrgetter("_version")


def versions(tensors: Iterable[torch.Tensor]) -> tuple[int, ...]:
    """The version counters of ``tensors``, 0 for an inference tensor (which keeps none)."""
    tensors = tuple(tensors)
    try:
        return tuple(map(_VERSION, tensors))  # one attribute read each, in a C loop: the common case
    except RuntimeError:  # an inference tensor among them
        return tuple(map(version, tensors))


def version(tensor: torch.Tensor) -> int:
    """:func:`versions` of one tensor."""
    return 0 if tensor.is_inference() else tensor._version


@contextlib.contextmanager
def kept_tensors() -> Iterator[None]:
    """Build tensors that a model keeps across calls as normal tensors without autograd history,
    also inside ``torch.inference_mode()`` (whose tensors could not be saved for backward later)."""
    with torch.inference_mode(False), torch.no_grad():
        yield
