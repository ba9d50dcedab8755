"""Training recipes: one YAML file, seven typed sections, checked before anything starts.

```yaml
model:      {source: tiny, overrides: {capacity_factor: 2.0}, expert_aux_loss_alpha: 0.003}
data:       {seq_len: 256, embedded_vocab_size: 4096}          # ms_deepseek.data.DataConfig
train:      {steps: 300, micro_batch_size: 8, grad_accum_steps: 1, seed: 1234}
optim:      {lr: 3.0e-3, schedule: cosine, warmup_steps: 20, weight_decay: 0.1}
parallel:   {dp: 1}                                             # ms_deepseek.parallel_plan.ParallelConfig
checkpoint: {save_interval: 100, keep_last: 2}
logging:    {log_interval: 10}
```

:func:`load_recipe` reads the file, applies ``--set section.key=value`` overrides, builds
the dataclasses (unknown keys and wrong types fail naming the key), resolves the model
config (preset / config.json / checkpoint folder + overrides + alphas) and checks what
needs two sections at once: the sequence length against the model's positions, the
tokenizer's vocabulary against the model's, the batch against the data-parallel degree.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, Union

import yaml

from ms_deepseek.config.data import DataConfig
from ms_deepseek.config.dispatch_shapes import max_tokens_per_group
from ms_deepseek.config.lora import LoraSpec
from ms_deepseek.config.model import MOE_DISPATCH, DeepseekV2Config, check_model_size, load_model_config
from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.config.quant import QuantSpec
from ms_deepseek.core.errors import UserError
from ms_deepseek.core.safe_io import json_loads, yaml_load
from ms_deepseek.core.schema import MAX_BATCH, MAX_SEED, MAX_STEPS, apply_overrides, check_at_most, from_dict, to_dict

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


@dataclass
class ModelSection:
    """What to train: a preset name, a ``config.json``, or a checkpoint folder to start from."""

    source: str = "tiny"
    # Model config fields to change, e.g. {capacity_factor: 2.0, num_hidden_layers: 2}.
    overrides: Dict[str, Any] = field(default_factory=dict)
    # Balance-loss weights (the paper's alpha1 / alpha2 / alpha3); null keeps the config's.
    expert_aux_loss_alpha: Optional[float] = None
    device_aux_loss_alpha: Optional[float] = None
    comm_aux_loss_alpha: Optional[float] = None
    # The routed experts' training path: capacity (buffers of capacity_factor, overflow dropped) or dropless
    # (every routed choice through a grouped matmul); null keeps the config's (capacity unless overridden).
    moe_dispatch: Optional[str] = None
    # Load the folder's weights when ``source`` is a checkpoint folder (else: random init).
    load_weights: bool = True

    def __post_init__(self):
        if not self.source.strip():
            raise UserError("model.source: empty (a preset name, a config.json or a checkpoint folder)")
        for key in ("expert_aux_loss_alpha", "device_aux_loss_alpha", "comm_aux_loss_alpha"):
            value = getattr(self, key)
            if value is not None and value < 0:
                raise UserError(f"model.{key}: must be >= 0, got {value}")
        if self.moe_dispatch is not None and self.moe_dispatch not in MOE_DISPATCH:
            raise UserError(f"model.moe_dispatch: must be one of {', '.join(MOE_DISPATCH)}, got {self.moe_dispatch!r}")


@dataclass
class TrainSection:
    steps: int = 100  # optimizer steps
    micro_batch_size: int = 8  # sequences per worker per micro-step
    grad_accum_steps: int = 1  # micro-steps per optimizer step
    seed: int = 1234
    clip_grad_norm: Optional[float] = 1.0  # global-norm clipping; null = off
    mode: Literal["graph", "pynative"] = "graph"
    # Validation (needs data.validation): every eval_interval optimizer steps (0: only at the end of
    # the run) each worker evaluates eval_batches micro-batches of its share of the validation set.
    eval_interval: int = 0
    eval_batches: int = 8
    # Dynamic loss scale (used only when the model computes in float16).
    loss_scale_init: float = 65536.0
    loss_scale_factor: float = 2.0
    loss_scale_window: int = 1000

    def __post_init__(self):
        for key in ("steps", "micro_batch_size", "grad_accum_steps"):
            if getattr(self, key) < 1:
                raise UserError(f"train.{key}: must be >= 1, got {getattr(self, key)}")
        if self.seed < 0:
            raise UserError(f"train.seed: must be >= 0, got {self.seed}")
        if self.eval_interval < 0:
            raise UserError(f"train.eval_interval: must be >= 0 (0 = only at the end), got {self.eval_interval}")
        if self.eval_batches < 1:
            raise UserError(f"train.eval_batches: must be >= 1, got {self.eval_batches}")
        if self.clip_grad_norm is not None and self.clip_grad_norm <= 0:
            raise UserError(f"train.clip_grad_norm: must be > 0 or null (off), got {self.clip_grad_norm}")
        if self.loss_scale_init < 1:
            raise UserError(f"train.loss_scale_init: must be >= 1, got {self.loss_scale_init}")
        if self.loss_scale_factor <= 1:
            raise UserError(f"train.loss_scale_factor: must be > 1, got {self.loss_scale_factor}")
        if self.loss_scale_window < 1:
            raise UserError(f"train.loss_scale_window: must be >= 1, got {self.loss_scale_window}")
        for key, limit, what in (
            ("steps", MAX_STEPS, "optimizer steps"),
            ("eval_interval", MAX_STEPS, "steps"),
            ("loss_scale_window", MAX_STEPS, "steps"),
            ("micro_batch_size", MAX_BATCH, "sequences per micro-batch"),
            ("grad_accum_steps", MAX_BATCH, "micro-steps per optimizer step"),
            ("eval_batches", MAX_BATCH, "validation micro-batches"),
            ("seed", MAX_SEED, "numpy's and MindSpore's seed range"),
            ("loss_scale_init", 2.0**64, "a loss scale"),
        ):
            check_at_most(f"train.{key}", getattr(self, key), limit, what)


@dataclass
class OptimSection:
    """AdamW and its learning-rate schedule."""

    lr: float = 3e-4
    min_lr: float = 0.0  # cosine floor
    schedule: Literal["cosine", "step", "constant"] = "cosine"
    warmup_steps: int = 0
    milestones: List[float] = field(default_factory=lambda: [0.6, 0.9])  # step schedule: fractions of the run
    decay_factor: float = 0.316  # step schedule: lr multiplier at each milestone
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8

    def __post_init__(self):
        if self.lr <= 0:
            raise UserError(f"optim.lr: must be > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise UserError(f"optim.min_lr: must be in [0, optim.lr={self.lr}], got {self.min_lr}")
        if self.warmup_steps < 0:
            raise UserError(f"optim.warmup_steps: must be >= 0, got {self.warmup_steps}")
        if any(not 0 < m < 1 for m in self.milestones) or list(self.milestones) != sorted(self.milestones):
            raise UserError(f"optim.milestones: must be increasing fractions in (0, 1), got {self.milestones}")
        if not 0 < self.decay_factor <= 1:
            raise UserError(f"optim.decay_factor: must be in (0, 1], got {self.decay_factor}")
        if self.weight_decay < 0:
            raise UserError(f"optim.weight_decay: must be >= 0, got {self.weight_decay}")
        for key in ("beta1", "beta2"):
            if not 0 < getattr(self, key) < 1:
                raise UserError(f"optim.{key}: must be in (0, 1), got {getattr(self, key)}")
        if self.eps <= 0:
            raise UserError(f"optim.eps: must be > 0, got {self.eps}")
        check_at_most("optim.warmup_steps", self.warmup_steps, MAX_STEPS, "optimizer steps")


@dataclass
class CheckpointSection:
    save_interval: int = 0  # optimizer steps between checkpoints; 0 = only at the end
    keep_last: int = 3  # complete checkpoints kept (older ones deleted)
    save_final: bool = True  # also save after the last step
    # What `train` does with an existing run folder when --resume is not given: null = fresh runs
    # only (a folder with checkpoints is refused); "auto" = resume its newest complete checkpoint
    # when there is one, else start fresh (a scheduler can re-run the same command after a failure).
    resume: Optional[str] = None

    def __post_init__(self):
        if self.resume is not None and self.resume != "auto":
            raise UserError(
                f"checkpoint.resume: must be 'auto' or null, got {self.resume!r} (a checkpoint path "
                "goes on the command line: --resume PATH)"
            )
        if self.save_interval < 0:
            raise UserError(f"checkpoint.save_interval: must be >= 0 (0 = only at the end), got {self.save_interval}")
        if self.keep_last < 1:
            raise UserError(f"checkpoint.keep_last: must be >= 1, got {self.keep_last}")
        check_at_most("checkpoint.save_interval", self.save_interval, MAX_STEPS, "optimizer steps")
        check_at_most("checkpoint.keep_last", self.keep_last, MAX_STEPS, "checkpoints")


@dataclass
class LoggingSection:
    log_interval: int = 10  # optimizer steps between metrics records
    tensorboard: bool = True  # event files under RUN_DIR/tb
    progress_bar: bool = True
    alerts: bool = True  # print ms_deepseek.report.alerts warnings as they happen

    def __post_init__(self):
        if self.log_interval < 1:
            raise UserError(f"logging.log_interval: must be >= 1, got {self.log_interval}")
        check_at_most("logging.log_interval", self.log_interval, MAX_STEPS, "optimizer steps")


@dataclass(frozen=True)
class RecipeOrigin:
    """What a loaded recipe was built from, so that a variant of it (more ``--set`` overrides) or its copy in
    another process is built without reading a file again: the mapping as read (``written``), the overrides
    applied to it in order, where it was read (messages start with it), and the architecture ``model.source``
    gave (the model config's fields before ``model.overrides``) with the source it was read for and, when that
    source was not on this machine, the config.json beside the recipe it was read from instead."""

    written: Dict[str, Any]
    overrides: Tuple[str, ...]
    source: str
    architecture: Dict[str, Any]
    architecture_of: str
    architecture_file: Optional[str] = None


@dataclass
class Recipe:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainSection = field(default_factory=TrainSection)
    optim: OptimSection = field(default_factory=OptimSection)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    lora: Optional[LoraSpec] = None  # LoRA fine-tuning (ms_deepseek.config.lora); null = full fine-tuning
    quant: Optional[QuantSpec] = None  # a quantized frozen base under LoRA (ms_deepseek.config.quant)
    # filled by load_recipe (not YAML keys)
    source_path: Optional[str] = field(default=None, init=False, repr=False)
    model_config: Optional[DeepseekV2Config] = field(default=None, init=False, repr=False)
    origin: Optional[RecipeOrigin] = field(default=None, init=False, repr=False)

    # ---------------------------------------------------------------- derived
    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step over all data-parallel replicas (with pipeline parallelism the
        pipeline's micro-batches are the accumulation: dp x micro_batch_size x micro_batches)."""
        return self.parallel.global_batch(self.train.micro_batch_size, self.train.grad_accum_steps)

    @property
    def seq_len(self) -> int:
        return effective_seq_len(self.data)

    @property
    def weights_folder(self) -> Optional[Path]:
        """The checkpoint folder to load weights from, or None for random init."""
        p = Path(self.model.source).expanduser()
        if self.model.load_weights and p.is_dir() and any((p / f).is_file() for f in _WEIGHT_FILES):
            return p
        if self.model.load_weights and p.is_dir() and list(p.glob("model-*-of-*.safetensors")):
            return p
        return None

    def to_dict(self) -> Dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            if f.init:
                value = getattr(self, f.name)
                if value is not None:  # an absent lora section stays absent ("lora:" alone means defaults)
                    out[f.name] = to_dict(value)
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    # ---------------------------------------------------------------- variants and copies
    def with_overrides(self, overrides: Sequence[str]) -> "Recipe":
        """This recipe as loaded, with ``overrides`` applied after its own: built again from its
        :class:`RecipeOrigin` (sections changed on this object after loading are not carried; give them as
        overrides). No file is read unless an override names another ``model.source``."""
        origin = self._origin()
        try:
            return load_recipe_dict(origin.written, origin.overrides + tuple(overrides), origin.source, origin=origin)
        except UserError as exc:
            raise UserError(f"{origin.source}: {exc}") from None

    def to_request(self) -> Dict[str, Any]:
        """The recipe as JSON-ready data for a worker process (:func:`recipe_from_request` builds it there)."""
        return dict(dataclasses.asdict(self._origin()), overrides=list(self._origin().overrides))

    def _origin(self) -> RecipeOrigin:
        if self.origin is None:
            raise UserError("recipe: built without load_recipe / load_recipe_dict, so it has no origin to copy")
        return self.origin


def effective_seq_len(data: DataConfig) -> int:
    """The training sequence length: data.seq_len, else the prepared folder's, else the embedded default's."""
    if data.seq_len is not None:
        return data.seq_len
    if data.path is None:
        return data.embedded_seq_len
    meta = Path(data.primary_path).expanduser() / "meta.json"  # a mixture's sources must agree (checked at build)
    try:
        value = json_loads(meta.read_text(encoding="utf-8"), meta).get("seq_len")
    except (OSError, ValueError, AttributeError):
        value = None
    if not isinstance(value, int):
        raise UserError(
            f"data.path: {meta} is missing or has no seq_len; prepare the folder with "
            f"`ms-deepseek prepare-data` (or set data.seq_len)"
        )
    return value


def planning_config_path(recipe_path: Union[str, Path]) -> List[Path]:
    """Where planning looks for the architecture when ``model.source`` is a checkpoint folder that
    is not on this machine: ``<recipe stem>.config.json``, then ``config.json``, beside the recipe."""
    recipe_path = Path(recipe_path)
    return [recipe_path.with_name(recipe_path.stem + ".config.json"), recipe_path.with_name("config.json")]


def read_architecture(
    section: ModelSection, config_fallbacks: Sequence[Union[str, Path]] = ()
) -> Tuple[Dict[str, Any], Optional[Path]]:
    """The model config fields of ``model.source`` (preset / config.json / folder), before ``model.overrides``,
    and the fallback file they were read from (None: from ``model.source``).

    ``config_fallbacks``: when the source cannot be read, the first of these files that exists
    gives the architecture (``plan``: :func:`planning_config_path`, beside the recipe)."""
    beside = None
    try:
        cfg = load_model_config(section.source)
    except UserError as exc:
        beside = [Path(p) for p in config_fallbacks if Path(p).is_file()]
        if not beside:
            hint = (
                f"; to plan without it put its config.json beside the recipe as {config_fallbacks[0]}"
                if config_fallbacks
                else ""
            )
            raise UserError(f"model.source: {exc}{hint}") from None
        beside = beside[0]
        cfg = load_model_config(beside)
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}, beside


