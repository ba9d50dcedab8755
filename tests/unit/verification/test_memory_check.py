"""MindSpore's level-1 memory accounting read beside the planner (verification/compile/memory_accounting.py)."""

import pytest

from ms_deepseek.parallel_plan.costs import GB, StageMemory
from ms_deepseek.verification.compile import memory_accounting as mc

HEADER = (
    "start_time_stamp,end_time_stamp,device_addr,stream_id,pool_type,size,actual_used_memory,"
    "actual_peak_memory,file_name,line_num,type,producer_task,task_name,node_name,graph_name,user_tasks,"
    "last_user_task,python_stack,is_persistent,is_small,\n"
)
MIB = 2**20


def _row(start, end, size, used, kind, node):
    return f"{start},{end},0x0,0,Pool,{size},{used},{used},f.cc,1,{kind},0,t,{node},,{{}},0,,0,0,\n"


def _dump(tmp_path):
    """weights 8 MiB, Adam states 2 x 8 MiB, forward output 4 MiB (freed at 30), an AllGather output 2 MiB,
    a backward output 4 MiB allocated at 20 (the peak), a constant 1 MiB."""
    rows = [
        _row(1, 10**9, MIB, MIB, "ConstantValue", "Default/data-1"),
        _row(2, 10**9, 8 * MIB, 9 * MIB, "Weight", "model.layers.0.w"),
        _row(3, 10**9, 8 * MIB, 17 * MIB, "Weight", "adam_m.model.layers.0.w"),
        _row(4, 10**9, 8 * MIB, 25 * MIB, "Weight", "adam_v.model.layers.0.w"),
        _row(10, 30, 4 * MIB, 29 * MIB, "Kernel", "Default/network/model/MatMul-op3"),
        _row(12, 25, 2 * MIB, 31 * MIB, "Kernel", "Default/network/model/AllGather-op1"),
        _row(20, 22, 4 * MIB, 35 * MIB, "Kernel", "Gradients/Default/network/model/Grad_MatMul/MatMul-op9"),
        _row(40, 50, 3 * MIB, 28 * MIB, "Kernel", "Default/network/model/Add-op2"),
    ]
    path = tmp_path / "memory_block.csv"
    path.write_text(HEADER + "".join(rows))
    return path


def test_blocks_live_at_the_peak_are_grouped_as_the_planner_groups_them(tmp_path):
    got = mc.blocks_at_peak(_dump(tmp_path))
    assert got["tracker_peak_mb"] == 35.0
    assert got["at_peak_mb"] == {
        "weights": 8.0,
        "optimizer": 16.0,
        "accumulated_gradients": 0.0,
        "activations": 4.0,
        "backward": 4.0,
        "communication": 2.0,
        "other": 1.0,
    }
    assert sum(got["at_peak_mb"].values()) == got["tracker_peak_mb"]  # the live blocks are the peak
    assert {"category": "optimizer", "name": "adam_m", "blocks": 1, "mb": 8.0} in got["largest_at_peak"][:3]


def test_read_accounting_takes_mindspores_printed_peaks_and_says_when_there_are_none(tmp_path):
    _dump(tmp_path)
    log = tmp_path / "worker.log"
    log.write_text(
        "noise\nUsed peak memory usage (without fragments): 35M\nActual peak memory usage (with fragments): 40M\n"
    )
    got = mc.read_accounting(log, tmp_path)
    assert (got["used_peak_mb"], got["actual_peak_mb"], got["tracker_peak_mb"]) == (35, 40, 35.0)
    log.write_text("the step never ran\n")
    assert "no 'Used peak memory usage' line" in mc.read_accounting(log, tmp_path)["error"]


def test_compare_puts_each_planner_part_beside_mindspores_and_keeps_the_margin_apart(tmp_path):
    acct = mc.blocks_at_peak(_dump(tmp_path))
    stage = StageMemory(
        stage=0,
        layers=1,
        weights=8 * MIB,
        optimizer=16 * MIB,
        activations=3 * MIB,
        working_set=5 * MIB,
        comm_buffers=2 * MIB,
        hccl_buffers=100 * MIB,
        workspace=GB,
    )
    c = mc.compare(stage, acct, rank=0, layers=1)
    rows = {name: (round(p * GB / MIB, 3), round(m * GB / MIB, 3)) for name, p, m in c.rows}
    assert rows["weights"] == (8, 8) and rows["optimizer states"] == (16, 16)
    assert rows["activations + backward"] == (8, 8) and rows["communication"] == (2, 2)
    assert rows["other (constants, inputs)"] == (0, 1)
    assert round(c.ratio, 4) == round(34 / 35, 4)
    assert round(c.margin * GB / MIB) == 100 + 1024  # HCCL + workspace: the planner's, not MindSpore's


def test_extrapolation_is_the_least_squares_line():
    assert mc.extrapolate([(2, 10.0)], 27) is None
    value, slope = mc.extrapolate([(2, 10.0), (3, 12.5)], 27)
    assert (round(value, 6), round(slope, 6)) == (72.5, 2.5)
    value, slope = mc.extrapolate([(1, 1.0), (2, 2.0), (3, 4.0)], 4)
    assert round(slope, 6) == 1.5 and round(value, 6) == round(7 / 3 + 1.5 * 2, 6)


@pytest.mark.parametrize(
    "node,kind,want",
    [
        ("accu_grads.model.w", "Weight", "accumulated_gradients"),
        ("Default/x/_MicroStepAllGather-op1", "Kernel", "communication"),
        ("Gradients/Default/x/AlltoAll-op3", "Kernel", "communication"),
        ("Default/x/SendOp", "Other", "other"),
    ],
)
def test_block_category(node, kind, want):
    assert mc.block_category(kind, node) == want
