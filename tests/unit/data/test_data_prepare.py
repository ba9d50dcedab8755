"""prepare-data: MindRecord shards + meta.json, destination safety, the CLI, the embedded default corpus."""

import json

import numpy as np
import pytest

from ms_deepseek.core.errors import UserError
from ms_deepseek.data.chat import IGNORE_INDEX
from ms_deepseek.data.prepare import prepare_data, prepare_embedded_default, stdlib_files
from ms_deepseek.data.storage import load_meta
from ms_deepseek.data.tokenizer import load_tokenizer

from data_helpers import BOS_ID, EOS_ID, PAD_ID, byte_ids, make_byte_tokenizer, read_rows, write_jsonl


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    make_byte_tokenizer(folder)
    return folder


def _siblings(path):
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


def test_pretrain_shards_hold_the_packed_stream(tmp_path, tok_dir):
    texts = [f"document {i}: " + "x" * (i * 7 % 40) for i in range(30)]
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"text": t} for t in texts[:20]])
    for i, t in enumerate(texts[20:]):
        (tmp_path / "in" / f"t{i}.txt").write_text(t)
    out = tmp_path / "prepared"
    meta, summary = prepare_data([tmp_path / "in"], out, tok_dir, seq_len=16, progress=False)

    stream = [t for text in texts for t in [BOS_ID] + byte_ids(text) + [EOS_ID]]
    n_full = len(stream) // 16
    rows = read_rows(out)
    assert len(rows) == n_full + 1
    for k, row in enumerate(rows[:n_full]):
        assert row["input_ids"].tolist() == stream[16 * k : 16 * (k + 1)]
        assert row["labels"].tolist() == row["input_ids"].tolist() and int(row["length"]) == 16
    tail = stream[16 * n_full :]
    last = rows[-1]
    assert last["input_ids"].tolist() == tail + [PAD_ID] * (16 - len(tail))
    assert last["labels"].tolist() == tail + [IGNORE_INDEX] * (16 - len(tail))
    assert last["input_ids"].dtype == np.int32 and int(last["length"]) == len(tail)

    counts = meta["counts"]
    assert (counts["documents"], counts["samples"], counts["tokens"]) == (30, n_full + 1, len(stream))
    assert meta["format"] == "pretrain" and meta["seq_len"] == 16
    assert json.loads((out / "meta.json").read_text())["counts"] == counts
    # The tokenizer travels with the data and is identified by its hash.
    assert load_tokenizer(out).sha256() == load_tokenizer(tok_dir).sha256() == meta["tokenizer"]["sha256"]
    assert np.load(out / "lengths.npy").tolist() == [int(r["length"]) for r in rows]
    assert f"wrote {n_full + 1} samples ({len(stream)} tokens" in summary and "from 30 documents" in summary
    assert _siblings(out) == []


def test_sft_shards_lengths_and_truncation_count(tmp_path, tok_dir):
    records = [
        {"prompt": f"question {i}" + "?" * (i % 13), "response": "answer " + "a" * (i % 29)} for i in range(2500)
    ]
    write_jsonl(tmp_path / "chat.jsonl", records)
    out = tmp_path / "sft"
    meta, summary = prepare_data(
        [tmp_path / "chat.jsonl"], out, tok_dir, seq_len=48, fmt="sft", num_shards=3, progress=False
    )
    assert len(meta["files"]) == 3
    rows = read_rows(out)
    assert len(rows) == 2500
    lengths = np.load(out / "lengths.npy")
    # lengths.npy follows MindDataset's reading order (the loader relies on it):
    # rows are dealt round-robin to the 3 files, each file keeps write order.
    assert lengths.tolist() == [int(r["length"]) for r in rows]
    full_lengths = [1 + len(byte_ids(f"User: {r['prompt']}\n\nAssistant: {r['response']}")) + 1 for r in records]
    order = [i for shard in range(3) for i in range(shard, 2500, 3)]
    assert lengths.tolist() == [min(full_lengths[i], 48) for i in order]
    truncated = sum(n > 48 for n in full_lengths)
    assert truncated > 0 and meta["counts"]["truncated"] == truncated
    assert f"{truncated} truncated to seq_len" in summary
    row = rows[1]  # record 3
    prompt = 1 + len(byte_ids("User: question 3???\n\nAssistant:"))
    assert row["labels"][:prompt].tolist() == [IGNORE_INDEX] * prompt
    assert row["labels"][prompt:].tolist() == row["input_ids"][prompt:].tolist()
    assert row["input_ids"][-1] == EOS_ID


