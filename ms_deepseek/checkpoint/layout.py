"""Which slice of each tensor every rank holds, derived from the plan, and the layout file that records it.

A sharded checkpoint (``rank_RRRRR/`` folders) carries ``layout.json``: for every tensor its
full shape and dtype, its pipeline stage, and MindSpore's own description of a sliced
tensor, a *device matrix* over the stage's ``dp * tp`` devices (row-major, last axis
fastest) and a *tensor map* (per tensor axis: the device-matrix axis that splits it,
counted from the right as in MindSpore's strategy files, ``-1`` = not split). Routed
experts add the expert ids each expert-parallel coordinate holds (the placement table).

Deriving the device matrix (the rule MindSpore's ``ops_info`` applies to the primitive
that consumes the parameter, read from the plan's ``StyleSpec.consumers``):

* ``MatMul(transpose_b)``, x ``(n, c)``, weight ``(o, c)``: device matrix ``(n, c, o)``;
* ``BatchMatMul(transpose_b)``, x ``(b, n, c)``, weight ``(b, o, c)``: ``(b, n, c, o)``; the routed
  experts' 4-D x ``(dp/ep, ep, n, c)`` against ``(ep, o, c)``: ``(dp/ep, ep, n, c, o)``, so the
  expert block of stage device p is ``(p // tp) % ep`` (:mod:`ms_deepseek.parallel_plan.ranks`);
* ``Gather`` of the embedding, table ``(v, 1)``, ids ``(n, 1)``: ``(n, v)`` (vocab fastest,
  as tp is);
* a parameter no primitive consumes (norms, tables) is whole on every rank.

When the strategy uses fewer devices than the stage has, the repeat count is the rightmost
device-matrix axis, as in MindSpore (see :mod:`ms_deepseek.parallel_plan.ranks`). On Ascend the
strategy files that MindSpore writes are the ground truth: :func:`check_strategy_file`
compares them with this layout and names the first tensor that differs.

Global ranks: world = pp x dp x tp, tp fastest; rank r is device ``r % (dp * tp)`` of stage
``r // (dp * tp)``; a tensor lives only on the ranks of its stage.

Optimizer sharding (``parallel.optimizer_shard``) is not a further cut in the files: every
rank's file holds its model-parallel slice. On the device MindSpore's parallel optimizer keeps
only a part of it (axis 0 split over the parameter's optimizer-shard group, weights and
optimizer states alike); :mod:`ms_deepseek.checkpoint.opt_shard` gathers the parts before a
save and cuts them again on load. A layout with optimizer sharding is recorded
(``parallel.optimizer_shard``) so a checkpoint is never resumed under another one without
resharding.

A LoRA run's checkpoint holds only what trains (adapters, and the routers under
``lora.train_router``): its layout lists those tensors (each adapter split like its base
layer, by the plan's adapter rules) and records the adapters in ``lora`` (``r``,
``target_modules``, ``train_router``), so the file names what the rank folders hold.

Pure Python (no MindSpore): ``plan --simulate``, the converter and the tests use it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ms_deepseek.checkpoint.convert.quant_format import is_quantized_weight, quantized_entries
from ms_deepseek.config.inventory import parameter_inventory
from ms_deepseek.config.lora import LoraSpec, lora_inventory
from ms_deepseek.core.dtypes import safetensors_code
from ms_deepseek.core.errors import UserError
from ms_deepseek.core.safe_io import json_loads

LAYOUT_FILE = "layout.json"
RANK_DIR_GLOB = "rank_[0-9][0-9][0-9][0-9][0-9]"
FORMAT = "ms_deepseek.sharded"
VERSION = 1  # every rank folder stores all of its slices
VERSION_DISTINCT = 2  # each distinct slice stored once ("slices": "distinct", convert's pre-sharded output)

Slice = Tuple[object, ...]  # per axis: (start, stop) or a tuple of expert ids (axis 0 of stacked experts)


def rank_dir_name(rank: int) -> str:
    return f"rank_{rank:05d}"


def is_sharded(folder) -> bool:
    """A sharded checkpoint: ``layout.json`` or ``rank_RRRRR/`` folders (the one test of it)."""
    folder = Path(folder)
    return (folder / LAYOUT_FILE).is_file() or any(folder.glob(RANK_DIR_GLOB))


@dataclass(frozen=True)
class TensorLayout:
    name: str
    shape: Tuple[int, ...]
    dtype: str  # safetensors dtype ("BF16", "F32", ...)
    stage: int
    dev_matrix: Tuple[int, ...]  # over the stage's dp * tp devices, last axis fastest
    tensor_map: Tuple[int, ...]  # per tensor axis, device-matrix axis from the right; -1 = whole
    experts: Optional[Tuple[Tuple[int, ...], ...]] = None  # stacked experts: expert ids per axis-0 coordinate

    @property
    def split(self) -> Tuple[int, ...]:
        """Slices per axis."""
        n = len(self.dev_matrix)
        return tuple(1 if m < 0 else self.dev_matrix[n - 1 - m] for m in self.tensor_map)

    def coordinate(self, device: int, axis: int) -> int:
        """The slice index along ``axis`` held by device ``device`` of the stage."""
        m = self.tensor_map[axis]
        if m < 0:
            return 0
        n = len(self.dev_matrix)
        stride = 1
        for size in self.dev_matrix[n - m :]:
            stride *= size
        return (device // stride) % self.dev_matrix[n - 1 - m]

    def slice_of(self, device: int) -> Slice:
        out: List[object] = []
        for axis, (dim, k) in enumerate(zip(self.shape, self.split)):
            c = self.coordinate(device, axis)
            if axis == 0 and self.experts is not None:
                out.append(self.experts[c])
            else:
                out.append((c * (dim // k), (c + 1) * (dim // k)))
        return tuple(out)

    def slice_shape(self) -> Tuple[int, ...]:
        return tuple(d // k for d, k in zip(self.shape, self.split))

    def to_json(self) -> Dict:
        d = {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "stage": self.stage,
            "dev_matrix": list(self.dev_matrix),
            "tensor_map": list(self.tensor_map),
        }
        if self.experts is not None:
            d["experts"] = [list(e) for e in self.experts]
        return d


class ExpertIds(tuple):
    """Expert ids held on axis 0 of a stacked expert tensor (never read as a (start, stop) range)."""


def slice_array(array, sl: Slice):
    """Cut one rank's slice out of a full array (numpy); expert ids on axis 0 pick those experts."""
    import numpy as np

    if sl and isinstance(sl[0], ExpertIds):
        array = array[np.asarray(sl[0], dtype=np.int64)]
        sl = ((0, array.shape[0]),) + tuple(sl[1:])
    return array[tuple(slice(a, b) for a, b in sl)]


