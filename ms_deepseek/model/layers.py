"""Building blocks: Linear, RMSNorm, SwiGLU MLP. Single-device math, no parallelism.

Primitives live in named attributes (``matmul``, ``bmm`` ...) so the parallel plan
(``ms_deepseek.parallel_plan``) can give them shard strategies from outside.
"""

from __future__ import annotations

import mindspore as ms
from mindspore import Parameter, nn, ops
from mindspore.common.initializer import Normal, initializer
from mindspore.ops.auto_generate import SiLU

from ms_deepseek.core.dtypes import ms_dtype as to_ms_dtype  # noqa: E402,F401  (the one dtype table)


class Linear(nn.Cell):
    """``y = x @ weight.T (+ bias)``; weight is [out, in] as in HuggingFace checkpoints.

    Parameters are stored in ``param_dtype``; the matmul runs in ``compute_dtype``.
    Primitive: ``matmul`` (MatMul, transpose_b) on 2-D input [N, in].
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        init_std: float = 0.02,
        compute_dtype=ms.float32,
        param_dtype=ms.float32,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(initializer(Normal(init_std), [out_features, in_features], param_dtype), name="weight")
        self.bias = Parameter(initializer("zeros", [out_features], param_dtype), name="bias") if bias else None
        self.compute_dtype = compute_dtype
        self.matmul = ops.MatMul(transpose_b=True)
        self.add_bias = ops.Add()
        # Optional LoRA adapter, attached by ms_deepseek.model.lora.add_adapters (None: plain layer).
        self.lora_A = None  # LoraWeight [r, in]
        self.lora_B = None  # LoraWeight [out, r]
        self.lora_scaling = 0.0
        self.lora_dropout = None
        self.lora_a_matmul = ops.MatMul(transpose_b=True)  # x [N, in] x A^T -> [N, r]
        self.lora_b_matmul = ops.MatMul(transpose_b=True)  # [N, r] x B^T -> [N, out]

    def construct(self, x):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).astype(self.compute_dtype)  # [N, in]
        y = self.matmul(x2, self.weight.astype(self.compute_dtype))  # [N, out]
        if self.bias is not None:
            y = self.add_bias(y, self.bias.astype(self.compute_dtype))
        if self.lora_A is not None:
            h = x2 if self.lora_dropout is None else self.lora_dropout(x2)
            h = self.lora_a_matmul(h, self.lora_A.weight.astype(self.compute_dtype))  # [N, r]
            y = y + self.lora_b_matmul(h, self.lora_B.weight.astype(self.compute_dtype)) * self.lora_scaling
        return y.reshape(lead + (self.out_features,))

    def base_weight(self, dtype):
        """The frozen or trained weight [out, in] as floats of ``dtype`` (QuantLinear: dequantised)."""
        return self.weight.astype(dtype)

    def effective_weight(self, dtype):
        """The weight [out, in] this layer applies, its adapter included (W + scaling * B A): for code that
        uses the matrix itself instead of calling the layer (the absorbed MLA decode step)."""
        w = self.base_weight(dtype)
        if self.lora_A is not None:
            delta = ops.matmul(self.lora_B.weight.astype(dtype), self.lora_A.weight.astype(dtype))  # [out, in]
            w = w + delta * self.lora_scaling
        return w


class RMSNorm(nn.Cell):
    """``weight * x / sqrt(mean(x^2) + eps)``, computed in float32, returned in the input dtype.

    Every op is a named primitive, so the plan can split the norm like its input (``norm`` / ``hidden_norm``
    styles): under a pipeline MindSpore compiles in semi_auto mode, where an op without a strategy splits
    its first axis only, and the hidden stream [B, T, H] with B = 1 per rank would stay whole on every
    tensor-parallel rank instead of split by tokens (sequence parallel). MindFormers names them the same
    way (``LlamaRMSNorm.shard``, ``LLamaDecodeLayer`` under ``use_seq_parallel``).
    """

    def __init__(self, dim: int, eps: float = 1e-6, param_dtype=ms.float32):
        super().__init__()
        self.weight = Parameter(initializer("ones", [dim], param_dtype), name="weight")
        self.eps = eps
        self.cast_in = ops.Cast()
        # x^2 as one Square, not Mul(x, x): the two gradient terms of Mul(x, x), dout * x + dout * x, form the
        # AddN(Mul(AllReduce(X), Y), Z) that MindSpore's AdjustAllReduceMulAdd rewrites to
        # Mul(AllReduce(AddN(Z, X)), Y) without any condition (frontend/optimizer/irpass/arithmetic_simplify.cc,
        # run in opt_a's a_1 list, pipeline/jit/ps/pass.cc), which equals the original only when
        # AllReduce(Z) * Y == Z. When x is an AllReduce's output (the vocabulary-split embedding's, at float32
        # compute where no Cast separates it from the norm) the rewrite drops the variance term of x's gradient.
        # Square's gradient is one term, (dout * x) * 2 (grad_math_ops.cc, the "Square" bprop): no AddN to rewrite
        self.square = ops.Square()
        self.mean = ops.ReduceMean(keep_dims=True)
        self.add_eps = ops.Add()
        self.rsqrt = ops.Rsqrt()
        self.normalize = ops.Mul()
        self.cast_out = ops.Cast()
        self.cast_weight = ops.Cast()
        self.scale = ops.Mul()

    def construct(self, x):
        dtype = x.dtype
        x32 = self.cast_in(x, ms.float32)
        variance = self.mean(self.square(x32), -1)  # [..., 1]
        normed = self.normalize(x32, self.rsqrt(self.add_eps(variance, self.eps)))
        # The batch operand first, the weight second, as in Linear (x @ W^T). Gradient accumulation
        # relies on it: MindSpore marks the *primitive* of the first node (in graph order: depth first,
        # first input first) that consumes a Parameter, and then every node of that primitive must lie
        # on a micro-batch's path (grad_accumulation_utils.cc TagMicroBatchBpEndPrim / TagMicroBatchBpEnd,
        # "Cannot find micro info for node"). With the weight first, the final norm's weight Cast (the
        # one Cast primitive every astype shares, no batch dependence) was that node; with the batch
        # first, the depth-first walk reaches the embedding's own Gather first. Compiled by
        # tests/compile (grad_accum_steps > 1).
        return self.scale(self.cast_out(normed, dtype), self.cast_weight(self.weight, dtype))


class MLP(nn.Cell):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))`` (dense layers and shared experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int, init_std: float, compute_dtype, param_dtype):
        super().__init__()
        kw = dict(init_std=init_std, compute_dtype=compute_dtype, param_dtype=param_dtype)
        self.gate_proj = Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = Linear(intermediate_size, hidden_size, **kw)
        # named, so that the plan splits them like the column-parallel projections' output (parallel_plan/styles.py
        # "swiglu"): left to MindSpore's default strategy under semi_auto they would split the tokens, and every
        # layer's [B, T, I/tp] intermediate would be gathered and split again, forward and backward
        self.act = SiLU()  # ops.auto_generate: the primitive behind ops.silu
        self.act_mul = ops.Mul()

    def construct(self, x):
        return self.down_proj(self.act_mul(self.act(self.gate_proj(x)), self.up_proj(x)))  # [B, T, I] -> [B, T, H]
