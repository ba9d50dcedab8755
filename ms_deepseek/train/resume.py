"""Which checkpoint a run resumes from, when several places could disagree.

* :func:`resume_point`: the checkpoint a call continues (:func:`find_resume`), its state and the checks below;
* :func:`intact`: a damaged checkpoint (a file that differs from its recorded digest) is refused, naming the
  newest intact one, which ``--skip-damaged`` takes;
* :func:`agree_on_resume`: rank 0 decides, every rank checks it has that checkpoint (multi-worker runs);
* :func:`set_aside_newer`: a resume from an older checkpoint than the run's newest keeps the newer ones
  aside as ``step_N.abandoned-<time>`` (with --force) or is refused;
* :func:`check_settings`: a resume continues the run it resumes: the recipe and ``--set`` options of the
  command are compared field by field with the checkpoint's ``recipe.yaml``; what keeps the run exact
  (logging, checkpointing, evaluation, the layout at the same global batch, more steps of a schedule that
  does not depend on them) is named and applied, what breaks exactness is refused unless the command says
  ``--allow-changes``, and a LoRA run resumed without ``lora:`` (or the reverse) is refused outright.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict, List, Optional

from ms_deepseek.checkpoint import digests
from ms_deepseek.checkpoint import training as ckpt_mod
from ms_deepseek.checkpoint.layout import is_sharded
from ms_deepseek.core.errors import UserError
from ms_deepseek.jobs.distributed import gather_ints
from ms_deepseek.train.context import RunContext, TrainOptions


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a call continues (``folder`` None: a fresh start), its ``state.json`` and the notes
    on the settings the command changed (:func:`check_settings`)."""

    folder: Optional[Path] = None
    state: Dict = dataclasses.field(default_factory=dict)
    notes: List[str] = dataclasses.field(default_factory=list)

    @property
    def step(self) -> int:
        return int(self.state.get("step", 0))


def resume_point(ctx: RunContext, options: TrainOptions) -> ResumePoint:
    """Which checkpoint this call continues, every rank agreeing, its state read and the command's changes to
    its settings checked; a resume from an older checkpoint than the run's newest sets the newer aside."""
    folder = find_resume(ctx, options)
    if folder is None:
        return ResumePoint()
    state = ckpt_mod.read_state(folder)
    # a resume continues the run it resumes: the command's changes to its settings are named, and
    # those that break exactness are refused unless --allow-changes
    saved = ckpt_mod.read_recipe(folder, missing_ok=True)
    notes = check_settings(ctx.recipe, saved, state, folder, ctx.run_dir, options.allow_changes)
    set_aside_newer(ctx.run_dir, int(state.get("step", 0)), folder, options.force, ctx.rank)
    return ResumePoint(folder, state, notes)


def find_resume(ctx: RunContext, options: TrainOptions) -> Optional[Path]:
    """The checkpoint this call continues (None: a fresh start); every rank agrees on it."""
    run_dir = ctx.run_dir
    existing = ckpt_mod.CheckpointManager(run_dir / "checkpoints").latest()
    resume = options.resume or ctx.recipe.checkpoint.resume  # the command line wins over the recipe
    if ctx.world > 1 and resume:
        found = agree_on_resume(resume, existing, run_dir, ctx.rank, options.skip_damaged)
    elif resume == "auto":  # newest complete checkpoint when there is one, else a fresh start
        found = intact(existing, options.skip_damaged)
    else:
        found = ckpt_mod.resolve_checkpoint(resume, ckpt_mod.RESUME, run_dir) if resume else None
        found = intact(found, options.skip_damaged)
    if found is None and existing is not None:
        raise UserError(
            f"--output {run_dir}: already holds checkpoints (newest {existing.name}); pass "
            "--resume to continue that run, or choose another --output"
        )
    return found


