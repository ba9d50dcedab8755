"""Issue 13 item 11: every refusal names its culprit (key and expected type, file), on stderr, exit 2."""

import sys

import pytest

from bad_input_helpers import assert_refused, edit_config, hf_copy, run_cli


@pytest.mark.parametrize("key, value, expected", [("hidden_size", "abc", "expected an integer"),
                                                  ("num_hidden_layers", "2", "expected an integer"),
                                                  ("rope_theta", "big", "expected a number"),
                                                  ("n_routed_experts", [1], "expected"),
                                                  ("rms_norm_eps", None, "expected a number")])
def test_config_value_of_the_wrong_type(capsys, tmp_path, key, value, expected):
    hf = edit_config(hf_copy(tmp_path), **{key: value})
    code, _, err = run_cli(capsys, ["convert", "hf-to-ms", hf, tmp_path / "out", "--no-progress"])
    assert_refused(code, err, "config.json", key, expected)
    assert "not supported between" not in err


def test_string_rope_factor_names_the_key_not_a_comparison(capsys, tmp_path):
    hf = edit_config(hf_copy(tmp_path), rope_scaling={"type": "yarn", "factor": "40",
                                                        "original_max_position_embeddings": 4096})
    code, _, err = run_cli(capsys, ["convert", "hf-to-ms", hf, tmp_path / "out", "--no-progress"])
    assert_refused(code, err, "rope_scaling.factor: expected a number, got '40'")


@pytest.mark.parametrize("content", [bytes(range(256)) * 4, b"\xff\xfe\x00numpy==1\n"])
def test_doctor_requirements_not_text(capsys, tmp_path, content):
    (tmp_path / "req.txt").write_bytes(content)
    code, out, err = run_cli(capsys, ["doctor", "--requirements", tmp_path / "req.txt", "--only", "packages"])
    assert_refused(code, err, "req.txt: not a text requirements file")
    assert "crashed" not in out + err


def test_doctor_requirements_folder_and_fifo(capsys, tmp_path):
    import os

    code, _, err = run_cli(capsys, ["doctor", "--requirements", tmp_path, "--only", "packages"])
    assert_refused(code, err, "is a folder")
    os.mkfifo(tmp_path / "pipe")
    code, _, err = run_cli(capsys, ["doctor", "--requirements", tmp_path / "pipe", "--only", "packages"])
    assert_refused(code, err, "pipe: is a FIFO")


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
