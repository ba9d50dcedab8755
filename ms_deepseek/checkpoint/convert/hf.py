"""``hf_to_ms`` and ``ms_to_hf``: streaming, dtype-preserving checkpoint conversion.

Both directions run the same four steps:

1. open and check the source (index, headers, names, shapes, dtypes) before writing anything;
2. map the output shards as byte ranges of the source files (:mod:`.byte_map`);
3. write the shards into a temporary sibling of the destination, ``workers`` shards at
   a time, each byte range copied in the kernel (``os.copy_file_range``) in 64 MB steps,
   so host memory stays flat whatever the model size;
4. write the index, config and tokenizer files, then rename the folder into place.

On any error (or Ctrl-C) the temporary folder is removed and the destination is untouched.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Union

from ms_deepseek.checkpoint.convert.byte_map import ByteMap, map_hf_to_ms, map_ms_to_hf, shard
from ms_deepseek.checkpoint.safetensors_io import DTYPE_NAMES, read_header, write_file
from ms_deepseek.checkpoint.weight_files import INDEX_NAME, WeightFiles, read_weight_files
from ms_deepseek.core.atomic import check_destination, fsync_path, install, temporary_sibling
from ms_deepseek.core.errors import UserError
from ms_deepseek.core.safe_io import created_parents, remove_empty_dirs

# Files carried along from the source folder when present (tokenizer, generation defaults).
CARRIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
DEFAULT_SHARD_SIZE = "5GB"
DEFAULT_WORKERS = 4

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(value: Union[int, str], what: str = "--shard-size") -> int:
    """``"5GB"`` -> 5_000_000_000 (decimal units as in HuggingFace; ``GiB`` for binary); ints pass through."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(value), flags=re.IGNORECASE)
        if not match:
            raise UserError(f"{what} {value!r}: expected a size such as 500MB, 5GB or 2GiB")
        size = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    if size <= 0:
        raise UserError(f"{what} {value!r}: must be > 0")
    return size


@dataclass
class ConvertResult:
    dst: Path
    files: List[str]
    num_tensors: int
    total_bytes: int
    seconds: float


class _Cancelled(Exception):
    """Another worker failed: stop copying."""


# ------------------------------------------------------------------- destination
# One atomic writer for every checkpoint folder (see ms_deepseek.core.atomic).
_check_destination = check_destination
_install = install


# ------------------------------------------------------------------- writing
def _progress(total: int, desc: str, enabled: bool):
    from ms_deepseek.core.progress import progress_bar

    return progress_bar(
        total=total,
        enabled=enabled,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=desc,
        dynamic_ncols=True,
        smoothing=0.1,
    )


def _write_shards(
    byte_map: ByteMap, tmp: Path, file_names: List[str], metadata: Dict[str, str], workers: int, bar, fsync: bool
) -> None:
    lock = threading.Lock()
    cancelled = threading.Event()

    def on_bytes(n: int) -> None:
        if cancelled.is_set():
            raise _Cancelled()
        with lock:
            bar.update(n)

    def one(k: int) -> None:
        write_file(tmp / file_names[k], byte_map.shards[k], metadata, on_bytes=on_bytes, fsync=fsync)

    workers = max(1, min(workers, len(byte_map.shards)))
    if workers == 1:
        for k in range(len(byte_map.shards)):
            one(k)
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="convert") as pool:
        futures = [pool.submit(one, k) for k in range(len(byte_map.shards))]
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
        finally:
            # Harmless when all succeeded; on an error or Ctrl-C the running copies stop at their next chunk.
            cancelled.set()
            for f in futures:
                f.cancel()
    errors = [f.exception() for f in futures if not f.cancelled() and f.exception() is not None]
    real = [e for e in errors if not isinstance(e, _Cancelled)]
    if errors:
        raise (real or errors)[0]


def _write_json(path: Path, data, fsync: bool = True) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, indent=2) + "\n")
        if fsync:
            f.flush()
            os.fsync(f.fileno())


@dataclass(frozen=True)
class WriteOptions:
    """How a converted folder is written (the converter's command-line options)."""

    shard_size: Union[int, str] = DEFAULT_SHARD_SIZE  # bytes per output file, or "5GB"
    workers: int = DEFAULT_WORKERS  # files written in parallel
    overwrite: bool = False  # replace a non-empty destination
    progress: bool = True  # a progress bar (on a terminal)
    fsync: bool = True  # fsync every file and folder before the rename


