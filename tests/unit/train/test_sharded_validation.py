"""Validation under sharding, on emulated ranks: what can run on CPU.

* each rank reads its rows of every validation batch by the training rule (ranks.data_coordinates),
  checked against MindSpore's own placement (``_utils._to_full_tensor``, parallel_plan/ms_oracle.py): the
  global batches MindSpore assembles are the single worker's batches;
* eval batches are one micro-batch [rows, seq_len] on every rank (static shapes); SFT training
  batches of a sharded run too (no per-rank length buckets); SFT mixtures work and are static;
* the reduction of MindSpore's global-batch losses gives the single worker's token-weighted value,
  also when (without the pipeline's output broadcast) the first stage holds no loss;
* the trainer's own _build_data / Evaluator take these paths for a sharded layout;
* the planner counts the eval graph's dropless MoE buffers; a stated eval capacity makes it fit.
The compiled sharded eval (AutoParallel, Ascend) cannot run here (parallel_apply/apply.eval_parallel_wrap).
"""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ms_deepseek.config.data import DataConfig, DataSource, ValidationConfig
from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.core.errors import UserError
from ms_deepseek.data.chat import IGNORE_INDEX
from ms_deepseek.data.dataset import build_train_dataset
from ms_deepseek.data.prepare import prepare_data
from ms_deepseek.data.validation import build_validation
from ms_deepseek.parallel_plan import ms_oracle
from ms_deepseek.parallel_plan.ranks import data_coordinates, dataset_strategy
from ms_deepseek.train.evaluate import reduce_validation, scored_tokens

from data_helpers import make_byte_tokenizer, write_jsonl
from repo_paths import REPO

