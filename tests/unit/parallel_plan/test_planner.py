"""Planner: published layouts, recipes, CLI, memory reservation, placement tables."""

import json

import numpy as np
import pytest

from ms_deepseek.config.inventory import count_parameters
from ms_deepseek.config.model import get_preset
from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.core.errors import UserError
from ms_deepseek.parallel_plan.costs import GB, in_flight, param_bytes
from ms_deepseek.parallel_plan.plan import parameter_inventory, stage_layer_counts
from ms_deepseek.parallel_plan.planner import check_recipe_fits, estimate, search
from ms_deepseek.parallel_plan.workload import Precision, Workload

from builders import ATLAS_RECIPES
from repo_paths import REPO

V2 = get_preset("deepseek-v2", compute_dtype="bfloat16")
RECIPES = {
    "v2-lite-sft-8npu": "deepseek-v2-lite",
    "v2-lite-dropless-8npu": "deepseek-v2-lite",  # dropless: the bounded exchange's worst-case buffers
    "v2-lite-pretrain-16npu": "deepseek-v2-lite",
    "v2-sft-64npu": "deepseek-v2",
    "v2-pretrain-256npu": "deepseek-v2",
    "v2-qlora-8npu": "deepseek-v2",  # int4 base, one node
    "v2-lite-lora-1npu": "deepseek-v2-lite",
    "v2-lite-qlora-1npu": "deepseek-v2-lite",  # int4 base, 16K tokens
}


def test_mindformers_236b_finetune_fits():
    """MindFormers research/deepseek2 236B fine-tune: 64 NPUs, dp4 mp8 pp2 ep4, 20 micro-batches,
    seq 4096, full recompute, optimizer sharding, capacity factor 2, bf16 weights (param_init_type),
    eager attention (use_flash_attention: False); published 36 tokens/s/p at max_device_memory 59GB."""
    cfg = V2.replace(param_dtype="bfloat16", capacity_factor=2.0)
    layout = ParallelConfig(dp=4, tp=8, pp=2, ep=4, micro_batches=20, recompute="full", optimizer_shard=True)
    r = estimate(cfg, layout, Workload(seq_len=4096, global_batch_size=80), world_size=64)
    assert r.problems == [] and r.fits
    assert r.peak_gb < 59.0
    mem = r.memory_gb
    parts = [v for k, v in mem.items() if k not in ("total", "stage")]
    # each entry and the total are rounded to 1e-3 GB (costs.StageMemory.gb): half a step each at most
    assert mem["total"] == pytest.approx(sum(parts), abs=0.0005 * (len(parts) + 1))
    # the estimate (the low end, calibrated on this very run) within 0.5x-1.5x of the published 36
    assert 0.5 * 36 <= r.tokens_per_s_per_npu <= 1.5 * 36
    low, high = r.tokens_per_s_range
    assert low == r.tokens_per_s_per_npu < high
    assert r.mfu_range[0] == pytest.approx(0.018, abs=0.002)  # what 36 tokens/s/p means: 1.8% MFU
    assert r.bubble_fraction == pytest.approx(1 / 21)


@pytest.mark.parametrize("end", ["low", "high"])
def test_efficiencies_are_the_calibrated_ones(end):
    """costs.LOW / HIGH compute efficiencies are what reproduces each published run (re-solved
    here), and the stored constants give that run's figure."""
    from ms_deepseek.parallel_plan import costs
    from ms_deepseek.parallel_plan.planner import anchor_estimate, calibration_anchors, solve_compute_efficiency

    stored = (costs.LOW if end == "low" else costs.HIGH).compute
    assert solve_compute_efficiency(end) == pytest.approx(stored, rel=0.01)
    published = calibration_anchors()[end]["published"]
    r = anchor_estimate(end)
    assert r.problems == []
    assert r.tokens_per_s_per_npu == pytest.approx(published, rel=0.02)
    mfu = r.mfu_range[0]
    assert (0.015 < mfu < 0.025) if end == "low" else (0.2 < mfu < 0.3)  # 1.8% (MindFormers), 25% (paper)


