"""MindSpore's own compiler as the oracle of our sharded path, on a small model (seconds per compile).

Each test runs the compile check's worker (``verification.compile.worker``, the trainer's own set-up
under MindSpore's dry run with stub CANN libraries) on a small recipe, in a fresh process. The
planted mistakes go through our code (the plan's style table, the layout the check compares with)
and must be refused: by MindSpore with its own message where the lint restates a MindSpore rule, by
our compiled-layout check where the plan and the graph disagree.
"""

import json
import textwrap

import pytest

from ms_deepseek.config.recipe import load_recipe

from builders import SMALL_MODEL, write_recipe
from dryrun import run_dryrun

# dp 2, tp 2, ep 2 on one stage (4 devices): every kind of split the plan makes, at small width
LAYOUT = {"dp": 2, "tp": 2, "ep": 2, "optimizer_shard": True, "recompute": "full"}


def _recipe(tmp_path, accum=2, model_overrides=None, **parallel):
    model = dict(
        SMALL_MODEL, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, **(model_overrides or {})
    )
    data = {
        "model": {"source": "tiny", "overrides": model},
        "data": {"seq_len": 32, "embedded_vocab_size": 512, "validation": {"fraction": 0.1}},
        "train": {"steps": 3, "micro_batch_size": 1, "grad_accum_steps": accum, "eval_interval": 1},
        "parallel": dict(LAYOUT, **parallel),
        "checkpoint": {"save_interval": 0},
        "logging": {"tensorboard": False},
    }
    return write_recipe(tmp_path / "recipe", data)


def _compile(
    tmp_path, plant: str = "", world: int = 4, rank: int = 0, accum: int = 2, extra_env=None, model=None, **parallel
):
    """Run the worker (after ``plant``, Python run first in its process); returns its result.json."""
    recipe = _recipe(tmp_path, accum, model, **parallel)
    work = tmp_path / "work"
    work.mkdir()
    (work / "request.json").write_text(json.dumps({"recipe": load_recipe(recipe).to_request(), "eval": True}))
    code = (
        textwrap.dedent(plant) + "\nfrom ms_deepseek.verification.compile.worker import run\n"
        f"run({str(work / 'request.json')!r})\n"
    )
    rc, out = run_dryrun(code, work, world=world, rank=rank, extra_env=extra_env)
    result = work / "result.json"
    assert result.is_file(), out[-3000:]
    return json.loads(result.read_text())


def _graph(result, name):
    return result["graphs"].get(name) or result["graphs"].get("setup") or {}


def test_small_model_compiles_with_every_split_and_matches_the_plan(tmp_path):
    result = _compile(tmp_path)
    train, val = _graph(result, "train"), _graph(result, "eval")
    assert train.get("ok"), train
    assert val.get("ok"), val
    assert train["layouts_compared"] > 10 and train["strategies_compared"] > 10, train


