"""Conversion cost of the engine adapters (eagle_kernels/integrations/) on CPU.

Run in the engine venv (scripts/setup_engines_env.sh), from the repository root:

    TRITON_INTERPRET=1 build/engines-venv/bin/python bench/bench_engines.py

For each wrapped engine call it times the whole call (layout conversion both ways + our op) and
our op alone on the converted inputs, side by side in one run; "conversion" is the difference,
as a share of the wrapped call. On CPU the adapters' conversions are native ops
(csrc/cpu/engine_layout.cpp) that call our ``verify`` kernel in C++; our op alone is that kernel
(``torch.ops.eagle_kernels.verify``) on the inputs they give it (recorded from the tensor path,
which the tests keep identical, or made by ``sglang_greedy_verify_inputs``). The
adapters' tensor path (what runs on GPU, capturable in a CUDA graph) is timed on CPU as well. SGLang's
tree build is a conversion only (no op of ours inside): its row gives the native op and the tensor
path. The engines' own kernels are timed where they run on CPU: SGLang's tree kernels and vLLM's rejection
sampler are Triton kernels, here under the Triton interpreter, which runs them at Python speed
and is no speed reference (SGLang's CPU kernels live in sgl_kernel, a source build not on the
package index), so they are timed at the smallest shape only. Minimum over repeated calls (the
least disturbed by other load on a shared machine), in microseconds; the wrapped call and our op
alone are timed with their calls alternated, so that both see the same load.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python_tests", "integrations"))


def best_us(fn, repeats=30, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e6


def best_pair_us(wrapped, alone, repeats=30, warmup=3):
    """Minimum times of ``wrapped`` and ``alone`` with the calls alternated, so that both see
    the same load (the host is shared)."""
    for _ in range(warmup):
        wrapped()
        alone()
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, fn in enumerate((wrapped, alone)):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0] * 1e6, best[1] * 1e6


class Recorder:
    """Records the arguments of the adapter's ``ops.verify`` call."""

    def __init__(self, module):
        self.module, self.calls = module, []
        self.original = module.ops.verify

    def __enter__(self):
        def record(*args, **kwargs):
            self.calls.append((args, kwargs))
            return self.original(*args, **kwargs)

        self.module.ops.verify = record
        return self

    def __exit__(self, *exc):
        self.module.ops.verify = self.original


def op_alone_fn(module, call, native=False, drop_column=False):
    """Our op alone on the inputs ``call`` hands it (recorded): through ``eagle_kernels.verify``,
    or with ``native`` the registered kernel itself, as the fused native conversion calls it;
    ``drop_column``: the tensor path's extra never-selected logits column dropped where no token
    needs it, as SGLang's native conversion does."""
    import torch

    from eagle_kernels import ops

    with Recorder(module) as rec:
        call()
    args, kwargs = rec.calls[-1]
    if drop_column:
        tokens, parents, logits = args
        V = logits.shape[-1] - 1
        if bool((tokens < V).all()):
            args = (tokens, parents, logits[..., :V])
    op = torch.ops.eagle_kernels.verify if native else ops.verify
    return lambda: op(*args, **kwargs)


def ragged_op_alone_fn(flat, counts, logits, meta):
    """verify on each request's chain as vllm_chains makes it (root + first n - 1 drafts, the
    request's rows in place, vLLM's uniforms' bits as the stream), all requests in turn."""
    import torch
    from vllm.v1.sample.rejection_sampler import generate_uniform_probs

    V = logits.shape[1]
    uniform = None if meta.all_greedy else generate_uniform_probs(logits.shape[0], counts, {}, "cpu")
    calls, start = [], 0
    for b, n in enumerate(counts):
        if n:
            tokens = torch.cat([torch.zeros(1, dtype=torch.long), flat[start : start + n - 1].long()])[None]
            parents = (torch.arange(n, dtype=torch.int32) - 1)[None]
            kwargs = dict(max_depth=n - 1)
            if uniform is not None:
                bits = uniform.double().view(torch.int64)
                kwargs.update(temperature=(meta.temperature[b : b + 1] != 0).float(), seed=bits[start : start + 1],
                              offset=bits[start + n - 1 : start + n])
            calls.append(((tokens, parents, logits[start : start + n].view(1, n, V)), kwargs))
        start += n

    def run():
        for args, kwargs in calls:
            torch.ops.eagle_kernels.verify(*args, **kwargs)

    return run


