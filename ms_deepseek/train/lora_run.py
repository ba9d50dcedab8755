"""LoRA runs: the trainer's hooks, and ``export-lora`` (PEFT folder, or a merged HF folder).

A LoRA run trains only the adapters (and the routers with ``lora.train_router``); its
checkpoints hold those tensors and their optimizer state, nothing of the frozen base. The
base is ``model.source`` when that is a checkpoint folder; a random base (``source: tiny``
or a config.json) is written once to ``RUN_DIR/base`` in the HF layout, so resume, export
and ``--merge`` find the same weights again.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from ms_deepseek.checkpoint.layout import is_sharded
from ms_deepseek.checkpoint.opener import open_checkpoint
from ms_deepseek.checkpoint.quant_format import quant_spec_of
from ms_deepseek.checkpoint.safetensors_io import encode_array, write_arrays
from ms_deepseek.checkpoint.sources import full_slice, to_float32
from ms_deepseek.core.atomic import atomic_folder, check_apart, check_destination
from ms_deepseek.core.dtypes import safetensors_code
from ms_deepseek.core.errors import UserError
from ms_deepseek.model.loading import read_tensor
from ms_deepseek.spec.lora import LoraSpec

BASE_DIR = "base"


# ------------------------------------------------------------------------------- trainer hooks
def base_folder(recipe, run_dir: Path) -> Optional[Path]:
    """Where the frozen base's weights are: model.source, else RUN_DIR/base once written (None: random init)."""
    if recipe.weights_folder is not None:
        return recipe.weights_folder
    saved = Path(run_dir) / BASE_DIR
    return saved if (saved / "model.safetensors").is_file() else None


