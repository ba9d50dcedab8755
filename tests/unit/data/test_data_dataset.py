"""Training batches: DP sharding, seeded shuffling, exact resume, SFT bucketing, load-time checks."""

import json

import numpy as np
import pytest

from ms_deepseek.config.data import DataConfig
from ms_deepseek.core.errors import UserError
from ms_deepseek.data.chat import IGNORE_INDEX
from ms_deepseek.data.dataset import build_train_dataset
from ms_deepseek.data.prepare import prepare_data

from data_helpers import PAD_ID, make_byte_tokenizer, make_sentencepiece, read_rows, write_jsonl


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("dataset")
    make_byte_tokenizer(root / "tok")
    write_jsonl(root / "pt.jsonl", [{"text": f"doc {i:03d} " + "abcdefg"[: i % 7]} for i in range(60)])
    prepare_data([root / "pt.jsonl"], root / "pt", root / "tok", seq_len=16, num_shards=2, progress=False)
    write_jsonl(
        root / "sft.jsonl",
        [{"prompt": f"q{i:03d}" + "?" * (i % 3), "response": "r" * (i * 7 % 50)} for i in range(160)],
    )
    prepare_data([root / "sft.jsonl"], root / "sft", root / "tok", seq_len=64, fmt="sft", num_shards=3, progress=False)
    return root


@pytest.fixture(scope="module")
def pt_rows(folders):
    rows = read_rows(folders / "pt")
    keys = [tuple(r["input_ids"].tolist()) for r in rows]
    assert len(set(keys)) == len(keys)  # every window is unique: batches can be traced back to rows
    return {k: i for i, k in enumerate(keys)}


@pytest.fixture(scope="module")
def sft_rows(folders):
    rows = read_rows(folders / "sft")
    keys = [tuple(r["input_ids"].tolist()) for r in rows]
    assert len(set(keys)) == len(keys)
    return {k: (i, r) for i, (k, r) in enumerate(zip(keys, rows))}


def cfg(folders, name="pt", **kw):
    fmt = "sft" if name == "sft" else "pretrain"
    kw.setdefault("num_workers", 1)
    return DataConfig(path=str(folders / name), format=fmt, **kw)


def take(ds, n):
    it = iter(ds)
    return [next(it) for _ in range(n)]


def ids_of(batch, rows):
    return [rows[tuple(r.tolist())] for r in batch["input_ids"]]


def test_pretrain_batches(folders, pt_rows):
    ds = build_train_dataset(cfg(folders), batch_size=4)
    n = len(pt_rows)
    assert ds.num_samples == n and ds.seq_len == 16 and ds.steps_per_epoch == n // 4
    for batch in take(ds, ds.steps_per_epoch):
        assert set(batch) == {"input_ids", "labels"}
        assert batch["input_ids"].shape == (4, 16) and batch["input_ids"].dtype == np.int32
        assert batch["labels"].dtype == np.int32
        real = batch["labels"] != IGNORE_INDEX
        assert (batch["labels"][real] == batch["input_ids"][real]).all()
        assert (batch["input_ids"][~real] == PAD_ID).all()


def test_dp_ranks_are_disjoint_and_cover_the_epoch(folders, pt_rows):
    ranks = [build_train_dataset(cfg(folders), batch_size=3, rank=r, world_size=2) for r in range(2)]
    steps = ranks[0].steps_per_epoch
    assert steps == len(pt_rows) // 6
    seen = [[ids_of(b, pt_rows) for b in take(ds, steps)] for ds in ranks]
    order = ranks[0].epoch_order(0)
    for s in range(steps):  # each step takes the next 6 positions of the epoch's order
        assert sorted(seen[0][s] + seen[1][s]) == sorted(order[6 * s : 6 * (s + 1)].tolist())
    flat = [set(i for step in per_rank for i in step) for per_rank in seen]
    assert not flat[0] & flat[1]
    assert flat[0] | flat[1] == set(order[: 6 * steps].tolist())
    # Without shuffling, rank r reads rows r, r+2, r+4, ... (MindDataset's own strided layout).
    plain = build_train_dataset(cfg(folders, shuffle=False), batch_size=3, rank=1, world_size=2)
    assert [i for b in take(plain, 2) for i in ids_of(b, pt_rows)] == [1, 3, 5, 7, 9, 11]


