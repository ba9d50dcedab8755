"""Alerts (planted anomalies give exactly their alerts), the tolerant metrics reader, the HTML
report (self-contained, every plot present, renders in headless Chromium), --watch, and the
report of a real tiny training run."""

import json
import math
import random
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from ms_deepseek.core.errors import UserError
from ms_deepseek.report.alerts import RULES, Alert, AlertConfig, AlertMonitor, scan
from ms_deepseek.report.html import CORE_PLOTS, MEMORY_PLOTS, generate, watch
from ms_deepseek.report.metrics_io import read_metrics

from repo_paths import REPO

CHROMIUM = Path("/usr/bin/chromium")


def synth_records(n=300, plant=(), layers=("1", "2"), experts=8, seed=0, memory=True):
    """A healthy synthetic run (loss decays with noise, grad norm ~0.3, ~5000 tokens/s, near-uniform
    expert load) with the anomalies named in ``plant`` written in at known steps."""
    rnd = random.Random(seed)
    out = []
    for step in range(1, n + 1):
        loss = 2.0 + 8.0 * math.exp(-step / 60) + rnd.gauss(0, 0.02)
        load = {}
        for layer in layers:
            w = [1 + 0.2 * rnd.uniform(-1, 1) for _ in range(experts)]
            if "expert_starved" in plant and layer == "2" and 150 <= step < 200:
                w[5] = 0.08
            total = sum(w)
            load[layer] = [x / total for x in w]
        rec = {
            "step": step,
            "loss": loss,
            "total_loss": loss + 0.01,
            "lr": 3e-4 * min(1, step / 20),
            "grad_norm": 0.3 + 0.05 * rnd.uniform(-1, 1),
            "tokens_per_s": 5000 * (1 + 0.02 * rnd.uniform(-1, 1)),
            "elapsed_s": step * 0.5,
            "balance_expert": 1.0 + 0.01 * rnd.uniform(-1, 1),
            "balance_device": 0.5,
            "balance_comm": 0.25,
            "expert_load": load,
            "dropped_fraction": {layer: 0.01 for layer in layers},
        }
        if step == 1:
            rec["tokens_per_s"] = 900.0  # the first step pays for compilation
        if memory:
            rec.update(
                memory_allocated_gb=10.0 + 0.05 * rnd.uniform(-1, 1),
                memory_reserved_gb=12.0,
                memory_fragmentation=0.05 + 0.01 * rnd.uniform(-1, 1),
            )
            if step <= 5:  # allocator warm-up
                rec["memory_allocated_gb"] = 6.0 + step
        if "memory_growth" in plant and step >= 150:
            rec["memory_allocated_gb"] += 0.05 * (step - 150)
        if "memory_fragmented" in plant and 120 <= step < 135:
            rec["memory_fragmentation"] = 0.45
        if "grad_norm_high" in plant and 100 <= step < 115:
            rec["grad_norm"] = 2.5
        if "grad_norm_low" in plant and 200 <= step < 212:
            rec["grad_norm"] = 1e-5
        if "loss_spike" in plant and step == 250:
            rec["loss"] += 3.0
            rec["total_loss"] += 3.0
        if "non_finite" in plant and step == 270:
            rec.update(loss="NaN", total_loss="NaN", grad_norm="Infinity")
        if "throughput_drop" in plant and 280 <= step < 290:
            rec["tokens_per_s"] = 2000.0
        out.append(rec)
    return out


