"""plan --recipe R: every plan flag is applied to the recipe (as the --set it stands for) or refused
with one line naming the --set that does it; the global batch is printed, and a change to it said."""

import json

import pytest

from ms_deepseek.cli import main

from repo_paths import REPO

LORA8 = str(REPO / "recipes" / "v2-lite-lora-8npu.yaml")
PRETRAIN256 = str(REPO / "recipes" / "v2-pretrain-256npu.yaml")


def _plan(capsys, *argv):
    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _json(capsys, *argv):
    code, out, err = _plan(capsys, *argv, "--json")
    assert code in (0, 1), err
    data = json.loads(out)
    return data


# (flag args, other args both runs share, the --set it stands for)
FLAGS = [
    (["--recompute", "full"], [], "parallel.recompute=full"),
    (["--sequence-parallel"], ["--tp", "2", "--dp", "4", "--ep", "4"], "parallel.sequence_parallel=true"),
    (["--no-vocab-parallel"], ["--tp", "2", "--dp", "4", "--ep", "4"], "parallel.vocab_parallel=false"),
    (["--hbm-gb", "32"], [], "parallel.hbm_gb=32"),
    (["--compute-dtype", "float32"], [], "model.overrides.compute_dtype=float32"),
    (["--param-dtype", "float32"], [], "model.overrides.param_dtype=float32"),
    (["--capacity-factor", "1.25"], [], "model.overrides.capacity_factor=1.25"),
]


@pytest.mark.parametrize("flag,shared,as_set", FLAGS, ids=[f[0][0] for f in FLAGS])
def test_each_flag_is_applied_like_its_set(capsys, flag, shared, as_set):
    base = _json(capsys, "--recipe", LORA8, *shared)
    with_flag = _json(capsys, "--recipe", LORA8, *shared, *flag)
    with_set = _json(capsys, "--recipe", LORA8, *shared, "--set", as_set)
    assert with_flag == with_set
    assert with_flag != base, f"{flag} changed nothing"


def test_the_issues_example_recompute_full(capsys):
    code, out, _ = _plan(capsys, "--recipe", LORA8, "--recompute", "full")
    assert "recompute=full" in out.splitlines()[0]
    plain = _json(capsys, "--recipe", LORA8)["memory_gb"]["total"]
    assert _json(capsys, "--recipe", LORA8, "--recompute", "full")["memory_gb"]["total"] < plain / 2


def test_optimizer_shard_stage_layers_and_flash_attention(capsys):
    sft = str(REPO / "recipes" / "v2-sft-64npu.yaml")
    off = ("--set", "parallel.optimizer_shard=false")
    base = _json(capsys, "--recipe", sft, *off)
    on = _json(capsys, "--recipe", sft, *off, "--optimizer-shard")
    assert on["layout"]["optimizer_shard"] is True and on["memory_gb"]["total"] < base["memory_gb"]["total"]
    cut = _json(capsys, "--recipe", sft, "--pp", "2", "--stage-layers", "29,31", "--micro-batches", "80")
    assert cut["layout"]["stage_layers"] == [29, 31]
    pre = _json(capsys, "--recipe", PRETRAIN256, "--set", "model.overrides.use_flash_attention=false")
    assert (
        _json(
            capsys, "--recipe", PRETRAIN256, "--set", "model.overrides.use_flash_attention=false", "--flash-attention"
        )["memory_gb"]["total"]
        < pre["memory_gb"]["total"]
    )


def test_precision_assumptions_are_applied(capsys):
    sft8 = str(REPO / "recipes" / "v2-lite-sft-8npu.yaml")
    base = _json(capsys, "--recipe", sft8)
    for flag in (
        ["--optimizer-bytes", "16"],
        ["--master-bytes", "4"],
        ["--grad-bytes", "2"],
        ["--optimizer-level", "level3"],
    ):
        assert _json(capsys, "--recipe", sft8, *flag)["memory_gb"] != base["memory_gb"], flag


@pytest.mark.parametrize(
    "flag,names",
    [
        (["--npus", "16"], "--set parallel.dp="),
        (["--seq-len", "8192"], "--set data.seq_len="),
        (["--global-batch", "128"], "--set train.grad_accum_steps="),
        (["--micro-batch-size", "2"], "--set train.micro_batch_size="),
        (["--model", "deepseek-v2"], "--set model.source="),
        (["--top", "3"], "when searching"),
    ],
)
def test_flags_the_recipe_answers_are_refused_naming_the_set(capsys, flag, names):
    code, out, err = _plan(capsys, "--recipe", LORA8, *flag)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith(f"ms-deepseek plan: error: {flag[0]}: not with --recipe") and names in err


def test_global_batch_printed_and_a_dp_change_said(capsys):
    code, out, _ = _plan(capsys, "--recipe", PRETRAIN256)
    assert "global batch 2304 sequences" in out.splitlines()[0] and "note:" not in out
    code, out, _ = _plan(capsys, "--recipe", PRETRAIN256, "--dp", "16")
    assert "global batch 1152 sequences" in out.splitlines()[0]
    assert (
        "note: --dp 16 changes the recipe's global batch from 2304 to 1152 sequences per step" in out
        and "2304 needs --micro-batches 144" in out
    )
    code, out, _ = _plan(capsys, "--recipe", PRETRAIN256, "--dp", "16", "--micro-batches", "144")
    assert "global batch 2304 sequences" in out and "note:" not in out
