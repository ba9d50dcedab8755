"""A seeded mutation fuzzer over the files users hand to ms-deepseek.

Formats: config.json, safetensors headers, the shard index, layout.json, recipes and
metrics.jsonl. Each case copies one small fixture folder, mutates one file of it and runs
the command that reads it, in process, through :func:`ms_deepseek.cli.main`. The contract:
exit 0 (the input was valid), or a non-zero exit whose last stderr line is one
``ms-deepseek CMD: error: ...`` line; never a traceback, never a hang (a per-case
``signal.setitimer`` alarm turns a hang into a failure naming the case).

Mutations work on the parsed document (JSON / YAML tree): a value replaced by a hostile one
(Infinity, NaN, 1e30, a negative or huge integer, a 300-character name, the wrong type),
a key deleted or added, a number scaled; plus text-level cuts and line edits. Every case is
determined by (format, seed): a failure message gives both, so it replays alone.
"""

from __future__ import annotations

import copy
import io
import json
import os
import random
import shutil
import signal
import struct
import sys
import traceback
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import yaml

from repo_paths import REPO  # noqa: E402

HOSTILE: List[Any] = [
    float("inf"),
    float("-inf"),
    float("nan"),
    1e30,
    -1e30,
    1e308,
    -1,
    0,
    1,
    2**63,
    -(2**63) - 1,
    2**31,
    0.5,
    -0.0,
    True,
    False,
    None,
    "",
    "x" * 300,
    "../../etc/passwd",
    "/abs/path",
    "NaN",
    "Infinity",
    "a\u00e9\u4e2d",
    {},
    [],
    {"a": 1},
    [1, 2],
    [[]],
    [None],
    {"": None},
    "F32",
    "BF16",
    [1e30],
    [-1],
    [2**40, 2**40],
]


class CaseTimeout(Exception):
    pass


# ---------------------------------------------------------------------------- tree mutations
def _hostile(rng: random.Random) -> Any:
    return copy.deepcopy(rng.choice(HOSTILE))  # a fresh {} / []: a shared one could end up inside itself


def _paths(node, prefix=()) -> List[Tuple]:
    """Every path to a node of a JSON/YAML tree (the root is ())."""
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, prefix + (i,))
    return out


def _get(node, path):
    for k in path:
        node = node[k]
    return node


def mutate_tree(doc: Any, rng: random.Random, n_edits: int = 0) -> Tuple[Any, str]:
    """A mutated deep copy of ``doc`` and a description of the edits."""
    doc = copy.deepcopy(doc)
    n_edits = n_edits or rng.choice((1, 1, 1, 2, 3))
    said = []
    for _ in range(n_edits):
        paths = _paths(doc)
        path = rng.choice(paths[1:] if len(paths) > 1 else paths)
        op = rng.choice(("hostile", "hostile", "hostile", "scale", "delete", "add", "wrap", "retype"))
        if not path:
            doc = _hostile(rng)
            said.append(f"root={doc!r:.40}")
            continue
        parent, key = _get(doc, path[:-1]), path[-1]
        old = parent[key]
        if op == "scale" and isinstance(old, (int, float)) and not isinstance(old, bool):
            new = rng.choice((old * 2, old + 1, -old, old * 1e30, old * 1000003, old - 1, old / 3))
            if isinstance(old, int) and rng.random() < 0.5:
                new = int(new) if abs(new) < 1e18 else new
            parent[key] = new
        elif op == "delete":
            del parent[key]
            said.append(f"del {path}")
            continue
        elif op == "add" and isinstance(old, dict):
            new = _hostile(rng)
            old[rng.choice(("extra", "x" * 300, "", "dtype", "shape"))] = new
            said.append(f"add under {path}: {new!r:.40}")
            continue
        elif op == "wrap":
            parent[key] = rng.choice(([old], {"value": old}, str(old)))
        elif op == "retype" and isinstance(old, str):
            parent[key] = rng.choice((1, 1.5, [old], {"v": old}, old * 40, old + "x"))
        else:
            parent[key] = _hostile(rng)
        said.append(f"{path}={parent[key]!r:.50}")
    return doc, "; ".join(said)


