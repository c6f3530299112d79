"""The vLLM plugin against vLLM's own V1 rejection sampler on CPU (its Triton kernels under
TRITON_INTERPRET=1) (docs/serving.md). Runs in the venv of scripts/setup_engines_env.sh."""

from __future__ import annotations

import inspect
import logging
import os
from importlib import metadata
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

pytest.importorskip("vllm")

from chain_law import chi2_p_value, completed_p_value, rejection_chain_law  # noqa: E402
from scipy import stats  # noqa: E402
from vllm.v1.sample import rejection_sampler as rs  # noqa: E402

from eagle_kernels.integrations import vllm as plugin  # noqa: E402


def _interpretable_vllm_kernels():
    """vLLM's Triton launch helper reads a kernel's parameter names from the JIT function; under
    TRITON_INTERPRET=1 the kernel is an InterpretedFunction, whose Python function is ``fn``."""
    from vllm.model_executor.warmup import jit_warmup_triton_helper as helper

    cls = helper.VllmTritonJitKernel
    original = cls.__dict__["_kernel_arg_names"]

    def arg_names(self):
        if getattr(self.kernel, "arg_names", None) is None and getattr(self.kernel, "func", None) is None:
            fn = getattr(self.kernel, "fn", None) or self.kernel
            return tuple(inspect.signature(fn).parameters)
        return original.func(self)

    cls._kernel_arg_names = property(arg_names)


@pytest.fixture(scope="session")
def hooked():
    """vLLM's plugin loader discovers our entry point (once per process)."""
    import vllm.plugins

    _interpretable_vllm_kernels()

    os.environ["VLLM_PLUGINS"] = "eagle_kernels"
    vllm.plugins.plugins_loaded = False
    vllm.plugins.load_general_plugins()
    assert getattr(rs.rejection_sample, "__eagle_kernels__", False), "the plugin did not load"
    return rs.rejection_sample.__wrapped__


def batch(drafts, vocab):
    """vLLM's flattened draft layout for the ragged chains ``drafts``."""
    counts = [len(d) for d in drafts]
    flat = torch.tensor([t for d in drafts for t in d], dtype=torch.int32)
    cu = torch.tensor(np.cumsum(counts), dtype=torch.int32)
    return flat, counts, max(counts), cu


def greedy_metadata(bs):
    return SimpleNamespace(all_greedy=True, all_random=False, temperature=None, generators={})


def one_hot_logits(targets, vocab):
    """Target logits whose argmax at draft position j is targets[j] (the bonus column excluded)."""
    rows = [t for tgt in targets for t in tgt[:-1]]
    logits = torch.full((len(rows), vocab), -5.0)
    logits[torch.arange(len(rows)), torch.tensor(rows, dtype=torch.long)] = 5.0
    return logits


# vLLM's greedy chain cases (tests/v1/sample/test_rejection_sampler.py): drafts, target tokens
# (the last one is the bonus token), expected output.
GREEDY_CASES = {
    "perfect_match": ([[1, 2, 3]], [[1, 2, 3, 4]], [[1, 2, 3, 4]]),
    "early_mismatch": ([[1, 2, 3]], [[1, 5, 3, 4]], [[1, 5, -1, -1]]),
    "multiple_sequences": ([[1, 2], [3]], [[1, 2, 5], [3, 4]], [[1, 2, 5], [3, 4, -1]]),
    "single_token": ([[1]], [[1, 2]], [[1, 2]]),
    "empty_sequence": ([[]], [[5]], [[5]]),
    "multiple_mismatches": ([[1, 2, 3], [4, 5, 6]], [[1, 2, 7, 6], [4, 8, 6, 9]], [[1, 2, 7, -1], [4, 8, -1, -1]]),
}


def test_entry_point(hooked):
    eps = [ep for ep in metadata.entry_points(group="vllm.general_plugins") if ep.name == "eagle_kernels"]
    assert [ep.value for ep in eps] == ["eagle_kernels.integrations.vllm:register"]
    assert plugin.register() is True  # idempotent: vLLM runs general plugins in every process


