"""Rank geometry of a layout: which pipeline stage a rank is in, which rows of the batch it reads.

One rule, used both for what each rank's dataset reads (:func:`data_coordinates`) and for
what MindSpore is told each rank holds (:func:`dataset_strategy`, given to
``set_auto_parallel_context(dataset_strategy=...)`` and ``AutoParallel.dataset_strategy``):

* world = pp stages x (dp x tp) devices per stage, tp fastest: rank ``r`` is in stage
  ``r // (dp * tp)`` at position ``p = r % (dp * tp)`` of it.
* ``dataset_strategy: data_parallel``: the global micro-batch [dp * b, T] is split on the
  batch axis dp ways; position ``p`` holds slice ``p % dp`` (rows ``[s * b, (s + 1) * b)``).
  MindSpore is told that with the per-input strategy ``((dp, 1), (dp, 1))`` (input_ids,
  labels): a strategy that uses dp of the stage's dp * tp devices repeats each slice on tp
  devices, and the dataset's repeat is on the **left** (slowest) of its device matrix
  ``{repeat, dp}``, so slice ``p % dp``: ``ops_info/virtual_dataset_info.cc``
  (``VirtualDatasetInfo::InferDevMatrixShape``: the repeat goes right only when the
  virtual-dataset primitive has ``repeat_dim_direct="right"``, which MindFormers sets only
  for ``dataset_broadcast_opt_level > 0``; we leave MindSpore's default), and the same rule
  in Python, ``mindspore/parallel/_utils.py`` ``_to_full_tensor`` (stage rank r's batch at
  ``(r % dataset_strategy[i][0]) * b``), which the tests and ``plan --simulate`` use as the
  oracle (:mod:`ms_deepseek.parallel_plan.ms_oracle`). The tp peers of a replica (adjacent ranks,
  the tp axis is the fastest of the model's device matrices) therefore read *different*
  slices; MindSpore redistributes the token ids from the dataset's layout to the
  embedding's (a small int32 tensor). Left as MindSpore's own ``"data_parallel"``, it would
  assume the dp * tp devices hold dp * tp *different* slices (each sequence trained on tp
  times, the batch misread as tp times larger).
* ``dataset_strategy: full_batch``: every rank reads the whole global micro-batch
  [dp * b, T]; MindSpore's ``full_batch`` slices it itself.

Pure Python: the CLI's planner and ``plan --simulate`` use it without MindSpore.
"""

from __future__ import annotations

from typing import List, Tuple, Union

from ms_deepseek.config.parallel import ParallelConfig

# The step's dataset inputs: input_ids [k * b, T] and labels [k * b, T].
STEP_INPUTS = 2


def stage_of_rank(rank: int, par: ParallelConfig) -> int:
    """Pipeline stage of a global rank (stages are contiguous blocks of dp * tp ranks)."""
    return rank // (par.dp * par.tp)


def reads_full_batch(par: ParallelConfig) -> bool:
    """Whether every rank reads the whole global micro-batch: ``dataset_strategy: full_batch``, or any layout
    with tp > 1. MindSpore 2.9 compiles a data-parallel dataset strategy that leaves devices of the stage
    to repeats only when it covers the stage: with tp > 1, under ``sharding_propagation``, the tuple form
    ``((dp, 1), ...)`` fails in ``tensor_layout.cc`` (``IsValidTensorLayout``: "the max element in
    tensor_map_origin_ must be smaller than device_arrangement_origin_ size", then "No available strategy
    for: VirtualDatasetInfo"), and a ``Layout`` form is ignored (MindSpore splits the batch over all the
    stage's devices). Found by compiling dp, tp, pp and ep all 2 (``plan --recipe R --compile``). Reading
    the whole micro-batch costs each rank dp x its token ids (a few hundred KB) and MindSpore slices it."""
    return par.dataset_strategy == "full_batch" or par.tp > 1


def batch_slices(par: ParallelConfig) -> int:
    """How many ways the global batch axis is split among the ranks of a stage."""
    return 1 if reads_full_batch(par) else par.dp


