"""Mistakes MindSpore's compiler accepts and ``plan --execute`` refuses.

Each case plants one mistake in the product's sharded path and runs ``ms-deepseek plan --recipe R --execute``:
the compile still succeeds on every rank (the mistake is not a layout error), and the comparison of the executed
ranks with one device names the step, rank and tensor where they part. Without a plant the same runs agree:
``v2-lite-sft-8npu`` (dp2 ep2 with optimizer sharding, 2 accumulation steps, full recompute, flash attention)
in tests/compile/test_execute_recipes.py, the tensor-parallel layout below in its own test.

The plants reach the compile workers (separate processes) through a ``sitecustomize`` module on their
``PYTHONPATH``, active only under MindSpore's dry run (``MS_SIMULATION_LEVEL``): the one-device run stays the
product's own. The dataset plant is in this process, where the executor reads each rank's batches.
"""

import json
import os
import re
import textwrap

import pytest

from builders import main_captured, write_recipe
from repo_paths import RECIPES

RECIPE = RECIPES / "v2-lite-sft-8npu.yaml"
# two tensor-parallel peers, the embedding and lm_head replicated (the vocabulary split is another test's)
TP_LAYOUT = ["--dp", "1", "--tp", "2", "--ep", "1", "--no-vocab-parallel"]


# The optimizer's fused update (train/optim.py AdamW: one AdamWeightDecay call per parameter) behind a Cell that a
# plant overrides; ``step`` is the optimizer's global_step (already advanced when the update runs)
ADAM_WRAPPER = """
    import mindspore as ms
    from mindspore import nn, ops
    from ms_deepseek.train import optim
    class _Fused(nn.Cell):
        def __init__(self, fused, step):
            super().__init__()
            self.fused, self.step = fused, step
    def _install(cls):
        _init = optim.AdamW.__init__
        def __init__(self, *args, **kwargs):
            _init(self, *args, **kwargs)
            self.fused = cls(self.fused, self.global_step)
        optim.AdamW.__init__ = __init__
"""

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
    # every rank applies half the learning rate; the learning rate the step reports is unchanged
    "half_learning_rate": ADAM_WRAPPER
    + """
    class Planted(_Fused):
        def construct(self, param, m, v, lr, beta1, beta2, eps, decay, grad):
            return self.fused(param, m, v, lr * 0.5, beta1, beta2, eps, decay, grad)
    _install(Planted)
""",
    # rank 0 drops Adam's bias correction (the kernel's lr' = lr sqrt(bc2) / bc1, eps' = eps sqrt(bc2),
    # decay' = decay bc1 / sqrt(bc2): train/optim.py AdamW) and updates with lr, eps and decay as given
    "no_bias_correction": ADAM_WRAPPER
    + """
    class Planted(_Fused):
        def construct(self, param, m, v, lr, beta1, beta2, eps, decay, grad):
            t = self.step.astype(ms.float32)
            bc1, root_bc2 = 1.0 - ops.pow(beta1, t), ops.sqrt(1.0 - ops.pow(beta2, t))
            return self.fused(param, m, v, lr * bc1 / root_bc2, beta1, beta2, eps / root_bc2, decay * root_bc2 / bc1, grad)
    if os.environ.get("RANK_ID") == "0":
        _install(Planted)
""",
    # rank 1's update at step 2 takes a NaN gradient
    "nan_update": ADAM_WRAPPER
    + """
    class Planted(_Fused):
        def construct(self, param, m, v, lr, beta1, beta2, eps, decay, grad):
            poison = ops.select(self.step == 2, ops.fill(ms.float32, (), float("nan")), ops.ones((), ms.float32))
            return self.fused(param, m, v, lr, beta1, beta2, eps, decay, grad * poison)
    if os.environ.get("RANK_ID") == "1":
        _install(Planted)
""",
    # the second moments named otherwise on the sharded side
    "renamed_state": """
    from ms_deepseek.train import optim
    _state = optim.AdamW._state
    def _renamed(self, prefix):
        return _state(self, "adam_s" if prefix == "adam_v" else prefix)
    optim.AdamW._state = _renamed
""",
    # each rank divides its micro-batch loss by the labelled tokens it holds (a mean of the ranks' means, the
    # reduced layout's 2 data-parallel slices) instead of by the micro-batch's
    "own_token_count": """
    import mindspore as ms
    from mindspore import ops
    from ms_deepseek.model import loss
    SLICES = 2
    def construct(self, logits, labels):
        B, T = labels.shape
        flat = logits.reshape(B * T, self.vocab_size)
        last = ops.full((B, 1), loss.IGNORE_INDEX, dtype=ms.int32)
        shifted = ops.concat((labels[:, 1:].astype(ms.int32), last), 1).reshape(-1)
        valid = shifted != loss.IGNORE_INDEX
        safe = ops.select(valid, shifted, ops.zeros_like(shifted))
        picked = self.gather_target(flat, 1, safe.reshape(-1, 1)).reshape(-1)
        flat = ops.depend(flat, picked)
        row_max = ops.stop_gradient(self.row_max(flat, -1))
        lse = self.log(self.sum_exp(self.exp(self.sub(flat, row_max)), -1)) + row_max.reshape(-1)
        validf = valid.astype(ms.float32)
        per_slice = ((lse - picked) * validf).reshape(SLICES, -1).sum(-1)
        counts = ops.maximum(validf.reshape(SLICES, -1).sum(-1), 1.0)
        return (per_slice / counts).mean()
    loss.VocabParallelCrossEntropy.construct = construct
""",
}


