"""Issue 13 item 6: outputs that cannot be written are one line naming the path, before any work."""

import json

import pytest

from bad_input_helpers import assert_refused, hf_copy, listing, run_cli
from ms_deepseek.core.errors import UserError
from ms_deepseek.core.safe_io import check_output_dir, check_output_file


@pytest.mark.parametrize("dst", ["/proc/ms-deepseek-out", "/sys/ms-deepseek-out", "/proc/self/x/y"])
def test_convert_under_pseudo_fs(capsys, tmp_path, dst):
    hf = hf_copy(tmp_path)
    code, _, err = run_cli(capsys, ["convert", "hf-to-ms", hf, dst, "--no-progress"])
    assert_refused(code, err, dst.split("/")[1])


def test_convert_parent_is_a_file(capsys, tmp_path):
    hf = hf_copy(tmp_path)
    (tmp_path / "afile").write_text("x")
    before = listing(tmp_path)
    code, _, err = run_cli(capsys, ["convert", "hf-to-ms", hf, tmp_path / "afile" / "a" / "out", "--no-progress"])
    assert_refused(code, err, "afile is a file")
    assert listing(tmp_path) == before


def _run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    return run


@pytest.mark.parametrize("target, name", [("outdir", "outdir: is a folder"), ("/proc/r.html", "/proc/r.html"),
                                          ("afile/r.html", "afile is a file")])
def test_report_output(capsys, tmp_path, target, name):
    run = _run(tmp_path)
    (tmp_path / "outdir").mkdir()
    (tmp_path / "afile").write_text("x")
    before = listing(tmp_path)
    out = target if target.startswith("/") else tmp_path / target
    code, _, err = run_cli(capsys, ["report", run, "-o", out])
    assert_refused(code, err, name)
    assert listing(tmp_path) == before


def test_read_only_folder_is_found_by_trying(tmp_path):
    # os.access says yes to root everywhere; the probe really creates a file
    check_output_file(tmp_path / "ok.html")
    check_output_dir(tmp_path / "new" / "deeper")
    assert listing(tmp_path) == set()
    with pytest.raises(UserError, match="is a file"):
        (tmp_path / "f").write_text("x")
        check_output_dir(tmp_path / "f")
    with pytest.raises(UserError, match="is a folder"):
        check_output_file(tmp_path)


def _recipe(tmp_path):
    import yaml

    recipe = {"model": {"source": "tiny"}, "data": {"seq_len": 16, "embedded_vocab_size": 512},
              "train": {"steps": 1, "micro_batch_size": 1}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.parametrize("target, name", [("runfile", "runfile: is a file"), ("/proc/run", "/proc/run"),
                                          ("runfile/sub", "runfile is a file")])
def test_train_output(capsys, tmp_path, target, name):
    recipe = _recipe(tmp_path)
    (tmp_path / "runfile").write_text("x")
    before = listing(tmp_path)
    out = target if target.startswith("/") else tmp_path / target
    code, _, err = run_cli(capsys, ["train", recipe, "--output", out])
    assert_refused(code, err, name)
    assert listing(tmp_path) == before


@pytest.mark.parametrize("target, name", [("/proc/data", "/proc/data"), ("afile/data", "afile is a file"),
                                          ("afile", "afile: exists and is not a folder")])
def test_prepare_data_output(capsys, tmp_path, target, name):
    from data_helpers import make_byte_tokenizer, write_jsonl

    tok = make_byte_tokenizer(tmp_path / "tok")
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "hello world " * 5}] * 5)
    (tmp_path / "afile").write_text("x")
    before = listing(tmp_path)
    out = target if target.startswith("/") else tmp_path / target
    code, _, err = run_cli(capsys, ["prepare-data", src, "--tokenizer", tok, "--seq-len", "8", "--output", out,
                                    "--no-progress"])
    assert_refused(code, err, name)
    assert listing(tmp_path) == before
