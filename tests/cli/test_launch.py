"""``ms-deepseek launch``: the msrun command text, and a real 2-worker data-parallel run on CPU."""

import json
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest

from builders import ATLAS_RECIPES, free_port
from builders import main_captured as run_cli
from builders import small_recipe as recipe_data
from builders import write_recipe as write


def test_dry_run_prints_the_msrun_command(tmp_path):
    recipe = write(tmp_path, recipe_data(dp=16))
    code, out, _ = run_cli(
        [
            "launch",
            str(recipe),
            "--dry-run",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "10.1.2.3",
            "--master-port",
            "29600",
            "--output",
            "runs/x",
            "--set",
            "train.steps=7",
            "--cluster-time-out",
            "900",
            "--hccl-connect-timeout",
            "1200",
            "--hccl-exec-timeout",
            "3600",
        ]
    )
    assert code == 0
    words = shlex.split(out.strip())
    assert words[:3] == [
        "HCCL_CONNECT_TIMEOUT=1200",
        "HCCL_EXEC_TIMEOUT=3600",
        f"PATH={Path(sys.executable).parent}:$PATH",
    ]
    assert Path(words[3]).name == "msrun" or words[3] == sys.executable
    for flag in (
        "--worker_num=16",
        "--local_worker_num=8",
        "--master_addr=10.1.2.3",
        "--master_port=29600",
        "--node_rank=1",
        "--log_dir=runs/x/msrun_logs",
        "--join=True",
        "--cluster_time_out=900",
    ):
        assert flag in words, flag
    tail = words[words.index("python") : words.index("#")]
    assert tail == [
        "python",
        "-m",
        "ms_deepseek.cli",
        "train",
        str(recipe),
        "--output",
        "runs/x",
        "--quiet",
        "--set",
        "train.steps=7",
    ]
    assert not Path("runs").exists(), "--dry-run starts nothing"


def test_dry_run_keeps_exported_hccl_timeouts_and_names_the_interpreter(tmp_path, monkeypatch):
    """HCCL_EXEC_TIMEOUT / HCCL_CONNECT_TIMEOUT exported (as doctor advises) are kept; the flags still
    win; the defaults apply only when neither is set. The line says which python the workers run."""
    recipe = write(tmp_path, recipe_data(dp=2))
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "3600")
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "1800")
    code, out, _ = run_cli(["launch", str(recipe), "--dry-run"])
    assert code == 0 and shlex.split(out)[:2] == ["HCCL_CONNECT_TIMEOUT=1800", "HCCL_EXEC_TIMEOUT=3600"]
    assert "# python of the workers: " in out and f"{Path(sys.executable).parent}" in out.splitlines()[1]
    code, out, _ = run_cli(["launch", str(recipe), "--dry-run", "--hccl-exec-timeout", "900"])
    assert shlex.split(out)[:2] == ["HCCL_CONNECT_TIMEOUT=1800", "HCCL_EXEC_TIMEOUT=900"]
    monkeypatch.delenv("HCCL_EXEC_TIMEOUT")
    monkeypatch.delenv("HCCL_CONNECT_TIMEOUT")
    code, out, _ = run_cli(["launch", str(recipe), "--dry-run"])
    assert shlex.split(out)[:2] == ["HCCL_CONNECT_TIMEOUT=600", "HCCL_EXEC_TIMEOUT=1800"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nnodes", "3"], "--nnodes: 3 does not divide the recipe's world size 4"),
        (["--node-rank", "2", "--nnodes", "2"], "--node-rank: must be in [0, 1]"),
        (["--master-port", "80"], "--master-port: must be in 1024..65535"),
        (["--set", "parallel.dp=0"], "parallel.dp: must be >= 1"),
    ],
)
def test_launch_refuses_bad_layouts_before_starting(tmp_path, argv, message):
    recipe = write(tmp_path, recipe_data(dp=4))
    code, out, err = run_cli(["launch", str(recipe), "--dry-run"] + argv)
    assert code == 2
    assert message in err and "\n" not in err.strip()


def test_train_refuses_a_multi_worker_recipe_without_msrun(tmp_path):
    recipe = write(tmp_path, recipe_data(dp=2))
    code, _, err = run_cli(["train", str(recipe), "--output", str(tmp_path / "run")])
    assert code == 2 and "parallel.dp: 2 needs 2 workers" in err
    code, _, err = run_cli(["train", str(recipe), "--output", str(tmp_path / "run"), "--set", "parallel.tp=2"])
    assert code == 2 and "MindSpore compiles only on Ascend" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.msrun
