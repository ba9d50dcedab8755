"""DeepSeek-V2 model configuration: HuggingFace ``config.json`` <-> typed dataclass.

Field names are the HuggingFace ones, so a released ``config.json`` maps 1:1.
Two on-disk formats are read:

* the release format (``rope_theta`` + ``rope_scaling`` with ``"type": "yarn"``),
* the transformers-5 format (``rope_parameters`` with ``rope_type`` and ``rope_theta``).

``to_hf_dict`` always writes the release format. Fields that are ours (balance-loss
alphas beyond ``aux_loss_alpha``, capacity factor, dtypes) are not written to the
HuggingFace file; they live in recipes.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from ms_deepseek.core.dtypes import FLOAT_NAMES
from ms_deepseek.core.errors import UserError
from ms_deepseek.core.safe_io import json_loads
from ms_deepseek.core.schema import from_dict

# Every consumer walks the layers one by one (the inventory, the planner's per-stage sums), so a layer count far
# past any real model makes `plan` slow or endless. DeepSeek-V2 has 60, V3 61; 1024 leaves room for any real one.
MAX_LAYERS = 1024
MAX_EXPERTS = 65_536  # routed experts (DeepSeek-V2: 160)
MOE_DISPATCH = ("capacity", "dropless")  # DeepseekV2Config.moe_dispatch

# The other sizes of a model config ms_deepseek lists, plans or builds (each far beyond DeepSeek-V2's, in the
# comment): a config.json or a recipe asking for more is refused before a loop or an allocation trusts it.
MODEL_LIMITS = {
    "vocab_size": (2**24, "tokens of a vocabulary; DeepSeek-V2 has 102,400"),
    "hidden_size": (2**17, "DeepSeek-V2: 5120"),
    "intermediate_size": (2**20, "DeepSeek-V2: 12,288"),
    "moe_intermediate_size": (2**20, "DeepSeek-V2: 1536"),
    "num_attention_heads": (2**14, "DeepSeek-V2: 128"),
    "num_key_value_heads": (2**14, "DeepSeek-V2: 128"),
    "n_shared_experts": (2**10, "DeepSeek-V2: 2"),
    "n_routed_experts": (MAX_EXPERTS, "DeepSeek-V2: 160"),
    "num_experts_per_tok": (MAX_EXPERTS, "DeepSeek-V2: 6"),
    "n_group": (MAX_EXPERTS, "DeepSeek-V2: 8"),
    "topk_group": (MAX_EXPERTS, "DeepSeek-V2: 3"),
    "ep_size": (65_536, "NPUs"),
    "kv_lora_rank": (2**17, "DeepSeek-V2: 512"),
    "q_lora_rank": (2**17, "DeepSeek-V2: 1536"),
    "qk_rope_head_dim": (2**14, "DeepSeek-V2: 64"),
    "qk_nope_head_dim": (2**14, "DeepSeek-V2: 128"),
    "v_head_dim": (2**14, "DeepSeek-V2: 128"),
    "moe_layer_freq": (MAX_LAYERS, "layers"),
    "first_k_dense_replace": (MAX_LAYERS, "layers"),
    "max_position_embeddings": (2**24, "positions; DeepSeek-V2: 163,840"),
}


def check_layer_count(cfg) -> None:
    if cfg.num_hidden_layers > MAX_LAYERS:
        shown = cfg.num_hidden_layers if cfg.num_hidden_layers < 10**20 else f"{float(cfg.num_hidden_layers):.3g}"
        raise UserError(
            f"model config num_hidden_layers: {shown} is more than {MAX_LAYERS} "
            f"(DeepSeek-V2 has 60); not a model ms_deepseek can list, plan or build"
        )


def check_model_size(cfg, where: str = "model config ") -> None:
    """Every size of ``cfg`` within its sane bound (``MAX_LAYERS``, ``MODEL_LIMITS``), else one line naming it
    (``where`` + the key). The layer count, checked first, keeps its own message."""
    from ms_deepseek.core.schema import check_at_most

    check_layer_count(cfg)
    for key, (limit, what) in MODEL_LIMITS.items():
        check_at_most(f"{where}{key}", getattr(cfg, key), limit, what)
    rope = cfg.rope_scaling or {}
    check_at_most(
        f"{where}rope_scaling.original_max_position_embeddings",
        rope.get("original_max_position_embeddings"),
        2**24,
        "positions",
    )


# Keys of HF config files that carry no information for this port (or are derived).
_IGNORED_HF_KEYS = {
    "architectures",
    "auto_map",
    "model_type",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "pretraining_tp",
    "use_cache",
    "attention_dropout",
    "mlp_bias",
    "head_dim",
    "output_router_logits",
    "qk_head_dim",
    "_name_or_path",
    "rope_interleave",
    "quantization_config",
    "num_nextn_predict_layers",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "use_return_dict",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "tie_encoder_decoder",
    "problem_type",
    "id2label",
    "label2id",
    "_attn_implementation_autoset",
    "layer_types",
}

_DTYPES = FLOAT_NAMES


def _fail(key: str, msg: str):
    raise UserError(f"config {key}: {msg}")


@dataclass
class DeepseekV2Config:
    # --- HuggingFace fields (names and meaning as in the released config.json) ---
    vocab_size: int = 102400
    hidden_size: int = 5120
    intermediate_size: int = 12288
    moe_intermediate_size: int = 1536
    num_hidden_layers: int = 60
    num_attention_heads: int = 128
    num_key_value_heads: Optional[int] = None
    n_shared_experts: Optional[int] = 2
    n_routed_experts: Optional[int] = 160
    ep_size: int = 1
    routed_scaling_factor: float = 16.0
    kv_lora_rank: int = 512
    q_lora_rank: Optional[int] = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    topk_method: str = "group_limited_greedy"
    n_group: Optional[int] = 8
    topk_group: Optional[int] = 3
    num_experts_per_tok: Optional[int] = 6
    moe_layer_freq: int = 1
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = False
    scoring_func: str = "softmax"
    aux_loss_alpha: float = 0.001
    seq_aux: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 163840
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[Dict[str, Any]] = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: Optional[int] = 100000
    eos_token_id: Optional[Union[int, List[int]]] = 100001
    pad_token_id: Optional[int] = None
    # --- ours (not in HF files) ---
    expert_aux_loss_alpha: Optional[float] = None  # expert-level balance; None -> aux_loss_alpha
    device_aux_loss_alpha: float = 0.0  # device-level balance (paper's alpha2)
    comm_aux_loss_alpha: float = 0.0  # communication balance (paper's alpha3)
    capacity_factor: Optional[float] = None  # per-expert capacity in training; None = dropless
    # How the routed experts run in training: "capacity" (per-expert buffers of capacity_factor, overflow
    # dropped: the paper's token dropping) or "dropless" (every choice, sorted by expert, through a grouped
    # matmul; capacity_factor is not read). Evaluation follows eval_capacity_factor on the capacity path.
    moe_dispatch: str = "capacity"
    eval_capacity_factor: Optional[float] = None  # in evaluation (set_train(False)); None = dropless
    compute_dtype: str = "float32"  # float32 on CPU, bfloat16 on Ascend
    param_dtype: str = "float32"  # master weights
    use_flash_attention: bool = False  # Ascend FlashAttentionScore instead of the composite

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.rope_scaling is not None:
            self.rope_scaling = _normalise_rope_scaling(dict(self.rope_scaling))
        self.validate()

    # ----------------------------------------------------------------- derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def expert_alpha(self) -> float:
        return self.aux_loss_alpha if self.expert_aux_loss_alpha is None else self.expert_aux_loss_alpha

    @property
    def has_moe(self) -> bool:
        return bool(self.n_routed_experts)

    def is_moe_layer(self, layer_index: int) -> bool:
        """The original rule: MoE from ``first_k_dense_replace`` on, every ``moe_layer_freq``-th layer."""
        return self.has_moe and layer_index >= self.first_k_dense_replace and layer_index % self.moe_layer_freq == 0

    @property
    def moe_layer_indices(self) -> List[int]:
        check_layer_count(self)
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def eos_ids(self) -> List[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    # -------------------------------------------------------------- validation
    def validate(self) -> None:
        self._validate_shapes()
        self._validate_settings()
        if self.has_moe:
            self._validate_moe()

    def _validate_shapes(self) -> None:
        positive = [
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "v_head_dim",
            "max_position_embeddings",
            "moe_layer_freq",
            "ep_size",
        ]
        for key in positive:
            if getattr(self, key) <= 0:
                _fail(key, f"must be > 0, got {getattr(self, key)}")
        if self.qk_nope_head_dim < 0:
            _fail("qk_nope_head_dim", f"must be >= 0, got {self.qk_nope_head_dim}")
        if self.qk_rope_head_dim % 2:
            _fail("qk_rope_head_dim", f"must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            _fail("q_lora_rank", f"must be > 0 or null, got {self.q_lora_rank}")
        if self.num_attention_heads % self.num_key_value_heads:
            _fail(
                "num_key_value_heads",
                f"{self.num_key_value_heads} does not divide num_attention_heads {self.num_attention_heads}",
            )

    def _validate_settings(self) -> None:
        if self.hidden_act != "silu":
            _fail("hidden_act", f"only 'silu' is supported, got {self.hidden_act!r}")
        if self.rms_norm_eps <= 0:
            _fail("rms_norm_eps", f"must be > 0, got {self.rms_norm_eps}")
        if self.rope_theta <= 0:
            _fail("rope_theta", f"must be > 0, got {self.rope_theta}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            _fail(
                "first_k_dense_replace",
                f"must be in [0, num_hidden_layers={self.num_hidden_layers}], got {self.first_k_dense_replace}",
            )
        for key in ("compute_dtype", "param_dtype"):
            if getattr(self, key) not in _DTYPES:
                _fail(key, f"must be one of {', '.join(_DTYPES)}, got {getattr(self, key)!r}")
        if self.moe_dispatch not in MOE_DISPATCH:
            _fail("moe_dispatch", f"must be one of {', '.join(MOE_DISPATCH)}, got {self.moe_dispatch!r}")
        for key in ("capacity_factor", "eval_capacity_factor"):
            if getattr(self, key) is not None and getattr(self, key) <= 0:
                _fail(key, f"must be > 0 or null (dropless), got {getattr(self, key)}")
        for key in ("aux_loss_alpha", "device_aux_loss_alpha", "comm_aux_loss_alpha"):
            if getattr(self, key) < 0:
                _fail(key, f"must be >= 0, got {getattr(self, key)}")
        if self.expert_aux_loss_alpha is not None and self.expert_aux_loss_alpha < 0:
            _fail("expert_aux_loss_alpha", f"must be >= 0, got {self.expert_aux_loss_alpha}")

    def _validate_moe(self) -> None:
        E, k = self.n_routed_experts, self.num_experts_per_tok
        if self.moe_intermediate_size <= 0:
            _fail("moe_intermediate_size", f"must be > 0, got {self.moe_intermediate_size}")
        if self.n_shared_experts is not None and self.n_shared_experts < 0:
            _fail("n_shared_experts", f"must be >= 0, got {self.n_shared_experts}")
        if k is None or not 1 <= k <= E:
            _fail("num_experts_per_tok", f"must be in [1, n_routed_experts={E}], got {k}")
        if self.scoring_func != "softmax":
            _fail("scoring_func", f"only 'softmax' is supported, got {self.scoring_func!r}")
        if self.topk_method not in ("greedy", "group_limited_greedy"):
            _fail("topk_method", f"must be 'greedy' or 'group_limited_greedy', got {self.topk_method!r}")
        if self.topk_method == "group_limited_greedy":
            self._validate_group_routing()
        if self.routed_scaling_factor <= 0:
            _fail("routed_scaling_factor", f"must be > 0, got {self.routed_scaling_factor}")

    def _validate_group_routing(self) -> None:
        E, k = self.n_routed_experts, self.num_experts_per_tok
        if not self.n_group or E % self.n_group:
            _fail("n_group", f"must divide n_routed_experts={E}, got {self.n_group}")
        if not self.topk_group or not 1 <= self.topk_group <= self.n_group:
            _fail("topk_group", f"must be in [1, n_group={self.n_group}], got {self.topk_group}")
        if self.topk_group * (E // self.n_group) < k:
            _fail(
                "topk_group",
                f"{self.topk_group} groups of {E // self.n_group} experts cannot hold num_experts_per_tok={k} choices",
            )

    # ------------------------------------------------------------------- I/O
    @classmethod
    def from_dict(cls, data: Dict[str, Any], source: str = "config") -> "DeepseekV2Config":
        """Build from a HF config dict (either format) or our own dict."""
        data = dict(data)
        model_type = data.get("model_type")
        if model_type is not None and model_type not in ("deepseek_v2",):
            raise UserError(f"{source}: model_type {model_type!r} is not 'deepseek_v2'")
        if "rope_parameters" in data:  # transformers-5 format
            params = dict(data.pop("rope_parameters") or {})
            data.setdefault("rope_theta", params.pop("rope_theta", 10000.0))
            rope_type = params.get("rope_type", params.get("type", "default"))
            data["rope_scaling"] = None if rope_type == "default" else params
        for key in list(data):
            if key in _IGNORED_HF_KEYS:
                data.pop(key)
        try:
            return from_dict(cls, data)
        except UserError as exc:
            raise UserError(f"{source}: {exc}") from None

    @classmethod
    def from_json(cls, path: Union[str, Path]) -> "DeepseekV2Config":
        path = Path(path)
        try:
            data = json_loads(path.read_text(encoding="utf-8"), path)
        except FileNotFoundError:
            raise UserError(f"{path}: no such file") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UserError(f"{path}: not a readable JSON config ({exc})") from None
        if not isinstance(data, dict):
            raise UserError(f"{path}: expected a JSON object")
        return cls.from_dict(data, source=str(path))

    def to_hf_dict(self, dtype: str = "bfloat16") -> Dict[str, Any]:
        """The release-format ``config.json`` contents."""
        ours = {
            "expert_aux_loss_alpha",
            "device_aux_loss_alpha",
            "comm_aux_loss_alpha",
            "capacity_factor",
            "eval_capacity_factor",
            "moe_dispatch",
            "compute_dtype",
            "param_dtype",
            "use_flash_attention",
        }
        out: Dict[str, Any] = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2"}
        for f in dataclasses.fields(self):
            if f.name not in ours:
                out[f.name] = getattr(self, f.name)
        if self.rope_scaling is not None:
            scaling = dict(self.rope_scaling)
            scaling["type"] = scaling.pop("rope_type", scaling.get("type", "yarn"))
            out["rope_scaling"] = scaling
        out["torch_dtype"] = dtype
        return out

    def save(self, path: Union[str, Path], dtype: str = "bfloat16") -> None:
        Path(path).write_text(json.dumps(self.to_hf_dict(dtype), indent=2) + "\n", encoding="utf-8")

    def replace(self, **changes) -> "DeepseekV2Config":
        return dataclasses.replace(self, **changes)


_YARN_KEY_TYPES = {
    "factor": float,
    "original_max_position_embeddings": int,
    "beta_fast": float,
    "beta_slow": float,
    "mscale": float,
    "mscale_all_dim": float,
    "attention_factor": float,
    "truncate": bool,
}


def _normalise_rope_scaling(scaling: Dict[str, Any]) -> Dict[str, Any]:
    """Accept ``type`` or ``rope_type``; check the YaRN keys we need."""
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    if rope_type in (None, "default"):
        raise UserError("config rope_scaling: missing 'type' (only 'yarn' is supported)")
    if rope_type != "yarn":
        raise UserError(f"config rope_scaling.type: only 'yarn' is supported, got {rope_type!r}")
    for key in ("factor", "original_max_position_embeddings"):
        if scaling.get(key) is None:
            raise UserError(f"config rope_scaling.{key}: required for yarn")
    # the inner keys are read as numbers inside RoPE: check them here, naming the key
    for key, kind in _YARN_KEY_TYPES.items():
        value = scaling.get(key)
        if value is None:
            scaling.pop(key, None)  # null = absent: RoPE takes the key's default
            continue
        ok = (
            isinstance(value, bool)
            if kind is bool
            else (not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int))
        )
        if not ok:
            expected = {bool: "true or false", int: "an integer", float: "a number"}[kind]
            raise UserError(f"config rope_scaling.{key}: expected {expected}, got {value!r}")
    if scaling["original_max_position_embeddings"] <= 0:
        raise UserError(
            "config rope_scaling.original_max_position_embeddings: must be > 0, got "
            f"{scaling['original_max_position_embeddings']}"
        )
    if scaling["factor"] <= 0:
        raise UserError(f"config rope_scaling.factor: must be > 0, got {scaling['factor']}")
    out = {"type": "yarn"}
    out.update(scaling)
    return out


# --------------------------------------------------------------------------- presets
_RELEASE_YARN = {
    "type": "yarn",
    "factor": 40,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}

_PRESETS: Dict[str, Dict[str, Any]] = {
    # deepseek-ai/DeepSeek-V2 (and -Chat: same architecture, same config)
    "deepseek-v2": dict(
        vocab_size=102400,
        hidden_size=5120,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_hidden_layers=60,
        num_attention_heads=128,
        num_key_value_heads=128,
        n_shared_experts=2,
        n_routed_experts=160,
        routed_scaling_factor=16.0,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        v_head_dim=128,
        qk_nope_head_dim=128,
        topk_method="group_limited_greedy",
        n_group=8,
        topk_group=3,
        num_experts_per_tok=6,
        first_k_dense_replace=1,
        max_position_embeddings=163840,
        rope_scaling=_RELEASE_YARN,
    ),
    # deepseek-ai/DeepSeek-V2-Lite (and -Lite-Chat)
    "deepseek-v2-lite": dict(
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        n_shared_experts=2,
        n_routed_experts=64,
        routed_scaling_factor=1.0,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        v_head_dim=128,
        qk_nope_head_dim=128,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        num_experts_per_tok=6,
        first_k_dense_replace=1,
        max_position_embeddings=163840,
        rope_scaling=_RELEASE_YARN,
    ),
    # A few million parameters: the CPU default (MLA with q compression, group-limited MoE, YaRN).
    "tiny": dict(
        vocab_size=4096,
        hidden_size=192,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        routed_scaling_factor=1.0,
        kv_lora_rank=64,
        q_lora_rank=96,
        qk_rope_head_dim=16,
        v_head_dim=32,
        qk_nope_head_dim=32,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        max_position_embeddings=2048,
        rope_scaling=None,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        capacity_factor=2.0,
        initializer_range=0.02,
    ),
}
_PRESETS["deepseek-v2-chat"] = dict(_PRESETS["deepseek-v2"])
_PRESETS["deepseek-v2-lite-chat"] = dict(_PRESETS["deepseek-v2-lite"])

PRESET_NAMES = tuple(sorted(_PRESETS))


def get_preset(name: str, **overrides) -> DeepseekV2Config:
    if name not in _PRESETS:
        raise UserError(f"unknown model preset {name!r}; choose from {', '.join(PRESET_NAMES)}")
    values = dict(_PRESETS[name])
    values.update(overrides)
    return DeepseekV2Config(**values)


def load_model_config(spec: Union[str, Path]) -> DeepseekV2Config:
    """A preset name, a ``config.json`` path, or a checkpoint folder holding ``config.json``."""
    text = str(spec)
    if text in _PRESETS:
        return get_preset(text)
    path = Path(text)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{path}: folder has no config.json (expected a HuggingFace or ms_deepseek checkpoint)")
        return DeepseekV2Config.from_json(path / "config.json")
    if path.is_file():
        return DeepseekV2Config.from_json(path)
    raise UserError(f"model {text!r}: not a preset ({', '.join(PRESET_NAMES)}), config.json or checkpoint folder")
