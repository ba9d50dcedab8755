"""Read any part of a tensor from a checkpoint, whole or sharded, touching only the bytes it needs.

Every source answers one question: :meth:`read(name, sl)`: the raw values (bytes unchanged:
bfloat16 stays uint16 bit patterns) of tensor ``name`` (our names, routed experts stacked
[E, out, in]) restricted to ``sl`` (per axis a (start, stop) range, and for stacked experts
a tuple of expert ids on axis 0).

* :class:`WholeSource`: an HF folder (per-expert tensors, stacked on the fly, only the
  experts asked for) or an ms_deepseek folder / whole training checkpoint;
* :class:`ShardedSource`: ``rank_RRRRR/`` folders plus ``layout.json``; the pieces of
  the stored slices that intersect the request are read and put together.

Reads go through ``numpy.memmap`` of the safetensors data: a row range of a tensor reads
those rows only (what ``safe_open(...).get_slice(name)[a:b]`` does), so a rank's peak host
memory is its own slices plus, for slices across the inner axis, one tensor's pages.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from ms_deepseek.checkpoint.digests import check_file, recorded
from ms_deepseek.checkpoint.layout import RANK_DIR_GLOB, ExpertIds, ShardLayout, rank_dir_name, read_layout
from ms_deepseek.checkpoint.safetensors_io import TensorInfo, read_header
from ms_deepseek.config import names
from ms_deepseek.core.dtypes import BY_SAFETENSORS
from ms_deepseek.core.errors import UserError

RAW_DTYPES = {code: d.raw for code, d in BY_SAFETENSORS.items()}  # the stored bits, by safetensors code


def full_slice(shape, experts: bool = False):
    sl = tuple((0, d) for d in shape)
    if experts and shape:
        sl = (ExpertIds(range(shape[0])),) + sl[1:]
    return sl


def slice_shape(sl) -> Tuple[int, ...]:
    return tuple(len(s) if isinstance(s, ExpertIds) else s[1] - s[0] for s in sl)


def memmap(info: TensorInfo) -> np.ndarray:
    """A read-only view of a tensor's bytes (nothing is read until indexed)."""
    if info.dtype not in RAW_DTYPES:
        raise UserError(f"{info.file}: tensor {info.name} has dtype {info.dtype}, which ms_deepseek cannot load")
    if 0 in info.shape or info.nbytes == 0:
        return np.zeros(info.shape, dtype=RAW_DTYPES[info.dtype])
    return np.memmap(info.file, dtype=RAW_DTYPES[info.dtype], mode="r", offset=info.offset, shape=info.shape)


def _rows_only(sl, shape) -> bool:
    """The request is a row range of axis 0 with every other axis whole: contiguous bytes on disk."""
    return bool(sl) and not isinstance(sl[0], ExpertIds) and all(tuple(s) == (0, d) for s, d in zip(sl[1:], shape[1:]))


def pread_rows(info: TensorInfo, lo: int, hi: int, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Rows [lo, hi) of axis 0 read straight into ``out`` (or a new array): no second copy, no mapping."""
    row = info.nbytes // info.shape[0] if info.shape and info.shape[0] else info.nbytes
    if out is None:
        out = np.empty((hi - lo,) + tuple(info.shape[1:]), dtype=RAW_DTYPES[info.dtype])
    # [rows, ...] -> [rows * ... * itemsize] bytes of the same buffer: preadv fills the array in place
    buf = memoryview(out.reshape(-1).view(np.uint8)) if out.size else memoryview(b"")
    done, want = 0, (hi - lo) * row
    with open(info.file, "rb", buffering=0) as f:
        while done < want:
            got = os.preadv(f.fileno(), [buf[done:want]], info.offset + lo * row + done)
            if got <= 0:
                raise UserError(f"{info.file}: tensor {info.name} ends early (file shrank while reading?)")
            done += got
    return out


def _ranges(sl) -> Tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in sl)


def to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Raw safetensors values -> float32 (bfloat16 is the top half of a float32: widened exactly)."""
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32, copy=False)


