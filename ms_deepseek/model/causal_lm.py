"""DeepSeek-V2 causal language model (single-device math; see ms_deepseek.parallel_plan for sharding).

``DeepseekV2ForCausalLM(cfg)(input_ids, labels=None)``

* Called from Python (PyNative or GRAPH_MODE) it returns :class:`CausalLMOutput`
  with ``.logits`` float32 [B, T, V], and with labels ``.loss`` / ``.aux_loss``.
* Inside a compiled graph (e.g. a training step wrapping it) ``construct`` returns the
  tuple ``(logits, loss, aux_loss, moe_stats)`` (plus ``routing`` when
  ``output_routing`` is set), because graphs return tensors, not Python objects.

``loss`` is the mean next-token cross-entropy over labels != -100, with labels aligned
to ``input_ids`` and shifted here (the HuggingFace convention). ``aux_loss`` is the sum
over MoE layers of the balance losses times their alphas. ``moe_stats`` is
[num_moe_layers, E + 4]: per-expert load fractions, dropped fraction, and the
unweighted expert / device / communication balance losses.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer

from ms_deepseek.config.model import DeepseekV2Config
from ms_deepseek.core.errors import UserError
from ms_deepseek.model.block import DecoderLayer
from ms_deepseek.model.layers import Linear, RMSNorm, to_ms_dtype
from ms_deepseek.model.loss import IGNORE_INDEX, VocabParallelCrossEntropy  # noqa: F401 (IGNORE_INDEX re-exported)
from ms_deepseek.model.mla import CausalMask
from ms_deepseek.model.rope import RotaryEmbedding


class CausalLMOutput(NamedTuple):
    """A tuple with names: ``out.logits`` and ``out[0]`` both work, in and outside graphs."""

    logits: Tensor
    loss: Optional[Tensor] = None
    aux_loss: Optional[Tensor] = None
    moe_stats: Optional[Tensor] = None
    routing: Optional[Tuple[Any, ...]] = None


class Embedding(nn.Cell):
    """Token embedding [V, H]; primitive ``gather``."""

    def __init__(self, vocab_size: int, hidden_size: int, init_std: float, param_dtype):
        super().__init__()
        self.weight = Parameter(initializer(Normal(init_std), [vocab_size, hidden_size], param_dtype), name="weight")
        self.gather = ops.Gather()

    def construct(self, ids):
        return self.gather(self.weight, ids, 0)


class DeepseekV2Model(nn.Cell):
    def __init__(self, cfg: DeepseekV2Config):
        super().__init__()
        self.config = cfg
        pdt = to_ms_dtype(cfg.param_dtype)
        self.compute_dtype = to_ms_dtype(cfg.compute_dtype)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, cfg.initializer_range, pdt)
        self.layers = nn.CellList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pdt)
        self.rotary_emb = RotaryEmbedding(cfg)
        self.causal_mask = CausalMask()
        self.embed_cast = ops.Cast()  # the embedding output into the hidden stream (``hidden_cast`` style)
        self.num_moe_layers = len(cfg.moe_layer_indices)
        self.stats_width = (cfg.n_routed_experts or 0) + 4

    def construct(self, input_ids, start_pos=0, caches=None, prefill=False):
        """input_ids [B, T] -> hidden [B, T, H], aux scalar, stats [L_moe, E + 4], routing tuple.

        Training passes input_ids only. Decoding passes ``caches`` (one latent buffer per layer,
        [B, S, kv_lora + rope], updated in place; see ``model.decode.CachedDecoder``) and the position
        of the first token, ``start_pos`` (int32 scalar Tensor): ``prefill=True`` runs the prompt from
        position 0 through the full attention and fills the caches, otherwise the tokens at
        start_pos.. attend to everything cached so far (themselves included, causally). Decoding
        returns aux 0 and no stats (nobody reads them; skipping them saves ops in PyNative).
        """
        T = input_ids.shape[1]
        # float positions made as floats: under sharding propagation a Cast of the (constant-folded)
        # int32 arange got a split of its own while the constant stayed whole, and the inserted
        # AllGather gave dp x T positions (reshape.cc ReshapeCheckSize: "x_shape {32768} ... out_shape
        # {4096, 1}" on V2-Lite at dp 8, seq 4096)
        positions_f = ops.arange(0, T, dtype=ms.float32)  # [T]
        if caches is not None and not prefill:
            positions_f = positions_f + start_pos.astype(ms.float32)
        cos, sin = self.rotary_emb(positions_f)
        cache_index = None
        if caches is None or prefill:
            mask = self.causal_mask(T, T)  # [T, T]
        else:
            mask = self.causal_mask(T, caches[0].shape[1], start_pos)  # [T, S]: rows after each query masked
            B = input_ids.shape[0]
            rows = ops.broadcast_to(ops.arange(0, B, dtype=ms.int32).reshape(B, 1), (B, T))  # [B, T]
            positions = ops.arange(0, T, dtype=ms.int32) + start_pos  # [T]
            cols = ops.broadcast_to(positions.reshape(1, T), (B, T))  # [B, T]
            cache_index = ops.stack((rows, cols), -1)  # [B, T, 2]: where each new entry goes, all layers
        x = self.embed_cast(self.embed_tokens(input_ids), self.compute_dtype)  # [B, T, H]
        # aux is carried as [1], not as a 0-d tensor: a 0-d value that crosses a pipeline stage comes out of
        # MindSpore's Receive as a Python-number abstract (<Float32, NoShape>, pipeline_transformer.cc
        # InsertReceive), which the next stage's Add refuses ("input's type 'Float32' does not match
        # expected type 'Tensor'"; the compile check, v2-sft-64npu stage 7).
        aux = ops.zeros((1,), ms.float32)
        stats = ()
        routing = ()
        i = 0
        for layer in self.layers:
            cache = None if caches is None else caches[i]
            x, layer_aux, layer_stats, layer_routing = layer(x, cos, sin, mask, cache, cache_index, prefill)
            i += 1
            if caches is not None:  # decoding reads only the hidden states: no balance-loss bookkeeping
                continue
            # [1] + [] -> [1] by broadcasting, not layer_aux.reshape(1): with two MoE layers under sharding
            # propagation that Reshape got no strategy ("Reshape generate strategy costs failed",
            # reshape_info.cc GenerateStrategyCosts: "Infer strategy by tensor_info failed"), so no pp = 1
            # recipe compiled past one MoE layer
            aux = aux + layer_aux
            if layer_stats is not None:
                stats = stats + (layer_stats,)
                routing = routing + (layer_routing,)
        if self.num_moe_layers and caches is None:
            # stop_gradient here, on the last stage, not in each MoE layer: a layer's statistics cross the
            # pipeline stages, and MindSpore cuts a stage only after an operator it shards
            # (pipeline_transformer.cc FindPipelineCareNode: "Only PipelineSplit cared node can be a
            # border"; StopGradient is not one: IsParallelConsiderCNode)
            stats_t = ops.stop_gradient(ops.stack(stats))  # [L_moe, E + 4]
        else:
            stats_t = ops.zeros((0, self.stats_width), ms.float32)
        return self.norm(x), aux.reshape(()), stats_t, routing


class DeepseekV2ForCausalLM(nn.Cell):
    def __init__(self, config: DeepseekV2Config, output_routing: bool = False):
        super().__init__()
        if config.tie_word_embeddings:
            raise UserError("config tie_word_embeddings: true is not supported (no DeepSeek-V2 release ties them)")
        self.config = config
        self.model = DeepseekV2Model(config)
        kw = dict(
            init_std=config.initializer_range,
            compute_dtype=to_ms_dtype(config.compute_dtype),
            param_dtype=to_ms_dtype(config.param_dtype),
        )
        self.lm_head = Linear(config.hidden_size, config.vocab_size, **kw)
        self.loss_fn = VocabParallelCrossEntropy(config.vocab_size)  # no parameters
        self.output_routing = output_routing
        self.vocab_size = config.vocab_size

    def cross_entropy(self, logits, labels):
        """Mean next-token CE over labels != -100. logits [B, T, V] f32, labels [B, T] int.

        Vocabulary-parallel form (``ms_deepseek.model.loss``): no gather over the vocabulary axis."""
        return self.loss_fn(logits, labels)

    def construct(self, input_ids, labels=None):
        hidden, aux, stats, routing = self.model(input_ids)
        logits = self.lm_head(hidden).astype(ms.float32)
        loss = None
        if labels is not None:
            loss = self.cross_entropy(logits, labels)
        if self.output_routing:
            return logits, loss, aux, stats, routing
        return logits, loss, aux, stats

    def __call__(self, *args, **kwargs):
        if self.config.use_flash_attention and ms.get_context("device_target") != "Ascend":
            raise UserError(
                "config use_flash_attention: FlashAttentionScore runs only on Ascend; set it to false on this device"
            )
        out = super().__call__(*args, **kwargs)
        if isinstance(out, CausalLMOutput) or not isinstance(out, (tuple, list)):
            return out
        return CausalLMOutput(*out)

    @classmethod
    def from_pretrained(cls, path, adapter=None, **config_overrides) -> "DeepseekV2ForCausalLM":
        """Load a checkpoint folder; ``adapter`` = a PEFT LoRA folder to attach (ms_deepseek.model.lora_peft)."""
        from ms_deepseek.model.loading import load_pretrained

        model = load_pretrained(cls, path, **config_overrides)
        if adapter is not None:
            from ms_deepseek.model.lora_peft import load_adapter

            load_adapter(model, adapter)
        return model