def build_model_config(
    section: ModelSection,
    config_fallbacks: Sequence[Union[str, Path]] = (),
    architecture: Optional[Dict[str, Any]] = None,
) -> DeepseekV2Config:
    """Preset / config.json / folder -> config, with overrides and alphas applied (errors name model.*).

    ``architecture``: the fields :func:`read_architecture` gave for this ``model.source`` (nothing is read);
    else they are read, with ``config_fallbacks``."""
    if architecture is None:
        architecture = read_architecture(section, config_fallbacks)[0]
    values = copy.deepcopy(architecture)
    known = set(values)
    for key, value in section.overrides.items():
        if key not in known:
            raise UserError(f"model.overrides.{key}: not a model config field")
        values[key] = value
    for key in ("expert_aux_loss_alpha", "device_aux_loss_alpha", "comm_aux_loss_alpha", "moe_dispatch"):
        if getattr(section, key) is not None:
            values[key] = getattr(section, key)
    try:
        cfg = from_dict(DeepseekV2Config, values, "model.overrides")
    except UserError as exc:
        text = str(exc)
        raise UserError(text if text.startswith("model.") else f"model.overrides: {text}") from None
    try:
        check_model_size(cfg, "")
    except UserError as exc:  # name the recipe key when an override set it
        key = str(exc).split(":", 1)[0].removeprefix("model config ")
        where = f"model.overrides.{key}" if key in section.overrides else f"model.source {section.source}: config {key}"
        raise UserError(f"{where}:{str(exc).split(':', 1)[1]}") from None
    return cfg


