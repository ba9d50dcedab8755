"""The top-level command: help, unknown commands, user errors as one line, closed pipes."""

import os
import subprocess
import sys

from ms_deepseek.cli import COMMANDS, main

from repo_paths import REPO

ENV = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_unknown_command_is_one_line(capsys):
    assert main(["trian"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'trian'" in err and "Traceback" not in err


def test_every_command_has_help():
    for name in COMMANDS:
        proc = subprocess.run(
            [sys.executable, "-m", "ms_deepseek.cli", name, "--help"],
            capture_output=True,
            text=True,
            timeout=120,
            env=ENV,
        )
        assert proc.returncode == 0, (name, proc.stderr[-500:])
        assert "usage: ms-deepseek " + name in proc.stdout


def test_closed_pipe_is_not_a_traceback():
    proc = subprocess.run(
        f"{sys.executable} -m ms_deepseek.cli plan --model deepseek-v2 --npus 64 --seq-len 4096 "
        f"--global-batch 64 --dp 4 --tp 8 --pp 2 --ep 4 --json | head -c 10",
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )
    assert "Traceback" not in proc.stderr and proc.stdout.startswith("{")


def test_every_command_module_follows_the_convention():
    """add_arguments(parser) + run(args) and no entry point of its own (cli.py handles errors once)."""
    import importlib

    for name, (module_name, _) in COMMANDS.items():
        module = importlib.import_module(module_name)
        assert callable(getattr(module, "add_arguments", None)) and callable(getattr(module, "run", None)), name
        assert not hasattr(module, "main"), f"{module_name} has its own main(); register it in cli.COMMANDS only"


def test_verbose_is_every_command_flag_and_default_is_quiet(monkeypatch):
    """Default: GLOG_v=3 (MindSpore errors only) unless the user set it; --verbose leaves it alone."""
    from ms_deepseek.core import runtime

    monkeypatch.delenv("GLOG_v", raising=False)
    monkeypatch.delenv(runtime.VERBOSE_ENV, raising=False)
    assert main(["doctor", "--list"]) == 0
    assert os.environ.get("GLOG_v") == "3"
    monkeypatch.delenv("GLOG_v")
    assert main(["doctor", "--list", "--verbose"]) == 0
    assert "GLOG_v" not in os.environ and runtime.is_verbose()
    monkeypatch.delenv(runtime.VERBOSE_ENV)
    monkeypatch.setenv("GLOG_v", "1")  # the user's own choice wins
    runtime.quiet_defaults()
    assert os.environ["GLOG_v"] == "1"


def test_a_closed_output_is_exit_0_in_process(monkeypatch):
    """The error boundary takes BrokenPipeError before OSError (its base class), which re-raises: the
    pipe test above only sees that when `head` closes before plan has written."""
    import io

    read_end, write_end = os.pipe()

    class ClosedPipe(io.TextIOBase):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self):
            return write_end

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    try:
        assert (
            main(
                [
                    "plan",
                    "--model",
                    "deepseek-v2",
                    "--npus",
                    "64",
                    "--seq-len",
                    "4096",
                    "--global-batch",
                    "64",
                    "--dp",
                    "4",
                    "--tp",
                    "8",
                    "--pp",
                    "2",
                    "--ep",
                    "4",
                    "--json",
                ]
            )
            == 0
        )
    finally:
        os.close(read_end)
        os.close(write_end)
