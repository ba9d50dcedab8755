"""``ms-deepseek train`` and its run folder: MindSpore's dry run stops after the compile in one
line; one writer per run folder; checkpoints that prove they are intact; a full disk in one line."""

import os
import subprocess
import sys

import pytest
import yaml

from builders import SMALL_MODEL
from repo_paths import REPO


def _recipe(tmp_path, steps=4, save_interval=2):
    recipe = {
        "model": {"source": "tiny", "overrides": dict(SMALL_MODEL)},
        "data": {"seq_len": 16, "embedded_vocab_size": 512},
        "train": {"steps": steps, "micro_batch_size": 1, "seed": 3},
        "checkpoint": {"save_interval": save_interval, "keep_last": 5},
        "logging": {"log_interval": 1, "tensorboard": False},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _train_process(argv, env=None, **kw):
    """``ms-deepseek train ARGV`` in a child process (the worktree's package first on its path)."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "ms_deepseek.cli", "train", *map(str, argv), "--quiet"],
        capture_output=True,
        text=True,
        env=env,
        cwd=kw.pop("cwd", None),
        timeout=kw.pop("timeout", 600),
        **kw,
    )


# ---------------------------------------------------------------------------- MindSpore's dry run
@pytest.mark.slow
def test_dry_run_stops_after_the_compile_in_one_line(tmp_path):
    """Under MS_SIMULATION_LEVEL=0 the compiled step returns a placeholder (an int), which the trainer does not
    unpack as a step's results: one line, exit 0, no run folder, no traceback."""
    recipe = _recipe(tmp_path)
    proc = _train_process([recipe, "--output", tmp_path / "run"], env=dict(os.environ, MS_SIMULATION_LEVEL="0"))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ms-deepseek train:")]
    assert len(lines) == 1, proc.stdout
    assert "MS_SIMULATION_LEVEL=0" in lines[0] and "compiled" in lines[0], lines
    assert f"ms-deepseek plan --recipe {recipe} --compile" in lines[0], lines
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------- checkpoint digests
def _flip_middle(path, n=16):
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + n] = bytes(b ^ 0xFF for b in data[mid : mid + n])
    path.write_bytes(bytes(data))


def test_resume_refuses_a_damaged_checkpoint_and_takes_the_intact_one_when_told(tmp_path, capsys):
    """16 bytes flipped in the newest model.safetensors: --resume and --resume auto refuse it naming the file,
    and --skip-damaged sets it aside and resumes the intact checkpoint before it."""
    from bad_input_helpers import assert_refused, run_cli

    recipe, run = _recipe(tmp_path, steps=6), tmp_path / "run"
    code, _, err = run_cli(capsys, ["train", recipe, "--output", run, "--quiet", "--max-steps", "4"])
    assert code == 0, err
    ckpts = run / "checkpoints"
    _flip_middle(ckpts / "step_00000004" / "model.safetensors")
    longer = []
    for resume in (["--resume"], ["--resume", "auto"]):
        code, _, err = run_cli(capsys, ["train", recipe, "--output", run, "--quiet", *resume, *longer])
        assert_refused(code, err, str(ckpts / "step_00000004" / "model.safetensors"), "damaged", "step_00000002")
        assert "--skip-damaged" in err
    code, out, err = run_cli(
        capsys, ["train", recipe, "--output", run, "--quiet", "--resume", "--skip-damaged", *longer]
    )
    assert code == 0, err
    assert f"resuming {ckpts / 'step_00000002'} at step 2" in out, out
    assert [p.name.split(".damaged-")[0] for p in ckpts.glob("step_00000004.damaged-*")] == ["step_00000004"]
    assert (ckpts / "step_00000006").is_dir()


# ---------------------------------------------------------------------------- a full disk
def _used(folder):
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


