"""PEFT adapter folders: write ours, read PEFT's (including one trained elsewhere), merge into a base.

A PEFT LoRA folder is ``adapter_config.json`` + ``adapter_model.safetensors`` whose tensors are
named ``base_model.model.<module path>.lora_{A,B}.weight`` for the HF DeepseekV2 model; routed
experts carry the per-expert names of the released checkpoints
(``...mlp.experts.{e}.gate_proj.lora_A.weight``, what vLLM and PEFT on the per-expert model
load; PEFT >= 0.18 on transformers 5 converts them to its fused-expert layout on load).
PEFT's own layout on transformers 5's fused experts (``...mlp.experts.base_layer.lora_A.weight``
[E*2r, H] for gate+up, ``...mlp.experts.lora_A.weight`` [E*r, I] for down) is read too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np

from ms_deepseek.config.lora import PEFT_PREFIX
from ms_deepseek.core.errors import UserError
from ms_deepseek.core.safe_io import json_loads

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PREFIX = PEFT_PREFIX  # PEFT names the HF model's modules under it

# adapter_config.json keys and the only values we implement (anything else is refused naming the key)
_MUST_BE = {
    "use_dora": False,
    "use_rslora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "lora_bias": False,
    "layers_to_transform": None,
    "layers_pattern": None,
    "layer_replication": None,
    "use_qalora": False,
    "alora_invocation_tokens": None,
    "trainable_token_indices": None,
    "velora_config": None,
    "kasa_config": None,
    "arrow_config": None,
    "monteclora_config": None,
    "use_bdlora": None,
    "exclude_modules": None,
}
_EMPTY_OK = ("loftq_config", "eva_config", "corda_config", "lora_ga_config", "megatron_config")
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.((?:gate|up|down)_proj)\.(lora_[AB])\.weight$")
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(base_layer\.)?(lora_[AB])\.weight$")
_PLAIN = re.compile(r"^(.+)\.(lora_[AB])\.weight$")
_ROUTER = re.compile(r"^model\.layers\.\d+\.mlp\.gate\.weight$")


# ------------------------------------------------------------------------------- export
def adapter_config(r: int, alpha: float, dropout: float, targets: List[str], base: str, router: bool) -> Dict:
    """adapter_config.json as PEFT 0.21 writes it for a plain LoRA (every option we do not use at its default)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "auto_mapping": None,
        "base_model_name_or_path": base,
        "revision": None,
        "inference_mode": True,
        "r": int(r),
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(set(targets)),
        "target_parameters": None,
        "exclude_modules": None,
        "fan_in_fan_out": False,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "lora_bias": False,
        "modules_to_save": ["gate"] if router else None,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "megatron_config": None,
        "megatron_core": "megatron.core",
        "loftq_config": {},
        "layer_replication": None,
        "peft_version": "0.21.2",
    }


def write_adapter(out: Path, tensors: Dict[str, np.ndarray], config: Dict, overwrite: bool = False) -> Path:
    """Write a PEFT folder with the one atomic folder writer: nothing half-written on failure, and an old
    folder at ``out`` is removed only once the new one is in place."""
    from ms_deepseek.checkpoint.safetensors_io import array_tensor, order_for_alignment, write_file
    from ms_deepseek.core.atomic import atomic_folder

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise UserError(f"{out}: exists and is not empty (pass --overwrite to replace it)")
    with atomic_folder(out) as tmp:
        entries = order_for_alignment([array_tensor(k, v) for k, v in sorted(tensors.items())])
        write_file(tmp / WEIGHTS_NAME, entries, {"format": "pt"}, fsync=False)  # atomic_folder fsyncs the folder
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out


