"""Benchmark the checkpoint converter against a plain file copy (not a test).

Builds a random bfloat16 HuggingFace checkpoint with DeepSeek-V2-Lite-shaped layers
(hidden 2048, 64 routed experts of 1408, vocab 102400; as many MoE layers as fit the
requested size), then for each direction (hf-to-ms, then ms-to-hf back):

* copies the same bytes with ``shutil.copyfile`` (+ fsync, as the converter does) and times it,
* runs the converter in a child process and times it, sampling the child's resident memory,

with the source evicted from the page cache before each run, so both read from disk.
It prints throughput as a ratio to the copy, peak resident memory as a ratio to the
largest layer, checks the round trip is byte-exact, and deletes everything it wrote.

    python tools/bench_convert.py                       # ~3 GB, 4 workers
    python tools/bench_convert.py --size-gb 8 --workers 8 --shard-size 2GB
    MS_DEEPSEEK_NO_COPY_FILE_RANGE=1 python tools/bench_convert.py   # the buffered fallback path

Targets (issue 3): at least half the copy rate; peak memory under three times the largest layer.

``--mode layouts`` benchmarks the per-rank paths instead (issue 11) on the same checkpoint:

* per-rank loading: one rank of ``--layout`` (default dp2 tp2 pp2 ep2) reads its slices straight from
  the HF files in a child process; peak RSS against the rank's slices + the largest tensor;
* pre-sharded conversion (``hf-to-ms --dp/--tp/--pp/--ep``) and the merge back (``ms-to-hf`` of the
  rank folders): time against a copy of the same bytes, peak RSS against the largest tensor;
* the merged folder holds the source's tensors byte for byte.

    python tools/bench_convert.py --mode layouts --size-gb 4
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ms_deepseek.checkpoint.convert.synthetic import write_random_checkpoint  # noqa: E402
from ms_deepseek.checkpoint.safetensors_io import read_header  # noqa: E402
from ms_deepseek.config import names  # noqa: E402
from ms_deepseek.config.inventory import expected_hf_shapes  # noqa: E402
from ms_deepseek.config.model import get_preset  # noqa: E402

# The child reports its own peak RSS (VmHWM: high-water mark of this process image, all threads, since exec;
# ru_maxrss would also count the benchmark's memory inherited at fork).
_CONVERT = (
    "import sys; from ms_deepseek.checkpoint.convert.hf import {fn}; "
    "{fn}(sys.argv[1], sys.argv[2], workers=int(sys.argv[3]), shard_size=sys.argv[4], progress=False); "
    "print('VmHWM', next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')))"
)


_LOAD_RANK = (
    "import sys, resource; from pathlib import Path; "
    "from ms_deepseek.checkpoint.convert.sharded import load_rank, target_layout; "
    "from ms_deepseek.checkpoint.slice_readers import WholeSource; "
    "from ms_deepseek.checkpoint.weight_files import read_weight_files; "
    "from ms_deepseek.config.parallel import ParallelConfig; "
    "dp, tp, pp, ep, rank = map(int, sys.argv[2:7]); "
    "par = ParallelConfig(dp=dp, tp=tp, pp=pp, ep=ep, micro_batches=max(1, pp)); "
    "base = int(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmRSS:'))); "
    "src = WholeSource.of(read_weight_files(Path(sys.argv[1]))); "
    "lay = target_layout(src.cfg, par, src); "
    "mine = load_rank(src, lay, lay.world_size - 1 - rank); "
    "print('SLICES', sum(v.nbytes for v in mine.values()), 'BASE', base); "
    "print('VmHWM', next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')))"
)
_SHARDED = (
    "import sys; from ms_deepseek.checkpoint.convert.sharded import write_sharded, merge_to_hf; "
    "from ms_deepseek.config.parallel import ParallelConfig; "
    "dp, tp, pp, ep = map(int, sys.argv[3:7]); "
    "par = ParallelConfig(dp=dp, tp=tp, pp=pp, ep=ep, micro_batches=max(1, pp)); "
    "(write_sharded(sys.argv[1], sys.argv[2], par) if sys.argv[7] == 'split' else "
    "merge_to_hf(sys.argv[1], sys.argv[2], shard_size=sys.argv[8], progress=False)); "
    "print('VmHWM', next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')))"
)


def _child(code: str, *argv):
    """(seconds, peak RSS bytes, stdout) of ``python -c code argv...``."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, *map(str, argv)], env=env, stdout=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"child failed with exit code {proc.returncode}")
    kib = int(proc.stdout.split("VmHWM")[-1].split()[0])
    return seconds, kib * 1024, proc.stdout


def largest_tensor_bytes(cfg) -> int:
    from ms_deepseek.config.inventory import expected_ms_shapes

    return max(2 * _numel(s) for s in expected_ms_shapes(cfg).values())


