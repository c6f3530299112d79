"""generate runs under torch.inference_mode(); what models keep across calls stays normal tensors, and models
made under inference mode (as serving code often makes them) decode as others do."""

import pytest
import torch

from eagle_kernels import _inference
from eagle_kernels.decoder import SpeculativeDecoder, TreeConfig
from eagle_kernels.models import LlamaModel
from eagle_kernels.models.eagle_head import EagleHead
from helpers import PROMPTS, tiny_hf_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")

TREE = TreeConfig(3, 2, 6, lookup=2)


def make_pair(seed=0):
    target = LlamaModel.from_transformers(tiny_hf_model(torch.float32, seed=seed))
    torch.manual_seed(seed)
    return target, EagleHead.random(target, "eagle3", draft_vocab_size=60)


def inference_tensors(root) -> list[str]:
    """Paths of the inference tensors reachable from ``root`` through the attributes of package objects (and
    torch modules), dicts, lists, tuples and sets."""
    found, seen, stack = [], set(), [(root, type(root).__name__)]
    while stack:
        obj, path = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.is_inference():
                found.append(path)
        elif isinstance(obj, dict):
            stack.extend((v, f"{path}[{k!r}]") for k, v in obj.items())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(obj))
        elif hasattr(obj, "__dict__") and (type(obj).__module__.startswith("eagle_kernels")
                                           or isinstance(obj, torch.nn.Module)):
            stack.extend((v, f"{path}.{k}") for k, v in vars(obj).items())
        elif hasattr(type(obj), "__slots__"):
            stack.extend((getattr(obj, k), f"{path}.{k}") for k in type(obj).__slots__ if hasattr(obj, k))
    return found


def test_generate_runs_under_inference_mode():
    target, head = make_pair()
    seen = []
    SpeculativeDecoder(target, head, TREE).generate(
        PROMPTS, 6, on_sync=lambda tokens, lengths: seen.append(torch.is_inference_mode_enabled()))
    assert seen and all(seen)


def test_what_models_keep_stays_normal_after_generate():
    """The packed and fused matrices, RoPE tables and per-pass lists made during a generate call are normal
    tensors: a model can train (save them for backward, update weights in place) after decoding."""
    target, head = make_pair()
    name = "model.layers.0.self_attn.q_proj.weight"
    target.weights[name] = target.weights[name].clone()  # fused again, inside the next call
    decoder = SpeculativeDecoder(target, head, TREE)
    plain = decoder.generate(PROMPTS, 8, speculative=False)
    assert decoder.generate(PROMPTS, 8).sequences == plain.sequences
    assert inference_tensors(target) == [] and inference_tensors(head) == []
    target.weights[name].mul_(1.0)  # an in-place update outside inference mode
    o_proj = head.weights[head.prefix + "self_attn.o_proj.weight"].requires_grad_(True)
    features = torch.randn(1, 2, target.config.hidden_size)
    with torch.enable_grad():  # the torch path: saves the RoPE tables and the matrices for backward
        head(torch.tensor([[3, 4]]), features, head.new_cache(1, 16)).sum().backward()
    assert o_proj.grad is not None and o_proj.grad.abs().sum() > 0


def test_models_made_under_inference_mode_decode_as_others():
    """Serving code loads and runs models under torch.inference_mode(): their matrices keep no version
    counter, which the caches keyed by versions read as 0."""
    target, head = make_pair(seed=3)
    want_plain = SpeculativeDecoder(target, head, TREE).generate(PROMPTS, 8, speculative=False).sequences
    want_spec = SpeculativeDecoder(target, head, TREE).generate(PROMPTS, 8).sequences
    with torch.inference_mode():
        target2, head2 = make_pair(seed=3)
        decoder = SpeculativeDecoder(target2, head2, TREE)
        assert decoder.generate(PROMPTS, 8, speculative=False).sequences == want_plain
        assert decoder.generate(PROMPTS, 8).sequences == want_spec
    assert decoder.generate(PROMPTS, 8).sequences == want_spec  # and again outside it


def test_versions_of_inference_tensors():
    normal = torch.zeros(3)
    normal.add_(1)
    with torch.inference_mode():
        made = torch.zeros(3)
    assert _inference.versions([normal]) == (normal._version,) and normal._version > 0
    assert _inference.versions([normal, made]) == (normal._version, 0)
    assert _inference.version(made) == 0 and _inference.version(normal) == normal._version
    with torch.inference_mode(), _inference.kept_tensors():
        kept = torch.zeros(3) + 1
    assert not kept.is_inference() and kept.grad_fn is None
