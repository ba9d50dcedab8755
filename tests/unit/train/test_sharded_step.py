"""The sharded (SEMI_AUTO_PARALLEL) training step's parts that have CPU semantics.

MindSpore compiles sharded graphs only on Ascend; what is ours is checked here:

* the rank geometry (``ms_deepseek.parallel_plan.ranks``): which rows every rank reads, and the
  dataset strategy MindSpore is told, from the same rule;
* the pipeline step's ``accu_grads`` Parameters and its gradient hand-off;
* the global gradient norm in MindSpore's ``grad_scale`` marker pattern;
* the vocabulary-parallel cross-entropy against the gather form.
"""

import mindspore as ms
import numpy as np
import pytest
from mindspore import ops

from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.config.recipe import TrainSection
from ms_deepseek.parallel_plan.ms_oracle import batch_row_of_rank, slice_of_rank
from ms_deepseek.parallel_plan.ranks import (
    data_coordinates,
    dataset_strategy,
    reads_full_batch,
    rows_of_rank,
    stage_of_rank,
)

LAYOUTS = [
    ParallelConfig(dp=2, tp=2, pp=2, ep=2, micro_batches=2),
    ParallelConfig(dp=4, tp=2, pp=3, ep=2, micro_batches=3),
    ParallelConfig(dp=2, tp=4, pp=1),
    ParallelConfig(dp=3, tp=1, pp=2, micro_batches=2),
    ParallelConfig(dp=2, tp=2, pp=2, micro_batches=2, dataset_strategy="full_batch"),
]


@pytest.mark.parametrize("par", LAYOUTS, ids=lambda p: p.describe())
def test_every_rank_reads_its_slice_and_the_stage_covers_the_batch_once(par):
    b = 3
    stage_devices = par.dp * par.tp
    assert par.world_size == stage_devices * par.pp
    strategy = dataset_strategy(par)
    for stage in range(par.pp):
        ranks = [r for r in range(par.world_size) if stage_of_rank(r, par) == stage]
        assert ranks == list(range(stage * stage_devices, (stage + 1) * stage_devices))
        slices = {}
        for r in ranks:
            data_rank, data_world, rows = data_coordinates(r, par, b)
            held = rows_of_rank(r, par, b)
            assert len(held) == rows and 0 <= data_rank < data_world
            slices.setdefault(data_rank, held)
            assert slices[data_rank] == held  # ranks of one slice (tp peers) hold identical rows
        # distinct slices, put together, are the global micro-batch [dp * b] exactly once
        together = sorted(row for rows in slices.values() for row in rows)
        assert together == list(range(par.dp * b))
        if reads_full_batch(par):  # full_batch, or tp > 1 (MindSpore refuses the data-parallel form there)
            assert strategy == "full_batch" and list(slices) == [0]
            continue
        # what MindSpore is told: the batch axis of both inputs split dp ways, each slice repeated tp times
        assert strategy == ((par.dp, 1), (par.dp, 1))
        for r in ranks:
            # MindSpore's own rule (_utils._to_full_tensor): where it places rank r's batch in the global one
            start = batch_row_of_rank(r, par.world_size, par.pp, strategy, b)
            assert rows_of_rank(r, par, b) == list(range(start, start + b)), (r, start)


def test_tp_peers_read_the_whole_micro_batch():
    """With tp > 1 the data-parallel dataset strategy (a slice per dp rank, repeated on the tp peers) is what
    MindSpore 2.9 refuses under sharding propagation (tests/compile compiles dp, tp and ep all 2): every rank
    reads the global micro-batch and MindSpore slices it (ranks.reads_full_batch)."""
    par = ParallelConfig(dp=2, tp=2, pp=2, micro_batches=2)
    assert dataset_strategy(par) == "full_batch"
    assert {tuple(rows_of_rank(r, par, 3)) for r in range(par.world_size)} == {tuple(range(6))}
    assert dataset_strategy(ParallelConfig(dp=2, tp=1, pp=2, micro_batches=2)) == ((2, 1), (2, 1))


