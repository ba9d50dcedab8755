"""A 2-worker data-parallel run (msrun on CPU) saved, resharded to 1 worker and resumed continues with the
same losses as the 2-worker run (to 1e-6); resuming it on 1 worker without the reshard command (read on the
fly) does too."""

import json

import numpy as np
import pytest

from builders import free_port
from builders import main_captured as run_cli
from builders import small_recipe as recipe_data
from builders import write_recipe as write


def losses(run):
    return {
        json.loads(line)["step"]: json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
    }


def launch(recipe, out, *extra):
    code, stdout, err = run_cli(
        [
            "launch",
            str(recipe),
            "--output",
            str(out),
            "--master-port",
            str(free_port()),
            "--cluster-time-out",
            "120",
            *extra,
        ]
    )
    logs = "\n".join(p.read_text(errors="replace")[-2000:] for p in (out / "msrun_logs").glob("worker_*.log"))
    assert code == 0, f"{err}\n{logs}"


@pytest.mark.msrun
def test_two_workers_resharded_to_one_continue_with_the_same_losses(tmp_path):
    from ms_deepseek.data.prepare import prepare_embedded_default

    data = tmp_path / "corpus"
    prepare_embedded_default(data, seq_len=32, vocab_size=512, max_bytes=100_000, progress=False)
    base = recipe_data(data, dp=2)
    base["train"]["steps"] = 4
    base["checkpoint"] = {"save_interval": 2, "keep_last": 3}
    recipe = write(tmp_path, base)
    dp_dir = tmp_path / "dp2"
    # 2 workers, 4 steps, saving at step 2: its steps 3-4 are what resuming step 2 without resharding
    # gives (a resume continues bit-identically: test_train's crash-and-resume test)
    launch(recipe, dp_dir)
    saved = dp_dir / "checkpoints" / "step_00000002"
    assert json.loads((saved / "state.json").read_text())["world_size"] == 2
    want = losses(dp_dir)

    # reshard to 1 worker, resume with the same global batch (1 x 4 instead of 2 x 2)
    code, out, err = run_cli(["convert", "reshard", str(saved), str(tmp_path / "one"), "--dp", "1"])
    assert code == 0, err
    assert "whole checkpoint" in out
    one_worker = ["--set", "parallel.dp=1", "--set", "train.micro_batch_size=4"]
    for name, source in (("resharded", tmp_path / "one"), ("on_the_fly", saved)):
        run = tmp_path / name
        code, _, err = run_cli(
            ["train", str(recipe), "--output", str(run), "--quiet", "--resume", str(source), *one_worker]
        )
        assert code == 0, err
        got = losses(run)
        assert sorted(got) == [3, 4], name
        np.testing.assert_allclose([got[s] for s in (3, 4)], [want[s] for s in (3, 4)], rtol=1e-6, atol=0, err_msg=name)
