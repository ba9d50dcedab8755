"""Issue 13 item 7: nonsense values are refused by name (argparse validators in ms_deepseek/cli/args.py)."""

import argparse

import pytest

from bad_input_helpers import assert_refused, edit_config, hf_copy, run_cli
from ms_deepseek.cli import args as cli_args

PLAN = ["plan", "--model", "tiny", "--npus", "2", "--seq-len", "64", "--global-batch", "4"]


@pytest.mark.parametrize("flag, value", [("--workspace-gb", "-1"), ("--workspace-gb", "0"), ("--optimizer-bytes", "0"),
                                         ("--optimizer-bytes", "-8"), ("--grad-bytes", "0"), ("--master-bytes", "-2"),
                                         ("--runtime-reserved-gb", "-3"), ("--npus-per-node", "0"),
                                         ("--hbm-gb", "nan"), ("--npus", "0"), ("--top", "-1")])
def test_plan(capsys, flag, value):
    code, out, err = run_cli(capsys, PLAN + [flag, value])
    assert_refused(code, err, f"argument {flag}:")
    assert out == ""


@pytest.mark.parametrize("flag, value", [("--timeout", "-5"), ("--need-gb", "-1"), ("--master-port", "99999"),
                                         ("--master-port", "0"), ("--bench-mb", "0"), ("--master-addr", "a..b")])
def test_doctor(capsys, flag, value):
    code, _, err = run_cli(capsys, ["doctor", "--only", "python", flag, value])
    assert_refused(code, err, f"argument {flag}:")


@pytest.mark.parametrize("addr", ["", "  ", "a..b", "999.1.1.1", "-x", "host_name!"])
def test_launch_master_addr(capsys, tmp_path, addr):
    code, _, err = run_cli(capsys, ["launch", "recipe.yaml", f"--master-addr={addr}"])
    assert_refused(code, err, "argument --master-addr:")


@pytest.mark.parametrize("good", ["127.0.0.1", "::1", "node-0", "node0.cluster.local", "10.1.2.3"])
def test_host_accepts_real_addresses(good):
    assert cli_args.host(good) == good


def test_validators_bounds():
    assert cli_args.port("1") == 1 and cli_args.port("65535") == 65535
    assert cli_args.positive_float("0.5") == 0.5 and cli_args.non_negative_int("0") == 0
    for fn, text in ((cli_args.port, "65536"), (cli_args.positive_float, "0"), (cli_args.positive_int, "1.5"),
                     (cli_args.non_negative_float, "-0.1"), (cli_args.positive_float, "inf")):
        with pytest.raises(argparse.ArgumentTypeError):
            fn(text)


@pytest.mark.parametrize("scaling, key", [
    ({"type": "yarn", "factor": "40", "original_max_position_embeddings": 4096}, "factor"),
    ({"type": "yarn", "factor": 40, "original_max_position_embeddings": "4k"}, "original_max_position_embeddings"),
    ({"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096.5}, "original_max_position_embeddings"),
    ({"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": "x"}, "beta_fast"),
    ({"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": [1]}, "mscale"),
    ({"type": "yarn", "factor": True, "original_max_position_embeddings": 4096}, "factor"),
])
def test_rope_scaling_inner_keys(capsys, tmp_path, scaling, key):
    hf = edit_config(hf_copy(tmp_path), rope_scaling=scaling)
    code, _, err = run_cli(capsys, ["convert", "hf-to-ms", hf, tmp_path / "out", "--no-progress"])
    assert_refused(code, err, f"rope_scaling.{key}: expected")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key", ["factor", "original_max_position_embeddings"])
def test_rope_scaling_required_key_null(capsys, tmp_path, key):
    scaling = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, key: None}
    hf = edit_config(hf_copy(tmp_path), rope_scaling=scaling)
    code, _, err = run_cli(capsys, ["convert", "hf-to-ms", hf, tmp_path / "out", "--no-progress"])
    assert_refused(code, err, f"rope_scaling.{key}: required for yarn")
    assert not (tmp_path / "out").exists()


def test_rope_scaling_optional_key_null_means_its_default():
    from ms_deepseek.spec.config import DeepseekV2Config

    base = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096}
    with_null = DeepseekV2Config(rope_scaling={**base, "mscale": None, "beta_fast": None})
    assert with_null.rope_scaling == DeepseekV2Config(rope_scaling=base).rope_scaling
