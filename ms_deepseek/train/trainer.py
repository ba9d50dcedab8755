"""Recipe -> trained model: the training loop of one worker (data-parallel under msrun).

``train(recipe, run_dir, resume=None)`` builds the model (random init, or a checkpoint
folder's weights), the data-parallel rank's batches, MindFormers AdamW and the compiled
compiled train step (one graph per optimizer step), then runs ``train.steps`` optimizer steps. Every
``logging.log_interval`` steps it writes a record to ``RUN_DIR/metrics.jsonl`` and
TensorBoard and prints a line; every ``checkpoint.save_interval`` steps (and at the end)
it saves ``RUN_DIR/checkpoints/step_N``. ``resume`` continues from a checkpoint exactly:
same data position, optimizer state, step count and RNG state.

Under msrun (``MS_WORKER_NUM`` set) each worker joins the collective group
(``mindspore.communication.init``, mccl on CPU, HCCL on Ascend), reads its shard of each
global batch, and gradients are averaged with ``nn.DistributedGradReducer`` once per
optimizer step; rank 0 writes metrics and checkpoints.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from ms_deepseek.errors import UserError
from ms_deepseek.train import checkpoint as ckpt_mod
from ms_deepseek.train import metrics as metrics_mod
from ms_deepseek.train.recipe import Recipe


@dataclass
class TrainResult:
    run_dir: Path
    steps: int                      # optimizer steps completed (total, including resumed ones)
    final_loss: float
    losses: List[float] = field(default_factory=list)  # LM loss of every step run in this call
    checkpoint: Optional[Path] = None
    metrics_path: Optional[Path] = None
    tokens_per_s: float = 0.0       # steady state: steps after the first (compile) step of this call
    wall_s: float = 0.0


def _distributed() -> bool:
    return int(os.environ.get("MS_WORKER_NUM", "1") or 1) > 1 or os.environ.get("MS_ROLE") == "MS_WORKER"


def _init_distributed(par):
    """Join the collective group; returns (rank, world size)."""
    import mindspore as ms
    from mindspore.communication import get_group_size, get_rank, init

    init()
    rank, world = get_rank(), get_group_size()
    if world != par.world_size:
        raise UserError(f"parallel: {par.describe()} needs {par.world_size} workers (dp x tp x pp) but msrun "
                        f"started {world}")
    if not par.uses_semi_auto:  # sharded layouts get their context from the AutoParallel wrapper
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                     device_num=world)
    return rank, world


def _device_target() -> str:
    """MS_DEEPSEEK_DEVICE if set, else Ascend on a host with NPUs and CANN, else CPU."""
    import shutil

    if os.environ.get("MS_DEEPSEEK_DEVICE"):
        return os.environ["MS_DEEPSEEK_DEVICE"]
    if shutil.which("npu-smi") and os.environ.get("ASCEND_HOME_PATH"):
        return "Ascend"
    return "CPU"


def _model_tensors(model) -> Dict[str, object]:
    """The model's parameters under its own names, without the expert placement table (plan data)."""
    return {name: p for name, p in model.parameters_and_names() if not name.endswith("expert_placement")}


def _rng_state() -> Dict:
    import mindspore as ms

    np_state = np.random.get_state()
    return {"numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
            "mindspore_seed": ms.get_seed(),
            "mindspore_generator": ms.get_rng_state().asnumpy().tolist()}


def _restore_rng(state: Dict) -> None:
    import mindspore as ms

    if "numpy" in state:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if state.get("mindspore_seed") is not None:
        ms.set_seed(int(state["mindspore_seed"]))
    if "mindspore_generator" in state:
        dtype = ms.get_rng_state().asnumpy().dtype  # the generator's own state dtype (uint8)
        ms.set_rng_state(ms.Tensor(np.asarray(state["mindspore_generator"], dtype=dtype)))


def _load_into(params: Dict[str, object], path: Path, what: str) -> None:
    """Copy every named tensor of a safetensors file into ``params``; all must be present, shapes equal."""
    import mindspore as ms

    stored = ckpt_mod.load_tensors(path)
    missing = [n for n in params if n not in stored]
    if missing:
        raise UserError(f"{path}: {what} tensor {missing[0]} is missing"
                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                        + "; the checkpoint does not match this recipe's model")
    for name, param in params.items():
        value = stored[name]
        if tuple(value.shape) != tuple(param.shape):
            raise UserError(f"{path}: {what} tensor {name} has shape {list(value.shape)}, "
                            f"the model has {list(param.shape)}")
        param.set_data(ms.Tensor(value.asnumpy(), dtype=param.dtype))


