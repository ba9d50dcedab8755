"""Issue 13 item 10: paths named in data folders stay inside them, non-regular files are refused, bad
records are one line naming file:line (or, in metrics.jsonl, a warning naming it)."""

import json
import os

import numpy as np
import pytest

from bad_input_helpers import assert_refused, listing, run_cli
from data_helpers import make_byte_tokenizer, write_jsonl
from ms_deepseek.data.storage import load_lengths, load_meta
from ms_deepseek.core.errors import UserError


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from ms_deepseek.data.prepare import prepare_data

    base = tmp_path_factory.mktemp("prepared")
    tok = make_byte_tokenizer(base / "tok")
    src = write_jsonl(base / "in.jsonl", [{"text": f"hello world {i} " * 4} for i in range(20)])
    prepare_data([src], base / "data", tok, 16, progress=False)
    return base / "data"


def _copy(prepared, tmp_path, **meta_changes):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(prepared, data)
    meta = json.loads((data / "meta.json").read_text())
    meta.update(meta_changes)
    (data / "meta.json").write_text(json.dumps(meta))
    return data


@pytest.mark.parametrize("name, why", [("/etc/passwd", "is an absolute path"), ("../outside.npy", "points outside"),
                                       ("", "expected a file name"), (5, "expected a file name")])
def test_lengths_file_confined(prepared, tmp_path, name, why):
    (tmp_path / "outside.npy").write_bytes(b"x")
    data = _copy(prepared, tmp_path, lengths_file=name)
    with pytest.raises(UserError, match=f"meta.json: lengths_file: .*{why}"):
        load_meta(data)
    with pytest.raises(UserError, match="lengths_file"):
        load_lengths(data, json.loads((data / "meta.json").read_text()))


def test_shard_names_confined(prepared, tmp_path):
    data = _copy(prepared, tmp_path, files=["../../etc/passwd"])
    with pytest.raises(UserError, match=r"meta.json: files: '../../etc/passwd' points outside"):
        load_meta(data)


def test_symlink_out_of_the_folder(prepared, tmp_path):
    data = _copy(prepared, tmp_path)
    np.save(tmp_path / "elsewhere.npy", np.array([3, 4]))
    (data / "lengths.npy").unlink()
    (data / "lengths.npy").symlink_to(tmp_path / "elsewhere.npy")
    with pytest.raises(UserError, match="points outside"):
        load_meta(data)


@pytest.mark.parametrize("content, why", [(np.array([{"x": 1}], dtype=object), "not a plain .npy"),
                                          (np.zeros((2, 2), dtype=np.int64), "1-D integer array"),
                                          (np.array([1.5, 2.5]), "1-D integer array")])
def test_lengths_contents(prepared, tmp_path, content, why):
    data = _copy(prepared, tmp_path)
    np.save(data / "lengths.npy", content, allow_pickle=True)
    with pytest.raises(UserError, match=why):
        load_lengths(data, load_meta(data))


def test_train_names_the_pickled_lengths_file(capsys, prepared, tmp_path):
    import yaml

    data = _copy(prepared, tmp_path)
    np.save(data / "lengths.npy", np.array([{"x": 1}], dtype=object), allow_pickle=True)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"source": "tiny"}, "data": {"path": str(data), "num_workers": 1},
                                      "train": {"steps": 1, "micro_batch_size": 1},
                                      "logging": {"tensorboard": False}}))
    code, _, err = run_cli(capsys, ["train", recipe, "--output", tmp_path / "run"])
    assert_refused(code, err, "lengths.npy: not a plain .npy")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("role", ["tokenizer", "input"])
def test_fifo_refused(capsys, tmp_path, role):
    tok = make_byte_tokenizer(tmp_path / "tok")
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "hello"}])
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)  # opening it for reading would block forever
    argv = ["prepare-data", fifo if role == "input" else src, "--tokenizer", fifo if role == "tokenizer" else tok,
            "--seq-len", "8", "--output", tmp_path / "o", "--no-progress"]
    code, _, err = run_cli(capsys, argv)
    assert_refused(code, err, "pipe.json: is a FIFO")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("fmt, record, key", [
    ("pretrain", '{"text": "bad \\ud800 text"}', "'text'"),
    ("sft", '{"prompt": "hi", "response": "\\udfff"}', "'response'"),
    ("sft", '{"messages": [{"role": "user", "content": "x\\ud83d"}]}', "'messages[0].content'"),
])
def test_lone_surrogate(capsys, tmp_path, fmt, record, key):
    tok = make_byte_tokenizer(tmp_path / "tok")
    first = {"text": "fine"} if fmt == "pretrain" else {"prompt": "a", "response": "b"}
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(first) + "\n" + record + "\n")
    before = listing(tmp_path)
    code, _, err = run_cli(capsys, ["prepare-data", src, "--tokenizer", tok, "--seq-len", "8", "--format", fmt,
                                    "--output", tmp_path / "o", "--no-progress"])
    assert_refused(code, err, "in.jsonl:2:", key, "lone surrogate")
    assert listing(tmp_path) == before


@pytest.mark.parametrize("step", ['"abc"', '"NaN"', "NaN", "-1", "1.5", "true", "null"])
def test_metrics_bad_step_is_a_warning(capsys, tmp_path, step):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": ' + step + ', "loss": 1.0}\n'
                                       '{"step": 2, "loss": 1.5}\n')
    code, out, err = run_cli(capsys, ["report", run])
    assert code == 0 and "2 records" in out
    assert "metrics.jsonl:2: " in err and err.startswith("warning: ")
