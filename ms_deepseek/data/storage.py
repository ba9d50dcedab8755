"""Prepared data folders: MindRecord shards + ``meta.json`` + the tokenizer.

Layout of a folder written by ``prepare-data``::

    DIR/meta.json                     format, seq_len, counts, tokenizer hash, shard files
    DIR/data.mindrecord[0..K-1]       MindRecord shards {input_ids int32[-1], labels int32[-1], length int32}
    DIR/data.mindrecord*.db           their index files
    DIR/tokenizer.json (+ tokenizer_config.json) | DIR/tokenizer.model

Everything is written into a hidden sibling folder and renamed into place at
the end, so a failure never leaves a half-written ``DIR``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Union

import numpy as np

from ms_deepseek.core.atomic import install
from ms_deepseek.core.errors import UserError
from ms_deepseek.core.safe_io import (
    check_output_dir,
    confined,
    created_parents,
    json_loads,
    regular_file,
    remove_empty_dirs,
)

META_NAME = "meta.json"
LENGTHS_NAME = "lengths.npy"
DATA_STEM = "data.mindrecord"
META_VERSION = 1
SCHEMA = {
    "input_ids": {"type": "int32", "shape": [-1]},
    "labels": {"type": "int32", "shape": [-1]},
    "length": {"type": "int32"},
}
COLUMNS = ["input_ids", "labels", "length"]


def _make_readable(folder: Path) -> None:
    """mkdtemp and FileWriter create owner-only modes; give the folder the usual umask modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.iterdir():
        os.chmod(f, 0o666 & ~umask)


class DestinationRaced(Exception):
    """Another process installed the destination folder first (see :meth:`ShardWriter.install`)."""


def check_destination(output: Path, overwrite: bool) -> None:
    """Refuse a non-empty destination unless ``overwrite`` (checked before any work)."""
    if output.exists() and not output.is_dir():
        raise UserError(f"{output}: exists and is not a folder")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise UserError(f"{output}: folder is not empty (use --overwrite to replace it)")
    check_output_dir(output, "--output folder")


class ShardWriter:
    """Writes rows into MindRecord shards inside a temporary sibling of ``output``.

    Use as a context manager; call :meth:`install` with the meta dict to move
    the finished folder into place. Leaving the block any other way removes
    the temporary folder.
    """

    def __init__(self, output: Union[str, Path], num_shards: int = 1, overwrite: bool = False):
        from mindspore.mindrecord import FileWriter

        self.output = Path(output).expanduser().absolute()
        if not 1 <= num_shards <= 1000:
            raise UserError(f"--num-shards: must be between 1 and 1000, got {num_shards}")
        check_destination(self.output, overwrite)
        self.overwrite = overwrite
        self._new_dirs = created_parents(self.output)  # removed again unless the folder is installed
        self.output.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.output.name}.tmp-", dir=self.output.parent))
        self.num_shards = num_shards
        # One standalone MindRecord file per shard, rows dealt round-robin. (A
        # single FileWriter(shard_num=K) spreads rows over its files in an order
        # of its own; here the order is known, so lengths.npy can follow it.)
        digits = len(str(num_shards - 1))
        self.files = [DATA_STEM] if num_shards == 1 else [f"{DATA_STEM}{s:0{digits}d}" for s in range(num_shards)]
        self._writers = []
        for name in self.files:
            writer = FileWriter(str(self.tmp / name), shard_num=1)
            writer.add_schema(SCHEMA, "ms_deepseek_samples")
            self._writers.append(writer)
        self._buffers: List[List[dict]] = [[] for _ in self.files]
        self._lengths: List[List[int]] = [[] for _ in self.files]
        self._rows = 0
        self._installed = False

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *_exc_info) -> None:
        if not self._installed:
            shutil.rmtree(self.tmp, ignore_errors=True)
            remove_empty_dirs(self._new_dirs)

    def write(self, row: dict) -> None:
        shard = self._rows % self.num_shards
        self._rows += 1
        self._buffers[shard].append(row)
        self._lengths[shard].append(int(row["length"]))
        if len(self._buffers[shard]) >= 1024:
            self._flush(shard)

    def _flush(self, shard: int) -> None:
        if self._buffers[shard]:
            self._writers[shard].write_raw_data(self._buffers[shard])
            self._buffers[shard] = []

    def install(self, meta: Dict) -> Dict:
        """Commit the shards, write meta.json and rename the folder into place; returns the full meta."""
        for shard, writer in enumerate(self._writers):
            self._flush(shard)
            writer.commit()
        # Per-sample lengths in reading order (the files in meta order, each in
        # write order): the loader counts SFT bucket batches from it without
        # reading the shards (exact resume, see dataset.py).
        lengths = np.concatenate([np.asarray(x, dtype=np.int32) for x in self._lengths])
        np.save(self.tmp / LENGTHS_NAME, lengths)
        meta = dict(meta, version=META_VERSION, files=self.files, lengths_file=LENGTHS_NAME)
        (self.tmp / META_NAME).write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        _make_readable(self.tmp)
        if self.output.is_dir() and any(self.output.iterdir()) and not self.overwrite:
            raise DestinationRaced(str(self.output))
        install(self.tmp, self.output)  # the one atomic writer's swap (core.atomic)
        self._installed = True
        return meta