@pytest.mark.parametrize("case", sorted(GREEDY_CASES))
def test_greedy_golden(hooked, case):
    drafts, targets, expected = GREEDY_CASES[case]
    vocab = 12
    flat, counts, max_len, cu = batch(drafts, vocab)
    bonus = torch.tensor([[t[-1]] for t in targets], dtype=torch.int32)
    logits = one_hot_logits(targets, vocab)
    out = rs.rejection_sample(flat, counts, max_len, cu, None, logits, bonus, greedy_metadata(len(drafts)))
    assert out.dtype == torch.int32
    assert out.tolist() == expected
    ref = hooked(flat, counts, max_len, cu, None, logits, bonus, greedy_metadata(len(drafts)))
    assert ref.tolist() == expected  # vLLM's own sampler agrees


@pytest.mark.parametrize("seed", range(4))
def test_greedy_random_chains_match_vllm(hooked, seed):
    gen = torch.Generator().manual_seed(seed)
    bs, max_len, vocab = 6, 5, 4
    counts = torch.randint(0, max_len + 1, (bs,), generator=gen).tolist()
    counts[0] = max_len
    drafts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in counts]
    flat, counts, max_len, cu = batch(drafts, vocab)
    logits = torch.randn(flat.numel(), vocab, generator=gen)
    bonus = torch.randint(0, vocab, (bs, 1), generator=gen, dtype=torch.int32)
    ours = rs.rejection_sample(flat, counts, max_len, cu, None, logits, bonus, greedy_metadata(bs))
    ref = hooked(flat, counts, max_len, cu, None, logits, bonus, greedy_metadata(bs))
    assert torch.equal(ours, ref)


def exact_chain_law(probs, drafts, bonus):
    """Law of the emitted tokens of one chain: x_j ~ p_j while x_j equals draft j; after the
    last draft, the bonus token."""
    law = {}

    def walk(j, prefix, mass):
        if j == len(drafts):
            law[prefix + (bonus,)] = law.get(prefix + (bonus,), 0) + mass
            return
        for x in range(probs.shape[1]):
            p = mass * probs[j, x]
            if p == 0:
                continue
            if x == drafts[j]:
                walk(j + 1, prefix + (x,), p)
            else:
                law[prefix + (x,)] = law.get(prefix + (x,), 0) + p

    walk(0, (), 1.0)
    return law


@pytest.mark.parametrize("layout", ["full_native", "full_tensor_path", "ragged"])
def test_sampling_is_exact(hooked, monkeypatch, layout):
    """χ² of the emitted chains (random requests, one greedy request mixed in) against the exact
    law of sampling from the target: full chains (read in place; native on CPU, and the tensor
    path) and ragged ones (gathered: one extra request with a shorter chain, not counted)."""
    if layout == "full_tensor_path":
        monkeypatch.setattr(plugin, "_native_chains", lambda: None)
    gen = torch.Generator().manual_seed(5)
    draws, vocab, chain = 4000, 4, [1, 3]
    probs = torch.softmax(torch.randn(len(chain), vocab, generator=gen) * 1.5, -1)
    probs[1, 0] = 0
    logits = torch.log(probs)
    extra = [[1]] if layout == "ragged" else []
    flat, counts, max_len, cu = batch([chain] * draws + extra, vocab)
    bonus = torch.full((draws + len(extra), 1), 2, dtype=torch.int32)
    temperature = torch.ones(draws + len(extra))
    temperature[0] = 0  # a greedy request in a random batch
    meta = SimpleNamespace(all_greedy=False, all_random=False, temperature=temperature, generators={})
    rows = torch.cat([logits.repeat(draws, 1), logits[:1].repeat(len(extra), 1)])
    out = rs.rejection_sample(flat, counts, max_len, cu, None, rows, bonus, meta)[:draws]
    greedy = [int(probs[0].argmax())]
    if greedy[0] == chain[0]:
        greedy += [int(probs[1].argmax())] if int(probs[1].argmax()) != chain[1] else [chain[1], 2]
    assert [t for t in out[0].tolist() if t >= 0] == greedy
    counts_seen = {}
    for row in out[1:].tolist():
        seq = tuple(t for t in row if t >= 0)
        counts_seen[seq] = counts_seen.get(seq, 0) + 1
    exact = probs.double() / probs.double().sum(-1, keepdim=True)
    law = exact_chain_law(exact.numpy(), chain, 2)
    assert set(counts_seen) <= set(law)
    keys = sorted(law)
    observed = np.array([counts_seen.get(k, 0) for k in keys], dtype=np.float64)
    expected = np.array([law[k] for k in keys])
    expected *= observed.sum() / expected.sum()
    assert stats.chisquare(observed, expected)[1] > 1e-3