def _stack_micro_batches(parts: List[Dict[str, np.ndarray]], pad_id: int):
    """k micro-batches -> one [k * b, T] pair, in order (SFT buckets of one step padded to the longest)."""
    from ms_deepseek.data.chat import IGNORE_INDEX

    if len(parts) == 1:
        return parts[0]["input_ids"], parts[0]["labels"]
    width = max(p["input_ids"].shape[1] for p in parts)
    ids, labels = [], []
    for p in parts:
        extra = width - p["input_ids"].shape[1]
        # pads go after the real tokens: causal attention keeps them invisible, -100 keeps them out of the loss
        ids.append(np.pad(p["input_ids"], ((0, 0), (0, extra)), constant_values=pad_id) if extra
                   else p["input_ids"])
        labels.append(np.pad(p["labels"], ((0, 0), (0, extra)), constant_values=IGNORE_INDEX) if extra
                      else p["labels"])
    return np.concatenate(ids), np.concatenate(labels)


def _first_batch_checked(dataset):
    """The batch iterator, with its first batch already read: unreadable shards fail here, as one line."""
    import itertools

    it = iter(dataset)
    try:
        first = next(it)
    except UserError:
        raise
    except Exception as exc:  # MindSpore's reader raises RuntimeError with a multi-line report
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        # the report's "Dataset Pipeline Error Message" section holds the reason, e.g. "Failed to read file."
        reason = next((ln for ln in lines if ln.startswith("[ERROR]")), lines[0] if lines else type(exc).__name__)
        raise UserError(f"data.path: {dataset.data_dir}: cannot read the training samples "
                        f"({reason[:300]}); prepare the folder again with `ms-deepseek prepare-data`") from None
    return itertools.chain([first], it)


def _print(msg: str, bar) -> None:
    if bar is not None:
        bar.write(msg)
    else:
        print(msg, flush=True)


