"""The modeled H200 decoding step (bench/gpu_step_model.py): the per-launch records of the launch
counter (eagle_kernels/launch_count.py) add up, and the model's bytes / FLOPs of a known GEMM and
of the KV-cache kernels are the ones its docstring states. One plain step of a 3-layer model."""

import dataclasses
import os
import sys

import pytest

from eagle_kernels.decoder import TreeConfig
from eagle_kernels.launch_count import Tensor, count_steps
from helpers import launch_counted_decoder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]


@pytest.fixture(scope="module")
def plain():
    decoder = launch_counted_decoder(TreeConfig(6, 2, 8))
    return decoder.target.config, count_steps(decoder, [[1, 2, 3]], steps=2, speculative=False)[-1]


def test_records_add_up(plain):
    _, count = plain
    assert len(count.launches) == count.total
    assert sum(1 for launch in count.launches if launch.layer < 0) == count.outside_layers
    for i, (owner, n) in enumerate(count.layers):
        mine = [launch for launch in count.launches if launch.layer == i]
        assert len(mine) == n and {launch.owner for launch in mine} == {owner}
    names = {}
    for launch in count.launches:
        names[launch.name] = names.get(launch.name, 0) + 1
    assert names == dict(count.by_kernel)


def test_lm_head_gemm(plain):
    """The target's LM head: one row (B 1) times the (H, V) weight: 2 H V FLOPs, H + H V + V
    elements moved; with a width map, the mapped sizes."""
    import gpu_step_model

    config, count = plain
    H, V = config.hidden_size, config.vocab_size
    gemm = [launch for launch in count.launches if launch.layer < 0 and launch.name == "mm"][-1]
    assert [t.shape for t in gemm.tensors] == [(1, H), (H, V), (1, V)]
    assert gemm.flops == 2 * H * V
    cost = gpu_step_model.launch_cost(gemm, {}, prefix=100, vocab=V)
    assert (cost.bytes, cost.flops) == (2 * (H + H * V + V), 2 * H * V)
    wide = gpu_step_model.launch_cost(gemm, {H: 4 * H}, prefix=100, vocab=V)
    assert (wide.bytes, wide.flops) == (2 * (4 * H + 4 * H * V + V), 8 * H * V)


def test_kv_cache_kernels(plain):
    """tree_attention reads the attended prefix (not the cache's capacity), grows with it; the
    KV write moves the pass's rows; the step's time has one t_min floor per launch."""
    import gpu_step_model

    config, count = plain
    kv_row = config.num_kv_heads * config.head_dim * 2  # bf16
    attention = next(launch for launch in count.launches if launch.name == "_tree_attention_kernel")
    short, long = (gpu_step_model.launch_cost(attention, {}, prefix=p, vocab=config.vocab_size) for p in (10, 1010))
    assert long.bytes - short.bytes == 2 * 1000 * kv_row  # K and V, B 1
    # The KV write: in rmsnorm_qkv_rope's epilogue (the caches are its arguments 7 and 8, x [B N, K] its first).
    write = next(launch for launch in count.launches if launch.name == "_rmsnorm_qkv_rope_kernel")
    cost = gpu_step_model.launch_cost(write, {}, prefix=10, vocab=config.vocab_size)
    rows = write.tensors[0].shape[0]  # the pass's tokens, written to K and V
    others = sum(t.nbytes for i, t in enumerate(write.tensors) if i not in (7, 8))
    assert cost.bytes == others + 2 * rows * kv_row
    weight = write.tensors[2].shape
    assert cost.flops == 2 * rows * weight[0] * weight[1]  # its q/k/v GEMM
    # The cache's capacity does not count.
    bigger = [Tensor((1, 10 * t.shape[1]) + t.shape[2:], t.itemsize) if i in (7, 8) else t
              for i, t in enumerate(write.tensors)]
    assert gpu_step_model.launch_cost(dataclasses.replace(write, tensors=tuple(bigger)), {}, 10,
                                      config.vocab_size).bytes == cost.bytes
    costs = [gpu_step_model.launch_cost(launch, {}, 10, config.vocab_size) for launch in count.launches]
    handoffs = sum(c.handoffs for c in costs)
    assert handoffs == 2 * len(count.layers)  # o_proj_mlp's two hand-offs a layer, each priced as a floor
    assert gpu_step_model.step_seconds(costs, 1e-3) == pytest.approx((count.total + handoffs) * 1e-3)


def test_phased_launch(plain):
    """o_proj_mlp: each phase's GEMM FLOPs and bytes (its rows, matrix and output), priced as three launches unless a
    hand-off time is given for the second and third."""
    import gpu_step_model

    config, count = plain
    launch = next(launch for launch in count.launches if launch.name == "_o_proj_mlp_kernel")
    rows = launch.tensors[0].shape[0]
    H, inner, Ka = config.hidden_size, config.intermediate_size, config.num_heads * config.head_dim
    cost = gpu_step_model.launch_cost(launch, {}, 10, config.vocab_size)
    assert [f for _, f in cost.phases] == [2 * rows * H * Ka, 2 * rows * 2 * inner * H, 2 * rows * H * inner]
    assert cost.flops == sum(f for _, f in cost.phases) and cost.handoffs == 2
    assert cost.phases[1][0] == 2 * (rows * H + H + 2 * inner * H + rows * inner)  # mid, norm, gate/up, act (bf16)
    assert cost.seconds(1e-3) == pytest.approx(3e-3)
    assert cost.seconds(1e-3, handoff=0.25e-3) == pytest.approx(1.5e-3)
    cost.pdl = True
    assert cost.seconds(1e-3, 0.5e-3) == pytest.approx(1.5e-3)  # each phase at the PDL edge's floor
    big = dataclasses.replace(cost, phases=((4.3e12, 0), (0, 0), (0, 0)))  # 1 s of bytes in the first phase
    assert big.seconds(1e-3, handoff=0.0) == pytest.approx(1.0)


