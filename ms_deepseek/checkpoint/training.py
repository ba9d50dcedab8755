"""Training checkpoints: ``RUN_DIR/checkpoints/step_{N:08d}/``, written whole or not at all.

A whole checkpoint folder (data-parallel and single-worker runs) holds

* ``model.safetensors``      the model's parameters under its own names (the HF names,
                              routed experts stacked [E, out, in], in expert order);
                              convertible with ``ms-deepseek convert ms-to-hf``;
* ``optimizer.safetensors``  ``global_step``, ``adam_m.<name>``, ``adam_v.<name>``, and
                              the loss-scale state;
* ``config.json``            the model config (HF release format);
* ``state.json``             step, data position, RNG states, tokens seen, elapsed time;
* ``recipe.yaml``            the recipe as trained (after ``--set`` overrides).

A sharded run's folder (tp / pp / ep / optimizer sharding, Ascend) holds instead one
``rank_RRRRR/{model,optimizer}.safetensors`` per rank with that rank's slices (plus
MindSpore's ``strategy.ckpt``), and ``layout.json`` (:mod:`.layout`) saying which slice
each rank holds; ``convert ms-to-hf`` merges it, ``convert reshard`` turns it into another
layout, ``train --resume`` reads whatever slices the new layout needs.

Every folder is written with :func:`ms_deepseek.core.atomic.atomic_folder`: a crash
mid-save leaves the previous checkpoints intact and no ``step_*`` folder that is
incomplete; leftover temporary folders are removed when the next run starts.
"""

from __future__ import annotations

import contextlib
import errno
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ms_deepseek.checkpoint.digests import FILES_KEY, file_entry, text_entry
from ms_deepseek.checkpoint.layout import LAYOUT_FILE, ShardLayout, is_sharded, rank_dir_name, read_layout
from ms_deepseek.checkpoint.tensors import save_tensors
from ms_deepseek.core.atomic import atomic_folder, atomic_write_text, fsync_tree, install, remove_partials
from ms_deepseek.core.errors import UserError
from ms_deepseek.core.safe_io import json_loads

STEP_DIR = re.compile(r"^step_(\d{8})$")
ABANDONED = ".abandoned-"  # step_N.abandoned-<UTC time>: a newer checkpoint set aside by a resume from an older one
DAMAGED = ".damaged-"  # step_N.damaged-<UTC time>: a checkpoint whose files differ from their digests, set aside
REQUIRED_FILES = ("model.safetensors", "optimizer.safetensors", "config.json", "state.json", "recipe.yaml")
RANK_FILES = ("model.safetensors", "optimizer.safetensors")
COMMON_FILES = ("config.json", "state.json", "recipe.yaml")


RANK_DIGESTS = "digests.json"  # rank_RRRRR/digests.json: a rank's file digests until rank 0 gathers them
LATEST = "latest"  # checkpoints/latest: the name of the newest complete save (one line)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rank_dir(step_dir: Path, rank: int) -> Path:
    return Path(step_dir) / rank_dir_name(rank)