def train(recipe: Recipe, run_dir, resume: Optional[str] = None, force: bool = False,
          progress: bool = True, max_steps: Optional[int] = None) -> TrainResult:
    """Run the recipe. ``max_steps`` stops early after that many total steps (the schedule still
    spans ``train.steps``), which is how a run is split into resumable pieces."""
    from ms_deepseek.train import optim

    started = time.time()
    run_dir = Path(run_dir)
    cfg = recipe.model_config
    par = recipe.parallel
    sharded = par.uses_semi_auto
    if sharded and _device_target() == "CPU":
        raise UserError(f"parallel: {par.describe()} shards the model (tp / pp / ep / optimizer sharding), which "
                        "MindSpore compiles only on Ascend; on CPU train data-parallel layouts (parallel.dp only), "
                        "and size this one with `ms-deepseek plan` / `launch --dry-run`")
    plan = fit_plan(recipe, force)
    if par.world_size > 1 and not _distributed():
        what = f"parallel: {par.describe()}" if sharded else f"parallel.dp: {par.dp}"
        raise UserError(f"{what} needs {par.world_size} workers; start them with `ms-deepseek launch` (msrun), "
                        "or set parallel.dp=1 for one worker")

    import mindspore as ms
    from mindspore import Tensor, nn

    from ms_deepseek.train import sharded as sharded_mod

    ms.set_context(device_target=_device_target())
    rank, world = _init_distributed(par) if _distributed() else (0, 1)
    # Rank 0 coordinates checkpoints; the logging rank sees the real loss (with pipeline
    # parallelism only the last stage computes it).
    log_rank = (par.pp - 1) * par.dp * par.tp if sharded else 0
    is_main = rank == log_rank

    # ---- resume state
    resume_dir = ckpt_mod.resolve_resume(resume, run_dir) if resume else None
    existing = ckpt_mod.CheckpointManager(run_dir / "checkpoints").latest()
    if resume_dir is None and existing is not None:
        raise UserError(f"--output {run_dir}: already holds checkpoints (newest {existing.name}); pass --resume "
                        "to continue that run, or choose another --output")
    state = ckpt_mod.read_state(resume_dir) if resume_dir else {}
    start_step = int(state.get("step", 0))
    total = recipe.train.steps
    stop_at = min(total, max_steps) if max_steps is not None else total
    if start_step >= total:
        raise UserError(f"--resume: {resume_dir} is at step {start_step}; train.steps is {total}, nothing to do "
                        "(raise train.steps with --set train.steps=N to train further)")

    # ---- data first: a bad dataset stops the run before anything is compiled
    from ms_deepseek.data.dataset import build_train_dataset

    data_rank, data_world, rows = (sharded_mod.data_coordinates(rank, par, recipe.train.micro_batch_size)
                                   if sharded else (rank, world, recipe.train.micro_batch_size))
    dataset = build_train_dataset(recipe.data, rows, data_rank, data_world,
                                  state=state.get("data"), max_positions=cfg.max_position_embeddings,
                                  vocab_size=cfg.vocab_size, progress=progress and is_main)
    seq_len = dataset.seq_len
    batches = _first_batch_checked(dataset)
    # MindFormers (AdamW, cosine schedule) logs into the run folder; its import resets the
    # execution mode, so it comes before set_context(mode=...) below.
    optim._mindformers(run_dir / "logs")

    # ---- model
    ms.set_seed(recipe.train.seed)
    np.random.seed(recipe.train.seed)
    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM

    weights_folder = recipe.weights_folder
    if weights_folder is not None and resume_dir is None:
        model = DeepseekV2ForCausalLM.from_pretrained(weights_folder, show_progress=progress and is_main,
                                                      **_config_changes(recipe))
    else:
        model = DeepseekV2ForCausalLM(cfg)
    model.set_train(True)
    from ms_deepseek.parallel.apply import apply_plan, auto_parallel_wrap, pipeline_wrap
    from ms_deepseek.parallel.memory import reserve_device_memory

    applied = apply_plan(model, par, cfg)  # strategies (inert in data parallel), expert placement, recompute
    if par.reserve_memory:  # Ascend: the planner's estimate + headroom, before compile (no-op on CPU)
        reserve_device_memory(plan, par.memory_headroom_gb, stage=sharded_mod.stage_of_rank(rank, par)
                              if par.pp > 1 else None, hbm_gb=par.hbm_gb)

    params = model.trainable_params()
    optimizer = optim.build_optimizer(params, recipe.optim, total, run_dir / "logs")
    ms.set_context(mode=ms.GRAPH_MODE if recipe.train.mode == "graph" else ms.PYNATIVE_MODE)
    # data parallel: average gradients here; sharded layouts: AutoParallel inserts the reductions
    reducer = nn.DistributedGradReducer(optimizer.parameters, mean=True, degree=world) \
        if world > 1 and not sharded else None
    dynamic = cfg.compute_dtype == "float16"
    from ms_deepseek.train.step import build_step

    moe_layers = cfg.moe_layer_indices
    E = cfg.n_routed_experts or 0
    k = par.micro_batches if par.pp > 1 else recipe.train.grad_accum_steps  # micro-batches per step
    wrap = (lambda net: pipeline_wrap(net, par, applied, model_prefix="model")) if par.pp > 1 else None
    step_cell, update = build_step(model, optimizer, k, len(moe_layers), E, recipe.train.clip_grad_norm, dynamic,
                                   recipe.train.loss_scale_init, recipe.train.loss_scale_factor,
                                   recipe.train.loss_scale_window, reducer, wrap_net=wrap)
    strategy_file = run_dir / "strategy" / f"rank_{rank:05d}.ckpt"
    if sharded:  # Ascend only (refused on CPU above)
        strategy_file.parent.mkdir(parents=True, exist_ok=True)
        step_cell = auto_parallel_wrap(step_cell, par, str(strategy_file))
    model_tensors = _model_tensors(model)
    opt_tensors = dict(optim.optimizer_state(optimizer))
    opt_tensors["loss_scale"] = update.loss_scale
    opt_tensors["loss_scale_good_steps"] = update.good_steps
    if resume_dir is not None:
        if sharded:  # parameters are sliced when the step compiles: compile, then load this rank's slices
            shape = (k * rows, dataset.seq_len)
            step_cell.compile(Tensor(np.zeros(shape, np.int32)), Tensor(np.zeros(shape, np.int32)))
            sharded_mod.load_sharded(resume_dir, rank, world, model_tensors, opt_tensors, _load_into)
        else:
            _load_into(model_tensors, resume_dir / "model.safetensors", "model")
            _load_into(opt_tensors, resume_dir / "optimizer.safetensors", "optimizer")
        _restore_rng(state.get("rng", {}))
    stats_mean = _RankMean(world) if world > 1 and not sharded else None

    # ---- outputs
    manager = ckpt_mod.CheckpointManager(run_dir / "checkpoints", recipe.checkpoint.keep_last)
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        manager.remove_partial()
        metrics_mod.truncate_after(run_dir / "metrics.jsonl", start_step)  # before the writer opens it
        _write_atomic(run_dir / "recipe.yaml", recipe.to_yaml())
    writer = metrics_mod.MetricsWriter(run_dir, recipe.logging.tensorboard and is_main, enabled=is_main)
    monitor = _alert_monitor() if (is_main and recipe.logging.alerts) else None
    memory_fn = _memory_metrics_fn()

    tokens_per_step = recipe.global_batch_size * seq_len
    elapsed_before = float(state.get("elapsed_s", 0.0))
    tokens_seen = int(state.get("tokens_seen", 0))
    losses: List[float] = []
    last_ckpt: Optional[Path] = None
    interval_tokens, interval_start = 0, time.time()
    steady_tokens, steady_time = 0, 0.0
    from tqdm import tqdm

    bar = tqdm(total=stop_at, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
               disable=not (progress and is_main and recipe.logging.progress_bar), leave=False)
    bar_or_none = bar if not bar.disable else None
    if is_main:
        what = f"resuming {resume_dir} at step {start_step}" if resume_dir else "starting"
        _print(f"{what}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
               f"{E} routed experts; global batch {recipe.global_batch_size} x {seq_len} tokens "
               f"({world} worker{'s' if world > 1 else ''}); output {run_dir}", bar_or_none)
    try:
        for step in range(start_step + 1, stop_at + 1):
            t0 = time.time()
            input_ids, labels = _stack_micro_batches([next(batches) for _ in range(k)], dataset.pad_id)  # [k * b, T]
            outputs, grad_norm, lr, overflow, cur_scale = step_cell(Tensor(input_ids), Tensor(labels))
            vec = outputs.asnumpy()  # host read: the step is finished
            grad_norm = float(grad_norm.asnumpy())
            loss_v, aux_v = float(vec[1]), float(vec[2])
            stats_v = vec[3:].reshape(len(moe_layers), E + 4) if moe_layers else np.zeros((0, E + 4), np.float32)
            if stats_mean is not None:
                loss_v, aux_v, stats_v = stats_mean(loss_v, aux_v, stats_v)
            losses.append(loss_v)
            tokens_seen += tokens_per_step
            interval_tokens += tokens_per_step
            if step > start_step + 1:
                steady_tokens += tokens_per_step
                steady_time += time.time() - t0
            bar.update(1)
            bar.set_postfix(loss=f"{loss_v:.3f}", refresh=False)
            if step % recipe.logging.log_interval == 0 or step == stop_at:
                now = time.time()
                record = {"step": step, "loss": loss_v, "total_loss": loss_v + aux_v, "lr": float(lr.asnumpy()),
                          "grad_norm": grad_norm,
                          "tokens_per_s": interval_tokens / max(now - interval_start, 1e-9),
                          "elapsed_s": elapsed_before + now - started}
                record.update(metrics_mod.moe_fields(stats_v, moe_layers, E))
                if dynamic:
                    record["loss_scale"] = float(cur_scale.asnumpy())
                    record["overflow"] = bool(overflow.asnumpy())
                metrics_mod.optional_memory(record, memory_fn() if memory_fn else None)
                interval_tokens, interval_start = 0, now
                if is_main:
                    writer.write(record)
                    _print(metrics_mod.console_line(record, total), bar_or_none)
                    for alert in (monitor.observe(record) if monitor is not None else []):
                        _print(f"ALERT {alert}", bar_or_none)
            save_now = (recipe.checkpoint.save_interval and step % recipe.checkpoint.save_interval == 0) or \
                (step == stop_at and recipe.checkpoint.save_final)
            if save_now:
                ckpt_state = {
                    "step": step, "data": dataset.state_dict(), "rng": _rng_state(),
                    "tokens_seen": tokens_seen, "elapsed_s": elapsed_before + time.time() - started,
                    "world_size": world, "global_batch_size": recipe.global_batch_size, "seq_len": seq_len,
                }
                if sharded:  # every rank writes its slices, rank 0 completes the folder
                    last_ckpt = sharded_mod.save_sharded(manager, step, rank, world, model_tensors, opt_tensors,
                                                         cfg, ckpt_state, recipe.to_yaml(), strategy_file, par)
                else:
                    if world > 1:  # every rank takes part: the replicas must hold the same weights
                        ckpt_state["replica_sha1"] = _replica_digests(model_tensors, world)
                    if rank == 0:
                        last_ckpt = manager.save(step, model_tensors, opt_tensors, cfg, ckpt_state,
                                                 recipe.to_yaml())
    finally:
        bar.close()
        writer.close()
    wall = time.time() - started
    result = TrainResult(run_dir=run_dir, steps=stop_at, final_loss=losses[-1] if losses else float("nan"),
                         losses=losses, checkpoint=last_ckpt or manager.latest(),
                         metrics_path=writer.path if is_main else None,
                         tokens_per_s=steady_tokens / steady_time if steady_time else 0.0, wall_s=wall)
    return result


