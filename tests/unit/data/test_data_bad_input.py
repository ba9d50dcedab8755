"""Bad data folders and records: paths named in a prepared folder stay inside it, non-regular and pickled
files are refused, runaway-nested records are one line naming file:line."""

import json

import numpy as np
import pytest

from ms_deepseek.core.errors import UserError
from ms_deepseek.data.storage import load_lengths, load_meta

from bad_input_helpers import assert_refused, deep, run_cli
from data_helpers import make_byte_tokenizer, write_jsonl


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


@pytest.mark.parametrize(
    "name, why",
    [
        ("/etc/passwd", "is an absolute path"),
        ("../outside.npy", "points outside"),
        ("", "expected a file name"),
        (5, "expected a file name"),
    ],
)
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


@pytest.mark.parametrize(
    "content, why",
    [
        (np.array([{"x": 1}], dtype=object), "not a plain .npy"),
        (np.zeros((2, 2), dtype=np.int64), "1-D integer array"),
        (np.array([1.5, 2.5]), "1-D integer array"),
    ],
)
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
    recipe.write_text(
        yaml.safe_dump(
            {
                "model": {"source": "tiny"},
                "data": {"path": str(data), "num_workers": 1},
                "train": {"steps": 1, "micro_batch_size": 1},
                "logging": {"tensorboard": False},
            }
        )
    )
    code, _, err = run_cli(capsys, ["train", recipe, "--output", tmp_path / "run"])
    assert_refused(code, err, "lengths.npy: not a plain .npy")
    assert not (tmp_path / "run").exists()


def test_jsonl_line_names_file_and_line(tmp_path):
    from ms_deepseek.core.errors import UserError
    from ms_deepseek.data.readers import read_jsonl

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "fine"}) + "\n" + '{"text": ' + deep() + "}\n")
    with pytest.raises(UserError, match=r"in\.jsonl:2: nested too deeply"):
        list(read_jsonl(src, "pretrain"))