def intact(found: Optional[Path], skip_damaged: bool, announce: bool = True) -> Optional[Path]:
    """The checkpoint to resume, its files checked against the digests its state.json records
    (:mod:`ms_deepseek.checkpoint.digests`). A damaged one is refused in one line naming the file and the
    newest intact checkpoint before it; with ``skip_damaged`` that one is taken and the damaged ones are
    set aside as ``step_N.damaged-<time>`` (``announce``: this rank renames them and says so)."""
    if found is None:
        return None
    # a sharded checkpoint's rank files: sizes here, their bytes by each rank as it reads its slices (one
    # process hashing every rank's files would read the whole checkpoint)
    by_size = is_sharded(found)
    why = digests.damage(found, by_size)
    if why is None:
        return found
    step = int(ckpt_mod.read_state(found).get("step", -1))
    damaged, candidate = [found], None
    for s, folder in reversed(ckpt_mod.CheckpointManager(found.parent).complete()):
        if s >= step or folder.resolve() == found.resolve():
            continue
        if digests.damage(folder, by_size) is None:
            candidate = folder
            break
        damaged.append(folder)
    if candidate is None:
        raise UserError(f"--resume: {why}; no older checkpoint in {found.parent} is intact")
    if not skip_damaged:
        raise UserError(
            f"--resume: {why}; the newest intact checkpoint is {candidate}: pass --skip-damaged to continue "
            f"from it (the damaged one{'s are' if len(damaged) > 1 else ' is'} then set aside as "
            f"step_N{ckpt_mod.DAMAGED}<time>)"
        )
    if announce:
        moved = ckpt_mod.CheckpointManager(found.parent).set_aside(damaged, ckpt_mod.DAMAGED)
        print(f"--skip-damaged: {why}; set aside " + ", ".join(p.name for p in moved), flush=True)
    return candidate


def agree_on_resume(
    resume: str, existing: Optional[Path], run_dir: Path, rank: int, skip_damaged: bool = False
) -> Optional[Path]:
    """Rank 0 decides the checkpoint to resume (checked against its digests: :func:`intact`); every rank
    checks it has that one, or the job stops naming the ranks that lack it (without a shared file system,
    or with NFS lag, each rank's own "newest complete checkpoint" may differ)."""
    error = None
    try:
        mine = existing if resume == "auto" else ckpt_mod.resolve_checkpoint(resume, ckpt_mod.RESUME, run_dir)
        if rank == 0:  # one rank reads the files through (the others read the slices they need, checked)
            mine = intact(mine, skip_damaged)
    except UserError as exc:
        mine, error = None, exc
    step = -2 if error else (int(ckpt_mod.read_state(mine).get("step", -1)) if mine else -1)
    decided = int(gather_ints([step])[0, 0])
    if decided == -2:
        if error is not None and rank == 0:
            raise error
        raise UserError(f"--resume {resume}: rank 0 found no checkpoint to resume (see worker_0.log)")
    if decided == -1:  # rank 0 starts fresh (auto, no checkpoint): so does everyone
        return None
    parent = mine.parent if mine is not None else ckpt_mod.resume_parent(resume, run_dir)
    candidate = parent / ckpt_mod.step_dir_name(decided)
    have = ckpt_mod.is_complete(candidate) and int(ckpt_mod.read_state(candidate).get("step", -1)) == decided
    flags = gather_ints([int(have)])[:, 0]
    lacking = [r for r, ok in enumerate(flags) if not ok]
    if lacking:
        who = ", ".join(map(str, lacking))
        raise UserError(
            f"--resume {resume}: rank 0 resumes from step {decided} but rank{'s' if len(lacking) > 1 else ''} "
            f"{who} {'do' if len(lacking) > 1 else 'does'} not have that complete checkpoint "
            f"({ckpt_mod.step_dir_name(decided)} in its {parent}); copy it there or put the run on a "
            "shared file system"
        )
    return candidate


