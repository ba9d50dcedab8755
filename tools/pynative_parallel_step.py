"""The tiny model's training step on MindSpore's dynamic-graph (PyNative) parallel stack, against one device.

MindSpore 2.10's dynamic-graph parallel stack (HyperParallel: DTensor, FSDP/HSDP, pipeline schedules) ships
as its own package, ``hyper_parallel`` (not a part of the ``mindspore`` wheel and not on the package index
this project installs from): pass the folder that holds it with ``--hyper-parallel``. This tool

1. trains the ``tiny`` preset (MLA + MoE, the project's own Cells) for ``--steps`` steps on one process over the
   whole batch (PyNative, CPU), and records the loss, the gradient norm, every gradient and every weight;
2. starts ``msrun`` with ``--workers`` CPU workers that run the same steps with the data split between them and
   every parameter sharded over them by HyperParallel's ``hsdp`` (FSDP-style: weights gathered before the
   forward, gradients reduce-scattered, the optimizer updating this rank's shard only);
3. compares each step's loss, gradient norm, gradients and weight changes with one device and prints one
   verdict; exit status 1 when they differ.

Where the stock stack stops on CPU (``--stock-collectives`` shows it): HyperParallel's MindSpore platform
(``hyper_parallel/platform/mindspore/platform.py``) calls ``mindspore.communication.comm_func``'s collectives,
whose PyNative kernels (``InnerCommAllGather``, ``InnerCommAllReduce``, ``InnerCommReduceScatter``) have no
CPU implementation ("The kernel InnerCommAllGather unregistered", ``pyboost_utils.cc`` ``SelectKernel``). By
default the tool replaces those three platform functions with the collective primitives that do run in
PyNative on CPU (``ops.AllGather`` and ``ops.AllReduce``; a reduce-scatter is an AllReduce and this rank's
chunk), which compute the same values. MindSpore's CPU collectives take only the world group
(``allgather_cpu_kernel_collective.cc`` ``Init``: "AllGather only support mccl_world_group on CPU"), so the
sharding group must be every worker: one FSDP axis, no second mesh dimension. ``--probe-collectives`` lists
which collectives run in PyNative on this CPU.

The step: cross-entropy only (balance-loss weights 0: they are statistics of each rank's own tokens, not a
per-token mean) and no expert capacity (dropless: which token a full expert drops depends on the batch's
composition), so the data-parallel mean of the ranks' losses is the one-device loss. The optimizer is SGD with
momentum: its change of a weight is proportional to the gradient (step 1) and carries step 1's momentum into
step 2, so a weight change compared with one device checks the gradient's size and sign, which Adam's
normalised first step would not.

Example:  python tools/pynative_parallel_step.py --hyper-parallel /path/to/hyper-parallel
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
FLOAT32_EPS = float(np.finfo(np.float32).eps)
# Relative allowance for a value computed in float32 by two summation orders (the batch split over ranks,
# the gradient reduced over ranks): a few hundred roundings of eps / 2 each, far below any planted error.
SUM_ORDER_TOL = 1e-5
# MindSpore's world group on CPU (msrun workers): the only group its CPU collectives take
CPU_WORLD = "mccl_world_group"


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=(
            "The tiny model's training step on MindSpore's dynamic-graph (PyNative) parallel stack "
            "(HyperParallel hsdp: data parallel with FSDP-style sharding) over msrun CPU workers, compared with "
            "one device: loss, gradient norm, gradients and weight changes per step."
        )
    )
    p.add_argument("--hyper-parallel", type=Path, help="folder holding the hyper_parallel package (a source checkout)")
    p.add_argument("--workers", type=int, default=2, help="msrun CPU workers (data parallel = FSDP axis); default 2")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps compared; default 2")
    p.add_argument("--batch", type=int, default=4, help="global batch (rows), split over the workers; default 4")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per row; default 32")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate; default 0.05")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum; default 0.9")
    p.add_argument(
        "--optimizer-level",
        default="level1",
        choices=["level1", "level2", "level3"],
        help="hsdp optimizer_level (level1: weights and optimizer state sharded); default level1",
    )
    p.add_argument(
        "--plant",
        default="none",
        choices=["none", "half-grad", "skip-update"],
        help="plant a mistake on the last rank to see the comparison fail: half-grad halves its gradients, "
        "skip-update leaves its shard unchanged",
    )
    p.add_argument(
        "--stock-collectives",
        action="store_true",
        help="use HyperParallel's own collectives (comm_func): shows where the stock stack stops on CPU",
    )
    p.add_argument(
        "--probe-collectives", action="store_true", help="only list which collectives run in PyNative on CPU"
    )
    p.add_argument(
        "--recompute",
        action="store_true",
        help="recompute every decoder layer in the backward (Cell.recompute, the plan's recompute=full)",
    )
    p.add_argument("--keep", type=Path, help="keep the exchanged arrays and worker logs in this folder")
    p.add_argument("--master-port", type=int, default=8741, help="msrun's master port; default 8741")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.add_argument("--role", choices=["single", "worker", "probe"], help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.workers < 2:
        p.error("--workers: at least 2")
    if args.batch % args.workers:
        p.error(f"--batch {args.batch}: must divide by --workers {args.workers}")
    if args.steps < 1:
        p.error("--steps: at least 1")
    return args


# ------------------------------------------------------------------ both sides


def setup_mindspore():
    import mindspore as ms

    from ms_deepseek.core.runtime import check_mindspore_version, quiet_defaults

    quiet_defaults()
    check_mindspore_version()
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    ms.set_deterministic(True)
    # PyNative launches each op asynchronously by default; launching them in line is faster on a few
    # CPU cores and changes no value (tests/conftest.py does the same)
    ms.runtime.launch_blocking()
    return ms


def build_model(ms, recompute=False):
    """The ``tiny`` preset, cross-entropy only and dropless (see the module docstring)."""
    from ms_deepseek.config.model import get_preset
    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM

    cfg = get_preset(
        "tiny",
        capacity_factor=None,
        eval_capacity_factor=None,
        aux_loss_alpha=0.0,
        expert_aux_loss_alpha=0.0,
        device_aux_loss_alpha=0.0,
        comm_aux_loss_alpha=0.0,
    )
    ms.set_seed(1234)
    model = DeepseekV2ForCausalLM(cfg)
    if recompute:
        for layer in model.model.layers:
            layer.recompute()
    model.set_train(True)
    return cfg, model


def batch(cfg, args):
    """Global batch: ids and next-token labels, the same on every process (rows split by rank)."""
    rng = np.random.default_rng(7)
    ids = rng.integers(3, cfg.vocab_size, size=(args.steps, args.batch, args.seq_len + 1), dtype=np.int64)
    return ids[..., :-1].astype(np.int32), ids[..., 1:].astype(np.int32)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def loss_fn_of(model):
    def forward(input_ids, labels):
        return model(input_ids, labels).loss

    return forward


# ------------------------------------------------------------------ one device


def run_single(args):
    ms = setup_mindspore()
    from mindspore import nn

    cfg, model = build_model(ms, args.recompute)
    params = model.trainable_params()
    names = [p.name for p in params]
    init = {n: p.asnumpy().copy() for n, p in zip(names, params)}
    opt = nn.SGD(params, learning_rate=args.lr, momentum=args.momentum)
    grad_fn = ms.value_and_grad(loss_fn_of(model), None, params)
    ids, labels = batch(cfg, args)
    out = {"init": init, "steps": []}
    for s in range(args.steps):
        t0 = time.perf_counter()
        loss, grads = grad_fn(ms.Tensor(ids[s]), ms.Tensor(labels[s]))
        opt(grads)
        dt = time.perf_counter() - t0
        g = {n: x.asnumpy() for n, x in zip(names, grads)}
        out["steps"].append(
            {
                "loss": float(loss.asnumpy()),
                "gnorm": float(np.sqrt(sum(float((v.astype(np.float64) ** 2).sum()) for v in g.values()))),
                "grads": g,
                "weights": {n: p.asnumpy().copy() for n, p in zip(names, params)},
                "seconds": dt,
            }
        )
    out["param_bytes"] = int(sum(v.nbytes for v in init.values()))
    # which implementation each of the project's custom operators got (ms_deepseek/ops/backend.py)
    kinds = {type(c).__name__ + ": " + c.impl.kind for _, c in model.cells_and_names() if hasattr(c, "impl")}
    out["custom_ops"] = sorted(kinds)
    out["peak_rss_mb"] = peak_rss_mb()
    save(args.out, out)


# ------------------------------------------------------------------ msrun workers


def cpu_collectives(platform_cls, ms):
    """HyperParallel's three platform collectives on PyNative CPU primitives (world group only)."""
    from mindspore import mint, ops
    from mindspore.communication import get_group_size, get_rank

    world = get_group_size()

    def members(group_info):
        size = getattr(group_info, "rank_size", None)
        if size is None and not isinstance(group_info, str):
            size = get_group_size(group_info.group_name)
        if size not in (None, world):
            name = getattr(group_info, "group_name", group_info)
            raise RuntimeError(f"group {name}: MindSpore's CPU collectives take only the world group")

    def all_gather_into_tensor(data, group_info, async_op=False):
        members(group_info)
        return ops.AllGather()(data), None

    def all_reduce(data, group_info, async_op=False):
        members(group_info)
        return ops.AllReduce()(data), None

    def reduce_scatter_tensor(data, group_info, async_op=False):
        members(group_info)
        return mint.chunk(ops.AllReduce()(data), world, 0)[get_rank()], None

    platform_cls.all_gather_into_tensor = staticmethod(all_gather_into_tensor)
    platform_cls.all_reduce = staticmethod(all_reduce)
    platform_cls.reduce_scatter_tensor = staticmethod(reduce_scatter_tensor)