def validate(recipe: Recipe) -> None:
    """Checks that need more than one section (single-section checks run in __post_init__).

    What the run will find on this machine (folders, tokenizer, LoRA base) is checked by
    :func:`ms_deepseek.train.preflight.check_recipe`, not here: ``plan`` and ``convert --recipe``
    read recipes of cluster jobs whose data and checkpoints are elsewhere."""
    cfg = recipe.model_config
    seq_len = recipe.seq_len
    if seq_len > cfg.max_position_embeddings:
        raise UserError(
            f"data.seq_len: {seq_len} is longer than the model's max_position_embeddings {cfg.max_position_embeddings}"
        )
    if cfg.n_routed_experts:
        # each data-parallel rank routes its micro-batch's tokens in one call of every MoE layer
        tokens, limit = recipe.train.micro_batch_size * seq_len, max_tokens_per_group(cfg.num_experts_per_tok)
        if tokens > limit:
            raise UserError(
                f"train.micro_batch_size: {recipe.train.micro_batch_size} x {seq_len} = {tokens} tokens "
                f"per data-parallel rank exceed the {limit} the MoE dispatch orders exactly with top-"
                f"{cfg.num_experts_per_tok} routing (float32 sort keys); use a smaller micro-batch"
            )
    if recipe.parallel.pp > 1 and recipe.train.grad_accum_steps != 1:
        raise UserError(
            f"train.grad_accum_steps: must be 1 with pipeline parallelism (parallel.pp="
            f"{recipe.parallel.pp}); the pipeline's parallel.micro_batches="
            f"{recipe.parallel.micro_batches} are the accumulation"
        )
    if recipe.quant is not None and recipe.lora is None:
        raise UserError(
            "quant: a quantized base is frozen, so it needs a lora: section (LoRA fine-tuning); "
            "remove quant: for full fine-tuning"
        )
    if recipe.train.eval_interval and recipe.data.validation is None:
        raise UserError(
            "train.eval_interval: validation needs data.validation (a prepared folder, or a "
            "fraction of the training data held out: data.validation.fraction=0.02)"
        )


