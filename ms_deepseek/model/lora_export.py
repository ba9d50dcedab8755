"""LoRA checkpoints out of training: ``export-lora`` (a PEFT folder, or a merged HF folder) and the
model a LoRA checkpoint describes (``generate`` on a LoRA run).

A LoRA run's checkpoints hold the adapters (and trained routers) and their optimizer state, nothing
of the frozen base; the base is ``model.source``, or ``RUN_DIR/base`` (:data:`BASE_DIR`) for a random
one. Everything here reads files and builds Cells; nothing of it trains.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from ms_deepseek.checkpoint.convert.quant_format import quant_spec_of
from ms_deepseek.checkpoint.opener import open_checkpoint
from ms_deepseek.checkpoint.safetensors_io import encode_array
from ms_deepseek.checkpoint.slice_readers import full_slice, to_float32
from ms_deepseek.config.lora import LoraSpec
from ms_deepseek.core.atomic import atomic_folder, check_apart, check_destination
from ms_deepseek.core.errors import UserError
from ms_deepseek.model.loading import read_tensor

BASE_DIR = "base"  # RUN_DIR/base: a LoRA run's random base, written once in the HF layout


# ------------------------------------------------------------------------------- export
def run_lora_settings(ckpt: Path) -> Tuple[Dict, Dict]:
    """(lora section, model section) of the recipe a checkpoint was trained with."""
    from ms_deepseek.checkpoint.training import read_recipe

    recipe = read_recipe(ckpt)
    section = recipe.get("lora")
    if not section:
        raise UserError(
            f"{ckpt}: not a LoRA run (its recipe.yaml has no lora section); export full "
            "checkpoints with `ms-deepseek convert`"
        )
    return section, recipe.get("model") or {}


def run_base(ckpt: Path, model_section: Dict) -> Path:
    """The base a LoRA checkpoint was trained on: RUN_DIR/base (random base) or model.source."""
    run_dir = ckpt.parent.parent
    if (run_dir / BASE_DIR / "model.safetensors").is_file():
        return (run_dir / BASE_DIR).resolve()  # absolute, as for model.source: the adapter is read from elsewhere
    source = Path(str(model_section.get("source", ""))).expanduser()
    if source.is_dir() and (source / "config.json").is_file():
        if quant_spec_of(source) is not None:  # a QLoRA run on a `convert quantize` folder: its float original
            from ms_deepseek.checkpoint.convert.quantize import original_of

            original = original_of(source)
            if original is None:
                raise UserError(
                    f"{ckpt}: the run's base {source} is quantized and the float checkpoint it was "
                    "made from is gone; pass --base FOLDER (the unquantized base)"
                )
            return original.resolve()
        return source.resolve()
    raise UserError(
        f"{ckpt}: cannot find the run's base model ({run_dir / BASE_DIR} or model.source "
        f"{str(source)!r}); pass --base FOLDER"
    )


def checkpoint_arrays(ckpt: Path):
    """(name, float32 array) of every tensor of a LoRA checkpoint, whole or sharded (the slices of a
    tp / pp / ep run put together, experts in expert order), one tensor at a time; and the file to
    name in errors."""
    opened = open_checkpoint(ckpt)
    if opened.lora is None:
        raise UserError(
            f"{ckpt}: a checkpoint of a full model (it lists no LoRA adapters); export it with "
            "`ms-deepseek convert ms-to-hf`"
        )
    if opened.sharded:
        src = opened.model
        items = (
            (name, to_float32(src.read(name, full_slice(t.shape, t.experts is not None)), t.dtype))
            for name, t in src.layout.tensors.items()
        )
        return items, ckpt / "layout.json"
    tensors = opened.model.tensors
    return ((name, read_tensor(info).astype(np.float32)) for name, info in tensors.items()), ckpt / "model.safetensors"


def checkpoint_adapter(ckpt: Path, base: Path) -> Tuple[Dict[str, np.ndarray], Dict]:
    """(PEFT-named tensors, adapter_config) of a LoRA training checkpoint."""
    from ms_deepseek.model.lora_peft import PREFIX, adapter_config

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
    notes = []
    dense = sorted(
        {
            re.sub(r"\.layers\.\d+\.", ".layers.*.", n.split(".lora_")[0]).replace("base_model.model.", "")
            for n in tensor_names
            if re.search(r"\.mlp\.(shared_experts\.)?(gate|up|down)_proj\.lora_", n)
        }
    )
    if dense:
        notes.append(
            f"note: transformers >= 5 + PEFT 0.21 ignore the adapters on {', '.join(dense)} "
            "(they are written for the module names of the released checkpoints; --merge folds them in)"
        )
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
    from ms_deepseek.checkpoint.training import EXPORT, resolve_checkpoint
    from ms_deepseek.model.lora_peft import write_adapter

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
    from ms_deepseek.checkpoint.weight_files import read_weight_files
    from ms_deepseek.model.lora_peft import group_adapter, read_adapter_tensors, read_config

    base, out, adapter_folder = Path(base), Path(out), Path(adapter_folder)
    if quant_spec_of(base) is not None:
        raise UserError(
            f"--merge {base}: a quantized checkpoint; merge into the unquantized base it was made "
            "from (its config.json's quantization_config.original)"
        )
    ckpt = read_weight_files(base)
    E = ckpt.config.n_routed_experts or 0
    factors, routers = group_adapter(
        read_adapter_tensors(adapter_folder), read_config(adapter_folder), E, adapter_folder
    )
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
        from ms_deepseek.config import names

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
            raise UserError(
                f"{self.adapter_folder}: adapter for {name} is {b.shape[0]} x {a.shape[1]}, "
                f"the base tensor is {list(w.shape)} (an adapter for another base?)"
            )
        return w + s * (b @ a)

    def plan_file(self, ckpt, src: Path, scratch: Path, scratch_file) -> list:
        """The output tensors of base file ``src``: merged ones encoded into ``scratch``, the rest byte ranges."""
        from ms_deepseek.checkpoint.safetensors_io import OutTensor, order_for_alignment
        from ms_deepseek.config import names

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
                    planned.append(
                        OutTensor(
                            out_name, info.dtype, tuple(info.shape[1:]), ((info.file, info.offset + e * per, per),)
                        )
                    )
            else:
                planned.append(OutTensor(name, info.dtype, tuple(info.shape), ((info.file, info.offset, info.nbytes),)))
        scratch_file.flush()
        return order_for_alignment(planned)

    def check_all_applied(self, base: Path) -> None:
        """Every adapter and router found its base tensor (else the adapter is for another base)."""
        from ms_deepseek.config import names

        for path, (a, _b, _s) in sorted(self.factors.items()):
            stack = f"{path}.weight"
            if stack not in self.present and not (
                a.ndim == 3 and all(n in self.present for n in names.ms_to_hf(stack, self.E))
            ):
                raise UserError(
                    f"{self.adapter_folder}: the adapter for {path} has no base tensor in {base} "
                    "(an adapter for another base?)"
                )
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
        (tmp / ckpt.index_path.name).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2)
            + "\n"
        )
    for extra in base.iterdir():  # config.json, tokenizer files, generation_config.json ...
        if extra.is_file() and not extra.name.endswith(".safetensors") and extra != ckpt.index_path:
            shutil.copy2(extra, tmp / extra.name)
