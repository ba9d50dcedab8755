"""Planner with a quantized frozen base (recipe ``quant:``, ``plan --quant-bits/--quant-group-size``):
bytes of the int8 / int4 weights, their scales and the dequantisation workspace, counted by hand
from the model's inventory of a small config; the recipe and CLI forms; bad input."""

import json

import pytest

from ms_deepseek.cli import main
from ms_deepseek.config.lora import LoraSpec, lora_inventory
from ms_deepseek.config.model import get_preset
from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.config.quant import QuantSpec
from ms_deepseek.core.errors import UserError
from ms_deepseek.parallel_plan.costs import param_bytes
from ms_deepseek.parallel_plan.planner import estimate
from ms_deepseek.parallel_plan.workload import Precision, Workload

from repo_paths import REPO

# tiny, two layers: layer 0 dense, layer 1 MoE (8 routed experts, one shared); bf16 base
CFG = get_preset("tiny", num_hidden_layers=2, param_dtype="bfloat16", compute_dtype="bfloat16")
LORA = LoraSpec(r=4, target_modules=["o_proj"])

# Hand count of the tiny shapes (H 192, V 4096, 4 heads, q_lora 96, qk 32+16, kv_lora 64, v 32,
# dense I 512, expert I 128, E 8, one shared expert of width 128), each weight as [lead.., out, in].
ATTENTION = [(96, 192), (4 * 48, 96), (64 + 16, 192), (4 * (32 + 32), 64), (192, 4 * 32)]  # q_a, q_b, kv_a, kv_b, o
DENSE = [(512, 192), (512, 192), (192, 512)]
EXPERTS = [(8, 128, 192), (8, 128, 192), (8, 192, 128)]
SHARED = [(128, 192), (128, 192), (192, 128)]
QUANTIZED = ATTENTION + DENSE + ATTENTION + EXPERTS + SHARED
KEPT_BF16 = (
    4096 * 192  # embed_tokens
    + 2 * (192 + 192 + 96 + 64)  # input / post-attention norms, q_a / kv_a layernorms, per layer
    + 192  # final norm
    + 4096 * 192
)  # lm_head
ROUTER_F32 = 8 * 192
PLACEMENT_I32 = 8 * 2
ADAPTERS_F32 = 2 * (4 * 128 + 192 * 4)  # o_proj lora_A [4, 128] + lora_B [192, 4], both layers


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def _held(quant, parallel=ParallelConfig()):  # noqa: B008 (read, never mutated)
    inv = lora_inventory(CFG, LORA)
    return param_bytes(CFG, parallel, Precision(compute_bytes=2), inv, quant=quant)[0]


def test_int8_per_channel_bytes_by_hand():
    held = _held(QuantSpec(bits=8, group_size=None))
    base = sum(_numel(s) for s in QUANTIZED)  # one byte per element
    assert held["weights"] == base + 2 * KEPT_BF16 + 4 * ROUTER_F32 + 4 * PLACEMENT_I32 + 4 * ADAPTERS_F32
    # one float32 scale and one float32 offset per output channel (and per expert): [.., out]
    assert held["scales"] == (4 + 4) * sum(_numel(s[:-1]) for s in QUANTIZED)
    # the largest weight dequantised to float32: the stacked routed gate_proj [8, 128, 192]
    assert held["dequant"] == 4 * 8 * 128 * 192
    # the quantized weights keep no cast copy; the fp32 adapters keep their bf16 casts (``casts``: not gathered,
    # held from each layer's forward to its backward, also under full recompute)
    assert held["casts"] == 2 * ADAPTERS_F32 and held["copies"] == 0


