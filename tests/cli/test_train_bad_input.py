"""Bad input to ``ms-deepseek train``: refusals leave nothing behind (or keep an existing run folder's files),
unwritable outputs are one line naming the path."""

import pytest
import yaml

from bad_input_helpers import assert_refused, edit_config, hf_copy, listing, run_cli
from data_helpers import make_byte_tokenizer, write_jsonl


def _recipe(tmp_path, source, data):
    recipe = {
        "model": {"source": str(source)},
        "data": {"path": str(data), "num_workers": 1},
        "train": {"steps": 2, "micro_batch_size": 2},
        "logging": {"tensorboard": False},
        "checkpoint": {"save_interval": 0},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_train_refused_for_a_bad_checkpoint_shape_leaves_nothing(capsys, tmp_path):
    tok = make_byte_tokenizer(tmp_path / "tok")
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "hello world " * 8}] * 20)
    code, _, err = run_cli(
        capsys,
        ["prepare-data", src, "--tokenizer", tok, "--seq-len", "16", "--output", tmp_path / "data", "--no-progress"],
    )
    assert code == 0, err
    hf = edit_config(hf_copy(tmp_path), vocab_size=512)  # embed/lm_head rows (256) no longer match
    recipe = _recipe(tmp_path, hf, tmp_path / "data")
    before = listing(tmp_path)
    for run in (tmp_path / "runs" / "new", tmp_path / "data_run"):
        code, _, err = run_cli(capsys, ["train", recipe, "--output", run])
        assert_refused(code, err, "model.embed_tokens.weight has shape [256, 64]")  # checked when opened
        leftovers = listing(tmp_path) - before
        assert not {p for p in leftovers if not p.startswith("mf_log")}, leftovers


def test_train_refusal_in_an_existing_run_folder_keeps_its_files(capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    recipe = _recipe(tmp_path, "tiny", tmp_path / "missing-data")
    code, _, err = run_cli(capsys, ["train", recipe, "--output", run])
    assert code == 2, err
    assert listing(run) == {"notes.txt"}


def _recipe_tiny(tmp_path):
    import yaml

    recipe = {
        "model": {"source": "tiny"},
        "data": {"seq_len": 16, "embedded_vocab_size": 512},
        "train": {"steps": 1, "micro_batch_size": 1},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.parametrize(
    "target, name",
    [("runfile", "runfile: is a file"), ("/proc/run", "/proc/run"), ("runfile/sub", "runfile is a file")],
)
def test_train_output(capsys, tmp_path, target, name):
    recipe = _recipe_tiny(tmp_path)
    (tmp_path / "runfile").write_text("x")
    before = listing(tmp_path)
    out = target if target.startswith("/") else tmp_path / target
    code, _, err = run_cli(capsys, ["train", recipe, "--output", out])
    assert_refused(code, err, name)
    assert listing(tmp_path) == before


def test_a_recipe_that_does_not_exist_names_the_nearest_one(capsys):
    """`train recipes/tiny.yaml` (no such file) says so and names the nearest recipe that exists."""
    from repo_paths import RECIPES

    code, _, err = run_cli(capsys, ["train", RECIPES / "tiny.yaml"])
    assert_refused(code, err, "tiny.yaml: no such recipe file", f"(did you mean {RECIPES / 'tiny-cpu.yaml'}?)")
