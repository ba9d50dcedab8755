"""The rename fallback of the atomic writer (file systems without RENAME_EXCHANGE, e.g. NFS): a writer
killed between its two renames leaves `.old-` and `.partial-` copies and no destination; the next start's
cleanup puts the complete one back instead of deleting both."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from repo_paths import REPO

# a writer without RENAME_EXCHANGE that dies (os._exit: no cleanup runs) when it renames the new folder in
_CRASHING_WRITER = """
import os, sys
from pathlib import Path
import ms_deepseek.core.atomic as atomic
atomic._exchange = lambda a, b: False
dst = Path(sys.argv[1])
with atomic.atomic_folder(dst) as tmp:
    (tmp / "state.json").write_text("old")
real_rename = os.rename
def rename(src, to):
    if atomic.PARTIAL in os.fspath(src):
        os._exit(9)
    real_rename(src, to)
os.rename = rename
with atomic.atomic_folder(dst) as tmp:
    (tmp / "state.json").write_text("new")
"""


def _crash(dst: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", _CRASHING_WRITER, str(dst)], env=env, capture_output=True)
    assert proc.returncode == 9, proc.stderr.decode()
    left = sorted(p.name.split("-")[0] for p in dst.parent.iterdir())
    assert not dst.exists() and left == [f".{dst.name}.old", f".{dst.name}.partial"], left  # what the crash leaves


@pytest.mark.parametrize("cleanup", ["run_start", "next_save"])
def test_an_interrupted_swap_is_restored_with_the_new_copy(tmp_path, cleanup):
    from ms_deepseek.checkpoint.training import CheckpointManager
    from ms_deepseek.core.atomic import temporary_sibling

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    dst = folder / "step_00000002"
    _crash(dst)
    if cleanup == "run_start":
        CheckpointManager(folder).remove_partial()  # what the trainer runs when it starts
    else:
        temporary_sibling(dst)  # what the next writer of the same folder runs first
    assert (dst / "state.json").read_text() == "new"
    assert [p.name for p in folder.iterdir()] == [dst.name]


def test_the_old_copy_comes_back_when_the_new_one_is_gone(tmp_path):
    from ms_deepseek.core.atomic import restore_interrupted

    dst = tmp_path / "out"
    _crash(dst)
    for p in tmp_path.iterdir():
        if ".partial-" in p.name:
            import shutil

            shutil.rmtree(p)
    assert restore_interrupted(tmp_path) == [dst]
    assert (dst / "state.json").read_text() == "old"