def write_run(folder: Path, records, tail: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        f.write(tail)
    return folder


# where each planted anomaly must be reported: (first step, last step) bounds
EXPECTED = {
    "grad_norm_high": (100, 114),
    "grad_norm_low": (200, 211),
    "loss_spike": (250, 250),
    "non_finite": (270, 270),
    "throughput_drop": (280, 289),
    "memory_fragmented": (120, 134),
}


def test_clean_run_has_no_alerts():
    assert scan(synth_records()) == []
    assert scan(synth_records(seed=7, n=600)) == []


@pytest.mark.parametrize("rule", sorted(RULES))
def test_planted_anomaly_gives_exactly_its_alert(rule, tmp_path):
    run = write_run(tmp_path / "run", synth_records(plant=(rule,)))
    alerts = scan(read_metrics(run / "metrics.jsonl").records)
    assert [a.rule for a in alerts] == [rule], [str(a) for a in alerts]
    (alert,) = alerts
    if rule == "memory_growth":
        # median of the last 20 logs passes 10.0 * 1.1 + 0.25 GB about 35 steps into the growth
        assert 180 <= alert.first_step <= 195 and alert.last_step == 300 and "grew from 10.0" in alert.message
    elif rule == "expert_starved":
        # window of 20 logs: opens once the mean falls below half the fair share, ends when it recovers
        assert alert.key == "2" and "expert(s) 5 " in alert.message
        assert 140 <= alert.first_step <= 160 and 199 <= alert.last_step <= 215
    else:
        assert (alert.first_step, alert.last_step) == EXPECTED[rule], str(alert)


def test_all_anomalies_together():
    alerts = scan(synth_records(plant=tuple(RULES)))
    assert sorted(a.rule for a in alerts) == sorted(RULES)


def test_monitor_is_incremental_and_reports_each_episode_once():
    mon = AlertMonitor()
    printed = []
    for rec in synth_records(plant=("grad_norm_high",)):
        printed += mon.observe(rec)
    assert len(printed) == 1 and printed[0].first_step == 100
    assert printed[0] is mon.alerts[0] and mon.alerts[0].last_step == 114  # updated in place
    assert str(printed[0]).startswith("[alert:grad_norm_high] steps 100-114:")
    # a second episode later opens a second alert
    mon = AlertMonitor(AlertConfig(streak=3))
    seq = [2.0] * 3 + [0.5] + [2.0] * 4
    opened = [a for i, g in enumerate(seq) for a in mon.observe({"step": i + 1, "grad_norm": g})]
    assert [(a.first_step, a.last_step) for a in opened] == [(1, 3), (5, 8)]


def test_overflow_with_loss_scale_is_not_non_finite():
    mon = AlertMonitor()
    assert mon.observe({"step": 1, "loss": 2.0, "grad_norm": "Infinity", "loss_scale": 65536.0}) == []
    assert mon.observe({"step": 2, "loss": 2.0, "grad_norm": "NaN", "loss_scale": 1024.0, "overflow": True}) == []
    assert [a.rule for a in mon.observe({"step": 3, "loss": "NaN", "grad_norm": 1.0})] == ["non_finite"]
    # an inf gradient norm the trainer did not flag as an overflow is reported
    mon = AlertMonitor()
    assert [
        a.rule for a in mon.observe({"step": 1, "grad_norm": "Infinity", "loss_scale": 1.0, "overflow": False})
    ] == ["non_finite"]


def test_reader_tolerates_live_and_damaged_files(tmp_path):
    recs = synth_records(n=5, memory=False)
    for r in recs[2:]:
        del r["expert_load"], r["dropped_fraction"]  # optional keys missing
    p = tmp_path / "metrics.jsonl"
    lines = [json.dumps(r) for r in recs]
    lines.insert(2, "garbage {")
    p.write_text("\n".join(lines) + "\n" + '{"step": 6, "loss": 1.')
    m = read_metrics(p)
    assert [r["step"] for r in m.records] == [1, 2, 3, 4, 5]
    assert m.skipped_lines == [3] and m.truncated_tail
    p.write_text('{"step": 1, "loss": "NaN", "expert_load": {"1": ["NaN", 0.5]}}\n')
    rec = read_metrics(p).records[0]
    assert math.isnan(rec["loss"]) and math.isnan(rec["expert_load"]["1"][0])
    with pytest.raises(UserError, match="no metrics file"):
        read_metrics(tmp_path / "nope" / "metrics.jsonl")


def test_report_is_self_contained_with_every_plot(tmp_path):
    run = write_run(tmp_path / "run", synth_records(plant=tuple(RULES)), tail='{"step": 301, "lo')
    info = generate(run)
    out = run / "report.html"
    assert info["output"] == out and info["records"] == 300 and len(info["alerts"]) == len(RULES)
    page = out.read_text()
    for pid in CORE_PLOTS + MEMORY_PLOTS + ("plot-expert-load-layer-1", "plot-expert-load-layer-2"):
        assert f'id="{pid}"' in page, pid
    assert page.index('id="alerts"') < page.index('id="plot-loss"')  # alerts at the top
    for rule in RULES:
        assert f'data-rule="{rule}"' in page
    assert "last line was incomplete" in page
    # nothing fetched when viewed: no external URLs, scripts or stylesheets
    assert "http://" not in page and "https://" not in page and "<script" not in page
    assert list(run.glob(".*tmp")) == []


def test_report_without_optional_data(tmp_path):
    recs = [
        {"step": s, "loss": 3.0 - s / 100, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 100.0, "elapsed_s": float(s)}
        for s in range(1, 30)
    ]
    page = Path(generate(write_run(tmp_path / "dense", recs), tmp_path / "out" / "r.html")["output"]).read_text()
    assert 'id="plot-expert-load"' in page and "no expert load logged" in page
    assert 'id="plot-memory"' not in page and "No alerts." in page


def test_report_cli_errors(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "ms_deepseek.cli", "report", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        cwd=str(REPO),
    )
    assert proc.returncode == 2 and "not a folder" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "ms_deepseek.cli", "report", str(tmp_path), "--watch", "0"],
        capture_output=True,
        text=True,
        cwd=str(REPO),
    )
    assert proc.returncode == 2 and "--watch" in proc.stderr


