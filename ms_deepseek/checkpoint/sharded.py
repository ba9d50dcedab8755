"""Checkpoints across layouts: per-rank loading, pre-sharded conversion, merge to HF, resharding.

All four are one operation, "read the slice a target wants from whatever the source is"
(:mod:`.sources`), applied per tensor and streamed:

* :func:`load_rank` -- the slices one rank holds under a layout, read straight from an HF or
  ms_deepseek folder, a whole training checkpoint or a sharded one (peak host memory: the
  rank's slices plus one tensor's pages);
* :func:`write_sharded` -- ``DST/rank_RRRRR/model.safetensors`` (and ``optimizer.safetensors``)
  for every rank plus ``layout.json`` (``convert hf-to-ms --recipe``, ``convert reshard``);
* :func:`merge_to_hf` -- one HF folder from a sharded checkpoint, byte-identical to
  ``convert ms-to-hf`` of the equivalent whole checkpoint (same plan, same header bytes);
* :func:`write_whole` -- a sharded training checkpoint back to a whole one (``reshard`` to a
  data-parallel layout).

A LoRA run's checkpoint (adapters and trained routers only, ``lora`` in its layout file or
its recipe.yaml) reshards the same way; it has no HF form of its own (``export-lora``).

Destinations are written with :func:`ms_deepseek.checkpoint.atomic.atomic_folder`: nothing
is left at the destination on failure.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from ms_deepseek.checkpoint.atomic import atomic_folder, check_destination
from ms_deepseek.checkpoint.layout import (LAYOUT_FILE, ShardLayout, build_layout, checkpoint_inventory,
                                           lora_settings, rank_dir_name)
from ms_deepseek.checkpoint.sources import ShardedSource, WholeSource, full_slice
from ms_deepseek.convert import names
from ms_deepseek.convert.safetensors_io import OutTensor, order_for_alignment, read_header, write_file
from ms_deepseek.errors import UserError

TRAINING_FILES = ("state.json", "recipe.yaml")  # carried along by reshard


# ----------------------------------------------------------------------------- sources
def open_any(folder: Path):
    """(model source, optimizer source or None, config, config path) of any checkpoint folder.

    The model source's ``lora`` is the LoRA settings of a LoRA checkpoint (None otherwise)."""
    from ms_deepseek.config import DeepseekV2Config
    from ms_deepseek.convert.source import open_checkpoint

    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{folder}: no such checkpoint folder")
    if (folder / LAYOUT_FILE).is_file() or any(folder.glob("rank_[0-9][0-9][0-9][0-9][0-9]")):
        model = ShardedSource(folder, "model.safetensors")
        if not (folder / "config.json").is_file():
            raise UserError(f"{folder}: sharded checkpoint without config.json")
        cfg = DeepseekV2Config.from_json(folder / "config.json")
        _check_layout_matches_config(model.layout, cfg, folder)
        model.lora = model.layout.lora
        opt = None
        if model.layout.optimizer:
            opt = ShardedSource(folder, "optimizer.safetensors", layout=model.layout.for_optimizer())
        return model, opt, cfg, folder / "config.json"
    ckpt = open_checkpoint(folder)
    model = WholeSource(ckpt)
    model.lora = _lora_of(folder)
    if model.lora is not None:  # adapters (+ routers): read by our names
        from ms_deepseek.convert.plan import check_tensors

        model.hf = False
        check_tensors(ckpt, {i.name: i.shape for i in checkpoint_inventory(ckpt.config, model.lora)}, "LoRA")
    else:
        _check_whole(model, ckpt)
    opt = None
    if (folder / "optimizer.safetensors").is_file():
        header = read_header(folder / "optimizer.safetensors")
        opt = WholeSource(ckpt, extra=header.tensors)
        opt.tensors = dict(header.tensors)
        opt.hf = False
    return model, opt, ckpt.config, ckpt.config_path


def _lora_of(folder: Path) -> Optional[Dict]:
    """The LoRA settings of a whole LoRA training checkpoint (its recipe.yaml's lora section), else None."""
    if not (folder / "state.json").is_file():
        return None
    from ms_deepseek.checkpoint.training import read_recipe
    from ms_deepseek.schema import from_dict
    from ms_deepseek.train.recipe import LoraSection

    section = read_recipe(folder, missing_ok=True).get("lora")
    if section is None:
        return None
    return lora_settings(from_dict(LoraSection, section, f"{folder / 'recipe.yaml'}: lora"))


