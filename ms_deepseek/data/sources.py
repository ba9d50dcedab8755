"""Where a recipe's data comes from, resolved once: the embedded corpora (built on first use), the folders a
recipe names with their checked metadata, the held-out share, and the one tokenizer they were prepared with.

:func:`resolve_data` returns a :class:`ResolvedData` that the preflight, training and validation all take
(:func:`ms_deepseek.data.dataset.build_train_dataset`, :mod:`ms_deepseek.data.validation`).
"""

from __future__ import annotations

import fcntl
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from ms_deepseek.config.data import DataConfig
from ms_deepseek.core.errors import UserError
from ms_deepseek.data.storage import DestinationRaced, find_meta, load_meta


def default_cache_dir() -> Path:
    """Where the embedded default corpus is built once: $MS_DEEPSEEK_CACHE or ~/.cache/ms_deepseek."""
    return Path(os.environ.get("MS_DEEPSEEK_CACHE", "~/.cache/ms_deepseek")).expanduser()


def ensure_embedded_default(cfg: DataConfig, cache_dir: Union[str, Path, None] = None, progress: bool = True) -> Path:
    """The embedded default corpus for ``cfg``, built under ``cache_dir/data/`` if not there yet.

    Safe to call from every rank at once (:func:`_built_once`).
    """
    import platform

    from ms_deepseek.data.prepare import prepare_embedded_default

    py = "".join(platform.python_version_tuple()[:2])
    name = f"embedded-py{py}-s{cfg.embedded_seq_len}-v{cfg.embedded_vocab_size}-b{cfg.embedded_max_bytes}"

    def build(dest: Path) -> str:
        return prepare_embedded_default(
            dest,
            seq_len=cfg.embedded_seq_len,
            vocab_size=cfg.embedded_vocab_size,
            max_bytes=cfg.embedded_max_bytes,
            progress=progress,
        )[1]

    return _built_once(name, build, cache_dir, "embedded default corpus" if progress else None)


def ensure_embedded_chat(cfg: DataConfig, cache_dir: Union[str, Path, None] = None) -> Path:
    """The embedded chat corpus (SFT: :func:`ms_deepseek.data.prepare.prepare_embedded_chat`) at ``cfg``'s
    embedded sequence length, tokenized with the embedded default corpus's tokenizer; built once under
    ``cache_dir/data/``."""
    import platform

    from ms_deepseek.data.prepare import prepare_embedded_chat
    from ms_deepseek.data.tokenizer import find_tokenizer_file

    tokenizer = find_tokenizer_file(ensure_embedded_default(cfg, cache_dir, progress=False))
    py = "".join(platform.python_version_tuple()[:2])
    name = f"embedded-chat-py{py}-s{cfg.embedded_seq_len}-v{cfg.embedded_vocab_size}-b{cfg.embedded_max_bytes}"
    return _built_once(name, lambda dest: prepare_embedded_chat(dest, tokenizer, cfg.embedded_seq_len)[1], cache_dir)


