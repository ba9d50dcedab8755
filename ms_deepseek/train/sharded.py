"""Sharded layouts (tp / pp / ep / optimizer sharding) for the trainer: Ascend only.

MindSpore compiles SEMI/AUTO parallel graphs only on Ascend, so nothing here runs on
a CPU host; the pure functions (data coordinates, pipeline stage, checkpoint layout)
are unit-tested here, the rest runs under msrun on Atlas 800T A2.

* The step Cell is wrapped in ``AutoParallel`` (:func:`ms_deepseek.parallel.apply.auto_parallel_wrap`):
  the plan's strategies (set by ``apply_plan``) plus sharding propagation, the 1F1B
  pipeline, optimizer sharding; MindSpore inserts the gradient reduction.
* Devices: world = pp stages x (dp x tp) devices per stage, tp fastest, so rank r sits in
  stage ``r // (dp * tp)`` and data-parallel replica ``(r % (dp * tp)) // tp``; with
  ``dataset_strategy: data_parallel`` each replica reads its own shard, with
  ``full_batch`` every device reads the whole global batch.
* Checkpoints: every rank writes its own parameter slices into
  ``step_N/rank_RRRRR/{model,optimizer}.safetensors`` plus its strategy file; rank 0
  writes ``shards.json``, ``config.json``, ``state.json``, ``recipe.yaml`` and renames the
  folder into place after a barrier. The ranks need one shared file system (as the
  msrun log folder does). Merge the slices into one HF-layout folder with MindSpore's
  ``unified_safetensors`` and the strategy files before ``convert ms-to-hf``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Dict

from ms_deepseek.errors import UserError
from ms_deepseek.parallel.config import ParallelConfig
# The rank geometry lives in ms_deepseek.parallel.ranks (re-exported for older imports).
from ms_deepseek.parallel.ranks import data_coordinates, stage_of_rank  # noqa: F401

SHARDS_FILE = "shards.json"


def rank_dir(step_dir: Path, rank: int) -> Path:
    return step_dir / f"rank_{rank:05d}"


def is_complete_sharded(folder: Path) -> bool:
    try:
        world = int(json.loads((folder / SHARDS_FILE).read_text())["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return all((rank_dir(folder, r) / f).is_file() for r in range(world)
               for f in ("model.safetensors", "optimizer.safetensors"))


def barrier() -> None:
    """All ranks meet here (an AllReduce of one number)."""
    import mindspore as ms
    from mindspore import ops

    ops.AllReduce()(ms.Tensor([1.0], ms.float32)).asnumpy()


def save_sharded(manager, step: int, rank: int, world: int, model_tensors: Dict, optimizer_tensors: Dict,
                 config, state: Dict, recipe_yaml: str, strategy_file: Path, par: ParallelConfig) -> Path:
    """Every rank writes its slices; rank 0 completes the folder and renames it into place."""
    from ms_deepseek.train import checkpoint as ckpt_mod

    folder = manager.folder
    final = folder / ckpt_mod.step_dir_name(step)
    tmp = folder / f"{ckpt_mod.TMP_PREFIX}{ckpt_mod.step_dir_name(step)}_sharded"
    mine = rank_dir(tmp, rank)
    if mine.exists():
        shutil.rmtree(mine)
    mine.mkdir(parents=True)
    ckpt_mod._save_tensors(model_tensors, mine / "model.safetensors")
    ckpt_mod._save_tensors(optimizer_tensors, mine / "optimizer.safetensors")
    if strategy_file.is_file():
        shutil.copy2(strategy_file, mine / "strategy.ckpt")
    barrier()  # every slice is on disk
    if rank == 0:
        config.save(tmp / "config.json", dtype=config.param_dtype)
        (tmp / "recipe.yaml").write_text(recipe_yaml, encoding="utf-8")
        (tmp / SHARDS_FILE).write_text(json.dumps({"world_size": world, "layout": par.describe()}) + "\n")
        (tmp / "state.json").write_text(json.dumps(state, indent=1) + "\n", encoding="utf-8")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        manager.prune()
    barrier()  # nobody starts the next save before the rename
    return final


def load_sharded(step_dir: Path, rank: int, world: int, model_tensors: Dict, optimizer_tensors: Dict) -> None:
    """Load this rank's slices (after the step Cell is compiled, so the parameters are sliced)."""
    from ms_deepseek.train.step_io import load_into

    saved = json.loads((step_dir / SHARDS_FILE).read_text())
    if int(saved["world_size"]) != world:
        raise UserError(f"--resume {step_dir}: saved by {saved['world_size']} ranks ({saved['layout']}), now {world}; "
                        "reshard it first (MindSpore transform_checkpoints with the strategy files)")
    mine = rank_dir(step_dir, rank)
    load_into(model_tensors, mine / "model.safetensors", "model")
    load_into(optimizer_tensors, mine / "optimizer.safetensors", "optimizer")
