"""Readers (jsonl / parquet / text), packing and masking, and the data: config section."""

import numpy as np
import pytest

from ms_deepseek.config.data import DataConfig
from ms_deepseek.core.errors import UserError
from ms_deepseek.core.schema import from_dict
from ms_deepseek.data.chat import IGNORE_INDEX
from ms_deepseek.data.packing import Packer, PackStats, sft_row
from ms_deepseek.data.readers import discover_files, iter_documents

from data_helpers import write_jsonl


def _docs(files, fmt):
    return [doc for _, doc in iter_documents(files, fmt)]


def _parquet(path, columns):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), str(path))
    return path


# ----------------------------------------------------------------------------- readers


def test_pretrain_from_jsonl_parquet_and_text(tmp_path):
    j = write_jsonl(tmp_path / "a.jsonl", [{"text": "one", "id": 1}, {"text": "twö"}])
    (tmp_path / "b.jsonl").write_text('{"text": "three"}\n\n   \n')  # blank lines are skipped
    p = _parquet(tmp_path / "c.parquet", {"text": ["four", "five"], "other": [1, 2]})
    t = tmp_path / "d.py"
    t.write_text("print('six')\n")
    assert _docs([j, tmp_path / "b.jsonl", p, t], "pretrain") == [
        "one",
        "twö",
        "three",
        "four",
        "five",
        "print('six')\n",
    ]


def test_folders_are_read_recursively_in_sorted_order(tmp_path):
    for rel in ("b/2.txt", "b/10.txt", "a.txt", ".hidden/x.txt", "b/__pycache__/y.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    assert [f.relative_to(tmp_path).as_posix() for f in discover_files([tmp_path])] == ["a.txt", "b/10.txt", "b/2.txt"]


def test_sft_records_from_jsonl_and_parquet(tmp_path):
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    j = write_jsonl(tmp_path / "s.jsonl", [{"messages": chat}, {"prompt": "q2", "response": "a2", "system": "s"}])
    p = _parquet(tmp_path / "m.parquet", {"messages": [chat]})
    p2 = _parquet(tmp_path / "pr.parquet", {"prompt": ["q3"], "response": ["a3"]})
    docs = _docs([j, p, p2], "sft")
    assert docs[0] == chat and docs[2] == chat
    assert docs[1] == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
    ]
    assert docs[3] == [{"role": "user", "content": "q3"}, {"role": "assistant", "content": "a3"}]


