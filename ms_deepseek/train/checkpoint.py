"""Training checkpoints: ``RUN_DIR/checkpoints/step_{N:08d}/``, written whole or not at all.

A checkpoint folder holds

* ``model.safetensors``      the model's parameters under its own names (the HF names,
                              routed experts stacked [E, out, in]); loadable with
                              ``DeepseekV2ForCausalLM.from_pretrained`` and convertible
                              with ``ms-deepseek convert ms-to-hf``;
* ``optimizer.safetensors``  ``global_step``, ``adam_m.<name>``, ``adam_v.<name>``, and
                              the loss-scale state;
* ``config.json``            the model config (HF release format);
* ``state.json``             step, data position, RNG states, tokens seen, elapsed time;
* ``recipe.yaml``            the recipe as trained (after ``--set`` overrides).

Everything is written into a hidden temporary sibling (``.tmp_step_...``) that is
renamed into place at the end: a crash mid-save leaves the previous checkpoints intact
and no ``step_*`` folder that is incomplete. Leftover temporary folders are removed
when the next run starts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import mindspore as ms

from ms_deepseek.errors import UserError

STEP_DIR = re.compile(r"^step_(\d{8})$")
REQUIRED_FILES = ("model.safetensors", "optimizer.safetensors", "config.json", "state.json", "recipe.yaml")
TMP_PREFIX = ".tmp_"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def is_complete(folder: Path) -> bool:
    """All files present: whole tensors, or every rank's slices of a sharded run (see .sharded)."""
    if not folder.is_dir():
        return False
    if all((folder / f).is_file() for f in REQUIRED_FILES):
        return True
    from ms_deepseek.train.sharded import is_complete_sharded

    return all((folder / f).is_file() for f in ("config.json", "state.json", "recipe.yaml")) and \
        is_complete_sharded(folder)


def _save_tensors(named: Dict[str, object], path: Path) -> None:
    ms.save_checkpoint([{"name": name, "data": value} for name, value in named.items()], str(path),
                       format="safetensors")
    if not path.is_file():  # MindSpore appends the suffix when it is missing; we always pass it
        raise RuntimeError(f"internal: save_checkpoint did not write {path}")


def load_tensors(path: Path) -> Dict[str, ms.Parameter]:
    try:
        return ms.load_checkpoint(str(path), format="safetensors")
    except Exception as exc:  # MindSpore raises assorted types for damaged files
        raise UserError(f"{path}: cannot read checkpoint tensors ({str(exc).splitlines()[0]})") from None


class CheckpointManager:
    """Saves, lists, prunes and finds the training checkpoints of one run."""

    def __init__(self, folder: Path, keep_last: int = 3):
        self.folder = Path(folder)
        self.keep_last = keep_last

    def complete(self) -> List[Tuple[int, Path]]:
        """(step, folder) of every complete checkpoint, oldest first."""
        if not self.folder.is_dir():
            return []
        out = []
        for child in self.folder.iterdir():
            match = STEP_DIR.match(child.name)
            if match and is_complete(child):
                out.append((int(match.group(1)), child))
        return sorted(out)

    def latest(self) -> Optional[Path]:
        done = self.complete()
        return done[-1][1] if done else None

    def remove_partial(self) -> List[Path]:
        """Delete temporary folders left by a save that crashed; return what was removed."""
        removed = []
        if self.folder.is_dir():
            for child in self.folder.iterdir():
                if child.name.startswith(TMP_PREFIX) and child.is_dir():
                    shutil.rmtree(child, ignore_errors=True)
                    removed.append(child)
        return removed

    def save(self, step: int, model_tensors: Dict[str, object], optimizer_tensors: Dict[str, object],
             config, state: Dict, recipe_yaml: str) -> Path:
        """Write one checkpoint atomically (temporary folder + rename), then prune to ``keep_last``."""
        self.folder.mkdir(parents=True, exist_ok=True)
        final = self.folder / step_dir_name(step)
        tmp = self.folder / f"{TMP_PREFIX}{step_dir_name(step)}_{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        _save_tensors(model_tensors, tmp / "model.safetensors")
        _save_tensors(optimizer_tensors, tmp / "optimizer.safetensors")
        config.save(tmp / "config.json", dtype=config.param_dtype)
        (tmp / "recipe.yaml").write_text(recipe_yaml, encoding="utf-8")
        # state.json last: its presence is part of what makes a folder complete
        (tmp / "state.json").write_text(json.dumps(state, indent=1) + "\n", encoding="utf-8")
        for f in tmp.iterdir():  # data on disk before the rename makes it visible
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if final.exists():  # re-saving a step (e.g. a resumed run): swap, never a moment without one
            old = self.folder / f"{TMP_PREFIX}old_{step_dir_name(step)}_{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        self.prune()
        return final

    def prune(self) -> None:
        done = self.complete()
        for _, folder in done[:-self.keep_last]:
            shutil.rmtree(folder, ignore_errors=True)


def resolve_resume(spec: str, run_dir: Path) -> Path:
    """``latest`` -> newest complete checkpoint of ``run_dir``; a path -> that checkpoint (or the newest inside)."""
    if spec == "latest":
        found = CheckpointManager(run_dir / "checkpoints").latest()
        if found is None:
            raise UserError(f"--resume: no complete checkpoint in {run_dir / 'checkpoints'}")
        return found
    path = Path(spec).expanduser()
    if not path.exists():
        raise UserError(f"--resume {spec}: no such folder")
    if STEP_DIR.match(path.name) or (path / "state.json").exists():
        if not is_complete(path):
            missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
            raise UserError(f"--resume {spec}: incomplete checkpoint (missing {', '.join(missing)})")
        return path
    found = latest_in(path)
    if found is None:
        raise UserError(f"--resume {spec}: no complete checkpoint (step_NNNNNNNN folder) in this folder")
    return found


def latest_in(folder: Path) -> Optional[Path]:
    """The newest complete checkpoint of a run folder (``folder/checkpoints``) or a checkpoints folder."""
    for candidate in (folder / "checkpoints", folder):
        found = CheckpointManager(candidate).latest()
        if found is not None:
            return found
    return None


def read_state(folder: Path) -> Dict:
    try:
        return json.loads((folder / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{folder / 'state.json'}: unreadable ({exc})") from None
