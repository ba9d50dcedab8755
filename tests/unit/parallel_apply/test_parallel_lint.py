"""The parallel-rules lint on built tiny models with their applied plans: the real plan passes,
deliberately broken plans fail naming the primitive (and axis). Nothing is compiled."""

import copy

import pytest

from ms_deepseek.config.model import get_preset
from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.parallel_apply.lint import lint_model
from ms_deepseek.parallel_plan.plan import DEEPSEEK_V2_PLAN, Plan
from ms_deepseek.simulation import simulate as S

TINY = get_preset("tiny")
DENSE = TINY.replace(n_routed_experts=None)  # no MoE: every layer a dense MLP
PAR = ParallelConfig(dp=2, tp=2, pp=2, ep=1, micro_batches=2)
MOE_PAR = ParallelConfig(dp=4, tp=2, pp=2, ep=2, micro_batches=2)


@pytest.fixture(scope="module")
def dense_ctx():
    return S.build_context(DENSE, PAR, 64)


@pytest.fixture(scope="module")
def moe_ctx():
    return S.build_context(TINY, MOE_PAR, 64)


def _with_strategy(applied, path, strategy):
    broken = copy.copy(applied)
    broken.strategies = dict(applied.strategies)
    broken.strategies[path] = strategy
    return broken


def test_real_plan_passes_on_dense_model(dense_ctx):
    report = lint_model(dense_ctx.model, dense_ctx.applied, dense_ctx.mesh)
    assert report.ok, report.problems
    assert report.edges >= 20 and report.primitives >= 40


def test_real_plan_passes_on_moe_model(moe_ctx):
    report = lint_model(moe_ctx.model, moe_ctx.applied, moe_ctx.mesh)
    assert report.ok, report.problems
    assert report.allowed >= 1  # the MoE dp -> ep exchange is a listed redistribution


def test_sequence_parallel_redistribution_is_listed():
    ctx = S.build_context(DENSE, ParallelConfig(dp=2, tp=2, sequence_parallel=True), 64)
    report = lint_model(ctx.model, ctx.applied, ctx.mesh)
    assert report.ok, report.problems
    assert report.allowed > 0


def test_sequence_parallel_hidden_stream_is_split_by_tokens_everywhere():
    # Under sequence parallel every op on the hidden stream [B, T, H] holds (dp, tp, 1): the norms, the casts
    # and the residual sums (under a pipeline, semi_auto would give an unnamed one B's split only, and with B = 1
    # per rank the stream would be whole on every tp rank).
    ctx = S.build_context(TINY, ParallelConfig(dp=2, tp=2, ep=2, sequence_parallel=True), 64)
    stream = ("_residual", "embed_cast", "attn_cast", "mlp_cast", "input_layernorm.square")
    stream_ops = [p for p in ctx.applied.strategies if p.endswith(stream)]
    assert len(stream_ops) == 1 + 5 * len(ctx.model.model.layers)  # embed_cast; per layer two casts, two sums, a norm
    for path in stream_ops + ["model.norm.scale", "model.layers.1.post_attention_layernorm.normalize"]:
        assert tuple(ctx.applied.strategies[path][0][0]) == (2, 2, 1), path
    # the latent norms follow their replicated projection: batch only
    assert tuple(ctx.applied.strategies["model.layers.0.self_attn.kv_a_layernorm.square"][0][0]) == (2, 1, 1)

    # planted: one residual sum left at the batch split (what semi_auto's default gives) fails, naming it
    path = "model.layers.1.mlp_residual"
    broken = _with_strategy(ctx.applied, path, (((2, 1, 1), (2, 1, 1)), None))
    problems = lint_model(ctx.model, broken, ctx.mesh).problems
    assert any(p.startswith(f"{path} input 0 reads the residual stream as (2, 1)") for p in problems), problems
    assert any(p.startswith(f"{path} output 0 gives (2, 1)") for p in problems), problems


def test_split_topk_last_axis_fails_naming_primitive_and_axis(moe_ctx):
    path = "model.layers.1.mlp.gate.topk"
    broken = _with_strategy(moe_ctx.applied, path, (((4, 2),), None))
    problems = lint_model(moe_ctx.model, broken, moe_ctx.mesh).problems
    hits = [p for p in problems if p.startswith(path)]
    assert hits and "axis 1" in hits[0] and "topk_info.cc" in hits[0], problems


def test_split_concat_axis_fails(moe_ctx):
    path = "model.layers.1.mlp.pad_tokens"  # Concat on axis 1 of [G, N, H]
    broken = _with_strategy(moe_ctx.applied, path, (((4, 2, 1), (4, 2, 1)), None))
    problems = lint_model(moe_ctx.model, broken, moe_ctx.mesh).problems
    assert any(p.startswith(path) and "axis 1" in p and "concat_info.cc" in p for p in problems), problems


def test_split_softmax_axis_of_custom_op_fails(dense_ctx):
    path = "model.layers.0.self_attn.softmax.impl.op"
    broken = _with_strategy(dense_ctx.applied, path, (((2, 1, 1, 2),), None))
    problems = lint_model(dense_ctx.model, broken, dense_ctx.mesh).problems
    assert any(p.startswith(path) and "axis 3" in p and "FP32Softmax" in p for p in problems), problems