def sampled_chain_batch(draws, gen, ragged):
    """Random requests whose 2-draft chains are drawn from q (one greedy request first; with
    ``ragged``, a last request with a 1-draft chain), vLLM's inputs for them, and p / q."""
    vocab, length = 4, 2
    p = torch.softmax(torch.randn(length, vocab, generator=gen) * 1.5, -1)
    p[1, 0] = 0
    p /= p.sum(-1, keepdim=True)
    q = torch.softmax(torch.randn(length, vocab, generator=gen), -1)
    q[0, 3] = 0  # a token the drafter never proposes
    q /= q.sum(-1, keepdim=True)
    chains = torch.stack([torch.multinomial(q[j], draws, replacement=True, generator=gen) for j in range(length)], 1)
    drafts = chains.tolist() + ([[1]] if ragged else [])
    flat, counts, max_len, cu = batch(drafts, vocab)
    rows = torch.log(p).repeat(draws, 1)
    probs = q.repeat(draws, 1)
    if ragged:
        rows, probs = torch.cat([rows, torch.log(p[:1])]), torch.cat([probs, q[:1]])
    n = len(drafts)
    temperature = torch.ones(n)
    temperature[0] = 0  # a greedy request in a random batch
    meta = SimpleNamespace(all_greedy=False, all_random=False, temperature=temperature, generators={})
    bonus = torch.full((n, 1), 2, dtype=torch.int32)
    return (flat, counts, max_len, cu, probs.contiguous(), rows, bonus, meta), drafts, p, q


def law_pvalue(out, draws, p, q):
    seen = {}
    for row in out[1:draws].tolist():
        seq = tuple(t for t in row if t >= 0)
        seen[seq] = seen.get(seq, 0) + 1
    return chi2_p_value(seen, rejection_chain_law(p.double().numpy(), q.double().numpy(), bonus=2))


@pytest.mark.parametrize("ragged", [False, True], ids=["full", "ragged"])
def test_draft_probs_sampling_is_exact(hooked, caplog, ragged):
    """Drafts drawn from q, with their draft probabilities: our verify's draft-aware rule (no
    fallback to vLLM's sampler) emits the exact law of rejection sampling against q (χ²), and the
    greedy request in the batch its argmax chain."""
    plugin._log_fallback.cache_clear()
    draws = 4000
    args, drafts, p, q = sampled_chain_batch(draws, torch.Generator().manual_seed(11), ragged)
    with caplog.at_level(logging.WARNING, logger="eagle_kernels.integrations"):
        out = rs.rejection_sample(*args)
    assert "falls back" not in caplog.text
    greedy = []
    for j, draft in enumerate(drafts[0]):
        greedy.append(int(p[j].argmax()))
        if greedy[-1] != draft:
            break
    else:
        greedy.append(2)
    assert [t for t in out[0].tolist() if t >= 0] == greedy
    assert law_pvalue(out, draws, p, q) > 1e-3