def main():
    import conftest  # noqa: F401  (the engines' import-time stubs)
    import numpy as np
    import sglang_cases as cases
    import torch
    from sglang.kernels.ops.speculative import spec_tree
    from sglang.srt.speculative import eagle_utils

    from eagle_kernels.integrations import sglang as sg
    from eagle_kernels.integrations import vllm as vl

    # One thread: on a loaded machine OpenMP wake-ups cost milliseconds per small op.
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread")
    rows = []
    gen = torch.Generator().manual_seed(0)
    for bs, topk, depth, n in ((1, 4, 4, 8), (8, 8, 6, 16), (32, 8, 6, 64)):
        score_list, token_list, parents_list = cases.random_draft(bs, topk, depth, 50, gen)
        parent_list, top_index, _ = eagle_utils.organize_draft_results(score_list, token_list, parents_list, n)
        seq_lens = torch.randint(100, 2000, (bs,), generator=gen)
        mask = torch.full((n * n * bs,), True)
        ret = torch.full((3, bs, n), -1, dtype=torch.long)
        pos = torch.empty(bs * n, dtype=torch.long)
        build_args = (parent_list, top_index, seq_lens, mask, pos, ret[0], ret[1], ret[2], topk, depth, n, 1)
        ours_build = best_us(lambda: sg.build_tree(*build_args))  # native on CPU
        tensors_build = best_us(lambda: sg.build_tree_tensors(*build_args))
        small = bs == 1
        sgl_build = (best_us(lambda: spec_tree.sgl_build_tree_kernel_triton(*build_args), repeats=3, warmup=1)
                     if small else None)
        rows.append(("sglang build_tree (QLEN_ONLY)", f"bs={bs} topk={topk} depth={depth} N={n}", ours_build, None,
                     tensors_build, sgl_build))
        sg.build_tree(*build_args)
        cand = torch.randint(0, 3, (bs, n), generator=gen)
        target = torch.randint(0, 3, (bs, n), generator=gen)
        outs = (torch.zeros(bs * n, dtype=torch.int32), torch.full((bs, depth + 1), -1, dtype=torch.int32),
                torch.empty(bs, dtype=torch.int32))
        greedy_args = (*outs, cand, ret[0], ret[1], ret[2], target)
        tensors = best_us(lambda: sg.verify_greedy_tensors(*greedy_args))
        # verify alone on the native conversion's own inputs (the nodes the walk looks at, 3 classes).
        tok, par, lg, _ = torch.ops.eagle_kernels.sglang_greedy_verify_inputs(cand, ret[1], ret[2], target, depth)
        total, alone = best_pair_us(lambda: sg.verify_greedy(*greedy_args),
                                    lambda: torch.ops.eagle_kernels.verify(tok, par, lg, max_depth=depth), 300)
        sgl = (best_us(lambda: spec_tree.verify_tree_greedy_triton(*greedy_args), repeats=3, warmup=1)
               if small else None)
        rows.append(("sglang verify_tree_greedy", f"bs={bs} N={n}", total, alone, tensors, sgl))
        for V in (32000,):
            # SGLang's probabilities as eagle_sample makes them (softmax of the logits over the
            # temperature, through the plugin's softmax hook), then top-k: the sampling verify
            # takes the logits and parameters they were made of (the handoff); the same
            # probabilities as a fresh tensor take the logarithm path.
            logits = torch.randn(bs * n, V, generator=gen)
            temps = torch.full((bs * n, 1), 0.8)
            top_ks = torch.full((bs * n,), 50)
            probs = sg.softmax_hook(lambda x, t: torch.softmax(x / t, -1), logits, temps)
            probs = sg.top_k_renorm_prob(probs, top_ks).view(bs, n, V)
            coins, final = torch.rand(bs, n, generator=gen), torch.rand(bs, generator=gen)
            handed = sg._handed_logits(probs)
            assert handed is not None
            sample_args = (*outs, cand, ret[0], ret[1], ret[2], coins, final, probs)
            tensors = best_us(lambda: sg.tree_sampling_tensors(*sample_args[:-1], None, handed), repeats=3)
            alone = op_alone_fn(sg, lambda: sg.tree_sampling_tensors(*sample_args[:-1], None, handed, compact=True),
                                native=True)
            total, alone = best_pair_us(lambda: sg.tree_sampling(*sample_args), alone)
            rows.append(("sglang tree sampling (logits)", f"bs={bs} N={n} V={V}", total, alone, tensors, None))
            # Probabilities the adapter does not know the making of (here unfiltered: zeros, as
            # top-k leaves, make torch.log take a slow path): the logarithm path.
            fresh = torch.softmax(logits / temps, -1).view(bs, n, V)
            fresh_args = (*sample_args[:-1], fresh)
            slow = bs * n * V > 1 << 22
            tensors = best_us(lambda: sg.tree_sampling_tensors(*fresh_args), repeats=3)
            alone = op_alone_fn(sg, lambda: sg.tree_sampling_tensors(*fresh_args), native=True, drop_column=True)
            total, alone = best_pair_us(lambda: sg.tree_sampling(*fresh_args), alone, 3 if slow else 10)
            rows.append(("sglang tree sampling (probs)", f"bs={bs} N={n} V={V}", total, alone, tensors, None))

    from types import SimpleNamespace

    for bs, k, V, ragged in ((1, 3, 32000, False), (16, 5, 32000, False), (16, 5, 32000, True)):
        counts = [k] * bs
        if ragged:  # one request with a shorter chain: the gathered layout
            counts[-1] = k - 2
        T = sum(counts)
        flat = torch.randint(0, V, (T,), generator=gen, dtype=torch.int32)
        cu = torch.tensor(np.cumsum(counts), dtype=torch.int32)
        logits = torch.randn(T, V, generator=gen)
        bonus = torch.randint(0, V, (bs, 1), generator=gen, dtype=torch.int32)
        for name, meta in (("greedy", SimpleNamespace(all_greedy=True, all_random=False, temperature=None,
                                                        generators={})),
                           ("random", SimpleNamespace(all_greedy=False, all_random=True, temperature=torch.ones(bs),
                                                        generators={}))):
            call = lambda: vl.chain_verify(flat, counts, k, cu, None, logits, bonus, meta)  # noqa: E731
            tensors = None
            if ragged:
                # The native op verifies each request alone (its rows in place): our op alone is
                # those calls, timed here from Python (each call's dispatch, ~1-2 us, counted in).
                alone = ragged_op_alone_fn(flat, counts, logits, meta)
                native, vl._native_chains = vl._native_chains, lambda: None
                try:
                    tensors = best_us(call, repeats=10)
                finally:
                    vl._native_chains = native
            else:
                # The native op (CPU) calls verify in C++; the tensor path's call records the same
                # inputs (tests keep the two identical).
                native, vl._native_chains = vl._native_chains, lambda: None
                try:
                    tensors = best_us(call, repeats=10)
                    alone = op_alone_fn(vl, call, native=True)
                finally:
                    vl._native_chains = native
            total, alone = best_pair_us(call, alone, 300 if bs == 1 else 30)
            shape = f"bs={bs} k={k} V={V}" + (" ragged" if ragged else "")
            rows.append((f"vllm rejection_sample ({name})", shape, total, alone, tensors, None))

    # Drafts drawn by a sampling drafter, with its probabilities: vLLM's draft_probs (V1, gathered
    # chains) and SGLang's rejection-sampling chains, through verify's draft-aware rule (tensor code
    # on every device: the wrapped call is the tensor path).
    bs, k, V = 16, 5, 32000
    counts = [k] * bs
    flat = torch.randint(0, V, (bs * k,), generator=gen, dtype=torch.int32)
    cu = torch.tensor(np.cumsum(counts), dtype=torch.int32)
    logits = torch.randn(bs * k, V, generator=gen)
    draft_probs = torch.softmax(torch.randn(bs * k, V, generator=gen), -1)
    bonus = torch.randint(0, V, (bs, 1), generator=gen, dtype=torch.int32)
    meta = SimpleNamespace(all_greedy=False, all_random=True, temperature=torch.ones(bs), generators={})
    call = lambda: vl.chain_verify(flat, counts, k, cu, draft_probs, logits, bonus, meta)  # noqa: E731
    total, alone = best_pair_us(call, op_alone_fn(vl, call), 10)
    rows.append(("vllm rejection_sample (q)", f"bs={bs} k={k} V={V}", total, alone, total, None))
    n = k + 1
    outs = (torch.zeros(bs * n, dtype=torch.int32), torch.full((bs, n), -1, dtype=torch.int32),
            torch.empty(bs, dtype=torch.int32))
    links = torch.full((bs, n), -1)
    # The target's probabilities as SGLang's softmax (hooked) makes them, verified from their logits,
    # and the same probabilities as a fresh tensor, through their logarithm.
    chain_logits = torch.randn(bs * n, V, generator=gen)
    made = sg.softmax_hook(lambda x, t: torch.softmax(x / t, -1), chain_logits, torch.full((bs * n, 1), 0.8))
    for source, target_probs in (("logits", made.view(bs, n, V)), ("probs", made.clone().view(bs, n, V))):
        chain_args = (*outs, torch.randint(0, V, (bs, n), generator=gen), torch.arange(bs * n).view(bs, n), links,
                      links, torch.rand(bs, n, generator=gen), torch.rand(bs, generator=gen), target_probs,
                      torch.softmax(torch.randn(bs, n - 1, V, generator=gen), -1), 1.0, 1.0, True)
        call = lambda: sg.chain_sampling(*chain_args)  # noqa: E731
        total, alone = best_pair_us(call, op_alone_fn(sg, call), 10)
        rows.append((f"sglang chain sampling ({source})", f"bs={bs} N={n} V={V}", total, alone, total, None))

    print(f"{'call':30} {'shape':28} {'wrapped us':>10} {'op alone us':>11} {'conversion':>10} "
          f"{'tensor path us':>14} {'engine kernel (interp.) us':>26}")
    for name, shape, total, alone, tensors, engine in rows:
        conv = "" if alone is None else f"{100 * (total - alone) / total:.0f}%"
        cells = ["" if x is None else f"{x:.1f}" if x < 100 else f"{x:.0f}" for x in (total, alone, tensors, engine)]
        print(f"{name:30} {shape:28} {cells[0]:>10} {cells[1]:>11} {conv:>10} {cells[2]:>14} {cells[3]:>26}")


if __name__ == "__main__":
    main()