def test_custom_op_without_strategy_fails(dense_ctx):
    path = "model.layers.0.self_attn.softmax.impl.op"
    uncovered = copy.copy(dense_ctx.applied)
    uncovered.strategies = {k: v for k, v in dense_ctx.applied.strategies.items() if k != path}
    problems = lint_model(dense_ctx.model, uncovered, dense_ctx.mesh).problems
    assert any(p.startswith(path + " (FP32Softmax): no strategy") for p in problems), problems
    # apply_plan itself refuses a plan that leaves the custom op out; the simulation reports it
    table = {k: v for k, v in DEEPSEEK_V2_PLAN.items() if k != "model.layers.*.self_attn.softmax.impl.op"}
    ctx = S.build_context(DENSE, PAR, 64, plan=Plan(table))
    assert ctx.apply_error and "softmax.impl.op" in ctx.apply_error
    assert S.check_lint(ctx).status == "fail"


def test_wrong_style_is_an_unlisted_redistribution():
    table = dict(DEEPSEEK_V2_PLAN)
    table["model.layers.*.self_attn.o_proj"] = "colwise"  # should be rowwise: heads arrive split by tp
    ctx = S.build_context(DENSE, PAR, 64, plan=Plan(table))
    problems = lint_model(ctx.model, ctx.applied, ctx.mesh).problems
    assert any(
        p.startswith("model.layers.0.self_attn.o_proj.matmul input 0 has strategy (2, 1)") and "pv_bmm" in p
        for p in problems
    ), problems


def test_stale_edge_table_fails(dense_ctx):
    from ms_deepseek.parallel_apply.lint import EDGES, Edge

    edges = list(EDGES) + [Edge("self_attn.qk_bmm", 0, "self_attn.renamed_softmax", 0, requires="self_attn.qk_bmm")]
    problems = lint_model(dense_ctx.model, dense_ctx.applied, dense_ctx.mesh, edges=edges).problems
    assert any("renamed_softmax is not in the model" in p for p in problems), problems


# ------------------------------------------------------------ custom ops in MindSpore's form
def _custom_prims(ctx):
    from ms_deepseek.parallel_apply.lint import _primitive_table

    return {p: prim for p, (kind, prim) in _primitive_table(ctx.model).items() if type(prim).__name__ == "Custom"}


def test_custom_ops_carry_layouts_that_split_as_planned(moe_ctx):
    """Every Custom op in the applied model was sharded with Layout objects (MindSpore 2.9's only form for
    a Custom op), and MindSpore's own tensor-map reader (_tensor._get_tensor_strategy) turns each input
    layout back into the plan's strategy; the outputs are split like input 0."""
    from mindspore.parallel._tensor import _get_tensor_strategy

    prims = _custom_prims(moe_ctx)
    assert any(p.endswith("mlp.lookup.impl.op") for p in prims) and any(p.endswith("softmax.impl.op") for p in prims)
    for path, prim in prims.items():
        ins, outs = prim.attrs["in_layout"], prim.attrs["out_layout"]
        in_s = moe_ctx.applied.strategies[path][0]
        for lay, s in zip(ins, in_s):
            dev = list(lay["device_matrix"])
            assert int(__import__("numpy").prod(dev)) == moe_ctx.mesh.stage_devices, path
            assert tuple(_get_tensor_strategy(dev, list(lay["tensor_map"]))) == tuple(s), (path, lay, s)
        for lay in outs:
            assert tuple(lay["tensor_map"]) == tuple(ins[0]["tensor_map"]), path
    lookup = next(prim for p, prim in prims.items() if p.endswith("mlp.lookup.impl.op"))
    assert len(lookup.attrs["out_layout"]) == 4  # buffer_row, position, keep split too, not only output 0


def test_custom_op_without_layouts_fails_the_lint():
    """A planted Custom op without layouts (MindSpore 2.9 refuses a Custom op sharded by a tuple strategy
    or not at all): the lint says so; layouts that disagree with the strategy fail as well."""
    ctx = S.build_context(TINY, MOE_PAR, 64)
    path = next(p for p in _custom_prims(ctx) if p.endswith("mlp.lookup.impl.op"))
    prim = _custom_prims(ctx)[path]
    prim.del_prim_attr("in_layout")
    problems = lint_model(ctx.model, ctx.applied, ctx.mesh).problems
    assert any(p.startswith(path + " (Custom): no in/out layouts") for p in problems), problems
    ctx2 = S.build_context(TINY, MOE_PAR, 64)
    prim2 = _custom_prims(ctx2)[path]
    ins = list(prim2.attrs["in_layout"])
    ins[0] = dict(ins[0], tensor_map=tuple(-1 for _ in ins[0]["tensor_map"]))
    prim2.add_prim_attr("in_layout", tuple(ins))
    problems = lint_model(ctx2.model, ctx2.applied, ctx2.mesh).problems
    assert any(p.startswith(path + " (Custom): input 0 layout") for p in problems), problems
    assert S.check_lint(ctx).status == "fail"