def test_int4_group_bytes_by_hand():
    held = _held(QuantSpec(bits=4, group_size=32))
    base = sum(_numel(s) for s in QUANTIZED) // 2  # two values per byte
    assert held["weights"] == base + 2 * KEPT_BF16 + 4 * ROUTER_F32 + 4 * PLACEMENT_I32 + 4 * ADAPTERS_F32
    # one float32 scale and offset per 32 input columns: [.., in / 32, out]
    assert held["scales"] == (4 + 4) * sum(_numel(s) // 32 for s in QUANTIZED)
    assert held["dequant"] == 4 * 8 * 128 * 192
    # against the bf16 base: the same inventory without quant
    bf16 = _held(None)
    assert bf16["weights"] - held["weights"] == 2 * sum(_numel(s) for s in QUANTIZED) - base


def test_expert_parallel_splits_quantized_experts_and_their_scales():
    held = _held(QuantSpec(bits=8), ParallelConfig(dp=2, ep=2))
    per_rank_experts = [(4,) + s[1:] for s in EXPERTS]  # 4 of the 8 experts on each rank
    quantized = ATTENTION + DENSE + ATTENTION + per_rank_experts + SHARED
    assert held["weights"] == (
        sum(_numel(s) for s in quantized) + 2 * KEPT_BF16 + 4 * ROUTER_F32 + 4 * PLACEMENT_I32 + 4 * ADAPTERS_F32
    )
    assert held["scales"] == (4 + 4) * sum(_numel(s[:-1]) for s in quantized)
    # the largest dequantised weight is now a dense one: [512, 192] = [4, 128, 192] elements
    assert held["dequant"] == 4 * 512 * 192


def test_estimate_totals_include_scales_and_workspace():
    w = Workload(seq_len=64, global_batch_size=1, lora=LORA, quant=QuantSpec(bits=4, group_size=32))
    quant = estimate(CFG, ParallelConfig(), w, world_size=1)
    plain = estimate(CFG, ParallelConfig(), Workload(seq_len=64, global_batch_size=1, lora=LORA), world_size=1)
    q, p = quant.worst, plain.worst
    assert q.scales == 8 * sum(_numel(s) // 32 for s in QUANTIZED) and q.dequant_workspace == 4 * 8 * 128 * 192
    assert p.scales == p.dequant_workspace == 0
    assert q.total - p.total == pytest.approx(
        (q.weights - p.weights) + q.scales + q.dequant_workspace + (q.weight_copies - p.weight_copies)
    )
    assert q.weights < p.weights


def test_ordered_accumulation_holds_each_later_micro_batchs_unpacked_base():
    """Without MindSpore's accumulation pass (train/step.py OrderedAccumulation) the unpacking of a quantized
    base reads only Parameters, so MindSpore runs each later micro-batch's at the step's start: one
    compute-dtype image of every quantized weight per micro-batch after the first (level 1 of
    v2-lite-qlora-1npu at 2 micro-batches). A sharded layout's accumulation pass does not hoist it."""
    quant = QuantSpec(bits=4, group_size=32)
    assert _held(quant)["dequantized"] == 2 * sum(_numel(s) for s in QUANTIZED)  # bfloat16 images
    for par, images in ((ParallelConfig(), 2), (ParallelConfig(dp=2, ep=2), 0)):
        held = _held(quant, par)["dequantized"]
        acts = [
            estimate(CFG, par, Workload(seq_len=64, global_batch_size=k * par.dp, lora=LORA, quant=quant)).worst
            for k in (1, 3)
        ]
        assert acts[1].activations - acts[0].activations == pytest.approx(images * held)


def test_quant_needs_lora_and_a_dividing_group():
    with pytest.raises(UserError, match=r"^quant: a quantized base is frozen, so it needs LoRA"):
        estimate(CFG, ParallelConfig(), Workload(seq_len=64, global_batch_size=1, quant=QuantSpec(bits=8)))
    with pytest.raises(
        UserError,
        match=r"^quant.group_size: 48 does not divide the input width 64 of "
        r"model.layers.0.self_attn.kv_b_proj.weight$",
    ):
        estimate(
            CFG,
            ParallelConfig(),
            Workload(seq_len=64, global_batch_size=1, lora=LORA, quant=QuantSpec(bits=8, group_size=48)),
        )
    # tp 4 splits o_proj's 128 input columns into 32: a group of 64 divides every whole width (q_proj
    # instead of q_a / q_b) but not that slice
    cfg = CFG.replace(q_lora_rank=None)
    r = estimate(
        cfg,
        ParallelConfig(tp=4),
        Workload(seq_len=64, global_batch_size=1, lora=LORA, quant=QuantSpec(bits=4, group_size=64)),
        world_size=4,
    )
    assert r.problems == [
        "quant.group_size: 64 does not divide the 32 input columns of "
        "model.layers.0.self_attn.o_proj.weight on one NPU (input width 128 split 4 ways)"
    ]
    assert not r.fits


# ------------------------------------------------------------------------------------- the CLI
ARGS = [
    "plan",
    "--model",
    "tiny",
    "--npus",
    "1",
    "--dp",
    "1",
    "--seq-len",
    "64",
    "--global-batch",
    "1",
    "--lora-r",
    "4",
    "--lora-targets",
    "o_proj",
]


def _cli(capsys, *args):
    capsys.readouterr()
    code = main(list(args))
    return code, capsys.readouterr()


def test_cli_quant_flags_show_the_quantized_base(capsys):
    code, out = _cli(capsys, *ARGS, "--quant-bits", "4", "--quant-group-size", "32", "--json")
    data = json.loads(out.out)
    assert code == 0 and data["workload"]["quant"] == {"bits": 4, "group_size": 32}
    code, out = _cli(capsys, *ARGS)
    assert code == 0 and "scales" not in out.out
    code, out = _cli(capsys, *ARGS, "--quant-bits", "8")
    assert code == 0
    assert "quantized base: int8, one scale per output channel" in out.out
    assert "  scales " in out.out and "  dequant_workspace " in out.out


def test_cli_quant_bits_other_than_4_or_8(capsys):
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:  # argparse's choices (it prints the usage first)
        main([*ARGS, "--quant-bits", "3"])
    out = capsys.readouterr()
    assert exc.value.code == 2 and out.out == ""
    assert out.err.strip().splitlines()[-1] == (
        "ms-deepseek plan: error: argument --quant-bits: invalid choice: 3 (choose from 4, 8)"
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--quant-bits", "4", "--quant-group-size", "7"],
            "--quant-group-size: int4 packs two values per byte, so the group size must be even, got 7",
        ),
        (
            ["--quant-bits", "4", "--quant-group-size", "100"],
            "quant.group_size: 100 does not divide the input width 192 of model.layers.0.self_attn.q_a_proj.weight",
        ),
        (["--quant-group-size", "32"], "--quant-group-size: needs --quant-bits (4 or 8)"),
    ],
)
def test_cli_quant_bad_input_is_one_line(capsys, extra, message):
    code, out = _cli(capsys, *ARGS, *extra)
    assert code == 2 and out.out == ""
    assert out.err.strip().splitlines() == [f"ms-deepseek plan: error: {message}"]