def test_draft_probs_law_is_vllms(hooked):
    """vLLM's own sampler on the same kind of inputs follows the law the test above holds ours to
    (the law is vLLM's rule, not ours restated)."""
    draws = 1500
    args, _, p, q = sampled_chain_batch(draws, torch.Generator().manual_seed(12), False)
    assert law_pvalue(hooked(*args), draws, p, q) > 1e-3


def test_draft_probs_greedy_and_bad_shape(hooked, caplog):
    """All-greedy batches ignore draft probabilities (vLLM's bits); draft probabilities of the
    wrong shape run vLLM's own sampler, with the reason logged."""
    plugin._log_fallback.cache_clear()
    gen = torch.Generator().manual_seed(13)
    flat, counts, max_len, cu = batch([[1, 2], [0]], 6)
    logits = torch.randn(3, 6, generator=gen)
    probs = torch.softmax(torch.randn(3, 6, generator=gen), -1)
    bonus = torch.tensor([[3], [4]], dtype=torch.int32)
    ours = rs.rejection_sample(flat, counts, max_len, cu, probs, logits, bonus, greedy_metadata(2))
    assert torch.equal(ours, hooked(flat, counts, max_len, cu, probs, logits, bonus, greedy_metadata(2)))
    meta = SimpleNamespace(all_greedy=False, all_random=True, temperature=torch.ones(2), generators={})
    with caplog.at_level(logging.WARNING, logger="eagle_kernels.integrations"):
        rs.rejection_sample(flat, counts, max_len, cu, probs[:, :5].contiguous(), logits, bonus, meta)
    assert "draft_probs: expected a float [3, 6] tensor" in caplog.text
    # A row that is no distribution (NaN): verify's fallback, no draft accepted, a token of p.
    bad = probs.clone()
    bad[0, 0] = float("nan")
    out = rs.rejection_sample(flat, counts, max_len, cu, bad, logits, bonus, meta)
    assert out[0, 0].item() in range(6) and out[0, 1:].tolist() == [-1, -1]


@pytest.mark.parametrize("native", [True, False], ids=["native_cpu", "tensor_path"])
def test_no_host_reads(hooked, monkeypatch, native):
    """Ragged chains (gathered layout) and full chains (read in place): no host reads, with the
    native CPU op for full chains and on the tensor path every other device takes."""
    from test_sglang import HostReads

    if not native:
        monkeypatch.setattr(plugin, "_native_chains", lambda: None)
    gen = torch.Generator().manual_seed(1)
    reads = HostReads(monkeypatch)
    for drafts in ([[1, 2, 3], [0], []], [[1, 2], [0, 4], [3, 3]]):
        flat, counts, max_len, cu = batch(drafts, 5)
        logits = torch.randn(flat.numel(), 5, generator=gen)
        bonus = torch.tensor([[1], [2], [3]], dtype=torch.int32)
        meta = SimpleNamespace(all_greedy=False, all_random=True, temperature=torch.ones(3), generators={})
        rs.rejection_sample(flat, counts, max_len, cu, None, logits, bonus, meta)
        rs.rejection_sample(flat, counts, max_len, cu, None, logits, bonus, greedy_metadata(3))
        probs = torch.softmax(torch.randn(flat.numel(), 5, generator=gen), -1)
        rs.rejection_sample(flat, counts, max_len, cu, probs, logits, bonus, meta)
    assert reads.calls == []


