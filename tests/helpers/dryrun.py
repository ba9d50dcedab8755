"""Run a Python snippet under MindSpore's dry run (compile only, a simulated world, device Ascend) with the
stub CANN libraries (ms_deepseek.verification.cann_stubs): what the compile tier (tests/compile) uses to
have MindSpore's own compiler judge a graph."""

import subprocess
import sys
import textwrap
from pathlib import Path

PRELUDE = """
import numpy as np
import mindspore as ms
from mindspore import nn, ops, Tensor, Parameter
from mindspore.communication import init
ms.set_device("Ascend")
ms.set_context(mode=ms.GRAPH_MODE)
init()
"""


def dryrun_env(world: int, rank: int = 0, level: int = 0):
    """Level 0 compiles; level 1 also runs the step once without kernels, accounting device memory."""
    from ms_deepseek.verification.cann_stubs import ensure_stubs

    env = ensure_stubs(level=level).env()
    env.update(
        {
            "MS_SIMULATION_LEVEL": str(level),
            "RANK_SIZE": str(world),
            "RANK_ID": str(rank),
            "MS_DEEPSEEK_DEVICE": "Ascend",
            "GLOG_v": "3",
        }
    )
    return env


def run_dryrun(
    code: str, folder: Path, world: int = 8, rank: int = 0, timeout: float = 600, extra_env=None, level: int = 0
):
    """(exit code, combined output) of PRELUDE + ``code`` in a fresh process under the dry run."""
    script = Path(folder) / "probe.py"
    script.write_text(PRELUDE + textwrap.dedent(code))
    env = dryrun_env(world, rank, level)
    env.update(extra_env or {})
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc.returncode, proc.stdout + proc.stderr
