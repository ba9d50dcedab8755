"""Checkpoints across layouts: per-rank loading, pre-sharded conversion, merge to HF, resharding.

All four are one operation, "read the slice a target wants from whatever the source is"
(:mod:`~ms_deepseek.checkpoint.slice_readers`), applied per tensor and streamed:

* :func:`load_rank` -- the slices one rank holds under a layout, read straight from an HF or
  ms_deepseek folder, a whole training checkpoint or a sharded one (peak host memory: the
  rank's slices plus one tensor's pages);
* :func:`write_sharded` -- ``DST/rank_RRRRR/model.safetensors`` (and ``optimizer.safetensors``)
  for every rank plus ``layout.json`` (``convert hf-to-ms --recipe``, ``convert reshard``); each
  distinct slice is stored once, by the lowest rank holding it (layout.json version 2, ``"slices":
  "distinct"``), and the data-parallel replicas read it from there through :class:`~ms_deepseek.checkpoint.slice_readers.ShardedSource`;
* :func:`merge_to_hf` -- one HF folder from a sharded checkpoint, byte-identical to
  ``convert ms-to-hf`` of the equivalent whole checkpoint (same plan, same header bytes);
* :func:`write_whole` -- a sharded training checkpoint back to a whole one (``reshard`` to a
  data-parallel layout).

A LoRA run's checkpoint (adapters and trained routers only, ``lora`` in its layout file or
its recipe.yaml) reshards the same way; it has no HF form of its own (``export-lora``).

Destinations are written with :func:`ms_deepseek.core.atomic.atomic_folder`: nothing
is left at the destination on failure.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from ms_deepseek.checkpoint import digests
from ms_deepseek.checkpoint.layout import LAYOUT_FILE, ShardLayout, build_layout, checkpoint_inventory, rank_dir_name
from ms_deepseek.checkpoint.opener import OPTIMIZER_FILE, lora_not_a_model, open_checkpoint
from ms_deepseek.checkpoint.safetensors_io import OutTensor, order_for_alignment, write_file
from ms_deepseek.checkpoint.slice_readers import ShardedSource, full_slice
from ms_deepseek.config import names
from ms_deepseek.config.lora import LoraSpec
from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.core.atomic import atomic_folder, check_destination
from ms_deepseek.parallel_plan.validate import validate_layout

TRAINING_FILES = ("state.json", "recipe.yaml")  # carried along by reshard


# ----------------------------------------------------------------------------- layouts
def target_layout(cfg, parallel, src, lora: Optional[LoraSpec] = None) -> ShardLayout:
    """The layout for ``parallel``, with each tensor's dtype as the source stores it (a LoRA
    checkpoint's, ``lora``: the layout of its adapters)."""
    validate_layout(parallel, cfg)
    return build_layout(
        cfg, parallel, dtypes={i.name: src.dtype(i.name) for i in checkpoint_inventory(cfg, lora)}, lora=lora
    )


# ----------------------------------------------------------------------------- per-rank loading
def load_rank(src, layout: ShardLayout, rank: int, names_: Optional[List[str]] = None) -> Dict[str, np.ndarray]:
    """name -> raw slice (safetensors dtype bits) of every tensor ``rank`` holds under ``layout``."""
    out: Dict[str, np.ndarray] = {}
    for name in names_ if names_ is not None else layout.tensors_of_rank(rank):
        out[name] = src.read(name, layout.slice_of(name, rank))
    return out


def check_loader_slices(cfg, parallel, seed: int = 0) -> float:
    """``plan --simulate`` check: each rank's loader slices, put together, are the full tensors.

    Writes a random HF-layout checkpoint of ``cfg`` (float32) to a temporary folder, loads every
    virtual rank's slices with :func:`load_rank` straight from it and rebuilds every tensor
    from them; returns the max abs difference (0.0 when every value is where the plan says).
    """
    import tempfile

    from ms_deepseek.checkpoint.convert.synthetic import write_random_checkpoint

    with tempfile.TemporaryDirectory(prefix="ms_deepseek_loader_") as tmp:
        write_random_checkpoint(Path(tmp) / "hf", cfg, dtype="float32", layout="hf", seed=seed)
        src = open_checkpoint(Path(tmp) / "hf").model
        layout = target_layout(cfg, parallel, src)
        rebuilt = {n: np.full(t.shape, np.nan, np.float32) for n, t in layout.tensors.items()}
        for rank in range(layout.world_size):
            for name, value in load_rank(src, layout, rank).items():
                _place(rebuilt[name], layout.slice_of(name, rank), value.view(np.float32))
        err = 0.0
        for name, t in layout.tensors.items():
            full = src.read(name, full_slice(t.shape, t.experts is not None)).view(np.float32)
            diff = np.abs(rebuilt[name] - full)
            err = max(err, float(np.nanmax(diff)) if diff.size else 0.0)
            if np.isnan(rebuilt[name]).any():
                return float("inf")  # a part no rank holds
        return err


