"""The model's dataflow as the parallel-rules lint (:mod:`.lint`) reads it: the declared producer -> consumer
edges of the attention, MLP, router and MoE (``EDGES``), the residual stream's producers and consumers, and the
layout transforms (reshapes and transposes) between the two ends of an edge (``TRANSFORMS``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

from ms_deepseek.parallel_plan.styles import Mesh

Layout = Tuple[int, ...]


# ------------------------------------------------------------ layout transforms
def _same(layout: Layout, mesh: Mesh) -> Layout:
    return layout


def _rows_to_heads(layout: Layout, mesh: Mesh) -> Layout:
    # [N, nh*d] -> reshape [B, T, nh, d] -> transpose(0, 2, 1, 3) [B, nh, T, d]; N is rank-major over B
    return (layout[0], layout[1], 1, 1)


def _heads_to_rows(layout: Layout, mesh: Mesh) -> Layout:
    # [B, nh, T, d] -> transpose(0, 2, 1, 3) [B, T, nh, d] -> reshape [B*T, nh*d]
    b, h, t, d = layout
    if t != 1 or d != 1:
        raise NotExpressible(f"a split of T ({t}) or d ({d}) does not survive the merge into rows")
    return (b, h)


def tokens_to_rows(layout: Layout, mesh: Mesh) -> Layout:
    # [B, T, H] -> reshape [B*T, H]. A split of T survives the merge as (b * t) when each rank holds one
    # sequence (B / b = 1), as every sequence-parallel recipe does (styles.hidden_split); otherwise MindSpore's
    # reshape redistributes (correct, with communication), which this lint does not see.
    b, t, h = layout
    return (b * t, h)


class NotExpressible(Exception):
    """A layout a transform cannot carry (the split does not survive the reshape)."""


TRANSFORMS: Dict[str, Callable[[Layout, Mesh], Layout]] = {
    "same": _same,
    "rows_to_heads": _rows_to_heads,
    "heads_to_rows": _heads_to_rows,
    "tokens_to_rows": tokens_to_rows,
}


# ------------------------------------------------------------------ the edges
@dataclass(frozen=True)
class Edge:
    """``producer`` output ``out`` feeds ``consumer`` input ``inp`` through ``transform``.

    Paths are relative to ``scope`` (a cell path pattern, ``*`` = the layer index); the edge
    applies where the ``requires`` primitive exists (a variant of the model); ``group``
    names the variant for the MoE coverage rule.
    """

    producer: str
    out: int
    consumer: str
    inp: int
    transform: str = "same"
    requires: str = ""
    scope: str = "model.layers.*"
    group: str = ""


def _attention_edges() -> List[Edge]:
    a = "self_attn."
    edges = []
    for q in ("q_proj.matmul", "q_b_proj.matmul"):  # without / with the q low-rank compression
        edges += [
            Edge(a + q, 0, a + "qk_bmm", 0, "rows_to_heads", requires=f"{a}{q}&{a}qk_bmm"),
            Edge(a + q, 0, a + "flash_attention", 0, "rows_to_heads", requires=f"{a}{q}&{a}flash_attention"),
        ]
    edges += [
        Edge(a + "q_a_proj.matmul", 0, a + "q_b_proj.matmul", 0, requires=a + "q_a_proj.matmul"),
        Edge(a + "kv_a_proj_with_mqa.matmul", 0, a + "kv_b_proj.matmul", 0, requires=a + "kv_b_proj.matmul"),
        # eager attention: scores -> fp32 softmax (FP32Softmax) -> probabilities @ v -> o_proj
        Edge(a + "kv_b_proj.matmul", 0, a + "qk_bmm", 1, "rows_to_heads", requires=a + "qk_bmm"),
        Edge(a + "kv_b_proj.matmul", 0, a + "pv_bmm", 1, "rows_to_heads", requires=a + "pv_bmm"),
        Edge(a + "qk_bmm", 0, a + "softmax.impl.op", 0, requires=a + "qk_bmm"),
        Edge(a + "softmax.impl.op", 0, a + "pv_bmm", 0, requires=a + "qk_bmm"),
        Edge(a + "pv_bmm", 0, a + "o_proj.matmul", 0, "heads_to_rows", requires=a + "pv_bmm"),
        # fused attention (Ascend)
        Edge(a + "kv_b_proj.matmul", 0, a + "flash_attention", 1, "rows_to_heads", requires=a + "flash_attention"),
        Edge(a + "kv_b_proj.matmul", 0, a + "flash_attention", 2, "rows_to_heads", requires=a + "flash_attention"),
        Edge(a + "flash_attention", 3, a + "o_proj.matmul", 0, "heads_to_rows", requires=a + "flash_attention"),
    ]
    return edges


def _mlp_edges() -> List[Edge]:
    m = "mlp."
    dense = [
        Edge(m + "gate_proj.matmul", 0, m + "down_proj.matmul", 0, requires=m + "gate_proj.matmul"),
        Edge(m + "up_proj.matmul", 0, m + "down_proj.matmul", 0, requires=m + "up_proj.matmul"),
    ]
    shared = [
        Edge(
            m + "shared_experts.gate_proj.matmul",
            0,
            m + "shared_experts.down_proj.matmul",
            0,
            requires=m + "shared_experts.gate_proj.matmul",
        ),
        Edge(
            m + "shared_experts.up_proj.matmul",
            0,
            m + "shared_experts.down_proj.matmul",
            0,
            requires=m + "shared_experts.up_proj.matmul",
        ),
    ]
    router = [
        Edge(m + "gate.matmul", 0, m + "gate.softmax.impl.op", 0, requires=m + "gate.matmul"),
        Edge(m + "gate.softmax.impl.op", 0, m + "gate.topk", 0, requires=m + "gate.matmul"),
        Edge(m + "gate.softmax.impl.op", 0, m + "gate.group_topk", 0, requires=m + "gate.group_topk"),
    ]
    return dense + shared + router


def _moe_edges() -> List[Edge]:
    """The MoE dataflow as built (one group per dispatch design; an MoE layer must match one)."""
    m = "mlp."
    edges: List[Edge] = []
    # Per-group dispatch (MindFormers MoE v1, ms_deepseek/config/dispatch_shapes.py): tokens [G, N, H],
    # buffer [G, E, C, H] viewed [G/ep, ep, E, C, H], transposed (0, 2, 1, 3, 4) to [G/ep, E, ep, C, H]
    # and read as the 4-D expert input [G/ep, E, ep*C, H]; the same way back before the combine gather.
    grouped = "per-group"
    req = m + "to_experts"
    edges += [
        Edge(m + "gate.topk", 1, m + "lookup.impl.op", 0, "rows_to_kmajor", requires=req, group=grouped),
        Edge(m + "pad_tokens", 0, m + "dispatch_gather", 0, requires=req, group=grouped),
        Edge(m + "dispatch_gather", 0, m + "to_experts", 0, "groups_to_view", requires=req, group=grouped),
        Edge(m + "to_experts", 0, m + "experts.gate_bmm", 0, "view_to_experts", requires=req, group=grouped),
        Edge(m + "to_experts", 0, m + "experts.up_bmm", 0, "view_to_experts", requires=req, group=grouped),
        Edge(m + "experts.gate_bmm", 0, m + "experts.down_bmm", 0, requires=req, group=grouped),
        Edge(m + "experts.down_bmm", 0, m + "from_experts", 0, "experts_to_view", requires=req, group=grouped),
        Edge(m + "from_experts", 0, m + "combine_gather", 0, "view_to_groups", requires=req, group=grouped),
    ]
    return edges


def _rows_to_groups(layout: Layout, mesh: Mesh) -> Layout:
    # [G*N, X] -> reshape [G, N, X]: a row split by dp lands on G (rank-major rows)
    return (layout[0], 1, layout[1])


def _rows_to_kmajor(layout: Layout, mesh: Mesh) -> Layout:
    # topk ids [G*N, k] -> [G, N, k] -> transpose [G, k, N] -> reshape [G, k*N] (the lookup's k-major input)
    if layout[1] != 1:
        raise NotExpressible(f"a split of k ({layout[1]}) does not survive the k-major merge")
    return (layout[0], 1)


# How the layouts below are derived (MindSpore's rules, read in its sources, not run here):
# * a Reshape keeps each device's slice: a split of a merged axis lands on its major (leftmost) part
#   first, and an axis split by the reshape's output must be the input's split (reshape_info.cc
#   ReshapeInfo::InferTensorMap / tensor_layout's ExpandTensorShape; MindFormers' MoEV2 reshapes
#   [dp, E, C, H] -> (dp_moe, ep, E, C, H) on exactly this rule);
# * a Transpose's output layout is its input strategy permuted (transpose_info.cc
#   TransposeInfo::InferTensorMap / GetOutputsStrategy: output[i] = input[perm[i]]); the primitive
#   carries the strategy of its input, so the edge transform applies the permutation;
# * a BatchMatMul of a 4-D x on a 3-D weight keeps x's leading axis (matmul_info.cc SetDevMatrixShape,
#   its example [2,4,8,16] x [4,16,32] -> [2,4,8,16,32]); the output is x's batch axes, rows, columns.
# The reshape rule is read from MindFormers' use of it and MindSpore's docs (the C++ snapshot of
# reshape_info.cc was not read here); transpose_info.cc and matmul_info.cc were read.


def _split_major(split: int, sizes: Sequence[int], what: str) -> Tuple[int, ...]:
    """The split of an axis merged from ``sizes`` (major first) spread over them, major part first."""
    out, left = [], split
    for size in sizes:
        k = left if size % left == 0 else size
        if left % k:
            raise NotExpressible(f"a split {split} of {what} does not map onto its parts {tuple(sizes)}")
        out.append(k)
        left //= k
    if left != 1:
        raise NotExpressible(f"a split {split} of {what} does not map onto its parts {tuple(sizes)}")
    return tuple(out)


def _groups_to_view(layout: Layout, mesh: Mesh) -> Layout:
    # [G, E, C, H] -> reshape [G/ep, ep, E, C, H] (G = dp): a G split by dp lands on (dp/ep, ep)
    ep = mesh.ep if mesh.dp % mesh.ep == 0 else 1
    return _split_major(layout[0], (mesh.dp // ep, ep), "G") + tuple(layout[1:])


def _merge(splits: Sequence[int]) -> int:
    out = 1
    for k in splits:
        out *= k
    return out


def _view_to_experts(layout: Layout, mesh: Mesh) -> Layout:
    # transpose (0, 2, 1, 3, 4): [G/ep, ep, E, C, H] -> [G/ep, E, ep, C, H]; reshape -> [G/ep, E, ep*C, H]
    u, a, e, c, h = layout
    return (u, e, _merge((a, c)), h)


def _experts_to_view(layout: Layout, mesh: Mesh) -> Layout:
    # [G/ep, E, ep*C, H] -> reshape [G/ep, E, ep, C, H]: a split of ep*C lands on ep first
    u, e, m, h = layout
    ep = mesh.ep if mesh.dp % mesh.ep == 0 else 1
    if m % ep and ep % m:
        raise NotExpressible(f"a split {m} of ep*C does not map onto [ep, C] (ep {ep})")
    a = ep if m % ep == 0 else m
    return (u, e, a, m // a, h)


def _view_to_groups(layout: Layout, mesh: Mesh) -> Layout:
    # transpose (0, 2, 1, 3, 4): [G/ep, E, ep, C, H] -> [G/ep, ep, E, C, H]; reshape -> [G, E*C, H]
    u, e, a, c, h = layout
    return (u * a, e * c, h)


TRANSFORMS.update(
    {
        "rows_to_groups": _rows_to_groups,
        "rows_to_kmajor": _rows_to_kmajor,
        "groups_to_view": _groups_to_view,
        "view_to_experts": _view_to_experts,
        "experts_to_view": _experts_to_view,
        "view_to_groups": _view_to_groups,
    }
)


# The residual stream: the hidden states between the sub-layers, split as styles.hidden_split says ([B, T, H]; the
# lint compares it as rows [B*T, H]). Producers write into it: their output must have its layout. Consumers
# read it: the norms' output keeps it, so the matmuls after a norm read it too. A ``>transform`` maps a
# producer's output (or the stream, for a consumer) onto the compared form; ``<transform`` maps the consumer's own
# strategy instead (``<tokens_to_rows``: a consumer on [B, T, H], compared as rows).
RESIDUAL_PRODUCERS = (
    "model.embed_tokens.gather:0>tokens_to_rows",
    "model.embed_cast:0>tokens_to_rows",
    "model.layers.*.self_attn.o_proj.matmul:0",
    "model.layers.*.mlp.down_proj.matmul:0",
    "model.layers.*.mlp.shared_experts.down_proj.matmul:0",
    "model.layers.*.attn_cast:0>tokens_to_rows",
    "model.layers.*.attn_residual:0>tokens_to_rows",
    "model.layers.*.mlp_cast:0>tokens_to_rows",
    "model.layers.*.mlp_residual:0>tokens_to_rows",
)
RESIDUAL_CONSUMERS = (
    "model.layers.*.input_layernorm.cast_in:0<tokens_to_rows",
    "model.layers.*.post_attention_layernorm.cast_in:0<tokens_to_rows",
    "model.norm.cast_in:0<tokens_to_rows",
    "model.layers.*.attn_residual:0<tokens_to_rows",
    "model.layers.*.attn_residual:1<tokens_to_rows",
    "model.layers.*.mlp_residual:0<tokens_to_rows",
    "model.layers.*.mlp_residual:1<tokens_to_rows",
    "model.layers.*.self_attn.q_proj.matmul:0",
    "model.layers.*.self_attn.q_a_proj.matmul:0",
    "model.layers.*.self_attn.kv_a_proj_with_mqa.matmul:0",
    "model.layers.*.mlp.gate_proj.matmul:0",
    "model.layers.*.mlp.up_proj.matmul:0",
    "model.layers.*.mlp.gate.matmul:0",
    "model.layers.*.mlp.shared_experts.gate_proj.matmul:0",
    "model.layers.*.mlp.shared_experts.up_proj.matmul:0",
    "model.layers.*.mlp.pad_tokens:0>rows_to_groups",
    "lm_head.matmul:0",
)

EDGES: List[Edge] = _attention_edges() + _mlp_edges() + _moe_edges()
