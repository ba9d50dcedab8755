"""checkpoints/latest: written atomically after each complete save; ``latest()`` (what ``--resume auto`` and
``--resume latest`` use) reads it, and scans the folder when it is absent or names no complete checkpoint."""

import shutil

import numpy as np

from builders import small_config


def _save(manager, step):
    import mindspore as ms

    tensors = {"w": ms.Parameter(ms.Tensor(np.full((2, 2), step, np.float32)), name="w")}
    return manager.save(step, tensors, dict(tensors), small_config(), {"step": step}, "train: {}\n")


def test_the_pointer_names_each_complete_save_and_resume_falls_back_to_scanning(tmp_path):
    from ms_deepseek.checkpoint.training import RESUME, CheckpointManager, resolve_checkpoint

    run = tmp_path / "run"
    manager = CheckpointManager(run / "checkpoints", keep_last=3)
    for step in (2, 4, 6):
        _save(manager, step)
        assert (run / "checkpoints" / "latest").read_text() == f"step_{step:08d}\n"
    assert not [p for p in (run / "checkpoints").iterdir() if ".partial-" in p.name]  # no temporary left
    (run / "checkpoints" / "latest").write_text("step_00000004\n")  # the pointer wins over the scan
    assert resolve_checkpoint("latest", RESUME, run).name == "step_00000004"
    shutil.rmtree(run / "checkpoints" / "step_00000004")  # stale: its folder is gone
    assert resolve_checkpoint("latest", RESUME, run).name == "step_00000006"
    (run / "checkpoints" / "latest").write_text("../../etc\n")  # not a checkpoint name: scanned
    assert manager.latest().name == "step_00000006"
    (run / "checkpoints" / "latest").unlink()  # absent (a run from before the pointer)
    assert manager.latest().name == "step_00000006"
