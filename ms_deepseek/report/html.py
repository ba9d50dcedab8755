"""``ms-deepseek report RUN_DIR``: a self-contained HTML health page of a training run.

Reads ``RUN_DIR/metrics.jsonl`` (tolerating a run that is still writing it),
runs the alert rules of :mod:`ms_deepseek.report.alerts` over the whole file and
writes one HTML file with the alerts at the top and inline SVG plots: loss (with
a smoothed line and the validation loss when logged), learning rate, gradient norm with its healthy band, tokens/s,
per-MoE-layer expert load heatmaps, dropped-token fraction, balance losses, and
device memory / fragmentation and samples per data source (mixtures) when logged. Nothing is fetched when it is viewed.
:func:`watch` rewrites the page every N seconds (atomically) until interrupted. The command line is
:mod:`ms_deepseek.cli.report`.
"""

from __future__ import annotations

import datetime as _dt
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ms_deepseek.core.atomic import atomic_write_text
from ms_deepseek.core.errors import UserError
from ms_deepseek.report.alerts import GRAD_NORM_HIGH, GRAD_NORM_LOW, RULES, Alert, scan
from ms_deepseek.report.metrics_io import MetricsFile, number, read_metrics
from ms_deepseek.report.svg import Band, Chart, Series, ema, esc, render_chart, render_heatmap, xy

CORE_PLOTS = (
    "plot-loss",
    "plot-lr",
    "plot-grad-norm",
    "plot-tokens-per-s",
    "plot-expert-load",
    "plot-dropped-fraction",
    "plot-balance-losses",
)
MEMORY_PLOTS = ("plot-memory", "plot-fragmentation")

CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:20px;color:#222;background:#fff}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:18px 0 8px}
.meta{color:#555;margin-bottom:10px} .note{color:#8a5a00}
#alerts{border:1px solid #ddd;border-radius:6px;padding:8px 12px;background:#fafafa}
#alerts.has{border-color:#d62728;background:#fff5f5}
.alert{margin:4px 0} .rule{font-family:ui-monospace,monospace;background:#d62728;color:#fff;padding:1px 6px;
border-radius:4px;font-size:12px} .steps{font-weight:600;margin:0 6px} .why{color:#666;font-size:12px}
.ok{color:#2ca02c;font-weight:600}
.grid-plots{display:flex;flex-wrap:wrap;gap:14px}
figure.plot{margin:0;border:1px solid #e3e3e3;border-radius:6px;padding:6px 8px;background:#fff}
figcaption{font-weight:600;margin-bottom:2px}
svg .grid{stroke:#eee} svg .axis{stroke:#888} svg .frame{fill:none;stroke:#bbb}
svg .tick{font-size:11px;fill:#555} svg .label{font-size:11px;fill:#333} svg .empty{font-size:13px;fill:#999}
svg .nonfinite{stroke:#d62728;stroke-width:2}
.legend{font-size:12px;color:#444} .key{margin-right:12px;white-space:nowrap}
.key i{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:-2px;border-radius:2px}
"""


# ---------------------------------------------------------------------------------------------
# page


def _alerts_html(alerts: List[Alert]) -> str:
    if not alerts:
        return '<section id="alerts"><h2>Alerts</h2><p class="ok">No alerts.</p></section>'
    items = "".join(
        f'<div class="alert" data-rule="{esc(a.rule)}"><span class="rule">{esc(a.rule)}</span>'
        f'<span class="steps">{esc(a.steps)}</span>{esc(a.message)} <span class="why">(rule: {esc(RULES[a.rule])})'
        f"</span></div>"
        for a in alerts
    )
    return f'<section id="alerts" class="has"><h2>Alerts ({len(alerts)})</h2>{items}</section>'


def _moe_layers(records) -> List[str]:
    layers = set()
    for r in records:
        for key in ("expert_load", "dropped_fraction"):
            if isinstance(r.get(key), dict):
                layers.update(r[key].keys())
    return sorted(layers, key=lambda s: (len(s), s))


def _per_layer(record, key: str) -> dict:
    """``record[key]`` when it is the per-layer mapping the trainer logs, else {} (a damaged line)."""
    value = record.get(key)
    return value if isinstance(value, dict) else {}


_SOURCE_COLORS = ("#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#9467bd", "#2ca02c")


def _per_source_validation(records) -> List[str]:
    """The ``val_loss/<source>`` keys a weighted mixture logs (one per source), in first-seen order."""
    keys: List[str] = []
    for r in records:
        keys += [k for k in r if isinstance(k, str) and k.startswith("val_loss/") and k not in keys]
    return keys


def _step_values(records, value_of) -> Tuple[List[int], List[float]]:
    """(steps, values) of the records where ``value_of(record)`` is a number (not a bool)."""
    xs, ys = [], []
    for r in records:
        v = value_of(r)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs.append(int(r.get("step", 0)))
            ys.append(float(v))
    return xs, ys


def _loss_plot(records) -> List[str]:
    steps, loss = xy(records, "loss")
    ts, total = xy(records, "total_loss")
    per_source = [
        Series(
            f"validation loss: {key.split('/', 1)[1]}",
            *xy(records, key),
            _SOURCE_COLORS[i % len(_SOURCE_COLORS)],
            1.5,
            dash="6 3",
        )
        for i, key in enumerate(_per_source_validation(records))
    ]
    return [
        render_chart(
            Chart(
                "plot-loss",
                "Loss",
                [
                    Series("total loss (with balance losses)", ts, total, "#ff7f0e", 1.0, dash="4 3"),
                    Series("loss", steps, loss, "#9ec5e8", 1.0),
                    Series("loss (smoothed)", steps, ema(loss), "#1f77b4", 2.0),
                    Series("validation loss (held-out, eval mode)", *xy(records, "val_loss"), "#d62728", 2.0),
                ]
                + per_source,
            )
        )
    ]


def _lr_plot(records) -> List[str]:
    return [render_chart(Chart("plot-lr", "Learning rate", [Series("lr", *xy(records, "lr"))]))]


def _grad_norm_plot(records) -> List[str]:
    return [
        render_chart(
            Chart(
                "plot-grad-norm",
                "Gradient norm (log scale)",
                [Series("grad norm", *xy(records, "grad_norm"), "#9467bd")],
                log_y=True,
                band=Band(GRAD_NORM_LOW, GRAD_NORM_HIGH, f"healthy band [{GRAD_NORM_LOW:g}, {GRAD_NORM_HIGH:g}]"),
            )
        )
    ]


def _tokens_plot(records) -> List[str]:
    return [
        render_chart(
            Chart(
                "plot-tokens-per-s",
                "Throughput (tokens/s)",
                [Series("tokens/s", *xy(records, "tokens_per_s"), "#2ca02c")],
            )
        )
    ]


def _expert_load_plots(records) -> List[str]:
    heat = []
    for layer in _moe_layers(records):
        hs, rows = [], []
        for r in records:
            load = _per_layer(r, "expert_load").get(layer)
            if isinstance(load, list) and load:
                n = len(load)
                hs.append(int(r.get("step", 0)))
                rows.append([float(x) * n if isinstance(x, (int, float)) else float("nan") for x in load])
        if rows and len({len(r) for r in rows}) == 1:
            heat.append(render_heatmap(f"plot-expert-load-layer-{layer}", f"Expert load, MoE layer {layer}", hs, rows))
    if not heat:
        heat.append('<p class="empty">no expert load logged (dense model or no MoE layer)</p>')
    return [
        f'<div class="plot-group" id="plot-expert-load"><h2>Expert load per MoE layer (share of routed '
        f'slots / fair share; bright = overloaded, dark = starved)</h2><div class="grid-plots">'
        f"{''.join(heat)}</div></div>"
    ]


def _dropped_plot(records) -> List[str]:
    dropped = []
    for layer in _moe_layers(records):
        xs, ys = _step_values(records, lambda r, layer=layer: _per_layer(r, "dropped_fraction").get(layer))
        if xs:
            dropped.append(Series(f"layer {layer}", xs, ys))
    return [render_chart(Chart("plot-dropped-fraction", "Dropped fraction of routed slots", dropped))]


def _balance_plot(records) -> List[str]:
    return [
        render_chart(
            Chart(
                "plot-balance-losses",
                "Balance losses (unweighted, summed over MoE layers)",
                [
                    Series("expert", *xy(records, "balance_expert")),
                    Series("device", *xy(records, "balance_device")),
                    Series("communication", *xy(records, "balance_comm")),
                ],
            )
        )
    ]


def _samples_by_source_plot(records) -> List[str]:
    """A weighted mixture: samples drawn from each source so far (no plot without one)."""
    sources = sorted({name for r in records for name in _per_layer(r, "samples_by_source")})
    if not sources:
        return []
    series = [
        Series(name, *_step_values(records, lambda r, name=name: _per_layer(r, "samples_by_source").get(name)))
        for name in sources
    ]
    return [render_chart(Chart("plot-samples-by-source", "Samples drawn per data source", series))]


def _data_wait_plot(records) -> List[str]:
    if not any(number(r, "data_wait_s") is not None for r in records):
        return []
    return [
        render_chart(
            Chart(
                "plot-data-wait",
                "Data wait per step (s)",
                [Series("waiting for the batch", *xy(records, "data_wait_s"), "#9467bd")],
            )
        )
    ]


def _memory_plot(records) -> List[str]:
    if not any(
        number(r, "memory_allocated_gb") is not None or number(r, "memory_reserved_gb") is not None for r in records
    ):
        return []
    return [
        render_chart(
            Chart(
                "plot-memory",
                "Device memory (GB)",
                [
                    Series("allocated", *xy(records, "memory_allocated_gb")),
                    Series("reserved", *xy(records, "memory_reserved_gb")),
                ],
            )
        )
    ]


def _fragmentation_plot(records) -> List[str]:
    if not any(number(r, "memory_fragmentation") is not None for r in records):
        return []
    return [
        render_chart(
            Chart(
                "plot-fragmentation",
                "Memory fragmentation",
                [Series("fragmentation", *xy(records, "memory_fragmentation"), "#8c564b")],
            )
        )
    ]


# the report's plots in page order; each gives its HTML, nothing when its metric was never logged
PLOTS = (
    _loss_plot,
    _lr_plot,
    _grad_norm_plot,
    _tokens_plot,
    _expert_load_plots,
    _dropped_plot,
    _balance_plot,
    _samples_by_source_plot,
    _data_wait_plot,
    _memory_plot,
    _fragmentation_plot,
)


def build_plots(records) -> List[str]:
    return [html for plot in PLOTS for html in plot(records)]


def render_page(run_dir: Path, metrics: MetricsFile, alerts: List[Alert], refresh: Optional[float] = None) -> str:
    records = metrics.records
    last = records[-1] if records else {}
    notes = []
    if metrics.truncated_tail:
        notes.append("the last line was incomplete (the run is writing it) and was left out")
    if metrics.skipped_lines:
        lines = ", ".join(map(str, metrics.skipped_lines[:10]))
        notes.append(f"{len(metrics.skipped_lines)} unreadable line(s) skipped: {lines}")
    elapsed = number(last, "elapsed_s")
    meta = (
        f"{len(records)} logged steps"
        + (f", last step {last.get('step')}" if records else "")
        + (f", {elapsed / 3600:.2f} h elapsed" if elapsed is not None and elapsed == elapsed else "")
        + f" &middot; generated {_dt.datetime.now().strftime('%Y-%m-%d %H:%M:%S')}"
    )
    head_refresh = f'<meta http-equiv="refresh" content="{int(max(1, refresh))}">' if refresh else ""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>ms-deepseek report: {esc(run_dir.name)}</title>{head_refresh}<style>{CSS}</style></head><body>"
        f'<h1>Training report: {esc(run_dir.resolve())}</h1><div class="meta">{meta}</div>'
        + "".join(f'<div class="note">Note: {esc(n)}</div>' for n in notes)
        + _alerts_html(alerts)
        + '<h2>Metrics</h2><div class="grid-plots">'
        + "".join(build_plots(records))
        + "</div>"
        + "</body></html>\n"
    )


def generate(run_dir, output=None, refresh: Optional[float] = None) -> Dict[str, object]:
    """Build the report once; returns {"output", "records", "alerts"}."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: not a folder (expected a run folder holding metrics.jsonl)")
    metrics = read_metrics(run_dir / "metrics.jsonl")
    if not metrics.records:  # an empty page would read as "no alerts": say there is nothing to report
        why = (
            f"{len(metrics.skipped_lines)} unreadable line(s), first at line {metrics.skipped_lines[0]}"
            if metrics.skipped_lines
            else "an incomplete last line only"
            if metrics.truncated_tail
            else "the file is empty"
        )
        raise UserError(f"{run_dir / 'metrics.jsonl'}: no valid step record ({why}); nothing to report")
    alerts = scan(metrics.records)
    out = Path(output) if output else run_dir / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, render_page(run_dir, metrics, alerts, refresh))  # a viewer never sees half a page
    return {"output": out, "records": len(metrics.records), "alerts": alerts, "problems": metrics.problems}


def watch(run_dir, output=None, seconds: float = 30.0, iterations: Optional[int] = None, echo=print) -> int:
    """Rewrite the report every ``seconds``; new alerts are echoed as they appear."""
    shown = set()
    done = 0
    while iterations is None or done < iterations:
        if done:
            time.sleep(seconds)
        try:
            info = generate(run_dir, output, refresh=seconds)
        except UserError as exc:  # metrics.jsonl not there yet: keep waiting
            echo(f"waiting: {exc}")
            done += 1
            continue
        for alert in info["alerts"]:
            key = (alert.rule, alert.first_step, alert.key)
            if key not in shown:
                shown.add(key)
                echo(str(alert))
        done += 1
    return 0
