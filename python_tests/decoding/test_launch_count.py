"""Launch accounting (eagle_kernels/launch_count.py): the kernels one decoding step launches on a
GPU, counted on CPU tensors with the GPU code path forced (static policy, GPU layer path, Triton
kernels interpreted). Budgets (docs/decoding.md, "Launches per step"): at most 9 launches per
decoder layer, target and head; at most 40 per step outside the layers."""

import pytest
import torch

from eagle_kernels import _dispatch
from eagle_kernels.decoder import TreeConfig
from eagle_kernels.launch_count import LaunchCount, count_steps, counting
from eagle_kernels.models import LlamaModel
from eagle_kernels.models.eagle_head import EagleHead
from helpers import launch_counted_decoder, tiny_hf_model

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

LAYER_BUDGET = 9
OUTSIDE_LAYERS_BUDGET = 40
# The launch structure of the default GPU tree (6, 8, 60) at a fraction of the interpreter's time:
# the count depends on the depth (head passes), not on top_k or the node count (checked by
# bench/launch_count.py, which runs both).
TREE = TreeConfig(6, 2, 8)


@pytest.fixture(scope="module")
def counted():
    decoder = launch_counted_decoder(TREE)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        coupled = launch_counted_decoder(TREE, coupled_sampling=True)
        return {"plain": count_steps(decoder, [[1, 2, 3]], steps=2, speculative=False)[-1],
                "speculative": count_steps(decoder, [[1, 2, 3]], steps=2, speculative=True)[-1],
                "coupled": count_steps(coupled, [[1, 2, 3]], steps=2, speculative=True, temperature=1.0, top_p=0.9,
                                       seed=3)[-1]}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("mode", ["plain", "speculative", "coupled"])
def test_layers_within_budget(counted, mode):
    count: LaunchCount = counted[mode]
    target_layers = count.per_layer("target")
    assert len(target_layers) == 3  # one target pass, every layer on the GPU path
    assert max(target_layers) <= LAYER_BUDGET, target_layers
    # The same kernels in every layer but the first, whose input norm is token_rows': rmsnorm_qkv_rope (norm,
    # copy, q/k/v, RoPE, KV write), tree_attention, o_proj_mlp (the o projection into the residual, the norm,
    # gate/up with SwiGLU, the down projection into the residual).
    assert target_layers[1:] == [3] * (len(target_layers) - 1) and target_layers[0] == 4, target_layers
    head_layers = count.per_layer("head")
    if mode != "plain":
        assert len(head_layers) == TREE.depth  # depth - 1 drafting passes and the commit
        assert max(head_layers) <= LAYER_BUDGET, head_layers
        # The commit pass's layer runs EAGLE-3's two-input norm; each drafting pass takes its normed input
        # from the expansion step's launch: one launch fewer.
        assert sorted(head_layers) == [3] * (TREE.depth - 1) + [4], head_layers
    else:
        assert head_layers == []
    # The layers' kernels are the GPU path's: Triton norms, RoPE + KV write (in the q/k/v GEMM's epilogue), attention.
    assert count.by_kernel["_rmsnorm_qkv_rope_kernel"] == len(target_layers) + len(head_layers)
    assert count.by_kernel["_rope_write_kv_kernel"] == 0
    assert "_write_kv_kernel" not in count.by_kernel


@pytest.mark.parametrize("mode", ["plain", "speculative", "coupled"])
def test_no_host_reads(counted, mode):
    """Nothing in a step on the GPU path waits for the device (no value read on the host, no
    output shaped by values)."""
    assert not counted[mode].host_reads, counted[mode].host_reads


# Launches outside the layers as measured at steady state (the second step; docs/decoding.md,
# "Launches per step"): a step that launches more fails. Speculative, tree (6, 2, 8): the ops
# (draft_expand 1 per depth, verify 2: the all-rows kernel for the greedy and unfiltered requests, then
# the walk for those that filter, since the step passes filter tensors; build_tree, compact_kv) 10; the
# models outside their layers
# (the target's final norm and LM head, each head pass's but the first's final norm and draft LM
# head as one rmsnorm_linear, the first pass's LM head over the root's norm, which the commit
# makes, the commit's fc) 9; the bookkeeping
# (eagle_kernels/bookkeeping.py: one per depth, which also gathers the next head pass's inputs,
# commit_inputs with the feature rows, commit) 8. The target's embedding and tree positions are
# made in its first layer's first launch.
# Coupled sampling (StaticPolicy(coupled_sampling=True), T 1, top-p 0.9): the speculative step's 27 less the
# all-rows kernel (verify with positions is the walk alone), the positions (one add) and one
# coupled_draft_logits per depth.
# Plain: the target's final norm and LM head, verify on the root's one-node tree (made once per batch size,
# no fills a step; its two launches), the commit.
MEASURED_OUTSIDE_LAYERS = {"plain": 5, "speculative": 27, "coupled": 26 + 1 + TREE.depth}


