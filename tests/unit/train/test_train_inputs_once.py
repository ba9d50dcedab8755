"""A run's data is resolved once: the preflight (``load_run_inputs``) loads the tokenizer and reads every data
folder's meta.json, and the trainer's data (``build_data``: the training batches, the validation set and a
mixture's per-source validation sets) is built from that resolution, with no tokenizer loaded and no metadata
read again."""

from collections import Counter

import pytest

from ms_deepseek.data import sources as sources_module
from ms_deepseek.data import tokenizer as tokenizer_module
from ms_deepseek.data.prepare import prepare_data
from ms_deepseek.train import preflight
from ms_deepseek.train.build import build_data
from ms_deepseek.train.context import RunContext
from ms_deepseek.train.parallelism import DATA_PARALLEL

from builders import SMALL_MODEL, write_recipe
from data_helpers import make_byte_tokenizer, write_jsonl


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    """A recipe over two prepared folders of one byte tokenizer, named by data.tokenizer, 20% of each held out."""
    root = tmp_path_factory.mktemp("inputs")
    tok = make_byte_tokenizer(root / "tok")
    for name in ("a", "b"):
        write_jsonl(root / f"{name}.jsonl", [{"text": f"{name}{i:03d} " + "some text " * (i % 3)} for i in range(40)])
        prepare_data([root / f"{name}.jsonl"], root / name, root / "tok", seq_len=16, progress=False)
    spec = {
        "model": {"source": "tiny", "overrides": dict(SMALL_MODEL, vocab_size=300)},
        "data": {
            "path": [{"path": str(root / "a"), "weight": 0.5}, {"path": str(root / "b"), "weight": 0.5}],
            "tokenizer": str(tok),
            "num_workers": 1,
            "validation": {"fraction": 0.2},
        },
        "train": {"steps": 3, "micro_batch_size": 2, "eval_batches": 1},
    }
    return write_recipe(root / "recipe", spec)


def _counted(monkeypatch, reads: Counter) -> None:
    """Count tokenizer loads (wherever they happen) and meta.json reads (``data.sources.load_meta``)."""
    load_tokenizer, load_meta = tokenizer_module.load_tokenizer, sources_module.load_meta

    def counted_tokenizer(*a, **k):
        reads["tokenizer"] += 1
        return load_tokenizer(*a, **k)

    def counted_meta(*a, **k):
        reads["meta.json"] += 1
        return load_meta(*a, **k)

    monkeypatch.setattr(tokenizer_module, "load_tokenizer", counted_tokenizer)
    monkeypatch.setattr(preflight, "load_tokenizer", counted_tokenizer)
    monkeypatch.setattr(sources_module, "load_meta", counted_meta)


def test_preflight_training_and_validation_share_one_resolution(mixture, tmp_path, monkeypatch):
    reads = Counter()
    _counted(monkeypatch, reads)
    recipe, data = preflight.load_run_inputs(mixture)
    assert reads == Counter({"tokenizer": 1, "meta.json": 2}), reads  # one tokenizer, one read per folder
    built = build_data(RunContext(recipe, tmp_path / "run"), DATA_PARALLEL, False, data)
    built.open()  # the batches from the start, first one read
    assert reads == Counter({"tokenizer": 1, "meta.json": 2}), reads
    # what was built from it: the batches, the held-out set of both folders, and each folder's own
    assert next(built.batches)["input_ids"].shape == (2, 16)
    assert built.validation is not None and built.validation.total_samples > 0
    assert sorted(built.validation_by_source) == ["a", "b"]