def test_watch_rewrites_the_page_as_the_run_grows(tmp_path):
    run = tmp_path / "run"
    records = synth_records(plant=("loss_spike",))
    echoed = []
    watch(run, seconds=0.01, iterations=1, echo=echoed.append)  # no metrics yet: waits, no crash
    assert echoed and echoed[0].startswith("waiting")
    write_run(run, records[:200])
    watch(run, seconds=0.01, iterations=1, echo=echoed.append)
    first = (run / "report.html").read_text()
    assert "200 logged steps" in first and 'http-equiv="refresh"' in first and "No alerts." in first
    write_run(run, records)
    echoed.clear()
    watch(run, seconds=0.01, iterations=2, echo=echoed.append)
    assert "300 logged steps" in (run / "report.html").read_text()
    assert len(echoed) == 1 and echoed[0].startswith("[alert:loss_spike] step 250")  # printed once


def _png_pixels(path: Path):
    """(width, height, fraction of non-white pixels) of an 8-bit RGB/RGBA PNG, decoded with zlib."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and color in (2, 6)
            bpp = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw, stride = zlib.decompress(idat), width * bpp
    prev, nonwhite, i = bytearray(stride), 0, 0
    for _ in range(height):
        ftype, line = raw[i], bytearray(raw[i + 1 : i + 1 + stride])
        i += 1 + stride
        for x in range(stride):  # undo the PNG row filters
            a = line[x - bpp] if x >= bpp else 0
            b, c = prev[x], prev[x - bpp] if x >= bpp else 0
            if ftype == 1:
                line[x] = (line[x] + a) & 255
            elif ftype == 2:
                line[x] = (line[x] + b) & 255
            elif ftype == 3:
                line[x] = (line[x] + (a + b) // 2) & 255
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        nonwhite += sum(1 for x in range(0, stride, bpp) if min(line[x : x + 3]) < 245)
        prev = line
    return width, height, nonwhite / (width * height)


def test_report_renders_in_headless_chromium(tmp_path):
    # chromium is part of the test environment (tools/test.sh installs Debian's package as root)
    assert CHROMIUM.exists(), f"{CHROMIUM} missing: run tools/test.sh as root, or apt-get install chromium"
    run = write_run(tmp_path / "run", synth_records(plant=tuple(RULES)))
    page = generate(run)["output"]
    flags = [
        str(CHROMIUM),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'ud'}",
    ]
    shot = tmp_path / "shot.png"
    subprocess.run(
        flags + [f"--screenshot={shot}", "--window-size=1400,3000", page.as_uri()],
        capture_output=True,
        timeout=120,
        check=True,
    )
    dom = subprocess.run(
        flags + ["--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    for pid in CORE_PLOTS + MEMORY_PLOTS + ("plot-expert-load-layer-1", "plot-expert-load-layer-2", "alerts"):
        assert f'id="{pid}"' in dom, pid
    assert dom.count("<svg") >= 9 and dom.count('class="alert"') == len(RULES)
    width, height, ink = _png_pixels(shot)
    assert (width, height) == (1400, 3000)
    assert ink > 0.08, ink  # plots, heatmaps and text: far from a blank page


@pytest.mark.slow
def test_real_tiny_training_run_produces_a_report(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ms_deepseek.cli",
            "train",
            str(REPO / "recipes" / "tiny-cpu.yaml"),
            "--set",
            "train.steps=10",
            "--set",
            "logging.log_interval=1",
            "--set",
            "train.micro_batch_size=2",
            "--set",
            "data.seq_len=64",
            "--set",
            "model.overrides.num_hidden_layers=2",
            "--set",
            "checkpoint.save_final=false",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=str(tmp_path),
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    found = sorted(tmp_path.rglob("metrics.jsonl"))
    assert found, "the training run wrote no metrics.jsonl"
    run = found[0].parent
    metrics = read_metrics(found[0])
    assert len(metrics.records) == 10 and not metrics.skipped_lines and not metrics.truncated_tail
    info = generate(run)
    page = info["output"].read_text()
    for pid in CORE_PLOTS:
        assert f'id="{pid}"' in page, pid
    assert "plot-expert-load-layer-" in page  # the tiny model has MoE layers
    assert isinstance(info["alerts"], list) and all(isinstance(a, Alert) for a in info["alerts"])


def test_report_plots_validation_loss_and_samples_per_source(tmp_path):
    records = synth_records(n=40, memory=False)
    for r in records:
        if r["step"] % 10 == 0:
            r["val_loss"], r["val_ppl"] = r["loss"] + 0.3, math.exp(r["loss"] + 0.3)
        r["samples_by_source"] = {"data/web": 6 * r["step"], "data/code": 2 * r["step"]}
    generate(write_run(tmp_path / "run", records))
    page = (tmp_path / "run" / "report.html").read_text()
    loss_plot = page[page.index('id="plot-loss"') : page.index('id="plot-lr"')]
    assert "validation loss" in loss_plot
    assert 'id="plot-samples-by-source"' in page and "data/web" in page and "data/code" in page
    generate(write_run(tmp_path / "plain", synth_records(n=40, memory=False)))
    plain = (tmp_path / "plain" / "report.html").read_text()
    assert "plot-samples-by-source" not in plain


def test_report_plots_the_data_wait_when_logged(tmp_path):
    records = synth_records(n=20, memory=False)
    for r in records:
        r["data_wait_s"] = 0.002 * r["step"]
    generate(write_run(tmp_path / "run", records))
    assert 'id="plot-data-wait"' in (tmp_path / "run" / "report.html").read_text()
    generate(write_run(tmp_path / "plain", synth_records(n=20, memory=False)))
    assert "plot-data-wait" not in (tmp_path / "plain" / "report.html").read_text()


@pytest.mark.parametrize("content", ["", "\n\n", 'not json\n{"loss": 1}\n', '{"step": -1}\n', '{"step": 1'])
def test_report_with_no_valid_record_says_so_and_fails(tmp_path, capsys, content):
    """An empty page with "No alerts." does not pass for a report: like a missing file, a metrics file without
    one valid step record is one line and a non-zero exit, and no page is written."""
    from ms_deepseek.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(content)
    code = main(["report", str(run)])
    err = [ln for ln in capsys.readouterr().err.splitlines() if not ln.startswith("warning:")]
    assert code == 2 and len(err) == 1 and "no valid step record" in err[0], err
    assert not (run / "report.html").exists()
