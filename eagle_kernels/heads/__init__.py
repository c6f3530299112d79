"""Draft heads shipped with the package (trained by ``python -m eagle_kernels train``; see each
folder's README.md model card)."""

from __future__ import annotations

import os

HEADS = {"eagle1": "smollm2-135m-eagle1", "eagle3": "smollm2-135m-eagle3"}


def path(kind: str) -> str | None:
    """Folder of the shipped SmolLM2-135M head of ``kind`` ("eagle1" or "eagle3"), or None if
    this installation has none."""
    if kind not in HEADS:
        raise ValueError(f"kind: expected one of {sorted(HEADS)}, got {kind!r}")
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), HEADS[kind])
    return folder if os.path.exists(os.path.join(folder, "config.json")) else None