def _place(full: np.ndarray, sl, value: np.ndarray) -> None:
    from ms_deepseek.checkpoint.layout import ExpertIds

    if sl and isinstance(sl[0], ExpertIds):
        for k, e in enumerate(sl[0]):
            full[e][tuple(slice(a, b) for a, b in sl[1:])] = value[k]
    else:
        full[tuple(slice(a, b) for a, b in sl)] = value


# ----------------------------------------------------------------------------- writing
def rank_entries(src, layout: ShardLayout, rank: int) -> List[OutTensor]:
    entries = []
    for name in layout.stored_in(rank):
        t = layout.tensors[name]
        sl = layout.slice_of(name, rank)
        entries.append(
            OutTensor(
                name,
                t.dtype,
                t.slice_shape(),
                produce=lambda name=name, sl=sl: np.ascontiguousarray(src.read(name, sl)),
            )
        )
    return order_for_alignment(entries)


def _whole_entries(src, layout_tensors) -> List[OutTensor]:
    entries = []
    for name, t in layout_tensors.items():
        sl = full_slice(t.shape, t.experts is not None)
        entries.append(
            OutTensor(name, t.dtype, t.shape, produce=lambda name=name, sl=sl: np.ascontiguousarray(src.read(name, sl)))
        )
    return order_for_alignment(entries)


def _carry(src_folder: Path, tmp: Path, cfg_path: Path, extra=()) -> None:
    from ms_deepseek.checkpoint.convert.hf import CARRIED_FILES

    shutil.copyfile(cfg_path, tmp / "config.json")
    for name in tuple(CARRIED_FILES) + tuple(extra):
        if (src_folder / name).is_file():
            shutil.copyfile(src_folder / name, tmp / name)


def _optimizer_layout(layout: ShardLayout, opt_src) -> ShardLayout:
    infos = {}
    if isinstance(opt_src, ShardedSource):
        for n, t in opt_src.layout.tensors.items():
            infos[n] = (t.shape, t.dtype)
    else:
        for n, info in opt_src.tensors.items():
            infos[n] = (info.shape, info.dtype)
    return layout.with_optimizer(infos)


def write_sharded(
    src_folder, dst, parallel, *, overwrite: bool = False, fsync: bool = True, progress: bool = False
) -> ShardLayout:
    """Every rank's slices of ``src_folder`` (any checkpoint) under ``parallel``: ``DST/rank_RRRRR/`` + layout.json.

    A training checkpoint's optimizer state is sliced the same way and its state.json /
    recipe.yaml are carried along (``state.json``'s ``world_size`` becomes the new one)."""
    src_folder, dst = Path(src_folder), Path(dst)
    opened = open_checkpoint(src_folder)
    model, opt, cfg_path = opened.model, opened.optimizer, opened.config_path
    layout = target_layout(opened.config, parallel, model, opened.lora)
    if opt is not None:
        layout = _optimizer_layout(layout, opt)
    # each distinct slice once, in its owner's folder (the dp replicas read it from there): a dp8 layout
    # wrote 8 identical copies of every replicated slice
    layout = layout.storing_distinct()
    check_destination(src_folder, dst, overwrite)
    with atomic_folder(dst, fsync=fsync) as tmp:
        files: Dict[str, Dict] = {}
        for rank in range(layout.world_size):
            folder = tmp / rank_dir_name(rank)
            folder.mkdir()
            rel = f"{rank_dir_name(rank)}/"
            files[rel + "model.safetensors"] = _write_digested(
                folder / "model.safetensors", rank_entries(model, layout, rank)
            )
            if opt is not None:
                files[rel + OPTIMIZER_FILE] = _write_digested(
                    folder / OPTIMIZER_FILE, rank_entries(opt, layout.for_optimizer(), rank)
                )
            if progress:
                print(f"rank {rank + 1}/{layout.world_size} written", flush=True)
        layout.write(tmp / LAYOUT_FILE)
        _carry(src_folder, tmp, cfg_path, extra=TRAINING_FILES if opt is not None else ())
        _update_state(tmp, layout.world_size, files)
    return layout


