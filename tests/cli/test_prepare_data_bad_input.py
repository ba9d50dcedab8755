"""Bad input to ``ms-deepseek prepare-data``: FIFOs, lone surrogates, destinations inside an input, leftovers,
unwritable outputs."""

import json
import os

import pytest

from bad_input_helpers import assert_refused, listing, run_cli
from data_helpers import make_byte_tokenizer, write_jsonl


@pytest.mark.parametrize("role", ["tokenizer", "input"])
def test_fifo_refused(capsys, tmp_path, role):
    tok = make_byte_tokenizer(tmp_path / "tok")
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "hello"}])
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)  # opening it for reading would block forever
    argv = [
        "prepare-data",
        fifo if role == "input" else src,
        "--tokenizer",
        fifo if role == "tokenizer" else tok,
        "--seq-len",
        "8",
        "--output",
        tmp_path / "o",
        "--no-progress",
    ]
    code, _, err = run_cli(capsys, argv)
    assert_refused(code, err, "pipe.json: is a FIFO")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "fmt, record, key",
    [
        ("pretrain", '{"text": "bad \\ud800 text"}', "'text'"),
        ("sft", '{"prompt": "hi", "response": "\\udfff"}', "'response'"),
        ("sft", '{"messages": [{"role": "user", "content": "x\\ud83d"}]}', "'messages[0].content'"),
    ],
)
def test_lone_surrogate(capsys, tmp_path, fmt, record, key):
    tok = make_byte_tokenizer(tmp_path / "tok")
    first = {"text": "fine"} if fmt == "pretrain" else {"prompt": "a", "response": "b"}
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(first) + "\n" + record + "\n")
    before = listing(tmp_path)
    code, _, err = run_cli(
        capsys,
        [
            "prepare-data",
            src,
            "--tokenizer",
            tok,
            "--seq-len",
            "8",
            "--format",
            fmt,
            "--output",
            tmp_path / "o",
            "--no-progress",
        ],
    )
    assert_refused(code, err, "in.jsonl:2:", key, "lone surrogate")
    assert listing(tmp_path) == before


@pytest.mark.parametrize(
    "layout, output, inputs, name",
    [
        ("dir/in.jsonl", "dir", ["dir/in.jsonl"], "holds the input"),
        ("dir/in.jsonl", "dir", ["dir"], "holds the input"),
        ("corpus/in.jsonl", "corpus/prepared", ["corpus"], "lies inside the input folder"),
    ],
)
def test_prepare_data(capsys, tmp_path, layout, output, inputs, name):
    tok = make_byte_tokenizer(tmp_path / "tok")
    write_jsonl(tmp_path / layout, [{"text": "hello world " * 5}] * 5)
    before = listing(tmp_path)
    code, _, err = run_cli(
        capsys,
        [
            "prepare-data",
            *[tmp_path / i for i in inputs],
            "--tokenizer",
            tok,
            "--seq-len",
            "8",
            "--output",
            tmp_path / output,
            "--overwrite",
            "--no-progress",
        ],
    )
    assert_refused(code, err, name)
    assert listing(tmp_path) == before  # the input is still there, nothing was written


@pytest.mark.parametrize("bad", ["{not json", '{"no_text": 1}', '{"text": 5}'])
def test_failed_prepare_data_leaves_no_parent_folders(capsys, tmp_path, bad):
    tok = make_byte_tokenizer(tmp_path / "tok")
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "fine"}) + "\n" + bad + "\n")
    before = listing(tmp_path)
    code, _, err = run_cli(
        capsys,
        [
            "prepare-data",
            src,
            "--tokenizer",
            tok,
            "--seq-len",
            "8",
            "--output",
            tmp_path / "a" / "b" / "c",
            "--no-progress",
        ],
    )
    assert_refused(code, err, "in.jsonl:2")
    assert listing(tmp_path) == before


@pytest.mark.parametrize(
    "target, name",
    [("/proc/data", "/proc/data"), ("afile/data", "afile is a file"), ("afile", "afile: exists and is not a folder")],
)
def test_prepare_data_output(capsys, tmp_path, target, name):
    from data_helpers import make_byte_tokenizer, write_jsonl

    tok = make_byte_tokenizer(tmp_path / "tok")
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "hello world " * 5}] * 5)
    (tmp_path / "afile").write_text("x")
    before = listing(tmp_path)
    out = target if target.startswith("/") else tmp_path / target
    code, _, err = run_cli(
        capsys, ["prepare-data", src, "--tokenizer", tok, "--seq-len", "8", "--output", out, "--no-progress"]
    )
    assert_refused(code, err, name)
    assert listing(tmp_path) == before
