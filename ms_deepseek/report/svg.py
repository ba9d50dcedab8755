"""Inline SVG charts for the HTML report: line charts (linear or log y) and heatmaps
(an inline PNG, encoded here with zlib, inside the SVG).

Plain string building, no plotting library and nothing fetched when the page is
viewed. Non-finite values break a line and get a red tick at the top of the plot.
Long runs are thinned per pixel column (min and max of each bucket are kept, so
spikes survive).
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

W, H = 640, 230
PAD_L, PAD_R, PAD_T, PAD_B = 62, 16, 26, 34
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
MAX_POINTS = 1200


@dataclass
class Series:
    label: str
    xs: Sequence[float]
    ys: Sequence[Optional[float]]  # None = not logged; NaN / inf = non-finite (marked)
    color: str = ""
    width: float = 1.5
    opacity: float = 1.0
    dash: str = ""


@dataclass
class Band:
    low: float
    high: float
    label: str = ""
    color: str = "#2ca02c"


@dataclass
class Chart:
    id: str
    title: str
    series: List[Series] = field(default_factory=list)
    log_y: bool = False
    band: Optional[Band] = None
    y_label: str = ""


def esc(text: str) -> str:
    return html.escape(str(text), quote=True)


def nice_ticks(lo: float, hi: float, count: int = 5) -> List[float]:
    """Round tick values covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(1, count)
    if not math.isfinite(raw) or raw <= 0:  # a span beyond float range, or below its resolution at lo
        return []
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.ceil(lo / step) * step
    # by index, not t += step: at |lo| ~ 1e19 adding a step of 2 leaves t unchanged (an endless loop)
    n = int(math.floor((hi - start) / step + 1e-9)) + 1 if math.isfinite((hi - start) / step) else 0
    ticks = [round(start + k * step, 12) for k in range(max(0, min(n, 4 * count + 2)))]
    return sorted(set(ticks))


