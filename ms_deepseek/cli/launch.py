"""``ms-deepseek launch RECIPE``: build, print and run the msrun command for a recipe's layout.

    ms-deepseek launch recipes/v2-lite-8npu.yaml --dry-run
    ms-deepseek launch recipes/v2-64npu.yaml --nnodes 8 --node-rank 0 --master-addr 10.0.0.1

Run the same command on every node with its own ``--node-rank``. The world size is the
recipe's ``parallel`` layout (dp x tp x pp); each node starts ``world / nnodes`` workers.
Every worker runs ``ms-deepseek train`` with the same recipe and ``--set`` overrides;
msrun writes one log per worker into ``--log-dir`` (default ``RUN_DIR/msrun_logs``).
On CPU a data-parallel recipe runs for real (collectives through mccl).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

from ms_deepseek.cli.args import add_all, arg, host, overrides_arg, positive_int
from ms_deepseek.core.errors import UserError
from ms_deepseek.core.safe_io import check_output_dir, created_parents, remove_empty_dirs

ARGUMENTS = (
    arg("recipe", help="recipe YAML"),
    overrides_arg("override a recipe field (passed on to every worker; repeatable)"),
    arg("--output", "-o", default=None, help="run folder (default: runs/<recipe name>)"),
    arg("--nnodes", type=positive_int, default=1, help="number of nodes (default 1)"),
    arg("--node-rank", type=int, default=0, help="this node's index, 0..nnodes-1"),
    arg("--master-addr", type=host, default="127.0.0.1", help="address of node 0 (msrun scheduler)"),
    arg("--master-port", type=int, default=8118, help="scheduler port on node 0"),
    arg("--log-dir", default=None, help="msrun worker logs (default: RUN_DIR/msrun_logs)"),
    arg(
        "--stop-grace",
        type=positive_int,
        default=30,
        metavar="SECONDS",
        help="on SIGTERM / SIGHUP / SIGINT: seconds the workers get to save a checkpoint at their "
        "next step and exit before every process of the job is killed (default 30)",
    ),
    arg(
        "--watchdog-factor",
        type=float,
        default=10.0,
        metavar="F",
        help="stop the job (with every worker's Python stacks) when no step finished within F x "
        "the median step time, after the first step; 0: off (default 10)",
    ),
    arg(
        "--watchdog-min",
        type=positive_int,
        default=120,
        metavar="SECONDS",
        help="the watchdog never fires sooner than this after the last step (default 120)",
    ),
    arg(
        "--cluster-time-out",
        type=positive_int,
        default=600,
        help="seconds msrun waits for all workers to join (default 600)",
    ),
    arg(
        "--hccl-connect-timeout",
        type=positive_int,
        default=None,
        help="HCCL_CONNECT_TIMEOUT: seconds to build HCCL links (default: the environment's "
        "HCCL_CONNECT_TIMEOUT, else 600)",
    ),
    arg(
        "--hccl-exec-timeout",
        type=positive_int,
        default=None,
        help="HCCL_EXEC_TIMEOUT: seconds a collective may wait (default: the environment's "
        "HCCL_EXEC_TIMEOUT, else 1800)",
    ),
    arg(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="PATH",
        help="workers continue from the newest checkpoint, or from PATH; 'auto': continue when "
        "the run folder holds a complete checkpoint, else start fresh",
    ),
    arg(
        "--force",
        action="store_true",
        help="run even if the planner says it does not fit; with --resume of an older checkpoint, "
        "set the run's newer ones aside (passed on to train)",
    ),
    arg(
        "--allow-changes",
        action="store_true",
        help="with --resume: accept settings that differ from the run's (passed on to train)",
    ),
    arg(
        "--skip-damaged",
        action="store_true",
        help="with --resume: continue from the newest intact checkpoint when the newest is damaged (passed on to train)",
    ),
    arg(
        "--take-over",
        action="store_true",
        help="take the run folder's lease from a job you know to be dead (passed on to train)",
    ),
    arg("--max-steps", type=positive_int, default=None, help="passed on to train"),
    arg("--dry-run", action="store_true", help="print the command and exit"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_all(parser, ARGUMENTS)


def msrun_executable() -> List[str]:
    """``msrun`` next to this Python (the venv's), else on PATH, else the module form."""
    local = Path(sys.executable).parent / "msrun"
    if local.is_file():
        return [str(local)]
    found = shutil.which("msrun")
    if found:
        return [found]
    return [sys.executable, "-m", "mindspore.parallel.cluster.run"]


def build_command(args: argparse.Namespace, world_size: int, run_dir: Path) -> Tuple[Dict[str, str], List[str]]:
    """(environment additions, argv) of the msrun command for this node."""
    if args.nnodes < 1:
        raise UserError(f"--nnodes: must be >= 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise UserError(f"--node-rank: must be in [0, {args.nnodes - 1}], got {args.node_rank}")
    if world_size % args.nnodes:
        raise UserError(
            f"--nnodes: {args.nnodes} does not divide the recipe's world size {world_size} (parallel.dp x tp x pp)"
        )
    if not 1024 <= args.master_port <= 65535:
        raise UserError(f"--master-port: must be in 1024..65535, got {args.master_port}")
    for key in ("cluster_time_out", "hccl_connect_timeout", "hccl_exec_timeout"):
        if getattr(args, key) is not None and getattr(args, key) < 1:
            raise UserError(f"--{key.replace('_', '-')}: must be >= 1, got {getattr(args, key)}")
    local = world_size // args.nnodes
    log_dir = Path(args.log_dir) if args.log_dir else run_dir / "msrun_logs"
    env = hccl_env(args, os.environ)
    cmd = msrun_executable() + [
        f"--worker_num={world_size}",
        f"--local_worker_num={local}",
        f"--master_addr={args.master_addr}",
        f"--master_port={args.master_port}",
        f"--node_rank={args.node_rank}",
        f"--log_dir={log_dir}",
        "--join=True",
        f"--cluster_time_out={args.cluster_time_out}",
        # msrun runs "python ..." from PATH; run() puts this interpreter's folder first
        "python",
        "-m",
        "ms_deepseek.cli",
        "train",
        str(args.recipe),
        "--output",
        str(run_dir),
        "--quiet",
    ]
    for text in args.overrides:
        cmd += ["--set", text]
    if args.resume:
        cmd += ["--resume", args.resume]
    if args.force:
        cmd.append("--force")
    if getattr(args, "allow_changes", False):
        cmd.append("--allow-changes")
    if getattr(args, "skip_damaged", False):
        cmd.append("--skip-damaged")
    if getattr(args, "take_over", False):
        cmd.append("--take-over")
    if args.max_steps is not None:
        cmd += ["--max-steps", str(args.max_steps)]
    return env, cmd


# HCCL timeouts launch sets when neither its flag nor the environment gives one
HCCL_DEFAULTS = {"HCCL_CONNECT_TIMEOUT": 600, "HCCL_EXEC_TIMEOUT": 1800}


def hccl_env(args: argparse.Namespace, environ) -> Dict[str, str]:
    """HCCL timeouts for the workers: the flag, else the value already exported (what doctor and
    docs/troubleshooting.md advise raising), else launch's default."""
    flags = {"HCCL_CONNECT_TIMEOUT": args.hccl_connect_timeout, "HCCL_EXEC_TIMEOUT": args.hccl_exec_timeout}
    return {
        key: str(flag) if flag is not None else environ.get(key) or str(HCCL_DEFAULTS[key])
        for key, flag in flags.items()
    }


def interpreter_dir() -> str:
    """msrun starts its workers as ``python ...`` from PATH (MindSpore's _generate_cmd_args_list in
    mindspore/parallel/cluster/process_entity/_utils.py accepts only a bare python/python3 name), so
    launch puts this interpreter's folder first on PATH."""
    return str(Path(sys.executable).parent)


def worker_python() -> str:
    """The interpreter msrun's ``python`` resolves to with interpreter_dir() first on PATH."""
    found = shutil.which("python", path=interpreter_dir() + os.pathsep + os.environ.get("PATH", ""))
    if found and Path(found).resolve() == Path(sys.executable).resolve():
        return f"{found} (this interpreter)"
    return (
        f"{found or 'none found'}, not this interpreter {sys.executable}: put a `python` next to it "
        "(msrun starts workers as `python`)"
    )


def format_command(env: Dict[str, str], cmd: List[str]) -> str:
    """The command as a shell line that runs what launch runs: this interpreter's folder first on PATH."""
    path = f"PATH={shlex.quote(interpreter_dir())}:$PATH"
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in env.items()] + [path] + [shlex.quote(c) for c in cmd])