def set_aside_newer(run_dir: Path, start_step: int, resume_dir: Path, force: bool, rank: int) -> None:
    """Resuming from an older checkpoint than the run's newest: the newer ones would win a later
    ``--resume auto`` (and fill keep_last), so they are renamed ``step_N.abandoned-<time>`` (with
    --force) or the run is refused."""
    manager = ckpt_mod.CheckpointManager(run_dir / "checkpoints")
    newer = manager.newer_than(start_step, resume_dir)
    if not newer:
        return
    names = ", ".join(p.name for p in newer)
    if not force:
        raise UserError(
            f"--resume {resume_dir}: {run_dir / 'checkpoints'} holds newer checkpoints "
            f"({names}) that a later --resume auto would pick; pass --force to continue from step "
            f"{start_step} and keep them aside as step_N{ckpt_mod.ABANDONED}<time>"
        )
    if rank == 0:
        moved = manager.set_aside(newer)
        print(
            f"set aside {len(moved)} newer checkpoint(s) as abandoned: " + ", ".join(p.name for p in moved), flush=True
        )


# ------------------------------------------------------------------------- the run's settings on resume
# changes that leave the trained steps and the ones to come as an uninterrupted run would make them
_KEEP_EXACT = (
    "logging.",
    "checkpoint.",
    "train.eval_interval",
    "train.eval_batches",
    "parallel.force",
    "parallel.reserve_memory",
    "parallel.memory_headroom_gb",
    "parallel.hbm_gb",
)
# the layout: exact at the same global batch and sequence length (sums in another order: equal to rounding)
_LAYOUT = ("parallel.", "train.micro_batch_size", "train.grad_accum_steps")
# the learning-rate schedule: exact when every step already trained had the same learning rate
_SCHEDULE = (
    "train.steps",
    "optim.lr",
    "optim.min_lr",
    "optim.schedule",
    "optim.warmup_steps",
    "optim.milestones",
    "optim.decay_factor",
)


def _flatten(value: Any, prefix: str = "") -> Dict[str, Any]:
    if isinstance(value, dict):
        out: Dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def _normalized(saved: Dict) -> Dict:
    """The saved recipe with every default filled in, as the command's recipe is (a recipe.yaml written by an
    older version may lack fields added since); as saved when it does not build."""
    from ms_deepseek.config.recipe import Recipe
    from ms_deepseek.core.schema import from_dict

    try:
        data = {k: ({} if v is None else v) for k, v in saved.items()}
        return from_dict(Recipe, data).to_dict()
    except (UserError, TypeError, ValueError):
        return saved


def _same(a: Any, b: Any) -> bool:
    if a == b:
        return True
    if (
        isinstance(a, (int, float))
        and isinstance(b, (int, float))
        and not isinstance(a, bool)
        and not isinstance(b, bool)
    ):
        return float(a) == float(b)
    if isinstance(a, str) and isinstance(b, str):  # one folder written two ways (relative / absolute)
        try:
            pa, pb = Path(a).expanduser(), Path(b).expanduser()
            return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()
        except (OSError, ValueError):
            return False
    return False


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return "(none)" if value is None else str(value)


def _lr_fn(optim: Dict, steps: int):
    from ms_deepseek.train.schedules import lr_at

    return lambda step: lr_at(
        step,
        schedule=optim.get("schedule", "cosine"),
        lr=float(optim.get("lr", 3e-4)),
        total_steps=steps,
        warmup_steps=int(optim.get("warmup_steps", 0)),
        min_lr=float(optim.get("min_lr", 0.0)),
        milestones=optim.get("milestones", (0.6, 0.9)),
        decay_factor=float(optim.get("decay_factor", 0.316)),
    )