def test_plain_step_outside_layers_within_budget(counted):
    count = counted["plain"]
    assert count.outside_layers <= OUTSIDE_LAYERS_BUDGET, sorted(count.by_line.items())


@pytest.mark.parametrize("mode", ["plain", "speculative", "coupled"])
def test_outside_layers_do_not_grow(counted, mode):
    count = counted[mode]
    assert count.outside_layers <= MEASURED_OUTSIDE_LAYERS[mode], sorted(count.by_line.items())


def test_speculative_bookkeeping_kernels(counted):
    """The speculative step's bookkeeping: one launch per depth of the expansion, per head pass
    over a frontier, and one each around the head's commit pass; no torch gathers, scatters or
    index writes left outside the layers."""
    by_kernel = counted["speculative"].by_kernel
    assert by_kernel["_expansion_step_kernel"] == TREE.depth  # with the next head pass's inputs
    assert "_draft_inputs_kernel" not in by_kernel and "_gather_rows_kernel" not in by_kernel
    assert by_kernel["_commit_inputs_kernel"] == by_kernel["_commit_kernel"] == 1
    assert by_kernel["_draft_expand_kernel"] == TREE.depth  # one launch per depth, the merge in its last program
    # The target's embedding, first input norm and tree positions: its first layer's first launch.
    assert by_kernel["_token_rows_kernel"] == 1
    # rmsnorm: the target's final norm and the commit pass's two-input norm (EAGLE-3; the drafting passes' norms
    # are written by the expansion step before them). o_proj_mlp: each layer of the target's and the head's after
    # its attention. rmsnorm_linear: each head pass's final norm with its draft LM head but the first's (whose draft
    # logits read the root's norm made by the commit).
    assert by_kernel["_rmsnorm_kernel"] == 2
    assert by_kernel["_o_proj_mlp_kernel"] == 3 + TREE.depth
    assert by_kernel["_rmsnorm_linear_kernel"] == TREE.depth - 1
    assert "addmm_" not in by_kernel
    assert by_kernel["_silu_mul_kernel"] == 0
    for op in ("gather", "scatter_", "index_put_", "index", "embedding", "cat", "_to_copy", "add"):
        assert counted["speculative"].by_kernel[op] == 0, (op, dict(by_kernel))


def test_coupled_sampling_kernels(counted):
    """Coupled sampling's race runs inside verify's one launch (no per-depth walk outside it), and each
    drafting depth perturbs its rows in one launch (no noise tensor, no torch ops)."""
    by_kernel = counted["coupled"].by_kernel
    assert by_kernel["_verify_kernel"] == 1, dict(by_kernel)
    assert by_kernel["_coupled_draft_logits_kernel"] == TREE.depth, dict(by_kernel)
    for op in ("sort", "searchsorted", "_log_softmax", "where", "_coupled_noise_kernel", "arange"):
        assert by_kernel[op] == 0, (op, dict(by_kernel))


@pytest.mark.parametrize("mode", ["speculative", "coupled"])
def test_speculative_step_outside_layers_within_budget(counted, mode):
    count = counted[mode]
    assert count.outside_layers <= OUTSIDE_LAYERS_BUDGET, sorted(count.by_line.items())


@pytest.mark.parametrize("batch", [1, 2], ids=["B1", "B2"])
def test_eagle1_head_draft_pass(batch):
    """EAGLE-1's head (no input norm: rmsnorm_qkv_rope without a norm makes the residual's copy, q/k/v, RoPE and
    the KV write) drafting at a slot offset: three launches (the third o_proj_mlp). With B > 1 the attention rows
    past the offset are not one view: one more launch (a copy)."""
    if _dispatch.implementation("rmsnorm", "triton", "cpu")[0] is None:
        pytest.skip("triton runs CPU tensors only under TRITON_INTERPRET=1")
    target = LlamaModel.from_transformers(tiny_hf_model(torch.float32), dtype=torch.bfloat16)
    head = EagleHead.random(target, "eagle1")
    cache = head.new_cache(batch, 16)
    cache.seqlens += 3
    tokens = torch.zeros(batch, 2, dtype=torch.int64)
    features = torch.zeros(batch, 2, 64, dtype=torch.bfloat16)
    mask = torch.tensor([[[1], [2], [5]]] * batch)

    def draft():
        head(tokens, features, cache, positions=cache.seqlens[:, None].long() + 1, tree_mask=mask, slot_offset=1)

    head.layer_paths._gpu_path_on_cpu = True
    draft()  # the first pass makes the RoPE tables (once per model)
    with counting(head) as count:
        draft()
    assert count.per_layer("head") == [3 + (batch > 1)], count.by_kernel
    assert count.by_kernel["_rmsnorm_qkv_rope_kernel"] == 1
    assert count.by_kernel["_o_proj_mlp_kernel"] == 1  # o, gate/up, down
    assert count.by_kernel["_rmsnorm_linear_kernel"] == 0