@dataclass
class ShardLayout:
    """Every tensor's layout for one parallel configuration, plus the degrees."""

    dp: int
    tp: int
    pp: int
    ep: int
    optimizer_shard: bool
    tensors: Dict[str, TensorLayout]
    # the optimizer file's tensors (adam_m/adam_v like their parameter, scalars on every rank: stage -1)
    optimizer: Optional[Dict[str, TensorLayout]] = None
    # a LoRA checkpoint (layout.json: {"r", "target_modules", "train_router"}); its tensors are what trains
    lora: Optional[LoraSpec] = None
    # True (layout.json "slices": "distinct", version 2): each distinct slice is stored once, in the rank
    # folder of the lowest rank holding it (its owner, as distinct_slices reads it); the ranks that share
    # the slice (dp replicas) hold no copy. False (version 1, training checkpoints): every rank stores all
    # of its slices.
    distinct_only: bool = False
    _owned: Dict[int, List[str]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def stage_devices(self) -> int:
        return self.dp * self.tp

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def describe(self) -> str:
        return f"dp{self.dp} tp{self.tp} pp{self.pp} ep{self.ep}" + (" opt-shard" if self.optimizer_shard else "")

    def for_optimizer(self) -> "ShardLayout":
        """The layout of the optimizer file (same degrees)."""
        return ShardLayout(
            self.dp,
            self.tp,
            self.pp,
            self.ep,
            self.optimizer_shard,
            dict(self.optimizer or {}),
            lora=self.lora,
            distinct_only=self.distinct_only,
        )

    def with_optimizer(self, tensors: Dict[str, Tuple[Tuple[int, ...], str]]) -> "ShardLayout":
        """This layout plus the optimizer file's (name -> (shape, dtype)): ``adam_m.X`` / ``adam_v.X`` are
        sliced like X; everything else (step counter, loss scale) is whole on every rank (stage -1)."""
        opt: Dict[str, TensorLayout] = {}
        for name, (shape, dtype) in tensors.items():
            base = name.split(".", 1)[1] if name.startswith(("adam_m.", "adam_v.")) else None
            t = self.tensors.get(base) if base else None
            if t is not None and tuple(shape) == t.shape:
                opt[name] = TensorLayout(name, t.shape, dtype, t.stage, t.dev_matrix, t.tensor_map, t.experts)
            else:
                opt[name] = TensorLayout(name, tuple(shape), dtype, -1, (self.stage_devices,), tuple(-1 for _ in shape))
        return ShardLayout(
            self.dp, self.tp, self.pp, self.ep, self.optimizer_shard, self.tensors, opt, self.lora, self.distinct_only
        )

    def storing_distinct(self) -> "ShardLayout":
        """This layout with each distinct slice stored once (see :attr:`distinct_only`)."""
        return ShardLayout(
            self.dp, self.tp, self.pp, self.ep, self.optimizer_shard, self.tensors, self.optimizer, self.lora, True
        )

    def stored_in(self, rank: int) -> List[str]:
        """The tensors ``rank``'s file holds: all of its slices, or (distinct_only) those it owns."""
        if not self.distinct_only:
            return self.tensors_of_rank(rank)
        if not self._owned:
            owned: Dict[int, List[str]] = {r: [] for r in range(self.world_size)}
            for name in self.tensors:
                for owner, _ in self.distinct_slices(name):
                    owned[owner].append(name)
            self._owned.update(owned)
        return self._owned[rank]

    def ranks_holding(self, name: str) -> List[int]:
        t = self.tensors[name]
        if t.stage < 0:  # on every rank (optimizer scalars)
            return list(range(self.world_size))
        first = t.stage * self.stage_devices
        return list(range(first, first + self.stage_devices))

    def tensors_of_rank(self, rank: int) -> List[str]:
        stage = rank // self.stage_devices
        return [n for n, t in self.tensors.items() if t.stage in (stage, -1)]

    def slice_of(self, name: str, rank: int) -> Slice:
        return self.tensors[name].slice_of(rank % self.stage_devices)

    def distinct_slices(self, name: str) -> List[Tuple[int, Slice]]:
        """(lowest rank, slice) of every distinct slice of a tensor: enough to rebuild it."""
        seen: Dict[Slice, int] = {}
        for r in self.ranks_holding(name):
            sl = self.slice_of(name, r)
            seen.setdefault(sl, r)
        return [(r, sl) for sl, r in seen.items()]

    def to_json(self) -> Dict:
        return {
            "format": FORMAT,
            "version": VERSION_DISTINCT if self.distinct_only else VERSION,
            **({"slices": "distinct"} if self.distinct_only else {}),
            "world_size": self.world_size,
            "parallel": {
                "dp": self.dp,
                "tp": self.tp,
                "pp": self.pp,
                "ep": self.ep,
                "optimizer_shard": self.optimizer_shard,
            },
            "tensors": {n: t.to_json() for n, t in self.tensors.items()},
            **({"optimizer": {n: t.to_json() for n, t in self.optimizer.items()}} if self.optimizer else {}),
            **({"lora": self.lora.settings()} if self.lora else {}),
        }

    def write(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------- derivation
def _dev_matrix_for(
    spec, suffix: str, layout: Tuple[int, ...], devices: int
) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """(device matrix, tensor map) of a parameter from the primitive that consumes it."""
    consumer = spec.consumers.get(suffix)
    if consumer is None or all(k == 1 for k in layout):
        return (devices,), tuple(-1 for _ in layout)
    attr, index = consumer
    strategies = spec.prims[attr][0]
    if attr == "gather":  # Gather(table (v, 1), ids (n, 1)): device matrix (n, v)
        ids = strategies[1]
        dev = (ids[0], layout[0])
        tmap = (0,) + tuple(-1 for _ in layout[1:])
    elif len(layout) == 2:  # MatMul(transpose_b): x (n, c), w (o, c) -> (n, c, o)
        x = strategies[0]
        dev = (x[0], x[1], layout[0])
        tmap = (0, 1)
    elif len(layout) == 3:  # BatchMatMul(transpose_b): x (..., b, n, c), w (b, o, c) -> (..., b, n, c, o)
        # matmul_info.cc SetDevMatrixShape: x's axes then w's o ([2,4,8,16] x [4,16,32] -> [2,4,8,16,32]);
        # a 4-D x (the MoE's (dp/ep, ep, n, c)) puts its leading axis first, and MatMulBase::InferTensorMap
        # drops that axis from the weight's map: the weight is repeated over dp/ep (ep inside dp)
        x = strategies[0]
        dev = tuple(x) + (layout[1],)
        tmap = (3, 0, 1)
    elif len(layout) == 1:  # a bias added to the matmul output rows x cols: split like the output columns
        x = strategies[0]
        dev = tuple(x)
        tmap = (0,)
    else:
        raise UserError(f"checkpoint layout: no device-matrix rule for a {len(layout)}-axis parameter ({suffix})")
    used = 1
    for d in dev:
        used *= d
    if devices % used:
        raise UserError(f"checkpoint layout: strategy of {suffix} uses {used} devices, not a divisor of {devices}")
    if used < devices:
        dev = dev + (devices // used,)  # repeated devices rightmost, as MindSpore does
        tmap = tuple(m + 1 if m >= 0 else m for m in tmap)
    # axes split 1 way are whole: MindSpore maps them to a size-1 device axis, which is the same
    n = len(dev)
    tmap = tuple(m if m >= 0 and dev[n - 1 - m] > 1 else -1 for m in tmap)
    return dev, tmap


def checkpoint_inventory(cfg, lora: Optional[LoraSpec] = None):
    """The tensors a checkpoint of this model holds (ParamInfo rows): every weight, or under LoRA
    what trains: the adapters (named as model/lora.py names them) and the routers with ``train_router``."""
    rows = [info for info in parameter_inventory(cfg) if not info.is_buffer]
    if lora is None:
        return rows
    return [info for info in lora_inventory(cfg, lora, rows) if info.trainable]


def build_layout(
    cfg, parallel, dtypes: Optional[Dict[str, str]] = None, plan=None, lora=None, quant=None
) -> ShardLayout:
    """Every weight's layout for ``parallel`` (a ParallelConfig), from the plan and the model's name table.

    ``dtypes``: tensor name -> safetensors dtype (default: the config's parameter dtype, routers F32).
    ``lora``: the layout of a LoRA checkpoint (see :func:`checkpoint_inventory`).
    ``quant``: a quantized base (a QuantSpec, ``convert quantize``): each quantized weight becomes its
    stored weight and scale / offset (:func:`quantized_layouts`).
    """
    from ms_deepseek.parallel_plan.plan import Plan, layer_stages, stage_of_param
    from ms_deepseek.parallel_plan.styles import Mesh, style_spec

    plan = plan or Plan()
    mesh = Mesh.from_parallel(parallel)
    devices = parallel.dp * parallel.tp
    stages = layer_stages(cfg.num_hidden_layers, parallel.pp, parallel.stage_layers)
    experts = _experts_of_ranks(cfg, parallel)
    out: Dict[str, TensorLayout] = {}
    for info in checkpoint_inventory(cfg, lora):
        pattern, layout = plan.param_layout(info.name, mesh)
        spec = style_spec(plan.table[pattern], mesh)
        suffix = _suffix_after(pattern, info.name)
        for axis, (dim, k) in enumerate(zip(info.shape, layout)):
            if dim % k:
                raise UserError(
                    f"parallel: {info.name} axis {axis} ({dim}) is not divisible by {k} ({parallel.describe()})"
                )
        dev, tmap = _dev_matrix_for(spec, suffix, layout, devices)
        stacked = info.kind == "routed_experts"
        dtype = (dtypes or {}).get(info.name, safetensors_code(info.dtype))
        t = TensorLayout(
            info.name,
            info.shape,
            dtype,
            stage_of_param(info, parallel.pp, stages),
            dev,
            tmap,
            experts if stacked and tmap[0] >= 0 else None,
        )
        if stacked and t.split[0] != parallel.ep:
            raise UserError(
                f"checkpoint layout: {info.name} splits experts {t.split[0]} ways, parallel.ep is {parallel.ep}"
            )
        if quant is not None and lora is None and is_quantized_weight(info.name) and 0 not in info.shape:
            out.update(quantized_layouts(t, quant, parallel))
        else:
            out[info.name] = t
    return ShardLayout(
        parallel.dp, parallel.tp, parallel.pp, parallel.ep, bool(parallel.optimizer_shard), out, lora=lora
    )


def _experts_of_ranks(cfg, parallel) -> Optional[Tuple[ExpertIds, ...]]:
    """The routed experts each expert-parallel rank holds (the placement table), None without experts."""
    from ms_deepseek.parallel_plan.placement import placement_table

    if not cfg.n_routed_experts:
        return None
    table = placement_table(cfg.n_routed_experts, parallel.ep, parallel.expert_placement)
    return tuple(ExpertIds(int(e) for e in range(cfg.n_routed_experts) if table[e, 0] == r) for r in range(parallel.ep))


def _suffix_after(pattern: str, name: str) -> str:
    """What follows the part of ``name`` the plan's ``pattern`` matched ('' when it matched none)."""
    import re

    rx = re.compile(r"\.".join(r"[^.]+" if p == "*" else re.escape(p) for p in pattern.split(".")))
    match = rx.match(name)
    return name[match.end() + 1 :] if match else ""


def quantized_layouts(t: TensorLayout, quant, parallel) -> Dict[str, TensorLayout]:
    """The layouts of a quantized weight's tensors (checkpoint/convert/quant_format.py), from the float weight's ``t``.

    The stored weight (int8 [.., out, in], or int4 packed [.., out, in/2]) splits like the float one; a
    split of ``in`` must fall on a byte (int4) and on a group boundary (group-wise), else UserError naming
    the tensor. The scale and offset [.., out, in/G] split like the weight's leading and ``out`` axes and,
    group-wise, its ``in`` axis on the groups; a per-channel scale (one group) is whole on that axis, as
    the plan's dequantisation Mul takes it (parallel_plan/styles.py, ``fit_layout``)."""
    entries = quantized_entries(t.name, t.shape, quant)
    (q_name, q_dtype, q_shape), (s_name, _, s_shape), (o_name, _, _) = entries
    k = t.split[-1]  # how many ways the input width splits
    width, groups = t.shape[-1], s_shape[-1]
    if k > 1:
        if quant.bits == 4 and (width // k) % 2:
            raise UserError(
                f"checkpoint layout: {t.name}: a {k}-way split of its input width {width} "
                f"({parallel.describe()}) cuts a byte of int4 pairs"
            )
        if groups > 1 and groups % k:
            raise UserError(
                f"checkpoint layout: {t.name}: a {k}-way split of its input width {width} "
                f"({parallel.describe()}) cuts a scale group of {width // groups} columns"
            )
    s_map = t.tensor_map if groups > 1 else t.tensor_map[:-1] + (-1,)
    return {
        q_name: TensorLayout(q_name, q_shape, q_dtype, t.stage, t.dev_matrix, t.tensor_map, t.experts),
        s_name: TensorLayout(s_name, s_shape, "F32", t.stage, t.dev_matrix, s_map, t.experts),
        o_name: TensorLayout(o_name, s_shape, "F32", t.stage, t.dev_matrix, s_map, t.experts),
    }


def cuts_scale_groups(t: TensorLayout, groups: int) -> bool:
    """A float weight's split of ``in`` cuts a scale group: quantizing each slice alone would give other
    scales than quantizing the whole weight (per channel, ``groups`` 1: any split of ``in`` does)."""
    k = t.split[-1]
    return k > 1 and groups % k != 0


# ---------------------------------------------------------------------------- layout file
def read_layout(folder: Path) -> ShardLayout:
    """``folder/layout.json``, checked for form; UserError naming the file."""
    path = Path(folder) / LAYOUT_FILE
    try:
        data = json_loads(path.read_text(encoding="utf-8"), path)
    except FileNotFoundError:
        raise UserError(
            f"{path}: missing (a sharded checkpoint folder holds rank_RRRRR/ folders and {LAYOUT_FILE})"
        ) from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{path}: not a readable layout file ({exc})") from None
    try:
        version = int(data.get("version", 0))
        if data.get("format") != FORMAT or version not in (VERSION, VERSION_DISTINCT):
            raise ValueError(
                f"format {data.get('format')!r} version {data.get('version')!r}, expected {FORMAT!r} "
                f"version {VERSION} or {VERSION_DISTINCT}"
            )
        if data.get("slices", "distinct" if version == VERSION_DISTINCT else None) != (
            "distinct" if version == VERSION_DISTINCT else None
        ):
            raise ValueError(
                f'"slices": {data.get("slices")!r} does not go with version {version} '
                f'(version {VERSION_DISTINCT} has "slices": "distinct", version {VERSION} none)'
            )
        par = data["parallel"]
        dp, tp, pp, ep = (int(par[k]) for k in ("dp", "tp", "pp", "ep"))
        if min(dp, tp, pp, ep) < 1 or int(data["world_size"]) != dp * tp * pp:
            raise ValueError(f"world_size {data['world_size']} is not dp*tp*pp = {dp * tp * pp}")
        tensors = _read_tensors(data["tensors"], dp, tp, pp)
        optimizer = _read_tensors(data["optimizer"], dp, tp, pp) if data.get("optimizer") else None
        lora = _lora_entry(data.get("lora"))
        return ShardLayout(
            dp,
            tp,
            pp,
            ep,
            bool(par.get("optimizer_shard", False)),
            tensors,
            optimizer,
            lora,
            version == VERSION_DISTINCT,
        )
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:  # int(Infinity): Overflow
        raise UserError(f"{path}: malformed layout file ({exc})") from None


def _lora_entry(entry) -> Optional[LoraSpec]:
    try:
        return LoraSpec.from_settings(entry, "lora")
    except UserError as exc:  # read_layout names the file
        raise ValueError(str(exc)) from None


def _read_tensors(entries: Dict, dp: int, tp: int, pp: int) -> Dict[str, TensorLayout]:
    tensors: Dict[str, TensorLayout] = {}
    for name, t in entries.items():
        shape, dev, tmap = (tuple(int(x) for x in t[k]) for k in ("shape", "dev_matrix", "tensor_map"))
        stage = int(t["stage"])
        prod = 1
        for d in dev:
            prod *= d
        if (
            prod != dp * tp
            or len(tmap) != len(shape)
            or not -1 <= stage < pp
            or any(m >= len(dev) or m < -1 for m in tmap)
        ):
            raise ValueError(
                f"tensor {name}: dev_matrix {list(dev)} / tensor_map {list(tmap)} / stage {stage} "
                f"do not fit dp*tp = {dp * tp} devices, pp = {pp}"
            )
        exp = tuple(ExpertIds(int(e) for e in ids) for ids in t["experts"]) if t.get("experts") else None
        lay = TensorLayout(name, shape, str(t["dtype"]), stage, dev, tmap, exp)
        for axis, (d, k) in enumerate(zip(shape, lay.split)):
            if d % k:
                raise ValueError(f"tensor {name}: axis {axis} ({d}) is not divisible by {k}")
        if exp is None:
            tensors[name] = lay
            continue
        # the ids listed are bounded by this file's size, a declared shape is not: count before ranging
        held = sum(len(ids) for ids in exp)
        if held != shape[0]:
            raise ValueError(
                f"tensor {name}: shape {list(shape)} declares {shape[0]} experts, its experts list places {held}"
            )
        if len(exp) != lay.split[0] or sorted(e for ids in exp for e in ids) != list(range(held)):
            raise ValueError(
                f"tensor {name}: experts {[list(e) for e in exp]} are not a placement of "
                f"{shape[0]} experts over {lay.split[0]} ranks"
            )
        tensors[name] = lay
    return tensors


def check_strategy_file(layout: ShardLayout, strategy_path: Path, rank: int) -> None:
    """A MindSpore strategy file (``strategy.ckpt``, Ascend runs) must agree with the layout file.

    Read with ``mindspore.build_searched_strategy`` (name -> layout with ``dev_matrix`` and
    ``tensor_map``); parameters absent from the layout (optimizer accumulators) are skipped.
    """
    import mindspore as ms

    try:
        strategies = ms.build_searched_strategy(str(strategy_path))
    except Exception as exc:  # MindSpore raises assorted types for damaged files
        raise UserError(f"{strategy_path}: cannot read the strategy file ({str(exc).splitlines()[0]})") from None
    for name, entry in strategies.items():
        plain = name.split("adam_m.")[-1].split("adam_v.")[-1]
        if plain not in layout.tensors:
            continue
        want = layout.tensors[plain]
        dev = tuple(int(x) for x in entry.dev_matrix[0].dim)
        tmap = tuple(int(x) for x in entry.tensor_map[0].dim)
        mine = TensorLayout(plain, want.shape, want.dtype, want.stage, dev, tmap)
        if mine.split != want.split or any(
            mine.slice_of(rank % layout.stage_devices)[a] != want.slice_of(rank % layout.stage_devices)[a]
            for a in range(len(want.shape))
            if want.experts is None or a > 0
        ):
            raise UserError(
                f"{strategy_path}: tensor {name} has dev_matrix {list(dev)} tensor_map {list(tmap)}; "
                f"{LAYOUT_FILE} says {list(want.dev_matrix)} / {list(want.tensor_map)}"
            )
