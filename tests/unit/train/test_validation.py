"""Validation: held-out split, fixed seeded order, DP shares, val_loss in metrics / TensorBoard / the
step line, an independent recomputation of the logged value, exact resume, and bad inputs."""

import contextlib
import io
import json
import math

import numpy as np
import pytest

from ms_deepseek.cli import main
from ms_deepseek.config.data import DataConfig, ValidationConfig
from ms_deepseek.core.errors import UserError
from ms_deepseek.data.dataset import build_train_dataset
from ms_deepseek.data.validation import build_validation

from builders import SMALL_MODEL, write_recipe


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from ms_deepseek.data.prepare import prepare_embedded_default

    out = tmp_path_factory.mktemp("val") / "corpus"
    prepare_embedded_default(out, seq_len=32, vocab_size=512, max_bytes=60_000, progress=False)
    return out


def rows_of(batch):
    return {tuple(r.tolist()) for r in batch["input_ids"]}


def data_cfg(corpus, **val):
    return DataConfig(path=str(corpus), num_workers=1, validation=ValidationConfig(**(val or {"fraction": 0.1})))


def test_held_out_tail_is_never_trained_on_and_the_order_is_fixed(corpus):
    from data_helpers import read_rows

    rows = [tuple(r["input_ids"].tolist()) for r in read_rows(corpus)]
    n, held = len(rows), math.ceil(0.1 * len(rows))
    train = build_train_dataset(data_cfg(corpus), batch_size=4)
    assert train.num_samples == n - held and train.holdout == held
    seen = set()
    it = iter(train)
    for _ in range(2 * (n - held) // 4 + 2):  # two epochs and a bit
        seen |= rows_of(next(it))
    assert seen == set(rows[: n - held])  # every training sample, none of the tail
    val = build_validation(data_cfg(corpus), 4, 0, 1, eval_batches=2)
    got = set().union(*(rows_of(b) for b in val.batches))
    assert got <= set(rows[n - held :]) and len(got) == 8 and val.total_samples == held
    again = build_validation(data_cfg(corpus), 4, 0, 1, eval_batches=2)
    assert all((a["input_ids"] == b["input_ids"]).all() for a, b in zip(val.batches, again.batches))
    # two data-parallel workers evaluate disjoint halves of the same samples
    shares = [build_validation(data_cfg(corpus), 2, r, 2, eval_batches=2) for r in range(2)]
    halves = [set().union(*(rows_of(b) for b in s.batches)) for s in shares]
    assert not (halves[0] & halves[1]) and halves[0] | halves[1] == got
    # a held-out split that changed cannot resume the training position
    with pytest.raises(UserError, match="held out .* validation samples"):
        build_train_dataset(data_cfg(corpus, fraction=0.2), batch_size=4, state=train.state_dict())


def test_bad_validation_inputs_are_one_line(corpus, tmp_path):
    from ms_deepseek.config.recipe import load_recipe_dict
    from ms_deepseek.core.schema import from_dict
    from ms_deepseek.data.prepare import prepare_embedded_default

    with pytest.raises(UserError, match="set exactly one of path"):
        from_dict(DataConfig, {"validation": {}}, "data")
    with pytest.raises(UserError, match=r"data.validation.fraction: must be in \(0, 0.5\)"):
        from_dict(DataConfig, {"validation": {"fraction": 0.7}}, "data")
    base = {
        "model": {"source": "tiny", "overrides": dict(SMALL_MODEL)},
        "data": {"path": str(corpus)},
        "train": {"eval_interval": 5},
    }
    with pytest.raises(UserError, match="train.eval_interval: validation needs data.validation"):
        load_recipe_dict(base)
    with pytest.raises(UserError, match="fewer than one batch per worker"):
        build_validation(data_cfg(corpus, fraction=0.001), 64, 0, 1, eval_batches=1)
    other = tmp_path / "seq16"
    prepare_embedded_default(other, seq_len=16, vocab_size=512, max_bytes=20_000, progress=False)
    with pytest.raises(UserError, match=r"data.validation.path: .*seq16 was prepared with seq_len 16"):
        build_validation(DataConfig(path=str(corpus), validation=ValidationConfig(path=str(other))), 4, 0, 1, 2)


def _train(recipe, run_dir, *extra):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["train", str(recipe), "--output", str(run_dir), "--quiet", *extra])
    assert code == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus):
    root = tmp_path_factory.mktemp("valrun")
    spec = {
        "model": {"source": "tiny", "overrides": dict(SMALL_MODEL)},
        "data": {"path": str(corpus), "num_workers": 1, "validation": {"fraction": 0.1}},
        "train": {"steps": 4, "micro_batch_size": 4, "seed": 3, "eval_interval": 2, "eval_batches": 2},
        "optim": {"lr": 3e-3, "warmup_steps": 1},
        "checkpoint": {"save_interval": 2, "keep_last": 3},
        "logging": {"log_interval": 3, "tensorboard": True},
    }
    recipe = write_recipe(root, spec)
    stdout = _train(recipe, root / "run")
    return root, recipe, stdout


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_val_loss_is_logged_at_the_interval_and_at_the_end(run):
    root, _, stdout = run
    recs = {r["step"]: r for r in records(root / "run")}
    assert sorted(recs) == [2, 3, 4]  # validation steps are logged even off the log interval
    assert "val_loss" in recs[2] and "val_loss" in recs[4] and "val_loss" not in recs[3]
    for step in (2, 4):
        assert recs[step]["val_ppl"] == pytest.approx(math.exp(recs[step]["val_loss"]), rel=1e-9)
    assert recs[4]["val_loss"] < recs[2]["val_loss"]
    assert "validation: 0.1 of the training data held out: 8 of" in stdout
    assert f"| val {recs[4]['val_loss']:.4f}" in stdout
    events = b"".join(p.read_bytes() for p in (root / "run" / "tb").iterdir())
    assert b"train/val_loss" in events and b"train/val_ppl" in events


