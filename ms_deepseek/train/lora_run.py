"""LoRA runs: the trainer's hooks (the base, the adapters, what a checkpoint holds). ``export-lora`` and the
merge are :mod:`ms_deepseek.model.lora_export`.

A LoRA run trains only the adapters (and the routers with ``lora.train_router``); its
checkpoints hold those tensors and their optimizer state, nothing of the frozen base. The
base is ``model.source`` when that is a checkpoint folder; a random base (``source: tiny``
or a config.json) is written once to ``RUN_DIR/base`` in the HF layout, so resume, export
and ``--merge`` find the same weights again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from ms_deepseek.checkpoint.convert.quant_format import quant_spec_of
from ms_deepseek.checkpoint.opener import open_checkpoint
from ms_deepseek.checkpoint.safetensors_io import write_arrays
from ms_deepseek.checkpoint.slice_readers import to_float32
from ms_deepseek.core.atomic import atomic_folder
from ms_deepseek.core.dtypes import safetensors_code
from ms_deepseek.core.errors import UserError
from ms_deepseek.model.lora_export import BASE_DIR
from ms_deepseek.train.context import ModelSource, RunContext, TrainTensors
from ms_deepseek.train.parallelism import read_weight_slices, this_stage


# ------------------------------------------------------------------------------- trainer hooks
def base_folder(recipe, run_dir: Path) -> Optional[Path]:
    """Where the frozen base's weights are: model.source, else RUN_DIR/base once written (None: random init)."""
    if recipe.weights_folder is not None:
        return recipe.weights_folder
    saved = Path(run_dir) / BASE_DIR
    return saved if (saved / "model.safetensors").is_file() else None


def prepare(
    model,
    recipe,
    run_dir: Path,
    write_base: bool,
    base: Optional[Path] = None,
    sharded: bool = False,
    shapes_only: bool = False,
) -> List[str]:
    """Attach the recipe's adapters, freeze the base; a random base is saved to RUN_DIR/base first.

    With a ``quant:`` section the base is quantized before the adapters go on: a float base (loaded,
    or random and saved unquantized to RUN_DIR/base) in memory, deterministically, so a resumed run
    rebuilds the same one; a quantized ``model.source`` (``convert quantize``) arrives quantized and
    must match the section. ``sharded`` (a tp / pp / ep run, built without allocating): the quantized
    layers are placeholders, whose slices :func:`load_base_slices` reads after the compile.
    ``shapes_only`` (the compile check, ``verification.compile.worker``): no base is read or needed,
    the quantized layers are placeholders whatever the layout, and the adapters are unallocated too."""
    from ms_deepseek.model import lora

    section = recipe.lora
    if shapes_only:
        if recipe.quant is not None:
            _quantized_placeholders(model, recipe.quant, None, need_base=False)
        from mindspore.nn.utils import no_init_parameters

        with no_init_parameters():  # as an Ascend run builds them (exact_dropout: CPU only, see below)
            paths = lora.add_adapters(model, section, seed=recipe.train.seed, exact_dropout=False)
        lora.freeze_base(model, section.train_router)
        return paths
    if sharded and recipe.quant is not None:
        _quantized_placeholders(model, recipe.quant, base)
    elif recipe.quant is not None:
        if write_base:
            save_base(model, Path(run_dir) / BASE_DIR)
        _quantize_base(model, recipe.quant, base)
    elif write_base:
        save_base(model, Path(run_dir) / BASE_DIR)
    if recipe.quant is None and base is not None and quant_spec_of(base) is not None:
        raise UserError(
            f"model.source {base} is quantized (convert quantize); add a quant: section with its "
            "bits and group_size to train LoRA on it"
        )
    # exact dropout (train/resume exactness) on CPU, one device or data parallel; on Ascend and in a sharded
    # layout MindSpore's Dropout kernel, whose random state a resume does not replay: StepDropout's hash needs an
    # index tensor of each input's size, which graph mode folds into a constant per adapter (at V2-Lite width
    # one as large as each expert stack's input, more than the compile check's host holds), and its ops have no
    # sharding strategy
    from ms_deepseek.core.runtime import detect_device

    paths = lora.add_adapters(
        model, section, seed=recipe.train.seed, exact_dropout=not sharded and detect_device() == "CPU"
    )
    lora.freeze_base(model, section.train_router)
    return paths


def _quantize_base(model, spec, base: Optional[Path]) -> None:
    from ms_deepseek.model.quant import is_quantized, quantize_model

    have = quant_spec_of(base) if base is not None else None
    if have is not None:
        if (have.bits, have.group_size) != (spec.bits, spec.group_size):
            raise UserError(
                f"quant: bits {spec.bits}, group_size {spec.group_size}, but model.source {base} is "
                f"quantized with bits {have.bits}, group_size {have.group_size}"
            )
        if not is_quantized(model):
            raise RuntimeError("internal: a quantized source loaded into float layers")
        return
    quantize_model(model, spec)


