"""16-bit logits through the decoding loop: when the target and the head hand over bf16 logits,
``verify`` and ``draft_expand`` receive them as they are, and no float32 tensor of vocabulary
width is made outside the models (no fp32 copy of a [B, N, V] tensor in the decoder).

The models here wrap the tiny fp64 Llama and cast its logits to bf16 inside the wrapper (the
model's own forward is excluded from the audit), so the test holds the decoder's side of the
16-bit path whatever dtype the model layers produce their logits in."""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import eagle_kernels.decoder as decoder_module
from eagle_kernels import ops
from eagle_kernels.decoder import SpeculativeDecoder, TreeConfig
from eagle_kernels.models import LlamaModel
from eagle_kernels.models.eagle_head import EagleHead
from eagle_kernels.policy import StaticPolicy
from helpers import PROMPTS, tiny_hf_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")


class WideFloatAudit(TorchDispatchMode):
    """Records every op outside ``models()`` that makes a float32/float64 tensor whose last
    dimension is one of ``widths`` (the vocabularies)."""

    def __init__(self, widths):
        super().__init__()
        self.widths, self.inside, self.found = set(widths), 0, []

    @contextlib.contextmanager
    def models(self):
        self.inside += 1
        try:
            yield
        finally:
            self.inside -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.inside:
            for t in tree_flatten(out)[0]:
                if (isinstance(t, torch.Tensor) and t.dtype in (torch.float32, torch.float64) and t.dim() >= 2
                        and t.shape[-1] in self.widths):
                    self.found.append((str(func), tuple(t.shape), t.dtype))
        return out


def test_bf16_logits_reach_the_ops_without_a_float_copy(monkeypatch):
    """A speculative call (its prefill and plain root sampling included)."""
    target = LlamaModel.from_transformers(tiny_hf_model(torch.float64))
    head = EagleHead.random(target, "eagle3", draft_vocab_size=60)
    V, Vd = target.config.vocab_size, 60
    audit = WideFloatAudit({V, Vd})
    forward, head_forward, head_logits = target.forward, head.forward, head.logits

    def target_forward(*args, **kwargs):
        with audit.models():
            out = forward(*args, **kwargs)
            out.logits = out.logits.to(torch.bfloat16)
        return out

    def draft_logits(hidden, **kwargs):
        with audit.models():
            return head_logits(hidden, **kwargs).to(torch.bfloat16)

    def draft_forward(*args, **kwargs):
        with audit.models():
            return head_forward(*args, **kwargs)

    seen = []
    verify, draft_expand = ops.verify, ops.draft_expand
    monkeypatch.setattr(target, "forward", target_forward)
    monkeypatch.setattr(head, "forward", draft_forward)
    monkeypatch.setattr(head, "logits", draft_logits)
    monkeypatch.setattr(decoder_module.ops, "verify",
                        lambda tokens, parents, logits, **kw: (seen.append(("verify", logits.dtype)),
                                                               verify(tokens, parents, logits, **kw))[1])
    import eagle_kernels.expansion as expansion

    monkeypatch.setattr(expansion.ops, "draft_expand",
                        lambda logits, *a, **kw: (seen.append(("draft_expand", logits.dtype)),
                                                  draft_expand(logits, *a, **kw))[1])
    decoder = SpeculativeDecoder(target, head, TreeConfig(3, 3, 8), policy=StaticPolicy(), cuda_graph=False)
    with audit:
        result = decoder.generate(PROMPTS, 4)
    assert all(len(s) == 4 for s in result.sequences)
    assert {op for op, _ in seen} == {"verify", "draft_expand"}
    assert all(dtype == torch.bfloat16 for _, dtype in seen), seen
    assert audit.found == [], audit.found[:5]
