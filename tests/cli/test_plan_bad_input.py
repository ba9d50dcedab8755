"""Bad input to ``ms-deepseek plan``: nonsense flag values, invalid layouts, runaway-nested recipes, the error
line after a progress bar."""

import sys

import pytest

from bad_input_helpers import assert_refused, run_cli

PLAN = ["plan", "--model", "tiny", "--npus", "2", "--seq-len", "64", "--global-batch", "4"]


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--workspace-gb", "-1"),
        ("--workspace-gb", "0"),
        ("--optimizer-bytes", "0"),
        ("--optimizer-bytes", "-8"),
        ("--grad-bytes", "0"),
        ("--master-bytes", "-2"),
        ("--runtime-reserved-gb", "-3"),
        ("--npus-per-node", "0"),
        ("--hbm-gb", "nan"),
        ("--npus", "0"),
        ("--top", "-1"),
    ],
)
def test_plan(capsys, flag, value):
    code, out, err = run_cli(capsys, PLAN + [flag, value])
    assert_refused(code, err, f"argument {flag}:")
    assert out == ""


@pytest.mark.parametrize(
    "layout, problem",
    [
        (["--dp", "8", "--tp", "3", "--pp", "1"], "not divisible by tp=3"),
        (["--dp", "3", "--tp", "1", "--pp", "1"], "world size 64"),
    ],
)
def test_plan_invalid_layout_is_bad_input(capsys, layout, problem):
    code, out, err = run_cli(
        capsys, ["plan", "--model", "deepseek-v2", "--npus", "64", "--seq-len", "4096", "--global-batch", "80", *layout]
    )
    assert_refused(code, err, "invalid layout", problem)
    assert out == ""


def test_error_line_does_not_start_with_a_progress_bar(capsys):
    from tqdm import tqdm

    bar = tqdm(total=10, file=sys.stderr, desc="half-done")
    bar.update(4)
    code, _, err = run_cli(
        capsys,
        [
            "plan",
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
        ],
    )
    assert code == 2
    assert not tqdm._instances  # the bar was closed before the error was printed
    last = err.replace("\r", "\n").strip().splitlines()[-1]
    assert last.startswith("ms-deepseek plan: error: invalid layout")


@pytest.mark.parametrize("text", ["a: " + "{x: " * 5000 + "1" + "}" * 5000 + "\n", "- " * 5000 + "1\n"])
def test_recipes(capsys, tmp_path, text):
    (tmp_path / "r.yaml").write_text(text)
    code, _, err = run_cli(capsys, ["plan", "--recipe", tmp_path / "r.yaml"])
    assert_refused(code, err, "r.yaml: nested too deeply")


# ------------------------------------------------------------------ plan --compile (refused before any compile)
from repo_paths import RECIPES  # noqa: E402

SFT8 = str(RECIPES / "v2-lite-sft-8npu.yaml")
LORA16 = str(RECIPES / "v2-lora-16npu.yaml")


@pytest.mark.parametrize(
    "argv, names",
    [
        (["--recipe", SFT8, "--compile", "--ranks", "8"], ["--ranks", "outside the world of 8 ranks"]),
        (["--recipe", SFT8, "--compile", "--ranks", "0,x"], ["--ranks", "'x'"]),
        (["--recipe", SFT8, "--compile", "--ranks", "5-2"], ["--ranks", "'5-2'"]),
        (["--recipe", LORA16, "--compile", "--layers", "1"], ["--layers", "fewer than the 2 pipeline stages"]),
        (["--recipe", SFT8, "--compile", "--layers", "99"], ["--layers", "more than the model's 27 layers"]),
        (["--recipe", LORA16, "--compile", "--micro-batches", "1"], ["--micro-batches", "fewer than the 2"]),
        (["--recipe", SFT8, "--layers", "2"], ["--layers: only with --compile"]),
        (["--recipe", SFT8, "--ranks", "0"], ["--ranks: only with --compile"]),
        (["--model", "tiny", "--compile"], ["--compile: needs --recipe"]),
        (["--recipe", SFT8, "--compile", "--simulate"], ["--compile and --simulate"]),
        (["--recipe", SFT8, "--compile", "--cann", "/nonexistent/cann"], ["--cann", "/nonexistent/cann"]),
        # what every worker would refuse, refused once up front: a pipeline over a recipe that accumulates
        (
            ["--recipe", SFT8, "--compile", "--pp", "2", "--dp", "4", "--ep", "4"],
            ["train.grad_accum_steps", "pipeline"],
        ),
        (["--recipe", SFT8, "--compile", "--dp", "3", "--ep", "1"], ["parallel", "multiple of 8", "= 3"]),
        (["--recipe", SFT8, "--memory"], ["--memory: only with --compile"]),
        (["--recipe", SFT8, "--compile", "--tolerance", "0.2"], ["--tolerance: only with --compile --memory"]),
        (
            ["--recipe", SFT8, "--compile", "--memory", "--layers", "99"],
            ["--layers", "more than the model's 27 layers"],
        ),
        (["--recipe", SFT8, "--compile", "--memory", "--ranks", "9"], ["--ranks", "outside the world of 8 ranks"]),
        # plan --execute (refused before any compile)
        (["--model", "tiny", "--execute"], ["--execute: needs --recipe"]),
        (["--recipe", SFT8, "--steps", "2"], ["--steps: only with --execute"]),
        (["--recipe", SFT8, "--execute", "--steps", "0"], ["--steps"]),
        (["--recipe", SFT8, "--execute", "--steps", "99"], ["--steps"]),
        (["--recipe", SFT8, "--execute", "--compile"], ["--execute and --compile"]),
        (["--recipe", SFT8, "--execute", "--layers", "2"], ["--layers: not with --execute"]),
        (["--recipe", SFT8, "--execute", "--ranks", "0"], ["--ranks: not with --execute"]),
        (["--recipe", SFT8, "--execute", "--dp", "3", "--ep", "1"], ["parallel", "multiple of 8", "= 3"]),
    ],
)
def test_plan_compile_bad_input(capsys, argv, names):
    code, out, err = run_cli(capsys, ["plan", *argv])
    assert_refused(code, err, *names)
    assert out == ""


