"""Rules read from the IR MindSpore dumps after its ``validate`` pass (``MS_DEV_SAVE_GRAPHS``): the graph as it will
run, with this rank's slice shapes. ``plan --recipe R --compile`` (:mod:`ms_deepseek.verification.compile.check`)
refuses a graph that breaks one: a folded activation-sized constant, attention computed on every head under
tensor parallelism, layers joined into one recompute region; and reports whether the gradient norm is all-reduced
across the slices. Each operator is one line, then its ``: (inputs) -> (outputs)`` line, then its scope.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ms_deepseek.verification.compile.traffic import ITEMSIZE

# A constant at least this large in the compiled graph is a defect: an activation-shaped tensor the
# compiler folded (e.g. ``ops.zeros`` of a [B, nh, T, 64] pad, whose shape is static) is held in host
# memory through the compile and on the device all run. The model's real constants are smaller than the
# limit (the 2048 x 2048 uint8 causal mask) or as large as one micro-batch's V2-Lite pad slice
# ([1, 16, 4096, 64] bfloat16), which sets it.
LARGE_CONSTANT_MB = 8.0


def large_constants(path: Path, limit_mb: float = LARGE_CONSTANT_MB) -> List[Dict[str, object]]:
    """The tensor constants of one IR file of at least ``limit_mb`` MiB (this rank's slice shapes, as
    MindSpore prints a value node: ``Tensor(shape=[1, 128, 4096, 64], dtype=BFloat16, value=[...])``),
    one entry per shape and dtype with the number of places that use it, largest first."""
    found: Dict[Tuple[str, str], int] = {}
    for m in re.finditer(r"Tensor\(shape=\[([\d, ]*)\], dtype=(\w+), value=", path.read_text(errors="replace")):
        found[(m.group(1), m.group(2))] = found.get((m.group(1), m.group(2)), 0) + 1
    out = []
    for (dims, dtype), uses in found.items():
        shape = [int(d) for d in dims.split(",") if d.strip()]
        mb = math.prod(shape) * ITEMSIZE.get(dtype, 4) / 2**20
        if mb >= limit_mb:
            out.append({"shape": shape, "dtype": dtype, "mb": round(mb, 1), "uses": uses})
    return sorted(out, key=lambda c: -c["mb"])


@dataclass(frozen=True)
class HeadShape:
    """What a per-head attention tensor looks like in the compiled graph: ``heads`` attention heads over
    ``tp`` ranks, ``tokens`` per sequence, and the head sizes the attention slices and pads to."""

    heads: int
    tp: int
    tokens: int
    head_dims: Tuple[int, ...]

    @classmethod
    def of(cls, cfg, tp: int, tokens: int) -> "HeadShape":
        nope, rope, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        dims = {nope, rope, v, nope + rope, nope + v, max(nope + rope, v), tokens}  # + tokens: scores [B, nh, T, S]
        return cls(cfg.num_attention_heads, tp, tokens, tuple(sorted(dims)))


def gathered_heads(path: Path, shape: HeadShape, limit: int = 5) -> List[Dict[str, object]]:
    """Operators of the attention (scope ``MLAttention``) whose output holds all heads although the plan splits
    them by tp: [.., nh, T, d] or [.., T, nh, d] with the global head count next to the tokens and a head size
    (or the key length) after them. MindSpore compiles this when an operation on a per-head tensor has no
    strategy under ``semi_auto`` (its default splits the first axis only: ``model/mla.py``); every rank then
    gathers the heads, computes them all, and the gradients come back at the global shape. Reads the IR the
    way :func:`communication_from_ir` does: an operator line, then its ``: (inputs) -> (output)`` line, then
    ``# Fullname with scope``."""
    if shape.tp <= 1:
        return []
    nh, t = shape.heads, shape.tokens
    found: List[Dict[str, object]] = []
    lines = path.read_text(errors="replace").splitlines()
    op = re.compile(r"= ([A-Za-z_]\w*)\(")
    for i, line in enumerate(lines[:-2]):
        m = op.search(line)
        # a Load reads a parameter (an expert weight [E, H, I] can look like [nh, T, d]), and its scope is any user's
        if not m or m.group(1) == "Load" or "MLAttention" not in lines[i + 2]:
            continue
        out = re.search(r"-> \(<Tensor\[\w+\], \(([\d, ]*)\)>\)", lines[i + 1])
        if not out:
            continue
        dims = [int(d) for d in out.group(1).split(",") if d.strip()]
        for a in range(len(dims) - 2):
            if {dims[a], dims[a + 1]} == {nh, t} and nh != t and dims[a + 2] in shape.head_dims:
                scope = re.search(r"\(([^()]*)\)\s*$", lines[i + 2])
                found.append({"op": m.group(1), "shape": dims, "scope": scope.group(1) if scope else ""})
                break
        if len(found) >= limit:
            break
    return found