def test_moe_buffers_come_from_the_dispatch_as_built():
    """The planner's MoE memory and AllToAll bytes are dispatch_shapes' per-device shapes."""
    from ms_deepseek.config.dispatch_shapes import dispatch_buffers
    from ms_deepseek.parallel_plan.activations import moe_buffers
    from ms_deepseek.parallel_plan.throughput import layer_ep_bytes

    cfg = V2.replace(capacity_factor=2.0)
    layout = ParallelConfig(dp=4, tp=8, pp=2, ep=4, micro_batches=20)
    n = 4096
    built = dispatch_buffers(cfg, 4, 4, 8, n, training=True)
    b = moe_buffers(cfg, layout, n)
    C = built["capacity"]
    assert C == int(np.ceil(2.0 * n * 6 / 160))  # capacity per data-parallel rank
    assert b["expert_input"] == 160 * C * 5120  # E/ep experts x ep*C rows x H
    w = Workload(seq_len=4096, global_batch_size=80)
    layer = cfg.first_k_dense_replace
    assert layer_ep_bytes(cfg, layer, layout, w, 2) == 2 * built["alltoall_elements_per_device"] * 2
    assert built["alltoall_elements_per_device"] == 160 * C * 5120 * 3 // 4


def test_mindspeed_236b_pretrain_fits():
    """MindSpeed-LLM 236B pretraining: 160 NPUs, TP1 PP10 EP8 (dp 16), seq 8192, full recompute,
    distributed optimizer, bf16 weights with fp32 gradients and master copy, flash attention."""
    cfg = V2.replace(param_dtype="bfloat16", capacity_factor=1.0)
    layout = ParallelConfig(dp=16, tp=1, pp=10, ep=8, micro_batches=60, recompute="full", optimizer_shard=True)
    megatron = Precision(compute_bytes=2, grad_bytes=4, master_bytes=4)
    r = estimate(
        cfg, layout, Workload(seq_len=8192, global_batch_size=960, flash_attention=True), megatron, world_size=160
    )
    assert r.problems == [] and r.peak_gb <= r.usable_gb, r.memory_gb
    assert [s.layers for s in r.stages] == [6] * 10
    assert r.stages[0].activations == pytest.approx(10 * r.stages[1].activations / 9, rel=1e-9)


def test_236b_on_one_node_does_not_fit():
    results = search(V2.replace(capacity_factor=1.0), 8, Workload(seq_len=4096, global_batch_size=64), top=50)
    assert results and not any(r.fits for r in results)
    assert min(r.peak_gb for r in results) > 100  # 236B parameters alone need far more than 8 x 64 GB


def test_planner_bytes_for_unsharded_236b_equal_parameter_count():
    inventory = parameter_inventory(V2)
    trainable = sum(p.numel for p in inventory if p.trainable)
    assert trainable == count_parameters(V2).total
    held = param_bytes(V2, ParallelConfig(), Precision())
    routers = sum(p.numel for p in inventory if p.name.endswith("mlp.gate.weight"))
    placement = sum(p.numel for p in inventory if not p.trainable)
    assert held[0]["weights"] == 4 * (trainable + placement)  # float32 params, int32 placement tables
    assert held[0]["gradients"] == 4 * trainable
    assert held[0]["optimizer"] == 8 * trainable
    bf16 = param_bytes(V2.replace(param_dtype="bfloat16"), ParallelConfig(), Precision())
    assert bf16[0]["weights"] == 2 * (trainable - routers) + 4 * routers + 4 * placement  # the router stays fp32


def test_pipeline_bubble_and_in_flight():
    cfg = V2.replace(capacity_factor=1.0)
    layout = ParallelConfig(dp=16, tp=1, pp=16, ep=8, micro_batches=72, recompute="full", optimizer_shard=True)
    r = estimate(cfg, layout, Workload(seq_len=4096, global_batch_size=1152), world_size=256)
    assert r.bubble_fraction == pytest.approx(15 / (72 + 15))
    assert [in_flight(layout, s) for s in (0, 1, 15)] == [16, 15, 1]
    assert stage_layer_counts(60, 16) == [3] * 4 + [4] * 12
    assert sum(s.layers for s in r.stages) == 60


def test_search_ranks_fitting_layouts_by_speed():
    cfg = get_preset("deepseek-v2-lite", compute_dtype="bfloat16", capacity_factor=2.0)
    results = search(cfg, 8, Workload(seq_len=4096, global_batch_size=64), top=5)
    fitting = [r for r in results if r.fits]
    assert len(fitting) == 5
    speeds = [r.tokens_per_s_per_npu for r in fitting]
    assert speeds == sorted(speeds, reverse=True)
    assert all(r.layout.world_size == 8 and not r.problems for r in results)


