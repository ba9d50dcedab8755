"""What a newcomer meets on the first runs (issue 22's friction list), tried the way a user does.

One LoRA fine-tune of a small model on a small SFT folder (``ms-deepseek train`` in a fresh
process, its output redirected to a pipe as in a scheduler's log) gives the run the tests read:
the folder's format is taken from its meta.json, the start line names LoRA and the trained /
frozen parameter counts, a warmup longer than the run is warned about, no progress-bar frame
reaches the log, the first record keeps the compile out of tokens/s. ``generate --chat`` on the
run prompts with prepare-data's SFT template.
"""

import io
import json

import pytest


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bars_draw_only_on_a_terminal(monkeypatch):
    from ms_deepseek.core.progress import progress_bar

    monkeypatch.delenv("MS_DEEPSEEK_QUIET", raising=False)
    log, tty = io.StringIO(), _Terminal()
    for stream in (log, tty):
        with progress_bar(total=3, file=stream, desc="x") as bar:
            bar.update(3)
    assert log.getvalue() == ""                    # a redirected log gets no \r frames
    assert "\r" in tty.getvalue()                  # a terminal still gets its bar
    off = _Terminal()
    with progress_bar(total=3, file=off, enabled=False) as bar:
        bar.update(3)
    assert off.getvalue() == ""


# ----------------------------------------------------------------------------- small data folders
@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from data_helpers import make_byte_tokenizer, write_jsonl
    from ms_deepseek.data.prepare import prepare_data

    root = tmp_path_factory.mktemp("friction")
    make_byte_tokenizer(root / "tok")
    write_jsonl(root / "pt.jsonl", [{"text": f"doc {i:03d} " + "abcdefg"[: i % 7]} for i in range(60)])
    prepare_data([root / "pt.jsonl"], root / "pt", root / "tok", seq_len=16, progress=False)
    # 120 short conversations: a 1% hold-out is 2 samples, fewer than one micro-batch of 4
    write_jsonl(root / "sft.jsonl", [{"system": "be brief", "prompt": f"q{i:03d}?", "response": "r" * (1 + i % 9)}
                                     for i in range(120)])
    prepare_data([root / "sft.jsonl"], root / "sft", root / "tok", seq_len=48, fmt="sft", progress=False)
    return root


def test_an_sft_folder_needs_no_data_format(folders):
    from ms_deepseek.core.errors import UserError
    from ms_deepseek.data.dataset import build_train_dataset
    from ms_deepseek.spec.data import DataConfig, DataSource

    ds = build_train_dataset(DataConfig(path=str(folders / "sft"), num_workers=1), batch_size=2)
    assert ds.format == "sft" and ds.buckets  # read from meta.json: one conversation per sample, length buckets
    assert build_train_dataset(DataConfig(path=str(folders / "pt"), num_workers=1), batch_size=2).format == "pretrain"
    # an explicit format still wins, and a mismatch is one line naming the key and the folder's format
    with pytest.raises(UserError, match=r"^data.format: 'pretrain' but .*sft was prepared as 'sft' "
                                        r"\(leave data.format out to use the folder's\)$"):
        build_train_dataset(DataConfig(path=str(folders / "sft"), format="pretrain", num_workers=1), batch_size=2)
    # two folders of different formats do not mix, format given or not
    mixed = DataConfig(path=[DataSource(str(folders / "sft")), DataSource(str(folders / "pt"))], num_workers=1)
    with pytest.raises(UserError, match=r"^data.path\[1\]: .*pt was prepared as 'pretrain', data.path\[0\] "
                                        r".*sft as 'sft'; all folders must share one format$"):
        build_train_dataset(mixed, batch_size=2)
    with pytest.raises(UserError, match=r"^data.bucket_boundaries: only used with SFT data, and .*pt was prepared"):
        build_train_dataset(DataConfig(path=str(folders / "pt"), bucket_boundaries=[8], num_workers=1), batch_size=2)
