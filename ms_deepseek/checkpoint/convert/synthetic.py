"""Random checkpoints of any DeepSeek-V2 config, in either layout, written tensor by tensor.

For tests and the conversion benchmark (``tools/bench_convert.py``): values are
normal(0, std) in the requested dtype (bfloat16 by rounding float32 to nearest even),
taken from a bounded pool in bounded chunks, so a multi-GB checkpoint is written
quickly and with flat memory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ms_deepseek.checkpoint.safetensors_io import DTYPE_SIZES, encode_array, header_bytes, numel
from ms_deepseek.checkpoint.weight_files import INDEX_NAME, SINGLE_NAME
from ms_deepseek.config.inventory import expected_hf_shapes, expected_ms_shapes
from ms_deepseek.config.model import DeepseekV2Config
from ms_deepseek.core.dtypes import safetensors_code

_CHUNK = 1 << 22  # elements encoded at a time
_POOL = 1 << 24  # normal values drawn up front


def write_random_checkpoint(
    folder,
    cfg: DeepseekV2Config,
    *,
    dtype: str = "bfloat16",
    layout: str = "hf",
    num_shards: int = 1,
    seed: int = 0,
    std: float = 0.02,
    dtype_overrides: Optional[Dict[str, str]] = None,
    progress: bool = False,
) -> Path:
    """Write ``config.json`` and random weights to ``folder``; returns ``folder``.

    ``num_shards == 1`` writes ``model.safetensors``; more writes ``model-XXXXX-of-YYYYY.safetensors``
    plus the index, cutting at roughly equal byte counts. ``dtype_overrides`` maps tensor names to
    another dtype (to build mixed-dtype checkpoints).
    """
    import numpy as np

    from ms_deepseek.core.progress import progress_bar

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shapes = expected_hf_shapes(cfg) if layout == "hf" else expected_ms_shapes(cfg)
    overrides = {k: safetensors_code(v) for k, v in (dtype_overrides or {}).items()}
    entries: List[Tuple[str, str, Tuple[int, ...]]] = [
        (name, overrides.get(name, safetensors_code(dtype)), shape) for name, shape in shapes.items()
    ]
    total = sum(numel(s) * DTYPE_SIZES[d] for _, d, s in entries)
    shards = _cut(entries, total, num_shards)
    n = len(shards)
    names = [SINGLE_NAME] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    rng = np.random.default_rng(seed)
    # Draw from one pool of normal values at random offsets: as random as needed for conversion tests and
    # benchmarks, and several GB are written in seconds instead of minutes.
    pool = rng.standard_normal(min(sum(numel(e[2]) for e in entries), _POOL), dtype=np.float32) * np.float32(std)
    weight_map = {}
    with progress_bar(
        total=total, enabled=progress, unit="B", unit_scale=True, unit_divisor=1024, desc="random checkpoint"
    ) as bar:
        for file_name, tensors in zip(names, shards):
            tensors = sorted(tensors, key=lambda e: -DTYPE_SIZES[e[1]])  # keep every tensor aligned
            weight_map.update({name: file_name for name, _, _ in tensors})
            with open(folder / file_name, "wb") as f:
                f.write(header_bytes(tensors, {"format": "pt" if layout == "hf" else "ms"}))
                for _name, sf_dtype, shape in tensors:
                    _write_random(f, numel(shape), sf_dtype, pool, rng, bar)
    if n > 1:
        (folder / INDEX_NAME).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
        )
    cfg.save(folder / "config.json", dtype=dtype)
    return folder


def _cut(entries: List[Tuple[str, str, Tuple[int, ...]]], total: int, num_shards: int):
    """The tensors in order, cut into at most ``num_shards`` files of roughly equal byte counts."""
    target = -(-total // num_shards)
    shards: List[List[Tuple[str, str, Tuple[int, ...]]]] = [[]]
    size = 0
    for entry in entries:
        if size >= target and len(shards) < num_shards:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += numel(entry[2]) * DTYPE_SIZES[entry[1]]
    return shards


def _write_random(f, count: int, sf_dtype: str, pool, rng, bar) -> None:
    """``count`` values drawn from ``pool`` at random offsets, encoded as ``sf_dtype``, in chunks."""
    left = count
    while left:
        step = min(left, _CHUNK)
        start = int(rng.integers(0, len(pool) - step + 1))
        data = encode_array(pool[start : start + step], sf_dtype)
        f.write(data)
        bar.update(len(data))
        left -= step