def is_complete(folder: Path) -> bool:
    """All files present: whole tensors, or every rank's slices of a sharded run."""
    folder = Path(folder)
    if not folder.is_dir():
        return False
    if all((folder / f).is_file() for f in REQUIRED_FILES):
        return True
    if not all((folder / f).is_file() for f in COMMON_FILES):
        return False
    try:
        world = int(json_loads((folder / LAYOUT_FILE).read_text(), folder / LAYOUT_FILE)["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return all((rank_dir(folder, r) / f).is_file() for r in range(world) for f in RANK_FILES)


class CheckpointManager:
    """Saves, lists, prunes and finds the training checkpoints of one run."""

    def __init__(self, folder: Path, keep_last: int = 3, protected: Optional[Path] = None):
        self.folder = Path(folder)
        self.keep_last = keep_last
        self.protected = protected  # the checkpoint this run resumed from: never pruned

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
        """The checkpoint ``checkpoints/latest`` names when it is complete, else the newest complete one."""
        try:
            name = (self.folder / LATEST).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            name = ""
        if STEP_DIR.match(name) and is_complete(self.folder / name):
            return self.folder / name
        done = self.complete()  # no pointer, or a stale one (its folder pruned, set aside or incomplete)
        return done[-1][1] if done else None

    def point_latest(self, final: Path) -> None:
        """After a complete save: ``checkpoints/latest`` names it (written atomically)."""
        atomic_write_text(self.folder / LATEST, final.name + "\n")

    def remove_partial(self) -> List[Path]:
        """Delete temporary folders left by a save that crashed; return what was removed."""
        return remove_partials(self.folder)

    def save(
        self,
        step: int,
        model_tensors: Dict[str, object],
        optimizer_tensors: Dict[str, object],
        config,
        state: Dict,
        recipe_yaml: str,
    ) -> Path:
        """Write one whole checkpoint atomically, then prune to ``keep_last``."""
        final = self.folder / step_dir_name(step)
        need = checkpoint_bytes(model_tensors, optimizer_tensors)
        with disk_full_as_one_line(self, final, need):
            with atomic_folder(final) as tmp:
                files = {
                    "model.safetensors": save_tensors(model_tensors, tmp / "model.safetensors"),
                    "optimizer.safetensors": save_tensors(optimizer_tensors, tmp / "optimizer.safetensors"),
                }
                _common_files(tmp, config, state, recipe_yaml, files)
        self.point_latest(final)
        self.prune()
        return final

    def prune(self) -> None:
        keep = self.protected and Path(self.protected).resolve()
        done = [(s, f) for s, f in self.complete() if f.resolve() != keep]
        for _, folder in done[: -self.keep_last]:
            shutil.rmtree(folder, ignore_errors=True)

    def newer_than(self, step: int, resumed: Optional[Path] = None) -> List[Path]:
        """Complete checkpoints past ``step`` (a resume from an older one would leave them to win later)."""
        skip = resumed and Path(resumed).resolve()
        return [f for s, f in self.complete() if s > step and f.resolve() != skip]

    def set_aside(self, folders: List[Path], suffix: str = ABANDONED) -> List[Path]:
        """Rename ``folders`` to ``step_N<suffix><UTC time>`` (``.abandoned-``, ``.damaged-``): kept, but no
        longer a checkpoint to resume."""
        import time

        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        out = []
        for folder in folders:
            target = folder.with_name(f"{folder.name}{suffix}{stamp}")
            folder.rename(target)
            out.append(target)
        return out


# ------------------------------------------------------------------------------------------ disk space
_SMALL_FILES_BYTES = 256 * 1024  # config.json, recipe.yaml, state.json (RNG states included): below this


def checkpoint_bytes(*groups: Dict[str, object]) -> int:
    """The bytes the tensor files of ``groups`` ({name: tensor or array}) take on disk, plus the small files."""
    from ms_deepseek.checkpoint.safetensors_io import DTYPE_SIZES, numel
    from ms_deepseek.checkpoint.tensors import host_entry

    total = _SMALL_FILES_BYTES
    for named in groups:
        for name, value in named.items():
            _, code, shape = host_entry(value)
            total += numel(shape) * DTYPE_SIZES[code] + 128 + len(name)  # data + its header entry
    return total


def free_bytes(folder: Path) -> int:
    """Free bytes for an unprivileged writer on the file system of ``folder`` (or its nearest existing parent)."""
    folder = Path(folder).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def gigabytes(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 10**9 else f"{n / 1e6:.1f} MB"


def disk_full_line(manager: "CheckpointManager", final: Path, need: int, rank: Optional[int] = None) -> str:
    """One line for a checkpoint that does not fit: which, the bytes it needs and those free, the last complete
    checkpoint and how to continue."""
    last = manager.latest()
    then = (
        f"the last complete checkpoint is {last}; free space, then continue with the same command and --resume"
        if last is not None
        else "no complete checkpoint yet; free space and start the run again"
    )
    who = f" (rank {rank}'s slices)" if rank is not None else ""
    return (
        f"checkpoint {final}: no space left on the device: it needs {gigabytes(need)}{who}, "
        f"{manager.folder} has {gigabytes(free_bytes(manager.folder))} free; {then}"
    )


@contextlib.contextmanager
def disk_full_as_one_line(manager: "CheckpointManager", final: Path, need: int, rank: Optional[int] = None):
    """Refuse a save that the free space cannot hold before writing it, and turn a full disk (ENOSPC, a
    quota) met while writing into the same one line (the partial folder is gone by then: atomic_folder)."""
    if need > free_bytes(manager.folder):
        raise UserError(disk_full_line(manager, final, need, rank))
    try:
        yield
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise UserError(disk_full_line(manager, final, need, rank)) from None


def _common_files(tmp: Path, config, state: Dict, recipe_yaml: str, files: Dict[str, Dict]) -> None:
    """config.json, recipe.yaml and state.json, which records the digest of every other file (``files``:
    the tensor files' entries, taken as they were written; :mod:`.digests`)."""
    config.save(tmp / "config.json", dtype=config.param_dtype)
    (tmp / "recipe.yaml").write_text(recipe_yaml, encoding="utf-8")
    files = dict(files, **{"config.json": file_entry(tmp / "config.json"), "recipe.yaml": text_entry(recipe_yaml)})
    state = dict(state, **{FILES_KEY: dict(sorted(files.items()))})
    # state.json last: its presence is part of what makes a folder complete
    (tmp / "state.json").write_text(json.dumps(state, indent=1) + "\n", encoding="utf-8")


def barrier() -> None:
    """All ranks meet here (an AllReduce of one number)."""
    import mindspore as ms
    from mindspore import ops

    ops.AllReduce()(ms.Tensor([1.0], ms.float32)).asnumpy()


@dataclass(frozen=True)
class RankCheckpoint:
    """What one rank puts in a sharded checkpoint: its model and optimizer slices, and the files rank 0 writes for
    all (the model config, the run state, the recipe) with the rank's compiled strategy beside its slices."""

    model_tensors: Dict
    optimizer_tensors: Dict
    config: object
    state: Dict
    recipe_yaml: str
    strategy_file: Path


def save_sharded(manager: CheckpointManager, step: int, rank: int, layout: ShardLayout, ckpt: RankCheckpoint) -> Path:
    """Every rank writes its slices into a shared temporary folder; rank 0 completes it and swaps it in.

    The ranks need one shared file system (as the msrun log folder does); the temporary folder's
    name is the step's, so every rank finds it without a broadcast."""
    model_tensors, optimizer_tensors, strategy_file = ckpt.model_tensors, ckpt.optimizer_tensors, ckpt.strategy_file
    folder = manager.folder
    final = folder / step_dir_name(step)
    tmp = folder / f".{final.name}.partial-sharded"
    mine = rank_dir(tmp, rank)
    if mine.exists():
        shutil.rmtree(mine)
    with disk_full_as_one_line(manager, final, checkpoint_bytes(model_tensors, optimizer_tensors), rank):
        mine.mkdir(parents=True)
        files = {
            "model.safetensors": save_tensors(model_tensors, mine / "model.safetensors"),
            "optimizer.safetensors": save_tensors(optimizer_tensors, mine / "optimizer.safetensors"),
        }
    if strategy_file.is_file():
        shutil.copy2(strategy_file, mine / "strategy.ckpt")
        files["strategy.ckpt"] = file_entry(mine / "strategy.ckpt")
    # this rank's digests, for rank 0 to gather into state.json (the folders are on one shared file system)
    (mine / RANK_DIGESTS).write_text(json.dumps(files), encoding="utf-8")
    fsync_tree(mine)
    barrier()  # every slice is on disk
    if rank == 0:
        layout.write(tmp / LAYOUT_FILE)
        _common_files(tmp, ckpt.config, ckpt.state, ckpt.recipe_yaml, _gather_rank_digests(tmp, layout.world_size))
        fsync_tree(tmp)
        install(tmp, final)
        manager.point_latest(final)
        manager.prune()
    barrier()  # nobody starts the next save before the swap
    return final


def _gather_rank_digests(tmp: Path, world: int) -> Dict[str, Dict]:
    """Every rank's digests (``rank_RRRRR/digests.json``, removed once read) under their relative paths. After
    the barrier every rank has written its own; a rank folder without one (a test emulating ranks one at a
    time) records nothing, and its files are read unchecked."""
    files: Dict[str, Dict] = {}
    for r in range(world):
        path = rank_dir(tmp, r) / RANK_DIGESTS
        if not path.is_file():
            continue
        for name, value in json_loads(path.read_text(encoding="utf-8"), path).items():
            files[f"{rank_dir_name(r)}/{name}"] = value
        path.unlink()
    return files


RESUME, GENERATE, EXPORT = "resume", "generate", "export"  # the uses of resolve_checkpoint


def resolve_checkpoint(spec, use: str, run_dir: Optional[Path] = None) -> Path:
    """Which checkpoint a path means (the one resolver): the folder itself when it is one, else the newest
    complete checkpoint inside it (a run folder or its ``checkpoints/``). ``use`` decides what counts as a
    checkpoint and how a refusal is worded:

    * ``RESUME`` (``train --resume``): ``latest`` is ``run_dir``'s newest; a ``step_N`` / state.json folder
      must be complete;
    * ``GENERATE`` (``generate``): any folder with config.json (an HF folder too);
    * ``EXPORT`` (``export-lora``): a training checkpoint (state.json) with its model tensors, whole or
      sharded; a run folder means its newest."""
    if use == RESUME and spec == "latest":
        if not Path(run_dir).exists():
            raise UserError(
                f"--resume: the run folder {run_dir} does not exist, so there is nothing to resume "
                "(name the run with --output RUN_DIR, or leave out --resume to start it)"
            )
        found = CheckpointManager(Path(run_dir) / "checkpoints").latest()
        if found is None:
            raise UserError(f"--resume: no complete checkpoint in {Path(run_dir) / 'checkpoints'}")
        return found
    path = Path(spec) if use == EXPORT else Path(spec).expanduser()
    _check_exists(path, spec, use)
    if use == RESUME:
        if STEP_DIR.match(path.name) or (path / "state.json").exists():
            _check_complete(path, spec)
            return path
        found = latest_in(path)
        if found is None:
            raise UserError(f"--resume {spec}: no complete checkpoint (step_NNNNNNNN folder) in this folder")
        return found
    if use == GENERATE:
        found = path if (path / "config.json").is_file() else latest_in(path)
        if found is None:
            raise UserError(
                f"{path}: not a checkpoint (no config.json) and no complete step_NNNNNNNN checkpoint inside"
            )
        return found
    found = (
        path
        if (path / "state.json").is_file()
        else (latest_in(path / "checkpoints") if (path / "checkpoints").is_dir() else None)
    )
    if found is not None and is_sharded(found):
        return found  # a tp / pp / ep run's rank_*/ slices, put together by the reader
    if found is None or not (found / "model.safetensors").is_file():
        raise UserError(
            f"{path}: neither a checkpoint (state.json + model.safetensors) nor a run folder with complete checkpoints"
        )
    return found


def _check_exists(path: Path, spec, use: str) -> None:
    if use == RESUME and not path.exists():
        raise UserError(f"--resume {spec}: no such folder")
    if use == GENERATE and not path.exists():
        raise UserError(f"{path}: no such checkpoint folder")
    if use == GENERATE and not path.is_dir():
        raise UserError(f"{path}: not a folder (expected a checkpoint folder holding config.json, or a run folder)")
    if use == EXPORT and not path.is_dir():
        raise UserError(f"{path}: no such run or checkpoint folder")


def _check_complete(path: Path, spec) -> None:
    """A resume's named checkpoint has every file (a malformed sharded layout names itself)."""
    if is_complete(path):
        return
    if is_sharded(path):
        read_layout(path)  # a malformed layout file names itself
        raise UserError(f"--resume {spec}: incomplete sharded checkpoint (a rank folder or file is missing)")
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    raise UserError(f"--resume {spec}: incomplete checkpoint (missing {', '.join(missing)})")


def resume_parent(spec: str, run_dir: Path) -> Path:
    """The folder a ``--resume`` spec looks for step_N checkpoints in (without resolving which one)."""
    if spec in ("latest", "auto"):
        return Path(run_dir) / "checkpoints"
    path = Path(spec).expanduser()
    if STEP_DIR.match(path.name) or (path / "state.json").exists():
        return path.parent
    return path / "checkpoints" if (path / "checkpoints").is_dir() else path


def latest_in(folder: Path) -> Optional[Path]:
    """The newest complete checkpoint of a run folder (``folder/checkpoints``) or a checkpoints folder."""
    for candidate in (Path(folder) / "checkpoints", Path(folder)):
        found = CheckpointManager(candidate).latest()
        if found is not None:
            return found
    return None


def read_state(folder: Path) -> Dict:
    try:
        return json_loads((Path(folder) / "state.json").read_text(encoding="utf-8"), Path(folder) / "state.json")
    except (OSError, ValueError) as exc:
        raise UserError(f"{Path(folder) / 'state.json'}: unreadable ({exc})") from None


def read_recipe(folder: Path, missing_ok: bool = False) -> Dict:
    """The recipe a checkpoint was trained with (``folder/recipe.yaml``, a mapping; with ``missing_ok``
    {} when there is none)."""
    import yaml

    from ms_deepseek.core.safe_io import yaml_load

    path = Path(folder) / "recipe.yaml"
    if missing_ok and not path.exists():
        return {}
    try:
        recipe = yaml_load(path.read_text(encoding="utf-8"), path) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise UserError(f"{path}: cannot read the checkpoint's recipe ({exc})") from None
    if not isinstance(recipe, dict):
        raise UserError(f"{path}: not a recipe (expected a YAML mapping of sections)")
    return recipe
