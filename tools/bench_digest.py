"""Measure what a checkpoint's digests cost (not a test): the trainer's writer (``safetensors_io.write_arrays``)
writes the same host arrays with and without the SHA-256 taken while writing, side by side, then the check on
read (``digests.check_file``: every byte read and hashed again) is timed with the file evicted from the page
cache where the kernel allows it. Prints seconds per GB of each and the write's ratio with / without.

    python tools/bench_digest.py                 # 1 GB, 3 rounds, in the system's temporary folder
    python tools/bench_digest.py --size-gb 4 --folder /mnt/ckpt
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_convert import evict  # tools/ (this script's folder) is on the path

from ms_deepseek.checkpoint import digests
from ms_deepseek.checkpoint.safetensors_io import write_arrays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--folder", default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_digest-", dir=args.folder))
    try:
        n = int(args.size_gb * 1e9) // 4 // 8
        arrays = {f"t{i}": (np.random.default_rng(i).standard_normal(n, dtype=np.float32), "F32") for i in range(8)}
        size = sum(a.nbytes for a, _ in arrays.values())
        plain, hashed, check = [], [], []
        for _ in range(args.rounds):
            for label, times in (("plain", plain), ("hashed", hashed)):
                path = work / f"{label}.safetensors"
                hasher = digests.new_hasher() if label == "hashed" else None
                start = time.perf_counter()
                written = write_arrays(path, arrays, digest=hasher)
                fd = os.open(path, os.O_RDONLY)
                os.fsync(fd)  # what a save pays before the folder is swapped in
                os.close(fd)
                times.append(time.perf_counter() - start)
            (work / "state.json").write_text(
                json.dumps({"files": {"hashed.safetensors": digests.entry(written, hasher)}})
            )
            evict(work)  # the check reads from disk
            start = time.perf_counter()
            digests.check_file(work, "hashed.safetensors")
            check.append(time.perf_counter() - start)
        gb = size / 1e9
        w0, w1, c = min(plain) / gb, min(hashed) / gb, min(check) / gb
        print(f"file {gb:.2f} GB, best of {args.rounds}, folder {work.parent}")
        print(f"write without digest: {w0:.3f} s/GB; with SHA-256 while writing: {w1:.3f} s/GB ({w1 / w0:.2f}x)")
        print(f"digest cost at save: {w1 - w0:.3f} s/GB; check on read (read + hash): {c:.3f} s/GB")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