@pytest.mark.parametrize("name", ["pt", "sft"])
def test_a_sharded_step_gives_mindspore_the_micro_batches_one_device_reads(folders, pt_rows, sft_rows, name):
    """A sharded rank reads its step as one block (``block_rows`` = k x b), so that MindSpore's view of the step
    (each rank's [k * b, T] input one contiguous block of the global input, ``_to_full_tensor``; micro-batch i the
    global rows [i * W * b, (i + 1) * W * b), ``_MicroBatch``) holds in micro-batch i exactly the rows one device
    reads as its micro-batch i. The strided layout does not: its micro-batch 0 would be rank 0's rows."""
    rows = pt_rows if name == "pt" else {k: v[0] for k, v in sft_rows.items()}
    k, b, world = 2, 2, 2
    one = take(build_train_dataset(cfg(folders, name), batch_size=world * b, static_shapes=True), 2 * k)

    def ids_of(batch, rows):  # a batch's rows by their index in the folder (SFT rows: padded to seq_len)
        keys = [r.tolist() for r in batch["input_ids"]]
        keys = [tuple(key[: len(key) - next(i for i, t in enumerate(reversed(key)) if t != PAD_ID)]) for key in keys]
        return [rows[key] for key in keys]

    def micro_batches(block_rows):
        ranks = [
            build_train_dataset(
                cfg(folders, name), batch_size=b, rank=r, world_size=world, static_shapes=True, block_rows=block_rows
            )
            for r in range(world)
        ]
        steps = [[ids_of(batch, rows) for batch in take(ds, 2 * k)] for ds in ranks]
        out = []
        for s in range(2):
            # the global step input, rank-major (each rank's k micro-batches stacked), cut into k micro-batches
            global_input = [i for r in range(world) for batch in steps[r][s * k : (s + 1) * k] for i in batch]
            out += [sorted(global_input[i * world * b : (i + 1) * world * b]) for i in range(k)]
        return out

    assert micro_batches(k * b) == [sorted(ids_of(batch, rows)) for batch in one]
    assert micro_batches(1) != [sorted(ids_of(batch, rows)) for batch in one]


def test_seeded_shuffle_is_reproducible(folders, pt_rows):
    def run(seed, n, workers=1):
        ds = build_train_dataset(cfg(folders, seed=seed, num_workers=workers), batch_size=4)
        return [ids_of(b, pt_rows) for b in take(ds, n)], ds

    steps = len(pt_rows) // 4
    a, ds = run(7, 2 * steps)
    assert a == run(7, 2 * steps, workers=2)[0]  # reader threads do not change the order
    assert a != run(8, 2 * steps)[0]
    epoch0 = [i for b in a[:steps] for i in b]
    epoch1 = [i for b in a[steps:] for i in b]
    assert epoch0 == ds.epoch_order(0)[: 4 * steps].tolist()
    assert epoch1 == ds.epoch_order(1)[: 4 * steps].tolist()
    assert epoch0 != epoch1 and len(set(epoch0)) == 4 * steps  # a fresh permutation every epoch


def test_exact_resume_pretrain_across_epochs(folders, pt_rows):
    ds = build_train_dataset(cfg(folders), batch_size=4)
    it = iter(ds)
    for _ in range(ds.steps_per_epoch - 2):
        next(it)
    state = json.loads(json.dumps(ds.state_dict()))  # what a checkpoint stores
    expected = [next(it) for _ in range(5)]  # crosses into epoch 1
    resumed = take(build_train_dataset(cfg(folders), batch_size=4, state=state), 5)
    for a, b in zip(expected, resumed):
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
        np.testing.assert_array_equal(a["labels"], b["labels"])


def test_resume_pretrain_with_another_world_size(folders, pt_rows):
    single = build_train_dataset(cfg(folders), batch_size=6)
    it = iter(single)
    for _ in range(3):
        next(it)
    state = single.state_dict()
    nxt = next(it)
    pair = [
        next(iter(build_train_dataset(cfg(folders), batch_size=3, rank=r, world_size=2, state=state))) for r in range(2)
    ]
    assert sorted(ids_of(pair[0], pt_rows) + ids_of(pair[1], pt_rows)) == sorted(ids_of(nxt, pt_rows))


def _check_sft_batch(batch, ds, sft_rows):
    width = batch["input_ids"].shape[1]
    assert width in ds.buckets and batch["labels"].shape == batch["input_ids"].shape
    lower = ([0] + ds.buckets)[ds.buckets.index(width)]
    out = []
    for ids, labels in zip(batch["input_ids"], batch["labels"]):
        real = None
        for n in range(width, 0, -1):  # find the stored row this padded row came from
            if tuple(ids[:n].tolist()) in sft_rows:
                real = n
                break
        index, row = sft_rows[tuple(ids[:real].tolist())]
        assert lower < real <= width  # in the right bucket
        assert (ids[real:] == PAD_ID).all() and (labels[real:] == IGNORE_INDEX).all()
        assert labels[:real].tolist() == row["labels"].tolist()
        out.append(index)
    return out


def test_sft_bucketing_and_sharding(folders, sft_rows):
    ranks = [build_train_dataset(cfg(folders, "sft"), batch_size=4, rank=r, world_size=2) for r in range(2)]
    assert ranks[0].buckets == [32, 64]
    seen = []
    for r, ds in enumerate(ranks):
        n = ds._sft_batches(0)
        batches = take(ds, n)
        assert ds.state_dict()["epoch"] == 0 and ds.state_dict()["batches_in_epoch"] == n
        assert {b["input_ids"].shape[1] for b in batches} == {32, 64}
        ids = [i for b in batches for i in _check_sft_batch(b, ds, sft_rows)]
        assert len(ids) == len(set(ids)) == 4 * n
        mine = set(ds.epoch_order(0)[r::2].tolist())
        assert set(ids) <= mine
        seen.append(set(ids))
    assert not seen[0] & seen[1]