def _convert(
    src, dst, direction: str, tensors_of: Callable[[WeightFiles], list], options: WriteOptions
) -> ConvertResult:
    src = Path(src)
    parse_size(options.shard_size)
    _check_workers(options.workers)
    return convert_with(read_weight_files(src), src, dst, direction, tensors_of, options)


def _check_workers(workers) -> None:
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise UserError(f"--workers {workers!r}: must be an integer >= 1")


def convert_with(
    ckpt, src, dst, direction: str, tensors_of: Callable[[WeightFiles], list], options: WriteOptions
) -> ConvertResult:
    """Write the planned HF / ms folder for an opened source (``ckpt``: folder, config, config_path)."""
    workers, overwrite, progress, fsync = options.workers, options.overwrite, options.progress, options.fsync
    shard_size = options.shard_size
    start = time.perf_counter()
    src, dst = Path(src), Path(dst)
    _check_workers(workers)
    byte_map = shard(tensors_of(ckpt), parse_size(shard_size))
    _check_destination(src, dst, overwrite)
    new_dirs = created_parents(dst)  # removed again if the conversion fails
    dst.parent.mkdir(parents=True, exist_ok=True)
    n = len(byte_map.shards)
    file_names = [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    metadata = {"format": "ms"} if direction == "hf-to-ms" else {"format": "pt"}
    tmp = temporary_sibling(dst)
    tmp.mkdir()  # not tempfile.mkdtemp: the result keeps the user's umask, not mode 0700
    try:
        with _progress(byte_map.total_bytes, direction, progress) as bar:
            _write_shards(byte_map, tmp, file_names, metadata, workers, bar, fsync)
        for k, tensors in enumerate(byte_map.shards):  # re-read what was written: headers only, cheap
            written = read_header(tmp / file_names[k]).tensors
            if [(t.name, t.dtype, t.shape) for t in tensors] != [(i.name, i.dtype, i.shape) for i in written.values()]:
                raise RuntimeError(f"internal: {file_names[k]} does not hold the planned tensors")
        weight_map = {t.name: file_names[k] for k, tensors in enumerate(byte_map.shards) for t in tensors}
        _write_json(
            tmp / INDEX_NAME,
            {"metadata": {"total_size": byte_map.total_bytes}, "weight_map": dict(sorted(weight_map.items()))},
            fsync,
        )
        for name in CARRIED_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, tmp / name)
        torch_dtype = DTYPE_NAMES[byte_map.dtype]
        if direction == "hf-to-ms":
            shutil.copyfile(ckpt.config_path, tmp / "config.json")
        else:
            ckpt.config.save(tmp / "config.json", dtype=torch_dtype)
            if not (tmp / "generation_config.json").exists():
                cfg = ckpt.config
                gen = {"_from_model_config": True, "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}
                if cfg.pad_token_id is not None:
                    gen["pad_token_id"] = cfg.pad_token_id
                _write_json(tmp / "generation_config.json", gen, fsync)
        fsync_path(tmp)
        _install(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_empty_dirs(new_dirs)
        raise
    return ConvertResult(
        dst=dst,
        files=file_names,
        num_tensors=byte_map.num_tensors,
        total_bytes=byte_map.total_bytes,
        seconds=time.perf_counter() - start,
    )


def hf_to_ms(
    src,
    dst,
    *,
    shard_size: Union[int, str] = DEFAULT_SHARD_SIZE,
    workers: int = DEFAULT_WORKERS,
    overwrite: bool = False,
    progress: bool = True,
    fsync: bool = True,
) -> ConvertResult:
    """HuggingFace folder -> ms_deepseek folder (routed experts stacked per layer, dtype and bytes unchanged)."""
    return _convert(src, dst, "hf-to-ms", map_hf_to_ms, WriteOptions(shard_size, workers, overwrite, progress, fsync))


def ms_to_hf(
    src,
    dst,
    *,
    shard_size: Union[int, str] = DEFAULT_SHARD_SIZE,
    workers: int = DEFAULT_WORKERS,
    overwrite: bool = False,
    progress: bool = True,
    fsync: bool = True,
) -> ConvertResult:
    """ms_deepseek folder or training checkpoint -> HuggingFace folder (per-expert tensors, release config)."""
    from ms_deepseek.checkpoint.opener import lora_not_a_model, lora_of

    if lora_of(Path(src)) is not None:  # the same line as a sharded LoRA checkpoint's (sharded.merge_to_hf)
        raise lora_not_a_model(src)
    return _convert(src, dst, "ms-to-hf", map_ms_to_hf, WriteOptions(shard_size, workers, overwrite, progress, fsync))
