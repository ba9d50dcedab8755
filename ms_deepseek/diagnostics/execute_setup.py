"""The set-up of ``plan --execute`` (:mod:`.execute_check`): the reduced copy of a recipe and its ``--set``
options, each rank's batches and the one-device batch, and the slice of a one-device tensor a rank holds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from ms_deepseek.core.errors import UserError
from ms_deepseek.diagnostics.compile_check import Reduction, layout_overrides, stage_layers_setting
from ms_deepseek.parallel_plan import ranks

SEQ_LEN = 64
MAX_RANKS = 8  # the reduced world keeps expert replicas only within this many ranks


# ------------------------------------------------------------------------------------- reduction
@dataclass
class ExecReduction:
    """The reduced copy of a recipe that ``--execute`` runs (every value one of the recipe's own or said here)."""

    layout: Dict[str, int]  # dp, tp, pp, ep, micro_batches
    accumulation: int  # grad_accum_steps (pp == 1)
    layers: int
    stage_layers: Optional[List[int]]
    config: Dict[str, object]  # the reduced model's widths
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
    notes = [
        "float32 compute and master weights",
        "no token dropped (capacity_factor null on both sides)",
        "the embedded corpus at seq_len 64, pretrain packing",
    ]
    if recipe.lora is not None:
        notes.append("LoRA dropout off on both sides (each device count draws its own masks)")
    return ExecReduction(layout, accumulation, layers, split, config, notes)


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


def reduced_overrides(red: ExecReduction, weights: Path, recipe) -> List[str]:
    """The ``--set`` options that make the recipe its reduced copy (``red``), reading ``weights``."""
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
        "data.path=null",
        "data.validation=null",
        "train.eval_interval=0",
        "data.format=pretrain",
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
def rank_batches(recipe, steps: int) -> Tuple[Dict[int, List[Tuple[np.ndarray, np.ndarray]]], List[Tuple]]:
    """(rank -> per step its ``[k * rows, T]`` inputs and labels from the product's loader, per step the global
    ``[k * dp * b, T]`` pair one device reads: micro-batch ``i`` is every data slice's micro-batch ``i``)."""
    from ms_deepseek.data.dataset import build_train_dataset

    par, cfg = recipe.parallel, recipe.model_config
    k = par.micro_batches if par.pp > 1 else recipe.train.grad_accum_steps
    mb = recipe.train.micro_batch_size
    coords = {rank: ranks.data_coordinates(rank, par, mb) for rank in range(par.world_size)}
    slices = {c[1] for c in coords.values()}.pop()
    read: Dict[int, List[Dict]] = {}
    for data_rank, world, rows in sorted(set(coords.values())):
        ds = build_train_dataset(
            recipe.data,
            rows,
            data_rank,
            world,
            max_positions=cfg.max_position_embeddings,
            vocab_size=cfg.vocab_size,
            progress=False,
            static_shapes=True,
        )
        it = iter(ds)
        read[data_rank] = [next(it) for _ in range(steps * k)]
    per_rank = {}
    for rank, (data_rank, _, _) in coords.items():
        parts = read[data_rank]
        per_rank[rank] = [
            (
                np.concatenate([p["input_ids"] for p in parts[s * k : (s + 1) * k]]).astype(np.int32),
                np.concatenate([p["labels"] for p in parts[s * k : (s + 1) * k]]).astype(np.int32),
            )
            for s in range(steps)
        ]
    global_steps = []
    for s in range(steps):
        micro = [[read[d][s * k + i] for d in range(slices)] for i in range(k)]
        ids = np.concatenate([p["input_ids"] for group in micro for p in group]).astype(np.int32)
        labels = np.concatenate([p["labels"] for group in micro for p in group]).astype(np.int32)
        global_steps.append((ids, labels))
    return per_rank, global_steps


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