class WholeSource:
    """The tensors of a whole checkpoint: an HF / ms_deepseek folder, a training checkpoint's
    model or optimizer file. ``hf``: routed experts are stored per expert (HF names) and are
    stacked on read; default: detected from the names."""

    def __init__(self, tensors: Dict[str, TensorInfo], cfg, folder: Path, hf: Optional[bool] = None):
        self.cfg = cfg
        self.tensors: Dict[str, TensorInfo] = dict(tensors)
        self.folder = Path(folder)
        self.hf = any(names.hf_to_ms(n)[1] is not None for n in tensors) if hf is None else hf

    @classmethod
    def of(cls, weights, hf: Optional[bool] = None) -> "WholeSource":
        """The source of a folder's weight files (:func:`~ms_deepseek.checkpoint.weight_files.read_weight_files`)."""
        return cls(weights.tensors, weights.config, weights.folder, hf)

    def has(self, name: str) -> bool:
        if name in self.tensors:
            return True
        return (
            self.hf
            and names.is_stacked_expert(name)
            and names.ms_to_hf(name, self.cfg.n_routed_experts)[0] in self.tensors
        )

    def dtype(self, name: str) -> str:
        if name in self.tensors:
            return self.tensors[name].dtype
        return self.tensors[names.ms_to_hf(name, self.cfg.n_routed_experts)[0]].dtype

    def read(self, name: str, sl) -> np.ndarray:
        stacked = names.is_stacked_expert(name)
        if stacked and self.hf and name not in self.tensors:
            hf_names = names.ms_to_hf(name, self.cfg.n_routed_experts)
            ids = sl[0] if isinstance(sl[0], ExpertIds) else range(sl[0][0], sl[0][1])
            parts = [np.array(memmap(self.tensors[hf_names[e]])[_ranges(sl[1:])]) for e in ids]
            return np.stack(parts) if parts else np.zeros(slice_shape(sl), RAW_DTYPES[self.dtype(name)])
        info = self.tensors[name]
        if info.shape and _rows_only(sl, info.shape) and info.nbytes:
            return pread_rows(info, sl[0][0], sl[0][1])
        view = memmap(info)
        if sl and isinstance(sl[0], ExpertIds):
            return np.stack([np.array(view[e][_ranges(sl[1:])]) for e in sl[0]])
        return np.array(view[_ranges(sl)])


