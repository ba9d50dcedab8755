"""Weighted mixtures (data.path as a list): proportions, determinism, DP sharding, exact resume,
per-source counts (dataset, state.json, metrics), and sources that disagree."""

import json

import numpy as np
import pytest

from ms_deepseek.config.data import DataConfig, DataSource
from ms_deepseek.core.errors import UserError
from ms_deepseek.data.dataset import build_train_dataset
from ms_deepseek.data.mixture import CHUNK, MixtureDataset, chunk_counts
from ms_deepseek.data.prepare import prepare_data

from data_helpers import make_byte_tokenizer, make_sentencepiece, write_jsonl


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Three pretraining folders with one byte tokenizer: A (web-like), B (code-like), C (seq 32)."""
    root = tmp_path_factory.mktemp("mix")
    make_byte_tokenizer(root / "tok")
    write_jsonl(root / "a.jsonl", [{"text": f"A{i:03d} " + "web text " * (i % 3)} for i in range(50)])
    write_jsonl(root / "b.jsonl", [{"text": f"B{i:03d} " + "def f(): pass " * (i % 2)} for i in range(20)])
    prepare_data([root / "a.jsonl"], root / "a", root / "tok", seq_len=16, progress=False)
    prepare_data([root / "b.jsonl"], root / "b", root / "tok", seq_len=16, progress=False)
    prepare_data([root / "b.jsonl"], root / "c32", root / "tok", seq_len=32, progress=False)
    sp = make_sentencepiece(root / "sp")
    prepare_data([root / "b.jsonl"], root / "b_sp", sp, seq_len=16, progress=False)
    return root


def mix(folders, wa=0.7, wb=0.3, **kw):
    kw.setdefault("num_workers", 1)
    return DataConfig(path=[DataSource(str(folders / "a"), wa), DataSource(str(folders / "b"), wb)], **kw)


def source_of(row):
    """'A' or 'B' for a window (every window holds its document's tag: A### / B###)."""
    text = bytes(int(t) - 2 for t in row if 2 <= t < 258).decode("latin-1")
    return "A" if any(w in text for w in ("A0", "web", "text")) else "B"


def take(ds, n):
    it = iter(ds)
    return [next(it) for _ in range(n)]


def test_chunk_counts_are_exact_shares():
    assert chunk_counts([0.7, 0.3]).tolist() == [2867, 1229]
    assert chunk_counts([1, 1, 1]).sum() == CHUNK
    assert chunk_counts([5.0, 1.0, 1.0, 1.0]).tolist() == [2560, 512, 512, 512]


def test_proportions_determinism_and_counts(folders):
    ds = build_train_dataset(mix(folders), batch_size=4, seed=7)
    assert isinstance(ds, MixtureDataset)
    src, _ = ds.window_draws(0, CHUNK // 4)  # one whole chunk of positions
    assert np.bincount(src).tolist() == [2867, 1229]  # exactly 0.7 / 0.3
    batches = take(ds, 25)
    drawn = [source_of(r) for b in batches for r in b["input_ids"]]
    assert ds.source_counts == {str(folders / "a"): drawn.count("A"), str(folders / "b"): drawn.count("B")}
    assert 0.5 < drawn.count("A") / len(drawn) < 0.9
    again = take(build_train_dataset(mix(folders), batch_size=4, seed=7), 25)
    assert all((x["input_ids"] == y["input_ids"]).all() for x, y in zip(batches, again))
    other = take(build_train_dataset(mix(folders), batch_size=4, seed=8), 25)
    assert any((x["input_ids"] != y["input_ids"]).any() for x, y in zip(batches, other))


def test_a_source_read_more_than_four_epochs_is_named(folders):
    """A warning at start names a source the run would repeat more than MAX_EPOCHS times."""
    ds = build_train_dataset(mix(folders), batch_size=4, seed=7)
    a, b = ds.num_samples
    # 0.3 of the draws go to b: 4.5 epochs of b, well under 4 of the larger a (the split is the chunk's)
    total = int(4.5 * b / 0.3)
    lines = ds.repeat_warnings(total)
    assert len(lines) == 1 and lines[0].startswith(f"data.path[1]: {folders / 'b'} ({b} samples, weight 0.3)")
    assert "more than 4 epochs" in lines[0]
    assert ds.repeat_warnings(int(3.5 * b / 0.3)) == []


def test_data_parallel_ranks_split_the_same_stream_and_resume_exactly(folders):
    whole = take(build_train_dataset(mix(folders), batch_size=4), 12)
    ranks = [take(build_train_dataset(mix(folders), batch_size=2, rank=r, world_size=2), 12) for r in range(2)]
    for step in range(12):  # rank r holds positions r, r+2 of the step's 4
        got = np.stack(
            [
                ranks[0][step]["input_ids"][0],
                ranks[1][step]["input_ids"][0],
                ranks[0][step]["input_ids"][1],
                ranks[1][step]["input_ids"][1],
            ]
        )
        np.testing.assert_array_equal(got, whole[step]["input_ids"])
    first = build_train_dataset(mix(folders), batch_size=4)
    it = iter(first)
    for _ in range(21):  # past a read window (16 steps) so resume starts mid-window
        next(it)
    state = json.loads(json.dumps(first.state_dict()))  # as state.json stores it
    assert state["source_counts"] == first.source_counts and sum(state["source_counts"].values()) == 21 * 4
    resumed = take(build_train_dataset(mix(folders), batch_size=4, state=state), 5)
    straight = take(build_train_dataset(mix(folders), batch_size=4), 26)[21:]
    for x, y in zip(resumed, straight):
        np.testing.assert_array_equal(x["input_ids"], y["input_ids"])
    with pytest.raises(UserError, match="mixture's data position was saved with weights"):
        build_train_dataset(mix(folders, 0.5, 0.5), batch_size=4, state=state)


def test_sources_that_disagree_are_named(folders):
    def paths(*names):
        return DataConfig(path=[DataSource(str(folders / n), 1.0) for n in names], num_workers=1)

    with pytest.raises(UserError, match=r"^data.path\[1\]: .*c32 was prepared with seq_len 32, data.path\[0\]"):
        build_train_dataset(paths("a", "c32"), batch_size=2)
    with pytest.raises(UserError, match=r"^data.path\[1\]: .*b_sp was prepared with tokenizer .*share one tokenizer"):
        build_train_dataset(paths("a", "b_sp"), batch_size=2)
    with pytest.raises(UserError, match=r"^data.path\[2\]: .*missing does not exist"):
        build_train_dataset(paths("a", "b", "missing"), batch_size=2)
    from ms_deepseek.core.schema import from_dict

    with pytest.raises(UserError, match=r"weight: must be > 0"):
        from_dict(DataConfig, {"path": [{"path": "x", "weight": 0}, {"path": "y"}]}, "data")
    with pytest.raises(UserError, match="listed twice"):
        from_dict(DataConfig, {"path": [{"path": "x"}, {"path": "x"}]}, "data")
    # an SFT mixture is allowed (tests/unit/train/test_sharded_validation.py); length buckets are not
    with pytest.raises(UserError, match="a weighted mixture pads every sample to seq_len"):
        from_dict(
            DataConfig, {"path": [{"path": "x"}, {"path": "y"}], "format": "sft", "bucket_boundaries": [8]}, "data"
        )


@pytest.mark.slow
def test_training_on_a_mixture_counts_samples_per_source(folders, tmp_path):
    """The trainer end to end: per-source counts in metrics.jsonl and state.json, validation from both tails."""
    import contextlib
    import io

    from ms_deepseek.cli import main

    from builders import SMALL_MODEL, write_recipe

    spec = {
        "model": {"source": "tiny", "overrides": dict(SMALL_MODEL, vocab_size=300)},
        "data": {
            "path": [{"path": str(folders / "a"), "weight": 0.7}, {"path": str(folders / "b"), "weight": 0.3}],
            "num_workers": 1,
            "validation": {"fraction": 0.1},
        },
        "train": {"steps": 3, "micro_batch_size": 4, "eval_batches": 1},
        "optim": {"lr": 1e-3},
        "checkpoint": {"save_interval": 0},
        "logging": {"log_interval": 1, "tensorboard": False},
    }
    recipe = write_recipe(tmp_path, spec)
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["train", str(recipe), "--output", str(tmp_path / "run"), "--quiet"]) == 0
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [sum(r["samples_by_source"].values()) for r in recs] == [4, 8, 12]
    state = json.loads((tmp_path / "run" / "checkpoints" / "step_00000003" / "state.json").read_text())
    assert state["data"]["source_counts"] == recs[-1]["samples_by_source"]
    assert "val_loss" in recs[-1]


@pytest.mark.slow
def test_a_mixture_reports_validation_loss_per_source(folders, tmp_path):
    """With data.validation over a weighted mixture, val_loss/<source> is logged beside the
    overall val_loss, each from that source's own held-out tail (one set per source, the same eval graph), and
    the report plots it; a source whose tail is too small for one batch says so instead."""
    import contextlib
    import io
    import math

    from ms_deepseek.cli import main
    from ms_deepseek.config.data import ValidationConfig
    from ms_deepseek.data.validation import build_validation_by_source

    from builders import SMALL_MODEL, write_recipe

    cfg = mix(folders, validation=ValidationConfig(fraction=0.3))
    sets, notes = build_validation_by_source(cfg, 2, 0, 1, eval_batches=2)
    assert sorted(sets) == ["a", "b"] and notes == []
    for name, want in (("a", "A"), ("b", "B")):
        rows = [row for batch in sets[name].batches for row in batch["input_ids"]]
        assert rows and {source_of(row) for row in rows} == {want}, name
    # a source with a tail smaller than one batch per worker: a note, no set
    sets, notes = build_validation_by_source(cfg, 8, 0, 1, eval_batches=2)
    assert "b" not in sets and notes and notes[0].startswith("val_loss/b: not logged: data.path[1] holds out ")

    spec = {
        "model": {"source": "tiny", "overrides": dict(SMALL_MODEL, vocab_size=300)},
        "data": {
            "path": [{"path": str(folders / "a"), "weight": 0.7}, {"path": str(folders / "b"), "weight": 0.3}],
            "num_workers": 1,
            "validation": {"fraction": 0.3},
        },
        "train": {"steps": 2, "micro_batch_size": 2, "eval_batches": 2},
        "optim": {"lr": 1e-3},
        "checkpoint": {"save_interval": 0},
        "logging": {"log_interval": 1, "tensorboard": False},
    }
    recipe = write_recipe(tmp_path, spec)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["train", str(recipe), "--output", str(tmp_path / "run"), "--quiet"]) == 0
    assert "; val_loss/a: 4 of its " in out.getvalue() and "; val_loss/b: 4 of its " in out.getvalue()
    last = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][-1]
    for key in ("val_loss", "val_loss/a", "val_loss/b"):
        assert math.isfinite(last[key]) and last[key] > 0, key
    assert last["val_loss/a"] != last["val_loss/b"]
    assert main(["report", str(tmp_path / "run"), "--out", str(tmp_path / "r.html")]) == 0
    html = (tmp_path / "r.html").read_text()
    assert "validation loss: a" in html and "validation loss: b" in html
