"""The one checkpoint opener: any folder ms_deepseek reads, and what it holds.

:func:`open_checkpoint` knows every kind and checks it against its config before anything reads
a tensor:

* ``hf``: a HuggingFace folder (per-expert tensors, index + shards or one file);
* ``ms``: a converted ms_deepseek folder (routed experts stacked [E, out, in]);
* ``training``: a whole training checkpoint (``step_N/``: model + optimizer + state + recipe);
* ``sharded``: ``rank_RRRRR/`` slices described by ``layout.json`` (training or pre-sharded).

A LoRA run's checkpoint (whole or sharded) holds adapters and trained routers, not a model:
:attr:`Opened.lora` is then its :class:`~ms_deepseek.config.lora.LoraSpec`, and its tensors are
checked against the adapter inventory.

Everything that reads checkpoints goes through here: ``from_pretrained``, resume, per-rank
loading, resharding, merge to HF and LoRA export. The converter's byte copies read the weight
files (:mod:`.weight_files`) this opener is built on.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Optional, Union

from ms_deepseek.checkpoint.convert.byte_map import check_tensors
from ms_deepseek.checkpoint.convert.quant_format import check_quantized, expected_quantized, quant_spec_of
from ms_deepseek.checkpoint.digests import check_file
from ms_deepseek.checkpoint.layout import LAYOUT_FILE, ShardLayout, checkpoint_inventory, is_sharded
from ms_deepseek.checkpoint.safetensors_io import read_header
from ms_deepseek.checkpoint.slice_readers import ShardedSource, WholeSource
from ms_deepseek.checkpoint.training import read_recipe
from ms_deepseek.checkpoint.weight_files import WeightFiles, check_config_scale, read_weight_files
from ms_deepseek.config.inventory import expected_hf_shapes, expected_ms_shapes, ms_buffer_shapes, zero_width_shapes
from ms_deepseek.config.lora import LoraSpec
from ms_deepseek.config.model import DeepseekV2Config
from ms_deepseek.config.quant import QuantSpec
from ms_deepseek.core.errors import UserError

OPTIMIZER_FILE = "optimizer.safetensors"


class CheckpointKind(str, Enum):
    """The kinds of folder :func:`open_checkpoint` knows (a ``str``: compares equal to its value)."""

    HF = "hf"
    MS = "ms"
    TRAINING = "training"
    SHARDED = "sharded"

    def __str__(self) -> str:
        return self.value


Source = Union[WholeSource, ShardedSource]


@dataclass(frozen=True)
class Opened:
    """What a checkpoint folder holds, checked against its config (built with keywords)."""

    folder: Path
    kind: CheckpointKind
    config: DeepseekV2Config
    config_path: Path
    model: Source  # the model tensors (or a LoRA run's adapters)
    optimizer: Optional[Source] = None  # the optimizer state of a training checkpoint
    lora: Optional[LoraSpec] = None  # a LoRA run's checkpoint: its adapters' settings
    weights: Optional[WeightFiles] = None  # a whole folder's weight files (the converter's view)
    quant: Optional[QuantSpec] = None  # a quantized base (``convert quantize``): its bits and group size

    @property
    def sharded(self) -> bool:
        return self.kind is CheckpointKind.SHARDED

    @property
    def layout(self) -> Optional[ShardLayout]:
        return self.model.layout if self.sharded else None


def open_checkpoint(folder) -> Opened:
    """Open and check any checkpoint folder; UserError naming the file and tensor at fault."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{folder}: no such checkpoint folder")
    if is_sharded(folder):
        return _open_sharded(folder)
    weights = read_weight_files(folder)
    lora = lora_of(folder)
    quant = quant_spec_of(folder)
    if quant is not None:  # int8 / int4 weights with scales (checkpoint.convert.quantize)
        model = WholeSource.of(weights)
        expected = expected_hf_shapes(weights.config) if model.hf else expected_ms_shapes(weights.config)
        check_quantized(weights, expected, quant, optional=zero_width_shapes(weights.config))
        return Opened(
            folder=folder,
            kind=CheckpointKind.HF if model.hf else CheckpointKind.MS,
            config=weights.config,
            config_path=weights.config_path,
            model=model,
            weights=weights,
            quant=quant,
        )
    if lora is not None:  # adapters (+ routers), by our names
        model = WholeSource.of(weights, hf=False)
        check_tensors(weights, {i.name: i.shape for i in checkpoint_inventory(weights.config, lora)}, "LoRA")
    else:
        model = WholeSource.of(weights)
        _check_whole(model, weights)
    optimizer = None
    if (folder / OPTIMIZER_FILE).is_file():
        check_file(folder, OPTIMIZER_FILE)  # against the digest state.json records (read_weight_files: the rest)
        optimizer = WholeSource(read_header(folder / OPTIMIZER_FILE).tensors, weights.config, folder, hf=False)
    kind = (
        CheckpointKind.TRAINING
        if (folder / "state.json").is_file()
        else (CheckpointKind.HF if model.hf else CheckpointKind.MS)
    )
    return Opened(
        folder=folder,
        kind=kind,
        config=weights.config,
        config_path=weights.config_path,
        model=model,
        optimizer=optimizer,
        lora=lora,
        weights=weights,
    )