def mutate_text(text: str, rng: random.Random) -> Tuple[str, str]:
    op = rng.choice(("cut", "drop_char", "dup_line", "drop_line", "swap_lines"))
    lines = text.split("\n")
    if op == "cut":
        at = rng.randrange(len(text) + 1)
        return text[:at], f"cut at {at}"
    if op == "drop_char" and text:
        at = rng.randrange(len(text))
        return text[:at] + text[at + 1 :], f"drop char {at}"
    i = rng.randrange(len(lines))
    if op == "dup_line":
        return "\n".join(lines[: i + 1] + lines[i:]), f"dup line {i}"
    if op == "drop_line":
        return "\n".join(lines[:i] + lines[i + 1 :]), f"drop line {i}"
    j = rng.randrange(len(lines))
    lines[i], lines[j] = lines[j], lines[i]
    return "\n".join(lines), f"swap lines {i} {j}"


def _dump_json(doc) -> str:
    return json.dumps(doc, indent=1)  # Infinity / NaN come out as the tokens Python's json reads back


# ---------------------------------------------------------------------------- fixtures
def tiny_config():
    from ms_deepseek.config.model import DeepseekV2Config

    return DeepseekV2Config(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        moe_intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        kv_lora_rank=8,
        q_lora_rank=None,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=4,
        first_k_dense_replace=1,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=1,
    )


def metrics_lines() -> List[dict]:
    rows = []
    for step in range(1, 6):
        rows.append(
            {
                "step": step * 10,
                "loss": 5.0 - 0.3 * step,
                "total_loss": 5.1 - 0.3 * step,
                "lr": 1e-3,
                "grad_norm": 1.0 + 0.1 * step,
                "tokens_per_s": 1000.0 + step,
                "expert_load": {"1": [0.25, 0.25, 0.3, 0.2]},
                "dropped_fraction": {"1": 0.01},
                "balance_loss": {"expert": 0.01},
            }
        )
    rows[-1]["val_loss"] = 4.0
    return rows


def build_fixtures(root: Path) -> Dict[str, Path]:
    """The small inputs every case starts from (built once)."""
    from ms_deepseek.checkpoint.convert.sharded import write_sharded
    from ms_deepseek.checkpoint.convert.synthetic import write_random_checkpoint
    from ms_deepseek.config.parallel import ParallelConfig

    root = Path(root)
    cfg = tiny_config()
    write_random_checkpoint(root / "hf_index", cfg, dtype="float32", num_shards=2, seed=1)
    write_random_checkpoint(root / "hf_single", cfg, dtype="float32", num_shards=1, seed=2)
    write_sharded(root / "hf_single", root / "sharded", ParallelConfig(dp=2, tp=2, micro_batches=1), fsync=False)
    # expert parallel: layout.json lists each stacked expert tensor's experts per rank
    write_sharded(root / "hf_single", root / "sharded_ep", ParallelConfig(dp=2, ep=2, micro_batches=1), fsync=False)
    (root / "recipe").mkdir()
    shutil.copyfile(REPO / "recipes" / "tiny-cpu.yaml", root / "recipe" / "r.yaml")
    (root / "run").mkdir()
    (root / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics_lines()))
    return {
        "hf_index": root / "hf_index",
        "hf_single": root / "hf_single",
        "sharded": root / "sharded",
        "sharded_ep": root / "sharded_ep",
        "recipe": root / "recipe",
        "run": root / "run",
    }


def _copy_folder(src: Path, dst: Path) -> None:
    """Hard links for everything (cheap); the one file a case mutates is rewritten, never edited in place."""
    shutil.copytree(src, dst, copy_function=os.link)


def _replace(path: Path, data) -> None:
    path.unlink()
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data, encoding="utf-8")


# ---------------------------------------------------------------------------- the formats
def _mutate_json_file(path: Path, rng: random.Random) -> str:
    text = path.read_text(encoding="utf-8")
    if rng.random() < 0.15:
        new, said = mutate_text(text, rng)
    else:
        doc, said = mutate_tree(json.loads(text), rng)
        new = _dump_json(doc)
    _replace(path, new)
    return said


def _mutate_safetensors(path: Path, rng: random.Random) -> str:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    if rng.random() < 0.1:
        op = rng.choice(("len", "cut"))
        if op == "len":
            new_n = rng.choice((0, n - 1, n + 1, 2**64 - 1, 2**40))
            _replace(path, struct.pack("<Q", new_n) + raw[8:])
            return f"header length {new_n}"
        at = rng.randrange(len(raw))
        _replace(path, raw[:at])
        return f"file cut at {at}"
    doc, said = mutate_tree(header, rng)
    body = _dump_json(doc).encode("utf-8")
    _replace(path, struct.pack("<Q", len(body)) + body + data)
    return said