def test_destination_is_never_half_written(tmp_path, tok_dir):
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "hello world"}] * 5)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n')
    out = tmp_path / "out"
    with pytest.raises(UserError, match=r"bad.jsonl:2: bad JSON"):
        prepare_data([good, bad], out, tok_dir, seq_len=8, progress=False)
    assert not out.exists() and _siblings(out) == []

    prepare_data([good], out, tok_dir, seq_len=8, progress=False)
    before = (out / "meta.json").read_text()
    with pytest.raises(UserError, match=r"out: folder is not empty \(use --overwrite"):
        prepare_data([good], out, tok_dir, seq_len=4, progress=False)
    with pytest.raises(UserError, match=r"bad.jsonl:2"):
        prepare_data([bad], out, tok_dir, seq_len=4, overwrite=True, progress=False)
    assert (out / "meta.json").read_text() == before and _siblings(out) == []

    meta, _ = prepare_data([good], out, tok_dir, seq_len=4, overwrite=True, progress=False)
    assert load_meta(out)["seq_len"] == 4 and _siblings(out) == []


@pytest.mark.parametrize(
    "name, content, fmt, message",
    [
        ("bad.jsonl", b'{"text": "a"}\n{"text": "b"\n', "pretrain", r"bad.jsonl:2: bad JSON"),
        ("bad.txt", b"fine\n\xff\xfe\n", "pretrain", r"bad.txt:2: not valid UTF-8"),
        ("bad.parquet", b"PAR1 not really", "pretrain", r"bad.parquet: not a readable parquet file"),
        ("bad.jsonl", b'{"messages": [{"role": "user"}]}\n', "sft", r"bad.jsonl:1: messages\[0\] must be an object"),
    ],
)
def test_bad_inputs_leave_nothing_behind(tmp_path, tok_dir, name, content, fmt, message):
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "hello", "prompt": "q", "response": "a"}] * 3)
    (tmp_path / name).write_bytes(content)
    out = tmp_path / "out"
    with pytest.raises(UserError, match=message):
        prepare_data([good, tmp_path / name], out, tok_dir, seq_len=8, fmt=fmt, progress=False)
    assert not out.exists() and _siblings(out) == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"seq_len": 1}, r"--seq-len: must be an integer >= 2"),
        ({"fmt": "chat"}, r"--format: must be 'pretrain' or 'sft'"),
        ({"num_shards": 0}, r"--num-shards: must be between 1 and 1000"),
        ({"num_shards": 50}, r"--num-shards: 50 shards for only"),
        ({"tokenizer": "nowhere/tokenizer.json"}, r"nowhere/tokenizer.json: tokenizer not found"),
    ],
)
def test_bad_arguments(tmp_path, tok_dir, kwargs, message):
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "hello world"}] * 5)
    args = dict(inputs=[good], output=tmp_path / "out", tokenizer=tok_dir, seq_len=8, progress=False)
    args.update(kwargs)
    with pytest.raises(UserError, match=message):
        prepare_data(**args)
    assert not (tmp_path / "out").exists() and _siblings(tmp_path / "out") == []


def test_empty_corpus_is_refused(tmp_path, tok_dir):
    empty = write_jsonl(tmp_path / "e.jsonl", [{"text": ""}, {"text": "  \n"}])
    with pytest.raises(UserError, match=r"e.jsonl: no samples produced \(0 documents, 2 empty"):
        prepare_data([empty], tmp_path / "out", tok_dir, seq_len=8, progress=False)
    assert not (tmp_path / "out").exists()