def all_files(folder: Path):
    return sorted(p for p in folder.rglob("*.safetensors"))


def bench_layouts(args, cfg, work: Path) -> int:
    """Per-rank loading, pre-sharded conversion and the merge on the checkpoint in ``work / 'hf'``."""
    dp, tp, pp, ep = (int(x) for x in args.layout.split(","))
    total, largest = nbytes(cfg), largest_tensor_bytes(cfg)
    print(f"layout dp{dp} tp{tp} pp{pp} ep{ep}; largest tensor {largest / 1e6:.0f} MB")
    ok = True
    for rank in (0, dp * tp * pp - 1):  # the first and the last stage
        evict(work / "hf")
        secs, rss, out = _child(_LOAD_RANK, work / "hf", dp, tp, pp, ep, rank)
        slices = int(out.split("SLICES")[1].split()[0])
        base = int(out.split("BASE")[1].split()[0]) * 1024
        bound = slices + largest + base
        ok &= rss <= bound
        print(
            f"per-rank load (rank {dp * tp * pp - 1 - rank}): {secs:.1f} s, {slices / 1e6:.0f} MB of slices; "
            f"peak RSS {rss / 1e6:.0f} MB = slices + {(rss - slices) / 1e6:.0f} MB "
            f"(bound slices + largest tensor + interpreter {base / 1e6:.0f} MB = {bound / 1e6:.0f} MB: "
            f"{'ok' if rss <= bound else 'OVER'})"
        )
    copy_s = min(timed_copy(work / "hf", work / f"copy{k}") for k in range(args.repeat))
    for k in range(args.repeat):
        shutil.rmtree(work / f"copy{k}")
    rows = []
    for what, src, dst in (("split", work / "hf", work / "sharded"), ("merge", work / "sharded", work / "merged")):
        best = None
        for _rep in range(args.repeat):
            if dst.exists():
                shutil.rmtree(dst)
            evict(src) if what == "split" else [evict(d) for d in src.iterdir() if d.is_dir()]
            run = _child(_SHARDED, src, dst, dp, tp, pp, ep, what, args.shard_size)
            best = run if best is None or run[0] < best[0] else best
        secs, rss, _ = best
        ok &= rss <= largest * 2 + 200e6
        rows.append(what)
        written = sum(f.stat().st_size for f in all_files(dst))  # rank folders repeat replicated slices
        print(
            f"{'hf-to-ms --dp/--tp/--pp/--ep' if what == 'split' else 'ms-to-hf (merge)'}: {secs:.1f} s, "
            f"{total / 1e9:.2f} GB of model, {written / 1e9:.2f} GB written ({written / secs / 1e9:.2f} GB/s "
            f"written) = {copy_s / secs:.2f}x the time-rate of copying the model once "
            f"({total / copy_s / 1e9:.2f} GB/s); peak RSS {rss / 1e6:.0f} MB = {rss / largest:.2f}x the largest "
            "tensor"
        )
    same = tensor_digests(work / "hf") == tensor_digests(work / "merged")
    print(f"merged folder byte-identical to the source tensors: {same}")
    return 0 if ok and same else 1


def bench_config(size_gb: float):
    """V2-Lite shapes, with the number of MoE layers chosen to reach about ``size_gb`` GB in bf16."""
    lite = get_preset("deepseek-v2-lite")
    one = lite.replace(num_hidden_layers=2)  # embeddings + head + dense layer 0 + one MoE layer
    two = lite.replace(num_hidden_layers=3)
    per_moe = nbytes(two) - nbytes(one)
    fixed = nbytes(one) - per_moe
    moe_layers = max(1, round((size_gb * 1e9 - fixed) / per_moe))
    return lite.replace(num_hidden_layers=1 + moe_layers)


def nbytes(cfg) -> int:
    return sum(2 * _numel(s) for s in expected_hf_shapes(cfg).values())


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def largest_layer_bytes(cfg) -> int:
    per = {}
    for name, shape in expected_hf_shapes(cfg).items():
        key = names.layer_of(name)
        key = name if key is None else key  # embeddings / head count as layers of their own
        per[key] = per.get(key, 0) + 2 * _numel(shape)
    return max(per.values())


def weight_files(folder: Path):
    return sorted(folder.glob("model*.safetensors"))


