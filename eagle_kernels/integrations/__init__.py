"""eagle_kernels as the speculative-decoding backend of serving engines (docs/serving.md).

- :mod:`eagle_kernels.integrations.sglang`: a ``sglang.srt.plugins`` entry point that wraps
  SGLang's EAGLE tree build, greedy tree verify and tree sampling verify with our ops, and makes
  its CPU/XPU paths sample exactly where SGLang verifies greedily.
- :mod:`eagle_kernels.integrations.vllm`: a ``vllm.general_plugins`` entry point that replaces
  vLLM's chain rejection sampler (V1 runner and Model Runner V2) with ``verify`` on chains, in
  the lossless one-hot case.

Installing eagle_kernels registers both entry points; a plugin changes nothing until it is
enabled by the engine's plugin whitelist naming it (``SGLANG_PLUGINS=eagle_kernels``,
``VLLM_PLUGINS=eagle_kernels``) or by ``EAGLE_KERNELS_ENGINE_PLUGINS=1``.
"""

from __future__ import annotations

import logging
import os

PLUGIN_NAME = "eagle_kernels"
ENABLE_ENV = "EAGLE_KERNELS_ENGINE_PLUGINS"

logger = logging.getLogger("eagle_kernels.integrations")


def enabled(whitelist_env: str) -> bool:
    """True when the engine's plugin whitelist (``whitelist_env``) names this plugin, or when
    ``EAGLE_KERNELS_ENGINE_PLUGINS`` is 1; ``EAGLE_KERNELS_ENGINE_PLUGINS=0`` turns it off."""
    flag = os.environ.get(ENABLE_ENV, "").strip().lower()
    if flag in ("0", "false", "no", "off"):
        return False
    if flag in ("1", "true", "yes", "on"):
        return True
    names = {name.strip() for name in os.environ.get(whitelist_env, "").split(",")}
    return PLUGIN_NAME in names