def write_whole(src_folder, dst, *, overwrite: bool = False, fsync: bool = True) -> None:
    """A sharded (or whole) checkpoint as one whole ms_deepseek checkpoint (model + optimizer files)."""
    src_folder, dst = Path(src_folder), Path(dst)
    opened = open_checkpoint(src_folder)
    model, opt, cfg_path = opened.model, opened.optimizer, opened.config_path
    check_destination(src_folder, dst, overwrite)
    layout = target_layout(opened.config, ParallelConfig(), model, opened.lora)
    with atomic_folder(dst, fsync=fsync) as tmp:
        files = {"model.safetensors": _write_digested(tmp / "model.safetensors", _whole_entries(model, layout.tensors))}
        if opt is not None:
            files[OPTIMIZER_FILE] = _write_digested(
                tmp / OPTIMIZER_FILE, _whole_entries(opt, _optimizer_layout(layout, opt).optimizer)
            )
        _carry(src_folder, tmp, cfg_path, extra=TRAINING_FILES if opt is not None else ())
        _update_state(tmp, None, files)


def _write_digested(path: Path, entries: List[OutTensor]) -> Dict:
    """One output file, its digest taken as it is written (the entry state.json records)."""
    hasher = digests.new_hasher()
    return digests.entry(write_file(path, entries, {"format": "ms"}, fsync=False, digest=hasher), hasher)


def _update_state(tmp: Path, world: Optional[int], files: Dict[str, Dict]) -> None:
    """A training checkpoint's carried state.json: the new world size and the digests of the files written."""
    path = tmp / "state.json"
    if not path.is_file():
        return
    state = json.loads(path.read_text(encoding="utf-8"))
    carried = {
        name: digests.file_entry(tmp / name) for name in ("config.json", "recipe.yaml") if (tmp / name).is_file()
    }
    state[digests.FILES_KEY] = dict(sorted({**files, **carried}.items()))
    state["resharded_from_world_size"] = state.get("world_size")
    if world is not None:
        state["world_size"] = world
    else:
        state.pop("world_size", None)  # a whole checkpoint resumes on any data-parallel worker count
    path.write_text(json.dumps(state, indent=1) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------- merge to HF
def merge_to_hf(
    src_folder,
    dst,
    *,
    shard_size="5GB",
    workers: int = 1,
    overwrite: bool = False,
    progress: bool = True,
    fsync: bool = True,
):
    """A sharded checkpoint -> one HF folder, tensor by tensor (see module doc); returns a ConvertResult."""
    from ms_deepseek.checkpoint.convert import hf as api

    src_folder = Path(src_folder)
    opened = open_checkpoint(src_folder)
    model, cfg = opened.model, opened.config
    if opened.lora is not None:
        raise lora_not_a_model(src_folder)
    _check_strategy_files(src_folder, model.layout)

    def plan_fn(_):
        from ms_deepseek.config.inventory import expected_ms_shapes

        out: List[OutTensor] = []
        for name in expected_ms_shapes(cfg):
            t = model.layout.tensors[name]
            if not names.is_stacked_expert(name):
                sl = full_slice(t.shape)
                out.append(
                    OutTensor(
                        name,
                        t.dtype,
                        t.shape,
                        produce=lambda name=name, sl=sl: np.ascontiguousarray(model.read(name, sl)),
                    )
                )
                continue
            from ms_deepseek.checkpoint.layout import ExpertIds

            for e, hf_name in enumerate(names.ms_to_hf(name, cfg.n_routed_experts)):
                sl = (ExpertIds([e]),) + full_slice(t.shape)[1:]
                out.append(
                    OutTensor(
                        hf_name,
                        t.dtype,
                        t.shape[1:],
                        produce=lambda name=name, sl=sl: np.ascontiguousarray(model.read(name, sl)[0]),
                    )
                )
        return out

    return api.convert_with(
        opened, src_folder, dst, "ms-to-hf", plan_fn, api.WriteOptions(shard_size, workers, overwrite, progress, fsync)
    )


def _check_strategy_files(folder: Path, layout: ShardLayout) -> None:
    """MindSpore strategy files of an Ascend run (``rank_RRRRR/strategy.ckpt``) must agree with layout.json."""
    from ms_deepseek.checkpoint.layout import check_strategy_file

    for rank in range(layout.world_size):
        path = folder / rank_dir_name(rank) / "strategy.ckpt"
        if path.is_file():
            check_strategy_file(layout, path, rank)