def test_sft_exact_resume_across_epochs(folders, sft_rows):
    c = cfg(folders, "sft", bucket_boundaries=[24, 40])
    ds = build_train_dataset(c, batch_size=3, rank=1, world_size=2)
    assert ds.buckets == [24, 40, 64]
    it = iter(ds)
    first_epoch = ds._sft_batches(0)
    for _ in range(first_epoch - 1):
        next(it)
    state = json.loads(json.dumps(ds.state_dict()))
    expected = [next(it) for _ in range(4)]
    assert ds.state_dict()["epoch"] == 1
    resumed = take(build_train_dataset(c, batch_size=3, rank=1, world_size=2, state=state), 4)
    for a, b in zip(expected, resumed):
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
        np.testing.assert_array_equal(a["labels"], b["labels"])
    with pytest.raises(UserError, match=r"resume: SFT data position was saved with world_size=2, now 1"):
        build_train_dataset(c, batch_size=3, state=state)
    with pytest.raises(UserError, match=r"resume: SFT data position was saved with buckets=\[24, 40, 64\]"):
        build_train_dataset(cfg(folders, "sft"), batch_size=3, rank=1, world_size=2, state=state)


def test_load_time_checks(folders, tmp_path):
    with pytest.raises(UserError, match=r"data.path: .*nothere does not exist"):
        build_train_dataset(DataConfig(path=str(tmp_path / "nothere")), batch_size=2)
    (tmp_path / "junk").mkdir()
    with pytest.raises(UserError, match=r"junk has no meta.json"):
        build_train_dataset(DataConfig(path=str(tmp_path / "junk")), batch_size=2)
    with pytest.raises(UserError, match=r"data.format: 'sft' but .* was prepared as 'pretrain'"):
        build_train_dataset(DataConfig(path=str(folders / "pt"), format="sft"), batch_size=2)
    with pytest.raises(UserError, match=r"data.seq_len: 32 but .* was prepared with seq_len 16"):
        build_train_dataset(cfg(folders, seq_len=32), batch_size=2)
    with pytest.raises(UserError, match=r"longer than the model's max_position_embeddings 8"):
        build_train_dataset(cfg(folders), batch_size=2, max_positions=8)
    with pytest.raises(UserError, match=r"holds token id \d+ but the model's vocab_size is 100"):
        build_train_dataset(cfg(folders), batch_size=2, vocab_size=100)
    build_train_dataset(cfg(folders, tokenizer=str(folders / "tok")), batch_size=2, vocab_size=259)
    other = make_sentencepiece(tmp_path / "other.model")
    with pytest.raises(UserError, match=r"data.tokenizer: .*other.model is not the tokenizer"):
        build_train_dataset(cfg(folders, tokenizer=str(other)), batch_size=2)
    with pytest.raises(UserError, match=r"fewer than one global batch \(40 per rank x 2 ranks\)"):
        build_train_dataset(cfg(folders), batch_size=40, world_size=2)
    state = build_train_dataset(cfg(folders), batch_size=2).state_dict()
    with pytest.raises(UserError, match=r"resume: the data position was saved with seed=1234, now 5"):
        build_train_dataset(cfg(folders, seed=5), batch_size=2, state=state)
    with pytest.raises(UserError, match=r"data.bucket_boundaries: 128 is longer than the data's seq_len 64"):
        build_train_dataset(cfg(folders, "sft", bucket_boundaries=[128]), batch_size=2)
    with pytest.raises(UserError, match=r"rank 1 gets no full batch of 75"):
        build_train_dataset(cfg(folders, "sft"), batch_size=75, rank=1, world_size=2)


def test_embedded_default_is_built_once_and_cached(tmp_path, monkeypatch):
    import threading

    from ms_deepseek.data import prepare

    calls = []
    real = prepare.prepare_embedded_default
    monkeypatch.setattr(prepare, "prepare_embedded_default", lambda *a, **k: calls.append(1) or real(*a, **k))
    c = DataConfig(seq_len=32, embedded_vocab_size=512, embedded_max_bytes=60_000, num_workers=1)
    built = []

    def rank():  # two ranks starting at once: one builds, the other waits and reuses
        built.append(
            build_train_dataset(c, batch_size=2, cache_dir=tmp_path, vocab_size=512, max_positions=32, progress=False)
        )

    threads = [threading.Thread(target=rank) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 2 and len(calls) == 1 and built[0].data_dir == built[1].data_dir
    ds = built[0]
    assert next(iter(ds))["input_ids"].shape == (2, 32)
    meta = ds.data_dir / "meta.json"
    assert ds.data_dir.parent == tmp_path / "data"
    stamp = meta.stat().st_mtime_ns
    again = build_train_dataset(c, batch_size=2, cache_dir=tmp_path, progress=False)
    assert again.data_dir == ds.data_dir and meta.stat().st_mtime_ns == stamp and len(calls) == 1
    assert not [p for p in ds.data_dir.parent.iterdir() if ".tmp-" in p.name]