def _whole_number_keys():
    """section.key of every whole-number field of a recipe (lists of them too), read from the dataclasses."""
    import dataclasses
    import typing

    from ms_deepseek.config.recipe import Recipe

    def is_int(tp):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if tp is int:
            return True
        if typing.get_origin(tp) is typing.Union:
            return any(is_int(a) for a in args)
        return typing.get_origin(tp) is list and args == [int]

    keys = []
    for section in dataclasses.fields(Recipe):
        if not section.init:
            continue
        cls = [a for a in typing.get_args(typing.get_type_hints(Recipe)[section.name]) if a is not type(None)] or [
            typing.get_type_hints(Recipe)[section.name]
        ]
        hints = typing.get_type_hints(cls[0])
        keys += [f"{section.name}.{f.name}" for f in dataclasses.fields(cls[0]) if f.init and is_int(hints[f.name])]
    return keys


def _model_size_keys():
    from ms_deepseek.config.model import MODEL_LIMITS

    return ["model.overrides.num_hidden_layers"] + [f"model.overrides.{k}" for k in MODEL_LIMITS]


HUGE = 10**30


@pytest.mark.parametrize("key", _whole_number_keys() + _model_size_keys())
def test_a_huge_value_anywhere_in_a_recipe_is_refused_at_once(capsys, key):
    """Every whole number of a recipe and every size of the model config has a sane upper bound: a huge value
    (such as `parallel.dp: 10**30`, which a planner walking every rank would spin on) makes `plan --recipe`
    refuse it in one line naming the key, long before any loop could trust the value."""
    import signal

    from repo_paths import RECIPES

    def alarm(signum, frame):
        raise AssertionError(f"{key}={HUGE}: still running after 10 s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(10)
    try:
        listed = key.endswith(("stage_layers", "expert_placement", "bucket_boundaries"))
        value = f"[{HUGE}]" if listed else str(HUGE)
        code, out, err = run_cli(
            capsys, ["plan", "--recipe", RECIPES / "tiny-qlora-cpu.yaml", "--set", f"{key}={value}"]
        )
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert_refused(code, err, key.rsplit(".", 1)[-1] if key.startswith("model.") else key)
    # refused by their own rules (a choice, a format, a range, another field) first
    if key.rsplit(".", 1)[-1] not in (
        "bits",
        "bucket_boundaries",
        "expert_placement",
        "num_workers",
        "embedded_vocab_size",
        "num_key_value_heads",
        "num_experts_per_tok",
        "n_group",
        "topk_group",
        "first_k_dense_replace",
    ):
        assert "1e+30 is more than" in err, err


@pytest.mark.parametrize(
    "flag", ["--npus", "--seq-len", "--global-batch", "--micro-batch-size", "--dp", "--micro-batches"]
)
def test_a_huge_planner_flag_is_refused(capsys, flag):
    argv = ["plan", "--model", "tiny", "--npus", "2", "--seq-len", "64", "--global-batch", "4"]
    code, out, err = run_cli(capsys, argv + [flag, str(HUGE)])
    assert_refused(code, err, f"argument {flag}:", "is more than")