def _built_once(name: str, build, cache_dir: Union[str, Path, None], announce: Optional[str] = None) -> Path:
    """``cache_dir/data/<name>``, made by ``build(dest) -> summary`` if not there yet. Safe to call from every
    rank at once: the folder is installed by one atomic rename, ranks on one host wait for the first builder
    instead of all building, and a process that loses the race across hosts uses the winner's (identical)
    folder."""
    dest = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    dest = dest / "data" / name
    if find_meta(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if find_meta(dest):
            return dest
        try:
            summary = build(dest)
            if announce:
                print(f"{announce}: {summary}")
        except (DestinationRaced, UserError):
            if not find_meta(dest):
                raise
    return dest


def resolve_data_dir(cfg: DataConfig, cache_dir: Union[str, Path, None] = None, progress: bool = True) -> Path:
    """The prepared folder ``cfg`` points at: ``data.path``, or the embedded default when it is unset.

    A ``data.path`` that does not exist is an error (never silently replaced).
    """
    if cfg.path is not None:
        return Path(cfg.path).expanduser()
    return ensure_embedded_default(cfg, cache_dir, progress)


def holdout_count(num_samples: int, fraction: Optional[float]) -> int:
    """Samples held out for validation at the tail of a folder of ``num_samples``."""
    return 0 if not fraction else min(num_samples - 1, max(1, math.ceil(fraction * num_samples)))


def checked_meta(
    data_dir: Path,
    data_cfg: DataConfig,
    key: str,
    *,
    max_positions: Optional[int] = None,
    vocab_size: Optional[int] = None,
    tokenizer: Any = None,
) -> Dict:
    """A prepared folder's meta.json, checked against the recipe and the model (errors name ``key``).
    ``tokenizer``: ``data.tokenizer`` already loaded (:func:`resolve_data`); else it is loaded here."""
    meta = load_meta(data_dir, key)
    where = f"{key}: {data_dir}"
    if data_cfg.format is not None and meta["format"] != data_cfg.format:
        raise UserError(
            f"data.format: '{data_cfg.format}' but {data_dir} was prepared as '{meta['format']}' "
            "(leave data.format out to use the folder's)"
        )
    if data_cfg.bucket_boundaries is not None and meta["format"] != "sft":
        raise UserError(
            f"data.bucket_boundaries: only used with SFT data, and {data_dir} was prepared as "
            f"'{meta['format']}' (pretraining windows all have length seq_len)"
        )
    seq_len = int(meta["seq_len"])
    if data_cfg.seq_len is not None and data_cfg.seq_len != seq_len:
        raise UserError(
            f"data.seq_len: {data_cfg.seq_len} but {data_dir} was prepared with seq_len {seq_len} "
            "(re-run prepare-data, or leave data.seq_len out)"
        )
    if max_positions is not None and seq_len > max_positions:
        raise UserError(
            f"{where}: sequences of {seq_len} tokens are longer than the model's "
            f"max_position_embeddings {max_positions}"
        )
    max_id = int(meta["counts"]["max_token_id"])
    if vocab_size is not None and max_id >= vocab_size:
        raise UserError(
            f"{where}: holds token id {max_id} but the model's vocab_size is {vocab_size} "
            f"(the data's tokenizer has {meta['tokenizer']['vocab_size']} tokens)"
        )
    if data_cfg.tokenizer is not None:
        if tokenizer is None:
            from ms_deepseek.data.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(data_cfg.tokenizer)
        if tokenizer.sha256() != meta["tokenizer"]["sha256"]:
            raise UserError(
                f"data.tokenizer: {data_cfg.tokenizer} is not the tokenizer {data_dir} was prepared with "
                f"({meta['tokenizer']['source']})"
            )
    return meta


def check_same_preparation(first: Tuple[str, Path, Dict], other: Tuple[str, Path, Dict]) -> None:
    """Two folders read into one model must share tokenizer, sequence length and format."""
    (key0, dir0, meta0), (key, folder, meta) = first, other
    if meta["format"] != meta0["format"]:
        raise UserError(
            f"{key}: {folder} was prepared as '{meta['format']}', {key0} {dir0} as "
            f"'{meta0['format']}'; all folders must share one format"
        )
    if int(meta["seq_len"]) != int(meta0["seq_len"]):
        raise UserError(
            f"{key}: {folder} was prepared with seq_len {meta['seq_len']}, {key0} {dir0} with "
            f"{meta0['seq_len']}; all folders must share one sequence length"
        )
    if meta["tokenizer"]["sha256"] != meta0["tokenizer"]["sha256"]:
        raise UserError(
            f"{key}: {folder} was prepared with tokenizer {meta['tokenizer']['source']} "
            f"({meta['tokenizer']['vocab_size']} tokens), {key0} {dir0} with "
            f"{meta0['tokenizer']['source']} ({meta0['tokenizer']['vocab_size']} tokens); "
            "all folders must share one tokenizer"
        )


def source_folders(data_cfg: DataConfig, cache_dir=None, progress: bool = True) -> List[Tuple[str, Path, float]]:
    """(recipe key, folder, weight) of every training source (the embedded default when none is set)."""
    if data_cfg.path is None:
        return [("data.path", resolve_data_dir(data_cfg, cache_dir, progress), 1.0)]
    if isinstance(data_cfg.path, str):
        return [("data.path", Path(data_cfg.path).expanduser(), 1.0)]
    return [(f"data.path[{i}]", Path(s.path).expanduser(), s.weight) for i, s in enumerate(data_cfg.path)]


@dataclass(frozen=True)
class ResolvedData:
    """A recipe's ``data:`` section resolved once for a run: every training source (recipe key, folder, weight; the
    embedded default built when ``data.path`` is unset) with its ``meta.json`` checked against the recipe and the
    model, the validation folder's (``data.validation.path``) checked the same way and prepared like the sources,
    and the run's one tokenizer (``data.tokenizer``, else the prepared folder's when the caller loaded it; None:
    not loaded). The preflight's checks, the training batches and the validation sets read from it, not from the
    folders' metadata again."""

    config: DataConfig
    sources: Tuple[Tuple[str, Path, float], ...]
    metas: Tuple[Dict, ...]
    validation: Optional[Tuple[Path, Dict]] = None
    tokenizer: Any = None

    @property
    def seq_len(self) -> int:
        return int(self.metas[0]["seq_len"])

    @property
    def pad_id(self) -> int:
        return int(self.metas[0]["tokenizer"]["pad_id"])


def resolve_data(
    data_cfg: DataConfig,
    *,
    max_positions: Optional[int] = None,
    vocab_size: Optional[int] = None,
    cache_dir: Union[str, Path, None] = None,
    progress: bool = True,
    tokenizer: Any = None,
) -> ResolvedData:
    """Resolve ``data_cfg`` once (:class:`ResolvedData`): the sources and their checked metadata, the validation
    folder's, every folder prepared like the first. ``tokenizer``: the run's tokenizer when the caller has loaded
    it (``train.preflight``); ``data.tokenizer`` is loaded here otherwise, once for every folder's check."""
    if tokenizer is None and data_cfg.tokenizer is not None:
        from ms_deepseek.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(data_cfg.tokenizer)
    bounds = dict(max_positions=max_positions, vocab_size=vocab_size, tokenizer=tokenizer)
    folders = source_folders(data_cfg, cache_dir, progress)
    metas = [checked_meta(folder, data_cfg, key, **bounds) for key, folder, _ in folders]
    first = (folders[0][0], folders[0][1], metas[0])
    for (key, folder, _), meta in zip(folders[1:], metas[1:]):
        check_same_preparation(first, (key, folder, meta))
    validation = None
    val = data_cfg.validation
    if val is not None and val.path is not None:
        folder = Path(val.path).expanduser()
        meta = checked_meta(folder, data_cfg, "data.validation.path", **bounds)
        check_same_preparation(first, ("data.validation.path", folder, meta))
        validation = (folder, meta)
    return ResolvedData(data_cfg, tuple(folders), tuple(metas), validation, tokenizer)


def as_resolved(data: Union[DataConfig, ResolvedData], **resolve) -> ResolvedData:
    """``data`` as resolved: a :class:`ResolvedData` as given, a recipe's ``data:`` section resolved now
    (:func:`resolve_data` with ``resolve``)."""
    return data if isinstance(data, ResolvedData) else resolve_data(data, **resolve)
