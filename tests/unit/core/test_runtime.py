"""runtime.detect_device: the one rule for CPU or Ascend (trainer, generate, doctor's smoke run, tests)."""

import os

import pytest

from ms_deepseek.core.errors import UserError
from ms_deepseek.core.runtime import DEVICE_ENV, detect_device


def _fake_npu_smi(tmp_path, monkeypatch):
    tool = tmp_path / "npu-smi"
    tool.write_text("#!/bin/sh\nexit 0\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_ascend_needs_npu_smi_and_cann(tmp_path, monkeypatch):
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no npu-smi anywhere
    assert detect_device() == "CPU"
    _fake_npu_smi(tmp_path, monkeypatch)
    assert detect_device() == "CPU"  # NPUs without CANN's environment
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path))
    assert detect_device() == "Ascend"


def test_env_override_and_bad_value(tmp_path, monkeypatch):
    _fake_npu_smi(tmp_path, monkeypatch)
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path))
    monkeypatch.setenv(DEVICE_ENV, "CPU")
    assert detect_device() == "CPU"
    monkeypatch.setenv(DEVICE_ENV, "gpu")
    with pytest.raises(UserError) as err:
        detect_device()
    assert str(err.value) == "MS_DEEPSEEK_DEVICE='gpu': expected one of CPU, Ascend"


@pytest.mark.parametrize("found", ["2.10.0", "2.8.1", "3.0.0rc1"])
def test_another_mindspore_line_is_refused_in_one_line(found):
    from ms_deepseek.core.runtime import check_mindspore_version

    with pytest.raises(
        UserError, match=rf"^MindSpore {found}: ms-deepseek runs on MindSpore 2\.9\.x .*requirements\.txt"
    ):
        check_mindspore_version(found)


@pytest.mark.parametrize("found", ["2.9.0", "2.9.1", "2.9.0+cpu"])
def test_the_supported_line_passes(found):
    from ms_deepseek.core.runtime import check_mindspore_version

    check_mindspore_version(found)
    check_mindspore_version()  # the installed one (requirements.txt's pin)


def test_train_refuses_an_unsupported_mindspore_before_anything_runs(monkeypatch, tmp_path, capsys):
    import importlib.metadata

    from bad_input_helpers import assert_refused, run_cli

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.10.0" if name == "mindspore" else real(name))
    from repo_paths import RECIPES

    code, _, err = run_cli(capsys, ["train", str(RECIPES / "tiny-cpu.yaml"), "--output", str(tmp_path / "run")])
    assert_refused(code, err, "MindSpore 2.10.0: ms-deepseek runs on MindSpore 2.9.x")
    assert not (tmp_path / "run").exists()