def run(args: argparse.Namespace) -> int:
    from ms_deepseek.cli.train import default_run_dir
    from ms_deepseek.train.preflight import load_checked_recipe

    not_checked: List[str] = []
    if args.dry_run:  # a login node: the checkpoint and the data may be on the cluster only
        recipe = _recipe_for_dry_run(args, not_checked)
    else:
        recipe = load_checked_recipe(args.recipe, args.overrides)  # fail here, not in N workers
    from ms_deepseek.train.trainer import fit_plan

    fit_plan(recipe, args.force)
    run_dir = Path(args.output) if args.output else default_run_dir(args.recipe)
    env, cmd = build_command(args, recipe.parallel.world_size, run_dir)
    print(format_command(env, cmd), flush=True)
    if args.dry_run:
        print(f"# python of the workers: {worker_python()}")
        for line in not_checked:
            print(f"# not checked on this machine (train checks it on every node before it starts): {line}")
        return 0
    if args.resume == "latest" and not run_dir.exists():  # said here, not by every worker of a folder launch made
        raise UserError(
            f"--resume: the run folder {run_dir} does not exist, so there is nothing to resume "
            "(name the run with --output RUN_DIR, or leave out --resume to start it)"
        )
    _resolve_master(args.master_addr)  # msrun would fail only after creating the run folder
    check_output_dir(run_dir, "run folder")
    from ms_deepseek.jobs.lease import live_holder, refusal

    holder = live_holder(run_dir, getattr(args, "take_over", False))  # a job in this folder: touch nothing of it
    if holder is not None:
        raise refusal(run_dir, holder)
    new_dirs = created_parents(run_dir / "x")  # run_dir and the parents this run creates
    full_env = _worker_env(env)
    run_dir.mkdir(parents=True, exist_ok=True)
    code = _supervise(args, recipe, cmd, full_env, run_dir)
    if code != 0:
        remove_empty_dirs(new_dirs)  # a job that wrote nothing leaves no empty run folder behind
    return code