# The traffic tests' model: the small layout at a width where, as in every recipe, the weights, activations and
# expert buffers the planner prices carry the traffic. At the small model's width 32 the routing's per-token index
# gathers (int32 [G, k, N], which the planner leaves out) are a tenth of the data-parallel side's bytes.
TRAFFIC_WIDTH = {"hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64}


@pytest.fixture(scope="module")
def small_compile(tmp_path_factory):
    """``plan --compile --json`` of the small recipe's rank 0, at :data:`TRAFFIC_WIDTH`: (the recipe, the report)."""
    from builders import main_captured

    recipe = _recipe(tmp_path_factory.mktemp("small"), model_overrides=TRAFFIC_WIDTH)
    code, out, err = main_captured(["plan", "--recipe", str(recipe), "--compile", "--ranks", "0", "--json"])
    report = json.loads(out)
    assert code == 0 and report["compiled"], out[-3000:]
    return recipe, report


def test_the_command_reports_the_inserted_communication_and_the_global_norm(small_compile):
    """``plan --compile`` on the small recipe: MindSpore's IR shows the expert AllToAlls, and the gradient
    norm's square sums all-reduced across the slices (PARALLEL_GLOBALNORM_IN_STAGES) before the Sqrt."""
    _, report = small_compile
    train = report["ranks"][0]["graphs"]["train"]
    assert train["global_norm_allreduce"] is True
    assert train["communication"]["AlltoAll"]["count"] >= 2, train["communication"]
    # the compiled traffic per axis beside the planner's for the same reduced model, and in agreement
    rows = {row["axis"]: row for row in train["traffic_vs_planner"]}
    assert {"dp", "tp", "ep"} <= set(rows), rows
    assert all(row["ok"] for row in rows.values()), rows


def test_a_planner_that_syncs_per_micro_batch_disagrees_with_the_compiled_step(small_compile, monkeypatch):
    """The planner priced once per micro-batch what the compiled step synchronises once per step (the gradients'
    reduce-scatter and the parameters' gather): set beside the same compiled step, the data-parallel axis is marked,
    and only it. (The program-side form of this mistake, MindSpore's optimizer levels 2 and 3, does not compile
    here: MindSpore 2.9 asks for ``lazy_inline`` with them.)"""
    from ms_deepseek.parallel_plan import planner
    from ms_deepseek.verification.compile import traffic
    from ms_deepseek.verification.dryrun import stage_layers_setting

    from builders import main_captured

    recipe, report = small_compile
    real = planner.dp_sync

    def per_micro_batch(*args, **kwargs):
        accum = args[6] if len(args) > 6 else kwargs.get("accum_steps", 1)
        return [(sent * accum, t * accum, anchor * accum) for sent, t, anchor in real(*args, **kwargs)]

    monkeypatch.setattr(planner, "dp_sync", per_micro_batch)
    reduced = [
        "--set",
        f"model.overrides.num_hidden_layers={report['layers']}",
        "--set",
        stage_layers_setting(report["stage_layers"]),
        "--set",
        f"train.grad_accum_steps={report['micro_batches']}",
    ]
    code, out, err = main_captured(["plan", "--recipe", str(recipe), "--json", *reduced])
    planted = json.loads(out)["stage_communication_gb_per_step"][0]
    train = report["ranks"][0]["graphs"]["train"]
    rows = traffic.against_planner(train["traffic"], planted)
    assert [row["axis"] for row in rows if not row["ok"]] == ["dp"], rows
    lines = traffic.format_axes(train["traffic"], rows, "")
    assert any("(optimizer shard" in line and "differs by more than 10%" in line for line in lines), lines


def test_pipeline_with_every_degree_above_one_compiles(tmp_path):
    # dp, tp, pp and ep all 2 (8 devices); the last stage's first rank (it computes the loss)
    result = _compile(tmp_path, world=8, rank=4, pp=2, micro_batches=2, accum=1)
    assert _graph(result, "train").get("ok"), result
    assert _graph(result, "eval").get("ok"), result


# The attention's own slices and casts left without the plan's strategy (as every per-head operation was)
_UNNAMED_HEAD_OPS = """
from ms_deepseek.parallel_plan import styles as P
_heads = P.STYLES["attention_heads"]
def planted(mesh):
    spec = _heads(mesh)
    for attr in ("head_slice", "head_cast"):
        del spec.prims[attr]
    return spec
P.STYLES["attention_heads"] = planted
"""


@pytest.mark.parametrize("plant", ["", _UNNAMED_HEAD_OPS], ids=["as-built", "planted-unsplit-slices"])
def test_attention_keeps_its_heads_split_under_a_pipeline(tmp_path, plant):
    """Under a pipeline MindSpore compiles in ``semi_auto``, where an operation without a strategy splits its first
    axis only: the attention's slices, transposes and rotary on [B, nh, T, d] gathered every head onto each
    tensor-parallel rank (v2-sft-64npu, 128 heads on each of 8 ranks). They are named primitives with the plan's
    split (model/mla.py, plan ``attention_heads``). The compile check's rule (ir_rules.gathered_heads) reads
    MindSpore's validate IR: none of the 4 heads' tensors on the 2 ranks as built; planted, the slices' outputs."""
    from ms_deepseek.verification.compile.ir_rules import HeadShape, gathered_heads
    from ms_deepseek.verification.dryrun import ir_dump_env, ir_files

    ir = tmp_path / "ir"
    fa = {"use_flash_attention": True}
    result = _compile(
        tmp_path, plant, world=8, rank=4, pp=2, micro_batches=2, accum=1, extra_env=ir_dump_env(ir), model=fa
    )
    assert _graph(result, "train").get("ok"), result
    heads = HeadShape.of(load_recipe(str(tmp_path / "recipe" / "recipe.yaml")).model_config, 2, 32)
    found = gathered_heads(ir_files(ir)[0], heads, limit=100)
    if not plant:
        assert found == [], found[:3]
    else:
        assert {f["op"] for f in found} >= {"PrimFunc_StridedSlice"} and all(4 in f["shape"] for f in found), found[:3]


# A plan that splits the contracted axis of a matmul's x but not of its weight: MindSpore's MatMulInfo refuses
_BAD_MATMUL = """
from ms_deepseek.parallel_plan import styles as P
_colwise = P.STYLES["colwise"]
def planted(mesh):
    spec = _colwise(mesh)
    (x, w), out = spec.prims["matmul"]
    spec.prims["matmul"] = (((x[0], mesh.tp), w), out)  # x [N, in] split on in, weight [out, in] not
    return spec
P.STYLES["colwise"] = planted
"""


def test_a_planted_wrong_strategy_is_refused_by_mindspore(tmp_path):
    train = _graph(_compile(tmp_path, _BAD_MATMUL), "train")
    assert not train.get("ok")
    assert "strategy" in train["error"].lower() or "MatMul" in train["error"], train


# The lint's UNSPLITTABLE rules restate MindSpore's: the same planted split is refused by the compiler
_SPLIT_TOPK_AXIS = """
from ms_deepseek.parallel_plan import styles as P
_router = P.STYLES["router"]
def planted(mesh):
    spec = _router(mesh)
    spec.prims["topk"] = (((1, mesh.dp),), None)  # scores [N, E]: the last (top-k) axis split
    return spec
P.STYLES["router"] = planted
"""

_SPLIT_CONCAT_AXIS = """
from ms_deepseek.parallel_plan import styles as P
def planted(mesh):
    spec = P.StyleSpec(prims={"": (((1, mesh.dp, 1), (1, mesh.dp, 1)), None)}, is_primitive=True)
    return spec  # Concat of [G, N, H] and [G, 1, H] on axis 1, split on axis 1
P.STYLES["moe_pad_tokens"] = planted
"""


@pytest.mark.parametrize("plant,rule", [(_SPLIT_TOPK_AXIS, "TopK"), (_SPLIT_CONCAT_AXIS, "Concat")])
def test_lint_rules_restating_mindspore_are_refused_by_the_compiler_too(tmp_path, plant, rule):
    from ms_deepseek.parallel_apply.lint import UNSPLITTABLE

    assert rule in UNSPLITTABLE  # the lint's rule, checked here against MindSpore itself
    train = _graph(_compile(tmp_path, plant), "train")
    assert not train.get("ok"), train
    assert rule.lower() in (train["error"] + train.get("where", "")).lower() or "strategy" in train["error"].lower(), (
        train
    )


# The compiled graph is right, the plan the check reads says otherwise (tp 1): the compiled-layout check names it
_PLAN_SAYS_OTHERWISE = """
import dataclasses
from types import SimpleNamespace
from ms_deepseek.train import parallelism
layout = parallelism.checkpoint_layout
def planted(ctx, opt_tensors):
    par = dataclasses.replace(ctx.par, tp=1, dp=ctx.par.dp * ctx.par.tp)
    return layout(SimpleNamespace(cfg=ctx.cfg, par=par, recipe=ctx.recipe), opt_tensors)
parallelism.checkpoint_layout = planted
"""


def test_a_plan_graph_mismatch_is_caught_by_the_compiled_layout_check(tmp_path):
    train = _graph(_compile(tmp_path, _PLAN_SAYS_OTHERWISE), "train")
    assert not train.get("ok")
    assert train["kind"] == "layout" and train["error"].startswith("compiled layout: parameter"), train


# A pad of [B, nh, T, d] activations with zero columns, the flash-attention pad of model/mla.py, in two forms:
# ops.zeros of the static padded shape (which MindSpore folds into a constant of the global batch) and PadV3
# at run time (what the model does). Eight devices, the batch split by 8.
_PAD_PROBE = """
from mindspore.ops.operations.nn_ops import PadV3
from mindspore.parallel.auto_parallel import AutoParallel

class Pad(nn.Cell):
    def __init__(self):
        super().__init__()
        self.relu = ops.ReLU().shard(((8, 1, 1, 1),))
        self.concat = ops.Concat(-1).shard(((8, 1, 1, 1), (8, 1, 1, 1)))
        self.pad = PadV3(mode="constant", paddings_contiguous=True).shard(((8, 1, 1, 1),))
        self.value = Tensor(0.0, ms.bfloat16)

    def construct(self, x):
        x = self.relu(x)
        if RUNTIME:
            return self.pad(x, (0, 64), self.value)
        return self.concat((x, ops.zeros(x.shape[:-1] + (64,), x.dtype)))

net = AutoParallel(Pad(), parallel_mode="semi_auto")
net.compile(Tensor(shape=(16, 16, 4096, 128), dtype=ms.bfloat16, init=ms.common.initializer.Zero()))
print("COMPILED")
"""


@pytest.mark.parametrize("runtime", [False, True], ids=["folded-zeros", "padv3"])
def test_a_folded_activation_sized_constant_is_found_in_the_compiled_graph(tmp_path, runtime):
    """The compile check's folded-constant rule (ir_rules.large_constants) read from MindSpore's own
    validate IR: the zeros constant is there ([16, 16, 4096, 64] bfloat16, 128 MiB: MindSpore keeps a constant
    whole when its user's input comes from no dataset), PadV3's run-time pad is not."""
    from ms_deepseek.verification.compile.ir_rules import large_constants
    from ms_deepseek.verification.dryrun import ir_dump_env, ir_files

    ir = tmp_path / "ir"
    rc, out = run_dryrun(f"RUNTIME = {runtime}\n" + _PAD_PROBE, tmp_path, world=8, extra_env=ir_dump_env(ir))
    assert rc == 0 and "COMPILED" in out, out[-3000:]
    (validate,) = ir_files(ir)
    found = large_constants(validate)
    if runtime:
        assert found == [], found
    else:
        assert [(c["shape"][1:], c["dtype"]) for c in found] == [([16, 4096, 64], "BFloat16")], found


def _unpackings(validate_ir, weight: str) -> int:
    """How many times the compiled graph starts unpacking the packed weight ``weight`` (a Parameter's name):
    the ExpandDims (model/quant.py ``unpack_first``) that read it."""
    import re

    text = validate_ir.read_text(errors="replace")
    loads = set(re.findall(r"(%\d+)\([^)]*\) = Load\(%para\d+_" + re.escape(weight) + r"\b", text))
    reads = loads | set(re.findall(r"(%para\d+_" + re.escape(weight) + r")\b", text))
    firsts = re.findall(r"= (?:PrimFunc_)?ExpandDims\((%[\w.]+)", text)
    return sum(1 for c in firsts if c in reads)


def test_a_quantized_base_is_unpacked_at_each_use_not_once_per_step(tmp_path):
    """model/quant.py: MindSpore's CSE would merge the unpacking of a frozen int4 weight (it reads the Parameter
    alone) across the accumulation's micro-steps and hold it all step (level 1 of v2-qlora-8npu: 190 GB per NPU).
    Its first op (``unpack_first``, an ExpandDims) carries ``side_effect_hidden``: the compiled graph unpacks in
    each micro-step. Planted: the attribute removed, MindSpore merges them into one."""
    from ms_deepseek.verification.dryrun import ir_dump_env, ir_files

    def unpackings(plant: str) -> int:
        run = tmp_path / ("planted" if plant else "as-built")
        run.mkdir()
        model = dict(SMALL_MODEL, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2)
        recipe = write_recipe(
            run / "recipe",
            {
                "model": {"source": "tiny", "overrides": model},
                "lora": {"r": 4, "alpha": 8.0, "target_modules": ["q_b_proj", "experts.gate_proj"]},
                "quant": {"bits": 4, "group_size": 8},
                "data": {"seq_len": 32, "embedded_vocab_size": 512},
                "train": {"steps": 3, "micro_batch_size": 1, "grad_accum_steps": 2},
                "parallel": {"dp": 2, "ep": 2, "recompute": "full"},
                "checkpoint": {"save_interval": 0},
                "logging": {"tensorboard": False},
            },
        )
        work = run / "work"
        work.mkdir()
        (work / "request.json").write_text(json.dumps({"recipe": load_recipe(recipe).to_request(), "eval": False}))
        ir = work / "ir"
        code = (
            textwrap.dedent(plant) + "\nfrom ms_deepseek.verification.compile.worker import run\n"
            f"run({str(work / 'request.json')!r})\n"
        )
        rc, out = run_dryrun(code, work, world=2, extra_env=ir_dump_env(ir))
        result = json.loads((work / "result.json").read_text())
        assert result["graphs"]["train"]["ok"], (result, out[-3000:])
        return _unpackings(ir_files(ir)[0], "model.layers.1.mlp.experts.gate_proj.weight")

    planted = """
from mindspore import ops
from ms_deepseek.model import quant
_init = quant._Dequant._init_quant
def planted(self, *args):
    _init(self, *args)
    self.unpack_first = ops.ExpandDims()  # without side_effect_hidden
quant._Dequant._init_quant = planted
"""
    # one per micro-step (2) on the one expert weight; merged into one when planted
    assert unpackings("") >= 2
    assert unpackings(planted) == 1


# The causal mask's scaling left without the plan's replicated strategy, as the rotary table's was until 2026-12-04
_UNSPLIT_MASK_SCALE = """
from ms_deepseek.parallel_plan import styles as P
_mask = P.STYLES["causal_mask"]
def planted(mesh):
    spec = _mask(mesh)
    del spec.prims["scale"]
    return spec
P.STYLES["causal_mask"] = planted
"""


@pytest.mark.parametrize("plant", ["", _UNSPLIT_MASK_SCALE], ids=["as-built", "planted-split-mask"])
def test_each_layer_is_its_own_recompute_region_under_a_pipeline(tmp_path, plant):
    """MindSpore replays a recompute region from one start (recompute.cc InsertRecomputedNodes), so one operator
    shared by the layers' recomputed cells makes every layer replay at the start of the backward. Under a pipeline
    (``semi_auto``) the rotary table's scaling without a strategy split the table, and MindSpore put the AllGather
    that made it whole again inside the first layer's attention, read by every layer (level 1 of v2-lora-16npu:
    about 1 GiB per layer held); this small model's eager attention has the causal mask for the same mistake. The rule (ir_rules.recompute_regions) reads MindSpore's own region ids from
    the validate IR: as built each of the stage's 2 layers is one region per micro-batch; planted, one region
    reads both layers' weights (which run_rank refuses: tests/unit/verification/test_compile_check_ir_rules.py)."""
    from ms_deepseek.verification.compile.ir_rules import recompute_regions
    from ms_deepseek.verification.dryrun import ir_dump_env, ir_files

    ir = tmp_path / "ir"
    four = {"num_hidden_layers": 4, "first_k_dense_replace": 1}
    result = _compile(
        tmp_path, plant, world=8, rank=0, pp=2, micro_batches=2, accum=1, extra_env=ir_dump_env(ir), model=four
    )
    regions = recompute_regions(ir_files(ir)[0])
    layers = sorted({tuple(v) for v in regions.values() if v})
    if not plant:
        assert _graph(result, "train").get("ok"), result
        assert layers == [(0,), (1,)], regions  # stage 0 of 2 holds layers 0 and 1, each its own region
    else:
        assert (0, 1) in layers, regions
