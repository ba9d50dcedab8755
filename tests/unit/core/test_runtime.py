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


@pytest.mark.parametrize("found", ["2.11.0", "2.8.1", "3.0.0rc1", "2.1.0"])
def test_an_untested_mindspore_line_is_refused_in_one_line_naming_the_supported_ones(found):
    from ms_deepseek.core.runtime import check_mindspore_version

    with pytest.raises(UserError) as err:
        check_mindspore_version(found)
    message = str(err.value)
    assert message.startswith(f"MindSpore {found}: ms-deepseek runs on MindSpore 2.9.x and 2.10.x "), message
    assert "\n" not in message and "MS_DEEPSEEK_MINDSPORE=<line> pip install -e ." in message


@pytest.mark.parametrize(
    "found, line",
    [("2.9.0", "2.9"), ("2.9.1", "2.9"), ("2.9.0+cpu", "2.9"), ("2.10.0", "2.10"), ("2.10.1", "2.10")],
)
def test_the_supported_lines_pass_and_name_their_line(found, line):
    from ms_deepseek.core.runtime import check_mindspore_version

    assert check_mindspore_version(found) == line
    assert check_mindspore_version() in ("2.9", "2.10")  # the installed one (its line's pins file)


def test_each_supported_line_has_a_pins_file_that_differs_only_in_mindspore_and_mindformers():
    from ms_deepseek.core.runtime import SUPPORTED_MINDSPORE_LINES, pins_file
    from ms_deepseek.doctor.pins import parse_requirement_lines

    from repo_paths import REPO

    default = parse_requirement_lines((REPO / "requirements.txt").read_text().splitlines())
    assert pins_file(SUPPORTED_MINDSPORE_LINES[0]) == "requirements.txt"
    for line in SUPPORTED_MINDSPORE_LINES:
        pinned = parse_requirement_lines((REPO / pins_file(line)).read_text().splitlines())
        assert pinned["mindspore"].exact.startswith(line + "."), (line, pinned["mindspore"])
        rest = {k: v for k, v in pinned.items() if k not in ("mindspore", "mindformers")}
        assert rest == {k: v for k, v in default.items() if k not in ("mindspore", "mindformers")}, line


def _setup_requires(monkeypatch, line):
    """install_requires of setup.py with MS_DEEPSEEK_MINDSPORE=line (setuptools.setup captured, not run)."""
    import runpy

    import setuptools

    from repo_paths import REPO

    seen = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: seen.update(kw))
    monkeypatch.setenv("MS_DEEPSEEK_MINDSPORE", line)
    monkeypatch.chdir(REPO)
    runpy.run_path(str(REPO / "setup.py"))
    return [r for r in seen["install_requires"] if r.startswith(("mindspore==", "mindformers=="))]


def test_setup_installs_the_line_asked_for_and_refuses_another(monkeypatch):
    assert _setup_requires(monkeypatch, "") == ["mindspore==2.9.0", "mindformers==1.9.0"]
    assert _setup_requires(monkeypatch, "2.9") == ["mindspore==2.9.0", "mindformers==1.9.0"]
    assert _setup_requires(monkeypatch, "2.10") == ["mindspore==2.10.0"]
    with pytest.raises(SystemExit) as err:
        _setup_requires(monkeypatch, "2.8")
    assert str(err.value) == "MS_DEEPSEEK_MINDSPORE=2.8: not a supported MindSpore line (supported: 2.9, 2.10)"


def test_train_refuses_an_unsupported_mindspore_before_anything_runs(monkeypatch, tmp_path, capsys):
    import importlib.metadata

    from bad_input_helpers import assert_refused, run_cli

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.11.0" if name == "mindspore" else real(name))
    from repo_paths import RECIPES

    code, _, err = run_cli(capsys, ["train", str(RECIPES / "tiny-cpu.yaml"), "--output", str(tmp_path / "run")])
    assert_refused(code, err, "MindSpore 2.11.0: ms-deepseek runs on MindSpore 2.9.x and 2.10.x")
    assert not (tmp_path / "run").exists()
