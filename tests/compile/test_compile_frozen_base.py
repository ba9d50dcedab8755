"""A LoRA run's frozen base, as MindSpore compiles it, against the plan: ``plan --compile``'s layout check compares
the frozen (and quantized) tensors too, which the loader reads by the plan's layout and the planner prices by it.

A small int4 QLoRA recipe at dp 2, tp 2, pp 2, ep 2 (8 devices, rank 0: the first stage, with the attention's
replicated, column- and row-parallel quantized layers), compiled by the compile check's worker under the dry run.
Under a pipeline MindSpore compiles in semi_auto mode, where an operator without a strategy splits its first axis
over the stage's devices and a Parameter takes the layout of the operator that reads it."""

import json
import textwrap

from ms_deepseek.config.recipe import load_recipe

from builders import SMALL_MODEL, write_recipe
from dryrun import run_dryrun

LORA = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_b_proj", "kv_b_proj", "o_proj", "experts.up_proj"]}


def _compile(tmp_path, plant: str = "", quant=True):
    """The worker's training compile of rank 0 of 8 (after ``plant``, run first in its process): result.json."""
    model = dict(SMALL_MODEL, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2)
    data = {
        "model": {"source": "tiny", "overrides": model},
        "data": {"seq_len": 32, "embedded_vocab_size": 512},
        "train": {"steps": 3, "micro_batch_size": 1},
        "parallel": {"dp": 2, "tp": 2, "pp": 2, "ep": 2, "micro_batches": 2, "optimizer_shard": True},
        "checkpoint": {"save_interval": 0},
        "logging": {"tensorboard": False},
        "lora": LORA,
    }
    if quant:
        data["quant"] = {"bits": 4, "group_size": 8}
    recipe = write_recipe(tmp_path / "recipe", data)
    work = tmp_path / "work"
    work.mkdir()
    (work / "request.json").write_text(json.dumps({"recipe": load_recipe(recipe).to_request(), "eval": False}))
    code = (
        textwrap.dedent(plant) + "\nfrom ms_deepseek.verification.compile.worker import run\n"
        f"run({str(work / 'request.json')!r})\n"
    )
    _, out = run_dryrun(code, work, world=8, rank=0)
    result = work / "result.json"
    assert result.is_file(), out[-3000:]
    graphs = json.loads(result.read_text())["graphs"]
    return graphs.get("train") or graphs.get("setup")


def _on_rank0(quant: bool):
    """(trained, frozen): how many tensors of each rank 0's stage holds by the plan (the quantized layers' offsets,
    which the step does not read, left out)."""
    from ms_deepseek.checkpoint.layout import build_layout
    from ms_deepseek.config.lora import LoraSpec
    from ms_deepseek.config.model import get_preset
    from ms_deepseek.config.parallel import ParallelConfig
    from ms_deepseek.config.quant import QuantSpec

    cfg = get_preset("tiny", **dict(SMALL_MODEL, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2))
    par = ParallelConfig(dp=2, tp=2, pp=2, ep=2, micro_batches=2, optimizer_shard=True)
    base = build_layout(cfg, par, quant=QuantSpec(bits=4, group_size=8) if quant else None)
    trained = build_layout(cfg, par, lora=LoraSpec(**LORA))
    mine = [n for n in trained.tensors_of_rank(0) if trained.tensors[n].stage >= 0]
    frozen = [
        n
        for n in base.tensors_of_rank(0)
        if base.tensors[n].stage >= 0 and n not in trained.tensors and not n.endswith("weight_offset")
    ]
    return len(mine), len(frozen)


def test_the_quantized_base_compiles_as_the_plan_lays_it_out(tmp_path):
    train = _compile(tmp_path)
    assert train.get("ok"), train
    trained, frozen = _on_rank0(quant=True)
    assert trained == 3 * 2 and frozen > 3 * trained, (trained, frozen)  # layer 0's adapters: q_b, kv_b, o_proj
    assert train["layouts_compared"] == trained + frozen, train


def test_a_quantized_base_split_otherwise_than_the_plan_is_refused(tmp_path):
    """The dequantisation's first operator left without the plan's strategy (as it was): MindSpore splits every
    quantized weight by rows over the stage's 4 devices, and the check names the first."""
    plant = """
    from ms_deepseek.parallel_plan import styles as P
    _layouts = P.dequant_layouts
    def planted(*args):
        out = _layouts(*args)
        del out["unpack_first"]
        return out
    P.dequant_layouts = planted
    """
    train = _compile(tmp_path, plant)
    assert not train.get("ok") and train.get("kind") == "layout", train
    assert "compiled layout: parameter model.layers.0." in train["error"], train
    assert ".weight: MindSpore dev_matrix [4] tensor_map [0, -1] (splits [4, 1])" in train["error"], train


def test_the_float_base_of_a_lora_run_is_compared_too(tmp_path):
    train = _compile(tmp_path, quant=False)
    assert train.get("ok"), train
    assert train["layouts_compared"] == sum(_on_rank0(quant=False)), train


def test_a_quantized_base_split_on_the_other_devices_is_refused(tmp_path):
    """The dequantisation sharded by split counts instead of named device axes: a column-parallel weight is split
    tp ways, but over the devices' dp index (MindSpore repeats a partial split rightmost), where the plan and its
    MatMul put tp fastest; the splits agree and the check names the device holding another slice."""
    plant = """
    from ms_deepseek.parallel_apply import apply as A
    def planted(prim, named):
        prim.shard(named.strategy())
    A._shard_named = planted
    """
    train = _compile(tmp_path, plant)
    assert not train.get("ok") and train.get("kind") == "layout", train
    assert "compiled layout: parameter model.layers.0." in train["error"], train
    assert "device 1 of the stage holds slice" in train["error"], train