def data_slice(rank: int, par: ParallelConfig) -> int:
    """Index of the batch slice a rank holds: stage position ``p`` holds ``p % dp`` (the dataset's repeat
    on the left of its device matrix: virtual_dataset_info.cc, _utils.py ``_to_full_tensor``)."""
    if reads_full_batch(par):
        return 0
    return (rank % (par.dp * par.tp)) % par.dp


def data_coordinates(rank: int, par: ParallelConfig, micro_batch_size: int) -> Tuple[int, int, int]:
    """(data rank, data world, rows per micro-batch read by this rank) for the dataset.

    ``micro_batch_size`` is per data-parallel replica; the global micro-batch is dp times it."""
    slices = batch_slices(par)
    return data_slice(rank, par), slices, micro_batch_size * par.dp // slices


def block_rows(par: ParallelConfig, micro_batch_size: int, micro_batches: int) -> int:
    """How many consecutive positions of the sample stream a rank reads together (``data.batches.rank_positions``):
    its whole step, ``micro_batches`` x its rows, when the batch axis is split and the step has several
    micro-batches, since MindSpore takes a rank's step input as one contiguous block of the global input and cuts
    the micro-batches from that (``_utils.py`` ``_to_full_tensor``, ``cell_wrapper.py`` ``_MicroBatch``); 1 (the
    strided layout) when one micro-batch or the whole batch is read, where both layouts give MindSpore the same
    micro-batches."""
    _, slices, rows = data_coordinates(0, par, micro_batch_size)
    return micro_batches * rows if slices > 1 and micro_batches > 1 else 1


def rows_of_rank(rank: int, par: ParallelConfig, micro_batch_size: int) -> List[int]:
    """Rows of the global micro-batch [dp * b, T] that a rank holds, as MindSpore sees them."""
    _, slices, rows = data_coordinates(rank, par, micro_batch_size)
    start = data_slice(rank, par) * rows
    return list(range(start, start + rows))


def dataset_strategy(par: ParallelConfig, num_inputs: int = STEP_INPUTS) -> Union[str, Tuple[Tuple[int, ...], ...]]:
    """What to tell MindSpore about the step's inputs: ``"full_batch"`` or ``((dp, 1),) * num_inputs``."""
    if reads_full_batch(par):
        return "full_batch"
    return ((batch_slices(par), 1),) * num_inputs


# ------------------------------------------------------------------ expert-parallel groups
# The MoE device matrix orders (dp/ep, ep, tp), ep inside dp, as MindFormers does (``MoEV2._ffn_forward``:
# the buffer [dp, E, C, H] viewed (dp_moe, ep, E, C, H); ``llama_layer.py`` ``_shard_semi_auto_parallel``:
# the expert matmuls ((dp_moe, ep, 1, 1), (ep, mp, 1))). The model's data-parallel index of stage position p
# is p // tp (tp fastest in every model device matrix), so data-parallel rank d = u * ep + e holds experts
# block e = d % ep, and an expert-parallel group is ep consecutive data-parallel ranks, tp global ranks apart.


def exchange_view(dp: int, ep: int) -> Tuple[int, int]:
    """(dp/ep, ep): the split of the data-parallel axis the MoE exchange uses, ep the inner (fast) factor."""
    if ep < 1 or dp % ep:
        raise ValueError(f"ep={ep} does not divide dp={dp}")
    return dp // ep, ep


def expert_block_of_dp_rank(d: int, ep: int) -> int:
    """Experts block (of the ep contiguous blocks of the placement) held by data-parallel rank ``d``."""
    return d % ep


def ep_group_stride(par: ParallelConfig) -> int:
    """Distance in global ranks between two neighbours of one expert-parallel group (the AllToAll's)."""
    return par.tp


def ep_group_of_rank(rank: int, par: ParallelConfig) -> List[int]:
    """The global ranks of ``rank``'s expert-parallel group (the ranks its MoE AllToAll runs over)."""
    devices = par.dp * par.tp
    base, p = rank - rank % devices, rank % devices
    d, t = p // par.tp, p % par.tp
    first = d - expert_block_of_dp_rank(d, par.ep)
    return [base + (first + e) * par.tp + t for e in range(par.ep)]
