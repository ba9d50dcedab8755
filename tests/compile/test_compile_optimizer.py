"""The float32 update of bfloat16 weights, one parameter at a time, by MindSpore's own memory accounting.

``train/optim.py`` updates parameters not stored in float32 with float32 ops, whose temporaries are each as
large as the parameter. MindSpore orders a graph's kernels itself; left to it, every parameter's first
products started as soon as their inputs existed and the rest came later, so the temporaries of all
parameters were live together (v2-sft-64npu's rank 0: 5.1 GiB at 16 layers, docs/planner.md). The update
now starts with an in-place side effect, which MindSpore keeps in program order. Under MindSpore's dry run at
level 1 (the step runs once without kernels; ``memory_block.csv`` has every block's lifetime) the most
float32 update memory live at once must stay within a few temporaries of one parameter; the update as it was
(planted) must not.
"""

import csv
from pathlib import Path

from dryrun import run_dryrun

N_PARAMS = 8
ROWS, COLS = 512, 1024  # one float32 temporary: 2 MiB
TEMP_BYTES = ROWS * COLS * 4

_PROBE = """
import sys
from mindspore.common import dtype as mstype
from ms_deepseek.train.optim import AdamW

N, ROWS, COLS, PLANTED = {n}, {rows}, {cols}, {planted}


class Unchained(AdamW):
    # the composite as it was: nothing orders one parameter's update after another's
    def _composite(self, param, m, v, grad, lr, wd, bc1, bc2):
        g = grad.astype(mstype.float32)
        p = param.astype(mstype.float32)
        m_new = m * self.beta1 + g * (1.0 - self.beta1)
        v_new = v * self.beta2 + g * g * (1.0 - self.beta2)
        p_new = p * (1.0 - lr * wd) - m_new / (ops.sqrt(v_new / bc2) + self.eps) * (lr / bc1)
        p_new = ops.depend(p_new, ops.assign(m, m_new))
        p_new = ops.depend(p_new, ops.assign(v, v_new))
        ops.assign(param, p_new.astype(param.dtype))
        return p_new.astype(param.dtype)


class Chain(nn.Cell):
    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(0)
        self.ws = ms.ParameterTuple(
            [Parameter(Tensor(rng.normal(size=(ROWS, COLS)) * 0.01, mstype.bfloat16), name=f"w{{i}}") for i in range(N)]
        )

    def construct(self, x):
        for w in self.ws:  # [16, ROWS] @ [ROWS, COLS] -> [16, COLS], then back to ROWS by the transpose
            x = ops.matmul(ops.matmul(x, w), w.T)
        return x.astype(mstype.float32).sum()


class Step(nn.Cell):
    def __init__(self, net, optimizer):
        super().__init__()
        self.net, self.optimizer = net, optimizer
        self.grad = ops.GradOperation(get_by_list=True)
        self.params = ms.ParameterTuple(net.trainable_params())

    def construct(self, x):
        return self.optimizer(self.grad(self.net, self.params)(x))


net = Chain()
optimizer = (Unchained if PLANTED else AdamW)(net.trainable_params(), 1e-3, weight_decay=0.1)
Step(net, optimizer)(Tensor(np.ones((16, ROWS)), mstype.bfloat16))
print("STEP RAN")
"""


def _most_update_memory_live(folder: Path) -> int:
    """Largest sum of live kernel outputs of the optimizer's scope over the step (bytes)."""
    found = sorted(folder.rglob("memory_block.csv"))
    assert found, f"no memory_block.csv under {folder}"
    events = []
    with open(found[0], newline="") as f:
        for row in csv.DictReader(f):
            if row["type"] == "Kernel" and "/optimizer-" in row["node_name"]:
                size = int(row["size"])
                events.append((int(row["start_time_stamp"]), size))
                events.append((int(row["end_time_stamp"]), -size))
    assert events, f"{found[0]}: no kernel block of the optimizer"
    live = most = 0
    for _, delta in sorted(events, key=lambda e: (e[0], e[1])):  # frees before allocations at one time
        live += delta
        most = max(most, live)
    return most


def _run(tmp_path, planted: bool) -> int:
    work = tmp_path / ("planted" if planted else "ours")
    work.mkdir()
    code = _PROBE.format(n=N_PARAMS, rows=ROWS, cols=COLS, planted=planted)
    rc, out = run_dryrun(code, work, world=1, level=1, extra_env={"MS_ALLOC_CONF": "memory_tracker:True"})
    assert rc == 0 and "STEP RAN" in out, out[-3000:]
    return _most_update_memory_live(work)


def test_bf16_weights_update_one_parameter_at_a_time_and_the_unchained_update_does_not(tmp_path):
    ours = _run(tmp_path, planted=False)
    planted = _run(tmp_path, planted=True)
    # a handful of one parameter's float32 temporaries (MindSpore frees each after its last reader)
    assert ours <= 6 * TEMP_BYTES, f"ours: {ours / 2**20:.0f} MiB of update temporaries live at once"
    # the planted update holds several temporaries of every parameter at once
    assert planted >= 2 * N_PARAMS * TEMP_BYTES, f"planted: {planted / 2**20:.0f} MiB"