# ------------------------------------------------------------------------------- import
def read_config(folder: Path) -> Dict:
    """adapter_config.json, refusing options we do not implement (one line naming the key)."""
    path = Path(folder) / CONFIG_NAME
    if not Path(folder).is_dir():
        raise UserError(f"{folder}: no such adapter folder")
    try:
        cfg = json_loads(path.read_text(encoding="utf-8"), path)
    except FileNotFoundError:
        raise UserError(f"{folder}: not a PEFT adapter folder (no {CONFIG_NAME})") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: cannot read ({exc})") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{path}: expected a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise UserError(f"{path}: peft_type {cfg.get('peft_type')!r} is not supported (only LORA)")
    for key, want in _MUST_BE.items():
        if key in cfg and cfg[key] != want and not (want is None and cfg[key] in ([], {})):
            raise UserError(f"{path}: {key}: {cfg[key]!r} is not supported (only {json.dumps(want)})")
    for key in _EMPTY_OK:
        if cfg.get(key) not in (None, {}, []):
            raise UserError(f"{path}: {key}: {cfg[key]!r} is not supported (only null)")
    for key in ("r", "lora_alpha"):
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise UserError(f"{path}: {key}: must be a positive number, got {value!r}")
    saved = cfg.get("modules_to_save")
    if saved not in (None, [], ["gate"]):
        raise UserError(f'{path}: modules_to_save: {saved!r} is not supported (only the routers, ["gate"])')
    return cfg


def read_adapter_tensors(folder: Path) -> Dict[str, np.ndarray]:
    from ms_deepseek.checkpoint.safetensors_io import read_header
    from ms_deepseek.model.loading import read_tensor

    path = Path(folder) / WEIGHTS_NAME
    if not path.is_file():
        raise UserError(f"{folder}: not a PEFT adapter folder (no {WEIGHTS_NAME})")
    header = read_header(path)
    return {name: read_tensor(info).astype(np.float32) for name, info in header.tensors.items()}


def _pattern_value(patterns: Dict, path: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the end of the module path."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", path):
            return value
    return default


def group_adapter(tensors: Dict[str, np.ndarray], cfg: Dict, num_experts: int, where: Path):
    """PEFT tensors -> ({our module path: (A, B, scaling)}, {router name: weight}).

    Per-expert tensors are stacked in expert order; PEFT's fused transformers-5 layout is
    split into gate / up / down (gate and up share their fused A; a fused rank 2r stays 2r)."""
    r0, alpha0 = cfg["r"], cfg["lora_alpha"]
    ranks, alphas = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    plain, experts, fused, routers = _sort_tensors(tensors, where)

    def scaling(path: str, rank: int) -> float:
        return float(_pattern_value(alphas, path, alpha0)) / rank

    out: Dict[str, Tuple[np.ndarray, np.ndarray, float]] = {}
    for path, ab in plain.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise UserError(f"{where}: {PREFIX}{path} has {sorted(ab)} but not both lora_A and lora_B")
        a, b = ab["lora_A"], ab["lora_B"]
        out[path] = (a, b, scaling(path, int(_pattern_value(ranks, path, a.shape[0]))))
    for (stack, proj), ab in experts.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise UserError(f"{where}: {stack}.*.{proj} has {sorted(ab)} but not both lora_A and lora_B")
        for which, per in ab.items():
            _check_expert_set(per, f"{stack}.{{}}.{proj}.{which}.weight", proj, num_experts, where)
        a = np.stack([ab["lora_A"][e] for e in range(num_experts)])  # [E, r, in]
        b = np.stack([ab["lora_B"][e] for e in range(num_experts)])  # [E, out, r]
        path = f"{stack}.{proj}"
        out[path] = (a, b, scaling(f"{stack}.{num_experts - 1}.{proj}", int(a.shape[1])))
    for stack, parts in fused.items():
        out.update(_split_fused(stack, parts, num_experts, alphas, alpha0, ranks, r0, where))
    return out, routers


