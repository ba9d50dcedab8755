"""Preemption: on SIGTERM to `train` (which by default would kill it, exit 143, with no checkpoint) the
step in flight finishes, a complete checkpoint of it is saved, the run exits 128 + 15 with one line saying
so, and `--resume auto` repeats the uninterrupted run's losses exactly. (SIGTERM reaching every rank of a
2-worker job through `launch` is in test_launch_signals.py.)"""

import os
import signal

import pytest
from test_train import data_dir, losses_of, recipe_dict, reference, write_recipe  # noqa: F401 (fixtures)

from ms_deepseek.cli import main


@pytest.mark.slow
def test_sigterm_saves_at_the_next_step_and_resume_auto_repeats_the_losses(
    reference, data_dir, tmp_path, monkeypatch, capsys
):
    from ms_deepseek.checkpoint.training import CheckpointManager
    from ms_deepseek.train.run_log import RunLog

    ref_dir, _ = reference
    # no periodic saves: the only checkpoint can come from the preemption
    recipe = write_recipe(tmp_path, recipe_dict(data_dir, checkpoint={"save_interval": 0, "keep_last": 2}))
    run = tmp_path / "run"
    log = RunLog.log

    def log_then_sigterm(self, record):
        log(self, record)
        if record["step"] == 2:  # what a scheduler does, mid-run
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(RunLog, "log", log_then_sigterm)
    assert main(["train", str(recipe), "--output", str(run), "--quiet"]) == 128 + signal.SIGTERM
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ms-deepseek train: stopped by SIGTERM after step 3: saved checkpoint "), err
    assert "--resume auto" in err[-1]
    assert [s for s, _ in CheckpointManager(run / "checkpoints").complete()] == [3]
    monkeypatch.undo()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is the run's only

    assert main(["train", str(recipe), "--output", str(run), "--quiet", "--resume", "auto"]) == 0
    assert losses_of(run) == losses_of(ref_dir)
