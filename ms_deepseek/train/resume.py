"""Which checkpoint a run resumes from, when several places could disagree.

* :func:`agree_on_resume`: rank 0 decides, every rank checks it has that checkpoint (multi-worker runs);
* :func:`set_aside_newer`: a resume from an older checkpoint than the run's newest keeps the newer ones
  aside as ``step_N.abandoned-<time>`` (with --force) or is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ms_deepseek.checkpoint import training as ckpt_mod
from ms_deepseek.core.errors import UserError
from ms_deepseek.train.distributed import gather_ints


def agree_on_resume(resume: str, existing: Optional[Path], run_dir: Path, rank: int) -> Optional[Path]:
    """Rank 0 decides the checkpoint to resume; every rank checks it has that one, or the job stops
    naming the ranks that lack it (without a shared file system, or with NFS lag, each rank's own
    "newest complete checkpoint" may differ)."""
    error = None
    try:
        mine = existing if resume == "auto" else ckpt_mod.resolve_resume(resume, run_dir)
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
    have = ckpt_mod.is_complete(candidate) and \
        int(ckpt_mod.read_state(candidate).get("step", -1)) == decided
    flags = gather_ints([int(have)])[:, 0]
    lacking = [r for r, ok in enumerate(flags) if not ok]
    if lacking:
        who = ", ".join(map(str, lacking))
        raise UserError(f"--resume {resume}: rank 0 resumes from step {decided} but rank{'s' if len(lacking) > 1 else ''} "
                        f"{who} {'do' if len(lacking) > 1 else 'does'} not have that complete checkpoint "
                        f"({ckpt_mod.step_dir_name(decided)} in its {parent}); copy it there or put the run on a "
                        "shared file system")
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
        raise UserError(f"--resume {resume_dir}: {run_dir / 'checkpoints'} holds newer checkpoints "
                        f"({names}) that a later --resume auto would pick; pass --force to continue from step "
                        f"{start_step} and keep them aside as step_N{ckpt_mod.ABANDONED}<time>")
    if rank == 0:
        moved = manager.set_aside(newer)
        print(f"set aside {len(moved)} newer checkpoint(s) as abandoned: "
              + ", ".join(p.name for p in moved), flush=True)
