"""bench/llamacpp.py, without llama.cpp: the GGUF files it writes for the weight types (a tiny synthetic llama
GGUF) and the worker protocol (a stand-in ``llama_cpp`` module whose logits are known)."""

from __future__ import annotations

import os
import sys
import textwrap

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import llamacpp  # noqa: E402

from eagle_kernels.reference.cpu_linear import dequantize, quantize  # noqa: E402

Q = gguf.GGMLQuantizationType


def tiny_gguf(path) -> dict:
    """A llama GGUF with a Q8_0 embedding, a Q4_1 and an F32 matrix and an F32 norm; returns the matrices'
    exact float32 values by tensor name."""
    g = torch.Generator().manual_seed(0)
    values = {"token_embd.weight": torch.randn(64, 32, generator=g), "blk.0.ffn_up.weight": torch.randn(32, 64,
                                                                                                      generator=g),
              "blk.0.ffn_down.weight": torch.randn(32, 64, generator=g)}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_file_type(3)
    writer.add_string("general.name", "tiny")
    stored = {"token_embd.weight": Q.Q8_0, "blk.0.ffn_up.weight": Q.Q4_1, "blk.0.ffn_down.weight": Q.F32}
    exact = {}
    for name, qtype in stored.items():
        data = values[name].numpy()
        if qtype != Q.F32:
            data = gguf.quants.quantize(data, qtype)
            exact[name] = gguf.quants.dequantize(data, qtype).reshape(values[name].shape)
        else:
            exact[name] = data
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return exact


@pytest.mark.parametrize("kind", ["f32", "bf16", "q8_0", "q4_1"])
def test_write_gguf_converts_every_matrix_from_its_exact_values(tmp_path, kind):
    exact = tiny_gguf(tmp_path / "src.gguf")
    dest = llamacpp.write_gguf(str(tmp_path / "src.gguf"), str(tmp_path / f"{kind}.gguf"), kind)
    reader = gguf.GGUFReader(dest)
    assert reader.fields["general.file_type"].contents() == llamacpp.FILE_TYPES[kind]
    assert reader.fields["general.name"].contents() == "tiny"
    tensors = {t.name: t for t in reader.tensors}
    norm = tensors.pop("blk.0.attn_norm.weight")
    assert norm.tensor_type == Q.F32 and np.array_equal(norm.data, np.ones(32, dtype=np.float32))
    assert set(tensors) == set(exact)
    for name, t in tensors.items():
        assert t.tensor_type == {"f32": Q.F32, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_1": Q.Q4_1}[kind], name
        rows, cols = exact[name].shape
        got = torch.from_numpy(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(rows, cols).copy())
        source = torch.from_numpy(np.ascontiguousarray(exact[name]))
        if kind == "f32":
            want = source
        elif kind == "bf16":
            want = source.to(torch.bfloat16).float()  # round to nearest even, as torch
        else:  # the blocks our quantizer makes from the same values (quantize_matrices' bytes)
            want = dequantize(quantize(source, kind)).float()
        assert torch.equal(got, want), name


def test_write_gguf_rejects_an_unknown_kind(tmp_path):
    with pytest.raises(ValueError, match="kind"):
        llamacpp.write_gguf("unused.gguf", str(tmp_path / "x.gguf"), "q5_0")


def test_worker_decodes_greedily_from_the_token_ids(tmp_path):
    """The worker feeds the prompt's ids, then each argmax; exactly max_new tokens, lowest id on ties."""
    fake = tmp_path / "fake" / "llama_cpp"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(textwrap.dedent("""
        import ctypes
        import numpy as np
        __version__ = "stand-in"
        class _Ctx:
            def __init__(self, llm):
                self.llm = llm
            def get_logits_ith(self, i):
                return self.llm.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            def set_n_threads(self, n, n_batch):
                self.llm.threads = n
        class Llama:
            def __init__(self, path, n_ctx=512, **kwargs):
                self.logits = np.zeros(50, dtype=np.float32)
                self._ctx = _Ctx(self)
                self.context = n_ctx
            def n_ctx(self):
                return self.context
            def n_vocab(self):
                return 50
            def reset(self):
                self.seen = []
            def eval(self, tokens):
                self.seen += list(tokens)
                if len(self.seen) > self.context:  # llama_decode fails past the context
                    raise RuntimeError("llama_decode returned 1")
                self.logits[:] = 0.0
                self.logits[[(self.seen[-1] * 3 + len(self.seen)) % 50, 49]] = 1.0  # a tie: the lower id wins
    """))
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path / 'fake'} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    worker = llamacpp.LlamaCpp(str(python))
    try:
        assert worker.version == "stand-in"
        run = worker.run("model.gguf", 2, [[5, 7], [11]], 4)
        # A prompt past the first context (1,024 tokens) gets a model with a larger one.
        long_run = worker.run("model.gguf", 2, [[3] * 1500], 4)
    finally:
        worker.close()

    def expected(prompt):
        seen, out = list(prompt), []
        for _ in range(4):
            out.append(min((seen[-1] * 3 + len(seen)) % 50, 49))
            seen.append(out[-1])
        return out

    assert run["sequences"] == [expected([5, 7]), expected([11])]
    assert long_run["sequences"] == [expected([3] * 1500)]
    assert run["tokens"] == 8 and run["seconds"] >= run["first_token_seconds"] > 0 and run["peak_mb"] > 0
