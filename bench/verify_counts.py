"""Memory traffic of the Triton ``verify`` launch, counted in the Triton interpreter.

Runs ``eagle_kernels.triton.verify`` with its GPU launch configuration under TRITON_INTERPRET=1
on the bench's inputs (``bench_verify.make_inputs``: EAGLE-2 shaped trees of depth 6, one
planted token per row with p about 0.97 at T = 0.8) and counts, per mode:

- ``launches``: kernel launches; ``programs``: programs launched (all grids together);
- ``rows``: logit rows the launch read at least one entry of, of the B * N rows given;
- ``visited``: rows the walk visits (reference walk: accepted nodes + the bonus row);
- ``read``: bytes loaded from the logits tensor, and that over one read of the visited rows
  (``read / visited row bytes``: the passes over the rows the walk needs);
- ``max passes``: the most bytes read from one row over the row's size.

Modes: those of bench_verify (tiny nuclei: the planted token holds p about 0.97), ``topkp-wide``
(top-k 20000 with top-p 0.9: a top-k set beyond any candidate list), and with a ``-flat`` suffix
the same inputs with logits / 10 (huge nuclei: top-p 0.9 keeps most of the vocabulary, beyond
any candidate list).

Every masked-in element of a ``tl.load`` whose address lies in the logits tensor counts its
element size (what the kernel requests; a GPU reads whole 32-byte sectors, the same here for
contiguous tiles). The interpreter runs every program, so this is slow at V 128k for a launch
that reads all B * N rows: ``--rows`` picks fewer nodes per request to extrapolate from.

    TRITON_INTERPRET=1 PYTHONPATH=. python bench/verify_counts.py --B 8 --N 64 --V 128256
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton.runtime.interpreter as interp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_verify  # noqa: E402

from eagle_kernels import reference  # noqa: E402


class Counter:
    """Patches the interpreter's loads and launches; counts bytes read inside ``tensor``."""

    def __init__(self, tensor: torch.Tensor):
        self.base = tensor.data_ptr()
        self.row_bytes = tensor.shape[-1] * tensor.element_size()
        self.rows = tensor.numel() // tensor.shape[-1]
        self.end = self.base + tensor.numel() * tensor.element_size()
        self.per_row = np.zeros(self.rows, dtype=np.int64)
        self.launches = 0
        self.programs = 0

    def __enter__(self):
        builder, executor = interp.InterpreterBuilder, interp.GridExecutor
        self._load, self._call = builder.create_masked_load, executor.__call__
        counter = self

        def create_masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
            addr = np.asarray(ptrs.data).astype(np.uint64).ravel()
            m = np.broadcast_to(np.asarray(mask.data), np.asarray(ptrs.data).shape).ravel()
            inside = m & (addr >= counter.base) & (addr < counter.end)
            if inside.any():
                size = np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize
                rows = ((addr[inside] - counter.base) // counter.row_bytes).astype(np.int64)
                counter.per_row += np.bincount(rows, minlength=counter.rows) * size
            return counter._load(self, ptrs, mask, other, cache_policy, is_volatile)

        def call(self, *args, **kwargs):
            counter.launches += 1
            grid = [g(kwargs) if callable(g) else g for g in (self.grid if isinstance(self.grid, tuple) else ())]
            counter.programs += int(np.prod(grid)) if grid else 0
            return counter._call(self, *args, **kwargs)

        builder.create_masked_load, executor.__call__ = create_masked_load, call
        return self

    def __exit__(self, *exc):
        interp.InterpreterBuilder.create_masked_load, interp.GridExecutor.__call__ = self._load, self._call


# Modes beyond bench_verify's: (its mode, sampling arguments replaced).
EXTRA_MODES = {"topkp-wide": ("topkp", dict(top_k=20000))}


def count(B, N, V, mode, rows=None):
    from eagle_kernels.triton import verify as triton_verify

    flat = mode.endswith("-flat")
    base, replaced = EXTRA_MODES.get(mode.removesuffix("-flat"), (mode.removesuffix("-flat"), {}))
    tokens, parents, logits, sampling = bench_verify.make_inputs(B, N, V, base, torch.bfloat16)
    for name, value in replaced.items():
        sampling[name] = torch.full_like(sampling[name], value)
    if flat:  # logits / 10: a nucleus of most of the vocabulary, no candidate list holds it
        logits = logits / 10
    if rows is not None:  # the first `rows` nodes of each tree (for launches that read every row)
        tokens, parents, logits = tokens[:, :rows].contiguous(), parents[:, :rows].contiguous(), \
            logits[:, :rows].contiguous()
    want = reference.verify(tokens, parents, logits, max_depth=bench_verify.MAX_DEPTH, **sampling)
    start = time.perf_counter()
    with Counter(logits) as c:
        got = triton_verify.verify(tokens, parents, logits, max_depth=bench_verify.MAX_DEPTH,
                                   _config=triton_verify.GPU_CONFIG, **sampling)
    seconds = time.perf_counter() - start
    same = all(torch.equal(x, y) for x, y in zip(got, want))
    visited = int(want.accept_len.sum()) + B  # accepted nodes + each request's last (bonus) row
    row_bytes = c.row_bytes
    return dict(mode=mode, B=B, N=tokens.shape[1], V=V, launches=c.launches, programs=c.programs,
                rows=int((c.per_row > 0).sum()), visited=visited, read=int(c.per_row.sum()),
                over_visited=c.per_row.sum() / (visited * row_bytes), max_passes=c.per_row.max() / row_bytes,
                same=same, seconds=seconds)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--B", type=int, default=8)
    parser.add_argument("--N", type=int, default=64)
    parser.add_argument("--V", type=int, default=128256)
    parser.add_argument("--rows", type=int, default=None, help="nodes per request kept (default: all N)")
    parser.add_argument("--modes", nargs="+", default=list(bench_verify.MODES),
                        help="bench_verify modes or topkp-wide; a -flat suffix divides the logits by 10 (huge nuclei)")
    args = parser.parse_args()
    print("| mode | B | N | V | launches | programs | rows read | rows visited | MB read | "
          "read / visited rows | max passes over a row | same as reference | interpreter s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for mode in args.modes:
        r = count(args.B, args.N, args.V, mode, args.rows)
        print(f"| {r['mode']} | {r['B']} | {r['N']} | {r['V']} | {r['launches']} | {r['programs']} | {r['rows']} | "
              f"{r['visited']} | {r['read'] / 1e6:.2f} | {r['over_visited']:.2f} | {r['max_passes']:.2f} | "
              f"{r['same']} | {r['seconds']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
