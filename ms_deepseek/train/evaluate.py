"""Validation loss during training: the model in evaluation mode on the fixed validation batches.

:class:`Evaluator` runs the model with ``set_train(False)`` (the MoE layers' capacity is then
the token count: dropless, as DeepSeek-V2 evaluates) on this rank's validation batches
(:mod:`ms_deepseek.data.validation`) and returns the token-weighted mean cross-entropy
``val_loss`` and ``val_ppl = exp(val_loss)``. Under data parallelism every worker evaluates
its share and one AllReduce of ``[sum of token losses, tokens]`` makes the value the mean
over all of them (the same number a single worker gets on the same samples).

The eval Cell is compiled once (graph mode caches it by its phase and input shapes: every
validation batch has the same [B, seq_len] shape); the training step keeps its own graph, and
the model is put back in training mode afterwards.

Sharded layouts (tp / pp / ep, Ascend only): each rank reads its rows of every validation batch
by the training rule (:func:`ms_deepseek.parallel_plan.ranks.data_coordinates`: one micro-batch
[rows, T]), and the eval Cell is compiled under ``AutoParallel`` with the training plan's
strategies (the same primitives carry them) and dataset strategy
(:func:`ms_deepseek.parallel_apply.apply.eval_parallel_wrap`, MindFormers' pattern). MindSpore's loss
is then already the mean over the whole global batch (its reductions over the dp-split batch
axis get their AllReduce inserted), so the reduction differs from data parallelism
(:func:`reduce_validation`): batch j weighs by its global token count, the sum of every rank's
count over the ranks holding each slice. With pp > 1 the last stage computes the loss and
MindSpore broadcasts it to the other stages (``pipeline(output_broadcast=True)``).
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from ms_deepseek.data.chat import IGNORE_INDEX


def _eval_cell(model):
    import mindspore as ms
    from mindspore import nn

    class EvalLoss(nn.Cell):
        """(input_ids, labels) -> mean next-token cross-entropy over labels != -100."""

        def __init__(self, net):
            super().__init__(auto_prefix=False)  # the model's parameters keep their names
            self.model = net
            # Called from Python (PyNative) the model returns an output object; inside a graph, a tuple.
            self.graph = ms.get_context("mode") == ms.GRAPH_MODE

        def construct(self, input_ids, labels):
            if self.graph:
                out = self.model(input_ids, labels)
                return out[1]
            return self.model(input_ids, labels).loss

    return EvalLoss(model)


def scored_tokens(labels: np.ndarray) -> int:
    """Tokens the loss counts: next-token targets (labels shifted by one) that are not -100."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def reduce_validation(
    losses: Sequence[float],
    counts: Sequence[int],
    sum_over_ranks: Callable[[np.ndarray], np.ndarray],
    replicas: Optional[int] = None,
) -> float:
    """The token-weighted validation loss of all ranks (pure; ``sum_over_ranks`` is the AllReduce).

    ``losses[j]`` / ``counts[j]``: the eval Cell's loss and this rank's scored tokens of batch j.
    Data parallel (``replicas`` None): ``losses[j]`` is the mean over this rank's rows, so
    ``[sum_j losses[j] * counts[j], sum_j counts[j]]`` is summed over the ranks. Sharded
    (``replicas`` = ranks holding the same rows, world / batch slices): ``losses[j]`` is MindSpore's
    mean over the global batch j, whose token count is the sum of the ranks' counts / replicas."""
    losses = np.asarray(losses, np.float64)
    counts = np.asarray(counts, np.float64)
    if replicas is None:
        totals = sum_over_ranks(np.asarray([float((losses * counts).sum()), float(counts.sum())]))
        return float(totals[0] / max(totals[1], 1.0))
    tokens = sum_over_ranks(counts) / replicas  # [batches]: global tokens of each batch
    return float((losses * tokens).sum() / max(float(tokens.sum()), 1.0))


class Evaluator:
    def __init__(self, model, batches: List[Dict[str, np.ndarray]], world: int, parallel=None):
        """``parallel``: a sharded run's ParallelConfig (None: single worker or data parallel)."""
        self.model, self.batches, self.world = model, batches, world
        self.cell = _eval_cell(model)
        self.replicas = None
        if parallel is not None:
            from ms_deepseek.parallel_apply.apply import eval_parallel_wrap
            from ms_deepseek.parallel_plan.ranks import batch_slices

            self.cell = eval_parallel_wrap(self.cell, parallel)
            self.replicas = world // batch_slices(parallel)
        self.counts = [scored_tokens(b["labels"]) for b in batches]
        self.all_reduce = None
        if world > 1:
            from mindspore import ops

            self.all_reduce = ops.AllReduce()

    def _sum_over_ranks(self, values: np.ndarray) -> np.ndarray:
        if self.all_reduce is None:
            return values
        import mindspore as ms

        # float32 on the wire: counts exact up to 2**24 tokens per validation
        return self.all_reduce(ms.Tensor(values.astype(np.float32))).asnumpy().astype(np.float64)

    def loss(self, batches: List[Dict[str, np.ndarray]], counts: Optional[List[int]] = None) -> float:
        """The token-weighted loss of all ranks on ``batches`` (this rank's share, each of the shape the cell was
        compiled for: one compiled eval graph serves the overall set and every per-source set)."""
        import mindspore as ms

        counts = counts if counts is not None else [scored_tokens(b["labels"]) for b in batches]
        self.cell.set_train(False)  # the model too: eval capacity (dropless by default)
        try:
            losses = [float(self.cell(ms.Tensor(b["input_ids"]), ms.Tensor(b["labels"])).asnumpy()) for b in batches]
        finally:
            self.model.set_train(True)
        return float(reduce_validation(losses, counts, self._sum_over_ranks, self.replicas))

    def __call__(self) -> Dict[str, float]:
        val_loss = self.loss(self.batches, self.counts)
        return {"val_loss": float(val_loss), "val_ppl": float(math.exp(val_loss)) if val_loss < 700 else float("inf")}


class Evaluation:
    """When a run validates, and on what: ``val_loss`` / ``val_ppl`` every ``train.eval_interval`` steps and at
    the call's last step (with ``data.validation``), ``val_loss/<source>`` for a mixture's held-out sets. The
    :class:`Evaluator` (its graph compiled) is built at the first validation."""

    def __init__(self, model, data, world: int, parallel, every: Optional[int], stop_at: int):
        """``data``: the run's ``train.build.TrainData``; ``parallel``: a sharded run's ParallelConfig."""
        self.model, self.data, self.world, self.parallel = model, data, world, parallel
        self.every, self.stop_at = every, stop_at
        self.evaluator: Optional[Evaluator] = None

    def __call__(self, step: int) -> Optional[Dict[str, float]]:
        """The validation values of ``step``, or None when it does not validate."""
        validation = self.data.validation
        if validation is None or not ((self.every and step % self.every == 0) or step == self.stop_at):
            return None
        if self.evaluator is None:
            self.evaluator = Evaluator(self.model, validation.batches, self.world, parallel=self.parallel)
        result = self.evaluator()
        for name, per_source in self.data.validation_by_source.items():  # the same compiled eval graph
            result[f"val_loss/{name}"] = self.evaluator.loss(per_source.batches)
        return result