def test_cli_quant_without_lora_is_refused(capsys):
    code, out = _cli(capsys, *ARGS[:-4], "--quant-bits", "8")
    assert code == 2 and out.err.strip() == (
        "ms-deepseek plan: error: --quant-bits: only with LoRA (--lora-r or a "
        "recipe lora: section): a quantized base is frozen"
    )


# ------------------------------------------------------------------------------ the recipes
ONE_NODE = {
    "v2-qlora-8npu": {"bits": 4, "group_size": 128},
    "v2-lite-lora-1npu": None,
    "v2-lite-qlora-1npu": {"bits": 4, "group_size": 64},
}


@pytest.mark.parametrize(
    "name",
    sorted(ONE_NODE),
)
def test_one_node_recipes_fit_with_4_gb_to_spare(capsys, name):
    recipe = str(REPO / "recipes" / f"{name}.yaml")
    code, out = _cli(capsys, "plan", "--recipe", recipe, "--json")
    data = json.loads(out.out)
    assert code == 0 and data["fits"] and data["workload"]["quant"] == ONE_NODE[name]
    assert data["memory_gb"]["usable"] - data["memory_gb"]["total"] >= 4.0
    if name == "v2-lite-qlora-1npu":  # at 16K tokens the int4 base is what fits: the bf16 base does not
        assert data["workload"]["seq_len"] >= 16384
        bf16 = recipe.replace("v2-lite-qlora-1npu", "v2-lite-lora-1npu")  # the same job on the bf16 base
        code, out = _cli(
            capsys, "plan", "--recipe", bf16, "--set", f"data.seq_len={data['workload']['seq_len']}", "--json"
        )
        assert code == 1 and not json.loads(out.out)["fits"]
    if name == "v2-qlora-8npu":  # 236B on 8 NPUs: the int8 base leaves less than the 4 GB margin
        code, out = _cli(
            capsys, "plan", "--recipe", recipe, "--quant-bits", "8", "--set", "quant.group_size=null", "--json"
        )
        bf = json.loads(out.out)["memory_gb"]
        assert bf["usable"] - bf["total"] < 4.0
