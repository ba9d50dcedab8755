"""Worker script that ``ms-deepseek doctor`` launches with msrun (one process per device).

Every rank:

1. gathers every rank's host name and software versions (AllGather), so the
   doctor can tell whether all nodes run the same MindSpore / CANN / ms-deepseek;
2. times an AllReduce of ``--mb`` megabytes (float32), after warm-up, and takes
   the slowest rank's time (gathered) as the job's time;
3. writes ``result_rank{R}.json`` into ``--out`` (atomically).

Bandwidth follows the nccl-tests convention: algbw = bytes / time and
busbw = algbw * 2 (n - 1) / n, the traffic each rank's links carry in a ring.
On CPU the collectives go through mccl and the figure is informational.
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import sys
import time
from pathlib import Path

from ms_deepseek.core.atomic import atomic_write_text

VERSION_BYTES = 512


def versions_string() -> str:
    """'python=3.11.4 mindspore=2.9.0 numpy=1.26.4 ms-deepseek=0.1.0 cann=9.0.0' for this process."""
    import importlib.metadata as md

    parts = [f"python={platform.python_version()}"]
    for name in ("mindspore", "numpy", "mindformers"):
        try:
            parts.append(f"{name}={md.version(name)}")
        except md.PackageNotFoundError:
            parts.append(f"{name}=missing")
    try:
        import ms_deepseek

        parts.append(f"ms-deepseek={ms_deepseek.__version__}")
    except ImportError:
        parts.append("ms-deepseek=missing")
    try:
        from ms_deepseek.doctor.core import DoctorContext
        from ms_deepseek.doctor.host import find_cann

        found = find_cann(DoctorContext())
        parts.append(f"cann={found[2] if found else 'none'}")
    except ImportError:
        parts.append("cann=unknown")
    return " ".join(parts)


def _encode(text: str, size: int):
    import numpy as np

    raw = text.encode()[:size]
    buf = np.zeros(size, np.int32)
    buf[: len(raw)] = np.frombuffer(raw, np.uint8)
    return buf


def _decode(row) -> str:
    import numpy as np

    data = np.asarray(row, np.int32)
    return bytes(int(v) for v in data if v).decode(errors="replace")


def _who_runs_what(world: int) -> dict:
    """Every rank's host and versions: AllGather of fixed-size int32 rows ([world * VERSION_BYTES] after the
    gather)."""
    import mindspore as ms
    from mindspore import ops

    info = f"{socket.gethostname()}|{versions_string()}"
    gathered = ops.AllGather()(ms.Tensor(_encode(info, VERSION_BYTES)[None, :])).asnumpy()
    ranks = {}
    for r in range(world):
        host, _, vers = _decode(gathered[r]).partition("|")
        ranks[str(r)] = {"host": host, "versions": vers}
    return ranks


def _parse(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for result_rank{R}.json")
    parser.add_argument("--device", choices=["CPU", "Ascend"], default="CPU")
    parser.add_argument("--mb", type=float, default=64.0, help="AllReduce payload, megabytes")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)

    import mindspore as ms
    import numpy as np
    from mindspore import ops
    from mindspore.communication import get_group_size, get_rank, init

    ms.set_device(args.device)
    init()
    rank, world = get_rank(), get_group_size()

    ranks = _who_runs_what(world)

    # 2. AllReduce timing; a host read of one element waits for the result on CPU and Ascend alike
    numel = max(1, int(args.mb * 1024 * 1024) // 4)
    x = ms.Tensor(np.ones(numel, np.float32))
    all_reduce = ops.AllReduce()
    for _ in range(max(1, args.warmup)):
        y = all_reduce(x)
        y[:1].asnumpy()
    start = time.perf_counter()
    for _ in range(args.iters):
        y = all_reduce(x)
    check = float(y[:1].asnumpy()[0])
    seconds = (time.perf_counter() - start) / args.iters
    # slowest rank's time; AllGather because CPU's AllReduce only sums ([world] after the gather)
    slowest = float(ops.AllGather()(ms.Tensor([seconds], ms.float32)).asnumpy().max())

    nbytes = numel * 4
    algbw = nbytes / slowest / 1e9
    result = {
        "ok": abs(check - world) < 1e-3,
        "rank": rank,
        "world": world,
        "device": args.device,
        "bytes": nbytes,
        "seconds": slowest,
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * 2 * (world - 1) / world,
        "allreduce_value": check,
        "ranks": ranks,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / f"result_rank{rank}.json", json.dumps(result))
    print(json.dumps({k: v for k, v in result.items() if k != "ranks"}), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
