"""Ranks agree on the checkpoint to resume: rank 0 decides, so that without a shared file system (or with NFS lag)
ranks whose newest complete checkpoints differ do not start at different steps. Two msrun workers each see their own
run folder (as on two nodes with local disks): rank 0 holds step 2 and step 4, rank 1 only step 2. Rank 0 decides
(step 4); rank 1 lacks it, and the job stops with a line naming rank 1, before any model is built."""

import json
import os
import sys
from pathlib import Path

import pytest

from builders import free_port
from builders import small_recipe as recipe_data
from builders import write_recipe as write
from repo_paths import REPO as ROOT

# msrun starts the same command on every rank: this one trains into a folder of its own rank
PER_RANK = """
import os, sys
from ms_deepseek.cli import main
root, recipe = sys.argv[1], sys.argv[2]
sys.exit(main(["train", recipe, "--output", os.path.join(root, "rank" + os.environ["RANK_ID"]), "--quiet",
               "--resume", "auto"]))
"""


def _fake_checkpoint(run: Path, step: int) -> None:
    """A folder that counts as complete (files present); the job must stop before reading them."""
    folder = run / "checkpoints" / f"step_{step:08d}"
    folder.mkdir(parents=True)
    for name in ("model.safetensors", "optimizer.safetensors", "config.json", "recipe.yaml"):
        (folder / name).write_text("not read")
    (folder / "state.json").write_text(json.dumps({"step": step}))


@pytest.mark.msrun
def test_ranks_that_see_different_checkpoints_stop_naming_the_rank(tmp_path, capsys):
    from ms_deepseek.cli.launch import msrun_executable
    from ms_deepseek.jobs.supervise import run_supervised

    recipe = write(tmp_path, recipe_data(None, dp=2))
    for step in (2, 4):
        _fake_checkpoint(tmp_path / "rank0", step)
    _fake_checkpoint(tmp_path / "rank1", 2)
    script = tmp_path / "per_rank.py"
    script.write_text(PER_RANK)
    logs = tmp_path / "logs"
    cmd = msrun_executable() + [
        "--worker_num=2",
        "--local_worker_num=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        f"--log_dir={logs}",
        "--join=True",
        "--cluster_time_out=120",
        str(script),
        str(tmp_path),
        str(recipe),
    ]
    # msrun runs the script with "python" from PATH, as launch arranges: this interpreter's
    env = dict(
        os.environ, PYTHONPATH=str(ROOT), PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"]
    )
    code, failure = run_supervised(cmd, env, logs)
    assert code != 0 and failure is not None
    want = "rank 0 resumes from step 4 but rank 1 does not have that complete checkpoint (step_00000004 in its "
    for rank in (0, 1):
        text = (logs / f"worker_{rank}.log").read_text()
        assert want in text, text[-2000:]
        assert "Traceback" not in text
