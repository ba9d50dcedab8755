"""What goes into and out of the trainer's steps, apart from the loop itself.

* batches in: :func:`first_batch_checked` (an unreadable dataset fails as one line before
  anything compiles), :func:`stack_micro_batches` (a step's k micro-batches -> one array);
* checkpoint state: :func:`model_tensors`, :func:`load_into`, :func:`rng_state` /
  :func:`restore_rng` (numpy and MindSpore generators, so a resume continues exactly);
* data-parallel workers: :class:`RankMean` (logged values averaged over ranks) and
  :func:`replica_digests` (replicas proven to hold the same weights at each save).
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import numpy as np

from ms_deepseek.errors import UserError
from ms_deepseek.train import checkpoint as ckpt_mod


def model_tensors(model) -> Dict[str, object]:
    """The model's parameters under its own names, without the expert placement table (plan data)."""
    return {name: p for name, p in model.parameters_and_names() if not name.endswith("expert_placement")}


def rng_state() -> Dict:
    import mindspore as ms

    np_state = np.random.get_state()
    return {"numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
            "mindspore_seed": ms.get_seed(),
            "mindspore_generator": ms.get_rng_state().asnumpy().tolist()}


def restore_rng(state: Dict) -> None:
    import mindspore as ms

    if "numpy" in state:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if state.get("mindspore_seed") is not None:
        ms.set_seed(int(state["mindspore_seed"]))
    if "mindspore_generator" in state:
        dtype = ms.get_rng_state().asnumpy().dtype  # the generator's own state dtype (uint8)
        ms.set_rng_state(ms.Tensor(np.asarray(state["mindspore_generator"], dtype=dtype)))


def load_into(params: Dict[str, object], path: Path, what: str) -> None:
    """Copy every named tensor of a safetensors file into ``params``; all must be present, shapes equal."""
    import mindspore as ms

    stored = ckpt_mod.load_tensors(path)
    missing = [n for n in params if n not in stored]
    if missing:
        raise UserError(f"{path}: {what} tensor {missing[0]} is missing"
                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                        + "; the checkpoint does not match this recipe's model")
    for name, param in params.items():
        value = stored[name]
        if tuple(value.shape) != tuple(param.shape):
            raise UserError(f"{path}: {what} tensor {name} has shape {list(value.shape)}, "
                            f"the model has {list(param.shape)}")
        param.set_data(ms.Tensor(value.asnumpy(), dtype=param.dtype))


def stack_micro_batches(parts: List[Dict[str, np.ndarray]], pad_id: int):
    """k micro-batches -> one [k * b, T] pair, in order (SFT buckets of one step padded to the longest)."""
    from ms_deepseek.data.chat import IGNORE_INDEX

    if len(parts) == 1:
        return parts[0]["input_ids"], parts[0]["labels"]
    width = max(p["input_ids"].shape[1] for p in parts)
    ids, labels = [], []
    for p in parts:
        extra = width - p["input_ids"].shape[1]
        # pads go after the real tokens: causal attention keeps them invisible, -100 keeps them out of the loss
        ids.append(np.pad(p["input_ids"], ((0, 0), (0, extra)), constant_values=pad_id) if extra
                   else p["input_ids"])
        labels.append(np.pad(p["labels"], ((0, 0), (0, extra)), constant_values=IGNORE_INDEX) if extra
                      else p["labels"])
    return np.concatenate(ids), np.concatenate(labels)


def first_batch_checked(dataset):
    """The batch iterator, with its first batch already read: unreadable shards fail here, as one line."""
    import itertools

    it = iter(dataset)
    try:
        first = next(it)
    except UserError:
        raise
    except Exception as exc:  # MindSpore's reader raises RuntimeError with a multi-line report
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        # the report's "Dataset Pipeline Error Message" section holds the reason, e.g. "Failed to read file."
        reason = next((ln for ln in lines if ln.startswith("[ERROR]")), lines[0] if lines else type(exc).__name__)
        raise UserError(f"data.path: {dataset.data_dir}: cannot read the training samples "
                        f"({reason[:300]}); prepare the folder again with `ms-deepseek prepare-data`") from None
    return itertools.chain([first], it)


def replica_digests(tensors: Dict[str, object], world: int) -> List[str]:
    """SHA-1 of this rank's weights, all-gathered: one hex digest per rank. Raises if they differ."""
    import hashlib

    import mindspore as ms
    from mindspore import ops

    h = hashlib.sha1()
    for name in sorted(tensors):
        h.update(name.encode() + tensors[name].asnumpy().tobytes())
    mine = np.frombuffer(h.digest(), dtype=np.int32)  # 20 bytes -> [5]
    gathered = ops.AllGather()(ms.Tensor(mine)).asnumpy().reshape(world, -1)  # [world, 5]
    digests = [row.astype(np.int32).tobytes().hex() for row in gathered]
    if len(set(digests)) != 1:
        raise RuntimeError(f"data-parallel replicas hold different weights (sha1 per rank: {digests}); "
                           "gradient averaging is broken")
    return digests


class RankMean:
    """Mean of the logged values over data-parallel workers (one small AllReduce per step)."""

    def __init__(self, world: int):
        from mindspore import ops

        self.world = world
        self.all_reduce = ops.AllReduce()

    def __call__(self, loss: float, aux: float, stats: np.ndarray):
        import mindspore as ms

        vec = np.concatenate([[loss, aux], stats.reshape(-1)]).astype(np.float32)
        out = self.all_reduce(ms.Tensor(vec)).asnumpy() / self.world
        return float(out[0]), float(out[1]), out[2:].reshape(stats.shape)