def load_meta(folder: Union[str, Path], key: str = "data.path") -> Dict:
    """Read and check ``folder/meta.json``; every problem names the folder (and ``key``)."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise UserError(f"{key}: {folder} does not exist (create it with `ms-deepseek prepare-data`)")
    path = folder / META_NAME
    if not path.is_file():
        raise UserError(f"{key}: {folder} has no {META_NAME}; it is not a folder written by `ms-deepseek prepare-data`")
    try:
        meta = json_loads(path.read_text(encoding="utf-8"), path)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: unreadable ({exc})") from None
    for field in ("format", "seq_len", "counts", "files", "tokenizer"):
        if field not in meta:
            raise UserError(f"{path}: missing '{field}'")
    if meta.get("version") != META_VERSION:
        raise UserError(f"{path}: version {meta.get('version')!r} is not {META_VERSION}; re-run prepare-data")
    if not isinstance(meta["files"], list):
        raise UserError(f"{path}: 'files' must be a list of shard file names")
    # the names inside meta.json stay inside the folder (no /etc/passwd, no ../other)
    for name in meta["files"]:
        confined(folder, name, f"{path}: files")
    confined(folder, meta.get("lengths_file", LENGTHS_NAME), f"{path}: lengths_file")
    missing = [f for f in meta["files"] + [meta.get("lengths_file", LENGTHS_NAME)] if not (folder / f).is_file()]
    if missing or not meta["files"]:
        raise UserError(f"{path}: shard file(s) missing: {', '.join(missing) or 'none listed'}")
    return meta


def load_lengths(folder: Union[str, Path], meta: Dict) -> np.ndarray:
    """The per-sample token counts named by ``meta['lengths_file']``: a 1-D integer array read without
    pickle (a pickled .npy could run code), from inside ``folder`` only."""
    folder = Path(folder).expanduser()
    path = regular_file(
        confined(folder, meta.get("lengths_file", LENGTHS_NAME), f"{folder / META_NAME}: lengths_file"), "lengths file"
    )
    try:
        lengths = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise UserError(
            f"{path}: not a plain .npy array of sample lengths ({str(exc).splitlines()[0][:160]})"
        ) from None
    if not isinstance(lengths, np.ndarray) or lengths.ndim != 1 or lengths.dtype.kind not in "iu":
        raise UserError(
            f"{path}: expected a 1-D integer array of sample lengths, got "
            f"{getattr(lengths, 'dtype', type(lengths))} {getattr(lengths, 'shape', '')}"
        )
    return lengths


def shard_paths(folder: Union[str, Path], meta: Dict) -> List[str]:
    folder = Path(folder).expanduser()
    return [str(folder / f) for f in meta["files"]]


def find_meta(folder: Union[str, Path]) -> Optional[Path]:
    p = Path(folder).expanduser() / META_NAME
    return p if p.is_file() else None