def prepare(model, recipe, run_dir: Path, write_base: bool, base: Optional[Path] = None,
            sharded: bool = False, shapes_only: bool = False) -> List[str]:
    """Attach the recipe's adapters, freeze the base; a random base is saved to RUN_DIR/base first.

    With a ``quant:`` section the base is quantized before the adapters go on: a float base (loaded,
    or random and saved unquantized to RUN_DIR/base) in memory, deterministically, so a resumed run
    rebuilds the same one; a quantized ``model.source`` (``convert quantize``) arrives quantized and
    must match the section. ``sharded`` (a tp / pp / ep run, built without allocating): the quantized
    layers are placeholders, whose slices :func:`load_base_slices` reads after the compile.
    ``shapes_only`` (the compile check, ``diagnostics.compile_worker``): no base is read or needed,
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
        raise UserError(f"model.source {base} is quantized (convert quantize); add a quant: section with its "
                        "bits and group_size to train LoRA on it")
    # exact dropout (train/resume exactness) on CPU, one device or data parallel; on Ascend and in a sharded
    # layout MindSpore's Dropout kernel, whose random state a resume does not replay: StepDropout's hash needs an
    # index tensor of each input's size, which graph mode folds into a constant per adapter (at V2-Lite width
    # hundreds of MB per expert stack: the compile check's 1-NPU LoRA compile was killed at 21 GB of host
    # memory), and its ops have no sharding strategy yet
    from ms_deepseek.core.runtime import detect_device

    paths = lora.add_adapters(model, section, seed=recipe.train.seed,
                              exact_dropout=not sharded and detect_device() == "CPU")
    lora.freeze_base(model, section.train_router)
    return paths


def _quantize_base(model, spec, base: Optional[Path]) -> None:
    from ms_deepseek.model.quant import is_quantized, quantize_model

    have = quant_spec_of(base) if base is not None else None
    if have is not None:
        if (have.bits, have.group_size) != (spec.bits, spec.group_size):
            raise UserError(f"quant: bits {spec.bits}, group_size {spec.group_size}, but model.source {base} is "
                            f"quantized with bits {have.bits}, group_size {have.group_size}")
        if not is_quantized(model):
            raise RuntimeError("internal: a quantized source loaded into float layers")
        return
    quantize_model(model, spec)


def _quantized_placeholders(model, spec, base: Optional[Path], need_base: bool = True) -> None:
    """A sharded QLoRA run: the quantized layers, unallocated (no_init_parameters), before the adapters."""
    from mindspore.nn.utils import no_init_parameters

    from ms_deepseek.model.quant import quantize_model

    if base is None and need_base:
        raise UserError("quant: a tp / pp / ep run reads its frozen base from model.source (a checkpoint folder: "
                        "`convert quantize` output, or a float one, quantized per rank as it loads)")
    have = quant_spec_of(base) if base is not None else None
    if have is not None and (have.bits, have.group_size) != (spec.bits, spec.group_size):
        raise UserError(f"quant: bits {spec.bits}, group_size {spec.group_size}, but model.source {base} is "
                        f"quantized with bits {have.bits}, group_size {have.group_size}")
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

    from ms_deepseek.checkpoint.layout import build_layout, cuts_scale_groups
    from ms_deepseek.checkpoint.quant_format import is_quantized_weight, stored_array
    from ms_deepseek.checkpoint.tensors import restore_into

    opened = open_checkpoint(base)
    quantized = build_layout(cfg, parallel, quant=spec)
    if opened.quant is not None:
        restore_into({n: p for n, p in params.items() if n in quantized.tensors}, opened.model, "model",
                     layout=quantized, rank=rank, part=part)
        return
    floats = build_layout(cfg, parallel)
    to_quantize = {n: t for n, t in floats.tensors.items() if is_quantized_weight(n) and 0 not in t.shape
                   and f"{n[:-len('.weight')]}.weight_scale" in params}
    for name, t in to_quantize.items():
        groups = quantized.tensors[f"{name[:-len('.weight')]}.weight_scale"].shape[-1]
        if cuts_scale_groups(t, groups):
            raise UserError(f"model.source {base}: {name} is split {t.split[-1]} ways on its input width "
                            f"{t.shape[-1]} ({parallel.describe()}), which cuts its scale groups of "
                            f"{t.shape[-1] // groups} columns; quantizing each slice alone would not give the "
                            f"quantized base: run `ms-deepseek convert quantize` first and train on its output")
    kept = {n: p for n, p in params.items() if n in floats.tensors and n not in to_quantize}
    restore_into(kept, opened.model, "model", layout=floats, rank=rank, part=part)
    for name, t in to_quantize.items():
        stem = name[: -len(".weight")]
        w = to_float32(opened.model.read(name, floats.slice_of(name, rank)), opened.model.dtype(name))
        stored, scale = stored_array(w, spec)
        for suffix, value in (("weight", stored), ("weight_scale", scale),
                              ("weight_offset", np.zeros_like(scale))):
            param = params[f"{stem}.{suffix}"]
            value = part(param.name, value) if part is not None else value
            param.set_data(Tensor(np.ascontiguousarray(value)), slice_shape=tuple(value.shape) != tuple(param.shape))


def describe(recipe) -> str:
    """The start line's LoRA part: rank, adapted modules, trained and frozen parameter counts (from the
    spec's inventory, so a sharded or quantized run counts its logical parameters) and a quantized base."""
    from ms_deepseek.spec.lora import lora_inventory

    spec = recipe.lora
    inventory = lora_inventory(recipe.model_config, spec)
    trained = sum(i.numel for i in inventory if i.trainable and not i.is_buffer)
    frozen = sum(i.numel for i in inventory if not i.trainable and not i.is_buffer)
    modules = sum(1 for i in inventory if i.name.endswith(".lora_A.weight"))
    quant = recipe.quant
    base = "" if quant is None else (f"; int{quant.bits} base" + (f", groups of {quant.group_size}"
                                                                  if quant.group_size else ", per channel"))
    router = " and the routers" if spec.train_router else ""
    return (f"LoRA r={spec.r} alpha={spec.alpha:g} on {modules} modules ({len(spec.target_modules)} targets"
            f"{router}): trains {trained:,} parameters ({100 * trained / max(1, trained + frozen):.2f}%), "
            f"{frozen:,} frozen{base}")


