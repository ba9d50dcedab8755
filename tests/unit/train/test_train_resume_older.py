"""Resuming from an older checkpoint than the run's newest: the newer ones must not win a later `--resume auto`, nor
pruning delete the checkpoint resumed from. The resume is refused without --force; with --force the newer ones are
kept aside as `step_N.abandoned-<time>`, the resumed one is never pruned, and `--resume auto` continues the new line
of saves."""

import shutil

import pytest
from test_train import data_dir, losses_of, recipe_dict, reference, write_recipe  # noqa: F401 (fixtures)

from ms_deepseek.cli import main


@pytest.mark.slow
def test_resume_from_an_older_checkpoint_refuses_or_sets_newer_ones_aside(reference, tmp_path, capsys):
    ref_dir, _ = reference
    run = tmp_path / "run"
    shutil.copytree(ref_dir, run)
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000003", "step_00000004"]
    recipe = str(ref_dir.parent / "recipe.yaml")
    older = str(ckpts / "step_00000003")

    assert main(["train", recipe, "--output", str(run), "--quiet", "--resume", older]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds newer checkpoints (step_00000004)" in err[0] and "--force" in err[0], err
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000003", "step_00000004"]

    # keep_last 1: the save of step 4 would prune step 3, the checkpoint this run resumed from
    assert (
        main(
            [
                "train",
                recipe,
                "--output",
                str(run),
                "--quiet",
                "--resume",
                older,
                "--force",
                "--set",
                "checkpoint.keep_last=1",
            ]
        )
        == 0
    )
    assert "set aside 1 newer checkpoint(s) as abandoned: step_00000004.abandoned-" in capsys.readouterr().out
    names = sorted(p.name for p in ckpts.iterdir())  # "latest": the pointer file to the last complete save
    assert names[:3] == ["latest", "step_00000003", "step_00000004"] and names[3].startswith("step_00000004.abandoned-")
    assert len(names) == 4, names
    assert (ckpts / "latest").read_text().strip().endswith("step_00000004")  # the new save, not the abandoned one
    assert losses_of(run) == losses_of(ref_dir)  # the same steps again, exactly
    assert main(["train", recipe, "--output", str(run), "--quiet", "--resume", "auto"]) == 0
    assert capsys.readouterr().out.startswith("run complete:")