def _check_whole(src: WholeSource, ckpt) -> None:
    """Names, shapes and dtypes of a whole source against its config (the converter's checks)."""
    from ms_deepseek.convert.plan import check_tensors
    from ms_deepseek.model.inventory import (expected_hf_shapes, expected_ms_shapes, ms_buffer_shapes,
                                             zero_width_shapes)

    cfg = ckpt.config
    if src.hf:
        check_tensors(ckpt, expected_hf_shapes(cfg), "HuggingFace", optional=zero_width_shapes(cfg))
    else:
        check_tensors(ckpt, expected_ms_shapes(cfg), "ms_deepseek",
                      optional={**zero_width_shapes(cfg), **ms_buffer_shapes(cfg)})


def _check_layout_matches_config(layout: ShardLayout, cfg, folder: Path) -> None:
    expected = {info.name: info.shape for info in checkpoint_inventory(cfg, layout.lora)}
    for name, shape in expected.items():
        t = layout.tensors.get(name)
        if t is None:
            raise UserError(f"{folder / LAYOUT_FILE}: tensor {name} is missing (config.json requires it)")
        if t.shape != tuple(shape):
            raise UserError(f"{folder / LAYOUT_FILE}: tensor {name} has shape {list(t.shape)}, config.json implies "
                            f"{list(shape)}")
    extra = [n for n in layout.tensors if n not in expected]
    if extra:
        raise UserError(f"{folder / LAYOUT_FILE}: unexpected tensor {extra[0]} (not in the model config.json "
                        "describes)")


def target_layout(cfg, parallel, src) -> ShardLayout:
    """The layout for ``parallel``, with each tensor's dtype as the source stores it (a LoRA source:
    the layout of its adapters)."""
    from ms_deepseek.parallel.validate import validate_layout

    validate_layout(parallel, cfg)
    lora = getattr(src, "lora", None)
    return build_layout(cfg, parallel, dtypes={i.name: src.dtype(i.name) for i in checkpoint_inventory(cfg, lora)},
                        lora=lora)


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

    from ms_deepseek.convert.source import open_checkpoint
    from ms_deepseek.convert.synthetic import write_random_checkpoint

    with tempfile.TemporaryDirectory(prefix="ms_deepseek_loader_") as tmp:
        write_random_checkpoint(Path(tmp) / "hf", cfg, dtype="float32", layout="hf", seed=seed)
        src = WholeSource(open_checkpoint(Path(tmp) / "hf"))
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
def _rank_entries(src, layout: ShardLayout, rank: int) -> List[OutTensor]:
    entries = []
    for name in layout.tensors_of_rank(rank):
        t = layout.tensors[name]
        sl = layout.slice_of(name, rank)
        entries.append(OutTensor(name, t.dtype, t.slice_shape(),
                                 produce=lambda name=name, sl=sl: np.ascontiguousarray(src.read(name, sl))))
    return order_for_alignment(entries)


def _whole_entries(src, layout_tensors) -> List[OutTensor]:
    entries = []
    for name, t in layout_tensors.items():
        sl = full_slice(t.shape, t.experts is not None)
        entries.append(OutTensor(name, t.dtype, t.shape,
                                 produce=lambda name=name, sl=sl: np.ascontiguousarray(src.read(name, sl))))
    return order_for_alignment(entries)


def _carry(src_folder: Path, tmp: Path, cfg_path: Path, extra=()) -> None:
    from ms_deepseek.convert.api import CARRIED_FILES

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


def write_sharded(src_folder, dst, parallel, *, overwrite: bool = False, fsync: bool = True,
                  progress: bool = False) -> ShardLayout:
    """Every rank's slices of ``src_folder`` (any checkpoint) under ``parallel``: ``DST/rank_RRRRR/`` + layout.json.

    A training checkpoint's optimizer state is sliced the same way and its state.json /
    recipe.yaml are carried along (``state.json``'s ``world_size`` becomes the new one)."""
    src_folder, dst = Path(src_folder), Path(dst)
    model, opt, cfg, cfg_path = open_any(src_folder)
    layout = target_layout(cfg, parallel, model)
    if opt is not None:
        layout = _optimizer_layout(layout, opt)
    check_destination(src_folder, dst, overwrite)
    with atomic_folder(dst, fsync=fsync) as tmp:
        for rank in range(layout.world_size):
            folder = tmp / rank_dir_name(rank)
            folder.mkdir()
            write_file(folder / "model.safetensors", _rank_entries(model, layout, rank), {"format": "ms"},
                       fsync=False)
            if opt is not None:
                write_file(folder / "optimizer.safetensors", _rank_entries(opt, layout.for_optimizer(), rank),
                           {"format": "ms"}, fsync=False)
            if progress:
                print(f"rank {rank + 1}/{layout.world_size} written", flush=True)
        layout.write(tmp / LAYOUT_FILE)
        _carry(src_folder, tmp, cfg_path, extra=TRAINING_FILES if opt is not None else ())
        _update_state(tmp, layout.world_size)
    return layout


