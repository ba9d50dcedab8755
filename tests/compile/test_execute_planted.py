"""Mistakes MindSpore's compiler accepts and ``plan --execute`` refuses.

Each case plants one mistake in the product's sharded path and runs ``ms-deepseek plan --recipe R --execute``
on a small layout: the compile still succeeds on every rank (the mistake is not a layout error), and the
comparison of the executed ranks with one device names the step, rank and tensor where they part. Without
a plant the same layout agrees (the first case), so each failure is the plant's.

The plants reach the compile workers (separate processes) through a ``sitecustomize`` module on their
``PYTHONPATH``, active only under MindSpore's dry run (``MS_SIMULATION_LEVEL``): the one-device run stays the
product's own. The dataset plant is in this process, where the executor reads each rank's batches.
"""

import json
import os
import textwrap

import pytest

from builders import SMALL_MODEL, main_captured, write_recipe

# dp2 ep2 with optimizer sharding and 2 accumulation steps: 2 ranks
LAYOUT = {"dp": 2, "ep": 2, "optimizer_shard": True}
# dp2 tp2 ep2 with the embedding and lm_head replicated: 4 ranks whose tp peers must read the same rows
TP_LAYOUT = {"dp": 2, "tp": 2, "ep": 2, "vocab_parallel": False}


def _recipe(tmp_path, parallel):
    model = dict(SMALL_MODEL, num_attention_heads=4, num_key_value_heads=4)
    return write_recipe(
        tmp_path / "recipe",
        {
            "model": {"source": "tiny", "overrides": model},
            "data": {"seq_len": 32, "embedded_vocab_size": 512},
            "train": {"steps": 3, "micro_batch_size": 2, "grad_accum_steps": 2, "seed": 5},
            "optim": {"lr": 2e-3, "warmup_steps": 1},
            "parallel": parallel,
            "logging": {"tensorboard": False},
        },
    )


PRELUDE = """
import os
if os.environ.get("MS_SIMULATION_LEVEL") is not None:
"""

PLANTS = {
    # the mirror operators' mean over the replicas (gradients_mean): each replicated weight gets a fraction of
    # its gradient, the ep-split experts all of theirs
    "gradients_mean": """
    from ms_deepseek.parallel_apply import apply
    _wrap = apply.auto_parallel_wrap
    def auto_parallel_wrap(*args, **kwargs):
        wrapped = _wrap(*args, **kwargs)
        wrapped.enable_gradients_mean()
        return wrapped
    apply.auto_parallel_wrap = auto_parallel_wrap
""",
    # the accumulated micro-batches' loss not divided by their count
    "loss_divisor": """
    from ms_deepseek.train import step
    _init = step.StepOutputs.__init__
    def __init__(self, model, accum_steps, num_moe_layers):
        _init(self, model, accum_steps, num_moe_layers)
        self.inv_accum = 1.0
    step.StepOutputs.__init__ = __init__
""",
    # the expert placement table shifted by one expert: tokens reach their neighbour's weights
    "placement": """
    import numpy as np
    from ms_deepseek.model import moe
    _set = moe.DeepseekV2MoE.set_expert_placement
    def set_expert_placement(self, table, groups, ep):
        _set(self, np.roll(np.asarray(table), 1, axis=0), groups, ep)
    moe.DeepseekV2MoE.set_expert_placement = set_expert_placement
""",
    # the gradient norm's square sums left unreduced across the ranks holding different slices (no marker for
    # MindSpore's PARALLEL_GLOBALNORM AllReduce): each rank clips by its own partial norm
    "unreduced_norm": """
    from mindspore.ops import operations as P
    from ms_deepseek.train import step
    step._NORM_MARKER = P.ExpandDims()
""",
    # each rank takes the next rank's part of an optimizer-sharded slice
    "optimizer_part": """
    from ms_deepseek.checkpoint import opt_shard
    _part = opt_shard.OptimizerShards.part
    def part(self, name, value):
        group = self.groups.get(name)
        if group is None:
            return value
        size = self.group_size(group)
        return opt_shard.own_part(value, size, (self.group_rank(group) + 1) % size, name)
    opt_shard.OptimizerShards.part = part
""",
}


def _execute(tmp_path, monkeypatch, parallel, plant=None):
    if plant is not None:
        folder = tmp_path / "plant"
        folder.mkdir()
        (folder / "sitecustomize.py").write_text(PRELUDE + textwrap.dedent(PLANTS[plant]).replace("\n", "\n    "))
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p))
    code, out, _ = main_captured(["plan", "--recipe", str(_recipe(tmp_path, parallel)), "--execute", "--json"])
    return code, json.loads(out)


def test_the_layout_agrees_without_a_plant(tmp_path, monkeypatch):
    code, report = _execute(tmp_path, monkeypatch, LAYOUT)
    assert code == 0 and report["agrees"], json.dumps(report, indent=1)[:3000]
    assert report["compared"] > 0 and len(report["loss"]) == 2


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_planted_mistake_compiles_and_is_refused(tmp_path, monkeypatch, plant):
    code, report = _execute(tmp_path, monkeypatch, LAYOUT, plant)
    assert code == 1 and not report["agrees"], json.dumps(report, indent=1)[:3000]
    assert not report["error"], report["error"]  # every rank compiled and ran: the comparison refused it
    failure = report["first_failure"]
    assert failure is not None and failure["rel"] > 1e-3, failure


def test_tp_peers_reading_different_rows_are_refused(tmp_path, monkeypatch):
    """The loader gives the two tensor-parallel peers different rows while MindSpore's dataset strategy (full batch
    under tp) has every rank of a stage read the same ones."""
    from ms_deepseek.parallel_plan import ranks

    code, report = _execute(tmp_path, monkeypatch, TP_LAYOUT)
    assert code == 0 and report["agrees"], json.dumps(report, indent=1)[:3000]
    coordinates = ranks.data_coordinates
    monkeypatch.setattr(
        ranks, "data_coordinates", lambda rank, par, mb: (rank % par.tp, par.tp, coordinates(rank, par, mb)[2])
    )
    code, report = _execute(tmp_path / "planted", monkeypatch, TP_LAYOUT)
    assert code == 1 and report["first_failure"] is not None, json.dumps(report, indent=1)[:3000]