def fmt(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e5 or a < 1e-3:
        return f"{v:.0e}"
    if a >= 100:
        return f"{v:.0f}"
    return f"{v:.3g}"


def thin(xs: Sequence[float], ys: Sequence[Optional[float]], limit: int = MAX_POINTS):
    """At most ~``limit`` points: per x-bucket keep the min and max finite y, in x order."""
    n = len(xs)
    if n <= limit:
        return list(xs), list(ys)
    buckets = limit // 2
    out_x, out_y = [], []
    for b in range(buckets):
        lo, hi = b * n // buckets, (b + 1) * n // buckets
        idx = [i for i in range(lo, hi) if ys[i] is not None and math.isfinite(ys[i])]
        if not idx:
            if hi > lo:  # keep the gap / non-finite marker
                out_x.append(xs[lo])
                out_y.append(ys[lo])
            continue
        i_min = min(idx, key=lambda i: ys[i])
        i_max = max(idx, key=lambda i: ys[i])
        for i in sorted({i_min, i_max}):
            out_x.append(xs[i])
            out_y.append(ys[i])
    return out_x, out_y


@dataclass
class _Axes:
    """The plot area of a chart: data ranges (decades on a log axis) and the pixel mapping."""

    x0: float
    x1: float
    y0: float
    y1: float
    log_y: bool
    pw: float = W - PAD_L - PAD_R
    ph: float = H - PAD_T - PAD_B

    def sx(self, x: float) -> float:
        return PAD_L + (x - self.x0) / (self.x1 - self.x0) * self.pw

    def sy(self, y: float) -> float:
        v = math.log10(y) if self.log_y else y
        return PAD_T + (1 - (v - self.y0) / (self.y1 - self.y0)) * self.ph

    def shown(self, y) -> bool:
        """A value the line can draw (finite; positive on a log axis)."""
        return y is not None and math.isfinite(y) and (y > 0 or not self.log_y)


def _axes(chart: Chart, pts_x: List[float], ys: List[float]) -> _Axes:
    x0, x1 = min(pts_x), max(pts_x)
    if x1 == x0:
        x1 = x0 + 1
    if chart.band is not None:
        ys = ys + [chart.band.low, chart.band.high]
    y0, y1 = min(ys), max(ys)
    if chart.log_y:
        y0, y1 = math.floor(math.log10(y0)), math.ceil(math.log10(y1))
        if y1 == y0:
            y1 = y0 + 1
    elif y1 == y0:
        y0, y1 = y0 - (abs(y0) * 0.1 or 1), y1 + (abs(y1) * 0.1 or 1)
    else:
        margin = (y1 - y0) * 0.05
        y0, y1 = y0 - margin, y1 + margin
    return _Axes(x0, x1, y0, y1, chart.log_y)


def _grid(ax: _Axes) -> List[str]:
    """Grid and y ticks, then the x ticks."""
    body = []
    yticks = [10.0**e for e in range(int(ax.y0), int(ax.y1) + 1)] if ax.log_y else nice_ticks(ax.y0, ax.y1)
    for t in yticks:
        y = ax.sy(t)
        if PAD_T - 0.5 <= y <= PAD_T + ax.ph + 0.5:
            body.append(f'<line x1="{PAD_L}" x2="{PAD_L + ax.pw}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
            body.append(f'<text x="{PAD_L - 6}" y="{y + 4:.1f}" text-anchor="end" class="tick">{fmt(t)}</text>')
    for t in nice_ticks(ax.x0, ax.x1, 6):
        x = ax.sx(t)
        body.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{PAD_T + ax.ph}" y2="{PAD_T + ax.ph + 4}" class="axis"/>')
        body.append(f'<text x="{x:.1f}" y="{PAD_T + ax.ph + 17}" text-anchor="middle" class="tick">{fmt(t)}</text>')
    return body


def _band_rect(ax: _Axes, band: Band) -> str:
    top, bottom = ax.sy(band.high), ax.sy(band.low)
    return (
        f'<rect x="{PAD_L}" y="{top:.1f}" width="{ax.pw}" height="{max(0.0, bottom - top):.1f}" '
        f'fill="{band.color}" fill-opacity="0.12" class="band"><title>{esc(band.label)}'
        f"</title></rect>"
    )


def _series_lines(ax: _Axes, s: Series, color: str, marks: list) -> List[str]:
    """A series as polylines over its runs of drawable points (a lone point as a dot); its non-finite
    values go to ``marks`` as (x pixel, value)."""
    xs, ys_ = thin(list(s.xs), list(s.ys))
    runs, cur = [], []
    for x, y in zip(xs, ys_):
        if ax.shown(y):
            cur.append(f"{ax.sx(x):.1f},{ax.sy(y):.1f}")
        else:
            if cur:
                runs.append(cur)
            cur = []
            if y is not None and not math.isfinite(y):
                marks.append((ax.sx(x), y))
    if cur:
        runs.append(cur)
    dash = f' stroke-dasharray="{s.dash}"' if s.dash else ""
    body = []
    for run in runs:
        if len(run) == 1:
            cx, cy = run[0].split(",")
            body.append(f'<circle cx="{cx}" cy="{cy}" r="1.8" fill="{color}"/>')
        else:
            body.append(
                f'<polyline points="{" ".join(run)}" fill="none" stroke="{color}" '
                f'stroke-width="{s.width}" stroke-opacity="{s.opacity}"{dash}/>'
            )
    return body


def render_chart(chart: Chart) -> str:
    """An SVG line chart inside a <figure id=chart.id>."""
    pts_x = [x for s in chart.series for x in s.xs]
    ys = [y for s in chart.series for y in s.ys if y is not None and math.isfinite(y) and (y > 0 or not chart.log_y)]
    if not pts_x or not ys:
        return _frame(
            chart, f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle" class="empty">no data logged</text>', ""
        )
    ax = _axes(chart, pts_x, ys)
    body = _grid(ax)
    if chart.band is not None:
        body.append(_band_rect(ax, chart.band))
    legend, marks = [], []
    for i, s in enumerate(chart.series):
        color = s.color or PALETTE[i % len(PALETTE)]
        body += _series_lines(ax, s, color, marks)
        legend.append(f'<span class="key"><i style="background:{color}"></i>{esc(s.label)}</span>')
    for x, y in marks:
        body.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{PAD_T}" y2="{PAD_T + 8}" class="nonfinite">'
            f"<title>{esc(y)}</title></line>"
        )
    if marks:
        legend.append('<span class="key"><i style="background:#d62728"></i>NaN / Inf</span>')
    if chart.band is not None:
        legend.append(
            f'<span class="key"><i style="background:{chart.band.color};opacity:.3"></i>{esc(chart.band.label)}</span>'
        )
    body.append(f'<rect x="{PAD_L}" y="{PAD_T}" width="{ax.pw}" height="{ax.ph}" class="frame"/>')
    body.append(f'<text x="{PAD_L + ax.pw / 2}" y="{H - 4}" text-anchor="middle" class="label">step</text>')
    return _frame(chart, "".join(body), "".join(legend))


def _frame(chart: Chart, body: str, legend: str) -> str:
    return (
        f'<figure class="plot" id="{esc(chart.id)}"><figcaption>{esc(chart.title)}</figcaption>'
        f'<svg viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" aria-label="{esc(chart.title)}">'
        f'{body}</svg><div class="legend">{legend}</div></figure>'
    )


# viridis, 6 stops
_STOPS = [(68, 1, 84), (65, 68, 135), (42, 120, 142), (34, 168, 132), (122, 209, 81), (253, 231, 37)]


def _rgb(t: float) -> Tuple[int, int, int]:
    t = min(1.0, max(0.0, t))
    pos = t * (len(_STOPS) - 1)
    i = min(int(pos), len(_STOPS) - 2)
    f = pos - i
    r, g, b = (round(a + (c - a) * f) for a, c in zip(_STOPS[i], _STOPS[i + 1]))
    return r, g, b


def colormap(t: float) -> str:
    return "#%02x%02x%02x" % _rgb(t)


def png_data_uri(pixels) -> str:
    """A ``data:image/png;base64,...`` URI of an RGB image: uint8 array [height, width, 3]."""
    import base64
    import struct
    import zlib

    import numpy as np

    pixels = np.ascontiguousarray(pixels, dtype=np.uint8)
    height, width, _ = pixels.shape
    rows = np.concatenate([np.zeros((height, 1), np.uint8), pixels.reshape(height, width * 3)], axis=1)
    raw = rows.tobytes()  # filter byte 0 + RGB per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )
    return "data:image/png;base64," + base64.b64encode(png).decode()


def colormap_array(t):
    """Viridis colours of ``t`` in [0, 1] (clipped): uint8 array [..., 3]."""
    import numpy as np

    stops = np.asarray(_STOPS, np.float64)
    pos = np.clip(np.nan_to_num(np.asarray(t, np.float64), nan=0.0), 0.0, 1.0) * (len(_STOPS) - 1)  # NaN: no index
    i = np.minimum(pos.astype(np.int64), len(_STOPS) - 2)
    f = (pos - i)[..., None]
    return np.rint(stops[i] + (stops[i + 1] - stops[i]) * f).astype(np.uint8)


def render_heatmap(
    chart_id: str, title: str, steps: Sequence[int], rows, vmax: float = 2.0, max_cols: int = 400
) -> str:
    """Heatmap of ``rows`` [T][E] (value / fair share) over time: x = logs (bucketed), y = expert.

    The cells are one small PNG (one pixel per cell) stretched over the plot area, so a
    160-expert layer over thousands of logs stays a few kilobytes.
    """
    import numpy as np

    data = np.asarray(rows, np.float64) if len(rows) else np.zeros((0, 0))
    if data.size == 0:
        return _frame(
            Chart(chart_id, title),
            f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle" class="empty">no data logged</text>',
            "",
        )
    T, E = data.shape
    cols = min(T, max_cols)
    starts = (np.arange(cols) * T) // cols  # first log of each column bucket
    ok = np.isfinite(data)
    sums = np.add.reduceat(np.where(ok, data, 0.0), starts, axis=0)  # [cols, E]
    counts = np.add.reduceat(ok.astype(np.int64), starts, axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = sums / counts
    pixels = colormap_array(mean.T / vmax)  # [E, cols, 3]
    pixels[(counts.T == 0)] = 255  # nothing finite logged: white
    pw, ph = W - PAD_L - PAD_R, H - PAD_T - PAD_B
    parts = [
        f'<image x="{PAD_L}" y="{PAD_T}" width="{pw}" height="{ph}" preserveAspectRatio="none" '
        f'style="image-rendering:pixelated" href="{png_data_uri(pixels)}"/>',
        f'<rect x="{PAD_L}" y="{PAD_T}" width="{pw}" height="{ph}" class="frame"/>',
    ]
    rh, cw = ph / E, pw / cols
    for t in nice_ticks(0, E - 1, min(E, 6)):
        if float(t).is_integer() and 0 <= t < E:
            parts.append(
                f'<text x="{PAD_L - 6}" y="{PAD_T + (t + 0.5) * rh + 4:.1f}" text-anchor="end" '
                f'class="tick">{int(t)}</text>'
            )
    for c in sorted({0, cols // 2, cols - 1}):
        parts.append(
            f'<text x="{PAD_L + (c + 0.5) * cw:.1f}" y="{PAD_T + ph + 17}" text-anchor="middle" '
            f'class="tick">{steps[int(starts[c])]}</text>'
        )
    parts.append(f'<text x="{PAD_L + pw / 2}" y="{H - 4}" text-anchor="middle" class="label">step</text>')
    parts.append(
        f'<text x="14" y="{PAD_T + ph / 2}" transform="rotate(-90 14 {PAD_T + ph / 2})" '
        f'text-anchor="middle" class="label">expert</text>'
    )
    legend = "".join(
        f'<span class="key"><i style="background:{colormap(v / vmax)}"></i>{v:g}x</span>' for v in (0, 0.5, 1, 1.5, 2)
    )
    return _frame(Chart(chart_id, title), "".join(parts), legend + '<span class="key">load / fair share</span>')


def ema(values: Sequence[Optional[float]], smoothing: float = 0.9) -> List[Optional[float]]:
    """Debiased exponential moving average (TensorBoard's smoothing); non-finite values skipped."""
    out, acc, weight = [], 0.0, 0.0
    for v in values:
        if v is None or not math.isfinite(v):
            out.append(None)
            continue
        acc = smoothing * acc + (1 - smoothing) * v
        weight = smoothing * weight + (1 - smoothing)
        out.append(acc / weight)
    return out


def xy(records, key: str) -> Tuple[List[int], List[Optional[float]]]:
    """(steps, values) of ``key`` over the records that logged it."""
    from ms_deepseek.report.metrics_io import number

    xs, ys = [], []
    for r in records:
        v = number(r, key)
        if v is not None:
            xs.append(int(r.get("step", 0)))
            ys.append(v)
    return xs, ys