def test_two_worker_data_parallel_equals_one_worker(tmp_path):
    """msrun, 2 CPU workers x batch 2 == 1 worker x batch 4: same losses, same final weights."""
    from safetensors.numpy import load_file

    from ms_deepseek.data.prepare import prepare_embedded_default

    data = tmp_path / "corpus"
    prepare_embedded_default(data, seq_len=32, vocab_size=512, max_bytes=100_000, progress=False)
    spec = recipe_data(data, dp=2)
    # validation at the end: each worker evaluates its half, the logged value is the mean over both
    spec["data"]["validation"] = {"fraction": 0.1}
    spec["train"]["eval_batches"] = 2
    recipe = write(tmp_path, spec)
    dp_dir, single_dir = tmp_path / "dp2", tmp_path / "single"

    code, out, err = run_cli(
        ["launch", str(recipe), "--output", str(dp_dir), "--master-port", str(free_port()), "--cluster-time-out", "120"]
    )
    logs = "\n".join(p.read_text(errors="replace")[-2000:] for p in (dp_dir / "msrun_logs").glob("worker_*.log"))
    assert code == 0, f"{err}\n{logs}"
    assert "--worker_num=2 --local_worker_num=2" in out

    code, _, err = run_cli(
        [
            "train",
            str(recipe),
            "--output",
            str(single_dir),
            "--quiet",
            "--set",
            "parallel.dp=1",
            "--set",
            "train.micro_batch_size=4",
        ]
    )
    assert code == 0, err

    def losses(run):
        return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]

    np.testing.assert_allclose(losses(dp_dir), losses(single_dir), rtol=1e-5)

    def val_loss(run):
        return json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["val_loss"]

    np.testing.assert_allclose(val_loss(dp_dir), val_loss(single_dir), rtol=1e-5)
    ckpt = "checkpoints/step_00000003"
    state = json.loads((dp_dir / ckpt / "state.json").read_text())
    assert state["world_size"] == 2
    assert len(state["replica_sha1"]) == 2 and state["replica_sha1"][0] == state["replica_sha1"][1]
    got, want = (
        load_file(str(dp_dir / ckpt / "model.safetensors")),
        load_file(str(single_dir / ckpt / "model.safetensors")),
    )
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=2e-5, err_msg=name)