def run_worker(args):
    ms = setup_mindspore()
    from mindspore import nn, ops
    from mindspore.communication import get_group_size, get_rank, init

    init()
    rank, world = get_rank(), get_group_size()
    if not args.stock_collectives:
        from hyper_parallel.platform.mindspore.platform import MindSporePlatform

        cpu_collectives(MindSporePlatform, ms)
    from hyper_parallel import hsdp, parallelize_value_and_grad

    cfg, model = build_model(ms, args.recompute)
    full_shapes = {p.name: tuple(p.shape) for p in model.trainable_params()}
    # sum over ranks, then 1/world: the gradient of the mean loss, as one device computes it
    hsdp(model, shard_size=-1, threshold=0, optimizer_level=args.optimizer_level, grad_scale=1.0 / world)
    params = model.trainable_params()
    names = [p.name for p in params]
    opt = nn.SGD(params, learning_rate=args.lr, momentum=args.momentum)
    grad_fn = parallelize_value_and_grad(loss_fn_of(model), params)
    ids, labels = batch(cfg, args)
    rows = args.batch // world
    mine = slice(rank * rows, (rank + 1) * rows)
    gather, reduce = ops.AllGather(), ops.AllReduce()

    def full(t, name):
        """This rank's shard -> the whole tensor (shards are split on axis 0 in rank order)."""
        if tuple(t.shape) == full_shapes[name]:
            return t.asnumpy()
        return gather(t).asnumpy()

    local_bytes = int(sum(p.asnumpy().nbytes for p in params))
    out = {"steps": [], "rank": rank, "world": world, "local_param_bytes": local_bytes}
    out["sharded"] = sorted(n for n, p in zip(names, params) if tuple(p.shape) != full_shapes[n])
    for s in range(args.steps):
        t0 = time.perf_counter()
        loss, grads = grad_fn(ms.Tensor(ids[s][mine]), ms.Tensor(labels[s][mine]))
        if args.plant == "half-grad" and rank == world - 1:
            grads = tuple(g * 0.5 for g in grads)
        before = [p.asnumpy().copy() for p in params] if args.plant == "skip-update" else None
        opt(grads)
        if before is not None and rank == world - 1:
            for p, b in zip(params, before):
                p.set_data(ms.Tensor(b))
        dt = time.perf_counter() - t0
        mean_loss = float(reduce(loss).asnumpy()) / world
        g = {n: full(x, n) for n, x in zip(names, grads)}
        out["steps"].append(
            {
                "loss": mean_loss,
                "gnorm": float(np.sqrt(sum(float((v.astype(np.float64) ** 2).sum()) for v in g.values()))),
                "grads": g,
                "weights": {n: full(p, n) for n, p in zip(names, params)},
                "seconds": dt,
            }
        )
    out["peak_rss_mb"] = peak_rss_mb()
    if rank == 0:
        save(args.out, out)
    else:
        save(
            args.out.with_name(f"{args.out.stem}_rank{rank}{args.out.suffix}"), {k: out[k] for k in out if k != "steps"}
        )