def _quantized_placeholders(model, spec, base: Optional[Path], need_base: bool = True) -> None:
    """A sharded QLoRA run: the quantized layers, unallocated (no_init_parameters), before the adapters."""
    from mindspore.nn.utils import no_init_parameters

    from ms_deepseek.model.quant import quantize_model

    if base is None and need_base:
        raise UserError(
            "quant: a tp / pp / ep run reads its frozen base from model.source (a checkpoint folder: "
            "`convert quantize` output, or a float one, quantized per rank as it loads)"
        )
    have = quant_spec_of(base) if base is not None else None
    if have is not None and (have.bits, have.group_size) != (spec.bits, spec.group_size):
        raise UserError(
            f"quant: bits {spec.bits}, group_size {spec.group_size}, but model.source {base} is "
            f"quantized with bits {have.bits}, group_size {have.group_size}"
        )
    with no_init_parameters():
        quantize_model(model, spec, from_weights=False)


def load_base_slices(params: Dict[str, object], base: Path, cfg, parallel, spec, rank: int, part=None) -> None:
    """A sharded QLoRA run: this rank's slices of the frozen quantized base (``params``: this stage's).

    From a quantized folder (``convert quantize``, whole or sharded) the stored slices are read as they
    are. From a float folder each weight's float slice is read and quantized here, on the host, which
    gives what ``convert quantize`` writes only when no split of ``in`` cuts a scale group (each group's
    maximum is then within the slice): checked for every weight before anything is read, and refused
    in one line naming the tensor (per channel, one group per row: any split of ``in`` cuts it)."""
    from mindspore import Tensor

    from ms_deepseek.checkpoint.convert.quant_format import is_quantized_weight, stored_array
    from ms_deepseek.checkpoint.layout import build_layout, cuts_scale_groups
    from ms_deepseek.checkpoint.tensors import restore_into

    opened = open_checkpoint(base)
    quantized = build_layout(cfg, parallel, quant=spec)
    if opened.quant is not None:
        restore_into(
            {n: p for n, p in params.items() if n in quantized.tensors},
            opened.model,
            "model",
            layout=quantized,
            rank=rank,
            part=part,
        )
        return
    floats = build_layout(cfg, parallel)
    to_quantize = {
        n: t
        for n, t in floats.tensors.items()
        if is_quantized_weight(n) and 0 not in t.shape and f"{n[: -len('.weight')]}.weight_scale" in params
    }
    for name, t in to_quantize.items():
        groups = quantized.tensors[f"{name[: -len('.weight')]}.weight_scale"].shape[-1]
        if cuts_scale_groups(t, groups):
            raise UserError(
                f"model.source {base}: {name} is split {t.split[-1]} ways on its input width "
                f"{t.shape[-1]} ({parallel.describe()}), which cuts its scale groups of "
                f"{t.shape[-1] // groups} columns; quantizing each slice alone would not give the "
                f"quantized base: run `ms-deepseek convert quantize` first and train on its output"
            )
    kept = {n: p for n, p in params.items() if n in floats.tensors and n not in to_quantize}
    restore_into(kept, opened.model, "model", layout=floats, rank=rank, part=part)
    for name in to_quantize:
        stem = name[: -len(".weight")]
        w = to_float32(opened.model.read(name, floats.slice_of(name, rank)), opened.model.dtype(name))
        stored, scale = stored_array(w, spec)
        for suffix, value in (("weight", stored), ("weight_scale", scale), ("weight_offset", np.zeros_like(scale))):
            param = params[f"{stem}.{suffix}"]
            value = part(param.name, value) if part is not None else value
            param.set_data(Tensor(np.ascontiguousarray(value)), slice_shape=tuple(value.shape) != tuple(param.shape))


def describe(recipe) -> str:
    """The start line's LoRA part: rank, adapted modules, trained and frozen parameter counts (from the
    spec's inventory, so a sharded or quantized run counts its logical parameters) and a quantized base."""
    from ms_deepseek.config.lora import lora_inventory

    spec = recipe.lora
    inventory = lora_inventory(recipe.model_config, spec)
    trained = sum(i.numel for i in inventory if i.trainable and not i.is_buffer)
    frozen = sum(i.numel for i in inventory if not i.trainable and not i.is_buffer)
    modules = sum(1 for i in inventory if i.name.endswith(".lora_A.weight"))
    quant = recipe.quant
    base = (
        ""
        if quant is None
        else (f"; int{quant.bits} base" + (f", groups of {quant.group_size}" if quant.group_size else ", per channel"))
    )
    router = " and the routers" if spec.train_router else ""
    return (
        f"LoRA r={spec.r} alpha={spec.alpha:g} on {modules} modules ({len(spec.target_modules)} targets"
        f"{router}): trains {trained:,} parameters ({100 * trained / max(1, trained + frozen):.2f}%), "
        f"{frozen:,} frozen{base}"
    )