# ------------------------------------------------------------------------------ Model Runner V2
def v2_inputs(drafts, vocab, gen, temperature):
    """Model Runner V2's layout: request r owns k_r + 1 logits rows; the draft verified at row i
    is draft_sampled[i + 1]."""
    R = len(drafts)
    counts = [len(d) for d in drafts]
    cu = torch.tensor(np.concatenate([[0], np.cumsum([k + 1 for k in counts])]), dtype=torch.int32)
    sampled = []
    for d in drafts:
        sampled += [7] + list(d)
    num_logits = int(cu[-1])
    expanded = torch.repeat_interleave(torch.arange(R), torch.tensor([k + 1 for k in counts]))
    local = torch.cat([torch.arange(k + 1) for k in counts])
    return dict(draft_logits=None, draft_sampled=torch.tensor(sampled, dtype=torch.int64), cu_num_logits=cu,
                pos=(100 + local).long(), idx_mapping=torch.arange(R, dtype=torch.int32),
                expanded_idx_mapping=expanded.int(), expanded_local_pos=local.int(),
                temperature=torch.full((R,), float(temperature)), seed=torch.randint(0, 2**31, (R,), generator=gen)), \
        num_logits


@pytest.mark.parametrize("seed", range(3))
def test_v2_greedy_random_chains_match_vllm(hooked, seed):
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler as v2_sampler
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler_utils as v2

    assert v2_sampler.rejection_sample is v2.rejection_sample  # the sampler's copy is rebound too
    gen = torch.Generator().manual_seed(seed)
    steps, vocab = 4, 4
    drafts = [torch.randint(0, vocab, (int(k),), generator=gen).tolist() for k in [steps, 0, 2, steps, 1]]
    kwargs, num_logits = v2_inputs(drafts, vocab, gen, 0.0)
    logits = torch.randn(num_logits, vocab, generator=gen)
    ours, ours_n = v2.rejection_sample(logits, num_speculative_steps=steps, **kwargs)
    ref, ref_n = v2.rejection_sample.__wrapped__(logits, num_speculative_steps=steps, **kwargs)
    assert torch.equal(ours_n, ref_n)
    for r in range(len(drafts)):
        assert ours[r, : int(ref_n[r])].tolist() == ref[r, : int(ref_n[r])].tolist()


def test_v2_sampling_is_exact(hooked):
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler_utils as v2

    gen = torch.Generator().manual_seed(8)
    draws, vocab, chain = 3000, 4, [1, 3]
    probs = torch.softmax(torch.randn(len(chain) + 1, vocab, generator=gen) * 1.5, -1)
    probs[1, 0] = 0
    kwargs, num_logits = v2_inputs([chain] * draws, vocab, gen, 1.0)
    logits = torch.log(probs).repeat(draws, 1)
    out, num = v2.rejection_sample(logits, num_speculative_steps=len(chain), **kwargs)
    seen = {}
    for r in range(draws):
        seq = tuple(out[r, : int(num[r])].tolist())
        seen[seq] = seen.get(seq, 0) + 1
    exact = (probs.double() / probs.double().sum(-1, keepdim=True)).numpy()
    law = {}

    def walk(j, prefix, mass):
        for x in range(vocab):
            p = mass * exact[j, x]
            if p == 0:
                continue
            if j < len(chain) and x == chain[j]:
                walk(j + 1, prefix + (x,), p)
            else:
                law[prefix + (x,)] = law.get(prefix + (x,), 0) + p

    walk(0, (), 1.0)
    assert set(seen) <= set(law)
    keys = sorted(law)
    observed = np.array([seen.get(k, 0) for k in keys], dtype=np.float64)
    expected = np.array([law[k] for k in keys]) * draws
    expected *= draws / expected.sum()
    assert stats.chisquare(observed, expected)[1] > 1e-3


def v2_draft_logits_case(draws, gen, temperature=0.7, vocab=4, steps=2):
    """Model Runner V2 inputs whose drafts are drawn from q_j = softmax(draft_logits_j / T)."""
    p = torch.softmax(torch.randn(steps + 1, vocab, generator=gen) * 1.5, -1)
    p[1, 0] = 0
    p /= p.sum(-1, keepdim=True)
    draft_logits = torch.randn(steps, vocab, generator=gen) * 1.5
    q = torch.softmax(draft_logits / temperature, -1)
    drafts = torch.stack([torch.multinomial(q[j], draws, replacement=True, generator=gen) for j in range(steps)], 1)
    kwargs, _ = v2_inputs(drafts.tolist(), vocab, gen, temperature)
    kwargs["draft_logits"] = draft_logits.expand(draws, steps, vocab).contiguous()
    return kwargs, torch.log(p).repeat(draws, 1), p, q


