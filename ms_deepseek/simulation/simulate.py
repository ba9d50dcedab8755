"""``plan --simulate``: check the parts of a sharded layout whose semantics are ours, on CPU.

SEMI_AUTO_PARALLEL cannot compile on a CPU (MindSpore's parallel frontend, ``GetCommInfo``: "Invalid
communication backend: CPU for semi_auto_parallel/auto_parallel mode"), so this module
builds the recipe's model at reduced depth and width with the SAME parallel structure
(:func:`small_config`: the dp / tp / ep / pp degrees, the experts, routing groups and
top-k unchanged, heads / vocabulary / intermediate sizes kept divisible by tp, at least
one layer per pipeline stage, a dense layer where the model has one), applies the plan
to it exactly as training does (``apply_plan``), and runs a registry of checks on it.

Each check returns one :class:`CheckResult` with its max error: a float32 error for the
numerical checks (MoE forward/backward against the unsharded layer), a count of
mismatched rows / parameters / rule violations for the structural ones. A check passes
at ``max_err <= TOLERANCE`` (1e-5); a check whose implementation is not in this build
says "not available" and does not count as a pass.

Registered checks (``CHECKS``, name -> function(ctx) -> CheckResult; add yours with
:func:`register`):

* ``layout``: the validator's rules on the full-size config (divisibility, world, batch);
* ``moe``: every MoE layer through ``ms_deepseek.simulation.moe_layer.simulate_moe_layer``
  (each virtual rank's share of routing, ExpertLookup, dispatch, its local experts, the
  emulated AllToAll and combine, forward and backward, against the unsharded layer);
* ``data``: the rows every rank reads (``data_coordinates`` + the loader's strided rule)
  against the slices MindSpore assumes under the dataset strategy;
* ``stages``: each pipeline stage holds the layers and parameters the plan says;
* ``loader``: each rank's loader slices put together equal the full tensors
  (``ms_deepseek.checkpoint.check_loader_slices``);
* ``lint``: the parallel-rules lint (:mod:`ms_deepseek.parallel_apply.lint`).

Nothing here reads the recipe's checkpoint or data: the config comes from the recipe
(preset or config.json) and the data's shape from its sequence length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.core.errors import UserError
from ms_deepseek.parallel_plan.plan import Mesh, Plan, layer_stages, parameter_inventory, stage_of_param

TOLERANCE = 1e-5
SMALL_SEQ_LEN = 8  # tokens per sequence in the reduced model (the recipe's length, cut)
SMALL_HIDDEN = 32


@dataclass
class CheckResult:
    name: str
    status: str  # "pass" | "fail" | "unavailable"
    max_err: Optional[float] = None  # None when unavailable
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def line(self) -> str:
        if self.status == "unavailable":
            return f"  {self.name:<8} not available  {self.detail}"
        verdict = "ok  " if self.passed else "FAIL"
        err = (
            f"{self.max_err:.3g}"
            if isinstance(self.max_err, float) and not float(self.max_err).is_integer()
            else f"{int(self.max_err)}"
        )
        return f"  {self.name:<8} {verdict} max_err {err:<10} {self.detail}"


def _result(name: str, err: float, detail: str) -> CheckResult:
    return CheckResult(name, "pass" if err <= TOLERANCE else "fail", float(err), detail)


@dataclass
class SimContext:
    """What every check sees: the reduced model with the plan applied, and the layout it stands for."""

    full_cfg: object  # the recipe's model config (full size)
    full_parallel: ParallelConfig
    cfg: object  # the reduced config the model was built from
    parallel: ParallelConfig  # the layout applied to the reduced model (same degrees)
    seq_len: int  # reduced sequence length
    micro_batch_size: int
    plan: Plan
    mesh: Mesh
    model: object = None
    applied: object = None
    apply_error: Optional[str] = None
    seed: int = 0
    full_seq_len: Optional[int] = None  # the recipe's sequence length (the layout rules that read it)


# --------------------------------------------------------------------------- registry
CHECKS: Dict[str, Callable[[SimContext], CheckResult]] = {}


def register(name: str):
    """Decorator: add ``fn(ctx) -> CheckResult`` to the checks ``plan --simulate`` runs (in order)."""

    def wrap(fn):
        CHECKS[name] = fn
        return fn

    return wrap


# ------------------------------------------------------------------- reduced config
def small_config(cfg, parallel: ParallelConfig, seq_len: int) -> Tuple[object, ParallelConfig, int]:
    """(config, layout, sequence length) of the reduced model that keeps the plan's divisibility.

    Kept as is: experts (count, top-k, routing groups, shared experts, capacity factor), the
    MoE layer frequency, the parallel degrees and micro-batches, sequence/vocab parallel.
    Reduced: width (hidden 32, head dims 8/4, ranks 16), heads = max(2, tp) (divisible by tp),
    intermediate sizes 8*tp / 4*tp, vocabulary 64*tp, depth = one layer per pipeline stage
    (at least the dense prefix (at most one layer) + one MoE layer), sequence 8 tokens
    (a multiple of tp under sequence parallel).
    """
    tp, pp = parallel.tp, parallel.pp
    dense = min(cfg.first_k_dense_replace, 1) if cfg.has_moe else 1
    freq = max(1, cfg.moe_layer_freq) if cfg.has_moe else 1
    layers = max(pp, dense + freq if cfg.has_moe else 1)
    heads = tp if tp >= 2 else 2
    seq = min(seq_len, SMALL_SEQ_LEN)
    if parallel.sequence_parallel and seq % tp:
        seq = tp * math.ceil(seq / tp)
    changes = dict(
        hidden_size=SMALL_HIDDEN,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=8 * tp,
        vocab_size=64 * tp,
        kv_lora_rank=16,
        q_lora_rank=None if cfg.q_lora_rank is None else 16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=8,
        v_head_dim=8,
        first_k_dense_replace=dense if cfg.has_moe else cfg.first_k_dense_replace,
        max_position_embeddings=max(cfg.max_position_embeddings, seq),
        compute_dtype="float32",
        param_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if cfg.has_moe:
        changes["moe_intermediate_size"] = 4 * tp
    small = cfg.replace(**changes)
    # stage_layers describes the full depth; the reduced model takes an even cut (one layer or so per stage)
    small_parallel = replace(parallel, stage_layers=None)
    return small, small_parallel, seq


def build_context(
    cfg,
    parallel: ParallelConfig,
    seq_len: int,
    micro_batch_size: int = 1,
    plan: Optional[Plan] = None,
    mesh: Optional[Mesh] = None,
    seed: int = 0,
) -> SimContext:
    """Build the reduced model and apply ``plan`` (default: the project's) for ``parallel``.

    ``mesh`` (tests: a deliberately wrong one) replaces the mesh the checks compare against;
    the model always gets the strategies ``apply_plan`` derives from ``parallel``.
    A plan that ``apply_plan`` refuses is recorded (``apply_error``) and fails the checks that need it.
    """
    import mindspore as ms

    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM
    from ms_deepseek.parallel_apply.apply import apply_plan

    small, small_par, seq = small_config(cfg, parallel, seq_len)
    plan = plan or Plan()
    ctx = SimContext(
        full_cfg=cfg,
        full_parallel=parallel,
        cfg=small,
        parallel=small_par,
        seq_len=seq,
        micro_batch_size=micro_batch_size,
        plan=plan,
        mesh=mesh or Mesh.from_parallel(small_par),
        seed=seed,
        full_seq_len=seq_len,
    )
    ms.set_seed(seed)
    ctx.model = DeepseekV2ForCausalLM(small)
    ctx.model.set_train(True)
    try:
        ctx.applied = apply_plan(ctx.model, small_par, small, plan=plan)
    except UserError as exc:
        ctx.apply_error = str(exc)
    return ctx


def run_checks(ctx: SimContext, names: Optional[Sequence[str]] = None) -> List[CheckResult]:
    out = []
    for name in names or list(CHECKS):
        if name not in CHECKS:
            raise UserError(f"plan --simulate: unknown check {name!r} (known: {', '.join(CHECKS)})")
        out.append(CHECKS[name](ctx))
    return out


def simulate(
    cfg,
    parallel: ParallelConfig,
    seq_len: int,
    micro_batch_size: int = 1,
    plan: Optional[Plan] = None,
    mesh: Optional[Mesh] = None,
    names: Optional[Sequence[str]] = None,
) -> List[CheckResult]:
    """Build the reduced model for ``parallel`` and run the registered checks (see module doc)."""
    ctx = build_context(cfg, parallel, seq_len, micro_batch_size, plan=plan, mesh=mesh)
    return run_checks(ctx, names)


def all_passed(results: Sequence[CheckResult]) -> bool:
    return bool(results) and all(r.passed for r in results)


def format_results(results: Sequence[CheckResult]) -> str:
    lines = ["simulation (CPU, reduced model, same parallel structure; pass at max_err <= 1e-5):"]
    lines += [r.line() for r in results]
    failed = [r.name for r in results if r.status == "fail"]
    missing = [r.name for r in results if r.status == "unavailable"]
    if not failed and not missing:
        lines.append("SIMULATION PASSED")
    else:
        parts = []
        if failed:
            parts.append("failed: " + ", ".join(failed))
        if missing:
            parts.append("not available: " + ", ".join(missing))
        lines.append("SIMULATION DID NOT PASS (" + "; ".join(parts) + ")")
    return "\n".join(lines)


def _apply_refused(ctx: SimContext, name: str) -> Optional[CheckResult]:
    if ctx.apply_error is not None:
        return CheckResult(name, "fail", 1.0, f"apply_plan refused the plan: {ctx.apply_error}")
    return None


# ------------------------------------------------------------------------- checks
@register("layout")
def check_layout(ctx: SimContext) -> CheckResult:
    """The validator's rules on the full-size config (the reduced model inherits the layout)."""
    from ms_deepseek.parallel_plan.validate import layout_problems

    problems = layout_problems(ctx.full_parallel, ctx.full_cfg, seq_len=ctx.full_seq_len)
    problems += [f"reduced model: {p}" for p in layout_problems(ctx.parallel, ctx.cfg, seq_len=ctx.seq_len)]
    return _result(
        "layout",
        len(problems),
        problems[0]
        if problems
        else f"dp{ctx.parallel.dp} tp{ctx.parallel.tp} ep{ctx.parallel.ep} pp{ctx.parallel.pp}, "
        f"reduced model {ctx.cfg.num_hidden_layers} layers, {ctx.cfg.n_routed_experts or 0} experts",
    )


@register("moe")
def check_moe(ctx: SimContext) -> CheckResult:
    """Every MoE layer: the sharded dispatch simulated per virtual rank vs the unsharded layer."""
    failed = _apply_refused(ctx, "moe")
    if failed:
        return failed
    try:
        from ms_deepseek.simulation.moe_layer import simulate_moe_layer
    except ImportError:
        return CheckResult(
            "moe", "unavailable", None, "(ms_deepseek.simulation.moe_layer.simulate_moe_layer is not in this build)"
        )
    import mindspore as ms

    layers = [(i, layer) for i, layer in enumerate(ctx.model.model.layers) if layer.is_moe]
    if not layers:
        return _result("moe", 0.0, "the model has no MoE layer")
    # The sharded semantics of a layer are a function of its strategies and shapes: layers whose
    # applied strategies are identical (the plan's layer-generic patterns) run the same per-rank
    # program, so one of each kind is simulated (every layer when a plan names layers one by one).
    kinds: Dict[tuple, List[int]] = {}
    for i, _ in layers:
        prefix = f"model.layers.{i}.mlp."
        signature = tuple(
            sorted(
                (path[len(prefix) :], repr(strategy))
                for path, strategy in ctx.applied.strategies.items()
                if path.startswith(prefix)
            )
        )
        kinds.setdefault(signature, []).append(i)
    rng = np.random.default_rng(ctx.seed)
    batch = ctx.parallel.dp * ctx.micro_batch_size  # one micro-batch over the dp replicas
    worst, where = 0.0, ""
    for members in kinds.values():
        i = members[0]
        x = ms.Tensor(rng.standard_normal((batch, ctx.seq_len, ctx.cfg.hidden_size)).astype(np.float32))
        try:
            report = simulate_moe_layer(ctx.model.model.layers[i].mlp, x, ctx.mesh)
        except Exception as exc:  # a strategy the simulator cannot even read: a failed check, never a pass
            return CheckResult(
                "moe",
                "fail",
                float("inf"),
                f"layer {i}: the simulation could not run this plan ({type(exc).__name__}: {exc})",
            )
        if report.get("problem"):
            return CheckResult("moe", "fail", float("inf"), f"layer {i}: {report['problem']}")
        fwd, bwd = float(report["forward_max_err"]), float(report["backward_max_err"])
        if max(fwd, bwd) >= worst:
            worst, where = max(fwd, bwd), f"worst layer {i}: forward {fwd:.3g}, backward {bwd:.3g}"
    simulated = ", ".join(
        f"layer {m[0]}" + (f" (for {len(m)} layers with its strategies)" if len(m) > 1 else "") for m in kinds.values()
    )
    return _result(
        "moe", worst, f"{batch}x{ctx.seq_len} tokens, {ctx.parallel.dp} dp ranks; simulated {simulated}; {where}"
    )


def _data_coordinates():
    from ms_deepseek.parallel_plan.ranks import data_coordinates

    return data_coordinates


def _dataset_strategy(parallel: ParallelConfig):
    """What MindSpore is told each rank reads (``auto_parallel_wrap``); plain data parallel splits the batch."""
    from ms_deepseek.parallel_plan.ranks import dataset_strategy

    return dataset_strategy(parallel) if parallel.uses_semi_auto else "data_parallel"


def mindspore_batch_slices(strategy, stage_devices: int, inputs: int = 2) -> Tuple[int, Optional[str]]:
    """How many slices MindSpore cuts the batch axis into under ``dataset_strategy`` (one stage).

    "data_parallel": every device of the stage holds its own slice; "full_batch": one slice;
    per-input strategies ``((s, 1), (s, 1))``: ``s`` slices. Returns (slices, problem or None).
    """
    if strategy == "full_batch":
        return 1, None
    if strategy == "data_parallel":
        return stage_devices, None
    try:
        splits = [tuple(int(k) for k in s) for s in strategy]
    except (TypeError, ValueError):
        return 1, f"dataset_strategy {strategy!r} is neither a mode nor per-input strategies"
    if len(splits) != inputs:
        return 1, f"dataset_strategy {strategy!r} has {len(splits)} entries for {inputs} inputs (input_ids, labels)"
    if len({s[0] for s in splits}) != 1 or any(k != 1 for s in splits for k in s[1:]):
        return 1, f"dataset_strategy {strategy!r}: the inputs must split the batch axis alike and nothing else"
    if stage_devices % splits[0][0]:
        return 1, f"dataset_strategy {strategy!r}: {splits[0][0]} slices do not divide the {stage_devices} devices"
    return splits[0][0], None


def rows_read(data_rank: int, data_world: int, rows: int) -> np.ndarray:
    """Positions (in one step's block of ``data_world * rows`` samples) that loader rank ``data_rank`` reads.

    The loader's rule (ms_deepseek.data.dataset: ``block[rank::world]``, MindDataset's strided sharding).
    """
    return data_rank + data_world * np.arange(rows)


@register("data")
def check_data(ctx: SimContext) -> CheckResult:
    """Rows per rank vs the slices MindSpore assumes: the distinct (dp replica) row blocks cover the
    global batch exactly once, and ranks MindSpore treats as distinct data slices read distinct rows.

    Which slice MindSpore takes each rank's batch for comes from MindSpore itself
    (:func:`ms_deepseek.parallel_plan.ms_oracle.slice_of_rank`: ``mindspore/parallel/_utils.py``
    ``_to_full_tensor``, the dataset's repeat on the left of its device matrix as in
    ``ops_info/virtual_dataset_info.cc``), not from the project's rank rule.
    """
    from ms_deepseek.parallel_plan.ms_oracle import slice_of_rank

    par, mbs = ctx.full_parallel, ctx.micro_batch_size
    coords = _data_coordinates()
    D, world = par.dp * par.tp, par.world_size
    strategy = _dataset_strategy(par)
    slices, problem = mindspore_batch_slices(strategy, D)
    if problem:
        return _result("data", 1, problem)
    global_rows = par.dp * mbs  # one micro-batch over the data-parallel replicas
    errors, first = 0, ""
    for stage in range(par.pp):
        by_slice: Dict[int, np.ndarray] = {}
        for r in range(stage * D, (stage + 1) * D):
            data_rank, data_world, rows = coords(r, par, mbs)
            mine = rows_read(data_rank, data_world, rows)
            if rows * slices != global_rows:
                errors += 1
                first = first or (
                    f"rank {r} reads {rows} rows but MindSpore takes its batch for 1/{slices} of "
                    f"{global_rows} (dataset_strategy {strategy!r})"
                )
            k, _ = slice_of_rank(r, world, par.pp, strategy, rows)
            if k in by_slice and not np.array_equal(by_slice[k], mine):
                errors += 1
                first = first or f"ranks of slice {k} read different rows (rank {r}: {mine.tolist()})"
            by_slice.setdefault(k, mine)
        union = np.concatenate([by_slice[k] for k in sorted(by_slice)])
        counts = np.bincount(union, minlength=global_rows)
        bad = int((counts != 1).sum()) + int((union >= global_rows).sum())
        if bad:
            errors += bad
            dup = np.flatnonzero(counts > 1)
            first = first or (
                f"stage {stage}: {len(dup)} rows read by several distinct slices (e.g. row "
                f"{int(dup[0])}), {int((counts == 0).sum())} rows by none, under dataset_strategy "
                f"{strategy!r} ({slices} slices over {D} devices)"
                if len(dup)
                else f"stage {stage}: {int((counts == 0).sum())} rows of {global_rows} read by no rank"
            )
    return _result(
        "data",
        errors,
        first
        or f"{world} ranks, {slices} MindSpore slices per stage, {global_rows} rows per micro-batch, each read once",
    )


@register("stages")
def check_stages(ctx: SimContext) -> CheckResult:
    """Each pipeline stage holds the layers and parameters the plan says (inventory vs the built cells)."""
    failed = _apply_refused(ctx, "stages")
    if failed:
        return failed
    cfg, par, applied = ctx.cfg, ctx.parallel, ctx.applied
    inventory = {p.name: p for p in parameter_inventory(cfg)}
    built = {p.name: tuple(p.shape) for p in ctx.model.get_parameters()}
    stages = layer_stages(cfg.num_hidden_layers, par.pp, par.stage_layers)
    cells = dict(ctx.model.cells_and_names())
    problems: List[str] = []
    for name in sorted(set(inventory) ^ set(built)):
        problems.append(
            f"parameter {name} is {'built but not in the plan inventory' if name in built else 'in the inventory but not built'}"
        )
    for name, shape in built.items():
        if name in inventory and inventory[name].shape != shape:
            problems.append(f"parameter {name}: built {shape}, inventory {inventory[name].shape}")
    # the stage of every parameter: the innermost staged cell holding it
    owners = sorted(applied.stage_of_cell, key=len, reverse=True)
    for name in built:
        owner = next((c for c in owners if name.startswith(c + ".")), None)
        if owner is None:
            problems.append(f"parameter {name} is under no staged cell")
            continue
        got = applied.stage_of_cell[owner]
        if par.pp > 1 and getattr(cells.get(owner), "pipeline_stage", None) != got:
            problems.append(
                f"cell {owner}: pipeline_stage {getattr(cells.get(owner), 'pipeline_stage', None)} "
                f"but the plan says {got}"
            )
        if name in inventory:
            want = stage_of_param(inventory[name], par.pp, stages)
            if got != want:
                problems.append(f"parameter {name} sits on stage {got}, the plan puts it on stage {want}")
    per_stage = [sum(1 for s in stages if s == k) for k in range(par.pp)]
    if any(n == 0 for n in per_stage):
        problems.append(f"a pipeline stage holds no decoder layer: {per_stage}")
    return _result(
        "stages",
        len(problems),
        problems[0]
        if problems
        else f"{par.pp} stages holding {per_stage} layers, {len(built)} parameters each on its planned stage",
    )


@register("loader")
def check_loader(ctx: SimContext) -> CheckResult:
    """Each rank's loader slices put together equal the full tensors (the checkpoint package's check)."""
    try:
        from ms_deepseek.checkpoint import check_loader_slices
    except ImportError:
        return CheckResult(
            "loader", "unavailable", None, "(ms_deepseek.checkpoint.check_loader_slices is not in this build)"
        )
    err = float(check_loader_slices(ctx.cfg, ctx.parallel))
    return _result("loader", err, f"every rank of {ctx.parallel.world_size} loaded its slices of a random checkpoint")


@register("lint")
def check_lint(ctx: SimContext) -> CheckResult:
    """The parallel-rules lint over the built reduced model with its applied plan."""
    failed = _apply_refused(ctx, "lint")
    if failed:
        return failed
    from ms_deepseek.parallel_apply.lint import lint_model

    report = lint_model(ctx.model, ctx.applied, ctx.mesh)
    problems = report.problems
    return _result(
        "lint",
        len(problems),
        problems[0]
        if problems
        else f"{report.primitives} primitives with strategies, {report.edges} producer->consumer edges "
        f"checked, {report.allowed} listed redistributions",
    )