def test_auto_parallel_wrap_gets_the_dataset_strategy():
    par = ParallelConfig(dp=4, tp=1, pp=2, ep=4, micro_batches=4)
    assert dataset_strategy(par) == ((4, 1), (4, 1))
    assert dataset_strategy(ParallelConfig(dp=4, tp=8, pp=2, ep=4, micro_batches=4)) == "full_batch"
    full = ParallelConfig(dp=4, tp=8, pp=2, ep=4, micro_batches=4, dataset_strategy="full_batch")
    assert dataset_strategy(full) == "full_batch"

    # AutoParallel.dataset_strategy takes it as given (the wrapper is built without compiling)
    import mindspore as ms
    from mindspore import nn
    from mindspore.parallel.auto_parallel import AutoParallel

    seen = []
    real = AutoParallel.dataset_strategy
    try:
        AutoParallel.dataset_strategy = lambda self, config: (seen.append(config), real(self, config))[1]
        from ms_deepseek.parallel_apply.apply import auto_parallel_wrap

        wrapped = auto_parallel_wrap(nn.Dense(2, 2), par)
    finally:
        AutoParallel.dataset_strategy = real
    assert seen == [((4, 1), (4, 1))] and wrapped._dataset_strategy_config == ((4, 1), (4, 1))
    assert ms.get_context("device_target") == "CPU"


def test_ranks_read_disjoint_rows_of_the_real_dataset(tmp_path):
    """The dataset each rank builds from data_coordinates: tp peers identical, data slices disjoint,
    together the single reader's global batch."""
    from ms_deepseek.config.data import DataConfig
    from ms_deepseek.data.dataset import build_train_dataset
    from ms_deepseek.data.prepare import prepare_embedded_default

    corpus = tmp_path / "corpus"
    prepare_embedded_default(corpus, seq_len=16, vocab_size=512, max_bytes=60_000, progress=False)
    cfg = DataConfig(path=str(corpus), num_workers=1)
    b = 2

    def first_batch(rank, world, rows):
        ds = build_train_dataset(cfg, rows, rank, world, progress=False)
        return np.asarray(next(iter(ds))["input_ids"])

    for par in (
        ParallelConfig(dp=2, tp=2, pp=2, micro_batches=2),
        ParallelConfig(dp=2, tp=2, pp=2, micro_batches=2, dataset_strategy="full_batch"),
    ):
        whole = first_batch(0, 1, par.dp * b)  # one reader of the global micro-batch
        got = {}
        for r in range(par.world_size):
            got[r] = first_batch(*data_coordinates(r, par, b))
        strategy = dataset_strategy(par)
        slice_of = {
            r: slice_of_rank(r, par.world_size, par.pp, strategy, data_coordinates(r, par, b)[2])[0]
            for r in range(par.world_size)
        }
        for r in range(par.world_size):  # the ranks MindSpore takes for one slice read identical rows
            peer = min(q for q in range(par.world_size) if slice_of[q] == slice_of[r])
            np.testing.assert_array_equal(got[r], got[peer])
        stage0 = [
            got[min(q for q in range(par.dp * par.tp) if slice_of[q] == k)] for k in sorted(set(slice_of.values()))
        ]
        rows = np.concatenate(stage0) if par.dataset_strategy != "full_batch" else stage0[0]
        assert sorted(map(tuple, rows)) == sorted(map(tuple, whole))


# ---------------------------------------------------------------- vocabulary-parallel cross-entropy
def _gather_cross_entropy(logits, labels):
    """The loss as it was before (a gather over the vocabulary axis), as the reference."""
    V = logits.shape[-1]
    shift_logits = logits[:, :-1, :].reshape(-1, V)  # [B*(T-1), V]
    shift_labels = labels[:, 1:].reshape(-1).astype(ms.int32)  # [B*(T-1)]
    valid = shift_labels != -100
    safe = ops.select(valid, shift_labels, ops.zeros_like(shift_labels))
    row_max = ops.stop_gradient(ops.amax(shift_logits, -1, keepdims=True))
    lse = ops.log(ops.exp(shift_logits - row_max).sum(-1)) + row_max.reshape(-1)
    picked = ops.gather_elements(shift_logits, 1, safe.reshape(-1, 1)).reshape(-1)
    validf = valid.astype(ms.float32)
    return ((lse - picked) * validf).sum() / ops.maximum(validf.sum(), 1.0)


def _ce_inputs(B=2, T=9, V=300, seed=0):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((B, T, V)) * 4).astype(np.float32)
    labels = rng.integers(0, V, (B, T)).astype(np.int32)
    labels[0, 2:5] = -100
    labels[1, -1] = -100
    return logits, labels