def test_sharded_layout_coordinates_and_checkpoint_completeness(tmp_path):
    """The Ascend-only sharded path's pure parts: data replica / pipeline stage of a rank, and when a
    checkpoint of per-rank slices counts as complete."""
    from ms_deepseek.checkpoint.layout import LAYOUT_FILE
    from ms_deepseek.checkpoint.training import CheckpointManager, is_complete, rank_dir
    from ms_deepseek.config.parallel import ParallelConfig
    from ms_deepseek.parallel_plan.ranks import data_coordinates, stage_of_rank

    # world 8: stage = r // 4; with tp > 1 every rank reads the whole micro-batch (parallel_plan.ranks.reads_full_batch:
    # MindSpore refuses the data-parallel dataset strategy there, found by compiling)
    par = ParallelConfig(dp=2, tp=2, pp=2, micro_batches=4)
    assert [stage_of_rank(r, par) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [data_coordinates(r, par, 3) for r in range(8)] == [(0, 1, 6)] * 8
    # tp 1: replica = r % dp within the stage, MindSpore's default (VirtualDatasetInfo; the oracle is
    # mindspore.parallel._utils._to_full_tensor, tests/unit/train/test_sharded_step.py)
    dp4 = ParallelConfig(dp=4, tp=1, pp=2, micro_batches=4)
    assert [data_coordinates(r, dp4, 3)[0] for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert data_coordinates(5, dp4, 3) == (1, 4, 3)
    full = ParallelConfig(dp=2, tp=2, dataset_strategy="full_batch")
    assert data_coordinates(3, full, 3) == (0, 1, 6)

    step = tmp_path / "checkpoints" / "step_00000010"
    for name in ("config.json", "state.json", "recipe.yaml"):
        (step / name).parent.mkdir(parents=True, exist_ok=True)
        (step / name).write_text("{}")
    (step / LAYOUT_FILE).write_text(json.dumps({"world_size": 2, "layout": par.describe()}))
    for r in range(2):
        rank_dir(step, r).mkdir()
        (rank_dir(step, r) / "model.safetensors").write_bytes(b"x")
    assert not is_complete(step)  # optimizer slices missing
    for r in range(2):
        (rank_dir(step, r) / "optimizer.safetensors").write_bytes(b"x")
    assert is_complete(step)
    assert CheckpointManager(tmp_path / "checkpoints").latest() == step


ATLAS = ATLAS_RECIPES


@pytest.mark.parametrize("recipe", ATLAS, ids=lambda p: p.stem)
def test_dry_run_of_an_atlas_recipe_needs_neither_checkpoint_nor_data(recipe, tmp_path, monkeypatch):
    """On a login node: schema and planner only (as plan --recipe), the command printed, and a line for
    each machine check it could not make; a real launch still refuses the missing inputs."""
    from ms_deepseek.config.recipe import load_recipe, planning_config_path

    monkeypatch.chdir(tmp_path)
    world = load_recipe(recipe, (), planning_config_path(recipe)).parallel.world_size
    nodes = "2" if world >= 16 else "1"  # one-node recipes (8 NPUs or fewer) run on one node
    argv = ["launch", str(recipe), "--dry-run", "--nnodes", nodes, "--master-addr", "10.0.0.1"]
    code, out, err = run_cli(argv)
    assert code == 0, err
    lines = out.splitlines()
    assert "msrun" in lines[0] and "--node_rank=0" in lines[0]
    skipped = [line for line in lines if line.startswith("# not checked on this machine")]
    assert skipped and any("data.path" in line or "lora:" in line for line in skipped)
    code, out, err = run_cli(["launch", str(recipe), "--nnodes", nodes, "--master-addr", "10.0.0.1"])
    assert code == 2 and out == "" and ("model.source" in err or "data.path" in err)


def test_a_recipe_the_planner_says_does_not_fit_is_refused_then_goes_on_with_force(tmp_path, monkeypatch):
    """An Atlas recipe on a smaller HBM than it needs (parallel.hbm_gb 16): launch --dry-run refuses it in one
    line naming --force, and goes on with it."""
    import yaml

    data = yaml.safe_load((ATLAS[0].parent / "v2-lite-sft-8npu.yaml").read_text())
    data["parallel"]["hbm_gb"] = 16.0
    data["model"]["source"] = "deepseek-v2-lite"  # the architecture preset: no checkpoint folder here
    recipe = tmp_path / "v2-lite-sft-8npu-16gb.yaml"
    recipe.write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path)
    argv = ["launch", str(recipe), "--dry-run", "--nnodes", "1", "--master-addr", "10.0.0.1"]
    code, out, err = run_cli(argv)
    assert code == 2 and out == "" and "does not fit" in err and "--force" in err, err
    code, out, err = run_cli(argv + ["--force"])
    assert code == 0 and "msrun" in out.splitlines()[0], err


FAKE_NODE_MSRUN = r'''
import os, subprocess, sys, time
# a stand-in for msrun on one node: this node's workers (RANK_ID as msrun numbers them) beat once, then wait
# for RUN/stop and exit 0
flags = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
run = sys.argv[sys.argv.index("--output") + 1]
local, node = int(flags["local_worker_num"]), int(flags.get("node_rank", 0))
worker = """
import sys, time
from pathlib import Path
from ms_deepseek.jobs.preempt import Heartbeat
Heartbeat(sys.argv[1], int(sys.argv[2])).beat(5, 5)
while not (Path(sys.argv[1]) / "stop").exists():
    time.sleep(0.05)
"""
procs = [subprocess.Popen([sys.executable, "-c", worker, run, str(node * local + i)],
                          env=dict(os.environ, MS_ROLE="MS_WORKER", RANK_ID=str(node * local + i)))
         for i in range(local)]
sys.exit(max(p.wait() for p in procs))
'''


def test_a_late_node_keeps_the_heartbeats_of_the_nodes_already_running(tmp_path):
    """Two `launch --nnodes 2` into one run folder (a cluster's shared file system), the second started once the
    first one's worker is running: the late node clears only its own entries (it used to remove RUN/.heartbeat,
    the running node's progress with it, which blinds that node's watchdog)."""
    import os
    import subprocess
    import time

    from repo_paths import REPO

    recipe = write(tmp_path, recipe_data(dp=2))
    fake, run = tmp_path / "fake_msrun.py", tmp_path / "run"
    fake.write_text(FAKE_NODE_MSRUN)
    starter = (
        f"import sys; import ms_deepseek.cli.launch as launch; launch.msrun_executable = lambda: "
        f"[sys.executable, {str(fake)!r}]; from ms_deepseek.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def node(rank):
        return subprocess.Popen(
            [
                sys.executable,
                "-c",
                starter,
                "launch",
                str(recipe),
                "--output",
                str(run),
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--master-port",
                str(free_port()),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    beats, procs = run / ".heartbeat", []
    try:
        procs.append(node(0))
        while not (beats / "rank_0").exists() and procs[0].poll() is None:
            time.sleep(0.05)
        procs.append(node(1))
        while not (beats / "rank_1").exists() and procs[1].poll() is None:
            time.sleep(0.05)
        assert (beats / "rank_0").read_text().split()[:2] == ["5", "5"], "node 1 removed node 0's heartbeat"
    finally:
        (run / "stop").parent.mkdir(parents=True, exist_ok=True)
        (run / "stop").write_text("")
        outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
