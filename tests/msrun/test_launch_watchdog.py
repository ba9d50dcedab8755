"""A hung worker is found: besides process exits, launch watches step progress, so a worker stuck in a
collective does not wait out HCCL_EXEC_TIMEOUT. Rank 1 of a 2-worker CPU job is made to hang after step 3; the
watchdog (no step within F x the median step time, at least --watchdog-min) dumps every worker's Python
stacks into its log, stops the job and names rank 1 as the one that did not reach step 4.

With the watchdog off, the CPU ring collective of rank 0 gives up waiting for rank 1 (30 s here); rank 0's
failed step then waits for launch to dump the stacks of rank 1 (the rank behind) before it exits, since
msrun kills rank 1 as soon as rank 0 is gone. The two must not race on a loaded 2-core machine: the watchdog
fires even when its first look finds step 3 already done (a step time measured only between two of its own
looks would never fire then, the collective would give up first and msrun would kill rank 1 with no stacks)."""

import os
import sys
from pathlib import Path

import pytest
from test_launch_signals import job_processes

from builders import free_port
from builders import small_recipe as recipe_data
from builders import write_recipe as write
from repo_paths import REPO as ROOT

HANG_RANK_1 = """
import os, sys, time
import numpy as np
from ms_deepseek.cli import main
from ms_deepseek.train.trainer import Trainer
save = Trainer.maybe_save
def maybe_save(self, step):
    save(self, step)
    if step == 3 and os.environ["RANK_ID"] == "1":
        time.sleep(600)  # a worker that stops making progress
Trainer.maybe_save = maybe_save
run_step = Trainer.run_step
def compiled_together(self):
    # Both ranks compile the step before either runs it: the CPU ring collective gives up after 30 s (not
    # configurable), and on a loaded 2-core machine one worker can finish its compile that much later than the
    # other, which then fails in step 1's all-reduce before the hang this test is about.
    if not getattr(self, "_together", False):
        from mindspore import Tensor
        shape = self.tensors.input_shape
        self.tensors.step_cell.compile(Tensor(np.zeros(shape, np.int32)), Tensor(np.zeros(shape, np.int32)))
        (self.run_dir / ("compiled_" + os.environ["RANK_ID"])).write_text("")
        while len(list(self.run_dir.glob("compiled_*"))) < 2:
            time.sleep(0.05)
        self._together = True
    return run_step(self)
Trainer.run_step = compiled_together
sys.exit(main(["train", sys.argv[2], "--output", sys.argv[1], "--quiet"]))
"""


@pytest.mark.parametrize("factor", [2, 0])
@pytest.mark.msrun
def test_a_hung_worker_stops_the_job_with_stacks_and_its_rank(tmp_path, factor):
    import time

    from ms_deepseek.cli.launch import msrun_executable
    from ms_deepseek.data.prepare import prepare_embedded_default
    from ms_deepseek.jobs.preempt import HEARTBEAT_DIR
    from ms_deepseek.jobs.supervise import run_supervised

    data = tmp_path / "corpus"
    prepare_embedded_default(data, seq_len=32, vocab_size=512, max_bytes=60_000, progress=False)
    spec = recipe_data(data, dp=2)
    spec["train"]["steps"] = 2000
    recipe = write(tmp_path, spec)
    run_dir, logs = tmp_path / "run", tmp_path / "run" / "msrun_logs"
    script = tmp_path / "hang.py"
    script.write_text(HANG_RANK_1)
    cmd = msrun_executable() + [
        "--worker_num=2",
        "--local_worker_num=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        f"--log_dir={logs}",
        "--join=True",
        "--cluster_time_out=120",
        str(script),
        str(run_dir),
        str(recipe),
    ]
    env = dict(
        os.environ, PYTHONPATH=str(ROOT), PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"]
    )
    t0 = time.time()
    # factor 2: a limit far below the CPU ring collective's own timeout (30 s; on Ascend HCCL_EXEC_TIMEOUT is
    # 1800 s); factor 0: no watchdog, the collective gives up first
    code, message = run_supervised(
        cmd, env, logs, heartbeat_dir=run_dir / HEARTBEAT_DIR, watchdog_factor=factor, watchdog_min_s=3
    )
    print(f"hung job stopped after {time.time() - t0:.1f} s: {message}")
    assert code == 1, message
    if factor:
        assert message.startswith("watchdog: no step finished for "), message
        assert "rank 1 did not reach step 4" in message
        assert "(most recent call first)" in (logs / "worker_0.log").read_text()  # faulthandler: every worker
    else:
        assert (
            message.startswith("worker rank 0 (pid ")
            and "in a collective waiting for rank 1, which did not reach step 4 (hung: Python stacks of rank 1 in "
            in message
        ), message
    stacks = (logs / "worker_1.log").read_text()
    assert "(most recent call first)" in stacks and "maybe_save" in stacks  # where the hung rank is stuck
    assert not job_processes(run_dir)
