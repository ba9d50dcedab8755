"""A resume continues the run it resumes. Tried as a new user would: a run trained with `--set train.steps=30`, then
`--resume` with the recipe alone must not train on to the recipe's 300 steps with no word (its cosine learning rate
jumping from 3.0e-4 to 2.97e-3) nor overwrite the run's recipe.yaml. The command's settings are compared field by
field with the checkpoint's recipe.yaml: what breaks exactness is refused in one line naming each field and its
consequence (unless --allow-changes), what keeps it is named and applied, and a LoRA run resumed without `lora:` (or
the reverse) says so."""

import pytest
from test_train import data_dir, losses_of, recipe_dict, write_recipe  # noqa: F401 (fixtures)

from ms_deepseek.core.errors import UserError

from builders import SMALL_MODEL, main_captured


@pytest.mark.slow
def test_a_resume_without_the_runs_settings_is_refused_naming_them(data_dir, tmp_path):
    recipe = write_recipe(tmp_path, recipe_dict(data_dir, checkpoint={"save_interval": 2, "keep_last": 2}))
    run = tmp_path / "run"
    code, _, err = main_captured(
        [
            "train",
            str(recipe),
            "--output",
            str(run),
            "--quiet",
            "--set",
            "train.steps=2",
            "--set",
            "checkpoint.save_interval=1",
        ]
    )
    assert code == 0, err
    settings, metrics = (run / "recipe.yaml").read_text(), (run / "metrics.jsonl").read_text()

    # the recipe alone (train.steps 4, save_interval 2): the cosine schedule would restart on 4 steps
    code, out, err = main_captured(["train", str(recipe), "--output", str(run), "--quiet", "--resume"])
    assert code == 2 and "\n" not in err.strip(), err
    assert (
        "this command changes the run's settings: train.steps 2 -> 4: the learning-rate schedule is "
        "recomputed for 4 steps, so the learning rate goes from 0.0003 at step 2 to 0.000975 at step 3" in err
    ), err
    assert "also changed, keeping the run exact: checkpoint.save_interval 1 -> 2" in err
    assert f"(they are in {run / 'recipe.yaml'}" in err and "--allow-changes" in err
    assert (run / "recipe.yaml").read_text() == settings and (run / "metrics.jsonl").read_text() == metrics

    # the run's own recipe resumes it: it is complete at its 2 steps, whatever the recipe file says
    code, out, err = main_captured(["train", str(run / "recipe.yaml"), "--output", str(run), "--quiet", "--resume"])
    assert code == 0 and out.startswith("run complete:") and "at step 2 of train.steps=2" in out, (out, err)

    # said so: trained on, the consequence printed
    code, out, err = main_captured(
        ["train", str(recipe), "--output", str(run), "--quiet", "--resume", "--allow-changes"]
    )
    assert code == 0, err
    assert "resume: --allow-changes: train.steps 2 -> 4: the learning-rate schedule is recomputed" in out, out
    assert "resume: settings changed from the run's" in out and "checkpoint.save_interval 1 -> 2" in out
    assert len(losses_of(run)) == 4


def test_changes_that_keep_the_run_exact_are_named_and_applied(data_dir, tmp_path):
    from ms_deepseek.config.recipe import load_recipe_dict
    from ms_deepseek.train.resume import check_settings

    saved = load_recipe_dict(recipe_dict(data_dir)).to_dict()
    run = tmp_path / "run"
    state = {"step": 2, "global_batch_size": 4, "seq_len": 32}

    def check(allow=False, **sections):
        return check_settings(
            load_recipe_dict(recipe_dict(data_dir, **sections)),
            saved,
            state,
            run / "checkpoints" / "step_00000002",
            run,
            allow,
        )

    assert check() == []
    lines = check(checkpoint={"keep_last": 5}, logging={"log_interval": 3}, train={"eval_batches": 2})
    assert lines == [
        "resume: settings changed from the run's ("
        + str(run / "checkpoints" / "step_00000002" / "recipe.yaml")
        + "), exactness kept: checkpoint.keep_last 2 -> 5, logging.log_interval 1 -> 3, "
        "train.eval_batches 8 -> 2"
    ], lines
    # a warmup the trained steps are still in, and a constant schedule: more steps leave their learning rates alone
    saved = load_recipe_dict(recipe_dict(data_dir, optim={"schedule": "constant", "warmup_steps": 3})).to_dict()
    assert (
        "exactness kept: train.steps 4 -> 40"
        in check(train={"steps": 40}, optim={"schedule": "constant", "warmup_steps": 3})[0]
    )
    # ... but not a longer warmup, nor the step schedule's milestones (fractions of the run)
    with pytest.raises(UserError, match=r"optim.warmup_steps 3 -> 5: the learning-rate schedule is recomputed"):
        check(optim={"schedule": "constant", "warmup_steps": 5})
    saved = load_recipe_dict(recipe_dict(data_dir)).to_dict()
    # another layout at the same global batch: named; another global batch: refused
    with pytest.raises(
        UserError,
        match=r"train.micro_batch_size 4 -> 2: the global batch becomes 2 x 32 tokens "
        r"where the run trained 4 x 32",
    ):
        check(train={"micro_batch_size": 2})
    assert (
        "another layout at the same global batch (train.grad_accum_steps 1 -> 2, train.micro_batch_size 4 -> 2)"
        in check(train={"micro_batch_size": 2, "grad_accum_steps": 2})[0]
    )
    # optimizer, data, model, seed: the steps already trained were made with the run's values
    with pytest.raises(
        UserError,
        match=r"model.overrides.capacity_factor \(none\) -> 2, optim.weight_decay 0.1 -> "
        r"0, train.seed 11 -> 12: the 2 steps already trained",
    ):
        check(
            model={"overrides": dict(SMALL_MODEL, capacity_factor=2.0)}, optim={"weight_decay": 0.0}, train={"seed": 12}
        )
    lines = check(True, optim={"weight_decay": 0.0})
    assert lines[-1].startswith("resume: --allow-changes: optim.weight_decay 0.1 -> 0: the 2 steps already")


def test_lora_and_full_runs_are_not_resumed_as_each_other(data_dir, tmp_path):
    from ms_deepseek.config.recipe import load_recipe_dict
    from ms_deepseek.train.resume import check_settings

    full = load_recipe_dict(recipe_dict(data_dir))
    lora = load_recipe_dict(dict(recipe_dict(data_dir), lora={"r": 4}))
    ckpt, run = tmp_path / "run" / "checkpoints" / "step_00000002", tmp_path / "run"
    with pytest.raises(
        UserError,
        match=r"a LoRA run \(lora: r=4, its checkpoints hold adapters only\) but this "
        r"recipe \(recipe\) has no lora: section",
    ):
        check_settings(full, lora.to_dict(), {"step": 2}, ckpt, run, allow=True)
    with pytest.raises(
        UserError,
        match=r"a full training run \(no lora: section\) but this recipe \(recipe\) has a "
        r"lora: section; to fine-tune its weights with LoRA start a new run",
    ):
        check_settings(lora, full.to_dict(), {"step": 2}, ckpt, run, allow=True)


def test_resume_into_a_run_folder_that_does_not_exist_says_so(data_dir, tmp_path):
    recipe = write_recipe(tmp_path, recipe_dict(data_dir))
    code, _, err = main_captured(["train", str(recipe), "--output", str(tmp_path / "nowhere"), "--resume"])
    assert code == 2 and "\n" not in err.strip()
    assert f"--resume: the run folder {tmp_path / 'nowhere'} does not exist" in err, err
    assert not (tmp_path / "nowhere").exists()