def test_fp8_head_draft_pass():
    """An "fp8" EAGLE-3 head's draft pass on the GPU path: each of its layer's four GEMMs is fp8_linear, which
    rounds its rows to fp8 in a launch of its own before the GEMM (docs/gpu_kernels.md, "The activations rounded
    once"): 13 launches a layer, 4 over the budget, the trade the decoding-step model prices (docs/gpu_model.md,
    "An 8-bit head"). Its draft logits are one more rounding launch and GEMM outside the layer."""
    import os
    import sys

    if _dispatch.implementation("rmsnorm", "triton", "cpu")[0] is None:
        pytest.skip("triton runs CPU tensors only under TRITON_INTERPRET=1")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    from gpu_e2e import random_llama

    from eagle_kernels.models.llama import LlamaConfig

    target = random_llama(LlamaConfig(97, 128, 256, 3, 4, 2, 32), torch.bfloat16, "cpu")
    head = EagleHead.random(target, "eagle3", draft_vocab_size=60, weight_dtype="fp8")
    cache = head.new_cache(1, 16)
    tokens = torch.zeros(1, 2, dtype=torch.int64)
    features = torch.zeros(1, 2, 128, dtype=torch.bfloat16)
    mask = torch.tensor([[[1], [3]]])

    def draft():
        head.run(tokens, features, cache, positions=cache.seqlens[:, None].long() + torch.arange(2), tree_mask=mask,
                 logits=True)

    head.layer_paths._gpu_path_on_cpu = True
    draft()  # the first pass makes the RoPE tables and the fp8 copies
    with counting(head) as count:
        draft()
    layer = [launch.name for launch in count.launches if launch.layer == 0]
    assert count.per_layer("head") == [LAYER_BUDGET + 4], layer
    assert layer.count("_fp8_round_rows_kernel") == 4 and layer.count("_fp8_linear_kernel") == 4
    for at, name in enumerate(layer):
        if name == "_fp8_linear_kernel":
            assert layer[at - 1] == "_fp8_round_rows_kernel", layer
    assert count.by_kernel["_fp8_linear_kernel"] == 5  # and the draft LM head


@pytest.mark.parametrize("mode", ["plain", "speculative", "coupled"])
def test_triton_launches_are_programmatic(counted, mode):
    """As on an sm_90 GPU, every Triton launch of a step uses programmatic dependent launch (and
    nothing else does); in every target layer the attention launch follows rmsnorm_qkv_rope's, a
    Triton kernel, so it may start while that one runs."""
    count: LaunchCount = counted[mode]
    assert all(launch.pdl == (launch.kind == "triton") for launch in count.launches)
    for layer in range(len(count.layers)):
        names = [launch.name for launch in count.launches if launch.layer == layer]
        at = names.index("_tree_attention_kernel")
        assert names[at - 1] in ("_rmsnorm_qkv_rope_kernel", "_rope_write_kv_kernel"), names
    assert count.pdl_edges >= len(count.layers)


def test_no_programmatic_launch_when_off():
    x = torch.randn(2, 16)
    weight = torch.randn(16)
    with counting(pdl=False) as off:
        _dispatch.run("rmsnorm", x.device, x, weight, 1e-5)
    with counting(pdl=True) as on:
        _dispatch.run("rmsnorm", x.device, x, weight, 1e-5)
    assert [launch.pdl for launch in off.launches] == [False] and off.pdl_edges == 0
    assert [launch.pdl for launch in on.launches] == [True]


def test_counter_counts_what_launches():
    """Views, allocations and empty outputs launch nothing; computing ops launch one kernel each."""
    x = torch.randn(4, 6)
    with counting() as count:
        y = x.reshape(-1).view(6, 4).t()[1:]  # views
        torch.empty(3)
        z = x[:, :0] * 2  # empty output
        w = (x + 1).sum()  # two kernels
        x.add_(1)
        assert not count.host_reads
        float(w)
        x.nonzero()
    assert count.total == 4 and dict(count.by_kernel) == {"add": 1, "sum": 1, "add_": 1, "nonzero": 1}
    assert sum(count.host_reads.values()) == 2
    assert y.shape == (3, 6) and z.numel() == 0 and w.dim() == 0