def _record(line: str) -> dict:
    try:
        value = json.loads(line)
    except ValueError:
        return {"step": 1}
    return value if isinstance(value, dict) else {"step": 1}


def _mutate_lines(path: Path, rng: random.Random) -> str:
    lines = path.read_text(encoding="utf-8").splitlines() or ["{}"]
    said = []
    for _ in range(rng.choice((1, 2, 3, 5))):
        i = rng.randrange(len(lines))
        op = rng.random()
        if op < 0.7:
            doc, s = mutate_tree(_record(lines[i]), rng)
            lines[i] = json.dumps(doc)
            said.append(f"line {i}: {s}")
        elif op < 0.8:
            lines[i], s = mutate_text(lines[i], rng)
            said.append(f"line {i}: {s}")
        elif op < 0.9:
            lines.insert(i, lines[i])
            said.append(f"dup line {i}")
        else:
            lines[i] = json.dumps({k: v for k, v in _record(lines[i]).items() if k in ("step", "grad_norm")})
            said.append(f"line {i}: step/grad_norm only")
    _replace(path, "\n".join(lines) + ("\n" if rng.random() < 0.8 else ""))
    return "; ".join(said)


CONFIG_KEYS = (
    "num_hidden_layers",
    "n_routed_experts",
    "hidden_size",
    "vocab_size",
    "num_attention_heads",
    "first_k_dense_replace",
    "moe_layer_freq",
    "num_experts_per_tok",
    "kv_lora_rank",
    "capacity_factor",
)


def _mutate_yaml(path: Path, rng: random.Random) -> str:
    text = path.read_text(encoding="utf-8")
    if rng.random() < 0.15:
        new, said = mutate_text(text, rng)
    else:
        doc = yaml.safe_load(text)
        said = ""
        if rng.random() < 0.3 and isinstance(doc.get("model"), dict):  # a model.overrides key the recipe lacks
            key, value = rng.choice(CONFIG_KEYS), rng.choice((10**9, 10**5, 2**40, 0, -1, 3, 1e30, None))
            doc["model"].setdefault("overrides", {})[key] = value
            said = f"model.overrides.{key}={value!r}; "
        doc, more = mutate_tree(doc, rng)
        said += more
        new = yaml.safe_dump(doc)
    _replace(path, new)
    return said


@dataclass
class Format:
    name: str
    fixture: str  # key of build_fixtures
    target: Callable[[Path, random.Random], Path]  # the file to mutate in the case folder
    mutate: Callable[[Path, random.Random], str]
    argv: Callable[[Path], List[str]]  # the command, given the case folder


def _shard(folder: Path, rng: random.Random) -> Path:
    return rng.choice(sorted(folder.glob("*.safetensors")))


def _rank_file(folder: Path, rng: random.Random) -> Path:
    return rng.choice(sorted(folder.glob("rank_*/model.safetensors")))


def _hf_to_ms(case: Path) -> List[str]:
    return [
        "convert",
        "hf-to-ms",
        str(case),
        str(case.parent / (case.name + "_out")),
        "--no-progress",
        "--workers",
        "1",
        "--no-fsync",
    ]


FORMATS = [
    Format("config.json", "hf_single", lambda f, r: f / "config.json", _mutate_json_file, _hf_to_ms),
    Format(
        "config.json/presharded",
        "hf_single",
        lambda f, r: f / "config.json",
        _mutate_json_file,
        lambda c: _hf_to_ms(c) + ["--dp", "2", "--tp", "2"],
    ),
    Format("safetensors header", "hf_index", _shard, _mutate_safetensors, _hf_to_ms),
    Format("shard index", "hf_index", lambda f, r: f / "model.safetensors.index.json", _mutate_json_file, _hf_to_ms),
    Format(
        "layout.json",
        "sharded",
        lambda f, r: f / "layout.json",
        _mutate_json_file,
        lambda c: [
            "convert",
            "ms-to-hf",
            str(c),
            str(c.parent / (c.name + "_out")),
            "--no-progress",
            "--workers",
            "1",
            "--no-fsync",
        ],
    ),
    Format(
        "layout.json/reshard",
        "sharded",
        lambda f, r: f / "layout.json",
        _mutate_json_file,
        lambda c: ["convert", "reshard", str(c), str(c.parent / (c.name + "_out")), "--tp", "2", "--no-fsync"],
    ),
    Format(
        "rank safetensors header",
        "sharded",
        _rank_file,
        _mutate_safetensors,
        lambda c: [
            "convert",
            "ms-to-hf",
            str(c),
            str(c.parent / (c.name + "_out")),
            "--no-progress",
            "--workers",
            "1",
            "--no-fsync",
        ],
    ),
    Format(
        "recipe", "recipe", lambda f, r: f / "r.yaml", _mutate_yaml, lambda c: ["plan", "--recipe", str(c / "r.yaml")]
    ),
    Format(
        "metrics.jsonl",
        "run",
        lambda f, r: f / "metrics.jsonl",
        _mutate_lines,
        lambda c: ["report", str(c), "--out", str(c / "report.html")],
    ),
]