def _load(name, overrides=()):
    from ms_deepseek.config.recipe import load_recipe

    # The planner needs the architecture, not the weights or the data: point the recipe at the
    # preset and at the embedded corpus (format pretrain) so it loads without prepared folders.
    base = [f"model.source={RECIPES[name]}", "data.path=null", "data.format=pretrain"]
    return load_recipe(REPO / "recipes" / f"{name}.yaml", base + list(overrides))


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipes_validate_and_fit(name):
    from ms_deepseek.parallel_plan.planner import recipe_workload
    from ms_deepseek.parallel_plan.validate import validate_layout

    recipe = _load(name)
    cfg = recipe.model_config
    assert cfg.compute_dtype == "bfloat16"
    w = recipe_workload(recipe)
    validate_layout(
        recipe.parallel,
        cfg,
        seq_len=w.seq_len,
        global_batch_size=w.global_batch_size,
        micro_batch_size=w.micro_batch_size,
        world_size=recipe.parallel.world_size,
    )
    result = check_recipe_fits(recipe)
    assert result.problems == [] and result.fits, (name, result.memory_gb)
    assert result.peak_gb <= 64 - 3


def test_recipe_that_cannot_fit_is_refused():
    recipe = _load("v2-sft-64npu", ["parallel.recompute=none", "model.overrides.use_flash_attention=false"])
    result = check_recipe_fits(recipe)
    # eager attention keeps [16 heads x 4096 x 4096] scores per layer for 80 micro-batches' worth
    assert not result.fits and result.problems == []
    assert result.peak_gb > result.usable_gb == 61.0
    assert result.memory_gb["activations"] > 64


def test_256_recipe_is_the_planners_best():
    recipe = _load("v2-pretrain-256npu")
    from ms_deepseek.parallel_plan.planner import recipe_workload

    best = search(
        recipe.model_config,
        256,
        recipe_workload(recipe),
        top=1,
        recompute=("full",),
        optimizer_shard=(True,),
        sequence_parallel=(False,),
    )[0]
    p = recipe.parallel
    assert (best.layout.dp, best.layout.tp, best.layout.pp, best.layout.ep, best.layout.micro_batches) == (
        p.dp,
        p.tp,
        p.pp,
        p.ep,
        p.micro_batches,
    )


def _cli(capsys, *argv):
    from ms_deepseek.cli import main

    code = main(["plan", *argv])
    return code, capsys.readouterr()


def test_cli_check_layout_json(capsys):
    code, out = _cli(
        capsys,
        "--model",
        "deepseek-v2",
        "--npus",
        "64",
        "--seq-len",
        "4096",
        "--global-batch",
        "80",
        "--dp",
        "4",
        "--tp",
        "8",
        "--pp",
        "2",
        "--ep",
        "4",
        "--micro-batches",
        "20",
        "--recompute",
        "full",
        "--optimizer-shard",
        "--param-dtype",
        "bfloat16",
        "--capacity-factor",
        "2",
        "--flash-attention",
        "--sequence-parallel",
        "--json",
    )
    data = json.loads(out.out)
    assert code == 0 and data["fits"] is True
    assert set(data["memory_gb"]) >= {
        "weights",
        "gradients",
        "optimizer",
        "activations",
        "comm_buffers",
        "workspace",
        "total",
    }
    assert data["tokens_per_s_per_npu"] > 0
    assert data["layout"]["dp"] == 4 and data["communication_gb_per_step"]["ep_alltoall"] > 0


def test_cli_one_node_236b_does_not_fit(capsys):
    code, out = _cli(
        capsys,
        "--model",
        "deepseek-v2",
        "--npus",
        "8",
        "--seq-len",
        "4096",
        "--global-batch",
        "64",
        "--tp",
        "8",
        "--recompute",
        "full",
        "--optimizer-shard",
    )
    assert code == 1
    assert "DOES NOT FIT" in out.out


def test_cli_text_search_and_errors(capsys):
    code, out = _cli(
        capsys,
        "--model",
        "tiny",
        "--npus",
        "2",
        "--seq-len",
        "256",
        "--global-batch",
        "16",
        "--compute-dtype",
        "float32",
        "--top",
        "3",
    )
    assert code == 0 and out.out.startswith("layout: ") and "FITS" in out.out and "other layouts:" in out.out
    code, out = _cli(
        capsys,
        "--model",
        "deepseek-v2",
        "--npus",
        "64",
        "--seq-len",
        "4096",
        "--global-batch",
        "80",
        "--dp",
        "8",
        "--tp",
        "3",
        "--pp",
        "1",
    )
    assert code == 2 and out.out == "" and out.err.startswith("ms-deepseek plan: error: invalid layout ")
    assert "parallel.tp: num_attention_heads=128 is not divisible by tp=3" in out.err
    code, out = _cli(capsys, "--model", "deepseek-v2", "--npus", "64")
    assert code == 2 and out.err.strip() == "ms-deepseek plan: error: --seq-len: required (or pass --recipe)"


