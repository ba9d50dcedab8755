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
"""

from __future__ import annotations

import math
from typing import Dict, List

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


class Evaluator:
    def __init__(self, model, batches: List[Dict[str, np.ndarray]], world: int):
        self.model, self.batches, self.world = model, batches, world
        self.cell = _eval_cell(model)
        self.counts = [scored_tokens(b["labels"]) for b in batches]
        self.all_reduce = None
        if world > 1:
            from mindspore import ops

            self.all_reduce = ops.AllReduce()

    def __call__(self) -> Dict[str, float]:
        import mindspore as ms

        self.cell.set_train(False)  # the model too: dropless MoE, no capacity buffer limit
        try:
            nll = 0.0
            for batch, n in zip(self.batches, self.counts):
                loss = self.cell(ms.Tensor(batch["input_ids"]), ms.Tensor(batch["labels"]))
                nll += float(loss.asnumpy()) * n  # mean over the batch's tokens -> their sum
        finally:
            self.model.set_train(True)
        totals = np.asarray([nll, float(sum(self.counts))], np.float64)
        if self.all_reduce is not None:  # float32 on the wire: counts exact up to 2**24 tokens per validation
            totals = self.all_reduce(ms.Tensor(totals.astype(np.float32))).asnumpy().astype(np.float64)
        val_loss = totals[0] / max(totals[1], 1.0)
        return {"val_loss": float(val_loss), "val_ppl": float(math.exp(val_loss)) if val_loss < 700 else float("inf")}