# ---------------------------------------------------------------------------- one case
@dataclass
class Outcome:
    ok: bool
    why: str


def _alarm(signum, frame):
    raise CaseTimeout()


def check_outcome(code, err: str, out: str = "", argv=()) -> Tuple[bool, str]:
    if code == 0:
        return True, "accepted"
    if code == 1 and list(argv[:1]) == ["plan"] and "DOES NOT FIT" in out and not err.strip():
        return True, "accepted (plan's verdict: does not fit, exit 1)"
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    if not lines:
        return False, f"exit {code} with nothing on stderr"
    last = lines[-1]
    if not (last.startswith("ms-deepseek ") and "error:" in last):
        return False, f"exit {code}, last stderr line is not an error line: {last[:200]}"
    if any("Traceback" in ln for ln in lines):
        return False, f"exit {code} after a traceback"
    return True, last


def run_case(fixtures: Dict[str, Path], work: Path, fmt: Format, seed: int, time_limit: float = 10.0) -> Outcome:
    """Mutate one file of a fresh copy of ``fmt``'s fixture and run its command; the outcome's why says what broke."""
    from ms_deepseek.cli import main

    rng = random.Random(f"{fmt.name}:{seed}")
    case = work / f"{fmt.name.replace('/', '_').replace(' ', '_')}-{seed}"
    _copy_folder(fixtures[fmt.fixture], case)
    target = fmt.target(case, rng)
    said = fmt.mutate(target, rng)
    argv = fmt.argv(case)
    name = f"[{fmt.name} seed={seed}: {target.name}: {said}]"
    out, err = io.StringIO(), io.StringIO()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, time_limit)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse
                code = exc.code
    except CaseTimeout:
        return Outcome(False, f"{name} still running after {time_limit} s (a hang): {' '.join(argv)}")
    except BaseException:  # noqa: BLE001  (any exception is a finding)
        tb = traceback.format_exc(limit=-3)
        return Outcome(False, f"{name} traceback: {tb}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        shutil.rmtree(case, ignore_errors=True)
        shutil.rmtree(case.parent / (case.name + "_out"), ignore_errors=True)
        for leftover in case.parent.glob(f".{case.name}_out*"):
            shutil.rmtree(leftover, ignore_errors=True)
    ok, why = check_outcome(code, err.getvalue(), out.getvalue(), argv)
    return Outcome(ok, f"{name} {why}")


def main_cli(
    argv=None,
) -> int:  # python tests/helpers/fuzz_helpers.py [N per format] [first seed]: explore beyond the test
    import tempfile
    import time

    sys.path.insert(0, str(REPO))
    n = int((argv or sys.argv[1:] or ["200"])[0])
    first = int((argv or sys.argv[1:])[1]) if len(argv or sys.argv[1:]) > 1 else 0
    with tempfile.TemporaryDirectory() as tmp:
        fixtures = build_fixtures(Path(tmp) / "fx")
        (Path(tmp) / "w").mkdir()
        bad = 0
        for fmt in FORMATS:
            t0, accepted = time.time(), 0
            for seed in range(first, first + n):
                o = run_case(fixtures, Path(tmp) / "w", fmt, seed)
                accepted += o.why.endswith("] accepted")
                if not o.ok:
                    bad += 1
                    print("FAIL", o.why, flush=True)
                elif "-v" in sys.argv:
                    print("ok", o.why[:300], flush=True)
            print(f"{fmt.name}: {n} cases in {time.time() - t0:.1f} s, {accepted} accepted", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main_cli())