def _replica_digests(tensors: Dict[str, object], world: int) -> List[str]:
    """SHA-1 of this rank's weights, all-gathered: one hex digest per rank. Raises if they differ."""
    import hashlib

    import mindspore as ms
    from mindspore import ops

    h = hashlib.sha1()
    for name in sorted(tensors):
        h.update(name.encode() + tensors[name].asnumpy().tobytes())
    mine = np.frombuffer(h.digest(), dtype=np.int32)  # 20 bytes -> [5]
    gathered = ops.AllGather()(ms.Tensor(mine)).asnumpy().reshape(world, -1)  # [world, 5]
    digests = [row.astype(np.int32).tobytes().hex() for row in gathered]
    if len(set(digests)) != 1:
        raise RuntimeError(f"data-parallel replicas hold different weights (sha1 per rank: {digests}); "
                           "gradient averaging is broken")
    return digests


class _RankMean:
    """Mean of the logged values over data-parallel workers (one small AllReduce per step)."""

    def __init__(self, world: int):
        from mindspore import ops

        self.world = world
        self.all_reduce = ops.AllReduce()

    def __call__(self, loss: float, aux: float, stats: np.ndarray):
        import mindspore as ms

        vec = np.concatenate([[loss, aux], stats.reshape(-1)]).astype(np.float32)
        out = self.all_reduce(ms.Tensor(vec)).asnumpy() / self.world
        return float(out[0]), float(out[1]), out[2:].reshape(stats.shape)


