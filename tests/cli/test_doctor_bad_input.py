"""Bad input to ``ms-deepseek doctor``: nonsense flag values, a requirements file that is not text, a folder
or a FIFO."""

import pytest

from bad_input_helpers import assert_refused, run_cli


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--timeout", "-5"),
        ("--need-gb", "-1"),
        ("--master-port", "99999"),
        ("--master-port", "0"),
        ("--bench-mb", "0"),
        ("--master-addr", "a..b"),
    ],
)
def test_doctor(capsys, flag, value):
    code, _, err = run_cli(capsys, ["doctor", "--only", "python", flag, value])
    assert_refused(code, err, f"argument {flag}:")


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


@pytest.mark.parametrize("level", ["16", "64"])
def test_a_cluster_level_without_the_master_address_stops_before_any_check(capsys, monkeypatch, level):
    """`doctor --level 16` without --master-addr is a usage error naming both flags before any check runs."""
    from ms_deepseek.cli import doctor

    monkeypatch.delenv("MS_SCHED_HOST", raising=False)
    ran = []
    real = doctor.run_check
    monkeypatch.setattr(doctor, "run_check", lambda chk, ctx: ran.append(chk.id) or real(chk, ctx))
    code, out, err = run_cli(capsys, ["doctor", "--level", level])
    assert_refused(code, err, f"--level {level}", "--master-addr", "--node-rank")
    assert not ran and "[PASS]" not in out