@pytest.mark.parametrize("split_vocab", [False, True], ids=["gather", "onehot"])
@pytest.mark.parametrize("mode", ["graph", "pynative"])
def test_vocab_parallel_cross_entropy_equals_the_gather_form(mode, split_vocab):
    import mindspore as ms
    from mindspore import Tensor, nn

    from ms_deepseek.model.loss import VocabParallelCrossEntropy

    saved = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    try:
        logits, labels = _ce_inputs()

        class Ref(nn.Cell):
            def construct(self, x, y):
                return _gather_cross_entropy(x, y)

        loss = VocabParallelCrossEntropy(logits.shape[-1])
        loss.set_split_vocab(split_vocab)  # both forms of the target logit (the plan chooses by the vocabulary split)
        got = ms.value_and_grad(loss)(Tensor(logits), Tensor(labels))
        want = ms.value_and_grad(Ref())(Tensor(logits), Tensor(labels))
    finally:
        ms.set_context(mode=saved)
    np.testing.assert_allclose(float(got[0].asnumpy()), float(want[0].asnumpy()), rtol=1e-6)
    np.testing.assert_allclose(got[1].asnumpy(), want[1].asnumpy(), rtol=1e-5, atol=1e-8)
    assert np.abs(got[1].asnumpy()[:, -1]).max() == 0  # the last position predicts nothing


def test_vocab_parallel_cross_entropy_splits_over_the_vocabulary():
    """The loss's reductions over V, done per vocabulary slice and combined as MindSpore's
    all-reduces would (max, then sums), give the unsplit value: what the plan's (dp, tp)
    strategies on row_max / sum_exp / onehot / pick compute on a tp-way vocabulary split."""
    import mindspore as ms
    from mindspore import Tensor

    from ms_deepseek.model.loss import VocabParallelCrossEntropy

    logits, labels = _ce_inputs(V=240)
    B, T, V = logits.shape
    loss = VocabParallelCrossEntropy(V)
    loss.set_split_vocab(True)  # the form the plan uses on a split vocabulary
    full = float(loss(Tensor(logits), Tensor(labels)).asnumpy())
    flat = logits.reshape(B * T, V).astype(np.float64)
    nxt = np.concatenate([labels[:, 1:], np.full((B, 1), -100)], 1).reshape(-1)
    valid = nxt != -100
    for tp in (2, 3, 4):
        width = V // tp
        parts = [flat[:, k * width : (k + 1) * width] for k in range(tp)]
        row_max = np.max([p.max(-1) for p in parts], 0)  # AllReduce(max)
        sum_exp = np.sum([np.exp(p - row_max[:, None]).sum(-1) for p in parts], 0)  # AllReduce(sum)
        picked = np.sum(
            [(p * (np.arange(k * width, (k + 1) * width)[None] == nxt[:, None])).sum(-1) for k, p in enumerate(parts)],
            0,
        )  # local one-hot slice
        loss = ((np.log(sum_exp) + row_max - picked) * valid).sum() / valid.sum()
        assert abs(loss - full) < 1e-5 * max(1.0, abs(full)), tp
    assert ms.get_context("device_target") == "CPU"


# ------------------------------------------------------------------------- global gradient norm
def test_norm_marker_is_the_one_mindspore_completes():
    """The marker pattern: an ExpandDims carrying grad_scale after each gradient's square sum, then
    AddN and Sqrt; its value equals the CPU GEMV form (float32) and the float64 norm."""
    from mindspore import Tensor

    from ms_deepseek.train.step import _NORM_MARKER, global_norm

    assert type(_NORM_MARKER).__name__ == "ExpandDims" and _NORM_MARKER.attrs.get("grad_scale") is True
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in ((7, 5), (3,), (4, 6, 2), (1,))]
    want = float(np.sqrt(sum((a.astype(np.float64) ** 2).sum() for a in arrays)))
    grads = tuple(Tensor(a) for a in arrays)
    marked = float(global_norm(grads, as_dot=False).asnumpy())
    dot = float(global_norm(grads, as_dot=True).asnumpy())
    assert marked == pytest.approx(want, rel=1e-6) and dot == pytest.approx(want, rel=1e-6)
    # float16 gradients are widened before squaring (their squares overflow above 256)
    big = (np.full((4, 4), 300.0, np.float16),)
    assert float(global_norm(tuple(Tensor(a) for a in big), as_dot=False).asnumpy()) == pytest.approx(1200.0)


# ------------------------------------------------------------------------------- pipeline step
@pytest.fixture(scope="module")
def tiny_model():
    from ms_deepseek.config.model import get_preset
    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM

    cfg = get_preset("tiny", num_hidden_layers=2)
    ms.set_seed(0)
    return cfg, DeepseekV2ForCausalLM(cfg)


def _optimizer(model):
    from ms_deepseek.config.recipe import OptimSection
    from ms_deepseek.train import optim

    return optim.build_optimizer(model.trainable_params(), OptimSection(lr=1e-3, schedule="constant"), 10)


