#!/usr/bin/env python
"""Run bad inputs through the real CLI and report, per case: traceback, exit code, leftovers, hang.

    .venv/bin/python tools/bad_input_campaign.py [--only SUBSTRING] [--timeout 120] [-v]

Each case gets a fresh temporary folder (the working directory of the command), a setup
that writes its bad input there, and the command line to run (``ms-deepseek ...`` as a
subprocess, the installed entry point of this venv). A case FAILS when

* stderr holds a Python traceback,
* the exit code is not the expected one (2 = bad input, the CLI's convention; a few cases
  expect 0 with a warning, e.g. report skipping bad metrics lines),
* the error line does not name the culprit (each case lists a substring it must contain),
* something is left behind that was not there before (files or folders, anywhere in the
  case's folder; a case may list paths it is allowed to create, or that must be gone),
* it does not finish within ``--timeout`` seconds (a hang: killed, reported).

Exit status: 0 when every case passes, 1 otherwise. Several cases per class of bad input; a developer tool:
each case starts a process and some import MindSpore, so a run takes minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
CLI = [str(Path(sys.executable).parent / "ms-deepseek")]
if not Path(CLI[0]).exists():
    CLI = [sys.executable, "-m", "ms_deepseek.cli"]
LITE = ROOT / "tests" / "fixtures" / "lite"
DEEP = 100_000  # far beyond any parser's recursion limit


@dataclass
class Case:
    kind: str  # issue 13 item: "5 nesting", "6 outputs", ...
    name: str
    setup: Callable[[Path], List[str]]  # writes the bad input into the folder, returns the argv after ms-deepseek
    names: str  # substring the error (or warning) line must hold
    exit_code: int = 2
    allowed: Sequence[str] = ()  # paths (relative) the command may create
    must_be_gone: Sequence[str] = ()  # paths (relative) setup created that the command must remove
    timeout: Optional[float] = None


@dataclass
class Outcome:
    case: Case
    code: Optional[int]
    seconds: float
    problems: List[str] = field(default_factory=list)
    err: str = ""


# ---------------------------------------------------------------------------- helpers for setups
def _hf_copy(d: Path, name: str = "hf") -> Path:
    dst = d / name
    shutil.copytree(LITE, dst)
    return dst


def _write_json(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def _deep_json() -> str:
    return "[" * DEEP + "]" * DEEP


def _byte_tokenizer(d: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests" / "helpers"))
    from data_helpers import make_byte_tokenizer  # the tests' tiny byte-level tokenizer (no download)

    return make_byte_tokenizer(d / "tok")


def _jsonl(d: Path, name: str = "in.jsonl", lines=None) -> Path:
    path = d / name
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = lines if lines is not None else [json.dumps({"text": f"hello world number {i} " * 4}) for i in range(40)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


_PREPARED: Optional[Path] = None


def _prepared(d: Path) -> Path:
    """A prepared data folder (built once per campaign, copied per case)."""
    global _PREPARED
    if _PREPARED is None:
        base = Path(tempfile.mkdtemp(prefix="campaign-data-"))
        tok = _byte_tokenizer(base)
        src = _jsonl(base)
        subprocess.run(
            CLI
            + [
                "prepare-data",
                str(src),
                "--tokenizer",
                str(tok),
                "--seq-len",
                "16",
                "--output",
                str(base / "data"),
                "--no-progress",
            ],
            check=True,
            cwd=base,
            capture_output=True,
        )
        _PREPARED = base / "data"
    dst = d / "data"
    shutil.copytree(_PREPARED, dst)
    return dst


def _recipe(d: Path, data_path: Optional[Path] = None, model_source: str = "tiny", **extra) -> Path:
    import yaml

    small = {
        "vocab_size": 512,
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "kv_lora_rank": 16,
        "q_lora_rank": 24,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "max_position_embeddings": 64,
        "capacity_factor": None,
    }
    model = {"source": model_source}
    if model_source == "tiny":
        model["overrides"] = small
    data = (
        {"seq_len": 16, "embedded_vocab_size": 512} if data_path is None else {"path": str(data_path), "num_workers": 1}
    )
    recipe = {
        "model": model,
        "data": data,
        "train": {"steps": 2, "micro_batch_size": 2, "seed": 5},
        "optim": {"lr": 1e-3, "warmup_steps": 1},
        "parallel": {"dp": 1},
        "checkpoint": {"save_interval": 0},
        "logging": {"log_interval": 1, "tensorboard": False},
    }
    for key, value in extra.items():
        recipe[key].update(value)
    path = d / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return path


def _plan_args(*extra) -> List[str]:
    return ["plan", "--model", "tiny", "--npus", "2", "--seq-len", "64", "--global-batch", "4", *extra]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _host_tag() -> str:
    return socket.gethostname().split(".")[0].replace("-", "_") or "host"


# ---------------------------------------------------------------------------- the cases
def cases() -> List[Case]:
    out: List[Case] = []
    add = out.append

    # 5. deeply nested JSON / YAML
    def deep_file(file_name):
        """A checkpoint whose file_name is a deeply nested JSON document, converted."""

        def setup(d):
            hf = _hf_copy(d)
            (hf / file_name).write_text(_deep_json())
            return ["convert", "hf-to-ms", str(hf), str(d / "out"), "--no-progress"]

        return setup

    add(Case("5 nesting", "config.json", deep_file("config.json"), "config.json: nested too deeply"))

    def deep_header(d):
        hf = _hf_copy(d)
        blob = ('{"a":' * 20000 + "1" + "}" * 20000).encode()
        (hf / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob)
        return ["convert", "hf-to-ms", str(hf), str(d / "out"), "--no-progress"]

    add(Case("5 nesting", "safetensors header", deep_header, "model.safetensors (safetensors header): nested"))

    add(
        Case(
            "5 nesting",
            "index",
            deep_file("model.safetensors.index.json"),
            "model.safetensors.index.json: nested too deeply",
        )
    )

    def deep_jsonl(d):
        tok = _byte_tokenizer(d)
        src = _jsonl(d, lines=[json.dumps({"text": "fine"}), '{"text": ' + _deep_json() + "}"])
        return [
            "prepare-data",
            str(src),
            "--tokenizer",
            str(tok),
            "--seq-len",
            "8",
            "--output",
            str(d / "o"),
            "--no-progress",
        ]

    add(Case("5 nesting", "jsonl line", deep_jsonl, "in.jsonl:2: nested too deeply", allowed=("tok",)))

    def deep_recipe(d):
        (d / "r.yaml").write_text("model: " + "[" * DEEP + "]" * DEEP + "\n")
        return ["plan", "--recipe", str(d / "r.yaml")]

    add(Case("5 nesting", "recipe (plan)", deep_recipe, "r.yaml: nested too deeply"))

    def deep_recipe_block(d):
        text = "".join("  " * i + f"k{i}:\n" for i in range(3000)) + "  " * 3000 + "v: 1\n"
        (d / "r.yaml").write_text(text)
        return ["train", str(d / "r.yaml"), "--output", str(d / "run")]

    add(Case("5 nesting", "recipe block-nested (train)", deep_recipe_block, "r.yaml: nested too deeply"))

    def deep_metrics(d):
        run = d / "run"
        run.mkdir()
        (run / "metrics.jsonl").write_text(
            json.dumps({"step": 1, "loss": 2.0})
            + "\n"
            + _deep_json()
            + "\n"
            + json.dumps({"step": 2, "loss": 1.0})
            + "\n"
        )
        return ["report", str(run)]

    add(
        Case(
            "5 nesting",
            "metrics line (report warns)",
            deep_metrics,
            "metrics.jsonl:2: nested too deeply",
            exit_code=0,
            allowed=("run/report.html",),
        )
    )

    # 6. outputs that cannot be written
    add(
        Case(
            "6 outputs",
            "convert dst under /proc",
            lambda d: ["convert", "hf-to-ms", str(_hf_copy(d)), "/proc/ms-deepseek-out", "--no-progress"],
            "/proc",
        )
    )
    add(
        Case(
            "6 outputs",
            "convert dst under /sys",
            lambda d: ["convert", "hf-to-ms", str(_hf_copy(d)), "/sys/ms-deepseek-out", "--no-progress"],
            "/sys",
        )
    )

    def parent_file(d):
        (d / "afile").write_text("x")
        return ["convert", "hf-to-ms", str(_hf_copy(d)), str(d / "afile" / "out"), "--no-progress"]

    add(Case("6 outputs", "convert parent is a file", parent_file, "afile is a file"))

    def report_folder(d):
        run = d / "run"
        run.mkdir()
        (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
        (d / "outdir").mkdir()
        return ["report", str(run), "-o", str(d / "outdir")]

    add(Case("6 outputs", "report -o a folder", report_folder, "outdir: is a folder"))

    def report_proc(d):
        run = d / "run"
        run.mkdir()
        (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
        return ["report", str(run), "-o", "/proc/report.html"]

    add(Case("6 outputs", "report -o under /proc", report_proc, "/proc/report.html"))

    def train_output_file(d):
        (d / "runfile").write_text("x")
        return ["train", str(_recipe(d)), "--output", str(d / "runfile")]

    add(Case("6 outputs", "train --output a file", train_output_file, "runfile: is a file"))

    def train_output_proc(d):
        return ["train", str(_recipe(d)), "--output", "/proc/ms-deepseek-run"]

    add(Case("6 outputs", "train --output under /proc", train_output_proc, "/proc/ms-deepseek-run"))

    def prepare_output_parent_file(d):
        tok = _byte_tokenizer(d)
        (d / "afile").write_text("x")
        return [
            "prepare-data",
            str(_jsonl(d)),
            "--tokenizer",
            str(tok),
            "--seq-len",
            "8",
            "--output",
            str(d / "afile" / "o"),
            "--no-progress",
        ]

    add(
        Case(
            "6 outputs",
            "prepare-data parent is a file",
            prepare_output_parent_file,
            "afile is a file",
            allowed=("tok",),
        )
    )

    # 7. accepted nonsense
    for flag, value in (
        ("--workspace-gb", "-1"),
        ("--workspace-gb", "0"),
        ("--optimizer-bytes", "-8"),
        ("--optimizer-bytes", "0"),
        ("--grad-bytes", "0"),
        ("--master-bytes", "-2"),
        ("--runtime-reserved-gb", "-3"),
        ("--npus-per-node", "0"),
        ("--hbm-gb", "nan"),
    ):
        add(Case("7 nonsense", f"plan {flag} {value}", lambda d, f=flag, v=value: _plan_args(f, v), flag))
    for addr in ("", "   ", "a..b", "999.1.1.1", "-x"):
        add(
            Case(
                "7 nonsense",
                f"launch --master-addr {addr!r}",
                lambda d, a=addr: ["launch", str(_recipe(d)), "--master-addr=" + a, "--output", str(d / "run")],
                "--master-addr",
            )
        )
    add(
        Case(
            "7 nonsense",
            "launch unresolvable master",
            lambda d: ["launch", str(_recipe(d)), "--master-addr", "no-such-host.invalid", "--output", str(d / "run")],
            "cannot resolve 'no-such-host.invalid'",
        )
    )
    for flag, value in (
        ("--timeout", "-5"),
        ("--need-gb", "-1"),
        ("--master-port", "99999"),
        ("--master-port", "0"),
        ("--bench-mb", "0"),
    ):
        add(
            Case(
                "7 nonsense",
                f"doctor {flag} {value}",
                lambda d, f=flag, v=value: ["doctor", "--only", "python", f, v],
                flag,
            )
        )
    for scaling, key in (
        ({"type": "yarn", "factor": "40", "original_max_position_embeddings": 4096}, "factor"),
        ({"type": "yarn", "factor": 40, "original_max_position_embeddings": "4k"}, "original_max_position_embeddings"),
        ({"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": "x"}, "beta_fast"),
        ({"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": [1]}, "mscale"),
    ):

        def rope(d, s=scaling):
            hf = _hf_copy(d)
            cfg = json.loads((hf / "config.json").read_text())
            cfg["rope_scaling"] = s
            _write_json(hf / "config.json", cfg)
            return ["convert", "hf-to-ms", str(hf), str(d / "out"), "--no-progress"]

        add(Case("7 nonsense", f"rope_scaling.{key} wrong type", rope, f"rope_scaling.{key}: expected"))

    # 8. destinations that destroy or pollute inputs
    def convert_inside(d):
        hf = _hf_copy(d)
        return ["convert", "hf-to-ms", str(hf), str(hf / "sub"), "--no-progress"]

    add(Case("8 destinations", "convert S S/sub", convert_inside, "lies inside the source"))

    def convert_parent(d):
        hf = _hf_copy(d, "parent/hf")
        return ["convert", "hf-to-ms", str(hf), str(d / "parent"), "--overwrite", "--no-progress"]

    add(Case("8 destinations", "convert S parent --overwrite", convert_parent, "holds the source"))

    def prepare_holds_input(d):
        tok = _byte_tokenizer(d)
        src = _jsonl(d, "dir/in.jsonl")
        return [
            "prepare-data",
            str(src),
            "--tokenizer",
            str(tok),
            "--seq-len",
            "8",
            "--output",
            str(d / "dir"),
            "--overwrite",
            "--no-progress",
        ]

    add(
        Case(
            "8 destinations",
            "prepare-data --output holds IN --overwrite",
            prepare_holds_input,
            "holds the input",
            allowed=("tok",),
        )
    )

    def prepare_inside_input(d):
        tok = _byte_tokenizer(d)
        _jsonl(d, "corpus/in.jsonl")
        return [
            "prepare-data",
            str(d / "corpus"),
            "--tokenizer",
            str(tok),
            "--seq-len",
            "8",
            "--output",
            str(d / "corpus" / "prepared"),
            "--no-progress",
        ]

    add(
        Case(
            "8 destinations",
            "prepare-data --output inside the input folder",
            prepare_inside_input,
            "lies inside the input folder",
            allowed=("tok",),
        )
    )

    # 9. leftovers
    def stale_partial(d):
        hf = _hf_copy(d)
        stale = d / f".out.partial-{_host_tag()}-{_dead_pid()}-0123456789ab"
        stale.mkdir()
        (stale / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 1024)
        return ["convert", "hf-to-ms", str(hf), str(d / "out"), "--no-progress"]

    add(
        Case(
            "9 leftovers",
            "stale partial of a SIGKILLed conversion is removed",
            stale_partial,
            "",
            exit_code=0,
            allowed=("out",),
            must_be_gone=(".out.partial-*",),
        )
    )

    def killed_conversion(d):
        hf = _hf_copy(d)
        # a real SIGKILL mid-write: a child converting with a sleep in its shard writer is killed by the parent
        code = (
            "import os, signal, sys, time\n"
            "import ms_deepseek.checkpoint.convert.hf as api\n"
            "orig = api._write_shards\n"
            "def slow(*a, **k):\n"
            "    open(os.environ['READY'], 'w').close(); time.sleep(60)\n"
            "api._write_shards = slow\n"
            f"api.hf_to_ms({str(hf)!r}, {str(d / 'out')!r}, progress=False)\n"
        )
        ready = d / "ready"
        proc = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, READY=str(ready)), cwd=d)
        for _ in range(600):
            if ready.exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
        proc.kill()
        proc.wait()
        ready.unlink(missing_ok=True)
        return ["convert", "hf-to-ms", str(hf), str(d / "out"), "--no-progress"]

    add(
        Case(
            "9 leftovers",
            "SIGKILLed conversion, then a re-run",
            killed_conversion,
            "",
            exit_code=0,
            allowed=("out",),
            must_be_gone=(".out.partial-*",),
        )
    )

    def prepare_parents(d):
        tok = _byte_tokenizer(d)
        src = _jsonl(d, lines=[json.dumps({"text": "fine"}), "{not json"])
        return [
            "prepare-data",
            str(src),
            "--tokenizer",
            str(tok),
            "--seq-len",
            "8",
            "--output",
            str(d / "a" / "b" / "c"),
            "--no-progress",
        ]

    add(
        Case(
            "9 leftovers",
            "failed prepare-data leaves no parents",
            prepare_parents,
            "in.jsonl:2: bad JSON",
            allowed=("tok",),
        )
    )

    def train_bad_shape(d):
        hf = _hf_copy(d)
        cfg = json.loads((hf / "config.json").read_text())
        cfg["vocab_size"] = 512  # the embedding / lm_head weights (256 rows) no longer match the config
        _write_json(hf / "config.json", cfg)
        return ["train", str(_recipe(d, _prepared(d), model_source=str(hf))), "--output", str(d / "x" / "run")]

    add(Case("9 leftovers", "train refused for a bad checkpoint shape", train_bad_shape, "shape"))

    def launch_master(d):
        return ["launch", str(_recipe(d)), "--master-addr", "no-such-host.invalid", "--output", str(d / "runs" / "r")]

    add(Case("9 leftovers", "launch with an unresolvable master", launch_master, "--master-addr"))

    # 10. unconfined / unvalidated data files
    def lengths_file(d, name):
        data = _prepared(d)
        meta = json.loads((data / "meta.json").read_text())
        meta["lengths_file"] = name
        _write_json(data / "meta.json", meta)
        return ["train", str(_recipe(d, data)), "--output", str(d / "run")]

    for name, what in (("/etc/passwd", "absolute path"), ("../outside.npy", "points outside")):
        add(Case("10 data files", f"lengths_file {name}", lambda d, n=name: lengths_file(d, n), what))

    def pickled(d):
        import numpy as np

        data = _prepared(d)
        np.save(data / "lengths.npy", np.array([{"x": 1}], dtype=object), allow_pickle=True)
        return ["train", str(_recipe(d, data)), "--output", str(d / "run")]

    add(Case("10 data files", "pickled lengths.npy", pickled, "lengths.npy: not a plain .npy"))

    def fifo_tokenizer(d):
        os.mkfifo(d / "tok.json")
        return [
            "prepare-data",
            str(_jsonl(d)),
            "--tokenizer",
            str(d / "tok.json"),
            "--seq-len",
            "8",
            "--output",
            str(d / "o"),
            "--no-progress",
        ]

    add(Case("10 data files", "FIFO tokenizer", fifo_tokenizer, "tok.json: is a FIFO", timeout=60))

    def fifo_input(d):
        tok = _byte_tokenizer(d)
        os.mkfifo(d / "in.jsonl")
        return [
            "prepare-data",
            str(d / "in.jsonl"),
            "--tokenizer",
            str(tok),
            "--seq-len",
            "8",
            "--output",
            str(d / "o"),
            "--no-progress",
        ]

    add(Case("10 data files", "FIFO input", fifo_input, "in.jsonl: is a FIFO", allowed=("tok",), timeout=60))

    def surrogate(d, record):
        tok = _byte_tokenizer(d)
        fmt = "sft" if "messages" in record or "prompt" in record else "pretrain"
        first = {"prompt": "a", "response": "b"} if fmt == "sft" else {"text": "fine"}
        src = _jsonl(d, lines=[json.dumps(first), record])
        return [
            "prepare-data",
            str(src),
            "--tokenizer",
            str(tok),
            "--seq-len",
            "8",
            "--output",
            str(d / "o"),
            "--format",
            fmt,
            "--no-progress",
        ]

    for record in (
        '{"text": "bad \\ud800 text"}',
        '{"prompt": "hi", "response": "\\udfff"}',
        '{"messages": [{"role": "user", "content": "x\\ud83d"}]}',
    ):
        add(
            Case(
                "10 data files",
                f"lone surrogate {record[:24]}",
                lambda d, r=record: surrogate(d, r),
                "in.jsonl:2: ",
                allowed=("tok",),
            )
        )
    for step in ('"abc"', '"NaN"', "NaN", "-1", "1.5", "true"):

        def bad_step(d, s=step):
            run = d / "run"
            run.mkdir()
            (run / "metrics.jsonl").write_text(
                '{"step": 1, "loss": 2.0}\n{"step": ' + s + ', "loss": 1.0}\n{"step": 2, "loss": 1.5}\n'
            )
            return ["report", str(run)]

        add(
            Case(
                "10 data files",
                f"metrics step {step}",
                bad_step,
                "metrics.jsonl:2: ",
                exit_code=0,
                allowed=("run/report.html",),
            )
        )

    # 11. messages that do not name the culprit
    for key, value in (
        ("hidden_size", "abc"),
        ("num_hidden_layers", "2"),
        ("rope_theta", "big"),
        ("n_routed_experts", [1]),
    ):

        def wrong_type(d, k=key, v=value):
            hf = _hf_copy(d)
            cfg = json.loads((hf / "config.json").read_text())
            cfg[k] = v
            _write_json(hf / "config.json", cfg)
            return ["convert", "hf-to-ms", str(hf), str(d / "out"), "--no-progress"]

        add(Case("11 messages", f"config {key}={value!r}", wrong_type, key))
    add(
        Case(
            "11 messages",
            "recipe value of the wrong type",
            lambda d: ["plan", "--recipe", str(_recipe(d, train={"steps": "many"}))],
            "train.steps",
        )
    )

    def binary_requirements(d):
        (d / "req.txt").write_bytes(bytes(range(256)) * 4)
        return ["doctor", "--requirements", str(d / "req.txt"), "--only", "packages"]

    add(Case("11 messages", "doctor --requirements binary", binary_requirements, "req.txt: not a text"))
    add(
        Case(
            "11 messages",
            "doctor --requirements a folder",
            lambda d: ["doctor", "--requirements", str(d), "--only", "packages"],
            "is a folder",
        )
    )
    add(
        Case(
            "11 messages",
            "plan invalid layout (stderr, exit 2)",
            lambda d: [
                "plan",
                "--model",
                "deepseek-v2",
                "--npus",
                "64",
                "--seq-len",
                "4096",
                "--global-batch",
                "80",
                "--dp",
                "8",
                "--tp",
                "3",
                "--pp",
                "1",
            ],
            "not divisible by tp=3",
        )
    )
    return out


# ---------------------------------------------------------------------------- running
def _listing(folder: Path) -> set:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def _matches(rel: str, patterns: Sequence[str]) -> bool:
    import fnmatch

    return any(
        rel == p or rel.startswith(p.rstrip("/") + "/") or fnmatch.fnmatch(rel.split("/")[0], p) for p in patterns
    )


def run_case(case: Case, timeout: float) -> Outcome:
    d = Path(tempfile.mkdtemp(prefix="campaign-"))
    try:
        argv = case.setup(d)
        before = _listing(d)
        t0 = time.time()
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        try:
            proc = subprocess.run(
                CLI + argv,
                cwd=d,
                capture_output=True,
                text=True,
                env=env,
                timeout=case.timeout or timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            return Outcome(case, None, time.time() - t0, [f"hang: no exit within {case.timeout or timeout:g} s"])
        out = Outcome(case, proc.returncode, time.time() - t0, err=proc.stderr)
        if "Traceback (most recent call last)" in proc.stderr:
            out.problems.append("traceback")
        if proc.returncode != case.exit_code:
            out.problems.append(f"exit {proc.returncode}, expected {case.exit_code}")
        if case.names and case.names not in proc.stderr:
            out.problems.append(f"stderr does not name {case.names!r}")
        if case.exit_code == 2:
            lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
            last = lines[-1] if lines else ""
            if not last.startswith("ms-deepseek "):
                out.problems.append(f"error line does not start with 'ms-deepseek': {last[:80]!r}")
        after = _listing(d)
        left = sorted(p for p in after - before if not _matches(p, case.allowed))
        if left:
            out.problems.append("left behind: " + ", ".join(left[:5]) + (" ..." if len(left) > 5 else ""))
        still = sorted(p for p in after if _matches(p, case.must_be_gone))
        if still:
            out.problems.append("not cleaned up: " + ", ".join(still[:3]))
        return out
    except Exception as exc:  # noqa: BLE001  (a broken setup is reported as this case's failure)
        return Outcome(case, None, 0.0, [f"setup failed: {type(exc).__name__}: {exc}"])
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="run the cases whose kind or name contains this text")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per case before it counts as a hang")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every case's stderr")
    args = parser.parse_args(argv)
    selected = [c for c in cases() if not args.only or args.only in c.kind or args.only in c.name]
    results = []
    for case in selected:
        r = run_case(case, args.timeout)
        results.append(r)
        status = "ok  " if not r.problems else "FAIL"
        print(
            f"{status} [{case.kind}] {case.name} (exit {r.code}, {r.seconds:.1f} s)"
            + ("" if not r.problems else ": " + "; ".join(r.problems)),
            flush=True,
        )
        if args.verbose or r.problems:
            tail = [ln for ln in r.err.strip().splitlines() if ln.strip()][-3:]
            for ln in tail:
                print(f"       | {ln[:200]}")
    failed = [r for r in results if r.problems]
    kinds = sorted({r.case.kind for r in results}, key=lambda k: int(k.split()[0]))
    print("\nsummary:")
    for kind in kinds:
        mine = [r for r in results if r.case.kind == kind]
        print(f"  {kind:<16} {sum(not r.problems for r in mine)}/{len(mine)} ok")
    counts = {
        w: sum(any(p.startswith(w) for p in r.problems) for r in results)
        for w in ("traceback", "exit", "stderr does not name", "left behind", "not cleaned", "hang", "setup")
    }
    print(
        f"  {len(results) - len(failed)}/{len(results)} cases ok; failures: "
        + ", ".join(f"{k} {v}" for k, v in counts.items())
    )
    if _PREPARED is not None:
        shutil.rmtree(_PREPARED.parent, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