def test_cli_recipe(capsys, repo_root):
    code, out = _cli(capsys, "--recipe", str(repo_root / "recipes" / "tiny-cpu.yaml"), "--json")
    assert code == 0 and json.loads(out.out)["fits"] is True


# ------------------------------------------------------------------------ memory
def _mindformers_result():
    cfg = V2.replace(param_dtype="bfloat16", capacity_factor=2.0)
    layout = ParallelConfig(dp=4, tp=8, pp=2, ep=4, micro_batches=20, recompute="full", optimizer_shard=True)
    return estimate(cfg, layout, Workload(seq_len=4096, global_batch_size=80), world_size=64)


def test_memory_reservation_sizes():
    from ms_deepseek.parallel_plan.memory import reservation_sizes, reserve_device_memory

    r = _mindformers_result()
    sizes = reservation_sizes(r, headroom_gb=2.0)
    pool = r.worst.pool / GB
    cap = 64 - 3 - r.worst.hccl_buffers / GB
    assert sizes["estimate_gb"] == pytest.approx(pool, abs=1e-3)
    assert sizes["cap_gb"] == pytest.approx(cap, abs=1e-3)
    # The pool may grow to what the device has, not to the estimate + a margin.
    assert sizes["max_size"] == f"{np.floor(cap * 10) / 10:.1f}GB"
    assert sizes["init_size"] == f"{np.ceil(pool * 10) / 10:.1f}GB"
    assert sizes["free_gb"] == pytest.approx(cap - pool, abs=1e-3) and not sizes["tight"] and not sizes["over"]
    assert sizes["stage"] == r.worst.stage
    stage0 = reservation_sizes(r, headroom_gb=2.0, stage=0)
    assert stage0["estimate_gb"] == pytest.approx(r.stages[0].pool / GB, abs=1e-3)
    assert stage0["max_size"] == sizes["max_size"]  # same device, same cap
    tight = reservation_sizes(r, headroom_gb=30.0)  # the margin asked for is not there
    assert tight["tight"] and not tight["over"] and tight["max_size"] == sizes["max_size"]
    small = reservation_sizes(r, headroom_gb=2.0, hbm_gb=32.0)  # estimate above the device
    assert small["over"] and small["init_size"] == small["max_size"] == f"{np.floor((cap - 32) * 10) / 10:.1f}GB"
    on_cpu = reserve_device_memory(r, headroom_gb=2.0)  # CPU: computed, not applied
    assert on_cpu["applied"] is False and on_cpu["max_size"] == sizes["max_size"]
    with pytest.raises(UserError, match="parallel.memory_headroom_gb: must be >= 0, got -1"):
        reservation_sizes(r, headroom_gb=-1)


def test_memory_metrics():
    from ms_deepseek.parallel_plan import memory_metrics
    from ms_deepseek.parallel_plan.memory import metrics_from_counts

    m = metrics_from_counts(3 * GB, 4 * GB, 3.5 * GB)
    assert m == {
        "memory_allocated_gb": 3.0,
        "memory_reserved_gb": 4.0,
        "memory_fragmentation": 0.25,
        "memory_peak_allocated_gb": 3.5,
    }
    assert metrics_from_counts(0, 0)["memory_fragmentation"] == 0.0
    cpu = memory_metrics()  # no device pool on CPU
    assert set(cpu) == {"memory_allocated_gb", "memory_reserved_gb", "memory_fragmentation", "memory_peak_allocated_gb"}
    assert cpu["memory_fragmentation"] == 0.0


