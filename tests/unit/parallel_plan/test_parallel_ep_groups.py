"""Expert-parallel groups are adjacent ranks (ep the inner factor of dp, MindFormers' MoE order).

The rule (:mod:`ms_deepseek.parallel_plan.ranks`) is checked against MindSpore's own Python where it exists:
``mindspore.parallel._tensor._get_tensor_slice_index`` on the expert weight's device matrix and tensor
map gives which experts block every device holds; an expert-parallel group must hold one of each block
and sit inside one 8-NPU node. The emulated AllToAll of the CPU simulation must run over the same groups,
and the planner must price the AllToAll with the bandwidth of that group (HCCS inside a node).
"""

import numpy as np
import pytest

from ms_deepseek.checkpoint.layout import build_layout
from ms_deepseek.config.model import get_preset
from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.parallel_plan import costs, ranks, throughput

from repo_paths import REPO  # noqa: E402

NODE = 8  # NPUs per Atlas 800T A2 node
EXPERT_WEIGHT = "model.layers.1.mlp.experts.gate_proj.weight"


def _cfg():
    return get_preset("tiny", n_routed_experts=16, num_experts_per_tok=2, first_k_dense_replace=1, num_hidden_layers=8)


def _mindspore_expert_blocks(layout, devices):
    """Experts block of each stage device, from MindSpore's slice index of the expert weight's layout."""
    from mindspore.parallel._tensor import _get_tensor_slice_index, _get_tensor_strategy

    t = layout.tensors[EXPERT_WEIGHT]
    strategy = [int(k) for k in _get_tensor_strategy(list(t.dev_matrix), list(t.tensor_map))]
    per_block = int(np.prod(strategy[1:]))  # slice index = row-major over the splits: axis 0 is the block
    return [
        int(_get_tensor_slice_index(list(t.dev_matrix), strategy, list(t.tensor_map), d)) // per_block
        for d in range(devices)
    ], strategy


def _pretrain_256npu():
    from ms_deepseek.config.recipe import load_recipe

    recipe = load_recipe(REPO / "recipes" / "v2-pretrain-256npu.yaml")
    return recipe.parallel


def test_v2_pretrain_256npu_expert_groups_are_inside_one_node():
    par = _pretrain_256npu()
    assert (par.dp, par.tp, par.ep, par.pp) == (32, 1, 8, 8)
    devices = par.dp * par.tp
    layout = build_layout(_cfg(), par)
    blocks, strategy = _mindspore_expert_blocks(layout, devices)
    assert strategy[0] == par.ep
    for rank in range(par.dp * par.tp * par.pp):
        group = ranks.ep_group_of_rank(rank, par)
        assert rank in group and len(group) == par.ep
        assert {r // NODE for r in group} == {rank // NODE}, (rank, group)  # one node: HCCS
        # MindSpore's slices: the group holds every experts block once (it is the exchange group)
        assert sorted(blocks[r % devices] for r in group) == list(range(par.ep)), (rank, group)
        # and the rule the simulation and the model's view use agrees with MindSpore's slice
        d = (rank % devices) // par.tp
        assert blocks[rank % devices] == ranks.expert_block_of_dp_rank(d, par.ep)


@pytest.mark.parametrize("layout", [dict(dp=4, tp=2, ep=2), dict(dp=8, tp=1, ep=4), dict(dp=4, tp=4, ep=4)])
def test_expert_blocks_follow_mindspore_slices(layout):
    par = ParallelConfig(**layout)
    devices = par.dp * par.tp
    blocks, _ = _mindspore_expert_blocks(build_layout(_cfg(), par), devices)
    for p in range(devices):
        group = ranks.ep_group_of_rank(p, par)
        assert max(group) - min(group) == (par.ep - 1) * ranks.ep_group_stride(par)  # adjacent dp ranks
        assert sorted(blocks[r] for r in group) == list(range(par.ep))
        assert blocks[p] == ranks.expert_block_of_dp_rank(p // par.tp, par.ep)


def test_simulated_alltoall_runs_over_adjacent_ranks():
    import mindspore as ms
    from mindspore import Tensor

    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM
    from ms_deepseek.parallel_apply.apply import apply_plan
    from ms_deepseek.parallel_plan.plan import Mesh
    from ms_deepseek.simulation.moe_layer import simulate_moe_layer

    cfg = get_preset(
        "tiny",
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=8,
        q_lora_rank=None,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        capacity_factor=1.0,
        initializer_range=0.3,
        first_k_dense_replace=1,
    )
    old = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        model = DeepseekV2ForCausalLM(cfg)
        par = ParallelConfig(dp=4, ep=2)
        apply_plan(model, par, cfg)
        x = Tensor(np.random.default_rng(1).standard_normal((4, 8, cfg.hidden_size)).astype(np.float32))
        report = simulate_moe_layer(model.model.layers[1].mlp, x, Mesh.from_parallel(par))
    finally:
        ms.set_context(mode=old)
    assert report["problem"] is None and report["forward_max_err"] < 1e-5
    assert report["exchange_groups"] == [[0, 1], [2, 3]]  # the old ep-outer order gave [[0, 2], [1, 3]]
    assert report["exchange_groups"] == [
        list(g) for g in sorted({tuple(ranks.ep_group_of_rank(r, par)) for r in range(4)})
    ]


def test_planner_prices_the_alltoall_on_the_real_group():
    par = _pretrain_256npu()
    hw = costs.Hardware()
    group = ranks.ep_group_of_rank(0, par)
    assert throughput.ranks_bandwidth(group, hw) == hw.hccs_gbps * 1e9 * (par.ep - 1)
    # a group that leaves the node (the old ep-outer order: ranks 0, 4, 8, ...) is priced on RoCE
    assert throughput.ranks_bandwidth(list(range(0, 4 * par.ep, 4)), hw) == hw.roce_gbps * 1e9
    assert throughput.ep_alltoall_bandwidth(par, hw) == throughput.ranks_bandwidth(group, hw)


def test_lint_fails_on_the_ep_outer_order():
    # Plant the old order: the expert matmuls' 4-D input split (ep, dp/ep, 1, 1) = (2, 4, 1, 1) (ep outer)
    # instead of (dp/ep, ep, 1, 1) = (4, 2, 1, 1); the lint's reshape/transpose algebra must see that the
    # exchange does not deliver it.
    import copy

    from ms_deepseek.parallel_apply.lint import lint_model
    from ms_deepseek.simulation import simulate as S

    par = ParallelConfig(dp=8, tp=1, ep=2)
    ctx = S.build_context(get_preset("tiny"), par, 16)
    assert lint_model(ctx.model, ctx.applied, ctx.mesh).ok
    broken = copy.copy(ctx.applied)
    broken.strategies = dict(ctx.applied.strategies)
    path = "model.layers.1.mlp.experts.gate_bmm"
    (_, w), out = broken.strategies[path]
    assert ctx.applied.strategies[path][0][0] == (4, 2, 1, 1)
    broken.strategies[path] = (((2, 4, 1, 1), w), out)
    problems = lint_model(ctx.model, broken, ctx.mesh).problems
    assert any(path in p and "(2, 4, 1, 1)" in p for p in problems), problems