def checkpoint_tensors(model) -> Dict[str, object]:
    """What a LoRA checkpoint holds: the trainable tensors (adapters, trained routers)."""
    from ms_deepseek.model.lora import trainable_tensors

    return trainable_tensors(model)


def save_base(model, folder: Path) -> None:
    """The model's weights as an HF folder (per-expert names, the parameters' dtype), written atomically."""
    from ms_deepseek.spec import names

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


# ------------------------------------------------------------------------------- export
def run_lora_settings(ckpt: Path) -> Tuple[Dict, Dict]:
    """(lora section, model section) of the recipe a checkpoint was trained with."""
    from ms_deepseek.checkpoint.training import read_recipe

    recipe = read_recipe(ckpt)
    section = recipe.get("lora")
    if not section:
        raise UserError(f"{ckpt}: not a LoRA run (its recipe.yaml has no lora section); export full "
                        "checkpoints with `ms-deepseek convert`")
    return section, recipe.get("model") or {}


def run_base(ckpt: Path, model_section: Dict) -> Path:
    """The base a LoRA checkpoint was trained on: RUN_DIR/base (random base) or model.source."""
    run_dir = ckpt.parent.parent
    if (run_dir / BASE_DIR / "model.safetensors").is_file():
        return (run_dir / BASE_DIR).resolve()  # absolute, as for model.source: the adapter is read from elsewhere
    source = Path(str(model_section.get("source", ""))).expanduser()
    if source.is_dir() and (source / "config.json").is_file():
        if quant_spec_of(source) is not None:  # a QLoRA run on a `convert quantize` folder: its float original
            from ms_deepseek.checkpoint.quantize import original_of

            original = original_of(source)
            if original is None:
                raise UserError(f"{ckpt}: the run's base {source} is quantized and the float checkpoint it was "
                                "made from is gone; pass --base FOLDER (the unquantized base)")
            return original.resolve()
        return source.resolve()
    raise UserError(f"{ckpt}: cannot find the run's base model ({run_dir / BASE_DIR} or model.source "
                    f"{str(source)!r}); pass --base FOLDER")


def checkpoint_arrays(ckpt: Path):
    """(name, float32 array) of every tensor of a LoRA checkpoint, whole or sharded (the slices of a
    tp / pp / ep run put together, experts in expert order), one tensor at a time; and the file to
    name in errors."""
    opened = open_checkpoint(ckpt)
    if opened.lora is None:
        raise UserError(f"{ckpt}: a checkpoint of a full model (it lists no LoRA adapters); export it with "
                        "`ms-deepseek convert ms-to-hf`")
    if opened.sharded:
        src = opened.model
        items = ((name, to_float32(src.read(name, full_slice(t.shape, t.experts is not None)), t.dtype))
                 for name, t in src.layout.tensors.items())
        return items, ckpt / "layout.json"
    tensors = opened.model.tensors
    return ((name, read_tensor(info).astype(np.float32)) for name, info in tensors.items()), \
        ckpt / "model.safetensors"


