"""The weight files of a whole checkpoint folder: config, index + shards or one file, every tensor's location.

This is the file-format layer under :func:`ms_deepseek.checkpoint.opener.open_checkpoint` (the one
opener, which knows every kind of checkpoint); the converter copies bytes straight from it.

Accepted folders:

* HuggingFace / converted ms_deepseek: ``config.json`` + ``model.safetensors.index.json``
  and the shards it names, or ``config.json`` + ``model.safetensors``;
* a training checkpoint (``step_XXXXXXXX/``): ``config.json`` + ``model.safetensors``;
  ``optimizer.safetensors``, ``state.json`` and ``recipe.yaml`` are ignored, except that the files read are
  checked against the digests ``state.json`` records (:mod:`.digests`).

Everything is checked before a byte is copied: the index (a JSON object whose
``weight_map`` names files inside the folder, each existing), every header against
its file size, and that the index and the files agree.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from ms_deepseek.checkpoint import digests
from ms_deepseek.checkpoint.safetensors_io import FileHeader, TensorInfo, read_header
from ms_deepseek.config import names
from ms_deepseek.config.model import DeepseekV2Config
from ms_deepseek.core.errors import UserError
from ms_deepseek.core.safe_io import is_file, json_loads

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass
class WeightFiles:
    folder: Path
    config_path: Path
    config: DeepseekV2Config
    files: List[Path]  # weight files, in index order
    tensors: Dict[str, TensorInfo]  # name -> where its bytes are
    index_path: Optional[Path]

    def where(self, name: str) -> Path:
        """The file a tensor lives in (for error messages)."""
        return self.tensors[name].file


def _is_local_name(rel: str) -> bool:
    """A relative path that stays inside the folder by name.

    Checked lexically, not by resolving symlinks: the HuggingFace cache keeps shards as
    symlinks into ../../blobs, which is legitimate; an index entry such as
    ``../../etc/x`` or ``/abs/path`` is not.
    """
    if os.path.isabs(rel) or "\0" in rel:
        return False
    norm = os.path.normpath(rel)
    return norm != "." and norm != ".." and not norm.startswith(".." + os.sep)


def _read_index(folder: Path, index_path: Path) -> Dict[str, Path]:
    """weight_map of the index: tensor name -> shard path (checked to exist inside ``folder``)."""
    try:
        data = json_loads(index_path.read_text(encoding="utf-8"), index_path)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{index_path}: not a readable JSON index ({exc})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise UserError(f"{index_path}: no 'weight_map' object naming the weight files")
    out: Dict[str, Path] = {}
    checked: Dict[str, Path] = {}
    for name, rel in weight_map.items():
        if not isinstance(rel, str) or not rel:
            raise UserError(f"{index_path}: weight_map[{name!r}] must be a file name, got {rel!r}")
        if rel not in checked:
            path = folder / rel
            if not _is_local_name(rel):
                raise UserError(f"{index_path}: weight_map[{name!r}] = {rel!r} lies outside the checkpoint folder")
            if not is_file(path, f"{index_path}: weight_map[{name!r}]"):
                raise UserError(f"{index_path}: weight_map[{name!r}] names {rel!r}, which is missing (no file {path})")
            checked[rel] = path
        out[name] = checked[rel]
    return out


def read_weight_files(folder) -> WeightFiles:
    folder = Path(folder)
    if not folder.exists():
        raise UserError(f"{folder}: no such folder")
    if not folder.is_dir():
        raise UserError(
            f"{folder}: not a checkpoint folder (expected a folder holding config.json and "
            f"{INDEX_NAME} or {SINGLE_NAME})"
        )
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise UserError(f"{folder}: not a checkpoint (no config.json)")
    recorded = digests.recorded(folder)  # a training checkpoint's state.json: each file's digest when saved
    digests.check_file(folder, "config.json", recorded)
    config = DeepseekV2Config.from_json(config_path)
    index_path: Optional[Path] = folder / INDEX_NAME
    if index_path.is_file():
        weight_map = _read_index(folder, index_path)
        files = list(dict.fromkeys(weight_map.values()))
    elif (folder / SINGLE_NAME).is_file():
        index_path, weight_map = None, None
        files = [folder / SINGLE_NAME]
    else:
        raise UserError(f"{folder}: not a checkpoint (no {INDEX_NAME} or {SINGLE_NAME})")
    for path in files:
        digests.check_file(folder, os.path.relpath(path, folder), recorded)
    headers: Dict[Path, FileHeader] = {path: read_header(path) for path in files}
    tensors: Dict[str, TensorInfo] = {}
    if weight_map is None:
        tensors = dict(headers[files[0]].tensors)
    else:
        for name, path in weight_map.items():
            info = headers[path].tensors.get(name)
            if info is None:
                raise UserError(f"{index_path}: tensor {name} is mapped to {path.name}, which does not hold it")
            tensors[name] = info
        for path, header in headers.items():
            for name in header.tensors:
                if weight_map.get(name) != path:
                    raise UserError(f"{path}: tensor {name} is not listed for this file in {index_path.name}")
    if not tensors:
        raise UserError(f"{folder}: not a checkpoint (its weight files hold no tensors)")
    check_config_scale(config, tensors, config_path, "the weight files")
    return WeightFiles(
        folder=folder, config_path=config_path, config=config, files=files, tensors=tensors, index_path=index_path
    )


def check_config_scale(cfg: DeepseekV2Config, tensor_names, config_path: Path, held_by: str) -> None:
    """The config names no more decoder layers (nor, for per-expert HF tensors, routed experts) than
    ``tensor_names`` hold.

    Checked from the names before anyone lists the config's expected tensors: a config.json
    saying ``num_hidden_layers: 10000000`` would otherwise be enumerated for minutes before the
    comparison finds that it does not match."""
    last_layer, last_expert = -1, -1
    for name in tensor_names:
        layer = names.layer_of(name)
        if layer is not None and layer > last_layer:
            last_layer = layer
        expert = names.hf_to_ms(name)[1]
        if expert is not None and expert > last_expert:
            last_expert = expert
    if cfg.num_hidden_layers > last_layer + 1:
        raise UserError(
            f"{config_path}: num_hidden_layers = {cfg.num_hidden_layers}, {held_by} hold "
            f"{last_layer + 1} decoder layer(s): the config does not match the tensors"
        )
    if last_expert >= 0 and (cfg.n_routed_experts or 0) > last_expert + 1:
        raise UserError(
            f"{config_path}: n_routed_experts = {cfg.n_routed_experts}, {held_by} hold "
            f"{last_expert + 1} routed expert(s) per layer: the config does not match the tensors"
        )
