"""Builders several test files share: the small model overrides of the training recipes, a small model
config, recipe writing, the Atlas recipe list, the CLI run in-process with its output captured, a free port."""

import contextlib
import io
import socket
from pathlib import Path

import yaml

from repo_paths import RECIPES

# model.overrides of the small training recipes: 2 layers (hidden 32, one MoE layer with 8 experts), vocab 512
SMALL_MODEL = {
    "vocab_size": 512,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "max_position_embeddings": 64,
    "capacity_factor": None,
}

# every recipe meant for Atlas hardware (the *-cpu recipes run here)
ATLAS_RECIPES = sorted(p for p in RECIPES.glob("*.yaml") if not p.stem.endswith("-cpu"))


def small_config(**over):
    """A 4-layer config with 8 routed experts (one dense layer first), small enough for every layout test."""
    from ms_deepseek.config.model import DeepseekV2Config

    values = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=4,
        num_attention_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        first_k_dense_replace=1,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=1,
    )
    values.update(over)
    return DeepseekV2Config(**values)


def write_recipe(folder: Path, data) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def small_recipe(data_path=None, dp=2, **parallel):
    """A 3-step recipe of the SMALL_MODEL on the embedded corpus (or DATA_PATH) with dp workers."""
    data = {
        "model": {"source": "tiny", "overrides": dict(SMALL_MODEL)},
        "data": {"seq_len": 32, "embedded_vocab_size": 512}
        if data_path is None
        else {"path": str(data_path), "num_workers": 1},
        "train": {"steps": 3, "micro_batch_size": 2, "seed": 5},
        "optim": {"lr": 2e-3, "warmup_steps": 1},
        "parallel": dict({"dp": dp}, **parallel),
        "checkpoint": {"save_interval": 0},
        "logging": {"log_interval": 1, "tensorboard": False},
    }
    return data


def main_captured(argv):
    """(exit code, stdout, stderr) of ``ms-deepseek ARGV`` run in this process."""
    from ms_deepseek.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_during_save_then_resume(monkeypatch, recipe: Path, run_dir: Path, step: int = 3) -> None:
    """Train ``recipe`` into ``run_dir`` with a kill (KeyboardInterrupt) in the middle of step ``step``'s save,
    which leaves a half-written optimizer file, then ``--resume`` the run to its end."""
    from ms_deepseek.checkpoint import training as ckpt_mod
    from ms_deepseek.cli import main

    real_save = ckpt_mod.save_tensors

    def crashing_save(named, path):
        if f"step_{step:08d}" in str(path.parent) and path.name == "optimizer.safetensors":
            path.write_bytes(b"\x00" * 64)
            raise KeyboardInterrupt("simulated kill during save")
        return real_save(named, path)

    monkeypatch.setattr(ckpt_mod, "save_tensors", crashing_save)
    assert main(["train", str(recipe), "--output", str(run_dir), "--quiet"]) == 130
    monkeypatch.setattr(ckpt_mod, "save_tensors", real_save)
    assert main(["train", str(recipe), "--output", str(run_dir), "--quiet", "--resume"]) == 0


def emulated_rank(recipe, run_dir: Path, rank: int, model, applied, model_tensors, seq_len: int = 8):
    """One emulated rank of a sharded run, built from the trainer's parts without a trainer: its
    ``RunContext`` (``recipe`` needs ``model_config``, ``parallel``, ``lora``, ``weights_folder``,
    ``global_batch_size`` and ``to_yaml``), its ``TrainTensors`` (no compiled step, no optimizer state) and
    the ``Checkpointer`` that saves them through the sharded layout (its data part a stand-in)."""
    import time
    from types import SimpleNamespace

    from ms_deepseek.checkpoint.training import CheckpointManager
    from ms_deepseek.train.components import Checkpointer, RunCounters
    from ms_deepseek.train.context import RunContext, TrainTensors
    from ms_deepseek.train.lora_run import model_converter
    from ms_deepseek.train.parallelism import SHARDED

    run_dir = Path(run_dir)
    ctx = RunContext(recipe, run_dir, rank, recipe.parallel.world_size)
    strategy_file = run_dir / "strategy" / "none.ckpt"
    tensors = TrainTensors(model, applied, model_tensors, {}, None, strategy_file, 1, 1, seq_len)
    data = SimpleNamespace(state_dict=lambda: {}, seq_len=seq_len)
    checkpointer = Checkpointer(
        ctx,
        SHARDED,
        model_converter(recipe),
        tensors,
        data,
        RunCounters(time.time()),
        CheckpointManager(run_dir / "checkpoints", 2),
        stop_at=1,
    )
    return SimpleNamespace(ctx=ctx, tensors=tensors, checkpointer=checkpointer)
