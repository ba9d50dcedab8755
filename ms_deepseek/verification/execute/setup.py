"""The set-up of ``plan --execute`` (:mod:`.check`): the reduced copy of a recipe and its ``--set``
options, each rank's batches and the one-device batch, and the slice of a one-device tensor a rank holds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from ms_deepseek.core.errors import UserError
from ms_deepseek.parallel_plan import ranks
from ms_deepseek.verification.dryrun import Reduction, layout_overrides, stage_layers_setting

SEQ_LEN = 64
MAX_RANKS = 8  # the reduced world keeps expert replicas only within this many ranks
# From step 1 (warmup 0): an Adam step moves each weight by about this much, far above the float32 spacing of
# the reduced model's weights, so each step's change is measured to a small fraction of itself
LEARNING_RATE = 1e-3


# ------------------------------------------------------------------------------------- reduction
@dataclass
class ExecReduction:
    """The reduced copy of a recipe that ``--execute`` runs (every value one of the recipe's own or said here)."""

    layout: Dict[str, int]  # dp, tp, pp, ep, micro_batches
    accumulation: int  # grad_accum_steps (pp == 1)
    layers: int
    stage_layers: Optional[List[int]]
    config: Dict[str, object]  # the reduced model's widths
    sft: bool = False  # the recipe trains on SFT data: so does the reduction (the embedded chat corpus)
    notes: List[str] = field(default_factory=list)

    @property
    def world(self) -> int:
        return self.layout["dp"] * self.layout["tp"] * self.layout["pp"]

    def describe(self) -> str:
        lay = self.layout
        k = lay["micro_batches"] if lay["pp"] > 1 else self.accumulation
        what = "pipeline micro-batches" if lay["pp"] > 1 else "accumulation steps"
        return (
            f"dp{lay['dp']} tp{lay['tp']} pp{lay['pp']} ep{lay['ep']} ({self.world} ranks), {self.layers} layers"
            + (f" (stages {'+'.join(map(str, self.stage_layers))})" if self.stage_layers else "")
            + f", {k} {what}, hidden {self.config['hidden_size']}, {self.config['num_attention_heads']} heads, "
            f"{self.config.get('n_routed_experts') or 0} routed experts, vocab {self.config['vocab_size']}, "
            f"seq {SEQ_LEN}, float32"
        )


def _cut(degree: int) -> int:
    return 1 if degree == 1 else 2


def reduce_recipe(recipe) -> ExecReduction:
    """The layout and model ``--execute`` runs for ``recipe`` (module docstring, 1)."""

    par, cfg = recipe.parallel, recipe.model_config
    ep, tp = _cut(par.ep), _cut(par.tp)
    pp = 1 if par.pp == 1 else (2 if par.pp < 4 else 4)
    dp = max(_cut(par.dp), ep)
    if par.dp > par.ep > 1 and 2 * dp * tp * pp <= MAX_RANKS:
        dp *= 2  # the recipe's experts have data-parallel replicas: so do the reduced ones
    world = dp * tp * pp
    if not (world in (1, 2, 4) or world % 8 == 0):  # MindSpore's rule (frontend/parallel/device_manager.cc)
        raise UserError(f"--execute: the reduced layout has {world} ranks; MindSpore needs 1, 2, 4 or a multiple of 8")
    layout = {"dp": dp, "tp": tp, "pp": pp, "ep": ep}
    layout["micro_batches"] = pp + 1 if pp > 1 else 1
    accumulation = min(recipe.train.grad_accum_steps, 2) if pp == 1 else 1
    dense = min(cfg.first_k_dense_replace, cfg.num_hidden_layers) if cfg.has_moe else 0
    layers = dense + max(pp, 1 if cfg.has_moe else 2)  # one MoE layer per stage
    split = Reduction(layers, cfg.num_hidden_layers, 1, 1, "micro_batches", pp=pp, dense_layers=dense).stage_layers
    config = reduced_config(cfg, tp=tp, ep=ep, layers=layers, world=dp * tp * pp)
    sft = recipe.data.format == "sft"
    notes = [
        "float32 compute and master weights",
        "capacity off, no token dropped (which token a full expert drops depends on its place in each side's "
        "buffer, not on the math)",
        f"learning rate {LEARNING_RATE:g} from step 1 ({recipe.optim.schedule} schedule, no warmup)",
        f"the embedded chat corpus at seq_len {SEQ_LEN} (SFT: prompts masked, rows of different lengths, padded)"
        if sft
        else f"the embedded corpus at seq_len {SEQ_LEN}, pretrain packing",
    ]
    if cfg.has_moe and ep > 1:
        notes.append(f"the one-device balance losses over the layout's {ep} expert-parallel device groups")
    if recipe.lora is not None:
        targets = ", ".join(recipe.lora.target_modules)
        notes.append(
            f"LoRA targets kept ({targets}); dropout off on both sides (each device count draws its own masks)"
        )
    return ExecReduction(layout, accumulation, layers, split, config, sft, notes)


def reduced_config(cfg, tp: int, ep: int, layers: int, world: int) -> Dict[str, object]:
    """The recipe's architecture (MLA with or without q compression, YaRN, routing method, shared experts,
    balance losses) at a width every degree divides: heads 2 x tp, experts a multiple of ep and of the routing
    groups with each group able to fill the top-k, vocabulary a multiple of the world."""
    heads = 2 * tp
    out: Dict[str, object] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "kv_lora_rank": 32,
        "q_lora_rank": 48 if cfg.q_lora_rank else None,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "num_hidden_layers": layers,
        "vocab_size": 256 * max(1, math.ceil(world / 8)) * 2,
        "max_position_embeddings": cfg.max_position_embeddings,
    }
    if cfg.has_moe:
        groups = cfg.n_group if cfg.topk_method == "group_limited_greedy" and cfg.n_group else 1
        topk = cfg.num_experts_per_tok
        per_group = max(2, math.ceil(topk / (cfg.topk_group or 1))) if groups > 1 else 1
        experts = math.lcm(ep, groups) * max(
            1, math.ceil(max(2 * ep, groups * per_group, topk + 2) / math.lcm(ep, groups))
        )
        out.update({"n_routed_experts": experts, "moe_intermediate_size": 32})
    return out


