"""The compiled-layout check (run by the trainer right after the first compile on Ascend) on
parameter_layout_dict entries in MindSpore's format [dev_matrix, tensor_map, slice_shape,
field_size, uniform_split, opt_shard_group, full_shape]: agreeing layouts pass, each kind of
disagreement stops with one line naming the parameter or primitive and both layouts."""

import pytest

from ms_deepseek.checkpoint.layout import build_layout
from ms_deepseek.config.model import get_preset
from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.core.errors import UserError
from ms_deepseek.parallel_apply import compiled_check as cc

TINY = get_preset("tiny")
PAR = ParallelConfig(dp=2, tp=2, pp=2, ep=2, micro_batches=2)
RANK = 5  # stage 1, device 1
Q = "model.layers.2.self_attn.kv_b_proj.weight"  # colwise, on stage 1


def _entry(dev, tmap, shape, group=""):
    split = [1 if m < 0 else dev[len(dev) - 1 - m] for m in tmap]
    return [list(dev), list(tmap), [d // k for d, k in zip(shape, split)], 0, True, group, list(shape)]


@pytest.fixture()
def case():
    layout = build_layout(TINY, PAR)
    compiled = {
        n: _entry(layout.tensors[n].dev_matrix, layout.tensors[n].tensor_map, layout.tensors[n].shape)
        for n in layout.tensors_of_rank(RANK)
    }
    return layout, compiled


def test_agreeing_layouts_pass(case):
    layout, compiled = case
    if Q not in compiled:
        pytest.fail("layer 2 is not on stage 1")
    # written by hand as MindSpore compiles a colwise MatMul(transpose_b) ((dp, 1), (tp, 1)) on 4 devices:
    # device matrix [dp, 1, tp], weight [out, in] with out on the tp axis (index 0)
    compiled[Q] = _entry([2, 1, 2], [0, -1], layout.tensors[Q].shape)
    assert cc.check_parameter_layouts(compiled, layout, RANK) == len(compiled)


def test_same_splits_on_other_devices_stop_naming_the_parameter(case):
    layout, compiled = case
    # out split 2 ways as planned, but along the dp axis: each device holds another slice
    compiled[Q] = _entry([2, 1, 2], [2, -1], layout.tensors[Q].shape)
    with pytest.raises(UserError) as err:
        cc.check_parameter_layouts(compiled, layout, RANK)
    msg = str(err.value)
    assert (
        "\n" not in msg
        and Q in msg
        and "MindSpore dev_matrix [2, 1, 2] tensor_map [2, -1]" in msg
        and "plan dev_matrix" in msg
    ), msg


def test_other_splits_missing_parameters_and_optimizer_groups_stop(case):
    layout, compiled = case
    bad = dict(compiled)
    bad[Q] = _entry([4], [-1, -1], layout.tensors[Q].shape)  # replicated: MindSpore did not split it
    with pytest.raises(
        UserError, match=r"kv_b_proj.weight: MindSpore dev_matrix \[4\] tensor_map \[-1, -1\] \(splits \[1, 1\]\)"
    ):
        cc.check_parameter_layouts(bad, layout, RANK)
    gone = {n: e for n, e in compiled.items() if n != Q}
    with pytest.raises(UserError, match="not in the compiled graph"):
        cc.check_parameter_layouts(gone, layout, RANK)
    grouped = dict(compiled)
    grouped[Q] = _entry(
        layout.tensors[Q].dev_matrix, layout.tensors[Q].tensor_map, layout.tensors[Q].shape, group="4-opt-shard-group"
    )
    with pytest.raises(UserError, match="optimizer-shard group is 4-opt-shard-group, the plan expects none"):
        cc.check_parameter_layouts(grouped, layout, RANK, optimizer_shard=False)


_SCOPE = (
    "Default/network-TrainStep/net-GradAccumulation/network-StepOutputs/model-DeepseekV2ForCausalLM/"
    "model-DeepseekV2Model/layers-CellList/1-DecoderLayer/"
)


def test_compiled_strategies_are_compared_primitive_by_primitive():
    # scope names as MindSpore's graph executor gives them (get_strategy); a recomputed copy too
    planned = {
        "model.layers.1.mlp.lookup.impl.op": ("Custom", ((2, 1), (1, 1))),
        "model.layers.1.self_attn.qk_bmm": ("BatchMatMul", ((2, 2, 1, 1), (2, 2, 1, 1))),
        "model.layers.1.self_attn.q_proj.matmul": ("MatMul", ((2, 1), (2, 1))),
        "model.layers.1.self_attn.q_proj.lora_a_matmul": ("MatMul", ((2, 1), (1, 1))),
    }
    compiled = {
        _SCOPE + "mlp-DeepseekV2MoE/lookup-ExpertLookup/impl-ExpertLookupReference/Custom-op3": [[2, 1], [1, 1]],
        "recompute_" + _SCOPE + "self_attn-MLAttention/BatchMatMul-op0": [[2, 2, 1, 1], [2, 2, 1, 1]],
        _SCOPE + "self_attn-MLAttention/q_proj-Linear/MatMul-op7": [[2, 1], [1, 1]],
        _SCOPE + "self_attn-MLAttention/q_proj-Linear/MatMul-op6": [[2, 1], [2, 1]],
        "Default/_VirtualDataset-op0": [[2, 1], [2, 1]],
    }
    assert cc.check_compiled_strategies(compiled, planned) == 4
    # a planned primitive the graph does not use (no adapter: no lora_a_matmul) is not a mismatch
    unused = {k: v for k, v in compiled.items() if not k.endswith("MatMul-op7")}
    assert cc.check_compiled_strategies(unused, planned) == 3
    # a primitive whose strategy MindSpore replaced (e.g. a BatchParallel fallback) is named with both
    bad = dict(compiled)
    bad[_SCOPE + "mlp-DeepseekV2MoE/lookup-ExpertLookup/impl-ExpertLookupReference/Custom-op3"] = [[4, 1], [1, 1]]
    with pytest.raises(
        UserError,
        match=r"lookup.impl.op \(Custom\): the plan's strategy is \[\[2, 1\], \[1, 1\]\], "
        r"MindSpore compiled \[\[4, 1\], \[1, 1\]\] for a Custom",
    ):
        cc.check_compiled_strategies(bad, planned)
    # a primitive of another stage (not in this graph) is not compared
    other = {k: v for k, v in compiled.items() if "BatchMatMul" not in k}
    assert cc.check_compiled_strategies(other, planned) == 3


def test_under_a_pipeline_only_the_ranks_stage_is_compared():
    """MindSpore's scope names under a pipeline can carry another stage's cell: compiling v2-sft-64npu's stage 7
    (layer 7 only), the labels' shift, a [1, 4095] + [1, 1] Concat, was named under layer 1's MoE. Compared with
    the whole model's plan that read as layer 1's ``pad_tokens`` compiled with another strategy; the rank's stage
    alone (the plan's ``stage_of_cell``) has no layer 1."""
    from types import SimpleNamespace

    from mindspore import ops

    def cell(**prims):
        return SimpleNamespace(**prims)

    cells = [
        ("model.layers.1.mlp", cell(pad_tokens=ops.Concat(1))),
        ("model.layers.7.mlp", cell(pad_tokens=ops.Concat(1))),
        ("model.rotary_emb", cell(concat=ops.Concat(-1))),  # on no stage of its own: kept
    ]
    model = SimpleNamespace(cells_and_names=lambda: iter(cells))
    three = ((1, 1, 1), (1, 1, 1))
    strategies = {
        "model.layers.1.mlp.pad_tokens": (three, None),
        "model.layers.7.mlp.pad_tokens": (three, None),
        "model.rotary_emb.concat": (((1, 1), (1, 1)), None),
    }
    stage_of_cell = {"model.layers.1": 1, "model.layers.7": 7}
    staged = cc.planned_primitives(model, strategies, stage_of_cell, stage=7)
    assert set(staged) == {"model.layers.7.mlp.pad_tokens", "model.rotary_emb.concat"}
    scope = _SCOPE.replace("1-DecoderLayer", "{}-DecoderLayer")
    compiled = {
        scope.format(1) + "mlp-DeepseekV2MoE/Concat-op0": [[1, 1], [1, 1]],  # the labels' shift, misnamed
        scope.format(7) + "mlp-DeepseekV2MoE/Concat-op0": [[1, 1, 1], [1, 1, 1]],
    }
    assert cc.check_compiled_strategies(compiled, staged) == 1
    with pytest.raises(UserError, match=r"model.layers.1.mlp.pad_tokens \(Concat\)"):  # the whole model's plan
        cc.check_compiled_strategies(compiled, cc.planned_primitives(model, strategies))


def test_primitives_sharded_by_layouts_count_among_the_planned_but_may_go_unreported():
    """A quantized layer without a bias: its planned ``add_bias`` is not in the graph, its nibble Add (sharded by a
    Layout, model/quant.py) is. Sharding propagation lists the Add with its strategy, semi_auto leaves it out."""
    quant = _SCOPE + "mlp-MLP/down_proj-QuantLinear/"
    planned = {
        "model.layers.1.mlp.down_proj.add_bias": ("Add", ((8, 1), (1,))),
        "model.layers.1.mlp.down_proj.nibble_bias": ("Add", ((1, 1, 1), ())),
    }
    layouts = {"model.layers.1.mlp.down_proj.nibble_bias"}
    propagated = {quant + "Add-op0": [[1, 1, 1], []]}
    assert cc.check_compiled_strategies(propagated, planned, layouts) == 1
    assert cc.check_compiled_strategies({}, planned, layouts) == 0  # semi_auto: not reported
    # as an operator of the plan it is no stray; without it, it reads as add_bias compiled otherwise
    with pytest.raises(UserError, match=r"down_proj.add_bias \(Add\)"):
        cc.check_compiled_strategies(propagated, {k: v for k, v in planned.items() if "nibble" not in k})