def _config_changes(recipe: Recipe) -> Dict:
    """Fields of the resolved config that differ from the folder's config.json (overrides, alphas)."""
    from ms_deepseek.config import load_model_config

    base = load_model_config(recipe.model.source)
    cfg = recipe.model_config
    return {k: getattr(cfg, k) for k in cfg.__dataclass_fields__ if getattr(cfg, k) != getattr(base, k)}


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def fit_plan(recipe: Recipe, force: bool = False):
    """The memory planner's verdict (``ms_deepseek.parallel.planner``) on the recipe's layout.

    UserError when it does not fit, unless ``force`` / ``parallel.force``; the result also
    sizes the device memory pool reserved before compile."""
    from types import SimpleNamespace

    from ms_deepseek.parallel.planner import check_recipe_fits

    view = SimpleNamespace(  # the fields the planner reads, with the sequence length resolved
        parallel=recipe.parallel, model_config=recipe.model_config,
        data=SimpleNamespace(seq_len=recipe.seq_len),
        train=SimpleNamespace(global_batch_size=recipe.global_batch_size,
                              micro_batch_size=recipe.train.micro_batch_size))
    result = check_recipe_fits(view)
    if not result.fits and not (force or recipe.parallel.force):
        why = "; ".join(result.problems) if result.problems else \
            f"needs {result.peak_gb:.1f} GB per NPU of {result.usable_gb:.1f} GB usable"
        raise UserError(f"parallel: {recipe.parallel.describe()} does not fit ({why}); see `ms-deepseek plan`, "
                        "or pass --force (parallel.force: true) to run anyway")
    return result


def _alert_monitor():
    from ms_deepseek.tools.alerts import AlertMonitor

    return AlertMonitor()


def _memory_metrics_fn():
    """Device memory numbers for the record; None on CPU, where MindSpore keeps no device pool."""
    if _device_target() == "CPU":
        return None
    from ms_deepseek.parallel.memory import memory_metrics

    return memory_metrics