def recipe_warnings(recipe: Recipe) -> List[str]:
    """What runs but is likely not meant (the trainer prints each in one line at the start; not refusals)."""
    out = []
    steps, warmup = recipe.train.steps, recipe.optim.warmup_steps
    if warmup >= steps:
        out.append(
            f"optim.warmup_steps: {warmup} warmup steps but train.steps is {steps}: the learning rate never "
            f"reaches optim.lr={recipe.optim.lr:g} (lower it, e.g. --set optim.warmup_steps={steps // 10})"
        )
    return out


def load_recipe_dict(
    data: Dict[str, Any],
    overrides: Sequence[str] = (),
    source: str = "recipe",
    config_fallbacks: Sequence[Union[str, Path]] = (),
    origin: Optional[RecipeOrigin] = None,
) -> Recipe:
    """A recipe from its mapping and ``--set`` overrides. ``origin``: what a recipe was loaded from; its
    architecture is used when this recipe names the same ``model.source``, else the source is read."""
    written = copy.deepcopy(data) if data else {}
    if not isinstance(written, dict):
        raise UserError(f"{source}: expected a YAML mapping of sections (model, data, train, ...)")
    data = copy.deepcopy(written)
    apply_overrides(data, overrides)
    for key, value in list(data.items()):
        if value is None:  # an empty section in YAML ("data:") means defaults
            data[key] = {}
    recipe = from_dict(Recipe, data)
    recipe.source_path = source
    if origin is not None and origin.architecture_of == recipe.model.source:
        arch, beside = origin.architecture, origin.architecture_file
    else:
        arch, beside = read_architecture(recipe.model, config_fallbacks)
    recipe.model_config = build_model_config(recipe.model, architecture=arch)
    recipe.origin = RecipeOrigin(
        written, tuple(overrides), source, arch, recipe.model.source, None if beside is None else str(beside)
    )
    validate(recipe)
    return recipe


