"""The trainer's parts on their own, without a trainer: the run context, the checkpointer over the run's
stateful parts (one save, one restore, state.json's one shape), and a layout strategy writing and reading the
checkpointer's tensors."""

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.train.components import RngState, RunCounters
from ms_deepseek.train.context import RunContext, TrainTensors

from builders import small_config


class Position:
    """A data part: gives and takes its position, opens its batches (order recorded in ``log``)."""

    seq_len = 8

    def __init__(self, log, at=0):
        self.log, self.at = log, at

    def state_dict(self):
        return {"at": self.at}

    def load_state_dict(self, state):
        self.log.append("data")
        self.at = state["at"]

    def open(self):
        self.log.append("open")


class Layout:
    """A layout strategy that keeps what the checkpointer hands it."""

    def __init__(self, log, replicas=None):
        self.log, self.saved, self.replicas = log, {}, replicas or {}

    def replica_state(self, ctx, tensors):
        return dict(self.replicas)

    def save(self, ctx, tensors, manager, step, state):
        self.saved[step] = json.loads(json.dumps(state))
        return Path(f"step_{step}")

    def materialize(self, ctx, tensors, converter, fresh):
        self.log.append(f"materialize fresh={fresh}")

    def load(self, ctx, tensors, folder):
        self.log.append(f"tensors {folder}")


def _checkpointer(log, layout, data, counters, stop_at=4):
    from ms_deepseek.train.components import Checkpointer

    recipe = SimpleNamespace(global_batch_size=16, checkpoint=SimpleNamespace(save_interval=2, save_final=True))
    ctx = RunContext(recipe, Path("run"), rank=0, world=2)
    return Checkpointer(ctx, layout, None, None, data, counters, None, stop_at)