def open_for_resume(folder) -> Opened:
    """:func:`open_checkpoint` of a training checkpoint, which must hold optimizer state."""
    opened = open_checkpoint(folder)
    if opened.optimizer is None:
        where = Path(folder) / (LAYOUT_FILE if opened.sharded else OPTIMIZER_FILE)
        raise UserError(f"{where}: no optimizer tensors (not a training checkpoint)")
    return opened


def _open_sharded(folder: Path) -> Opened:
    model = ShardedSource(folder, "model.safetensors")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise UserError(f"{folder}: sharded checkpoint without config.json")
    check_file(folder, "config.json")  # the rank files: when their slices are first read (ShardedSource)
    cfg = DeepseekV2Config.from_json(config_path)
    lora = LoraSpec.from_settings(model.layout.lora, f"{folder / LAYOUT_FILE}: lora")
    check_config_scale(cfg, model.layout.tensors, config_path, LAYOUT_FILE)
    quant = quant_spec_of(folder)  # pre-sharded `convert quantize --recipe` output
    _check_layout_matches_config(model.layout, cfg, folder, lora, quant)
    optimizer = None
    if model.layout.optimizer:
        optimizer = ShardedSource(folder, OPTIMIZER_FILE, layout=model.layout.for_optimizer())
    return Opened(
        folder=folder,
        kind=CheckpointKind.SHARDED,
        config=cfg,
        config_path=config_path,
        model=model,
        optimizer=optimizer,
        lora=lora,
        quant=quant,
    )


def lora_not_a_model(folder) -> UserError:
    """What converting a LoRA checkpoint (whole or sharded) to a model says: use export-lora."""
    return UserError(
        f"{folder}: a LoRA checkpoint holds adapters, not a model; write a PEFT adapter or a "
        f"merged HF folder with `ms-deepseek export-lora {folder} OUT [--merge BASE]`"
    )


def lora_of(folder: Path) -> Optional[LoraSpec]:
    """The LoRA settings of a whole LoRA training checkpoint (its recipe.yaml's lora section), else None."""
    if not (folder / "state.json").is_file():
        return None
    section = read_recipe(folder, missing_ok=True).get("lora")
    return LoraSpec.from_settings(section, f"{folder / 'recipe.yaml'}: lora")


def _check_whole(src: WholeSource, weights: WeightFiles) -> None:
    """Names, shapes and dtypes of a whole source against its config (the converter's checks)."""
    cfg = weights.config
    if src.hf:
        check_tensors(weights, expected_hf_shapes(cfg), "HuggingFace", optional=zero_width_shapes(cfg))
    else:
        check_tensors(
            weights,
            expected_ms_shapes(cfg),
            "ms_deepseek",
            optional={**zero_width_shapes(cfg), **ms_buffer_shapes(cfg)},
        )


def _check_layout_matches_config(
    layout: ShardLayout, cfg, folder: Path, lora: Optional[LoraSpec], quant: Optional[QuantSpec] = None
) -> None:
    expected = {info.name: info.shape for info in checkpoint_inventory(cfg, lora)}
    if quant is not None:  # the quantized tensors (quant_format.py) in place of each quantized weight
        expected = {n: shape for n, (shape, _) in expected_quantized(expected, quant).items()}
    for name, shape in expected.items():
        t = layout.tensors.get(name)
        if t is None:
            raise UserError(f"{folder / LAYOUT_FILE}: tensor {name} is missing (config.json requires it)")
        if t.shape != tuple(shape):
            raise UserError(
                f"{folder / LAYOUT_FILE}: tensor {name} has shape {list(t.shape)}, config.json implies {list(shape)}"
            )
    extra = [n for n in layout.tensors if n not in expected]
    if extra:
        raise UserError(
            f"{folder / LAYOUT_FILE}: unexpected tensor {extra[0]} (not in the model config.json describes)"
        )