def check_settings(recipe, saved: Dict, state: Dict, resume_dir: Path, run_dir: Path, allow: bool) -> List[str]:
    """Compare the command's recipe with the one the checkpoint was trained with (``saved``: its recipe.yaml).

    Returns the lines to print (each change, named field by field, with what it does); raises UserError for a
    LoRA run resumed without ``lora:`` or the reverse, and for changes that break exactness unless ``allow``."""
    if not saved:
        return []
    run_recipe = run_dir / "recipe.yaml"  # the run's settings, when they are the checkpoint's (else the checkpoint's)
    try:
        if run_recipe.read_text(encoding="utf-8") != (resume_dir / "recipe.yaml").read_text(encoding="utf-8"):
            run_recipe = resume_dir / "recipe.yaml"
    except OSError:
        run_recipe = resume_dir / "recipe.yaml"
    if (saved.get("lora") is None) != (recipe.lora is None):
        if saved.get("lora") is not None:
            lora = saved["lora"] if isinstance(saved["lora"], dict) else {}
            raise UserError(
                f"--resume {resume_dir}: a LoRA run (lora: r={lora.get('r', '?')}, its checkpoints hold "
                f"adapters only) but this recipe ({recipe.source_path}) has no lora: section; resume it "
                f"with the run's recipe ({run_recipe}), or start a full fine-tune in another --output"
            )
        raise UserError(
            f"--resume {resume_dir}: a full training run (no lora: section) but this recipe "
            f"({recipe.source_path}) has a lora: section; to fine-tune its weights with LoRA start a new "
            f"run in another --output with --set model.source={resume_dir}"
        )
    before, now = _flatten(_normalized(saved)), _flatten(recipe.to_dict())
    changed = [k for k in sorted(set(before) | set(now)) if not _same(before.get(k), now.get(k))]
    if not changed:
        return []
    step = int(state.get("step", 0))
    exact, layout, schedule, broken = [], [], [], []
    for key in changed:
        (
            exact
            if key.startswith(_KEEP_EXACT)
            else layout
            if key.startswith(_LAYOUT)
            else schedule
            if key in _SCHEDULE
            else broken
        ).append(key)
    said = lambda keys: ", ".join(f"{k} {_show(before.get(k))} -> {_show(now.get(k))}" for k in keys)  # noqa: E731
    problems: List[str] = []
    if layout:
        same_batch = state.get("global_batch_size") in (None, recipe.global_batch_size) and state.get("seq_len") in (
            None,
            recipe.seq_len,
        )
        if not same_batch:
            problems.append(
                f"{said(layout)}: the global batch becomes {recipe.global_batch_size} x {recipe.seq_len} "
                f"tokens where the run trained {state.get('global_batch_size')} x {state.get('seq_len')}, "
                f"so each step sees other data than the run's"
            )
            layout = []
    if schedule:
        old = _lr_fn(dict(_normalized(saved).get("optim") or {}), int(before.get("train.steps", recipe.train.steps)))
        new = _lr_fn(dataclasses.asdict(recipe.optim), recipe.train.steps)
        if all(abs(old(s) - new(s)) <= 1e-12 * max(abs(old(s)), 1e-30) for s in range(1, step + 1)):
            exact += schedule  # the steps already trained had these learning rates under the new settings too
        else:
            problems.append(
                f"{said(schedule)}: the learning-rate schedule is recomputed for {recipe.train.steps} "
                f"steps, so the learning rate goes from {old(step):.3g} at step {step} to "
                f"{new(step + 1):.3g} at step {step + 1} and the {step} steps already trained followed "
                f"another schedule"
            )
    if broken:
        problems.append(
            f"{said(broken)}: the {step} steps already trained were made with the run's values, so "
            f"the result is neither this run continued nor a run of the new settings"
        )
    lines = []
    if exact:
        lines.append(
            f"resume: settings changed from the run's ({resume_dir / 'recipe.yaml'}), exactness kept: {said(exact)}"
        )
    if layout:
        lines.append(
            f"resume: another layout at the same global batch ({said(layout)}): the same data per step, "
            f"sums in another order (losses equal to rounding, not bit for bit)"
        )
    if problems and not allow:
        kept = [said(exact)] if exact else []
        kept += [f"{said(layout)} (the same global batch)"] if layout else []
        also = f"; also changed, keeping the run exact: {', '.join(kept)}" if kept else ""
        raise UserError(
            f"--resume {resume_dir}: this command changes the run's settings: {'; '.join(problems)}{also}. "
            f"To continue the run as it was, use its settings (they are in {run_recipe}, e.g. "
            f"`ms-deepseek train {run_recipe} --output {run_dir} --resume`); to train on with these "
            f"changes anyway, add --allow-changes"
        )
    if problems:
        lines.append(f"resume: --allow-changes: {'; '.join(problems)}")
    return lines