def test_logged_val_loss_equals_an_independent_evaluation(run, corpus):
    """The final checkpoint's weights, dropless eval mode, the same 8 samples: the same token-weighted loss."""
    import mindspore as ms

    from ms_deepseek import DeepseekV2ForCausalLM

    root, _, _ = run
    final = {r["step"]: r for r in records(root / "run")}[4]["val_loss"]
    ms.set_context(mode=ms.PYNATIVE_MODE)
    model = DeepseekV2ForCausalLM.from_pretrained(root / "run" / "checkpoints" / "step_00000004", show_progress=False)
    model.set_train(False)
    val = build_validation(data_cfg(corpus), 4, 0, 1, eval_batches=2, seed=1234)
    nll = tokens = 0.0
    for b in val.batches:
        logits = model(ms.Tensor(b["input_ids"])).logits.asnumpy().astype(np.float64)  # [B, T, V]
        lg, tgt = logits[:, :-1], b["labels"][:, 1:]
        lse = np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1)) + lg.max(-1)
        picked = np.take_along_axis(lg, tgt[..., None].astype(np.int64), -1)[..., 0]
        nll += float((lse - picked).sum())
        tokens += tgt.size
    assert final == pytest.approx(nll / tokens, rel=2e-5)


@pytest.mark.slow
def test_resume_keeps_the_validation_set_and_order(run, tmp_path):
    root, recipe, _ = run
    piece = tmp_path / "piece"
    _train(recipe, piece, "--max-steps", "2")
    _train(recipe, piece, "--resume")
    got = {r["step"]: r.get("val_loss") for r in records(piece)}
    want = {r["step"]: r.get("val_loss") for r in records(root / "run")}
    assert got == want


def test_tokens_per_s_leaves_validation_out_and_data_wait_is_logged(tmp_path, corpus, monkeypatch):
    """An evaluation does not show as a throughput dip: tokens/s counts training time only, and every record
    says how long its steps waited for their batches (data_wait_s)."""
    import time

    from ms_deepseek.train import evaluate

    def slow_evaluation(self):
        time.sleep(1.0)  # far longer than a tiny training step
        return {"val_loss": 1.0, "val_ppl": math.e}

    monkeypatch.setattr(evaluate.Evaluator, "__call__", slow_evaluation)
    spec = {
        "model": {"source": "tiny", "overrides": dict(SMALL_MODEL)},
        "data": {"path": str(corpus), "num_workers": 1, "validation": {"fraction": 0.1}},
        "train": {"steps": 4, "micro_batch_size": 4, "seed": 3, "eval_interval": 1, "eval_batches": 1},
        "optim": {"lr": 3e-3, "warmup_steps": 1},
        "checkpoint": {"save_interval": 0, "save_final": False},
        "logging": {"log_interval": 1, "tensorboard": False},
    }
    _train(write_recipe(tmp_path, spec), tmp_path / "run")
    recs = records(tmp_path / "run")
    assert all(r["data_wait_s"] >= 0 for r in recs)
    tokens = 4 * 32  # micro_batch_size x seq_len per step
    for before, rec in zip(recs[1:], recs[2:]):  # one training step and one 1 s evaluation per interval
        wall = rec["elapsed_s"] - before["elapsed_s"]
        assert wall > 1.0 and rec["tokens_per_s"] > 2 * tokens / wall, (rec["tokens_per_s"], tokens / wall)
