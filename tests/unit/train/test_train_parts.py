"""The trainer's parts on their own, without a trainer: the run context, the checkpointer over named parts
(save and load), and a layout strategy as the checkpointer's file backend."""

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.train.components import Checkpointer, RngState, RunCounters
from ms_deepseek.train.context import RunContext, TrainTensors

from builders import small_config


class Position:
    """A part that gives and takes its own state."""

    def __init__(self, at=0):
        self.at = at

    def state_dict(self):
        return {"at": self.at}

    def load_state_dict(self, state):
        self.at = state["at"]


class Files:
    """A file backend that keeps what it was given."""

    def __init__(self):
        self.saved, self.loaded, self.order = {}, [], []

    def save(self, manager, step, state):
        self.saved[step] = json.loads(json.dumps(state))
        return Path(f"step_{step}")

    def load(self, folder):
        self.loaded.append(folder)
        self.order.append("tensors")


def test_run_context_is_frozen_and_reads_the_recipe():
    cfg, par = small_config(), ParallelConfig(dp=2)
    ctx = RunContext(SimpleNamespace(model_config=cfg, parallel=par), Path("run"), rank=1, world=2)
    assert (ctx.cfg, ctx.par, ctx.rank, ctx.world) == (cfg, par, 1, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.rank = 0


def test_checkpointer_saves_and_loads_every_named_part():
    files, position, counters = Files(), Position(7), RunCounters(started=0.0)
    counters.tokens_seen = 640
    save_only = SimpleNamespace(state_dict=lambda: {"fixed": True})  # takes its state when built
    ck = Checkpointer(None, files, {"data": position, "built": save_only}, merged=[counters], fixed={"seq_len": 8})
    assert ck.save(3) == Path("step_3")
    state = files.saved[3]
    assert state["step"] == 3 and state["data"] == {"at": 7} and state["built"] == {"fixed": True}
    assert state["tokens_seen"] == 640 and state["seq_len"] == 8 and "elapsed_s" in state  # merged at the top

    restored, counters2 = Position(), RunCounters(started=0.0)

    class Watched(Position):
        def load_state_dict(self, state):
            files.order.append("data")
            super().load_state_dict(state)

    restored = Watched()
    ck2 = Checkpointer(None, files, {"data": restored, "built": save_only}, merged=[counters2])
    ck2.load(Path("step_3"), state)
    assert files.loaded == [Path("step_3")] and files.order == ["tensors", "data"]  # the tensors first
    assert restored.at == 7 and counters2.tokens_seen == 640
    assert counters2.elapsed_before == pytest.approx(state["elapsed_s"])


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


def test_data_parallel_layout_is_the_checkpointers_file_backend(tmp_path):
    """The strategy and the checkpointer built without a trainer: a saved run's tensors and counters come back
    into a changed model through Checkpointer.load."""
    import mindspore as ms

    from ms_deepseek.checkpoint.training import CheckpointManager, read_state
    from ms_deepseek.train.parallelism import DATA_PARALLEL, TensorFiles

    ctx, tensors = _tiny_run(tmp_path)
    manager = CheckpointManager(tmp_path / "checkpoints", 2)
    counters = RunCounters(started=0.0)
    counters.tokens_seen = 32
    files = TensorFiles(DATA_PARALLEL, ctx, tensors)
    saved = Checkpointer(manager, files, {"rng": RngState()}, merged=[counters]).save(2)
    assert saved == tmp_path / "checkpoints" / "step_00000002"
    want = {n: p.asnumpy().copy() for n, p in tensors.model_tensors.items()}
    for p in list(tensors.model_tensors.values()) + list(tensors.opt_tensors.values()):
        p.set_data(ms.Tensor(np.zeros(p.shape, np.float32)).astype(p.dtype))
    counters2 = RunCounters(started=0.0)
    Checkpointer(manager, files, {"rng": RngState()}, merged=[counters2]).load(saved, read_state(saved))
    for name, value in want.items():
        np.testing.assert_array_equal(tensors.model_tensors[name].asnumpy(), value, err_msg=name)
    np.testing.assert_array_equal(tensors.opt_tensors["adam_m.lm_head.weight"].asnumpy(), 1.0)
    assert counters2.tokens_seen == 32