def _worker_env(env: Dict[str, str]) -> Dict[str, str]:
    """This environment with the command's: this Python first on PATH, this package first on PYTHONPATH."""
    full_env = dict(os.environ, **env)
    full_env["PATH"] = interpreter_dir() + os.pathsep + full_env.get("PATH", "")
    # Workers must import this very package, installed or not.
    package_root = str(Path(__file__).resolve().parents[2])
    full_env["PYTHONPATH"] = package_root + (os.pathsep + full_env["PYTHONPATH"] if full_env.get("PYTHONPATH") else "")
    return full_env


def _supervise(args: argparse.Namespace, recipe, cmd: List[str], full_env: Dict[str, str], run_dir: Path) -> int:
    """Run msrun under jobs/supervise.py; its exit code, with one line on stderr when it failed."""
    from ms_deepseek.jobs.supervise import clear_node_entries, run_supervised

    log_dir = Path(args.log_dir) if args.log_dir else run_dir / "msrun_logs"
    # a dead worker stops the whole job within seconds, with one line naming it (see jobs/supervise.py)
    # SIGTERM / SIGHUP / SIGINT: the workers save and stop, then nothing of the job is left (supervise.py)
    # a hung worker (no step within the watchdog time) stops the job with stacks and the ranks behind
    from ms_deepseek.jobs.preempt import HEARTBEAT_DIR

    if args.watchdog_factor < 0:
        raise UserError(f"--watchdog-factor: must be >= 0 (0: off), got {args.watchdog_factor:g}")
    # a previous job's progress is not this one's; on a shared run folder the other nodes' entries are theirs
    job_start, local = time.time(), recipe.parallel.world_size // args.nnodes
    clear_node_entries(run_dir / HEARTBEAT_DIR, range(args.node_rank * local, (args.node_rank + 1) * local), job_start)
    code, failure = run_supervised(
        cmd,
        full_env,
        log_dir,
        stop_grace_s=args.stop_grace,
        heartbeat_dir=run_dir / HEARTBEAT_DIR,
        watchdog_factor=args.watchdog_factor,
        watchdog_min_s=args.watchdog_min,
        job_start=job_start,
    )
    if failure is not None:
        print(f"ms-deepseek launch: {failure}", file=sys.stderr, flush=True)
    elif code != 0:
        where = f"worker logs in {log_dir}" if log_dir.is_dir() else "msrun wrote no worker logs"
        print(f"ms-deepseek launch: msrun exited with {code}; {where}", file=sys.stderr)
    return code


def _recipe_for_dry_run(args: argparse.Namespace, not_checked: List[str]):
    """The recipe as ``plan --recipe`` reads it (schema only; the architecture from a preset or a
    config.json beside the recipe when model.source is not here), then train's machine checks,
    whose failures are reported in ``not_checked`` instead of stopping the dry run."""
    from ms_deepseek.config.recipe import load_recipe, planning_config_path
    from ms_deepseek.train.preflight import check_recipe

    recipe = load_recipe(args.recipe, args.overrides, planning_config_path(args.recipe))  # read once
    beside = recipe.origin.architecture_file
    if beside is not None:
        not_checked.append(f"model.source: {recipe.model.source} is not here (architecture read from {beside})")
    try:
        check_recipe(recipe)
    except UserError as exc:
        not_checked.append(f"{exc}; the checks after this one did not run either")
    return recipe


def _resolve_master(addr: str) -> None:
    import socket

    try:
        socket.getaddrinfo(addr, None)
    except (OSError, UnicodeError) as exc:
        raise UserError(f"--master-addr: cannot resolve {addr!r} ({getattr(exc, 'strerror', None) or exc})") from None
