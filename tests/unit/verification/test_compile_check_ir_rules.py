"""The compile check's rules on MindSpore's validate IR, through ``compile.check.run_rank`` with the worker
replaced by a stand-in that writes what a worker writes (its result.json and the IR dump): the graph is refused,
naming what the rule found. MindSpore's own IR for these rules is in tests/compile (test_compile_planted.py)."""

import json

from ms_deepseek.verification.compile import check as cc
from ms_deepseek.verification.compile import ir_rules

# Two operators of one attention as MindSpore prints them after its validate pass: an operator line, its
# ": (inputs) -> (output)" line and its scope. The first holds all 4 heads of a [B, nh, T, d] tensor. Before them
# the Load of an expert weight [E, H, I] whose shape reads like [nh, T, d], with an attention scope (MindSpore gives a
# Load the scope of a user): a parameter, not a gathered activation.
_IR = """
  %56(CNode_0) = Load(%para16_model.layers.1.mlp.experts.down_proj.weight, UMonad[U]) cnode_attrs: {checkpoint: Bool(1)}
      : (<Ref[Tensor[Float32]], (4, 32, 8), ref_key=model.layers.1.mlp.experts.down_proj.weight, is_parameter>, <UMonad, NoShape>) -> (<Tensor[Float32], (4, 32, 8)>)
      # Fullname with scope: (recompute_Default/model-DeepseekV2Model/layers-CellList/0-DecoderLayer/self_attn-MLAttention/q_a_proj-Linear/Load-op9)
  %57(CNode_1) = PrimFunc_StridedSlice(%56, (I64(0), I64(0), I64(0), I64(0))) {in_strategy: ((1, 1, 1, 1))}
      : (<Tensor[BFloat16], (1, 4, 32, 16)>) -> (<Tensor[BFloat16], (1, 4, 32, 8)>)
      # Fullname with scope: (Default/model-DeepseekV2Model/layers-CellList/0-DecoderLayer/self_attn-MLAttention/StridedSlice-op0)
  %58(CNode_2) = PrimFunc_StridedSlice(%55, (I64(0), I64(0), I64(0), I64(0))) {in_strategy: ((1, 2, 1, 1))}
      : (<Tensor[BFloat16], (1, 2, 32, 16)>) -> (<Tensor[BFloat16], (1, 2, 32, 8)>)
      # Fullname with scope: (Default/model-DeepseekV2Model/layers-CellList/0-DecoderLayer/self_attn-MLAttention/StridedSlice-op1)
"""


def _stand_in_worker(ir_text):
    def run(cmd, cwd, env, stdout, stderr, timeout):
        folder = cwd
        ir = folder / "ir" / "rank_1"
        ir.mkdir(parents=True)
        (ir / "20_validate_0900.ir").write_text(ir_text)
        result = {"stage": 0, "graphs": {"train": {"ok": True, "layouts_compared": 3, "strategies_compared": 5}}}
        (folder / "result.json").write_text(json.dumps(result))

    return run


def test_a_graph_holding_every_head_on_each_rank_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(cc.subprocess, "run", _stand_in_worker(_IR))
    monkeypatch.setattr(cc, "compile_environment", lambda *a, **k: ({}, "stand-in"))
    heads = cc.HeadShape(heads=4, tp=2, tokens=32, head_dims=(8, 16, 32))
    result = cc.run_rank(cc.RankJob({}, 8, None, tmp_path, eval_graph=False, heads=heads), 1)
    train = result.graphs["train"]
    assert train["ok"] is False
    assert [g["shape"] for g in train["gathered_heads"]] == [[1, 4, 32, 8]]
    assert "all 4 heads on each of the 2 tensor-parallel ranks" in train["error"]
    assert "self_attn-MLAttention/StridedSlice-op0" in train["error"]

    # the same IR with the heads split as planned (tp 1: nothing to gather) passes
    (tmp_path / "rank_00001").rename(tmp_path / "first")
    whole = cc.HeadShape(heads=4, tp=1, tokens=32, head_dims=(8, 16, 32))
    assert cc.run_rank(cc.RankJob({}, 8, None, tmp_path, eval_graph=False, heads=whole), 1).graphs["train"]["ok"]


# Recomputed operators of two layers as MindSpore prints them after its validate pass: each tagged with its
# recompute region (recompute.cc InsertRecomputedNodes), reading a layer's weight through a Load and a Cast outside
# any region. Region 0 holds layer 0's and layer 1's matmuls (what one shared operator makes of them).
def _regions_ir(second_region: int) -> str:
    return f"""
subgraph @main() {{
  %1(CNode_1) = Load(%para4_model.layers.0.self_attn.o_proj.weight, UMonad[U]) cnode_attrs: {{checkpoint: Bool(1)}}
  %2(CNode_2) = Load(%para9_model.layers.1.self_attn.o_proj.weight, UMonad[U]) cnode_attrs: {{checkpoint: Bool(1)}}
  %3(CNode_3) = PrimFunc_Cast(%2, I64(43)) cnode_attrs: {{checkpoint: Bool(1)}}
  %4(CNode_4) = PrimFunc_MatMul(%0, %1, Bool(0), Bool(1)) cnode_attrs: {{recompute_sub_graph: U64(0), recompute: Bool(1)}}
  %5(CNode_5) = PrimFunc_MatMul(%4, %3, Bool(0), Bool(1)) cnode_attrs: {{recompute_sub_graph: U64({second_region}), recompute: Bool(1)}}
  %6(CNode_6) = PrimFunc_Mul(%5, %para2_model.norm.weight) cnode_attrs: {{recompute_sub_graph: U64(7)}}
}}
"""


def test_layers_recomputed_as_one_region_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(cc.subprocess, "run", _stand_in_worker(_regions_ir(0)))
    monkeypatch.setattr(cc, "compile_environment", lambda *a, **k: ({}, "stand-in"))
    train = cc.run_rank(cc.RankJob({}, 8, None, tmp_path, eval_graph=False), 1).graphs["train"]
    assert train["ok"] is False
    assert train["joined_recompute_regions"] == [{"region": 0, "layers": [0, 1]}]
    assert "recomputes layers [0, 1] as one region" in train["error"]

    # each layer its own region (region 7 reads no layer's weight): passes
    (tmp_path / "rank_00001").rename(tmp_path / "first")
    monkeypatch.setattr(cc.subprocess, "run", _stand_in_worker(_regions_ir(1)))
    result = cc.run_rank(cc.RankJob({}, 8, None, tmp_path, eval_graph=False), 1)
    assert result.graphs["train"]["ok"], result.graphs
    ir = tmp_path / "one_each.ir"
    ir.write_text(_regions_ir(1))
    assert ir_rules.recompute_regions(ir) == {0: [0], 1: [1], 7: []}