def reduced_overrides(red: ExecReduction, weights: Path, recipe, data: Optional[Path] = None) -> List[str]:
    """The ``--set`` options that make the recipe its reduced copy (``red``), reading ``weights`` and the SFT folder
    ``data`` (for an SFT recipe; else the embedded pretraining corpus)."""
    # the parallel section as loaded (plan's --dp / --no-vocab-parallel / ... applied), then the reduced degrees
    sets = layout_overrides(recipe.parallel) + [f"parallel.{k}={v}" for k, v in red.layout.items()]
    sets += [
        "parallel.expert_placement=null",
        stage_layers_setting(red.stage_layers),
        f"train.grad_accum_steps={red.accumulation}",
        f"model.source={weights}",
        "model.overrides.compute_dtype=float32",
        "model.overrides.param_dtype=float32",
        "model.overrides.capacity_factor=null",
        "model.overrides.eval_capacity_factor=null",
        f"data.path={data if red.sft else 'null'}",
        "data.validation=null",
        "train.eval_interval=0",
        f"data.format={'sft' if red.sft else 'pretrain'}",
        f"optim.lr={LEARNING_RATE}",
        "optim.warmup_steps=0",
        f"optim.min_lr={min(recipe.optim.min_lr, LEARNING_RATE)}",
        f"data.seq_len={SEQ_LEN}",
        f"data.embedded_vocab_size={red.config['vocab_size']}",
        "parallel.reserve_memory=false",
    ]
    # the reduced widths as overrides too: a recipe's own overrides would otherwise win over the folder's config
    sets += [f"model.overrides.{k}={'null' if v is None else v}" for k, v in red.config.items()]
    if recipe.lora is not None:
        sets.append("lora.dropout=0.0")
    if recipe.quant is not None:
        sets.append("quant.group_size=16")
    return sets


def single_device_overrides(recipe) -> List[str]:
    """The same run on one device: the global micro-batch (dp x b) per accumulation step, no sharding."""
    par = recipe.parallel
    k = par.micro_batches if par.pp > 1 else recipe.train.grad_accum_steps
    return [
        "parallel.dp=1",
        "parallel.tp=1",
        "parallel.pp=1",
        "parallel.ep=1",
        "parallel.micro_batches=1",
        "parallel.stage_layers=null",
        "parallel.optimizer_shard=false",
        "parallel.sequence_parallel=false",
        "parallel.recompute=none",
        f"train.micro_batch_size={par.dp * recipe.train.micro_batch_size}",
        f"train.grad_accum_steps={k}",
        "train.mode=pynative",  # the same kernels; no compile of the one-device graph
        "model.overrides.use_flash_attention=false",
    ]