def save_base(model, folder: Path) -> None:
    """The model's weights as an HF folder (per-expert names, the parameters' dtype), written atomically."""
    from ms_deepseek.config import names

    cfg = model.config
    E = cfg.n_routed_experts or 0
    tensors = {}
    for name, p in model.parameters_and_names():
        if name.endswith("expert_placement") or ".lora_" in name:
            continue
        value = _host(p)
        for hf_name, arr in names.unstack(name, value, E):
            tensors[hf_name] = (arr, safetensors_code(cfg.param_dtype))
    with atomic_folder(folder) as tmp:  # the old folder goes only once the new one is in place
        write_arrays(tmp / "model.safetensors", tensors)
        cfg.save(tmp / "config.json", dtype=cfg.param_dtype)


def _host(p) -> np.ndarray:
    import mindspore as ms

    return p.astype(ms.float32).asnumpy() if p.dtype == ms.bfloat16 else p.asnumpy()


# ------------------------------------------------------------------------------- model converters
class FullModel:
    """A full fine-tune or pre-training run: the model as built, every parameter in the checkpoint."""

    def weights_folder(self, recipe, run_dir: Path) -> Optional[Path]:
        return recipe.weights_folder

    def loads_weights(self, resume_dir: Optional[Path]) -> bool:
        """Whether the model is built from the weights folder (a resume reads its checkpoint instead)."""
        return resume_dir is None

    def convert(self, model, ctx: RunContext, source: ModelSource) -> None:
        """Nothing to change."""

    def checkpoint_tensors(self, model) -> Dict[str, object]:
        from ms_deepseek.checkpoint.tensors import model_tensors

        return model_tensors(model)

    def describe(self, recipe) -> Optional[str]:
        return None

    def before_step(self, model, seed: int, step: int, rank: int) -> None:
        """Nothing keyed by the step."""

    def load_slices(self, ctx: RunContext, tensors: TrainTensors, layout, fresh: bool) -> None:
        """Sharded run before a resume or the first step: this rank's slices of the weights folder (``fresh``
        is False when a checkpoint is read after this: a resume reads the checkpoint's slices instead)."""
        if fresh:
            read_weight_slices(ctx, tensors, layout, tensors.model_tensors)


class LoraModel(FullModel):
    """LoRA / QLoRA as a converter of the built model: adapters on a frozen (optionally quantized) base,
    checkpoints of the trainable tensors only, dropout masks keyed by (seed, step, rank)."""

    def __init__(self):
        self.dropout_keyed = False

    def weights_folder(self, recipe, run_dir: Path) -> Optional[Path]:
        return base_folder(recipe, run_dir)

    def loads_weights(self, resume_dir: Optional[Path]) -> bool:
        return True  # the frozen base is loaded on resume too: LoRA checkpoints hold adapters only

    def convert(self, model, ctx: RunContext, source: ModelSource) -> None:
        """Adapters + frozen base; a random base is saved once to RUN_DIR/base (``source.shapes_only``: the
        compile check's unallocated adapters, nothing read or written)."""
        from ms_deepseek.model.lora import dropout_key

        sharded = ctx.par.uses_semi_auto
        prepare(model, ctx.recipe, ctx.run_dir, source.write_base, source.base, sharded, source.shapes_only)
        self.dropout_keyed = dropout_key(model) is not None

    def checkpoint_tensors(self, model) -> Dict[str, object]:
        """What a LoRA checkpoint holds: the trainable tensors (adapters, trained routers)."""
        from ms_deepseek.model.lora import trainable_tensors

        return trainable_tensors(model)

    def describe(self, recipe) -> Optional[str]:
        return describe(recipe)

    def before_step(self, model, seed: int, step: int, rank: int) -> None:
        if self.dropout_keyed:  # LoRA dropout masks keyed by (seed, step, rank): replayed on resume
            from ms_deepseek.model.lora import set_dropout_step

            set_dropout_step(model, seed, step, rank)

    def load_slices(self, ctx: RunContext, tensors: TrainTensors, layout, fresh: bool) -> None:
        """Sharded LoRA run: this rank's slices of the frozen base (a QLoRA run: its quantized tensors, read
        from a quantized model.source or quantized here from a float one: :func:`load_base_slices`); the
        frozen base is never in a LoRA checkpoint, so it is read whether or not one follows."""
        from ms_deepseek.checkpoint.layout import build_layout
        from ms_deepseek.checkpoint.tensors import model_tensors

        recipe = ctx.recipe
        if recipe.quant is None:
            base = build_layout(ctx.cfg, ctx.par)
            read_weight_slices(
                ctx, tensors, base, {n: p for n, p in model_tensors(tensors.model).items() if n in base.tensors}
            )
            return
        quantized = build_layout(ctx.cfg, ctx.par, quant=recipe.quant)
        params = {n: p for n, p in model_tensors(tensors.model).items() if n in quantized.tensors}
        load_base_slices(
            this_stage(params, quantized, ctx.rank, ctx.par),
            base_folder(recipe, ctx.run_dir),
            ctx.cfg,
            ctx.par,
            recipe.quant,
            ctx.rank,
            part=tensors.part,
        )


def model_converter(recipe):
    """The recipe's model converter: :class:`LoraModel` with a ``lora:`` section, else :class:`FullModel`."""
    return LoraModel() if recipe.lora is not None else FullModel()