class ShardedSource:
    """``rank_RRRRR/<file>`` slices described by ``layout.json`` (a sharded training or converted checkpoint)."""

    def __init__(
        self,
        folder: Path,
        file_name: str = "model.safetensors",
        layout: Optional[ShardLayout] = None,
        check_shapes: bool = True,
    ):
        self.folder = Path(folder)
        self.layout = layout or read_layout(self.folder)
        self.file_name = file_name
        self._headers: Dict[int, Dict[str, TensorInfo]] = {}
        # the digests the checkpoint's state.json records; each rank file is checked when first read from
        self._recorded, self._checked = recorded(self.folder), set()
        import os

        root = os.path.realpath(self.folder)
        # the rank folders present bound every loop over ranks: layout.json's world size is only declared
        present = sorted(int(p.name[5:]) for p in self.folder.glob(RANK_DIR_GLOB) if p.name[5:].isdigit())
        for r in present:
            path = self.folder / rank_dir_name(r)
            real = os.path.realpath(path)
            if os.path.commonpath([root, real]) != root:
                raise UserError(f"{path}: rank folder lies outside the checkpoint folder (-> {real})")
        held = {r for r in present if (self.folder / rank_dir_name(r)).is_dir()}
        missing = next((r for r in range(self.layout.world_size) if r not in held), None)  # at most len(held) + 1
        if missing is not None:
            raise UserError(
                f"{self.folder / rank_dir_name(missing)}: missing rank folder (layout.json "
                f"describes {self.layout.world_size} ranks, {self.layout.describe()})"
            )
        extra = sorted(
            int(p.name[5:])
            for p in self.folder.glob("rank_*")
            if p.name[5:].isdigit() and int(p.name[5:]) >= self.layout.world_size
        )
        if extra:
            raise UserError(
                f"{self.folder / rank_dir_name(extra[0])}: rank folder of another layout "
                f"(layout.json describes {self.layout.world_size} ranks, {self.layout.describe()})"
            )
        if check_shapes:
            for r in range(self.layout.world_size):
                self.check_rank(r)

    def rank_tensors(self, rank: int) -> Dict[str, TensorInfo]:
        if rank not in self._headers:
            path = self.folder / rank_dir_name(rank) / self.file_name
            if not path.is_file():
                raise UserError(f"{path}: missing (every rank folder of a sharded checkpoint holds {self.file_name})")
            self._headers[rank] = read_header(path).tensors
        return self._headers[rank]

    def check_rank(self, rank: int) -> None:
        """The rank's file holds exactly its tensors, each with the slice shape and dtype the layout gives."""
        held = self.rank_tensors(rank)
        path = self.folder / rank_dir_name(rank) / self.file_name
        for name in self.layout.stored_in(rank):
            lay = self.layout.tensors[name]
            info = held.get(name)
            if info is None:
                raise UserError(f"{path}: tensor {name} is missing (layout.json puts it on rank {rank})")
            if tuple(info.shape) != lay.slice_shape() or info.dtype != lay.dtype:
                raise UserError(
                    f"{path}: tensor {name} is {info.dtype} {list(info.shape)}, layout.json says "
                    f"{lay.dtype} {list(lay.slice_shape())}: the layout file does not match the tensors"
                )
        if self.layout.distinct_only:  # a copy the layout does not know of would never be read
            extra = sorted(set(held) - set(self.layout.stored_in(rank)))
            if extra:
                raise UserError(
                    f"{path}: tensor {extra[0]} is stored here, layout.json (slices: distinct) stores "
                    f"it with another rank: the layout file does not match the tensors"
                )

    def has(self, name: str) -> bool:
        return name in self.layout.tensors

    def dtype(self, name: str) -> str:
        return self.layout.tensors[name].dtype

    def read(self, name: str, sl) -> np.ndarray:
        """The request put together from the stored slices that intersect it."""
        lay = self.layout.tensors[name]
        out = np.empty(slice_shape(sl), dtype=RAW_DTYPES[lay.dtype])
        covered = 0
        for rank, stored in self.layout.distinct_slices(name):
            src_index, dst_index = [], []
            empty = False
            for _axis, (want, have) in enumerate(zip(sl, stored)):
                if isinstance(have, ExpertIds) or isinstance(want, ExpertIds):
                    want_ids = list(want) if isinstance(want, ExpertIds) else list(range(want[0], want[1]))
                    have_ids = list(have) if isinstance(have, ExpertIds) else list(range(have[0], have[1]))
                    pos = {e: i for i, e in enumerate(have_ids)}
                    pairs = [(pos[e], j) for j, e in enumerate(want_ids) if e in pos]
                    if not pairs:
                        empty = True
                        break
                    src_index.append([p for p, _ in pairs])
                    dst_index.append([j for _, j in pairs])
                else:
                    lo, hi = max(want[0], have[0]), min(want[1], have[1])
                    if lo >= hi:
                        empty = True
                        break
                    src_index.append(slice(lo - have[0], hi - have[0]))
                    dst_index.append(slice(lo - want[0], hi - want[0]))
            if empty:
                continue
            if rank not in self._checked:  # the file's digest, before the first of its bytes is used
                check_file(self.folder, f"{rank_dir_name(rank)}/{self.file_name}", self._recorded)
                self._checked.add(rank)
            info = self.rank_tensors(rank)[name]
            whole_rows = (
                bool(src_index)
                and not isinstance(src_index[0], list)
                and all(
                    d.start == 0 and d.stop == n and s.start == 0 and s.stop == m
                    for d, s, n, m in zip(dst_index[1:], src_index[1:], out.shape[1:], info.shape[1:])
                )
            )
            if whole_rows and info.nbytes:  # rows of the stored slice land on rows of the request: read in place
                target = out[dst_index[0]]
                pread_rows(info, src_index[0].start, src_index[0].stop, target)
                covered += target.size
                continue
            view = memmap(info)
            piece = _take(view, src_index)
            del view  # unmap: the pages it touched leave this process
            _put(out, dst_index, piece)
            covered += piece.size
        if covered != out.size:
            raise UserError(
                f"{self.folder / 'layout.json'}: the slices of {name} do not cover it ({covered} of {out.size} values)"
            )
        return out


def _take(view: np.ndarray, index: List[object]) -> np.ndarray:
    """view[index] where list entries pick positions along one axis (the expert axis)."""
    if index and isinstance(index[0], list):
        return np.stack([np.array(view[i][tuple(index[1:])]) for i in index[0]])
    return np.array(view[tuple(index)])


def _put(out: np.ndarray, index: List[object], piece: np.ndarray) -> None:
    if index and isinstance(index[0], list):
        for k, j in enumerate(index[0]):
            out[j][tuple(index[1:])] = piece[k]
    else:
        out[tuple(index)] = piece