def write_whole(src_folder, dst, *, overwrite: bool = False, fsync: bool = True) -> None:
    """A sharded (or whole) checkpoint as one whole ms_deepseek checkpoint (model + optimizer files)."""
    src_folder, dst = Path(src_folder), Path(dst)
    model, opt, cfg, cfg_path = open_any(src_folder)
    check_destination(src_folder, dst, overwrite)
    layout = target_layout(cfg, _whole_parallel(), model)
    with atomic_folder(dst, fsync=fsync) as tmp:
        write_file(tmp / "model.safetensors", _whole_entries(model, layout.tensors), {"format": "ms"}, fsync=False)
        if opt is not None:
            write_file(tmp / "optimizer.safetensors", _whole_entries(opt, _optimizer_layout(layout, opt).optimizer),
                       {"format": "ms"}, fsync=False)
        _carry(src_folder, tmp, cfg_path, extra=TRAINING_FILES if opt is not None else ())
        _update_state(tmp, None)


def _whole_parallel():
    from ms_deepseek.parallel.config import ParallelConfig

    return ParallelConfig()


def _update_state(tmp: Path, world: Optional[int]) -> None:
    path = tmp / "state.json"
    if not path.is_file():
        return
    state = json.loads(path.read_text(encoding="utf-8"))
    state["resharded_from_world_size"] = state.get("world_size")
    if world is not None:
        state["world_size"] = world
    else:
        state.pop("world_size", None)  # a whole checkpoint resumes on any data-parallel worker count
    path.write_text(json.dumps(state, indent=1) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------- merge to HF
def merge_to_hf(src_folder, dst, *, shard_size="5GB", workers: int = 1, overwrite: bool = False,
                progress: bool = True, fsync: bool = True):
    """A sharded checkpoint -> one HF folder, tensor by tensor (see module doc); returns a ConvertResult."""
    from types import SimpleNamespace

    from ms_deepseek.convert import api

    src_folder = Path(src_folder)
    model, _, cfg, cfg_path = open_any(src_folder)
    if model.lora is not None:
        raise UserError(f"{src_folder}: a LoRA checkpoint holds adapters, not a model; write a PEFT adapter or a "
                        f"merged HF folder with `ms-deepseek export-lora {src_folder} OUT [--merge BASE]`")
    _check_strategy_files(src_folder, model.layout)

    def plan_fn(_):
        from ms_deepseek.model.inventory import expected_ms_shapes

        out: List[OutTensor] = []
        for name in expected_ms_shapes(cfg):
            t = model.layout.tensors[name]
            if not names.is_stacked_expert(name):
                sl = full_slice(t.shape)
                out.append(OutTensor(name, t.dtype, t.shape,
                                     produce=lambda name=name, sl=sl: np.ascontiguousarray(model.read(name, sl))))
                continue
            from ms_deepseek.checkpoint.layout import ExpertIds

            for e, hf_name in enumerate(names.ms_to_hf(name, cfg.n_routed_experts)):
                sl = (ExpertIds([e]),) + full_slice(t.shape)[1:]
                out.append(OutTensor(hf_name, t.dtype, t.shape[1:],
                                     produce=lambda name=name, sl=sl: np.ascontiguousarray(model.read(name, sl)[0])))
        return out

    ckpt = SimpleNamespace(folder=src_folder, config=cfg, config_path=cfg_path)
    return api.convert_with(ckpt, src_folder, dst, "ms-to-hf", plan_fn, shard_size, workers, overwrite, progress,
                            fsync)


def _check_strategy_files(folder: Path, layout: ShardLayout) -> None:
    """MindSpore strategy files of an Ascend run (``rank_RRRRR/strategy.ckpt``) must agree with layout.json."""
    from ms_deepseek.checkpoint.layout import check_strategy_file

    for rank in range(layout.world_size):
        path = folder / rank_dir_name(rank) / "strategy.ckpt"
        if path.is_file():
            check_strategy_file(layout, path, rank)


def describe_source(folder: Path) -> str:
    return "sharded" if (Path(folder) / LAYOUT_FILE).is_file() else "whole"