def _sort_tensors(tensors: Dict[str, np.ndarray], where: Path):
    """PEFT tensors by kind: (plain {path: {lora_A|lora_B: array}}, per-expert {(stack, proj): {which: {expert:
    array}}}, fused {stack: {part: array}}, routers {name: weight})."""
    plain: Dict[str, Dict[str, np.ndarray]] = {}
    experts: Dict[Tuple[str, str], Dict[str, Dict[int, np.ndarray]]] = {}
    fused: Dict[str, Dict[str, np.ndarray]] = {}
    routers: Dict[str, np.ndarray] = {}
    for full, value in tensors.items():
        if not full.startswith(PREFIX):
            raise UserError(
                f"{where}: tensor {full} does not start with {PREFIX!r} (not a PEFT adapter of a causal LM)"
            )
        name = full[len(PREFIX) :]
        m = _PER_EXPERT.match(name)
        if m:
            experts.setdefault((m.group(1), m.group(3)), {}).setdefault(m.group(4), {})[int(m.group(2))] = value
            continue
        m = _FUSED.match(name)
        if m:
            which = "gate_up" if m.group(2) else "down"
            fused.setdefault(m.group(1), {})[f"{which}.{m.group(3)}"] = value
            continue
        if _ROUTER.match(name):
            routers[name] = value
            continue
        m = _PLAIN.match(name)
        if not m:
            raise UserError(f"{where}: tensor {full}: not a LoRA factor (lora_A / lora_B .weight) we can load")
        plain.setdefault(m.group(1), {})[m.group(2)] = value

    return plain, experts, fused, routers


def _check_expert_set(per: Dict[int, np.ndarray], name: str, proj: str, num_experts: int, where: Path) -> None:
    """A per-expert factor covers experts 0..num_experts-1 exactly (``name``: the tensor name, ``{}`` for the
    expert)."""
    missing = sorted(set(range(num_experts)) - set(per))
    extra = sorted(set(per) - set(range(num_experts)))
    if extra:
        raise UserError(
            f"{where}: tensor {PREFIX}{name.format(extra[0])}: expert {extra[0]} "
            f"does not exist (the base has {num_experts} routed experts)"
        )
    if missing:
        raise UserError(
            f"{where}: tensor {PREFIX}{name.format(missing[0])} is missing "
            f"(an adapter for {proj} must cover all {num_experts} experts)"
        )


def _split_fused(stack, parts, E, alphas, alpha0, ranks, r0, where):
    """PEFT's ParamWrapper layout on transformers-5 fused experts -> our stacked per-projection factors.

    ParamWrapper (peft/tuners/lora/layer.py ``get_delta_weight``): lora_A [E*r, in] viewed
    [E, r, in]; lora_B [out, r*E] viewed [out, r, E]; delta_e = B[:, :, e] @ A_e. For gate_up_proj
    (out = 2I, gate rows first) the delta splits into gate = rows [:I], up = rows [I:], both
    with the whole A_e."""
    out = {}
    for which, _stacked in (("gate_up", ("gate_proj", "up_proj")), ("down", ("down_proj",))):
        keys = {f"{which}.lora_A", f"{which}.lora_B"}
        have = {k for k in parts if k.startswith(which + ".")}
        if not have:
            continue
        if have != keys:
            raise UserError(f"{where}: {stack} fused {which} adapter lacks {sorted(keys - have)}")
        a, b = parts[f"{which}.lora_A"], parts[f"{which}.lora_B"]
        if a.shape[0] % E or b.shape[1] % E or a.shape[0] != b.shape[1]:
            raise UserError(
                f"{where}: {PREFIX}{stack}.{'base_layer.' if which == 'gate_up' else ''}lora_A.weight "
                f"{list(a.shape)} / lora_B {list(b.shape)} do not split into {E} experts"
            )
        r = a.shape[0] // E
        a3 = a.reshape(E, r, a.shape[1])  # [E, r, in]
        b3 = np.transpose(b.reshape(b.shape[0], r, E), (2, 0, 1))  # [out, r, E] -> [E, out, r]
        name = "gate_up_proj" if which == "gate_up" else "down_proj"
        alpha = float(_pattern_value(alphas, f"{stack}.{name}", alpha0))
        scale = alpha / int(_pattern_value(ranks, f"{stack}.{name}", r))
        if which == "gate_up":
            if b3.shape[1] % 2:
                raise UserError(f"{where}: {PREFIX}{stack}.base_layer.lora_B.weight: odd gate_up width {b3.shape[1]}")
            half = b3.shape[1] // 2
            out[f"{stack}.gate_proj"] = (a3, np.ascontiguousarray(b3[:, :half]), scale)
            out[f"{stack}.up_proj"] = (a3.copy(), np.ascontiguousarray(b3[:, half:]), scale)
        else:
            out[f"{stack}.down_proj"] = (a3, np.ascontiguousarray(b3), scale)
    return out