@pytest.mark.ascend
def test_reserve_device_memory_on_ascend(tmp_path):
    """On an NPU, in a process of its own (set_device is allowed once per process and the other
    test modules set CPU first): the pool is reserved up to what the device has, and used."""
    import subprocess
    import sys

    script = """
import json, sys
import mindspore as ms
ms.set_device("Ascend")
from ms_deepseek.config.model import get_preset
from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.parallel_plan.workload import Workload
from ms_deepseek.parallel_plan.memory import memory_metrics, reserve_device_memory
from ms_deepseek.parallel_plan.planner import estimate
cfg = get_preset("deepseek-v2", compute_dtype="bfloat16", param_dtype="bfloat16", capacity_factor=2.0)
layout = ParallelConfig(dp=4, tp=8, pp=2, ep=4, micro_batches=20, recompute="full", optimizer_shard=True)
r = estimate(cfg, layout, Workload(seq_len=4096, global_batch_size=80), world_size=64)
sizes = reserve_device_memory(r, headroom_gb=2.0)
x = ms.ops.ones((1024, 1024, 64), ms.float32)
print(json.dumps({"sizes": sizes, "metrics": memory_metrics()}))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["sizes"]["applied"] is True and not out["sizes"]["over"]
    m = out["metrics"]
    assert m["memory_reserved_gb"] >= m["memory_allocated_gb"] > 0


# --------------------------------------------------------------------- placement
def test_placement_tables():
    from ms_deepseek.parallel_plan.placement import balanced_assignment, buffer_order, placement_table

    table = placement_table(8, 4)
    np.testing.assert_array_equal(table, [[0, 0], [0, 1], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0], [3, 1]])
    assert table.dtype == np.int32
    custom = placement_table(8, 2, [1, 0, 1, 0, 0, 1, 1, 0])
    np.testing.assert_array_equal(custom[:, 0], [1, 0, 1, 0, 0, 1, 1, 0])
    np.testing.assert_array_equal(custom[:, 1], [0, 0, 1, 1, 2, 2, 3, 3])
    order = buffer_order(custom)
    rows = custom[:, 0] * 4 + custom[:, 1]
    np.testing.assert_array_equal(order[rows], np.arange(8))
    with pytest.raises(
        UserError, match=r"parallel.expert_placement\[2\]: EP rank must be an integer in \[0, ep=2\), got 5"
    ):
        placement_table(4, 2, [0, 1, 5, 0])
    with pytest.raises(UserError, match="has 3 entries, expected n_routed_experts=4"):
        placement_table(4, 2, [0, 1, 0])
    load = [0.30, 0.05, 0.25, 0.05, 0.1, 0.1, 0.1, 0.05]
    assignment = balanced_assignment(load, 2)
    per_rank = [sum(x for x, r in zip(load, assignment) if r == k) for k in range(2)]
    assert sorted(assignment) == [0] * 4 + [1] * 4 and abs(per_rank[0] - per_rank[1]) <= 0.05 + 1e-9


def test_search_mode():
    from ms_deepseek.parallel_apply.apply import search_mode

    # a pipeline compiles in semi_auto (sharding_propagation failed across the stages' subgraphs: tests/compile)
    assert search_mode(ParallelConfig(dp=4, tp=8, pp=2, ep=4, micro_batches=20, optimizer_shard=True)) == "semi_auto"
    assert search_mode(ParallelConfig(dp=4, tp=8, ep=4, optimizer_shard=True)) == "sharding_propagation"


# -------------------------------------------------------------------------- LoRA
LORA_ALL = (
    "q_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


def test_lora_inventory_freezes_the_base_and_adds_adapters():
    from ms_deepseek.config.lora import LoraSpec, lora_inventory

    cfg = get_preset("deepseek-v2-lite", compute_dtype="bfloat16", param_dtype="bfloat16")
    base = parameter_inventory(cfg)
    inv = lora_inventory(cfg, LoraSpec(r=8, target_modules=("kv_b_proj", "experts.down_proj")))
    trainable = [i for i in inv if i.trainable]
    assert all(".lora_" in i.name for i in trainable) and len(inv) == len(base) + len(trainable)
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    assert len(trainable) == 2 * (cfg.num_hidden_layers + len(moe_layers))
    a = {i.name: i.shape for i in trainable}
    kv_b = next(i for i in base if i.name == "model.layers.0.self_attn.kv_b_proj.weight").shape
    assert a["model.layers.0.self_attn.kv_b_proj.lora_A.weight"] == (8, kv_b[1])
    assert a["model.layers.0.self_attn.kv_b_proj.lora_B.weight"] == (kv_b[0], 8)
    E, H, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    layer = moe_layers[0]
    assert a[f"model.layers.{layer}.mlp.experts.down_proj.lora_A.weight"] == (E, 8, I)  # one adapter per expert
    assert a[f"model.layers.{layer}.mlp.experts.down_proj.lora_B.weight"] == (E, H, 8)
    assert not any("shared_experts" in n for n in a)  # experts.down_proj only
    adapters = sum(i.numel for i in trainable)
    assert adapters == 8 * (cfg.num_hidden_layers * sum(kv_b) + len(moe_layers) * E * (H + I))
    # frozen weights: no gradient, no optimizer state; float32 adapters: 4 + 8 bytes per element
    held = param_bytes(cfg, ParallelConfig(), Precision(master_bytes=4), inv)[0]
    assert held["gradients"] == 4 * adapters and held["optimizer"] == (8 + 4) * adapters
    router = lora_inventory(cfg, LoraSpec(r=8, target_modules=("o_proj",), train_router=True))
    assert {i.name for i in router if i.trainable and ".lora_" not in i.name} == {
        f"model.layers.{k}.mlp.gate.weight" for k in moe_layers
    }
    with pytest.raises(UserError, match="lora.target_modules: no module of this model is targeted"):
        lora_inventory(cfg, LoraSpec(r=8, target_modules=("q_a_proj",)))  # V2-Lite has q_proj only
    dense = get_preset("tiny", compute_dtype="float32").replace(n_routed_experts=None)
    with pytest.raises(UserError, match=r"lora.target_modules\[1\]: 'experts.up_proj' matches no module"):
        lora_inventory(dense, LoraSpec(r=8, target_modules=("o_proj", "experts.up_proj")))
    assert lora_inventory(cfg, LoraSpec(r=8, target_modules=("q_proj", "q_a_proj", "q_b_proj")))


def test_lora_v2_lite_one_node_fits_and_needs_less_than_full():
    import dataclasses

    from ms_deepseek.config.lora import LoraSpec

    cfg = get_preset("deepseek-v2-lite", compute_dtype="bfloat16", param_dtype="bfloat16", capacity_factor=2.0)
    w = Workload(seq_len=4096, global_batch_size=64, flash_attention=True, lora=LoraSpec(r=16, target_modules=LORA_ALL))
    best = search(cfg, 8, w, top=1, recompute=("none",), sequence_parallel=(False,))[0]
    assert best.fits and best.layout.world_size == 8
    full = estimate(cfg, best.layout, dataclasses.replace(w, lora=None), world_size=8)
    lo, fu = best.memory_gb, full.memory_gb
    # LoRA's gradients: the adapters', plus the frozen embedding's one accumulation buffer MindSpore's pass
    # takes under accumulation in a sharded layout (measured at level 1: costs.stage_memory)
    embedding_gb = cfg.vocab_size * cfg.hidden_size * 2 / 1024**3
    assert lo["gradients"] - embedding_gb < 0.05 * fu["gradients"] and lo["optimizer"] < 0.05 * fu["optimizer"]
    assert best.peak_gb < full.peak_gb - 15
    # only the adapters' gradients are the layout's to synchronise; the anchoring embedding gradient is all-reduced
    # once per step over the dp replicas (2 (dp-1)/dp of it, as MindSpore compiles it: tests/compile)
    dp = best.layout.dp
    anchor_gb = 2 * (dp - 1) / dp * embedding_gb
    assert best.comm_minimum_gb["dp_sync"] < 0.05 * full.comm_gb["dp_sync"]
    assert abs(best.comm_gb["dp_sync"] - best.comm_minimum_gb["dp_sync"] - anchor_gb) < 1e-3 * anchor_gb
    assert best.tokens_per_s_per_npu > full.tokens_per_s_per_npu  # no base weight gradients


def test_lora_v2_needs_two_nodes():
    from ms_deepseek.config.lora import LoraSpec

    cfg = V2.replace(param_dtype="bfloat16", capacity_factor=2.0)
    w = Workload(
        seq_len=4096, global_batch_size=64, flash_attention=True, lora=LoraSpec(r=16, target_modules=LORA_ALL[:6])
    )
    choices = dict(top=1, recompute=("full",), optimizer_shard=(True,))
    assert not search(cfg, 8, w, **choices)[0].fits  # 236B bf16 weights alone are ~59 GB per NPU on 8
    two = search(cfg, 16, w, **choices)[0]
    assert two.fits and two.peak_gb <= 61.0


def test_cli_lora(capsys):
    args = [
        "--model",
        "deepseek-v2-lite",
        "--npus",
        "8",
        "--seq-len",
        "4096",
        "--global-batch",
        "64",
        "--param-dtype",
        "bfloat16",
        "--capacity-factor",
        "2",
        "--flash-attention",
        "--dp",
        "8",
        "--ep",
        "8",
        "--recompute",
        "full",
        "--json",
    ]
    code, out = _cli(capsys, *args)
    full = json.loads(out.out)
    code, out = _cli(capsys, *args, "--lora-r", "16", "--lora-targets", "q_proj,kv_b_proj,experts.gate_proj")
    lora = json.loads(out.out)
    assert code == 0 and lora["fits"]
    assert lora["workload"]["lora"] == {
        "r": 16,
        "target_modules": ["q_proj", "kv_b_proj", "experts.gate_proj"],
        "train_router": False,
    }
    assert lora["memory_gb"]["optimizer"] < 0.05 * full["memory_gb"]["optimizer"]
    lo, hi = lora["tokens_per_s_per_npu_range"]
    assert lo == lora["tokens_per_s_per_npu"] < hi
    code, out = _cli(capsys, *args, "--lora-r", "0")
    assert code == 2 and out.err.strip() == "ms-deepseek plan: error: --lora-r: must be >= 1, got 0"
    code, out = _cli(capsys, *args, "--lora-r", "4", "--lora-targets", "lm_head")
    assert code == 2 and "--lora-targets: unknown target module 'lm_head'" in out.err
    code, out = _cli(capsys, *args, "--compute-efficiency", "0.2,1.5")
    assert code == 2 and "--compute-efficiency: must be in (0, 1], got 1.5" in out.err


@pytest.mark.parametrize("path", ATLAS_RECIPES, ids=lambda p: p.stem)
def test_recipe_comments_state_the_planners_figures(path, capsys):
    """Every Atlas recipe's "Planner (`ms-deepseek plan --recipe ...`)" comment gives the figures the
    planner prints for it now: peak GB per NPU and the tokens/s range (the *-cpu recipes run here)."""
    comment = " ".join(line[1:].strip() for line in path.read_text().splitlines() if line.startswith("#"))
    assert "Planner (`ms-deepseek plan --recipe" in comment, f"{path.name}: no planner figures in its comment"
    stated = comment.split("Planner (`ms-deepseek plan --recipe", 1)[1]
    import re

    verdict = re.search(r"(DOES NOT FIT|FITS) at ([\d.]+) GB per NPU", stated)
    gb = float(verdict.group(2))
    lo, hi = (int(x) for x in re.search(r"(\d+)-(\d+) tokens/s per NPU", stated).groups())
    code, out = _cli(capsys, "--recipe", str(path), "--json")
    data = json.loads(out.out)
    # a recipe the planner finds too large says so in its comment (and plan exits 1 for it)
    assert (code, data["fits"]) == ((0, True) if verdict.group(1) == "FITS" else (1, False))
    # the peak over both graphs: the training step and, with data.validation, the eval graph
    assert gb == round(max(data["memory_gb"]["total"], data["memory_gb"].get("eval_total", 0.0)), 1)
    assert (lo, hi) == tuple(round(x) for x in data["tokens_per_s_per_npu_range"])


def test_bf16_weights_update_temporaries_are_counted_for_the_largest_parameter():
    """The float32 composite update of a bfloat16 parameter holds UPDATE_TEMPORARIES float32 images of it
    (MindSpore's level-1 accounting: tests/compile/test_compile_optimizer.py); float32 weights take the fused
    kernel in place and keep only the clipping's one image. A wide vocabulary makes the embedding the largest."""
    from ms_deepseek.parallel_plan.costs import UPDATE_TEMPORARIES

    working = {}
    for dtype in ("bfloat16", "float32"):
        cfg = get_preset("tiny").replace(vocab_size=262144, param_dtype=dtype)
        r = estimate(cfg, ParallelConfig(), Workload(seq_len=16, global_batch_size=1))
        assert r.problems == []
        working[dtype] = r.memory_gb["working_set"] * GB
        largest = cfg.vocab_size * cfg.hidden_size
    assert UPDATE_TEMPORARIES == 4
    assert working["bfloat16"] == pytest.approx(UPDATE_TEMPORARIES * 4 * largest, rel=0.01)
    assert working["float32"] == pytest.approx(4 * largest, rel=0.01)


def test_the_embeddings_whole_all_reduce_is_kept_per_micro_batch_under_sequence_parallel():
    """A tp-split vocabulary makes the embedding's output an AllReduce of the whole [n, H]; under sequence
    parallelism MindSpore kept it from each micro-batch's forward to its backward on the first stage (level 1 of
    v2-sft-64npu: 8 blocks of 40 MiB), beside the first layer's [n/tp, H] slice. Counted there only."""
    cfg = get_preset("tiny").replace(num_hidden_layers=4)
    w = Workload(seq_len=64, global_batch_size=8, micro_batch_size=1)
    n_h_c = 64 * cfg.hidden_size * 2  # bfloat16 activations
    comm = {}
    for sp in (False, True):
        par = ParallelConfig(tp=2, pp=2, micro_batches=8, sequence_parallel=sp)
        comm[sp] = [s.comm_buffers for s in estimate(cfg, par, w, Precision(compute_bytes=2)).stages]
    assert comm[True][0] - comm[False][0] == pytest.approx(in_flight(par, 0) * n_h_c)
    assert comm[True][1] == comm[False][1]
    # a whole vocabulary is gathered locally: no all-reduce
    whole = ParallelConfig(tp=2, pp=2, micro_batches=8, sequence_parallel=True, vocab_parallel=False)
    assert estimate(cfg, whole, w, Precision(compute_bytes=2)).stages[0].comm_buffers == comm[False][0]


def test_the_last_stage_peaks_with_the_loss_or_in_a_layer_not_both():
    """The loss's backward runs first and consumes the loss's kept tensors: the last stage peaks either
    there (loss kept + its backward) or in a recomputed layer's backward without them (level 1 of
    v2-qlora-8npu, 4 layers: the [n, V] Exp gone at the last layer's backward peak)."""
    from ms_deepseek.parallel_plan.activations import head_activation_bytes, head_backward_bytes, layer_activation_bytes

    w = Workload(seq_len=64, global_batch_size=1, micro_batch_size=1)
    par = ParallelConfig(recompute="full")
    prec = Precision(compute_bytes=2)
    for vocab, loss_peaks in ((100, False), (200000, True)):
        cfg = get_preset("tiny").replace(num_hidden_layers=2, vocab_size=vocab)
        stage = estimate(cfg, par, w, prec).stages[0]
        layers = sum(layer_activation_bytes(cfg, i, par, w, 2, "full") for i in range(2))
        head = head_activation_bytes(cfg, par, w, 2)
        if loss_peaks:
            assert stage.activations == pytest.approx(layers + head)
            assert stage.working_set >= head_backward_bytes(cfg, par, w, 2) and stage.comm_buffers == 0
        else:
            assert stage.activations == pytest.approx(layers)
            assert head + head_backward_bytes(cfg, par, w, 2) < stage.working_set + stage.comm_buffers


def test_all_to_all_buffers_are_counted_without_recompute_only():
    """A recomputed MoE layer's working set holds the exchange's two [E, C, H] gradients among its dispatch
    transients; no AlltoAll output was alive beside them at the MoE layer's backward (level 1 of
    v2-pretrain-256npu, stage 0). Without recompute the forward's send and receive buffers are counted."""
    from ms_deepseek.parallel_plan.activations import moe_buffers

    cfg = get_preset("tiny").replace(num_hidden_layers=4)
    w = Workload(seq_len=64, global_batch_size=4, micro_batch_size=1)
    prec = Precision(compute_bytes=2)
    comm = {}
    for policy in ("none", "full"):
        par = ParallelConfig(dp=2, ep=2, pp=2, micro_batches=2, recompute=policy)
        comm[policy] = estimate(cfg, par, w, prec).stages[0].comm_buffers
    assert comm["full"] == 0.0
    assert comm["none"] == pytest.approx(2 * moe_buffers(cfg, par, 64)["expert_input"] * 2)


def test_full_recompute_keeps_the_layer_input_and_replays_one_layer_at_a_time():
    """ "full" recompute keeps one [n, H] per layer and micro-batch (the layer input) and replays one layer at a time,
    also under a pipeline: the stage's working set does not grow with its layers. MindSpore's level 1 (docs/planner.md)
    shows both once each layer is its own recompute region (verification/compile/check.py recompute_regions); the
    planner counted four tensors a layer and the replays of all but one attention while it was not."""
    from ms_deepseek.parallel_plan.activations import layer_activation_bytes

    cfg = V2.replace(param_dtype="bfloat16", capacity_factor=2.0)
    w = Workload(seq_len=4096, global_batch_size=8, flash_attention=True)
    n, H, tp = 4096, cfg.hidden_size, 8
    stages = {}
    for first in (20, 30):
        par = ParallelConfig(dp=1, tp=tp, pp=2, ep=1, micro_batches=8, recompute="full", sequence_parallel=True)
        par.stage_layers = [first, 60 - first]
        r = estimate(cfg, par, w, world_size=16)
        assert r.problems == []
        stages[first] = r.stages[0]
    assert layer_activation_bytes(cfg, 1, par, w, 2, "full") == n * H * 2 / tp
    assert stages[30].working_set == stages[20].working_set
    # ten layers more on the stage: ten layer inputs more per micro-batch in flight (2 on stage 0 of 2)
    per_layer = layer_activation_bytes(cfg, 25, par, w, 2, "full") * 2
    assert stages[30].activations - stages[20].activations == pytest.approx(10 * per_layer)