@pytest.mark.parametrize(
    "content, fmt, message",
    [
        (b'{"text": "ok"}\n{"text": oops}\n', "pretrain", r"bad.jsonl:2: bad JSON"),
        (b'{"text": "ok"}\n{"text": "\xff"}\n', "pretrain", r"bad.jsonl:2: not valid UTF-8"),
        (b'{"text": "ok"}\n[1, 2]\n', "pretrain", r"bad.jsonl:2: expected a JSON object"),
        (b'{"body": "x"}\n', "pretrain", r"bad.jsonl:1: no 'text' field"),
        (b'{"text": 5}\n', "pretrain", r"bad.jsonl:1: 'text' must be a string"),
        (b'{"text": "x"}\n', "sft", r"bad.jsonl:1: SFT records need 'messages' or 'prompt' and 'response'"),
        (b'{"messages": [{"role": "bot", "content": "x"}]}\n', "sft", r"bad.jsonl:1: messages\[0\].role 'bot'"),
        (b'{"prompt": "x"}\n', "sft", r"bad.jsonl:1: .*needs both 'prompt' and 'response'"),
    ],
)
def test_bad_jsonl_names_file_and_line(tmp_path, content, fmt, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(UserError, match=message):
        _docs([path], fmt)


def test_bad_text_file_names_file_and_line(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(b"line one\nline two\nbad \xc3\x28 here\n")
    with pytest.raises(UserError, match=r"notes.txt:3: not valid UTF-8"):
        _docs([path], "pretrain")


def test_bad_parquet_and_missing_columns(tmp_path):
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(UserError, match=r"broken.parquet: not a readable parquet file"):
        _docs([broken], "pretrain")
    nocol = _parquet(tmp_path / "nocol.parquet", {"body": ["x"]})
    with pytest.raises(UserError, match=r"nocol.parquet: no 'text' column \(columns: body\)"):
        _docs([nocol], "pretrain")
    with pytest.raises(UserError, match=r"nocol.parquet: SFT parquet needs a 'messages' column"):
        _docs([nocol], "sft")
    nulls = _parquet(tmp_path / "nulls.parquet", {"text": ["ok", None]})
    with pytest.raises(UserError, match=r"nulls.parquet: row 2: 'text' must be a string"):
        _docs([nulls], "pretrain")


def test_missing_inputs_and_text_in_sft(tmp_path):
    with pytest.raises(UserError, match=r"nothere.jsonl: no such file or folder"):
        discover_files([tmp_path / "nothere.jsonl"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"no input files found"):
        discover_files([tmp_path / "empty"])
    (tmp_path / "t.txt").write_text("x")
    with pytest.raises(UserError, match=r"t.txt: plain text files are pretraining documents"):
        _docs([tmp_path / "t.txt"], "sft")


# ----------------------------------------------------------------------------- packing


def _pack(docs, seq_len, bos=0, eos=1, pad=2):
    stats = PackStats()
    packer = Packer(seq_len, bos, eos, pad, stats)
    rows = [r for d in docs for r in packer.add(d)] + list(packer.finish())
    return rows, stats


def test_packing_windows_and_padding():
    # stream: [0 5 6 7 1] [0 8 1] [0 9 9 9 9 1]  (bos doc eos), cut every 4 tokens
    rows, stats = _pack([[5, 6, 7], [8], [9, 9, 9, 9]], seq_len=4)
    assert [r["input_ids"].tolist() for r in rows] == [[0, 5, 6, 7], [1, 0, 8, 1], [0, 9, 9, 9], [9, 1, 2, 2]]
    assert [r["labels"].tolist() for r in rows] == [
        [0, 5, 6, 7],
        [1, 0, 8, 1],
        [0, 9, 9, 9],
        [9, 1, IGNORE_INDEX, IGNORE_INDEX],
    ]
    assert [int(r["length"]) for r in rows] == [4, 4, 4, 2]
    assert all(r["input_ids"].dtype == np.int32 and r["labels"].dtype == np.int32 for r in rows)
    assert (stats.documents, stats.samples, stats.tokens, stats.target_tokens, stats.max_token_id) == (3, 4, 14, 14, 9)


def test_packing_without_bos_and_dropping_a_lone_last_token():
    rows, stats = _pack([[5, 6, 7], [8, 8]], seq_len=3, bos=None)  # stream 5 6 7 1 8 8 1
    assert [r["input_ids"].tolist() for r in rows] == [[5, 6, 7], [1, 8, 8]]
    assert stats.dropped == 1  # the final window [1] would predict nothing


def test_sft_rows_truncate_and_drop_are_counted(tmp_path):
    from ms_deepseek.data.tokenizer import load_tokenizer

    from data_helpers import make_byte_tokenizer

    make_byte_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    stats = PackStats()
    full = sft_row(tok, chat, 100, stats)
    n = int(full["length"])
    cut = sft_row(tok, chat, n - 3, stats)
    assert cut["input_ids"].tolist() == full["input_ids"][: n - 3].tolist()
    assert cut["labels"].tolist() == full["labels"][: n - 3].tolist()
    # Cut inside the prompt: nothing to learn -> dropped, never a 0/0 loss.
    assert sft_row(tok, chat, 8, stats) is None
    assert (stats.documents, stats.samples, stats.truncated, stats.dropped) == (3, 2, 2, 1)


# ----------------------------------------------------------------------------- config


def test_data_config_defaults_and_types():
    cfg = from_dict(DataConfig, {"path": "x", "format": "sft", "bucket_boundaries": [64, 128], "seq_len": 256}, "data")
    assert cfg.shuffle and cfg.bucket_boundaries == [64, 128]
    assert from_dict(DataConfig, {}, "data").embedded_seq_len == 256
    with pytest.raises(UserError, match=r"data.seq_len: expected int"):
        from_dict(DataConfig, {"seq_len": "long"}, "data")
    with pytest.raises(UserError, match=r"data.fromat: unknown key"):
        from_dict(DataConfig, {"fromat": "sft"}, "data")


@pytest.mark.parametrize(
    "values, message",
    [
        ({"seq_len": 1}, r"data.seq_len: must be at least 2"),
        ({"num_workers": 0}, r"data.num_workers"),
        ({"seed": -1}, r"data.seed"),
        ({"path": "x", "format": "sft", "bucket_boundaries": [128, 64]}, r"data.bucket_boundaries: must be strictly"),
        ({"path": "x", "format": "sft", "bucket_boundaries": []}, r"data.bucket_boundaries: empty"),
        (
            {"path": "x", "format": "sft", "seq_len": 100, "bucket_boundaries": [64, 128]},
            r"data.bucket_boundaries: 128 is longer than data.seq_len 100",
        ),
        ({"bucket_boundaries": [64]}, r"data.bucket_boundaries: only used with data.format 'sft'"),
        ({"format": "sft"}, r"data.path: format 'sft' needs a prepared SFT folder"),
        ({"embedded_default": False}, r"data.path: not set and data.embedded_default is false"),
        ({"path": " "}, r"data.path: empty string"),
        ({"embedded_vocab_size": 100}, r"data.embedded_vocab_size"),
        ({"embedded_max_bytes": 5}, r"data.embedded_max_bytes"),
    ],
)
def test_data_config_rejects_impossible_values(values, message):
    with pytest.raises(UserError, match=message):
        from_dict(DataConfig, values, "data")