@pytest.mark.parametrize("optimizer_shard", [False, True])
def test_pipeline_step_has_accu_grads_for_every_optimizer_parameter(tiny_model, optimizer_shard):
    """pp > 1: Pipeline over the loss net with the plan's stages and micro-batches, and zero
    accu_grads.<name> clones of the optimizer's parameters (what MindSpore's pipeline pass fills)."""
    from mindspore.parallel.nn import Pipeline

    from ms_deepseek.parallel_apply.apply import apply_plan, pipeline_wrap
    from ms_deepseek.train.step import PipelineGrads, build_step

    cfg, model = tiny_model
    par = ParallelConfig(dp=1, tp=1, pp=2, micro_batches=4, optimizer_shard=optimizer_shard)
    applied = apply_plan(model, par, cfg)
    optimizer = _optimizer(model)
    step, update = build_step(
        model,
        optimizer,
        TrainSection(clip_grad_norm=1.0),
        par,
        wrap_net=lambda net: pipeline_wrap(net, par, applied, model_prefix="model"),
    )
    assert isinstance(step.net, Pipeline) and step.net.micro_size == 4
    assert isinstance(step.pipeline, PipelineGrads) and step.pipeline.opt_shard is optimizer_shard
    assert update.pre_unscaled  # the accumulated gradients are unscaled once, by PipelineGrads
    accu = {p.name: p for p in step.pipeline.accu_grads}
    params = list(optimizer.parameters)
    assert list(accu) == [f"accu_grads.{p.name}" for p in params]
    for p in params:
        a = accu[f"accu_grads.{p.name}"]
        assert a.shape == p.shape and a.dtype == p.dtype
        assert not np.any(a.asnumpy())
    # the plan's stages reached the model's cells through the wrapper's stage_config
    stages = {path: cell.pipeline_stage for path, cell in model.cells_and_names() if path in applied.stage_of_cell}
    assert stages == applied.stage_of_cell and stages["loss_fn"] == 1 and stages["model.embed_tokens"] == 0
    # the step's own names are unchanged: the model's parameters keep their checkpoint names
    names = {p.name for p in step.get_parameters()}
    assert {p.name for p in model.get_parameters()} <= names and set(accu) <= names


@pytest.mark.parametrize("optimizer_shard", [False, True])
def test_pipeline_grads_hand_over_the_accumulated_gradient_and_zero_it(optimizer_shard):
    """What the pipeline pass leaves in accu_grads (here written by hand) reaches the update divided
    by the loss scale, and the buffers start the next step at zero (graph mode, as on Ascend).
    With optimizer sharding MindSpore hands the accumulated gradient itself: it is used, the buffer
    is only zeroed."""
    from mindspore import Parameter, ParameterTuple, Tensor

    from ms_deepseek.train.step import PipelineGrads

    saved = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        params = ParameterTuple(
            [
                Parameter(Tensor(np.ones((2, 3), np.float32)), name="w"),
                Parameter(Tensor(np.ones((4,), np.float32)), name="b"),
            ]
        )
        cell = PipelineGrads(params, optimizer_shard)
        # an overflowed buffer (inf, NaN: a float16 step that was skipped) is zeroed exactly too
        accumulated = [np.array([[0, 1, 2], [np.inf, -np.inf, np.nan]], np.float32), np.full((4,), 3.0, np.float32)]
        handed = [np.full((2, 3), 5.0, np.float32), np.full((4,), 7.0, np.float32)]
        for a, value in zip(cell.accu_grads, accumulated):
            a.set_data(Tensor(value))
        out = cell(tuple(Tensor(g) for g in handed), Tensor(4.0, ms.float32))
    finally:
        ms.set_context(mode=saved)
    source = handed if optimizer_shard else accumulated
    for got, want in zip(out, source):
        np.testing.assert_array_equal(got.asnumpy(), want / 4.0)  # a division by a power of two is exact
    assert all(not np.any(a.asnumpy()) for a in cell.accu_grads)