SEQ = 64
B = 2  # micro-batch rows per data-parallel replica
# tp 1: each rank reads its own slice (with tp > 1 every rank reads the whole micro-batch, ranks.reads_full_batch,
# because MindSpore refuses the data-parallel dataset strategy there)
LAYOUTS = [ParallelConfig(dp=2, tp=1, pp=2, micro_batches=2), ParallelConfig(dp=4, tp=1, pp=2, ep=2, micro_batches=2)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Two SFT folders (conversations of different lengths) and one pretraining folder, one tokenizer."""
    root = tmp_path_factory.mktemp("shval")
    make_byte_tokenizer(root / "tok")
    for name, n in (("a", 60), ("b", 30)):
        write_jsonl(
            root / f"{name}.jsonl",
            [{"prompt": f"{name}{i}" + "x" * (i % 9), "response": "ok" * (1 + i % 4)} for i in range(n)],
        )
        prepare_data([root / f"{name}.jsonl"], root / name, root / "tok", seq_len=SEQ, fmt="sft", progress=False)
    return root


def _val_cfg(folders, **kw):
    return DataConfig(
        path=str(folders / "a"), format="sft", num_workers=1, validation=ValidationConfig(fraction=0.4), **kw
    )


def _global_batches(par, cfg, eval_batches=3):
    """Per rank: its validation batches; and the global batches MindSpore assembles from them."""
    world = par.world_size
    per_rank = {}
    for rank in range(world):
        r, w, rows = data_coordinates(rank, par, B)
        per_rank[rank] = build_validation(cfg, rows, r, w, eval_batches)
    rows = data_coordinates(0, par, B)[2]
    n = len(per_rank[0].batches)
    stage = par.dp * par.tp
    full = []
    for j in range(n):
        g = np.full((par.dp * B, SEQ), -1, np.int32)
        for rank in range(stage):  # stage 0's ranks; MindSpore's placement of each rank's rows
            start = ms_oracle.batch_row_of_rank(rank, world, par.pp, dataset_strategy(par), rows)
            mine = per_rank[rank].batches[j]["input_ids"]
            block = g[start : start + rows]
            assert (block == -1).all() or (block == mine).all(), "two ranks MindSpore puts together read different rows"
            g[start : start + rows] = mine
        full.append(g)
    return per_rank, full


@pytest.mark.parametrize("par", LAYOUTS, ids=lambda p: p.describe())
def test_each_rank_reads_the_rows_mindspore_assigns_it(folders, par):
    cfg = _val_cfg(folders)
    per_rank, full = _global_batches(par, cfg)
    single = build_validation(cfg, par.dp * B, 0, 1, 3)  # one worker, the global micro-batch
    assert len(full) == len(single.batches) == 3
    for got, ref in zip(full, single.batches):
        assert (got != -1).all()
        # the same samples (row order within a global batch is immaterial to a mean)
        assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, ref["input_ids"].tolist()))
    # every stage reads the same rows as stage 0 (the last stage's labels feed the loss)
    stage = par.dp * par.tp
    for rank in range(stage, par.world_size):
        for a, b in zip(per_rank[rank].batches, per_rank[rank % stage].batches):
            assert (a["labels"] == b["labels"]).all()


@pytest.mark.parametrize("par", LAYOUTS, ids=lambda p: p.describe())
def test_eval_batches_are_one_static_micro_batch_on_every_rank(folders, par):
    per_rank, _ = _global_batches(par, _val_cfg(folders))
    rows = data_coordinates(0, par, B)[2]
    shapes = {b["input_ids"].shape for v in per_rank.values() for b in v.batches}
    assert shapes == {(rows, SEQ)}  # the training micro-batch of one rank: one graph shape


def _fake_nll(ids):
    """A per-token 'loss' that depends on the token (so a wrong reduction shows)."""
    return (ids[:, 1:] % 7).astype(np.float64) + 0.5


def _mean_loss(ids, labels):
    """What the loss computes over a batch: mean of the per-token losses over scored targets."""
    mask = labels[:, 1:] != IGNORE_INDEX
    return float((_fake_nll(ids) * mask).sum() / max(mask.sum(), 1))


@pytest.mark.parametrize("par", LAYOUTS, ids=lambda p: p.describe())
def test_reduction_of_global_losses_is_the_single_workers_value(folders, par):
    cfg = _val_cfg(folders)
    single = build_validation(cfg, par.dp * B, 0, 1, 3)
    ref_num = sum(_mean_loss(b["input_ids"], b["labels"]) * scored_tokens(b["labels"]) for b in single.batches)
    reference = ref_num / sum(scored_tokens(b["labels"]) for b in single.batches)

    per_rank, _ = _global_batches(par, cfg)
    # MindSpore's loss of global batch j: the mean over every slice (labels assembled as MindSpore places them)
    world, rows = par.world_size, data_coordinates(0, par, B)[2]
    glob = []
    for j in range(len(single.batches)):
        ids = np.zeros((par.dp * B, SEQ), np.int32)
        labels = np.zeros((par.dp * B, SEQ), np.int32)
        for rank in range(par.dp * par.tp):
            start = ms_oracle.batch_row_of_rank(rank, world, par.pp, dataset_strategy(par), rows)
            ids[start : start + rows] = per_rank[rank].batches[j]["input_ids"]
            labels[start : start + rows] = per_rank[rank].batches[j]["labels"]
        glob.append(_mean_loss(ids, labels))
    counts = {r: [scored_tokens(b["labels"]) for b in v.batches] for r, v in per_rank.items()}
    total = np.sum([counts[r] for r in range(world)], axis=0).astype(np.float64)  # the AllReduce of counts
    replicas = world // par.dp
    last = range((par.pp - 1) * par.dp * par.tp, world)
    for rank in last:
        assert reduce_validation(glob, counts[rank], lambda v: total, replicas) == pytest.approx(reference, rel=1e-12)
    # Planted mistake: without the pipeline's output broadcast the first stage returns no loss (0 here);
    # the data-parallel reduction (AllReduce of loss x count) mixes it in and is wrong
    stage0 = range(par.dp * par.tp)
    num = sum(float(np.dot(glob if r in last else np.zeros(len(glob)), counts[r])) for r in range(world))
    den = float(total.sum())
    wrong = reduce_validation(glob, counts[list(last)[0]], lambda v: np.asarray([num, den]), None)
    assert len(stage0) and wrong != pytest.approx(reference, rel=1e-3)


def test_sharded_sft_training_batches_have_one_shape(folders):
    cfg = DataConfig(path=str(folders / "a"), format="sft", num_workers=1)

    def shapes(static):
        out = set()
        for r in range(2):  # two data-parallel slices
            it = iter(build_train_dataset(cfg, B, r, 2, static_shapes=static))
            out |= {next(it)["input_ids"].shape for _ in range(6)}
        return out

    assert len(shapes(False)) > 1  # length buckets: ranks would compile different graphs
    assert shapes(True) == {(B, SEQ)}  # what a sharded run reads


def test_sft_mixture_is_allowed_and_static(folders):
    cfg = DataConfig(
        path=[DataSource(str(folders / "a"), 0.6), DataSource(str(folders / "b"), 0.4)],
        format="sft",
        num_workers=1,
        validation=ValidationConfig(fraction=0.2),
    )
    ds = build_train_dataset(cfg, B, 1, 2)
    assert ds.format == "sft"
    it = iter(ds)
    for _ in range(5):
        batch = next(it)
        assert batch["input_ids"].shape == batch["labels"].shape == (B, SEQ)
        pad = batch["labels"] == IGNORE_INDEX
        assert pad.any() and (batch["input_ids"][:, -1] == ds.pad_id).all()  # short conversations padded
    val = build_validation(cfg, B, 1, 2, 2)
    assert {b["input_ids"].shape for b in val.batches} == {(B, SEQ)}
    from ms_deepseek.core.schema import from_dict

    with pytest.raises(UserError, match=r"^data.bucket_boundaries: a weighted mixture pads every sample"):
        from_dict(
            DataConfig, {"path": [{"path": "x"}, {"path": "y"}], "format": "sft", "bucket_boundaries": [16]}, "data"
        )


def _recipe(folders, tmp_path, par, **data):
    from ms_deepseek.config.recipe import load_recipe_dict

    spec = {
        "model": {"source": "tiny"},
        "data": dict(
            {"path": str(folders / "a"), "format": "sft", "num_workers": 1, "validation": {"fraction": 0.4}}, **data
        ),
        "train": {"steps": 2, "micro_batch_size": B, "eval_interval": 1, "eval_batches": 2},
        "parallel": {
            "dp": par.dp,
            "tp": par.tp,
            "pp": par.pp,
            "ep": par.ep,
            "micro_batches": par.micro_batches,
            "force": True,
        },
    }
    return load_recipe_dict(spec, [], str(tmp_path / "r.yaml"))


def _data(recipe, rank):
    """This rank's data as the trainer builds it (``train.build.build_data``) under the sharded layout."""
    from ms_deepseek.train.build import build_data
    from ms_deepseek.train.context import RunContext
    from ms_deepseek.train.parallelism import SHARDED

    return build_data(RunContext(recipe, Path("unused"), rank, recipe.parallel.world_size), SHARDED, False)


def test_trainer_builds_this_ranks_validation_for_a_sharded_layout(folders, tmp_path):
    par = LAYOUTS[1]
    recipe = _recipe(folders, tmp_path, par)
    seen = {}
    for rank in (0, 1, 2, 5):  # slices 0, 1, 2 of stage 0 and a last-stage rank (5 % 4 -> slice 1)
        t = _data(recipe, rank)
        r, w, rows = data_coordinates(rank, par, B)
        ref = build_validation(recipe.data, rows, r, w, 2)
        assert [b["input_ids"].tolist() for b in t.validation.batches] == [b["input_ids"].tolist() for b in ref.batches]
        t.open()
        assert next(t.batches)["input_ids"].shape == (rows, SEQ)  # training SFT batches: static too
        seen[rank] = t.validation.batches[0]["input_ids"].tolist()
    assert seen[5] == seen[1] != seen[0]


def test_trainer_refuses_length_buckets_for_a_sharded_layout(folders, tmp_path):
    recipe = _recipe(folders, tmp_path, LAYOUTS[0], bucket_boundaries=[16])
    from ms_deepseek.train.build import check_layout
    from ms_deepseek.train.parallelism import SHARDED

    # on Ascend: the CPU refusal of sharding comes first otherwise
    with pytest.raises(UserError, match=r"^data.bucket_boundaries: .* padded to seq_len"):
        check_layout(recipe, SHARDED, force=True, device="Ascend")


def test_evaluator_wraps_the_eval_cell_with_the_plan_and_counts_replicas(monkeypatch):
    import mindspore.ops

    import ms_deepseek.parallel_apply.apply as apply_mod
    from ms_deepseek.train.evaluate import Evaluator

    par = LAYOUTS[1]
    wrapped = []
    monkeypatch.setattr(apply_mod, "eval_parallel_wrap", lambda cell, p: wrapped.append(p) or cell)
    monkeypatch.setattr(mindspore.ops, "AllReduce", lambda: None)  # no collective group on CPU
    batch = {"input_ids": np.zeros((2, 4), np.int32), "labels": np.ones((2, 4), np.int32)}
    ev = Evaluator(SimpleNamespace(), [batch], par.world_size, parallel=par)
    assert wrapped == [par] and ev.replicas == par.world_size // par.dp == 2  # the two stages hold each slice
    ev = Evaluator(SimpleNamespace(), [batch], par.world_size)
    assert ev.replicas is None and len(wrapped) == 1


def test_planner_counts_the_eval_graph_and_a_stated_capacity(tmp_path):
    import dataclasses

    from ms_deepseek.config.recipe import load_recipe, planning_config_path
    from ms_deepseek.parallel_plan.costs import GB
    from ms_deepseek.parallel_plan.planner import check_recipe_fits, recipe_workload

    path = REPO / "recipes" / "v2-sft-64npu.yaml"
    recipe = load_recipe(path, [], planning_config_path(path))
    w = recipe_workload(recipe)
    assert w.validation  # the recipe validates
    plain = check_recipe_fits(recipe, workload=dataclasses.replace(w, validation=False))
    stated = check_recipe_fits(recipe)
    assert recipe.model_config.eval_capacity_factor == 4.0 and stated.fits
    assert stated.worst.eval_peak > 0 and plain.worst.eval_peak == 0
    assert stated.peak_gb >= plain.peak_gb
    dropless = load_recipe(path, ["model.overrides.eval_capacity_factor=null"], planning_config_path(path))
    res = check_recipe_fits(dropless)
    assert not res.fits and res.worst.eval_peak > stated.worst.eval_peak
    assert res.worst.total == pytest.approx(stated.worst.total)  # the training step is the same
    assert "eval_capacity_factor" in res.eval_note and res.peak_gb == pytest.approx(res.worst.eval_peak / GB)


def test_moe_layer_evaluates_at_the_stated_capacity():
    from ms_deepseek.config.dispatch_shapes import capacity, dispatch_buffers
    from ms_deepseek.config.model import get_preset
    from ms_deepseek.model.moe import DeepseekV2MoE

    cfg = get_preset("tiny").replace(capacity_factor=1.0, eval_capacity_factor=2.0)
    moe = DeepseekV2MoE(cfg)
    E, k, n = cfg.n_routed_experts, cfg.num_experts_per_tok, 64
    assert capacity(n, k, E, 1.0) < capacity(n, k, E, 2.0) < n  # three different buffers
    moe.set_train(True)
    assert moe.capacity(n) == capacity(n, k, E, 1.0)
    moe.set_train(False)
    assert moe.capacity(n) == capacity(n, k, E, 2.0) == dispatch_buffers(cfg, 1, 1, 1, n, training=False)["capacity"]
    moe.eval_capacity_factor = None  # the default: dropless
    assert (
        moe.capacity(n) == n == dispatch_buffers(cfg.replace(eval_capacity_factor=None), 1, 1, 1, n, False)["capacity"]
    )