def test_run_context_is_frozen_and_reads_the_recipe():
    cfg, par = small_config(), ParallelConfig(dp=2)
    ctx = RunContext(SimpleNamespace(model_config=cfg, parallel=par), Path("run"), rank=1, world=2)
    assert (ctx.cfg, ctx.par, ctx.rank, ctx.world) == (cfg, par, 1, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.rank = 0


def test_checkpointer_saves_every_part_in_state_jsons_one_shape():
    log, counters = [], RunCounters(started=0.0)
    counters.tokens_seen = 640
    layout = Layout(log, replicas={"replica_sha1": ["a", "a"]})
    ck = _checkpointer(log, layout, Position(log, 7), counters)
    assert ck.save(3) == Path("step_3") and (ck.saved_step, ck.last) == (3, Path("step_3"))
    state = layout.saved[3]
    # the key order is part of state.json's bytes
    assert list(state) == [
        "step",
        "data",
        "rng",
        "tokens_seen",
        "elapsed_s",
        "world_size",
        "global_batch_size",
        "seq_len",
        "replica_sha1",
    ]
    assert (state["step"], state["data"], state["tokens_seen"]) == (3, {"at": 7}, 640)
    assert (state["world_size"], state["global_batch_size"], state["seq_len"]) == (2, 16, 8)
    assert [s for s in range(1, 5) if ck.due(s)] == [2, 4]  # every save_interval steps and the last


def test_checkpointer_restores_every_part_in_one_call():
    log, counters = [], RunCounters(started=0.0)
    counters.tokens_seen = 640
    saved = Layout([])
    _checkpointer([], saved, Position([], 7), counters).save(3)
    state = saved.saved[3]

    counters2 = RunCounters(started=0.0)
    data = Position(log)
    ck = _checkpointer(log, Layout(log), data, counters2)
    ck.restore(Path("step_3"), state)
    # the data position and its first batch before the tensors (before any compile); the tensors' values
    # from the checkpoint after the layout materialised them
    assert log == ["data", "open", "materialize fresh=False", "tensors step_3"]
    assert data.at == 7 and counters2.tokens_seen == 640
    assert counters2.elapsed_before == pytest.approx(state["elapsed_s"])

    fresh_log = []
    _checkpointer(fresh_log, Layout(fresh_log), Position(fresh_log), RunCounters(started=0.0)).restore(None, {})
    assert fresh_log == ["open", "materialize fresh=True"]


def test_the_rng_part_continues_its_stream():
    import mindspore as ms

    rng = RngState()
    ms.set_seed(3)  # a run's seed: restoring it must not reseed numpy's stream after its state is set
    np.random.seed(5)
    state = json.loads(json.dumps(rng.state_dict()))  # as state.json holds it
    want = np.random.rand(3)
    np.random.rand(10)
    rng.load_state_dict(state)
    np.testing.assert_array_equal(np.random.rand(3), want)


def _tiny_run(tmp_path):
    import mindspore as ms

    from ms_deepseek.checkpoint.tensors import model_tensors
    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM

    cfg = small_config(num_hidden_layers=2)
    recipe = SimpleNamespace(
        model_config=cfg,
        parallel=ParallelConfig(dp=1),
        lora=None,
        global_batch_size=2,
        to_yaml=lambda: "model: {source: tiny}\n",
    )
    ms.set_seed(0)
    model = DeepseekV2ForCausalLM(cfg)
    opt = {"adam_m.lm_head.weight": ms.Parameter(ms.Tensor(np.ones((cfg.vocab_size, 32), np.float32)), "m")}
    ctx = RunContext(recipe, tmp_path)
    return ctx, TrainTensors(model, None, model_tensors(model), opt, None, tmp_path / "s.ckpt", 1, 2, 8)


def test_data_parallel_layout_writes_and_reads_the_checkpointers_tensors(tmp_path):
    """The strategy and the checkpointer built without a trainer: a saved run's tensors and counters come back
    into a changed model through Checkpointer.restore."""
    import mindspore as ms

    from ms_deepseek.checkpoint.training import CheckpointManager, read_state
    from ms_deepseek.train.components import Checkpointer
    from ms_deepseek.train.lora_run import FullModel
    from ms_deepseek.train.parallelism import DATA_PARALLEL

    ctx, tensors = _tiny_run(tmp_path)
    manager = CheckpointManager(tmp_path / "checkpoints", 2)
    counters = RunCounters(started=0.0)
    counters.tokens_seen = 32
    data = Position([])
    saved = Checkpointer(ctx, DATA_PARALLEL, FullModel(), tensors, data, counters, manager, 2).save(2)
    assert saved == tmp_path / "checkpoints" / "step_00000002"
    want = {n: p.asnumpy().copy() for n, p in tensors.model_tensors.items()}
    for p in list(tensors.model_tensors.values()) + list(tensors.opt_tensors.values()):
        p.set_data(ms.Tensor(np.zeros(p.shape, np.float32)).astype(p.dtype))
    counters2 = RunCounters(started=0.0)
    Checkpointer(ctx, DATA_PARALLEL, FullModel(), tensors, Position([]), counters2, manager, 2).restore(
        saved, read_state(saved)
    )
    for name, value in want.items():
        np.testing.assert_array_equal(tensors.model_tensors[name].asnumpy(), value, err_msg=name)
    np.testing.assert_array_equal(tensors.opt_tensors["adam_m.lm_head.weight"].asnumpy(), 1.0)
    assert counters2.tokens_seen == 32


def test_the_layout_protocol_declares_every_member_of_the_layouts():
    """What the trainer and its builders use of a layout is what LayoutStrategy declares: the two layouts'
    public members and the Protocol's are the same set."""
    from ms_deepseek.train.context import LayoutStrategy
    from ms_deepseek.train.parallelism import DataParallel, Sharded

    declared = set(LayoutStrategy.__annotations__) | {n for n in vars(LayoutStrategy) if not n.startswith("_")}
    for layout in (DataParallel, Sharded):
        public = {n for n in dir(layout) if not n.startswith("_")}
        assert public == declared, (layout.__name__, public ^ declared)


def test_the_trainer_is_complete_when_built():
    """Every attribute of a Trainer is a field declared on the class without a default (its builder must set
    each one), and no method of the trainer module sets an attribute afterwards."""
    import ast
    import dataclasses
    import inspect

    from ms_deepseek.train import trainer as trainer_mod

    fields = dataclasses.fields(trainer_mod.Trainer)
    assert fields and all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING for f in fields)
    tree = ast.parse(inspect.getsource(trainer_mod))
    set_later = [
        f"line {node.lineno}: self.{target.attr}"
        for node in ast.walk(tree)
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"
    ]
    assert not set_later, set_later
