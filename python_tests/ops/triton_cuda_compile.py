"""Compile every Triton kernel for a CUDA GPU without one: ``python python_tests/ops/triton_cuda_compile.py [ARCH]``.

The interpreter that runs the kernels on CPU tensors in the tests accepts code that the
compiler rejects (a constexpr reassigned in a loop, a global that is not a constexpr), and it
says nothing about registers. This script drives each Triton launcher on small CPU tensors
with the launch itself replaced by a recorder, so the launchers pick their real GPU
configurations (block sizes, warps, stages, constexpr flags per dtype and layout); then it
compiles each recorded specialisation for ``sm_ARCH`` (default 90, an H100/H200) with the
installed Triton and its bundled ptxas, and prints one JSON line per kernel: name,
constexprs, options, registers per thread, local memory per thread (spills) and the
dynamic shared memory of a block.

Run it without ``TRITON_INTERPRET`` (python_tests/ops/test_triton_compile.py starts it in a
subprocess for that reason).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction, mangle_type

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET=1: interpreted kernels cannot be compiled")

from eagle_kernels.triton import draft_expand as triton_draft_expand  # noqa: E402
from eagle_kernels.triton import rmsnorm as triton_rmsnorm  # noqa: E402
from eagle_kernels.triton import rope_write_kv as triton_rope_write_kv  # noqa: E402
from eagle_kernels.triton import silu_mul as triton_silu_mul  # noqa: E402
from eagle_kernels.triton import tree_attention as triton_tree_attention  # noqa: E402
from eagle_kernels.triton import verify as triton_verify  # noqa: E402
from eagle_kernels.triton import write_kv as triton_write_kv  # noqa: E402

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def record_launches() -> list[tuple[JITFunction, tuple, dict]]:
    """(kernel, args, kwargs) of every launch the launchers make over a grid of dtypes and
    layouts; nothing runs."""
    launches = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, dict(kwargs)))

    original = JITFunction.run
    JITFunction.run = record
    try:
        _drive_launchers()
    finally:
        JITFunction.run = original
    return launches


def _drive_launchers() -> None:
    g = torch.Generator().manual_seed(0)
    # verify: every logits dtype, greedy and sampling rows with top-k and top-p, V of Llama 3.
    B, N, V = 2, 3, 128256
    tokens = torch.randint(0, V, (B, N), generator=g)
    parents = torch.tensor([[-1, 0, 1]] * B, dtype=torch.int32)
    sampling = dict(temperature=torch.tensor([0.0, 0.8]), top_k=torch.tensor([0, 50], dtype=torch.int32),
                    top_p=torch.tensor([1.0, 0.9]), seed=torch.tensor([1, 2]), offset=torch.tensor([0, 0]))
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        logits = torch.randn(B, N, V, generator=g).to(dtype)
        triton_verify.verify(tokens, parents, logits, max_depth=2, **sampling)

    # tree_attention: 16- and 32-bit tiles, head dims 64/128/256, each with four of the
    # (contiguous | paged) x (tree mask | causal) x (one split | flash-decoding splits) layouts.
    Hq, Hkv, cap, page, N = 8, 2, 256, 64, 7
    layouts = [(False, False, 1), (True, True, 4), (False, True, 4), (True, False, 1)]
    for dtype in (torch.bfloat16, torch.float32):
        for D in (64, 128, 256):
            for paged, causal, splits in layouts:
                q = torch.randn(B, N, Hq, D).to(dtype)
                seqlens = torch.tensor([100, 37], dtype=torch.int32)
                if paged:
                    pages = cap // page
                    k = torch.randn(B * pages, page, Hkv, D).to(dtype)
                    table = torch.randperm(B * pages, generator=g).view(B, pages).to(torch.int32)
                else:
                    k, table = torch.randn(B, cap, Hkv, D).to(dtype), None
                mask = None if causal else torch.ones(B, N, 1, dtype=torch.int64)
                triton_tree_attention._launch(q, k, k.clone(), seqlens, mask, block_table=table, num_splits=splits)
    # The 64-row configuration, chosen only on a GPU (by its SM count), with the tree mask.
    q, k = torch.randn(B, N, Hq, 128).bfloat16(), torch.randn(B, cap, Hkv, 128).bfloat16()
    triton_tree_attention._launch(q, k, k.clone(), torch.tensor([100, 37], dtype=torch.int32),
                                  torch.ones(B, N, 1, dtype=torch.int64), config=triton_tree_attention.GPU_CONFIG_SMALL)

    # draft_expand: logits dtypes, with and without the draft-to-target map.
    for dtype in (torch.bfloat16, torch.float32):
        for d2t in (None, torch.arange(32000, dtype=torch.int64)):
            logits = torch.randn(2, 8, 32000, generator=g).to(dtype)
            triton_draft_expand.draft_expand(logits, torch.zeros(2, 8), 8, d2t=d2t)

    # write_kv: contiguous and paged.
    for dtype in (torch.bfloat16, torch.float32):
        k_new = torch.randn(B, 5, Hkv, 128).to(dtype)
        seqlens = torch.tensor([10, 3], dtype=torch.int32)
        triton_write_kv.write_kv(torch.zeros(B, 64, Hkv, 128, dtype=dtype), torch.zeros(B, 64, Hkv, 128, dtype=dtype),
                                 k_new, k_new, seqlens)
        table = torch.arange(4, dtype=torch.int32).view(B, 2)
        triton_write_kv.write_kv(torch.zeros(4, 32, Hkv, 128, dtype=dtype), torch.zeros(4, 32, Hkv, 128, dtype=dtype),
                                 k_new, k_new, seqlens, block_table=table)

    _drive_layer_launchers()


def _drive_layer_launchers() -> None:
    """The GPU decoder layer's kernels at SmolLM2-135M's and Llama-3-8B's widths in bf16 (fp16 compiles
    the same tiles), and at SmolLM2-135M's in fp32."""
    shapes = ((576, 1536, (9, 3, 64)), (4096, 14336, (32, 8, 128)))
    for dtype, widths in ((torch.bfloat16, shapes), (torch.float32, shapes[:1])):
        for H, I, (Hq, Hkv, D) in widths:
            x = torch.randn(2, 3, H).to(dtype)
            triton_rmsnorm.rmsnorm(x, x[0, 0], 1e-5)
            triton_rmsnorm.rmsnorm(x, x[0, 0], 1e-5, embed=x, embed_weight=x[0, 0])
            triton_silu_mul.silu_mul(torch.randn(2, 3, 2 * I).to(dtype))
            cos = torch.zeros(64, D // 2)
            cache = torch.zeros(2, 16, Hkv, D, dtype=dtype)
            triton_rope_write_kv.rope_write_kv(torch.randn(2, 3, (Hq + 2 * Hkv) * D).to(dtype),
                                               torch.zeros(2, 3, dtype=torch.int64), cos, cos, cache, cache.clone(),
                                               torch.tensor([1, 2], dtype=torch.int32), num_heads=Hq, slot_offset=2)


def specialisation(kernel: JITFunction, args: tuple, kwargs: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, options) of one recorded launch, as the JIT would derive them."""
    params = inspect.signature(kernel.fn).parameters
    kwargs = dict(kwargs)
    options = {name: kwargs.pop(name) for name in ("num_warps", "num_stages") if name in kwargs}
    bound = dict(zip(params, args), **kwargs)
    signature = {name: "constexpr" if "constexpr" in str(p.annotation) else mangle_type(bound[name])
                 for name, p in params.items()}
    constexprs = {name: bound[name] for name in params if signature[name] == "constexpr"}
    return signature, constexprs, options


def compile_for_cuda(kernel: JITFunction, signature: dict, constexprs: dict, options: dict, arch: int) -> dict:
    """Compile for sm_``arch``; registers, local (spill) and static shared bytes from the cubin,
    dynamic shared bytes (Triton's tiles and pipeline buffers) from the compiled kernel."""
    names = list(signature)
    source = ASTSource(kernel, signature, {(names.index(name),): value for name, value in constexprs.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    resources = {key: int(value) for key, value in re.findall(r"(REG|LOCAL|SHARED|STACK):(\d+)", usage)}
    return dict(kernel=kernel.fn.__name__, constexprs={k: str(v) for k, v in constexprs.items()}, options=options,
                registers=resources["REG"], local_bytes=resources["LOCAL"], shared_bytes=resources["SHARED"],
                dynamic_shared_bytes=compiled.metadata.shared)


def main() -> None:
    arch = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    seen = set()
    for kernel, args, kwargs in record_launches():
        signature, constexprs, options = specialisation(kernel, args, kwargs)
        key = json.dumps([kernel.fn.__name__, signature, {k: str(v) for k, v in constexprs.items()}, options],
                         sort_keys=True)
        if key not in seen:
            seen.add(key)
            print(json.dumps(compile_for_cuda(kernel, signature, constexprs, options, arch)), flush=True)


if __name__ == "__main__":
    main()