def run_probe():
    ms = setup_mindspore()
    import mindspore.mint.distributed as dist
    from mindspore import mint, ops
    from mindspore.communication import comm_func, get_rank, init

    init()
    rank = get_rank()

    def fresh():
        return ms.Tensor(np.full((2, 3), rank + 1, np.float32))

    x = fresh()
    two = mint.cat([x, x])

    def into(shape, fn):
        def run():
            o = ms.Tensor(np.zeros(shape, np.float32))
            fn(o)
            return o

        return run

    def point_to_point():
        o = ms.Tensor(np.zeros((2, 3), np.float32))
        if rank == 0:
            dist.send(x, dst=1, group=CPU_WORLD)
            dist.recv(o, src=1, group=CPU_WORLD)
        else:
            dist.recv(o, src=0, group=CPU_WORLD)
            dist.send(x, dst=0, group=CPU_WORLD)
        return o

    # (name, call, rank 0's expected sum). Rank r holds x = r + 1 in a [2, 3] tensor, two workers: every
    # gathered, reduced, scattered or exchanged result sums to 18 on rank 0; the gradients of the sums are
    # 2 per element (12); rank 0 receives rank 1's x (12). The ones that run on CPU go first: a refused
    # collective can leave the workers' later collectives out of step.
    cases = [
        ("ops.AllGather", lambda: ops.AllGather()(x), 18),
        ("ops.AllReduce", lambda: ops.AllReduce()(x), 18),
        ("mint.distributed.all_reduce", into((2, 3), lambda o: (o.copy_(x), dist.all_reduce(o))), 18),
        # the backward of a collective (a DTensor layer's redistribution is differentiated through it)
        ("grad of ops.AllReduce", lambda: ms.grad(lambda t: ops.AllReduce()(t).sum())(fresh()), 12),
        ("ops.ReduceScatter", lambda: ops.ReduceScatter()(two), 18),
        ("ops.AlltoAll", lambda: ops.AlltoAll(2, 0, 0)(two), 18),
        ("comm_func.all_gather_into_tensor", lambda: comm_func.all_gather_into_tensor(x), 18),
        ("comm_func.all_reduce", lambda: comm_func.all_reduce(x), 18),
        ("comm_func.reduce_scatter_tensor", lambda: comm_func.reduce_scatter_tensor(two), 18),
        ("mint.distributed.all_gather_into_tensor", into((4, 3), lambda o: dist.all_gather_into_tensor(o, x)), 18),
        ("mint.distributed.reduce_scatter_tensor", into((2, 3), lambda o: dist.reduce_scatter_tensor(o, two)), 18),
        ("mint.distributed.all_to_all_single", into((4, 3), lambda o: dist.all_to_all_single(o, two)), 18),
        ("mint.distributed.send / recv", point_to_point, 12),
        ("grad of ops.AllGather", lambda: ms.grad(lambda t: ops.AllGather()(t).sum())(fresh()), 12),
    ]
    for name, fn, expected in cases:
        try:
            out = fn()
            out = out[0] if isinstance(out, tuple) else out
            total = float(out.sum().asnumpy())
            value = "as expected" if total == expected else f"WRONG: sum {total:g}, expected {expected}"
            verdict = f"runs (shape {tuple(out.shape)}, {value})"
        except Exception as exc:  # noqa: BLE001 - the probe reports each failure in one line
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and not ln.strip().startswith("-")]
            verdict = f"fails: {'; '.join(lines[:3]) or type(exc).__name__}"
        if rank == 0:
            print(f"probe {name}: {verdict}", flush=True)