def checkpoint_adapter(ckpt: Path, base: Path) -> Tuple[Dict[str, np.ndarray], Dict]:
    """(PEFT-named tensors, adapter_config) of a LoRA training checkpoint."""
    from ms_deepseek.model.lora_peft import PREFIX, adapter_config
    import re

    section, _model = run_lora_settings(ckpt)
    lora_cfg = LoraSpec.from_settings(section, "lora")
    arrays, where = checkpoint_arrays(ckpt)
    tensors: Dict[str, np.ndarray] = {}
    targets, routed = set(), False
    has_router = False
    for name, value in arrays:
        m = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.((?:gate|up|down)_proj)\.(lora_[AB]\.weight)$", name)
        if m:  # stacked [E, ...] -> per expert, in expert order
            routed = True
            targets.add(m.group(2))
            for e in range(value.shape[0]):
                tensors[f"{PREFIX}{m.group(1)}.{e}.{m.group(2)}.{m.group(3)}"] = np.ascontiguousarray(value[e])
        elif ".lora_A.weight" in name or ".lora_B.weight" in name:
            targets.add(name.split(".lora_")[0].rsplit(".", 1)[-1])
            tensors[PREFIX + name] = value
        elif re.match(r"^model\.layers\.\d+\.mlp\.gate\.weight$", name):
            has_router = True
            tensors[PREFIX + name] = value
        else:
            raise UserError(f"{where}: tensor {name} is neither an adapter nor a router; not a LoRA checkpoint")
    if not targets:
        raise UserError(f"{where}: holds no LoRA adapter")
    _pair_gate_up(tensors, targets)
    # PEFT refuses lora_dropout on parameter-targeted (fused-expert) adapters; dropout only acts in training.
    dropout = 0.0 if routed else lora_cfg.dropout
    config = adapter_config(lora_cfg.r, lora_cfg.alpha, dropout, sorted(targets), str(base), has_router)
    return tensors, config


def _pair_gate_up(tensors: Dict[str, np.ndarray], targets: set) -> None:
    """A routed-expert adapter on gate_proj alone (or up_proj alone) gets an all-zero partner (B = 0:
    no change to the model), because PEFT on transformers 5 fuses the two into gate_up_proj and
    refuses half a pair."""
    import re

    have: Dict[Tuple[str, str], Dict[str, np.ndarray]] = {}
    for name, value in tensors.items():
        m = re.match(r"^(.*\.mlp\.experts\.\d+)\.(gate|up)_proj\.(lora_[AB])\.weight$", name)
        if m:
            have.setdefault((m.group(1), m.group(2)), {})[m.group(3)] = value
    for (expert, proj), ab in list(have.items()):
        other = "up" if proj == "gate" else "gate"
        if (expert, other) not in have:
            # gate and up have the same shapes [I, H]: A [r, H] and B [I, r] of the same sizes
            for which in ("lora_A", "lora_B"):
                tensors[f"{expert}.{other}_proj.{which}.weight"] = np.zeros_like(ab[which])
            targets.add(f"{other}_proj")


def compatibility_notes(tensor_names) -> List[str]:
    """What PEFT 0.21 on transformers >= 5 will not apply (measured with the fixtures' reference env):
    it maps gate/up/down_proj targets to the fused routed experts only, so adapters on the dense MLP
    and the shared experts are ignored there (the tensors still carry the module names of the released
    checkpoints; a ``--merge`` folder holds them in any case). (Its refusal of half a gate/up pair is
    handled by :func:`_pair_gate_up`.)"""
    import re

    notes = []
    dense = sorted({re.sub(r"\.layers\.\d+\.", ".layers.*.", n.split(".lora_")[0]).replace("base_model.model.", "")
                    for n in tensor_names
                    if re.search(r"\.mlp\.(shared_experts\.)?(gate|up|down)_proj\.lora_", n)})
    if dense:
        notes.append(f"note: transformers >= 5 + PEFT 0.21 ignore the adapters on {', '.join(dense)} "
                     "(they are written for the module names of the released checkpoints; --merge folds them in)")
    return notes


def model_with_adapters(ckpt: Path, show_progress: bool = False):
    """The base a LoRA run's checkpoint was trained on, with the checkpoint's adapters (and trained
    routers) attached as export-lora would write them: what ``generate`` samples from."""
    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM
    from ms_deepseek.model.lora_peft import attach_adapter

    _section, model_section = run_lora_settings(ckpt)
    base = run_base(ckpt, model_section)
    tensors, config = checkpoint_adapter(ckpt, base)
    model = DeepseekV2ForCausalLM.from_pretrained(base, show_progress=show_progress)
    attach_adapter(model, tensors, config, ckpt)
    return model