def global_norm_reduced(path: Path) -> bool:
    """Whether MindSpore completed the gradient norm across the ranks holding different slices: its
    parallel pass inserts an AllReduce named ``PARALLEL_GLOBALNORM_IN_STAGES`` between the marked square
    sums' AddN and the Sqrt (``step_parallel.cc`` HandleGlobalNormScale; the marker is
    ``train.step._NORM_MARKER``). Without it every rank would clip by its own partial norm."""
    return "PARALLEL_GLOBALNORM" in path.read_text(errors="replace")


_IR_NODE = re.compile(r"^\s+(%\d+)\([^)]*\) = [\w:]+\((.*)$")
_IR_INPUT = re.compile(r"%(?:para\d+_([\w.]+)|(\d+))")
_LAYER_PARAM = re.compile(r"model\.layers\.(\d+)\.")
_REGION = re.compile(r"recompute_sub_graph: U64\((\d+)\)")


def recompute_regions(path: Path, depth: int = 4) -> Dict[int, List[int]]:
    """MindSpore's recompute regions in one IR file: region id -> the decoder layers whose parameters its operators
    read (directly, or through up to ``depth`` operators outside any region: a weight's Load, its Cast to the
    compute dtype, the optimizer shard's AllGather).

    The ids are MindSpore's own: its recompute pass (``frontend/optimizer/recompute.cc`` InsertRecomputedNodes)
    grows each region over connected recomputed operators (GetMaxSubGraph, inputs and outputs), tags every operator
    of it with ``recompute_sub_graph``, and starts the whole region's replay at one point (GetFirstTargetInputs: the
    inputs of the region's first backward operator), so segments that one operator joins replay together. The
    ``validate`` dump keeps the tags on the forward operators and their backward."""
    regions: Dict[int, set] = {}
    graph: Dict[str, Tuple[list, Optional[int]]] = {}  # per subgraph: node -> (inputs, region)
    graphs = [graph]
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("subgraph @"):
                graph = {}
                graphs.append(graph)
                continue
            m = _IR_NODE.match(line)
            if m:
                region = _REGION.search(line)
                args = m.group(2).split(") {")[0]
                graph[m.group(1)] = (_IR_INPUT.findall(args), int(region.group(1)) if region else None)

    for graph in graphs:
        seen: Dict[Tuple[str, int], set] = {}
        for inputs, region in graph.values():
            if region is not None:
                regions.setdefault(region, set()).update(_layers_read(graph, inputs, depth, seen))
    return {k: sorted(v) for k, v in sorted(regions.items())}


def _layers_read(graph: Dict[str, Tuple[list, Optional[int]]], inputs, left: int, seen: Dict) -> set:
    """The decoder layers whose parameters ``inputs`` name, directly or through up to ``left`` operators outside every
    recompute region (memoised in ``seen``)."""
    found = set()
    for param, ref in inputs:
        if param:
            hit = _LAYER_PARAM.match(param)
            if hit:
                found.add(int(hit.group(1)))
            continue
        node = graph.get("%" + ref)
        if node is not None and node[1] is None and left > 0:
            key = ("%" + ref, left)
            if key not in seen:
                seen[key] = _layers_read(graph, node[0], left - 1, seen)
            found |= seen[key]
    return found


def joined_recompute_regions(path: Path) -> List[Dict[str, object]]:
    """The recompute regions of one IR file that read more than one decoder layer's parameters
    (:func:`recompute_regions`). The plan recomputes each layer as its own segment (``parallel_apply.apply``); a
    region over several layers replays all of them at once, at the start of the backward, and holds each replay
    until its own layer's backward. One operator on a table shared by every layer (such as the rotary table,
    ``model/rope.py`` RotaryEmbedding) is enough to join them."""
    return [{"region": k, "layers": v} for k, v in recompute_regions(path).items() if len(v) > 1]