def test_cli(tmp_path, tok_dir, capsys):
    from ms_deepseek.cli import main

    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "some text here"}] * 4)
    out = tmp_path / "cli_out"
    assert (
        main(
            [
                "prepare-data",
                str(data),
                "--output",
                str(out),
                "--tokenizer",
                str(tok_dir),
                "--seq-len",
                "8",
                "--num-shards",
                "2",
                "--no-progress",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith("wrote ")
    assert len(load_meta(out)["files"]) == 2
    assert (
        main(
            [
                "prepare-data",
                str(data),
                "--output",
                str(out),
                "--tokenizer",
                str(tok_dir),
                "--seq-len",
                "8",
                "--no-progress",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "folder is not empty" in err
    assert main(["prepare-data", str(data), "--output", str(tmp_path / "x"), "--seq-len", "8"]) == 2
    assert "--tokenizer: required" in capsys.readouterr().err
    with pytest.raises(SystemExit) as ex:
        main(["prepare-data", "--help"])
    assert ex.value.code == 0 and "--embedded-default" in capsys.readouterr().out
    assert main(["prepare-data", str(data), "--embedded-default", "--output", str(tmp_path / "e")]) == 2
    assert "drop INPUTs" in capsys.readouterr().err
    assert (
        main(
            [
                "prepare-data",
                "--embedded-default",
                "--output",
                str(tmp_path / "e"),
                "--seq-len",
                "32",
                "--vocab-size",
                "512",
                "--max-bytes",
                "30000",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "wrote " in capsys.readouterr().out and load_meta(tmp_path / "e")["seq_len"] == 32


def test_embedded_default_small(tmp_path):
    out = tmp_path / "embedded"
    meta, summary = prepare_embedded_default(out, seq_len=64, vocab_size=512, max_bytes=120_000, progress=False)
    tok = load_tokenizer(out)
    assert tok.kind == "sentencepiece" and tok.vocab_size == 512 and (out / "tokenizer.model").is_file()
    assert meta["format"] == "pretrain" and meta["seq_len"] == 64
    root, files = stdlib_files(120_000)
    assert sum(f.stat().st_size for f in files) <= 120_000
    assert not any(part in ("test", "tests", "site-packages") for f in files for part in f.parts)
    rows = read_rows(out)
    assert len(rows) == meta["counts"]["samples"] > 0
    first = rows[0]["input_ids"]
    assert first[0] == tok.bos_id
    # The first window is the start of the first (non-empty) standard library file.
    texts = [f.read_text(encoding="utf-8") for f in files]
    first_text = next(t for t in texts if t.strip())
    assert first_text.startswith(tok.decode(first[1:].tolist()))
    assert meta["counts"]["max_token_id"] < 512
    with pytest.raises(UserError, match=r"--vocab-size: must be between 512 and 65536"):
        prepare_embedded_default(tmp_path / "e2", vocab_size=100, progress=False)


def test_a_tokenizer_under_another_name_is_saved_as_the_folder_reads_it(tmp_path, tok_dir):
    """prepare-data --tokenizer tok.model (or my.json): the data folder holds it under the name
    train and generate look for, and its hash is of the bytes, not of the file name."""
    from ms_deepseek.data.tokenizer import train_sentencepiece

    text = "def f(x):\n    return x + 1\n" * 200 + "".join(chr(c) for c in range(32, 127)) * 20
    sp_file = tmp_path / "tok.model"
    train_sentencepiece([text], 400, sp_file)
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"text": text[:400]}])
    hf_file = tmp_path / "hf" / "my.json"
    hf_file.parent.mkdir()
    hf_file.write_bytes((tok_dir / "tokenizer.json").read_bytes())
    for src, name in ((sp_file, "tokenizer.model"), (hf_file, "tokenizer.json")):
        out = tmp_path / f"prepared-{name}"
        meta, _ = prepare_data([tmp_path / "in"], out, src, seq_len=16, progress=False)
        assert (out / name).is_file() and meta["tokenizer"]["files"] == [name]
        tok = load_tokenizer(out)  # what train does with the data folder
        assert tok.sha256() == load_tokenizer(src).sha256() == meta["tokenizer"]["sha256"]
