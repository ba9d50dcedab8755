"""Bad input to ``ms-deepseek plan``: nonsense flag values, invalid layouts, runaway-nested recipes, the error
line after a progress bar (issue 13 items 5, 7, 11)."""

import sys

import pytest

from bad_input_helpers import assert_refused, run_cli

PLAN = ["plan", "--model", "tiny", "--npus", "2", "--seq-len", "64", "--global-batch", "4"]


@pytest.mark.parametrize("flag, value", [("--workspace-gb", "-1"), ("--workspace-gb", "0"), ("--optimizer-bytes", "0"),
                                         ("--optimizer-bytes", "-8"), ("--grad-bytes", "0"), ("--master-bytes", "-2"),
                                         ("--runtime-reserved-gb", "-3"), ("--npus-per-node", "0"),
                                         ("--hbm-gb", "nan"), ("--npus", "0"), ("--top", "-1")])
def test_plan(capsys, flag, value):
    code, out, err = run_cli(capsys, PLAN + [flag, value])
    assert_refused(code, err, f"argument {flag}:")
    assert out == ""


@pytest.mark.parametrize("layout, problem", [(["--dp", "8", "--tp", "3", "--pp", "1"], "not divisible by tp=3"),
                                             (["--dp", "3", "--tp", "1", "--pp", "1"], "world size 64")])
def test_plan_invalid_layout_is_bad_input(capsys, layout, problem):
    code, out, err = run_cli(capsys, ["plan", "--model", "deepseek-v2", "--npus", "64", "--seq-len", "4096",
                                      "--global-batch", "80", *layout])
    assert_refused(code, err, "invalid layout", problem)
    assert out == ""


def test_error_line_does_not_start_with_a_progress_bar(capsys):
    from tqdm import tqdm

    bar = tqdm(total=10, file=sys.stderr, desc="half-done")
    bar.update(4)
    code, _, err = run_cli(capsys, ["plan", "--model", "deepseek-v2", "--npus", "64", "--seq-len", "4096",
                                    "--global-batch", "80", "--dp", "8", "--tp", "3", "--pp", "1"])
    assert code == 2
    assert not tqdm._instances  # the bar was closed before the error was printed
    last = err.replace("\r", "\n").strip().splitlines()[-1]
    assert last.startswith("ms-deepseek plan: error: invalid layout")


@pytest.mark.parametrize("text", ["a: " + "{x: " * 5000 + "1" + "}" * 5000 + "\n",
                                  "- " * 5000 + "1\n"])
def test_recipes(capsys, tmp_path, text):
    (tmp_path / "r.yaml").write_text(text)
    code, _, err = run_cli(capsys, ["plan", "--recipe", tmp_path / "r.yaml"])
    assert_refused(code, err, "r.yaml: nested too deeply")


# ------------------------------------------------------------------ plan --compile (refused before any compile)
from repo_paths import RECIPES  # noqa: E402

SFT8 = str(RECIPES / "v2-lite-sft-8npu.yaml")
LORA16 = str(RECIPES / "v2-lora-16npu.yaml")


@pytest.mark.parametrize("argv, names", [
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
])
def test_plan_compile_bad_input(capsys, argv, names):
    code, out, err = run_cli(capsys, ["plan", *argv])
    assert_refused(code, err, *names)
    assert out == ""