def recipe_from_request(request: Dict[str, Any]) -> Recipe:
    """The recipe :meth:`Recipe.to_request` wrote, built in this process from that data alone (no file is read)."""
    origin = RecipeOrigin(**dict(request, overrides=tuple(request["overrides"])))
    return load_recipe_dict(origin.written, origin.overrides, origin.source, origin=origin)


def _nearest_recipe(path: Path) -> str:
    """' (did you mean recipes/tiny-cpu.yaml?)' for recipes/tiny.yaml: the closest recipe file of that folder."""
    import difflib

    try:
        names = sorted(p.name for p in path.parent.glob("*.y*ml") if p.is_file())
    except OSError:
        return ""
    close = difflib.get_close_matches(path.name, names, n=1, cutoff=0.6)
    if not close:  # a stem that starts a recipe's name: tiny -> tiny-cpu
        close = [n for n in names if n.startswith(path.stem + "-")][:1]
    return f" (did you mean {path.parent / close[0]}?)" if close else ""


def load_recipe(
    path: Union[str, Path], overrides: Sequence[str] = (), config_fallbacks: Sequence[Union[str, Path]] = ()
) -> Recipe:
    """Read, override, type-check and cross-check a recipe file; raise UserError naming the key.

    ``config_fallbacks``: config.json files to read the architecture from when ``model.source``
    is not on this machine (``plan`` passes :func:`planning_config_path`). A run checks what it
    will read with :func:`ms_deepseek.train.preflight.check_recipe`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: no such recipe file{_nearest_recipe(path)}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read recipe ({exc})") from None
    try:
        data = yaml_load(text, path)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"{path}:{where} not valid YAML ({getattr(exc, 'problem', exc)})") from None
    try:
        return load_recipe_dict(data or {}, overrides, str(path), config_fallbacks)
    except UserError as exc:
        raise UserError(f"{path}: {exc}") from None
