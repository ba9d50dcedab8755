"""The training step reads its weights without MindSpore's per-read copies, and trains exactly the same.

By default MindSpore copies (``TensorMove``) every read of a parameter that its graph reads more than once
(``order_enforce.cc`` ``OrderEnforcer::GetSpecialLoads``). The float32 update of weights stored in another dtype
reads each weight a second time, so every weight of the step was copied and the copy held from the first forward
to the last backward: ~7 GB on ``v2-sft-64npu``'s first stage (docs/planner.md). The trainer turns the copies off
(``core/runtime.py`` ``skip_parameter_load_copies``). The copies protect a value read before a write and used
after it; the step has none, so turning them off must change nothing: with MindSpore's default, where the compiled
step holds the copies, and ours, where it holds none, the losses and the weights must be the same, bit for bit.

Float16 weights take the composite update here (the CPU has no bfloat16 matmul).

* The pipeline step (pp > 1, the layout whose copies were measured) in one graph: forward, backward and the update
  of every weight, which reads the gradient the pipeline pass accumulated (``accu_grads``, filled here by hand as
  on CPU the pass does not run), so nothing but MindSpore's ordering of side effects keeps a weight's update after
  its reads. Each mode runs in its own process (MindSpore reads the setting once per process).
* The trainer sets it: two runs of ``ms-deepseek train`` (data parallel on CPU, where the update is a graph of
  its own and only the step counter is read twice).
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from safetensors.numpy import load_file

from ms_deepseek.core.runtime import LOAD_COPIES_ENV
from ms_deepseek.verification.dryrun import ir_dump_env

from builders import SMALL_MODEL, write_recipe

pytestmark = pytest.mark.slow  # two trainings or two compiled steps per test: the full tier

FLOAT16_MODEL = dict(SMALL_MODEL, param_dtype="float16", compute_dtype="float16")


def _recipe(tmp_path):
    data = {
        "model": {"source": "tiny", "overrides": FLOAT16_MODEL},
        "data": {"seq_len": 32, "embedded_vocab_size": 512},
        "train": {"steps": 3, "micro_batch_size": 2, "grad_accum_steps": 2, "seed": 5, "mode": "graph"},
        "optim": {"lr": 2e-3, "warmup_steps": 1, "weight_decay": 0.1},
        "checkpoint": {"save_interval": 0},
        "logging": {"log_interval": 1, "tensorboard": False},
    }
    return write_recipe(tmp_path / "recipe", data)


def _ir_env(ir_dir, load_copies):
    """Dump the graph MindSpore runs (the compile check's ``validate`` dump); ``load_copies``: MindSpore's copy
    mode, None for ours (what the code under test sets)."""
    env = dict(os.environ, **ir_dump_env(ir_dir))
    env.pop(LOAD_COPIES_ENV, None)
    if load_copies is not None:
        env[LOAD_COPIES_ENV] = load_copies
    return env


def _copies_in_largest_graph(ir_dir):
    """``TensorMove`` nodes in the largest graph dumped (the step; the others are small, e.g. the schedule)."""
    dumps = sorted(ir_dir.rglob("*validate*.ir"))
    assert dumps, f"no IR dump under {ir_dir}"
    return max(dumps, key=lambda p: p.stat().st_size).read_text(errors="replace").count("= TensorMove(")


_PIPELINE_STEP = """
import json
import sys
import mindspore as ms
import numpy as np
from mindspore import Tensor
from mindspore.parallel.nn import Pipeline

from ms_deepseek.config.model import get_preset
from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.config.recipe import OptimSection, TrainSection
from ms_deepseek.core.runtime import skip_parameter_load_copies
from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM
from ms_deepseek.train.optim import build_optimizer
from ms_deepseek.train.step import build_step

out, ours, model_overrides = sys.argv[1], sys.argv[2] == "ours", json.loads(sys.argv[3])
if ours:
    skip_parameter_load_copies()
ms.set_context(mode=ms.GRAPH_MODE)
cfg = get_preset("tiny", **model_overrides)
ms.set_seed(0)
model = DeepseekV2ForCausalLM(cfg)
optimizer = build_optimizer(model.trainable_params(), OptimSection(lr=1e-2, schedule="constant", weight_decay=0.1), 10)
k = 2
step, _ = build_step(
    model, optimizer, TrainSection(clip_grad_norm=1.0), ParallelConfig(pp=2, micro_batches=k),
    wrap_net=lambda net: Pipeline(net, k),
)
rng = np.random.default_rng(3)
results = {}
for s in range(3):
    for accu in step.pipeline.accu_grads:  # what the pipeline pass would have summed
        accu.set_data(Tensor((rng.normal(size=accu.shape) * 0.01).astype(np.float16)))
    ids = Tensor(rng.integers(3, cfg.vocab_size, (2 * k, 16)).astype(np.int32))
    outputs, norm, *_ = step(ids, ids)
    results[f"outputs_{s}"] = outputs.asnumpy()
    results[f"norm_{s}"] = norm.asnumpy()
results.update({p.name: p.asnumpy() for p in model.trainable_params()})
np.savez(out, **results)
"""


def _pipeline_step(tmp_path, name, load_copies=None):
    script = tmp_path / "pipeline_step.py"
    script.write_text(textwrap.dedent(_PIPELINE_STEP))
    out = tmp_path / f"{name}.npz"
    ir_dir = tmp_path / f"ir_{name}"
    cmd = [sys.executable, str(script), str(out), "default" if load_copies else "ours", json.dumps(FLOAT16_MODEL)]
    done = subprocess.run(cmd, env=_ir_env(ir_dir, load_copies), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return dict(np.load(out)), _copies_in_largest_graph(ir_dir)


def test_the_pipeline_step_reads_weights_uncopied_and_computes_bit_for_bit_as_with_copies(tmp_path):
    copied, copies = _pipeline_step(tmp_path, "copied", load_copies="1")
    ours, ours_copies = _pipeline_step(tmp_path, "ours")
    n_weights = sum(1 for key in copied if not key.startswith(("outputs_", "norm_")))
    # MindSpore's default copies every weight the update reads again (the oracle: the copies exist to be removed)
    assert copies >= n_weights, f"MindSpore's default: {copies} TensorMove for {n_weights} weights"
    assert ours_copies == 0, f"{ours_copies} TensorMove left"
    assert ours.keys() == copied.keys()
    for name, value in copied.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)


def _train(recipe, run_dir, ir_dir, load_copies=None):
    """Losses, final weights and the number of ``TensorMove`` nodes in the compiled training step."""
    cmd = [sys.executable, "-m", "ms_deepseek.cli", "train", str(recipe), "--output", str(run_dir), "--quiet"]
    done = subprocess.run(cmd, env=_ir_env(ir_dir, load_copies), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = sorted((run_dir / "checkpoints").iterdir())[-1]
    return losses, load_file(str(final / "model.safetensors")), _copies_in_largest_graph(ir_dir)


def test_the_trainer_turns_the_copies_off_and_trains_bit_for_bit_as_with_them(tmp_path):
    recipe = _recipe(tmp_path)
    copied_losses, copied, copies = _train(recipe, tmp_path / "copied", tmp_path / "ir_copied", load_copies="1")
    losses, ours, ours_copies = _train(recipe, tmp_path / "ours", tmp_path / "ir_ours")
    # here only the step counter is read twice in one graph (the learning rate before its increment, the bias
    # correction after)
    assert copies >= 1, f"MindSpore's default mode: {copies} TensorMove in the update"
    assert ours_copies == 0, f"the trainer's update still copies {ours_copies} parameter reads"
    assert len(losses) == 3 and losses == copied_losses
    assert ours.keys() == copied.keys()
    for name, value in copied.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
