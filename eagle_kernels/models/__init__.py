"""Models on eagle_kernels' ops: the Llama-family target (EAGLE heads arrive with the decoder)."""

from .llama import ForwardOutput, KVCache, LlamaConfig, LlamaModel

__all__ = ["LlamaConfig", "LlamaModel", "KVCache", "ForwardOutput"]
