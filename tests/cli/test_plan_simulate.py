"""``ms-deepseek plan --recipe R --simulate``: the four Atlas recipes and a layout with dp, tp, ep
and pp all above 1 pass on CPU without their checkpoints or data; a deliberately broken plan,
a wrong dataset strategy, a misplaced stage and a missing check fail; bad input exits 2."""

import os
import shutil
import subprocess
import sys

import pytest

from ms_deepseek.config.model import get_preset
from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.parallel_plan.plan import DEEPSEEK_V2_PLAN, Plan
from ms_deepseek.simulation import simulate as S

from repo_paths import REPO

ROOT = REPO
ATLAS = ["v2-lite-sft-8npu", "v2-lite-pretrain-16npu", "v2-sft-64npu", "v2-pretrain-256npu", "v2-qlora-8npu"]
TINY = get_preset("tiny")


def _plan(tmp_path, *args):
    env = dict(os.environ, GLOG_v="3")
    return subprocess.run(
        [sys.executable, "-m", "ms_deepseek.cli", "plan", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _plan_here(tmp_path, monkeypatch, capsys, *args):
    """In-process ``ms-deepseek plan`` (the same entry point, without a second MindSpore import)."""
    from ms_deepseek.cli import main

    monkeypatch.chdir(tmp_path)
    code = main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("name", ATLAS)
def test_atlas_recipe_simulation_passes(tmp_path, monkeypatch, capsys, name):
    code, out, err = _plan_here(
        tmp_path, monkeypatch, capsys, "--recipe", str(ROOT / "recipes" / f"{name}.yaml"), "--simulate"
    )
    assert code == 0, out + err
    assert "SIMULATION PASSED" in out
    for check in S.CHECKS:
        assert f"  {check} " in out


@pytest.mark.parametrize("name", ["v2-lite-sft-8npu", "v2-sft-64npu"])  # greedy and group-limited routing
def test_all_four_degrees_above_one(tmp_path, monkeypatch, capsys, name):
    code, out, err = _plan_here(
        tmp_path,
        monkeypatch,
        capsys,
        "--recipe",
        str(ROOT / "recipes" / f"{name}.yaml"),
        "--simulate",
        "--dp",
        "4",
        "--tp",
        "2",
        "--ep",
        "2",
        "--pp",
        "2",
    )
    assert code == 0, out + err
    assert "dp4 tp2 ep2 pp2" in out and "SIMULATION PASSED" in out


def test_broken_plan_fails_the_simulation():
    table = dict(DEEPSEEK_V2_PLAN)
    table["model.layers.*.self_attn.o_proj"] = "colwise"  # a sharding mistake: heads arrive split by tp
    par = ParallelConfig(dp=2, tp=2, pp=2, micro_batches=2)
    results = S.simulate(TINY.replace(n_routed_experts=None), par, 64, plan=Plan(table))
    by_name = {r.name: r for r in results}
    assert by_name["lint"].status == "fail" and "o_proj" in by_name["lint"].detail
    assert not S.all_passed(results)
    assert "SIMULATION DID NOT PASS" in S.format_results(results)


def _ctx(par, mbs=1):
    return S.SimContext(
        full_cfg=TINY,
        full_parallel=par,
        cfg=TINY,
        parallel=par,
        seq_len=8,
        micro_batch_size=mbs,
        plan=Plan(),
        mesh=None,
    )


def test_data_check_follows_the_dataset_strategy(monkeypatch):
    par = ParallelConfig(dp=2, tp=2, pp=2, micro_batches=2)
    assert S.check_data(_ctx(par, 3)).passed
    # MindSpore told "every device its own slice" while tp peers read the same rows: each row seen tp times
    monkeypatch.setattr(S, "_dataset_strategy", lambda p: "data_parallel")
    result = S.check_data(_ctx(par, 3))
    assert result.status == "fail" and result.max_err > 0, result


def test_stage_check_catches_a_misplaced_layer():
    ctx = S.build_context(TINY, ParallelConfig(dp=1, tp=1, pp=2, micro_batches=2), 64)
    assert S.check_stages(ctx).passed
    ctx.model.model.layers[0].pipeline_stage = 1
    result = S.check_stages(ctx)
    assert result.status == "fail" and "model.layers.0" in result.detail


def test_missing_check_is_not_a_pass(monkeypatch):
    monkeypatch.setitem(sys.modules, "ms_deepseek.simulation.moe_layer", None)  # import -> ImportError
    ctx = S.build_context(TINY, ParallelConfig(dp=2, ep=2), 64)
    result = S.check_moe(ctx)
    assert result.status == "unavailable" and not result.passed
    assert "not available" in result.line()


def test_small_config_keeps_the_divisibility():
    cfg = get_preset("deepseek-v2")
    par = ParallelConfig(dp=4, tp=8, pp=2, ep=4, micro_batches=4, sequence_parallel=True)
    small, spar, seq = S.small_config(cfg, par, 4096)
    assert (small.n_routed_experts, small.num_experts_per_tok, small.n_group, small.topk_group) == (160, 6, 8, 3)
    assert small.num_attention_heads % 8 == 0 and small.vocab_size % 8 == 0 and seq % 8 == 0
    assert small.num_hidden_layers >= 2 and spar.tp == 8 and spar.ep == 4


def test_bad_input_exits_2_with_one_line(tmp_path):
    out = _plan(tmp_path, "--model", "tiny", "--simulate")
    assert out.returncode == 2 and "--simulate" in out.stderr and "Traceback" not in out.stderr
    out = _plan(tmp_path, "--recipe", str(ROOT / "recipes" / "v2-lite-sft-8npu.yaml"), "--simulate", "--tp", "3")
    assert out.returncode == 2 and "tp=3" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_recipe_without_checkpoint_reads_config_beside_it(tmp_path):
    recipe = tmp_path / "job.yaml"
    text = (
        (ROOT / "recipes" / "v2-lite-sft-8npu.yaml")
        .read_text()
        .replace("checkpoints/deepseek-v2-lite-chat", "checkpoints/not-here")
    )
    recipe.write_text(text)
    out = _plan(tmp_path, "--recipe", str(recipe))
    assert out.returncode == 2 and "job.config.json" in out.stderr
    shutil.copy(ROOT / "recipes" / "v2-lite-sft-8npu.config.json", tmp_path / "job.config.json")
    out = _plan(tmp_path, "--recipe", str(recipe))
    assert out.returncode in (0, 1) and "layout: dp8" in out.stdout, out.stderr


def test_moe_sharding_mistake_fails_the_moe_check():
    table = dict(DEEPSEEK_V2_PLAN)
    table["model.layers.*.mlp.to_experts"] = "moe_slot_sort"  # the exchange view split (dp, 1, 1): not (ep, dp/ep)
    par = ParallelConfig(dp=4, tp=2, pp=2, ep=2, micro_batches=2)
    by_name = {r.name: r for r in S.simulate(TINY, par, 64, plan=Plan(table), names=["moe", "lint"])}
    assert by_name["moe"].status == "fail" and "to_experts" in by_name["moe"].detail
    assert by_name["lint"].status == "fail" and "to_experts" in by_name["lint"].detail


def test_simulate_json_is_one_object(tmp_path, monkeypatch, capsys):
    import json

    code, out, err = _plan_here(
        tmp_path, monkeypatch, capsys, "--recipe", str(ROOT / "recipes" / "tiny-cpu.yaml"), "--simulate", "--json"
    )
    data = json.loads(out)
    assert code == 0 and data["simulation_passed"] is True and "fits" in data
    assert [c["check"] for c in data["simulation"]] == list(S.CHECKS)


def test_rows_read_is_the_loaders_rule(tmp_path):
    """The data check's model of the loader (rows_read) against the real dataset: rank r of W reads
    positions r, r + W, ... of the block a single reader takes for the same step."""
    import numpy as np

    from ms_deepseek.config.data import DataConfig
    from ms_deepseek.data.dataset import build_train_dataset
    from ms_deepseek.data.prepare import prepare_embedded_default

    corpus = tmp_path / "corpus"
    prepare_embedded_default(corpus, seq_len=16, vocab_size=512, max_bytes=60_000, progress=False)
    cfg = DataConfig(path=str(corpus), num_workers=1)
    world, rows = 3, 2
    whole = np.asarray(next(iter(build_train_dataset(cfg, world * rows, 0, 1, progress=False)))["input_ids"])
    for rank in range(world):
        mine = np.asarray(next(iter(build_train_dataset(cfg, rows, rank, world, progress=False)))["input_ids"])
        np.testing.assert_array_equal(mine, whole[S.rows_read(rank, world, rows)])