def export_adapter(spec, out, base: Optional[str] = None, overwrite: bool = False) -> Path:
    """``export-lora RUN_OR_CHECKPOINT OUT``: the PEFT folder of a LoRA run's checkpoint."""
    from ms_deepseek.model.lora_peft import write_adapter

    from ms_deepseek.checkpoint.training import EXPORT, resolve_checkpoint

    ckpt = resolve_checkpoint(spec, EXPORT)
    _section, model_section = run_lora_settings(ckpt)
    base_path = Path(base) if base else run_base(ckpt, model_section)
    check_apart(Path(out), [Path(spec), ckpt, base_path], "output folder")
    tensors, config = checkpoint_adapter(ckpt, base_path)
    return write_adapter(Path(out), tensors, config, overwrite)


# ------------------------------------------------------------------------------- merge
def merge(adapter_folder: Path, base: Path, out: Path, overwrite: bool = False) -> Path:
    """A full HF folder with the adapter folded into the base, streaming one tensor at a time.

    Tensors the adapter does not touch are copied as bytes (the converter's writer); each touched
    one is read, merged in float32 (W + scaling * B @ A; routers replaced), encoded back to its
    own dtype into a scratch file and copied from there. Output shards mirror the base's."""
    from ms_deepseek.checkpoint.source import read_weight_files
    from ms_deepseek.model.lora_peft import read_adapter_tensors, group_adapter, read_config

    base, out, adapter_folder = Path(base), Path(out), Path(adapter_folder)
    if quant_spec_of(base) is not None:
        raise UserError(f"--merge {base}: a quantized checkpoint; merge into the unquantized base it was made "
                        "from (its config.json's quantization_config.original)")
    ckpt = read_weight_files(base)
    E = ckpt.config.n_routed_experts or 0
    factors, routers = group_adapter(read_adapter_tensors(adapter_folder), read_config(adapter_folder), E, adapter_folder)
    check_apart(out, [adapter_folder, base], "output folder")  # OUT = the adapter would delete it
    check_destination(base, out, overwrite)
    merger = _Merger(factors, routers, E, adapter_folder)
    with atomic_folder(out) as tmp:
        scratch = tmp / ".scratch.bin"
        with open(scratch, "wb") as scratch_file:
            files = [(src.name, merger.plan_file(ckpt, src, scratch, scratch_file)) for src in ckpt.files]
        merger.check_all_applied(base)
        _write_merged(tmp, files, ckpt, base)
        scratch.unlink()
    return out