def evict(folder: Path) -> None:
    """Drop the folder's files from the page cache (after fsync, so the pages are clean)."""
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed_copy(src: Path, dst: Path) -> float:
    dst.mkdir()
    start = time.perf_counter()
    for path in weight_files(src):
        shutil.copyfile(path, dst / path.name)
        fd = os.open(dst / path.name, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    return time.perf_counter() - start


def timed_convert(fn: str, src: Path, dst: Path, workers: int, shard_size: str):
    """(seconds, peak RSS bytes) of one conversion in a child process."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _CONVERT.format(fn=fn), str(src), str(dst), str(workers), shard_size],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{fn} failed with exit code {proc.returncode}")
    kib = int(proc.stdout.split("VmHWM")[-1].split()[0])
    return seconds, kib * 1024


def tensor_digests(folder: Path) -> dict:
    out = {}
    for path in weight_files(folder):
        header = read_header(path)
        with open(path, "rb") as f:
            for name, info in header.tensors.items():
                f.seek(info.offset)
                out[name] = (info.dtype, info.shape, hashlib.blake2b(f.read(info.nbytes), digest_size=16).digest())
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=3.0, help="checkpoint size in GB (default 3)")
    parser.add_argument("--workers", type=int, default=4, help="converter workers (default 4)")
    parser.add_argument("--src-shards", type=int, default=4, help="shards of the random HF checkpoint (default 4)")
    parser.add_argument("--shard-size", default="1GB", help="converter output shard size (default 1GB)")
    parser.add_argument(
        "--repeat",
        type=int,
        default=2,
        help="copy/convert pairs per direction, best kept (default 2; the disk may be shared)",
    )
    parser.add_argument("--workdir", default=None, help="where to write (default: a temporary folder in /tmp)")
    parser.add_argument("--keep", action="store_true", help="keep the files written")
    parser.add_argument("--no-verify", action="store_true", help="skip the byte-exact round-trip check")
    parser.add_argument(
        "--mode",
        choices=("convert", "layouts"),
        default="convert",
        help="convert: hf-to-ms / ms-to-hf vs copy (default); layouts: per-rank loading, "
        "pre-sharded conversion and the merge",
    )
    parser.add_argument("--layout", default="2,2,2,2", help="dp,tp,pp,ep for --mode layouts (default 2,2,2,2)")
    args = parser.parse_args(argv)

    cfg = bench_config(args.size_gb)
    total, largest = nbytes(cfg), largest_layer_bytes(cfg)
    work = Path(tempfile.mkdtemp(prefix="bench_convert_", dir=args.workdir))
    print(
        f"config: V2-Lite shapes, {cfg.num_hidden_layers} layers ({len(cfg.moe_layer_indices)} MoE, 64 experts "
        f"of 1408), bf16: {total / 1e9:.2f} GB; largest layer {largest / 1e9:.3f} GB"
    )
    print(
        f"work dir: {work}; copy_file_range: "
        f"{'off' if os.environ.get('MS_DEEPSEEK_NO_COPY_FILE_RANGE') == '1' else 'on'}"
    )
    try:
        t0 = time.perf_counter()
        write_random_checkpoint(work / "hf", cfg, dtype="bfloat16", num_shards=args.src_shards, seed=0, progress=True)
        print(f"random checkpoint written in {time.perf_counter() - t0:.1f} s")
        if args.mode == "layouts":
            return bench_layouts(args, cfg, work)
        rows = []
        for fn, src, dst in (("hf_to_ms", work / "hf", work / "ms"), ("ms_to_hf", work / "ms", work / "hf2")):
            copies, runs = [], []
            for rep in range(args.repeat):  # alternate copy and conversion; keep the best of each
                if rep:
                    shutil.rmtree(dst)
                evict(src)
                copies.append(timed_copy(src, work / "copy"))
                shutil.rmtree(work / "copy")
                evict(src)
                runs.append(timed_convert(fn, src, dst, args.workers, args.shard_size))
            copy_s = min(copies)
            conv_s, rss = min(r[0] for r in runs), max(r[1] for r in runs)
            copy_rate, conv_rate = total / copy_s, total / conv_s
            rows.append((fn, copy_rate, conv_rate, rss))
            print(
                f"{fn}: copy {copy_s:.2f} s ({copy_rate / 1e9:.2f} GB/s), convert {conv_s:.2f} s "
                f"({conv_rate / 1e9:.2f} GB/s) = {conv_rate / copy_rate:.2f}x the copy rate; "
                f"peak RSS {rss / 1e6:.0f} MB = {rss / largest:.3f}x the largest layer  "
                f"[copy runs {', '.join(f'{c:.1f}' for c in copies)} s; "
                f"convert runs {', '.join(f'{r[0]:.1f}' for r in runs)} s]"
            )
        if not args.no_verify:
            same = tensor_digests(work / "hf") == tensor_digests(work / "hf2")
            print(f"round trip byte-exact: {same}")
            if not same:
                return 1
        worst_rate = min(r[2] / r[1] for r in rows)
        worst_mem = max(r[3] / largest for r in rows)
        ok = worst_rate >= 0.5 and worst_mem < 3.0
        print(
            f"summary: worst throughput {worst_rate:.2f}x copy (target >= 0.5), worst peak memory "
            f"{worst_mem:.3f}x largest layer (target < 3): {'PASS' if ok else 'FAIL'}"
        )
        return 0 if ok else 1
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
