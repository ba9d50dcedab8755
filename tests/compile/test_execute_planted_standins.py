"""A planted mistake in a compiled program that only a strict stand-in catches: ``plan --execute`` of
``v2-lite-sft-8npu`` (flash attention, 2 accumulation steps, full recompute) with one rank's
FlashAttentionScoreGrad nodes rewired to another micro-batch's forward statistics.

On Ascend the gradient kernel computes from the softmax_max / softmax_sum it is given (CANN
FlashAttentionScoreGrad), so a program that hands it another micro-batch's trains wrongly; a stand-in that
recomputed the statistics itself would execute such a program as if it were right. The plant is applied where the
executor decodes the programs (``RankProgram.from_bytes``, in this process); the compile and the one-device run are
the product's own.
"""

import json
import re

from builders import main_captured
from repo_paths import RECIPES

RECIPE = RECIPES / "v2-lite-sft-8npu.yaml"
PLANTED_RANK = 1
SOFTMAX_MAX, SOFTMAX_SUM = 8, 9  # FlashAttentionScoreGrad's inputs (gen_ops_prim.FlashAttentionScoreGrad)


def _layer_of(program, grad) -> str:
    """The decoder layer of a gradient node: that of the (recomputed) forward reading the same q."""
    forward = next(n for n in program.nodes if n.op == "FlashAttentionScore" and n.inputs[0] == grad.inputs[0])
    return re.search(r"layers-CellList/(\d+)-", forward.scope).group(1)


def _rewire(program) -> int:
    """Every layer's later FlashAttentionScoreGrad (the second micro-batch's: the accumulation unrolls them in
    order) takes the first one's softmax_max and softmax_sum; returns how many were rewired."""
    first_of_layer, rewired = {}, 0
    for node in program.nodes:
        if node.op != "FlashAttentionScoreGrad":
            continue
        first = first_of_layer.setdefault(_layer_of(program, node), node)
        if first is not node:
            assert node.inputs[0] != first.inputs[0]  # another forward call: another micro-batch
            node.inputs[SOFTMAX_MAX], node.inputs[SOFTMAX_SUM] = first.inputs[SOFTMAX_MAX], first.inputs[SOFTMAX_SUM]
            rewired += 1
    return rewired


def test_a_gradient_given_another_micro_batchs_statistics_is_refused(monkeypatch):
    from ms_deepseek.verification.execute import executor as ex

    decode = ex.RankProgram.from_bytes
    rewired = {}

    def from_bytes(cls, rank, data):
        program = decode(rank, data)
        if rank == PLANTED_RANK:
            rewired[rank] = _rewire(program)
        return program

    monkeypatch.setattr(ex.RankProgram, "from_bytes", classmethod(from_bytes))
    code, out, _ = main_captured(["plan", "--recipe", str(RECIPE), "--execute", "--json"])
    report = json.loads(out)
    assert rewired.get(PLANTED_RANK, 0) >= 1, rewired  # the plant found the second micro-batch's gradients
    brief = {k: report[k] for k in ("agrees", "error", "loss", "first_failure", "largest_difference")}
    assert code == 1 and not report["agrees"], brief
    # refused while executing step 1: no step's loss was recorded, nothing after the starting values was compared
    assert report["loss"] == [] and report["first_failure"] is None, brief
    assert report["largest_difference"] is None or report["largest_difference"]["step"] == 0, brief
    assert re.match(
        rf"step 1: rank {PLANTED_RANK}: FlashAttentionScoreGrad at \S+: its input softmax_max disagrees with the forward",
        report["error"],
    ), brief