# ------------------------------------------------------------------ the driver


def save(path: Path, obj) -> None:
    import pickle

    with open(path, "wb") as f:
        pickle.dump(obj, f)


def load(path: Path):
    import pickle

    with open(path, "rb") as f:
        return pickle.load(f)


def child_env(args):
    env = dict(os.environ)
    paths = [str(REPO)] + ([str(args.hyper_parallel.resolve())] if args.hyper_parallel else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    # msrun starts its workers as `python`: the interpreter running this tool
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def self_command(args, role, out):
    cmd = [__file__, "--role", role, "--out", str(out), "--steps", str(args.steps), "--batch", str(args.batch)]
    cmd += ["--seq-len", str(args.seq_len), "--lr", str(args.lr), "--momentum", str(args.momentum)]
    cmd += ["--optimizer-level", args.optimizer_level, "--plant", args.plant, "--workers", str(args.workers)]
    cmd += ["--recompute"] if args.recompute else []
    return cmd + (["--stock-collectives"] if args.stock_collectives else [])


def msrun(args, work: Path, role: str, out: Path):
    log_dir = work / f"msrun_{role}"
    cmd = [str(Path(sys.executable).parent / "msrun"), f"--worker_num={args.workers}"]
    cmd += [f"--local_worker_num={args.workers}", f"--master_port={args.master_port}", f"--log_dir={log_dir}"]
    cmd += ["--join=True"] + self_command(args, role, out)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=child_env(args), cwd=work, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        log = log_dir / "worker_0.log"
        lines = [ln for ln in log.read_text().splitlines() if ln.strip()] if log.is_file() else []
        tail = [ln for ln in lines if not ln.startswith("[")][-12:]
        sys.stderr.write("\n".join(tail) + "\n")
        raise SystemExit(f"pynative_parallel_step: the msrun workers failed (exit {proc.returncode}); log: {log}")
    return wall, log_dir


def compare(single, sharded):
    """Per step: (quantity, difference relative to its scale, allowance) rows and the verdict."""
    rows = []
    prev_single, prev_sharded = single["init"], single["init"]
    for s, (a, b) in enumerate(zip(single["steps"], sharded["steps"]), start=1):
        rows.append((s, "loss", abs(a["loss"] - b["loss"]) / abs(a["loss"]), SUM_ORDER_TOL))
        rows.append((s, "gradient norm", abs(a["gnorm"] - b["gnorm"]) / a["gnorm"], SUM_ORDER_TOL))
        worst_g = max(
            float(np.max(np.abs(a["grads"][n] - b["grads"][n]))) / max(float(np.max(np.abs(a["grads"][n]))), 1e-30)
            for n in a["grads"]
        )
        rows.append((s, "gradients (worst tensor)", worst_g, SUM_ORDER_TOL))
        worst = (-1.0, "", 0.0, 0.0)  # (difference / allowance, name, rel, allowed rel)
        for n, w in a["weights"].items():
            change_a = w - prev_single[n]
            change_b = b["weights"][n] - prev_sharded[n]
            scale = max(float(np.max(np.abs(change_a))), 1e-30)
            # a change is a difference of two stored weights: it is known to the weight's float32 spacing
            spacing = 2.0 * FLOAT32_EPS * float(np.max(np.abs(w)))
            allowed = max(SUM_ORDER_TOL, spacing / scale)
            rel = float(np.max(np.abs(change_a - change_b))) / scale
            ratio = rel / allowed if np.isfinite(rel) else float("inf")
            if ratio > worst[0]:
                worst = (ratio, n, rel, allowed)
        _, worst_name, worst_c, worst_tol = worst
        rows.append((s, f"weight changes (worst: {worst_name})", worst_c, worst_tol))
        prev_single, prev_sharded = a["weights"], b["weights"]
    ok = all(np.isfinite(r[2]) and r[2] <= r[3] for r in rows) and len(sharded["steps"]) == len(single["steps"])
    return rows, ok


def main(argv=None):
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))
    if args.role == "single":
        return run_single(args)
    if args.role == "worker":
        return run_worker(args)
    if args.role == "probe":
        return run_probe()
    if not args.probe_collectives:
        hp = args.hyper_parallel
        if hp is None or not (hp / "hyper_parallel" / "__init__.py").is_file():
            raise SystemExit(
                f"pynative_parallel_step: --hyper-parallel {hp}: no hyper_parallel/__init__.py there "
                "(a HyperParallel source checkout is needed; it is not on the package index)"
            )
    work = Path(tempfile.mkdtemp(prefix="pynative_step_")) if args.keep is None else args.keep.resolve()
    work.mkdir(parents=True, exist_ok=True)
    try:
        if args.probe_collectives:
            _, log_dir = msrun(args, work, "probe", work / "probe.pkl")
            for line in (log_dir / "worker_0.log").read_text().splitlines():
                if line.startswith("probe "):
                    print(line[len("probe ") :])
            return 0
        t0 = time.perf_counter()
        cmd = [sys.executable] + self_command(args, "single", work / "single.pkl")
        proc = subprocess.run(cmd, env=child_env(args), cwd=work, capture_output=True, text=True)
        single_wall = time.perf_counter() - t0
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-3000:])
            raise SystemExit(f"pynative_parallel_step: the one-device run failed (exit {proc.returncode})")
        sharded_wall, _ = msrun(args, work, "worker", work / "sharded.pkl")
        single, sharded = load(work / "single.pkl"), load(work / "sharded.pkl")
        others = [load(p) for p in sorted(work.glob("sharded_rank*.pkl"))]
        rows, ok = compare(single, sharded)
        report(args, single, sharded, others, rows, ok, single_wall, sharded_wall)
        return 0 if ok else 1
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