def _execute(tmp_path, monkeypatch, plant=None, layout=(), recipe=str(RECIPE)):
    if plant is not None:
        folder = tmp_path / "plant"
        folder.mkdir(parents=True)
        (folder / "sitecustomize.py").write_text(PRELUDE + textwrap.dedent(PLANTS[plant]).replace("\n", "\n    "))
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p))
    code, out, _ = main_captured(["plan", "--recipe", recipe, *layout, "--execute", "--json"])
    return code, json.loads(out)


# Where each plant must be refused: (step, rank or None for any, the compared quantity, its least relative
# difference or None for a non-finite one). The verdict is the largest difference of the earliest step that has one.
REFUSED_AT = {
    # a replicated weight's gradient halved: its second moment (g / 2)^2 is 3/4 below one device's
    "gradients_mean": (1, None, r"adam_v\.", 0.7),
    "half_learning_rate": (1, None, r"update of ", 0.45),
    # the loss, hence every gradient, doubled: second moments four times one device's
    "loss_divisor": (1, None, r"adam_v\.", 2.9),
    "nan_update": (2, 1, r"adam_m\.|update of ", None),
    "no_bias_correction": (1, 0, r"update of ", 0.3),
    "optimizer_part": (0, 0, r"^(lm_head|model)\.", 0.5),
    # the gradient of the tokens of a rank with fewer labelled tokens weighs more: some small gradients change sign
    "own_token_count": (1, None, r"update of |adam_", 0.1),
    "placement": (1, None, r"experts", 0.1),
    "renamed_state": (0, 0, r"^adam_s\.", None),
    "unreduced_norm": (1, None, r"^gradient norm$", 0.1),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_planted_mistake_compiles_and_is_refused(tmp_path, monkeypatch, plant):
    code, report = _execute(tmp_path, monkeypatch, plant)
    failure = report["first_failure"]
    print("REFUSED", plant, json.dumps(failure), report["error"][:300])
    assert code == 1 and not report["agrees"], json.dumps(report, indent=1)[:3000]
    assert not report["error"], report["error"]  # every rank compiled and ran: the comparison refused it
    step, rank, name, least = REFUSED_AT[plant]
    assert failure["step"] == step and rank in (None, failure["rank"]) and re.search(name, failure["name"]), failure
    if least is None:  # not a number: a NaN, or a tensor one side lacks
        assert failure["rel"] is None, failure
    else:
        assert failure["rel"] >= least, failure


def test_data_parallel_ranks_reading_the_same_rows_are_refused(tmp_path, monkeypatch):
    """The loader ignores the rank: every data-parallel slice reads rank 0's rows. The one-device run reads its own
    global batch, so the ranks' rows are refused before anything runs, at the micro-batch they part."""
    from ms_deepseek.data import dataset

    build = dataset.build_train_dataset

    def same_rows(data_cfg, batch_size, rank=0, world_size=1, **kwargs):
        return build(data_cfg, batch_size, 0, world_size, **kwargs)

    monkeypatch.setattr(dataset, "build_train_dataset", same_rows)
    code, report = _execute(tmp_path, monkeypatch)
    failure = report["first_failure"]
    assert code == 1 and not report["agrees"] and report["loss"] == [], json.dumps(report, indent=1)[:3000]
    # rank 1 holds rank 0's rows: MindSpore's micro-batch 1 (rank 1's block) is not one device's micro-batch 1
    assert (failure["step"], failure["rank"], failure["name"], failure["rel"]) == (1, 1, "batch rows", None), failure
    assert failure["detail"].startswith("micro-batch 1: the rows MindSpore cuts"), failure


def test_tp_peers_reading_different_rows_are_refused(tmp_path, monkeypatch):
    """The loader gives the two tensor-parallel peers different rows while MindSpore's dataset strategy (full batch
    under tp) has every rank of a stage read the same ones: refused before anything runs, where MindSpore places
    both ranks' rows at the same rows of the global input."""
    from ms_deepseek.parallel_plan import ranks

    code, report = _execute(tmp_path, monkeypatch, layout=TP_LAYOUT)
    assert code == 0 and report["agrees"], json.dumps(report, indent=1)[:3000]
    coordinates = ranks.data_coordinates
    monkeypatch.setattr(
        ranks, "data_coordinates", lambda rank, par, mb: (rank % par.tp, par.tp, coordinates(rank, par, mb)[2])
    )
    code, report = _execute(tmp_path, monkeypatch, layout=TP_LAYOUT)
    failure = report["first_failure"]
    assert code == 1 and failure is not None, json.dumps(report, indent=1)[:3000]
    assert (failure["step"], failure["name"]) == (1, "batch rows") and "hold different rows" in failure["detail"]


# RMSNorm's square as Mul(x, x) (model/layers.py squares with one Square): under the vocabulary split the first norm's
# input is the embedding's AllReduce, and MindSpore's AdjustAllReduceMulAdd rewrites the two gradient terms of
# Mul(x, x) into one that drops the variance term of the embedding's gradient
MUL_SQUARE = """
    import mindspore as ms
    from mindspore import ops
    from ms_deepseek.model import layers
    from ms_deepseek.parallel_plan import styles
    _init = layers.RMSNorm.__init__
    def __init__(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        self.square = ops.Mul()
    def construct(self, x):
        dtype = x.dtype
        x32 = self.cast_in(x, ms.float32)
        variance = self.mean(self.square(x32, x32), -1)
        normed = self.normalize(x32, self.rsqrt(self.add_eps(variance, self.eps)))
        return self.scale(self.cast_out(normed, dtype), self.cast_weight(self.weight, dtype))
    layers.RMSNorm.__init__ = __init__
    layers.RMSNorm.construct = construct
    _rms_norm = styles._rms_norm
    def rms_norm(s):
        spec = _rms_norm(s)
        spec.prims["square"] = ((s, s), None)
        return spec
    styles._rms_norm = rms_norm
"""


def test_vocab_split_embedding_gradient_agrees_and_mul_square_is_refused(tmp_path, monkeypatch):
    """dp2 tp2 ep2 with the vocabulary split agrees with one device; with RMSNorm's square planted back to
    Mul(x, x), the embedding's gradient loses its variance term and the comparison refuses the embedding."""
    data = {
        "model": {"source": "deepseek-v2-lite", "overrides": {"use_flash_attention": True}},
        "data": {"seq_len": 64},
        "train": {"steps": 10, "micro_batch_size": 1, "seed": 7},
        "optim": {"lr": 1e-3, "warmup_steps": 2},
        "parallel": {"dp": 2, "tp": 2, "pp": 1, "ep": 2, "vocab_parallel": True},
        "logging": {"tensorboard": False},
    }
    recipe = str(write_recipe(tmp_path / "recipe", data))
    code, report = _execute(tmp_path, monkeypatch, recipe=recipe)
    assert code == 0 and report["agrees"], json.dumps(report, indent=1)[:3000]
    monkeypatch.setitem(PLANTS, "mul_square", MUL_SQUARE)
    code, report = _execute(tmp_path, monkeypatch, "mul_square", recipe=recipe)
    assert code == 1 and not report["error"], json.dumps(report, indent=1)[:3000]
    assert "embed_tokens" in report["first_failure"]["name"], report["first_failure"]