@pytest.mark.slow
def test_a_full_disk_at_the_write_is_one_line_and_the_run_resumes(tmp_path, capsys, monkeypatch):
    """ENOSPC in safetensors_io.write_file ends the run in one line naming the checkpoint and the last complete
    one, leaves no partial, and --resume continues. Simulated at the write call (a real small file system needs
    root to mount)."""
    import errno

    from ms_deepseek.checkpoint import safetensors_io

    from bad_input_helpers import assert_refused, run_cli

    real = safetensors_io._write_all

    def full_at_step_4(fd, data, pos):
        if "step_00000004" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, pos)

    monkeypatch.setattr(safetensors_io, "_write_all", full_at_step_4)
    recipe, run = _recipe(tmp_path), tmp_path / "run"
    code, _, err = run_cli(capsys, ["train", recipe, "--output", run, "--quiet"])
    ckpts = run / "checkpoints"
    assert_refused(code, err, f"checkpoint {ckpts / 'step_00000004'}", "no space left", "needs", "free")
    assert f"the last complete checkpoint is {ckpts / 'step_00000002'}" in err and "--resume" in err
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000002"]  # no partial left
    monkeypatch.setattr(safetensors_io, "_write_all", real)
    code, out, err = run_cli(capsys, ["train", recipe, "--output", run, "--quiet", "--resume"])
    assert code == 0, err
    assert (ckpts / "step_00000004").is_dir()


@pytest.mark.slow
def test_free_space_is_checked_at_start_and_before_each_save(tmp_path, capsys, monkeypatch):
    """A disk that holds one checkpoint and a half: a warning at start, the second save refused before a byte of
    it is written."""
    from ms_deepseek.checkpoint import training as ckpt_mod

    from bad_input_helpers import assert_refused, run_cli

    recipe, run = _recipe(tmp_path), tmp_path / "run"
    budget = {}

    def free(folder):  # the budget less what the run's checkpoints take
        return budget["bytes"] - _used(run / "checkpoints")

    real_bytes = ckpt_mod.checkpoint_bytes

    def sized(*groups):
        size = real_bytes(*groups)
        budget.setdefault("bytes", int(size * 1.5))
        return size

    monkeypatch.setattr(ckpt_mod, "free_bytes", free)
    monkeypatch.setattr(ckpt_mod, "checkpoint_bytes", sized)
    code, out, err = run_cli(capsys, ["train", recipe, "--output", run, "--quiet"])
    assert "warning: checkpoint: this run writes 2 checkpoint(s)" in out, out
    assert_refused(code, err, "step_00000004", "no space left", "step_00000002")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_00000002"]


# ---------------------------------------------------------------------------- one writer per run folder
@pytest.mark.slow
def test_a_second_writer_is_refused_while_the_first_trains(tmp_path, capsys):
    """While A trains, B (`train --output SAME --resume`) neither removes A's partial checkpoint nor trains
    beside it: B is refused in one line naming A (host, pid, since, heartbeat) and touches nothing; once A is
    dead (killed), its lease is taken over without a word and the run resumes."""
    import signal
    import socket
    import time

    from bad_input_helpers import assert_refused, run_cli

    recipe, run = _recipe(tmp_path, steps=100000, save_interval=2), tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    a_log = open(tmp_path / "a.log", "w")  # a file, not a pipe nobody drains while A trains
    a = subprocess.Popen(
        [sys.executable, "-m", "ms_deepseek.cli", "train", str(recipe), "--output", str(run), "--quiet"],
        env=env,
        stdout=a_log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 900
        # any checkpoint: A trains tens of steps a second on an idle CPU, and keep_last prunes step 2 soon after
        while not list((run / "checkpoints").glob("step_*")):
            assert a.poll() is None and time.monotonic() < deadline, (tmp_path / "a.log").read_text()[-3000:]
            time.sleep(0.5)
        before = sorted(p.name for p in run.iterdir())
        # --max-steps: without the lease B trained beside A (and this test ends)
        code, _, err = run_cli(capsys, ["train", recipe, "--output", run, "--quiet", "--resume", "--max-steps", "4"])
        assert_refused(
            code, err, "held by another job", f"host {socket.gethostname()} pid {a.pid}", "since", "heartbeat"
        )
        assert "--take-over" in err
        assert a.poll() is None  # A trains on
        assert set(before) <= {p.name for p in run.iterdir()}  # B removed nothing of A's
    finally:
        a.send_signal(signal.SIGKILL)
        a.wait()
        a_log.close()
    assert (run / ".lease").is_file()  # a killed holder leaves its lease: taken over (its pid is gone)
    code, out, err = run_cli(capsys, ["train", recipe, "--output", run, "--quiet", "--resume", "--max-steps", "1"])
    assert code == 0, err
    assert "run complete" in out or "resuming" in out, out
    assert not (run / ".lease").exists()
