"""Bad input to ``ms-deepseek convert``: destinations that would destroy or pollute the source, leftovers of
failed and killed runs, config values of the wrong type, runaway nesting, nonsense rope_scaling values,
unwritable outputs. One line naming the culprit, exit 2, nothing left behind."""

import os
import signal
import struct
import subprocess
import sys
import time

import pytest

from bad_input_helpers import DEEP, assert_refused, deep, edit_config, hf_copy, listing, run_cli


@pytest.mark.parametrize(
    "dst, extra, name",
    [
        ("hf/sub", [], "lies inside the source"),
        ("hf/a/b", [], "lies inside the source"),
        ("hf", [], "is the source folder"),
        (".", ["--overwrite"], "holds the source"),
    ],
)
def test_convert(capsys, tmp_path, dst, extra, name):
    hf = hf_copy(tmp_path)
    (tmp_path / "other").write_text("keep")  # makes tmp_path non-empty
    before = listing(tmp_path)
    code, _, err = run_cli(capsys, ["convert", "hf-to-ms", hf, tmp_path / dst, "--no-progress", *extra])
    assert_refused(code, err, name)
    assert listing(tmp_path) == before


def test_convert_through_a_symlink_into_the_source(capsys, tmp_path):
    hf = hf_copy(tmp_path)
    (tmp_path / "link").symlink_to(hf)
    code, _, err = run_cli(capsys, ["convert", "hf-to-ms", hf, tmp_path / "link" / "sub", "--no-progress"])
    assert_refused(code, err, "lies inside the source")
    assert not (hf / "sub").exists()


def test_sigkilled_conversion_is_cleaned_by_the_next_run(capsys, tmp_path):
    hf = hf_copy(tmp_path)
    code = (
        "import os, time\n"
        "import ms_deepseek.checkpoint.convert.hf as api\n"
        "def stuck(*a, **k):\n"
        "    open(os.environ['READY'], 'w').close(); time.sleep(120)\n"
        "api._write_shards = stuck\n"
        f"api.hf_to_ms({str(hf)!r}, {str(tmp_path / 'out')!r}, progress=False)\n"
    )
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, READY=str(ready)))
    deadline = time.time() + 120
    while not ready.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert ready.exists(), "the writer did not start"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    ready.unlink()
    partials = [p for p in tmp_path.iterdir() if p.name.startswith(".out.partial-")]
    assert len(partials) == 1  # what SIGKILL leaves
    code, _, err = run_cli(capsys, ["convert", "hf-to-ms", hf, tmp_path / "out", "--no-progress"])
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out"]


def test_failed_conversion_removes_the_parents_it_created(capsys, tmp_path):
    hf = edit_config(hf_copy(tmp_path), intermediate_size=7)  # the tensors no longer match
    before = listing(tmp_path)
    code, _, err = run_cli(capsys, ["convert", "hf-to-ms", hf, tmp_path / "a" / "b" / "out", "--no-progress"])
    assert code == 2, err
    assert listing(tmp_path) == before


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("hidden_size", "abc", "expected an integer"),
        ("num_hidden_layers", "2", "expected an integer"),
        ("rope_theta", "big", "expected a number"),
        ("n_routed_experts", [1], "expected"),
        ("rms_norm_eps", None, "expected a number"),
    ],
)
def test_config_value_of_the_wrong_type(capsys, tmp_path, key, value, expected):
    hf = edit_config(hf_copy(tmp_path), **{key: value})
    code, _, err = run_cli(capsys, ["convert", "hf-to-ms", hf, tmp_path / "out", "--no-progress"])
    assert_refused(code, err, "config.json", key, expected)
    assert "not supported between" not in err


def test_string_rope_factor_names_the_key_not_a_comparison(capsys, tmp_path):
    hf = edit_config(
        hf_copy(tmp_path), rope_scaling={"type": "yarn", "factor": "40", "original_max_position_embeddings": 4096}
    )
    code, _, err = run_cli(capsys, ["convert", "hf-to-ms", hf, tmp_path / "out", "--no-progress"])
    assert_refused(code, err, "rope_scaling.factor: expected a number, got '40'")


def _config(hf):
    (hf / "config.json").write_text(deep())
    return "config.json: nested too deeply"


def _header(hf):
    blob = ('{"a":' * 20000 + "1" + "}" * 20000).encode()
    (hf / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob)
    return "model.safetensors (safetensors header): nested too deeply"


def _index(hf):
    (hf / "model.safetensors.index.json").write_text(deep())
    return "model.safetensors.index.json: nested too deeply"


def _object_config(hf):
    (hf / "config.json").write_text('{"a":' * DEEP + "1" + "}" * DEEP)
    return "config.json: nested too deeply"


@pytest.mark.parametrize("spoil", [_config, _header, _index, _object_config])
def test_convert_inputs(capsys, tmp_path, spoil):
    hf = hf_copy(tmp_path)
    name = spoil(hf)
    before = listing(tmp_path)
    code, _, err = run_cli(capsys, ["convert", "hf-to-ms", hf, tmp_path / "out", "--no-progress"])
    assert_refused(code, err, name)
    assert listing(tmp_path) == before


@pytest.mark.parametrize(
    "scaling, key",
    [
        ({"type": "yarn", "factor": "40", "original_max_position_embeddings": 4096}, "factor"),
        ({"type": "yarn", "factor": 40, "original_max_position_embeddings": "4k"}, "original_max_position_embeddings"),
        (
            {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096.5},
            "original_max_position_embeddings",
        ),
        ({"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": "x"}, "beta_fast"),
        ({"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": [1]}, "mscale"),
        ({"type": "yarn", "factor": True, "original_max_position_embeddings": 4096}, "factor"),
    ],
)
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


@pytest.mark.parametrize("dst", ["/proc/ms-deepseek-out", "/sys/ms-deepseek-out", "/proc/self/x/y"])
def test_convert_under_pseudo_fs(capsys, tmp_path, dst):
    hf = hf_copy(tmp_path)
    code, _, err = run_cli(capsys, ["convert", "hf-to-ms", hf, dst, "--no-progress"])
    assert_refused(code, err, dst.split("/")[1])


def test_convert_parent_is_a_file(capsys, tmp_path):
    hf = hf_copy(tmp_path)
    (tmp_path / "afile").write_text("x")
    before = listing(tmp_path)
    code, _, err = run_cli(capsys, ["convert", "hf-to-ms", hf, tmp_path / "afile" / "a" / "out", "--no-progress"])
    assert_refused(code, err, "afile is a file")
    assert listing(tmp_path) == before