# ----------------------------------------------------------------------------------------- batches
Batch = Tuple[np.ndarray, np.ndarray]  # input ids and labels, int32 [rows, T]


def _reads(recipe, rows: int, data_rank: int, world: int, count: int, block: int = 1) -> List[Dict[str, np.ndarray]]:
    """The first ``count`` batches of ``rows`` rows the product's loader gives data-parallel rank ``data_rank`` of
    ``world`` reading ``block`` rows together (``data.dataset.build_train_dataset``, static shapes as under
    SEMI_AUTO_PARALLEL)."""
    from ms_deepseek.data.dataset import build_train_dataset

    cfg = recipe.model_config
    ds = build_train_dataset(
        recipe.data,
        rows,
        data_rank,
        world,
        max_positions=cfg.max_position_embeddings,
        vocab_size=cfg.vocab_size,
        progress=False,
        static_shapes=True,
        block_rows=block,
    )
    it = iter(ds)
    return [next(it) for _ in range(count)]


def _joined(parts: List[Dict[str, np.ndarray]]) -> Batch:
    ids = np.concatenate([p["input_ids"] for p in parts]).astype(np.int32)
    labels = np.concatenate([p["labels"] for p in parts]).astype(np.int32)
    return ids, labels


def accumulation_of(recipe) -> int:
    """Micro-batches per optimizer step: the pipeline's or the accumulation's."""
    par = recipe.parallel
    return par.micro_batches if par.pp > 1 else recipe.train.grad_accum_steps


def rank_batches(recipe, steps: int) -> Dict[int, List[Batch]]:
    """rank -> per step its ``[k * rows, T]`` inputs and labels, read by the product's loader at the rank's data
    coordinates (``parallel_plan.ranks.data_coordinates``, ``block_rows``: as the trainer's ``build_data``),
    micro-batch-major."""
    par = recipe.parallel
    k = accumulation_of(recipe)
    mb = recipe.train.micro_batch_size
    block = ranks.block_rows(par, mb, k)
    coords = {rank: ranks.data_coordinates(rank, par, mb) for rank in range(par.world_size)}
    read = {c: _reads(recipe, c[2], c[0], c[1], steps * k, block) for c in sorted(set(coords.values()))}
    return {rank: [_joined(read[c][s * k : (s + 1) * k]) for s in range(steps)] for rank, c in coords.items()}


def one_device_batches(recipe, steps: int) -> List[Batch]:
    """Per step the ``[k * dp * b, T]`` inputs and labels one device reads: the product's loader at world size 1,
    the global micro-batch (dp x b rows), micro-batch-major. Independent of what the ranks read."""
    k = accumulation_of(recipe)
    rows = recipe.parallel.dp * recipe.train.micro_batch_size
    read = _reads(recipe, rows, 0, 1, steps * k)
    return [_joined(read[s * k : (s + 1) * k]) for s in range(steps)]


def global_rows(recipe, rank: int, rows: int) -> np.ndarray:
    """Where MindSpore puts each of the ``rows`` rows a rank feeds into the stage's global micro-batch, by its own
    rule (``mindspore/parallel/_utils.py`` ``_to_full_tensor``: row ``start = (stage_rank % dataset_strategy) x
    rows``); under ``full_batch`` every rank feeds the whole micro-batch."""
    import mindspore as ms
    from mindspore.parallel._utils import _to_full_tensor

    par = recipe.parallel
    strategy = ranks.dataset_strategy(par)
    if strategy == "full_batch":
        return np.arange(rows)
    saved = {k: ms.get_auto_parallel_context(k) for k in ("dataset_strategy", "pipeline_stages")}
    ms.set_auto_parallel_context(dataset_strategy=strategy, pipeline_stages=par.pp)
    try:
        marker = np.arange(1, rows + 1, dtype=np.int32)[:, None]  # [rows, 1]: row j carries j + 1
        full = _to_full_tensor([marker] * len(strategy), par.world_size, rank)[0].asnumpy()[:, 0]
    finally:
        ms.set_auto_parallel_context(**saved)
    where = np.zeros(rows, np.int64)
    for position, j in enumerate(full):
        if j:
            where[j - 1] = position
    return where