def test_states_of_a_deferred_parameter_stay_deferred():
    """A sharded run builds its model under no_init_parameters: the optimizer moments and accu_grads of its
    parameters stay deferred too (MindSpore initialises only this rank's slice at compile), while the
    states of an initialised parameter are zeros at once."""
    from mindspore import Parameter
    from mindspore.common.initializer import initializer
    from mindspore.nn.utils import no_init_parameters

    from ms_deepseek.train.optim import zero_states

    with no_init_parameters():
        deferred = Parameter(initializer("normal", (64, 32), ms.bfloat16), name="deferred")
    ready = Parameter(initializer("normal", (8, 4), ms.float32), name="ready")
    assert deferred.has_init and not ready.has_init
    lazy, eager = zero_states([deferred, ready], "adam_m", ms.float32)
    assert lazy.has_init and lazy.shape == (64, 32) and lazy.dtype == ms.float32 and lazy.name == "adam_m.deferred"
    assert not eager.has_init and not np.any(eager.asnumpy()) and eager.name == "adam_m.ready"
    assert not np.any(lazy.init_data().asnumpy())  # deferred zeros, when MindSpore initialises them


def test_without_pipeline_the_step_has_no_accu_grads(tiny_model):
    from ms_deepseek.train.step import build_step

    cfg, model = tiny_model
    step, update = build_step(
        model, _optimizer(model), TrainSection(grad_accum_steps=2, clip_grad_norm=1.0), ParallelConfig()
    )
    assert step.pipeline is None and not update.pre_unscaled
    assert not [p.name for p in step.get_parameters() if p.name.startswith("accu_grads")]


def test_pipeline_step_applies_what_the_pass_accumulated():
    """A CPU stand-in for MindSpore's pipeline pass: fill accu_grads with the micro-batches' summed
    gradient of one batch (what the pass accumulates on Ascend); one pipeline step (graph mode) fed
    a *different* batch then makes exactly the update of that gradient (same norm, same clipping,
    same weights): the update reads the accumulated buffers, not the step's own backward on CPU;
    and the buffers are left at zero."""
    from mindspore import Parameter, Tensor, nn
    from mindspore.parallel.nn import Pipeline

    from ms_deepseek.config.model import get_preset
    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM
    from ms_deepseek.train.step import StepOutputs, Update, build_step, output_width

    cfg = get_preset(
        "tiny",
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        first_k_dense_replace=0,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        n_group=1,
        topk_group=1,
        topk_method="greedy",
    )
    k, L, E = 2, len(cfg.moe_layer_indices), cfg.n_routed_experts
    rng = np.random.default_rng(5)
    ids = Tensor(rng.integers(3, cfg.vocab_size, (2 * k, 16)).astype(np.int32))
    other = Tensor(rng.integers(3, cfg.vocab_size, (2 * k, 16)).astype(np.int32))  # what the step is fed
    saved = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        ms.set_seed(0)
        model_a = DeepseekV2ForCausalLM(cfg)
        ms.set_seed(0)
        model_b = DeepseekV2ForCausalLM(cfg)

        class Grads(nn.Cell):  # the micro-batches' summed gradient, as GradAccumulation takes it
            def __init__(self, net, weights):
                super().__init__(auto_prefix=False)
                self.net, self.weights = net, weights
                self.grad = ops.GradOperation(get_by_list=True, sens_param=True)
                onehot = np.zeros(output_width(L, E), np.float32)
                onehot[0] = 1.0
                self.sens = Tensor(onehot)

            def construct(self, x, y):
                return self.grad(self.net, self.weights)(x, y, self.sens)

        from mindspore.parallel.nn import GradAccumulation

        opt_a = _optimizer(model_a)
        grads = Grads(GradAccumulation(StepOutputs(model_a, k, L), k), opt_a.parameters)(ids, ids)
        scale = Parameter(Tensor(1.0, ms.float32), name="loss_scale", requires_grad=False)
        norm_a, *_ = Update(opt_a, scale, 0.5, dot_norm=False)(grads)

        opt_b = _optimizer(model_b)
        step_b, _ = build_step(
            model_b,
            opt_b,
            TrainSection(clip_grad_norm=0.5),
            ParallelConfig(pp=2, micro_batches=k),
            wrap_net=lambda net: Pipeline(net, k),
        )
        step_b.update.dot_norm = False
        for accu, g in zip(step_b.pipeline.accu_grads, grads):
            accu.set_data(Tensor(g.asnumpy()))
        _, norm_b, *_ = step_b(other, other)
    finally:
        ms.set_context(mode=saved)
    assert float(norm_a.asnumpy()) > 0.5  # clipping was active
    np.testing.assert_allclose(float(norm_b.asnumpy()), float(norm_a.asnumpy()), rtol=1e-6)
    for pa, pb in zip(model_a.trainable_params(), model_b.trainable_params()):
        np.testing.assert_allclose(pb.asnumpy(), pa.asnumpy(), rtol=1e-6, atol=1e-7, err_msg=pa.name)
    assert all(not np.any(a.asnumpy()) for a in step_b.pipeline.accu_grads)