def v2_law_p_value(out, num, p, q):
    seen = {}
    for r in range(out.shape[0]):
        seq = tuple(out[r, : int(num[r])].tolist())
        seen[seq] = seen.get(seq, 0) + 1
    return chi2_p_value(seen, rejection_chain_law(p.double().numpy(), q.double().numpy()))


@triton.jit
def _log1p(x):
    return tl.log(1.0 + x)


def _interpretable_log1p(monkeypatch):
    """vLLM's V2 residual calls libdevice's log1p, which the interpreter lacks: log(1 + x) there."""
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler_utils as v2

    monkeypatch.setattr(v2, "tldevice", SimpleNamespace(log1p=_log1p))


def test_v2_draft_logits_sampling_is_exact(hooked, caplog, monkeypatch):
    """Model Runner V2 with draft logits (stored before the temperature, T 0.7): our verify (no
    fallback) and vLLM's own sampler both follow the law of rejection sampling against
    q = softmax(draft_logits / T) (χ²); the drafts verified as one-hot (a planted bug) do not."""
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler_utils as v2

    _interpretable_log1p(monkeypatch)
    plugin._log_fallback.cache_clear()
    kwargs, logits, p, q = v2_draft_logits_case(3000, torch.Generator().manual_seed(31))
    with caplog.at_level(logging.WARNING, logger="eagle_kernels.integrations"):
        out, num = v2.rejection_sample(logits, num_speculative_steps=2, **kwargs)
    assert "falls back" not in caplog.text
    assert v2_law_p_value(out, num, p, q) > 1e-3
    # vLLM's own kernel is slow under the interpreter (about 30 ms a request): fewer requests.
    small, small_logits, p2, q2 = v2_draft_logits_case(400, torch.Generator().manual_seed(33))
    ref, ref_num = v2.rejection_sample.__wrapped__(small_logits, num_speculative_steps=2, **small)
    assert v2_law_p_value(ref, ref_num, p2, q2) > 1e-3
    bug, bug_num = plugin.chain_verify_v2(logits, num_speculative_steps=2, **{**kwargs, "draft_logits": None})
    assert v2_law_p_value(bug, bug_num, p, q) < 1e-6


def completion_p_value(out, num, p, seed):
    """Block verification's emitted sequences completed from p (:func:`chain_law.completed_p_value`)."""
    return completed_p_value([out[r, : int(num[r])].tolist() for r in range(out.shape[0])], p.double().numpy(), seed)