def check_rows(recipe, per_rank: Dict[int, List[Batch]], one_device: List[Batch]) -> List[Tuple[int, int, str]]:
    """The ranks' rows against one device's, per step and micro-batch, as MindSpore assembles them: each rank's
    ``[k * rows, T]`` step input placed in the stage's global ``[k * dp * b, T]`` input (:func:`global_rows`), the
    ranks that MindSpore places at one row holding the same row, every row held, and micro-batch ``i`` cut from the
    global input as rows ``[i * dp * b, (i + 1) * dp * b)`` (``mindspore/nn/wrap/cell_wrapper.py`` ``_MicroBatch``)
    holding exactly the rows one device reads in its micro-batch ``i``. Their order inside a micro-batch may differ
    (the loader's strided layout): a micro-batch's loss is its labelled tokens' sum over their count
    (``model.loss``), its balance losses sum over its tokens or average per sequence, and with capacity off no
    token's place decides its fate, so the step is invariant to that order up to float32 summation order; it is
    not invariant to moving rows between micro-batches (each divides by its own count). Returns (step, rank,
    problem) for each disagreement."""
    k = accumulation_of(recipe)
    width = recipe.parallel.dp * recipe.train.micro_batch_size  # rows of the global micro-batch
    problems: List[Tuple[int, int, str]] = []
    # where each rank's rows go: the same every step (the step input's shape does not change)
    where = {rank: global_rows(recipe, rank, batches[0][0].shape[0]) for rank, batches in per_rank.items()}
    for s, (ids, labels) in enumerate(one_device, start=1):
        placed: Dict[int, Tuple[int, bytes]] = {}
        for rank in sorted(per_rank):
            r_ids, r_labels = per_rank[rank][s - 1]
            mine = _row_keys(r_ids, r_labels)
            for j, position in enumerate(where[rank]):
                other = placed.setdefault(int(position), (rank, mine[j]))
                if other[1] != mine[j]:
                    problems.append(
                        (
                            s,
                            rank,
                            f"ranks {other[0]} and {rank} hold different rows where MindSpore places both at "
                            f"row {position} of the global step input",
                        )
                    )
        missing = sorted(set(range(k * width)) - set(placed))
        if missing:
            problems.append((s, -1, f"no rank holds rows {missing} of the global step input"))
        for i in range(k):
            want = _row_keys(ids[i * width : (i + 1) * width], labels[i * width : (i + 1) * width])
            got = [placed[p] for p in range(i * width, (i + 1) * width) if p in placed]
            keys = [key for _, key in got]
            if sorted(keys) != sorted(want):
                surplus = [r for r, key in got if keys.count(key) > want.count(key)]
                problems.append(
                    (
                        s,
                        surplus[0] if surplus else -1,
                        f"micro-batch {i}: the rows MindSpore cuts from the ranks' "
                        f"inputs are not the rows one device reads ({_multiset_gap(keys, want)}; ranks holding a "
                        f"surplus row: {sorted(set(surplus))})",
                    )
                )
    return problems


def _row_keys(ids: np.ndarray, labels: np.ndarray) -> List[bytes]:
    return [a.tobytes() + b.tobytes() for a, b in zip(ids, labels)]


def _multiset_gap(got: List[bytes], want: List[bytes]) -> str:
    from collections import Counter

    surplus = sum((Counter(got) - Counter(want)).values())
    lacking = sum((Counter(want) - Counter(got)).values())
    return f"{surplus} rows one device does not read, {lacking} of its rows held by no rank"


# ------------------------------------------------------------------------------------------ slices
def slice_for_rank(full: np.ndarray, entry: Dict, rank: int, stage_size: int) -> np.ndarray:
    """What a rank holds of ``full`` by its compiled layout (``parameter_layout_dict``: device matrix, tensor map;
    ``part`` [index, size] of the parallel optimizer), as MindSpore's ``_load_tensor_by_layout`` cuts it for the
    rank's position in its stage (``mindspore/parallel/_tensor.py``)."""
    from mindspore.parallel._tensor import _get_tensor_slice_index, _get_tensor_strategy

    dev_mat, tensor_map = entry["layout"][0], entry["layout"][1]
    value = full
    if tensor_map:
        strategy = _get_tensor_strategy(dev_mat, tensor_map)
        index = int(_get_tensor_slice_index(dev_mat, strategy, tensor_map, rank % stage_size))
        chunks = [value]
        for axis, n in enumerate(strategy):  # row-major over the split axes, as _chunk_tensor_by_strategy
            chunks = [c for block in chunks for c in np.split(block, n, axis=axis)]
        value = chunks[index]
    part = entry.get("part")
    if part:
        index, size = part
        value = np.split(value, size, axis=0)[index]
    return value
