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