def report(args, single, sharded, others, rows, ok, single_wall, sharded_wall):
    n_params = len(single["init"])
    summary = {
        "layout": f"dp{args.workers} x FSDP (hsdp {args.optimizer_level}), {args.workers} msrun CPU workers",
        "batch": [args.batch, args.seq_len],
        "collectives": "stock" if args.stock_collectives else "CPU primitives (world group)",
        "plant": args.plant,
        "recompute": args.recompute,
        "steps": [
            {
                "step": i + 1,
                "loss": [a["loss"], b["loss"]],
                "gnorm": [a["gnorm"], b["gnorm"]],
                "step_seconds": [a["seconds"], b["seconds"]],
            }
            for i, (a, b) in enumerate(zip(single["steps"], sharded["steps"]))
        ],
        "comparisons": [{"step": s, "what": w, "rel": r, "allowed": t} for s, w, r, t in rows],
        "custom_ops": single["custom_ops"],
        "parameters": n_params,
        "sharded_parameters": len(sharded["sharded"]),
        "param_bytes": {"one_device": single["param_bytes"], "per_rank": [sharded["local_param_bytes"]]},
        "peak_rss_mb": {"one_device": single["peak_rss_mb"], "per_rank": [sharded["peak_rss_mb"]]},
        "wall_seconds": {"one_device": single_wall, "msrun": sharded_wall},
        "agrees": ok,
    }
    for o in others:
        summary["param_bytes"]["per_rank"].append(o["local_param_bytes"])
        summary["peak_rss_mb"]["per_rank"].append(o["peak_rss_mb"])
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(f"pynative step: tiny preset ({n_params} tensors), batch {args.batch} x {args.seq_len}, SGD lr {args.lr}")
    print(f"  {summary['layout']}; collectives: {summary['collectives']}; plant: {args.plant}", end="")
    print("; every decoder layer recomputed" if args.recompute else "")
    print(f"  {len(sharded['sharded'])} of {n_params} parameters sharded; custom operators {single['custom_ops']}")
    for st in summary["steps"]:
        print(
            f"  step {st['step']}: loss one device {st['loss'][0]:.7f}, sharded {st['loss'][1]:.7f}; "
            f"gradient norm {st['gnorm'][0]:.7f} / {st['gnorm'][1]:.7f}; "
            f"step time {st['step_seconds'][0]:.2f} s / {st['step_seconds'][1]:.2f} s"
        )
    for s, what, rel, tol in rows:
        mark = "ok" if np.isfinite(rel) and rel <= tol else "DIFFERS"
        print(f"  step {s} {what}: {rel:.2e} of its scale (allowed {tol:.1e}) {mark}")
    pb = summary["param_bytes"]
    print(f"  parameter bytes: one device {pb['one_device']}, per rank {pb['per_rank']}")
    pr = summary["peak_rss_mb"]
    print(f"  peak RSS MB: one device {pr['one_device']:.0f}, per rank {[round(x) for x in pr['per_rank']]}")
    print(f"  wall: one device {single_wall:.1f} s, msrun job {sharded_wall:.1f} s (process start and init included)")
    print("agrees with one device" if ok else "DIFFERS from one device")


if __name__ == "__main__":
    sys.exit(main())