def test_v2_block_verification_is_exact(hooked, caplog, monkeypatch):
    """``rejection_sample_method="block"`` runs our block_verify (no fallback): with draft logits
    (drafts drawn from softmax(draft_logits / T)) and with deterministic drafts, the emitted
    sequences completed from p have the target's law (χ²), as vLLM's own block kernel's do; drafts
    verified against sharper rows than they were drawn from (a planted bug) do not. Greedy requests get vLLM's
    tokens, and the block keeps more drafts than the token-by-token rule on the same chains."""
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler_utils as v2

    _interpretable_log1p(monkeypatch)
    plugin._log_fallback.cache_clear()
    kwargs, logits, p, q = v2_draft_logits_case(3000, torch.Generator().manual_seed(41))
    with caplog.at_level(logging.WARNING, logger="eagle_kernels.integrations"):
        out, num = v2.rejection_sample(logits, num_speculative_steps=2, use_block_verification=True, **kwargs)
    assert "falls back" not in caplog.text
    assert completion_p_value(out, num, p, 1) > 1e-3
    _, token_num = v2.rejection_sample(logits, num_speculative_steps=2, **kwargs)
    assert float(num.double().mean()) > float(token_num.double().mean())
    small, small_logits, p2, _ = v2_draft_logits_case(300, torch.Generator().manual_seed(43))
    ref, ref_num = v2.rejection_sample.__wrapped__(small_logits, num_speculative_steps=2, use_block_verification=True,
                                                   **small)
    assert completion_p_value(ref, ref_num, p2, 2) > 1e-3
    bug, bug_num = plugin.chain_verify_v2(logits, num_speculative_steps=2, use_block_verification=True,
                                          **{**kwargs, "draft_logits": kwargs["draft_logits"] * 3})
    assert completion_p_value(bug, bug_num, p, 3) < 1e-6
    # Deterministic drafts (no draft logits): the same law.
    gen = torch.Generator().manual_seed(44)
    fixed, num_logits = v2_inputs([[1, 3]] * 3000, 4, gen, 1.0)
    out, num = v2.rejection_sample(torch.log(p).repeat(3000, 1), num_speculative_steps=2, use_block_verification=True,
                                   **fixed)
    assert completion_p_value(out, num, p, 4) > 1e-3
    greedy, num_logits = v2_inputs([[1, 2], [], [3]], 5, gen, 0.0)
    greedy_logits = torch.randn(num_logits, 5, generator=gen)
    ours, ours_n = v2.rejection_sample(greedy_logits, num_speculative_steps=2, use_block_verification=True, **greedy)
    ref, ref_n = v2.rejection_sample.__wrapped__(greedy_logits, num_speculative_steps=2, use_block_verification=True,
                                                 **greedy)
    assert torch.equal(ours_n, ref_n)
    for r in range(3):
        assert ours[r, : int(ref_n[r])].tolist() == ref[r, : int(ref_n[r])].tolist()


def test_v2_draft_logits_greedy_and_other_vocab(hooked, caplog, monkeypatch):
    """Greedy requests ignore draft logits (vLLM's tokens); a draft vocabulary other than the
    target's runs vLLM's sampler, with the reason logged."""
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler_utils as v2

    _interpretable_log1p(monkeypatch)
    plugin._log_fallback.cache_clear()
    gen = torch.Generator().manual_seed(32)
    kwargs, num_logits = v2_inputs([[1, 2], [], [3]], 5, gen, 0.0)
    kwargs["draft_logits"] = torch.randn(3, 2, 5, generator=gen)
    logits = torch.randn(num_logits, 5, generator=gen)
    ours, ours_n = v2.rejection_sample(logits, num_speculative_steps=2, **kwargs)
    ref, ref_n = v2.rejection_sample.__wrapped__(logits, num_speculative_steps=2, **kwargs)
    assert torch.equal(ours_n, ref_n)
    for r in range(3):
        assert ours[r, : int(ref_n[r])].tolist() == ref[r, : int(ref_n[r])].tolist()
    kwargs["draft_logits"] = torch.randn(3, 2, 4, generator=gen)
    kwargs["temperature"] = torch.ones(3)
    with caplog.at_level(logging.WARNING, logger="eagle_kernels.integrations"):
        v2.rejection_sample(logits, num_speculative_steps=2, **kwargs)
    assert "draft_logits: expected a float [max_num_reqs, 2, 5] tensor" in caplog.text


def test_v2_no_host_reads(hooked, monkeypatch):
    from test_sglang import HostReads
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler_utils as v2

    gen = torch.Generator().manual_seed(2)
    kwargs, num_logits = v2_inputs([[1, 2], [], [3]], 5, gen, 1.0)
    logits = torch.randn(num_logits, 5, generator=gen)
    draft_logits = torch.randn(3, 2, 5, generator=gen)
    reads = HostReads(monkeypatch)
    v2.rejection_sample(logits, num_speculative_steps=2, **kwargs)
    v2.rejection_sample(logits, num_speculative_steps=2, **{**kwargs, "draft_logits": draft_logits})
    assert reads.calls == []
