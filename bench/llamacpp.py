"""llama.cpp (through llama-cpp-python) beside our decoders in ``bench/e2e.py``.

llama-cpp-python is optional and never installed in CI (its build from the sdist takes ~20 minutes of a
2-core machine); it may live in a separate virtual environment. The benchmark then runs it in a subprocess
of that environment's Python (``serve``, this file run as a script), which loads each GGUF once and decodes
the token ids it is sent: no tokenizer on either side, the same prompt ids as our decoders, greedy
(the argmax of the logits, lowest id on ties, as ``torch.argmax``), exactly ``max_new`` tokens (EOS ignored).

    # the Python that can import llama_cpp (default: this one, where it can)
    python bench/e2e.py --providers ours-plain llamacpp --llamacpp-python build/llamacpp-venv/bin/python

GGUF files for the weight types (``write_gguf``, with the ``gguf`` package, from the shipped file): F32 and
BF16 are the shipped matrices dequantized (the values our fp32 model holds; BF16 rounded to nearest even as
``torch``), Q8_0 / Q4_1 their GGML blocks by the ``gguf`` quantizer (bytes identical to
``quantize_matrices``), and the shipped file itself (Q4_1 projections, Q8_0 tied embedding) is ``ggufw``.
Provider names follow e2e's weight suffixes, so "same as plain" compares each with our plain decoding at the
same weights: ``llamacpp`` (F32) with ``ours-plain``, ``llamacpp-bf16w`` with ``ours-plain-bf16w``,
``llamacpp-q8_0w``, ``llamacpp-q4_1w`` and ``llamacpp-ggufw`` likewise.

Timing (per prompt, wall clock): the prompt's ``eval`` and the first argmax are the time to the first token;
each later token is one ``eval`` of the previous token and an argmax of its logits (llama.cpp's own default
context settings: F16 K/V cache, its default attention path).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

# e2e weight suffix -> GGUF kind written by write_gguf ("" is fp32; "gguf" the shipped file as it is).
KINDS = {"": "f32", "-bf16w": "bf16", "-q8_0w": "q8_0", "-q4_1w": "q4_1", "-ggufw": "gguf"}
FILE_TYPES = {"f32": 0, "bf16": 32, "q8_0": 7, "q4_1": 3}  # llama_ftype, for general.file_type


def write_gguf(source: str, dest: str, kind: str) -> str:
    """``source`` (a llama GGUF) with every 2-D matrix converted to ``kind`` (f32, bf16, q8_0, q4_1) from its
    exact dequantization; norms and metadata as they are. Returns ``dest``; an existing ``dest`` is kept."""
    if kind not in FILE_TYPES:
        raise ValueError(f"kind: expected one of {sorted(FILE_TYPES)}, got {kind!r}")
    if os.path.exists(dest):
        return dest
    import gguf
    import numpy as np

    Q = gguf.GGMLQuantizationType
    target = {"f32": Q.F32, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_1": Q.Q4_1}[kind]
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"]
    tmp = dest + ".tmp"
    writer = gguf.GGUFWriter(tmp, bytes(arch.parts[arch.data[0]]).decode())
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = FILE_TYPES[kind] if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    tensors = []
    for t in reader.tensors:
        data = np.asarray(t.data)
        if len(t.shape) == 2:  # the matrices; norms stay F32
            rows = int(t.shape[1])  # GGUF lists dims fastest first: [K, N]
            values = gguf.quants.dequantize(data, t.tensor_type).reshape(rows, -1).astype(np.float32)
            data = values if target == Q.F32 else gguf.quants.quantize(values, target)
            tensors.append((t.name, data, target))
        else:
            tensors.append((t.name, data, t.tensor_type))
    for name, data, qtype in tensors:
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dest)
    return dest


def find_python(explicit: str | None) -> str | None:
    """The Python to run llama_cpp with: ``explicit`` if given, else this one where it can import llama_cpp;
    None where there is none (the providers are then skipped)."""
    if explicit:
        return explicit
    import importlib.util

    return sys.executable if importlib.util.find_spec("llama_cpp") is not None else None


def noamx_shim(build_dir: str) -> str | None:
    """``llamacpp_noamx.c`` (refuses ggml the AMX tile state) built once into ``build_dir``; None (with a
    message) where no C compiler can build it."""
    dest = os.path.join(build_dir, "llamacpp_noamx.so")
    if not os.path.exists(dest):
        source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llamacpp_noamx.c")
        cmd = ["cc", "-O2", "-shared", "-fPIC", "-o", dest, source, "-ldl"]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            print(f"llamacpp: could not build the AMX refusal shim ({' '.join(cmd)}: {exc}); AMX left on")
            return None
    return dest


class LlamaCpp:
    """A ``serve`` subprocess: ``run(path, threads, prompts, max_new)`` -> e2e's run dict. ``preload``: a
    shared library preloaded into it (``noamx_shim``)."""

    def __init__(self, python: str, preload: str | None = None):
        env = dict(os.environ, PYTHONPATH="")
        if preload:
            env["LD_PRELOAD"] = " ".join(filter(None, [preload, env.get("LD_PRELOAD")]))
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), "--serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.version = self._ask({"op": "version"})["version"]

    def _ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp worker exited (code {self.proc.wait()}): see its stderr above")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"llama.cpp worker: {reply['error']}")
        return reply

    def run(self, path: str, threads: int, prompts: list, max_new: int) -> dict:
        return self._ask({"op": "run", "path": path, "threads": threads, "prompts": prompts, "max_new": max_new})

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait()


def peak_mb() -> float:
    """This process's peak RSS (VmHWM: ru_maxrss would count the benchmark's RSS at the fork)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def serve() -> None:  # runs under the Python of llama_cpp: numpy and llama_cpp only
    import time

    import llama_cpp
    import numpy as np

    models = {}

    def decode(llm, prompt, max_new):
        n_vocab = llm.n_vocab()
        llm.reset()
        tokens = []
        t0 = time.perf_counter()
        llm.eval(prompt)
        first = 0.0
        for i in range(max_new):
            logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))
            tokens.append(int(np.argmax(logits)))
            if i == 0:
                first = time.perf_counter() - t0
            if i + 1 < max_new:
                llm.eval(tokens[-1:])
        return tokens, time.perf_counter() - t0, first

    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "version":
                reply = {"version": llama_cpp.__version__}
            else:
                path, threads = request["path"], request["threads"]
                # The context holds the longest prompt and its new tokens, in whole 1,024-token steps.
                need = max(len(p) for p in request["prompts"]) + request["max_new"]
                n_ctx = 1024 * -(-need // 1024)
                llm = models.get(path)
                if llm is None or llm.n_ctx() < n_ctx:
                    llm = models[path] = llama_cpp.Llama(path, n_ctx=n_ctx, n_batch=512, n_threads=threads,
                                                         n_threads_batch=threads, verbose=False)
                llm._ctx.set_n_threads(threads, threads)
                reply = {"tokens": 0, "seconds": 0.0, "first_token_seconds": 0.0, "sequences": [], "tau": None}
                for prompt in request["prompts"]:
                    tokens, seconds, first = decode(llm, prompt, request["max_new"])
                    reply["tokens"] += len(tokens)
                    reply["seconds"] += seconds
                    reply["first_token_seconds"] += first
                    reply["sequences"].append(tokens)
                reply["peak_mb"] = peak_mb()
        except Exception as e:  # reported to the benchmark, which stops with it
            reply = {"error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        sys.exit("usage: python bench/llamacpp.py --serve (started by bench/e2e.py)")