class _Merger:
    """The adapter's deltas by base tensor name, and the output tensors of one base file."""

    def __init__(self, factors, routers, num_experts: int, adapter_folder: Path):
        from ms_deepseek.spec import names

        self.routers, self.E, self.adapter_folder, self.factors = routers, num_experts, adapter_folder, factors
        # per HF tensor name: (A [r, in], B [out, r], scaling); stacked [E, ...] factors under our stacked name
        self.deltas: Dict[str, Tuple[np.ndarray, np.ndarray, float]] = {}
        for path, (a, b, s) in factors.items():
            if a.ndim == 3:
                for e in range(a.shape[0]):
                    self.deltas[names.ms_to_hf(f"{path}.weight", num_experts)[e]] = (a[e], b[e], s)
            else:
                self.deltas[f"{path}.weight"] = (a, b, s)
        self.stacked = {f"{p}.weight": v for p, v in factors.items() if v[0].ndim == 3}
        self.present = set()

    def touches(self, name: str) -> bool:
        return name in self.deltas or name in self.routers or name in self.stacked

    def merged(self, info) -> np.ndarray:
        """The base tensor with its adapter folded in (float32), or the trained router."""
        from ms_deepseek.checkpoint.safetensors_io import DTYPE_NAMES

        name = info.name
        if info.dtype not in DTYPE_NAMES:
            raise UserError(f"{info.file}: tensor {name} has dtype {info.dtype}; cannot merge into it")
        if name in self.routers:
            return self.routers[name]
        w = read_tensor(info).astype(np.float32)
        if name in self.stacked:  # our stacked layout: all experts at once
            a, b, s = self.stacked[name]
            return w + s * np.matmul(b, a)  # [E, out, r] @ [E, r, in]
        a, b, s = self.deltas[name]
        if w.shape != (b.shape[0], a.shape[1]):
            raise UserError(f"{self.adapter_folder}: adapter for {name} is {b.shape[0]} x {a.shape[1]}, "
                            f"the base tensor is {list(w.shape)} (an adapter for another base?)")
        return w + s * (b @ a)

    def plan_file(self, ckpt, src: Path, scratch: Path, scratch_file) -> list:
        """The output tensors of base file ``src``: merged ones encoded into ``scratch``, the rest byte ranges."""
        from ms_deepseek.checkpoint.safetensors_io import OutTensor, order_for_alignment
        from ms_deepseek.spec import names

        planned = []
        for info in sorted((i for i in ckpt.tensors.values() if i.file == src), key=lambda i: i.offset):
            name = info.name
            if self.touches(name):
                w = self.merged(info)
                outs = names.unstack(name, w, self.E) if name in self.stacked else [(name, w)]
                for out_name, arr in outs:
                    raw = encode_array(np.ascontiguousarray(arr), info.dtype)
                    offset = scratch_file.tell()
                    scratch_file.write(raw)
                    planned.append(OutTensor(out_name, info.dtype, tuple(arr.shape), ((scratch, offset, len(raw)),)))
                self.present.add(name)
            elif names.is_stacked_expert(name):  # our layout: unstack by byte ranges
                per = info.nbytes // info.shape[0]
                for e, out_name in enumerate(names.ms_to_hf(name, self.E)):
                    planned.append(OutTensor(out_name, info.dtype, tuple(info.shape[1:]),
                                             ((info.file, info.offset + e * per, per),)))
            else:
                planned.append(OutTensor(name, info.dtype, tuple(info.shape), ((info.file, info.offset, info.nbytes),)))
        scratch_file.flush()
        return order_for_alignment(planned)

    def check_all_applied(self, base: Path) -> None:
        """Every adapter and router found its base tensor (else the adapter is for another base)."""
        from ms_deepseek.spec import names

        for path, (a, _b, _s) in sorted(self.factors.items()):
            stack = f"{path}.weight"
            if stack not in self.present and not (a.ndim == 3 and all(
                    n in self.present for n in names.ms_to_hf(stack, self.E))):
                raise UserError(f"{self.adapter_folder}: the adapter for {path} has no base tensor in {base} "
                                "(an adapter for another base?)")
        for name in self.routers:
            if name not in self.present:
                raise UserError(f"{self.adapter_folder}: router {name} has no base tensor in {base}")


def _write_merged(tmp: Path, files, ckpt, base: Path) -> None:
    """The planned files, the index mirroring the base's, and the base's other files (config, tokenizer)."""
    from ms_deepseek.checkpoint.safetensors_io import write_file

    weight_map: Dict[str, str] = {}
    for file_name, planned in files:
        write_file(tmp / file_name, planned, {"format": "pt"})
        weight_map.update({t.name: file_name for t in planned})
    if ckpt.index_path is not None:
        total = sum((tmp / f).stat().st_size for f, _ in files)
        (tmp / ckpt.index_path.name).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    for extra in base.iterdir():  # config.json, tokenizer files, generation_config.json ...
        if extra.is_file() and not extra.name.endswith(".safetensors") and extra != ckpt.index_path:
            shutil.copy2(extra, tmp / extra.name)