def load_adapter(model, folder, dropout: float = 0.0) -> Dict[str, Tuple[int, float]]:
    """Attach the PEFT adapter in ``folder`` to ``model`` (built, base weights loaded, never called yet
    in graph mode). Returns {module path: (rank, scaling)}. Shape mismatches name the tensor."""
    folder = Path(folder)
    cfg = read_config(folder)
    tensors = read_adapter_tensors(folder)
    if not tensors:
        raise UserError(f"{folder / WEIGHTS_NAME}: holds no tensors")
    return attach_adapter(model, tensors, cfg, folder, dropout)


def attach_adapter(
    model, tensors: Dict[str, np.ndarray], cfg: Dict, folder: Path, dropout: float = 0.0
) -> Dict[str, Tuple[int, float]]:
    """:func:`load_adapter` of PEFT-named ``tensors`` and their adapter_config ``cfg`` held in memory
    (``generate`` of a LoRA run's checkpoint); ``folder`` is named in errors."""
    from mindspore import Tensor

    from ms_deepseek.model import lora

    E = model.config.n_routed_experts or 0
    factors, routers = group_adapter(tensors, cfg, E, folder / WEIGHTS_NAME)
    if lora.has_adapters(model):
        raise UserError(f"{folder}: the model already holds LoRA adapters")
    modules = lora.adaptable_modules(model)
    for path, (a, b, scale) in sorted(factors.items()):
        if path not in modules:
            raise UserError(
                f"{folder / WEIGHTS_NAME}: tensor {PREFIX}{path}.lora_A.weight targets a module this base does not have"
            )
        holder, experts = modules[path]
        shape = tuple(getattr(holder, "dense_shape", holder.weight.shape))  # [out, in] or [E, out, in] (quantized too)
        lead = shape[:-2]
        r = a.shape[-2]
        want_a, want_b = lead + (r, shape[-1]), lead + (shape[-2], r)
        for tag, got, want in (("lora_A", a, want_a), ("lora_B", b, want_b)):
            if tuple(got.shape) != tuple(want):
                shown = (
                    f"{PREFIX}{path}.{tag}.weight"
                    if not lead
                    else f"{PREFIX}{path.rsplit('.', 1)[0]}.*.{path.rsplit('.', 1)[1]}.{tag}.weight"
                )
                got_s = list(got.shape) if not lead else list(got.shape[1:])
                want_s = list(want) if not lead else list(want[1:])
                raise UserError(
                    f"{folder / WEIGHTS_NAME}: tensor {shown} has shape {got_s}, this base needs "
                    f"{want_s} (an adapter for another base?)"
                )
        lora.attach(holder, scale, dropout, a, b, path)
    params = {p.name: p for p in model.get_parameters()}
    for name, value in routers.items():
        if name not in params or tuple(params[name].shape) != value.shape:
            raise UserError(
                f"{folder / WEIGHTS_NAME}: tensor {PREFIX}{name} has shape {list(value.shape)}, "
                f"this base needs {list(params[name].shape) if name in params else 'no such router'}"
            )
        params[name].set_data(Tensor(value, dtype=params[name].dtype))
    return lora.adapter_paths(model)
