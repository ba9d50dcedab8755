"""``ms-deepseek train RECIPE``: train a recipe in this process (one worker, or one msrun worker).

    ms-deepseek train recipes/tiny-cpu.yaml --output runs/tiny
    ms-deepseek train recipes/tiny-cpu.yaml --set train.steps=50 --set optim.lr=1e-3
    ms-deepseek train recipes/tiny-cpu.yaml --output runs/tiny --resume          # newest checkpoint
    ms-deepseek train recipes/tiny-cpu.yaml --resume runs/tiny/checkpoints/step_00000100
    ms-deepseek train recipes/tiny-cpu.yaml --output runs/tiny --resume auto     # resume if possible, else fresh
    ms-deepseek train recipes/tiny-cpu.yaml --output runs/tiny --resume --skip-damaged  # past a damaged checkpoint

A run that has already reached ``train.steps`` exits 0 with one line saying so, so a restart
loop can re-run the same command after any failure.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ms_deepseek.cli.args import add_all, arg, overrides_arg

ARGUMENTS = (
    arg("recipe", help="recipe YAML (see recipes/)"),
    overrides_arg("override a recipe field, e.g. --set train.steps=100 (repeatable)"),
    arg(
        "--output",
        "-o",
        default=None,
        help="run folder for metrics.jsonl, checkpoints/, tb/ (default: runs/<recipe name>)",
    ),
    arg(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="PATH",
        help="continue from the newest checkpoint of --output, or from PATH; 'auto': continue "
        "when --output holds a complete checkpoint, else start fresh (recipe: "
        "checkpoint.resume: auto)",
    ),
    arg(
        "--force",
        action="store_true",
        help="run even if the memory planner says the layout does not fit; with --resume of an older "
        "checkpoint, set the run's newer ones aside (step_N.abandoned-<time>)",
    ),
    arg(
        "--allow-changes",
        action="store_true",
        help="with --resume: accept settings that differ from the run's (each is named) even where "
        "the resumed run then differs from an uninterrupted one (steps of a schedule that "
        "depends on them, optimizer, batch, data, model, LoRA)",
    ),
    arg(
        "--skip-damaged",
        action="store_true",
        help="with --resume: when the checkpoint's files differ from the digests its state.json recorded at "
        "save time, continue from the newest intact checkpoint instead (the damaged ones are set aside as "
        "step_N.damaged-<time>); without it a damaged checkpoint is refused, naming that one",
    ),
    arg(
        "--take-over",
        action="store_true",
        help="take the run folder's lease (RUN_DIR/.lease) from the job that holds it, which you know to be "
        "dead (a node that went down); without it a run folder held by a live job is refused, and a lease "
        "is taken over only when its holder's process is gone (same host) or its heartbeat is older than "
        "MS_DEEPSEEK_LEASE_STALE_S (600 s)",
    ),
    arg(
        "--max-steps",
        type=int,
        default=None,
        help="stop after this many steps in total (the LR schedule still spans train.steps)",
    ),
    arg("--quiet", action="store_true", help="no progress bar"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_all(parser, ARGUMENTS)


def default_run_dir(recipe_path: str) -> Path:
    return Path("runs") / Path(recipe_path).stem


def _snapshot(run_dir: Path):
    """What exists before the run: (new parent folders, run folder existed, its top-level entries, metrics stat)."""
    from ms_deepseek.core.safe_io import created_parents

    metrics = run_dir / "metrics.jsonl"
    stat = metrics.stat() if metrics.is_file() else None
    entries = {p.name for p in run_dir.iterdir()} if run_dir.is_dir() else set()
    return created_parents(run_dir / "x"), run_dir.is_dir(), entries, stat and (stat.st_size, stat.st_mtime_ns)


def _remove_leftovers(run_dir: Path, before) -> None:
    """A refused run (bad checkpoint, bad data, ...) leaves nothing behind: the folders it created
    (logs/, tb/, an empty checkpoints/, the run folder itself) go, as long as it trained nothing."""
    import shutil

    from ms_deepseek.core.safe_io import remove_empty_dirs

    new_dirs, existed, entries, metrics = before
    now = run_dir / "metrics.jsonl"
    stat = now.stat() if now.is_file() else None
    if (stat and (stat.st_size, stat.st_mtime_ns)) != metrics:
        return  # this attempt logged steps: keep what it wrote
    ckpts = run_dir / "checkpoints"
    if "checkpoints" not in entries and ckpts.is_dir() and any(p.name.startswith("step_") for p in ckpts.iterdir()):
        return
    if not run_dir.is_dir():
        return
    for child in run_dir.iterdir():
        if child.name not in entries:
            shutil.rmtree(child, ignore_errors=True) if child.is_dir() and not child.is_symlink() else child.unlink(
                missing_ok=True
            )
    if not existed:
        remove_empty_dirs(new_dirs)


def run(args: argparse.Namespace) -> int:
    from ms_deepseek.core.errors import UserError
    from ms_deepseek.train.preflight import load_run_inputs

    recipe, data = load_run_inputs(args.recipe, args.overrides, progress=not args.quiet)
    if args.max_steps is not None and args.max_steps < 1:
        raise UserError(f"--max-steps: must be >= 1, got {args.max_steps}")
    run_dir = Path(args.output) if args.output else default_run_dir(args.recipe)
    from ms_deepseek.core.safe_io import check_output_dir

    check_output_dir(run_dir, "--output run folder")  # before any data is read or model built
    from ms_deepseek.jobs.lease import LeaseHeld
    from ms_deepseek.train.context import TrainOptions
    from ms_deepseek.train.trainer import train

    options = TrainOptions(
        resume=args.resume,
        force=args.force,
        progress=not args.quiet,
        max_steps=args.max_steps,
        allow_changes=args.allow_changes,
        skip_damaged=args.skip_damaged,
        take_over=args.take_over,
    )
    before = _snapshot(run_dir)
    try:
        result = train(recipe, run_dir, options, data)
    except LeaseHeld:
        raise  # the folder is another job's: nothing of it is this command's to clean up
    except UserError:
        _remove_leftovers(run_dir, before)
        raise
    return _report(args, recipe, result)


def _report(args: argparse.Namespace, recipe, result) -> int:
    """What the run's end says, and the exit code."""
    if result.dry_run is not None:  # MindSpore's dry run: the step compiled, a step would return placeholders
        import os

        rank = os.environ.get("RANK_ID")
        print(
            f"ms-deepseek train: MS_SIMULATION_LEVEL={result.dry_run} (MindSpore's dry run): the training step "
            f"compiled{f' on rank {rank}' if rank else ''} in {result.wall_s:.0f}s; nothing was trained or saved. "
            f"To check a recipe's compile on every pipeline stage: ms-deepseek plan --recipe {args.recipe} --compile",
            flush=True,
        )
        return 0
    if result.complete:
        print(
            f"run complete: {result.checkpoint} is at step {result.steps} of train.steps={recipe.train.steps}; "
            "nothing to do (to train further: --set train.steps=N, with --allow-changes when the learning-rate "
            "schedule depends on train.steps)",
            flush=True,
        )
        return 0
    if result.preempted:  # SIGTERM: a checkpoint of the last finished step on every rank, then a non-zero exit
        import signal

        if result.metrics_path is not None:
            print(
                f"ms-deepseek train: stopped by {result.preempted} after step {result.steps}: saved checkpoint "
                f"{result.checkpoint} (every rank); continue with --resume auto and the same recipe and --set "
                f"options (the run's settings: {result.run_dir / 'recipe.yaml'})",
                file=sys.stderr,
                flush=True,
            )
        return 128 + int(signal.Signals[result.preempted])
    if result.metrics_path is not None:  # the main worker (rank 0) reports
        _report_done(recipe, result)
    return 0


def _report_done(recipe, result) -> None:
    first = f" (first {result.losses[0]:.4f})" if result.losses else ""
    print(
        f"done: {result.steps} steps, final loss {result.final_loss:.4f}{first}, "
        f"{result.tokens_per_s:,.0f} tokens/s, {result.wall_s:.0f}s"
    )
    if result.checkpoint is not None:
        print(f"checkpoint: {result.checkpoint}")
    print(f"metrics:    {result.metrics_path}")
    if recipe.logging.tensorboard:
        print(f"tensorboard: tensorboard --logdir {result.run_dir / 'tb'}")
