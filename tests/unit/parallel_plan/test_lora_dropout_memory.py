"""The planner's LoRA-dropout bytes (activations.lora_dropout_bytes) against the dropouts the model runs.

The oracle is the model itself: one training-mode forward of a tiny LoRA model on CPU with MindSpore's
``nn.Dropout`` (what an NPU run uses, ``train/lora_run.py``), recording every adapter dropout's input. Each
dropout keeps its output (compute dtype) and a one-bit mask; inputs that several adapted projections share
are held once by the planner's layer count already, so the planner must add exactly the rest.
"""

import dataclasses
import hashlib

import mindspore as ms
import pytest
from mindspore import nn

from ms_deepseek.config.lora import LoraSpec
from ms_deepseek.config.model import get_preset
from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.parallel_plan.activations import layer_activation_bytes, lora_dropout_bytes
from ms_deepseek.parallel_plan.costs import in_flight
from ms_deepseek.parallel_plan.planner import estimate
from ms_deepseek.parallel_plan.workload import Precision, Workload

SEQ = 16
C = 2  # bytes per activation element (bfloat16 on the NPU)
ALL_TARGETS = ["q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"] + [
    "gate_proj",
    "up_proj",
    "down_proj",
]


class _Recorded(nn.Cell):
    """A dropout that records its input: (layer, input identity by content, elements)."""

    def __init__(self, inner, path, log):
        super().__init__()
        self.inner, self.path, self.log = inner, path, log

    def construct(self, x):
        layer = int(self.path.split(".")[2])
        content = hashlib.sha1(x.asnumpy().tobytes()).hexdigest() + str(tuple(x.shape))
        self.log.append((layer, content, int(x.size)))
        return self.inner(x)


def _dropout_inputs(cfg, spec):
    from ms_deepseek.model import lora
    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM

    mode = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        ms.set_seed(0)
        model = DeepseekV2ForCausalLM(cfg)
        paths = lora.add_adapters(model, spec, exact_dropout=False)
        modules = lora.adaptable_modules(model)
        log = []
        for path in paths:
            holder = modules[path][0]
            assert isinstance(holder.lora_dropout, nn.Dropout)  # MindSpore's, as on the NPU
            holder.lora_dropout = _Recorded(holder.lora_dropout, path, log)
        model.set_train(True)
        ids = ms.Tensor([[(7 * i + 3) % cfg.vocab_size for i in range(SEQ)]], ms.int32)
        model(ids)
    finally:
        ms.set_context(mode=mode)
    return log


def _expected(log, layer):
    """Every dropout's output and mask, less one copy of each distinct input (the layer count holds it)."""
    mine = [(content, n) for at, content, n in log if at == layer]
    kept = sum(n * C + n / 8 for _, n in mine)
    return kept - sum(n * C for n in dict(mine).values())


@pytest.mark.parametrize("q_lora_rank", [96, None], ids=["q_a_q_b", "q_proj"])
@pytest.mark.parametrize(
    "targets",
    [ALL_TARGETS, ["q_proj", "q_a_proj", "experts.gate_proj", "experts.up_proj", "shared_experts.down_proj"]],
    ids=["all", "some"],
)
def test_the_planner_counts_what_the_models_dropouts_keep(q_lora_rank, targets):
    cfg = get_preset("tiny").replace(num_hidden_layers=2, q_lora_rank=q_lora_rank)
    assert not cfg.is_moe_layer(0) and cfg.is_moe_layer(1)  # a dense and an MoE layer
    spec = LoraSpec(r=4, alpha=8, dropout=0.1, target_modules=targets)
    log = _dropout_inputs(cfg, spec)
    w = Workload(seq_len=SEQ, global_batch_size=1, lora=spec)
    for layer in (0, 1):
        expected = _expected(log, layer)
        assert expected > 0
        assert lora_dropout_bytes(cfg, layer, ParallelConfig(), w, C) == pytest.approx(expected)


def test_no_dropout_no_bytes_only_masks_under_full_recompute_none_in_evaluation():
    cfg = get_preset("tiny").replace(num_hidden_layers=2)
    par = ParallelConfig()
    w0 = Workload(seq_len=SEQ, global_batch_size=1, lora=LoraSpec(r=4, dropout=0.0, target_modules=ALL_TARGETS))
    w1 = Workload(seq_len=SEQ, global_batch_size=1, lora=LoraSpec(r=4, dropout=0.1, target_modules=ALL_TARGETS))
    assert lora_dropout_bytes(cfg, 1, par, w0, C) == 0.0
    dropped = lora_dropout_bytes(cfg, 1, par, w1, C)
    assert dropped > 0
    none = [layer_activation_bytes(cfg, 1, par, w, C, "none") for w in (w0, w1)]
    assert none[1] - none[0] == pytest.approx(dropped)
    # under full recompute the dropout is replayed but its mask is not: the masks stay
    full = [layer_activation_bytes(cfg, 1, par, w, C, "full") for w in (w0, w1)]
    assert full[1] - full[0] == pytest.approx(lora_dropout_bytes(cfg, 1, par, w1, C, masks_only=True))
    assert 0 < full[1] - full[0] < dropped
    evaluation = [layer_activation_bytes(cfg, 1, par, w, C, "none", training=False) for w in (w0, w1)]
    assert evaluation[0] == evaluation[1]
    # and the stage total carries it, once per layer (a stage without the loss: the first of two)
    par2 = ParallelConfig(pp=2, micro_batches=2)
    cfg4 = cfg.replace(num_hidden_layers=4)
    stage = [
        estimate(cfg4, par2, dataclasses.replace(w, global_batch_size=2), Precision(compute_bytes=C)).stages[0]
        for w in (w0, w1)
    ]
    stage = [st.activations / in_flight(par2, 0) for st in stage]
    assert stage[1] - stage[0] == pytest.approx(sum(lora_dropout_bytes(cfg4, i, par2, w1, C) for i in (0, 1)))


def test_ordered_accumulation_holds_every_micro_batchs_masks_a_sharded_one_does_not():
    """Without MindSpore's accumulation pass (train/step.py OrderedAccumulation) every micro-batch's
    DropoutGenMask runs at the step's start (it reads only a shape): k sets of masks per layer (level 1
    of v2-lite-lora-1npu, 4 micro-batches). The accumulation pass of a sharded layout generates each
    just before its use (level 1 of v2-lite-lora-8npu): one set."""
    cfg = get_preset("tiny").replace(num_hidden_layers=2)
    spec = LoraSpec(r=4, dropout=0.1, target_modules=ALL_TARGETS)
    prec = Precision(compute_bytes=C)
    for par, extra_sets in ((ParallelConfig(recompute="full"), 3), (ParallelConfig(recompute="full", dp=2, ep=2), 0)):
        acts = {}
        for k in (1, 4):
            w = Workload(seq_len=SEQ, global_batch_size=k * par.dp, lora=spec)
            acts[k] = estimate(cfg, par, w, prec).stages[0].activations
        w = Workload(seq_len=SEQ, global_batch_size=par.dp, lora=spec)
        masks = sum(lora_dropout_bytes(cfg, i, par, w, C, masks_only=True) for i in (0, 1))
        assert acts[4] - acts[1] == pytest.approx(extra_sets * masks)