def test_verify_at_its_kernel_model_time():
    """The speculative step's cross-check takes verify's device times launch by launch (the all-rows
    kernel and the walk's, as the decoder's filter tensors launch them) from the kernel model's decode
    rows (each launch constant removed) for SmolLM2's tree and the Llama shape's vocabulary, for a walk
    of tau's length; a step with the walk's launch alone (coupled sampling) takes the walk's own rows;
    models with no such row get none."""
    import json

    import gpu_step_model

    with open(gpu_step_model.VERIFY_MODEL) as f:
        rows = {row["case"]: row for row in json.load(f)}

    def total(times):
        return sum(times.values())

    for name, case in gpu_step_model.VERIFY_CASES.items():
        launches = {launch["kernel"]: launch for launch in rows[case]["launches"]}
        device = gpu_step_model.verify_device_time(name)
        assert set(device) == set(gpu_step_model.VERIFY_KERNELS) == set(launches)
        for kernel, seconds in device.items():
            assert seconds == pytest.approx(launches[kernel]["time_s"] - gpu_step_model.FITTED_LAUNCH_S)
            assert 0 < seconds < launches[kernel]["time_s"]
        # a step's walk: tau - 1 accepted drafts, linear between the modeled walks of 2 and 3
        two, three = (gpu_step_model.verify_device_time(name, tau) for tau in (3.0, 4.0))
        assert 1e-6 < total(two) <= total(three) <= total(device)
        assert total(gpu_step_model.verify_device_time(name, 3.5)) == pytest.approx((total(two) + total(three)) / 2)
        assert gpu_step_model.verify_device_time(name, float("nan")) == device  # no tau: the full walk
        alone = gpu_step_model.verify_device_time(name, None, {"_verify_kernel"})
        assert set(alone) == {"_verify_kernel"} and alone["_verify_kernel"] > device["_verify_kernel"]
    assert gpu_step_model.verify_device_time("tiny-3-layers") is None
    assert gpu_step_model.verify_device_time("tiny-3-layers", 3.1) is None


def test_draft_expand_at_its_kernel_model_time():
    """The cross-check's draft_expand times: one per frontier size (the root's row, the tree's 8
    frontier rows) from the kernel model's decode rows; a launch's counted rows pick which."""
    import gpu_step_model

    for name in gpu_step_model.DRAFT_EXPAND_CASES:
        times = gpu_step_model.draft_expand_device_times(name)
        assert set(times) == {1, 8} and all(0 < s < 1e-4 for s in times.values())
        assert times[8] >= times[1]  # eight rows cost at least one
    assert gpu_step_model.draft_expand_device_times("tiny-3-layers") is None
    from eagle_kernels.launch_count import Launch

    for rows in (1, 2):  # the root's row; the frontier rows as counted (top_k 2)
        launch = Launch("_draft_expand_kernel", "triton", None, -1,
                        (Tensor((1, rows, 6144), 2), Tensor((rows, 6), 4), Tensor((rows, 6), 8)))
        assert gpu_step_model.launch_cost(launch, {}, prefix=10, vocab=49152).rows == rows


def test_attention_at_its_kernel_model_time():
    """The cross-check's tree_attention times: SmolLM2's decoded token, head frontier and verify
    pass at each prefix of the model, from the kernel model's decode rows (the attention launch
    alone); a launch takes the time of the nearest row count; the Llama shape has none."""
    import dataclasses

    import gpu_step_model

    for prefix in gpu_step_model.PREFIXES:
        times = gpu_step_model.attention_device_times("smollm2-135m", prefix)
        assert set(times) == {1, 8, 61} and all(0 < s < 1e-4 for s in times.values())
    assert gpu_step_model.attention_device_times("llama3-8b-shape", 4096) is None
    times = {1: 1e-6, 8: 2e-6, 61: 5e-6}
    attention = [gpu_step_model.Cost("_tree_attention_kernel", "target", 0, 10, 0, tail=1e-6, rows=n)
                 for n in (1, 13, 61)]
    other = gpu_step_model.Cost("mm", "target", 0, 10, 0)
    costs = {"plain": [attention[0], other], "speculative": [attention[1], attention[2], other]}
    check = gpu_step_model.attention_cross_check("smollm2-135m", costs, 2.0, times, {})
    at_1us = check["by_t_min_us"]["1.0"]
    assert at_1us["plain_us"] == pytest.approx(1.0 + 1.0)  # its own time, no tail; mm at the floor
    assert at_1us["speculative_us"] == pytest.approx(2.0 + 5.0 + 1.0)  # 13 rows take 8's time
    assert at_1us["ratio"] == pytest.approx(2.0 * 2.0 / 8.0, abs=1e-3)
    assert dataclasses.replace(attention[0]).tail == 1e-6  # the inputs are left as they were
