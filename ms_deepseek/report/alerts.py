"""Training-health alert rules: one implementation for the trainer's console and the report.

``AlertMonitor.observe(record)`` takes one metrics record (the dict written to
metrics.jsonl, see the shared interfaces) and returns the alerts that this
record *opened*. An alert is an episode: while its condition keeps holding, the
same Alert object's ``last_step`` (and message) follow along, so the report,
which feeds the whole file through one monitor, shows one alert per episode
with its step range, and the console prints each episode once, when it starts.

Rule ids (cited by docs/troubleshooting.md as ``alert:<id>``) are in :data:`RULES`.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, Iterable, List, Optional

from ms_deepseek.report.metrics_io import SPECIAL, finite, number

RULES: Dict[str, str] = {
    "grad_norm_high": "gradient norm above 1 for 10 consecutive logs",
    "grad_norm_low": "gradient norm below 1e-4 for 10 consecutive logs",
    "expert_starved": "an expert gets under 50% of its fair share of routed tokens over the last 20 logs",
    "loss_spike": "loss above the mean of the last 50 logs by more than 4 standard deviations",
    "non_finite": "NaN or Inf in loss, total_loss, grad_norm, lr, balance losses or tokens/s",
    "throughput_drop": "tokens/s below half the median of the last 20 logs",
    "memory_growth": "device memory allocated (median of the last 20 logs) over 10% + 0.25 GB above its "
    "level after warm-up (logs 21-40)",
    "memory_fragmented": "memory fragmentation above 0.3 for 10 consecutive logs",
}

# Bounds of the healthy gradient-norm band (the report shades it).
GRAD_NORM_HIGH = 1.0
GRAD_NORM_LOW = 1e-4

FINITE_KEYS = (
    "loss",
    "total_loss",
    "grad_norm",
    "lr",
    "balance_expert",
    "balance_device",
    "balance_comm",
    "tokens_per_s",
)


@dataclass
class Alert:
    rule: str
    message: str
    first_step: int
    last_step: int
    key: str = ""  # what the episode is about (MoE layer for expert_starved), "" otherwise

    @property
    def steps(self) -> str:
        return (
            f"step {self.first_step}"
            if self.first_step == self.last_step
            else f"steps {self.first_step}-{self.last_step}"
        )

    def __str__(self) -> str:
        return f"[alert:{self.rule}] {self.steps}: {self.message}"


@dataclass
class AlertConfig:
    streak: int = 10  # consecutive logs for the gradient-norm rules
    grad_high: float = GRAD_NORM_HIGH
    grad_low: float = GRAD_NORM_LOW
    expert_window: int = 20
    expert_fraction: float = 0.5  # of the fair share 1/E
    spike_window: int = 50
    spike_min_history: int = 10
    spike_sigmas: float = 4.0
    spike_min_rel_std: float = 0.01  # std floor, relative to |mean|: a flat loss must not alert on noise
    throughput_window: int = 20
    throughput_min_history: int = 5
    throughput_fraction: float = 0.5
    memory_window: int = 20
    memory_growth: float = 0.10  # relative
    memory_slack_gb: float = 0.25  # absolute, so allocator noise on small runs does not alert
    fragmentation: float = 0.3


class _Streak:
    """``count`` consecutive finite values satisfying ``pred`` open an episode."""

    def __init__(self, rule: str, need: int, pred, describe):
        self.rule, self.need, self.pred, self.describe = rule, need, pred, describe
        self.start: Optional[int] = None
        self.values: List[float] = []
        self.open: Optional[Alert] = None

    def observe(self, step: int, value: Optional[float]) -> Optional[Alert]:
        if value is None:
            return None  # key not logged this time: the streak neither grows nor breaks
        if not math.isfinite(value) or not self.pred(value):
            self.start, self.values, self.open = None, [], None
            return None
        if self.start is None:
            self.start = step
        self.values.append(value)
        if len(self.values) < self.need:
            return None
        message = self.describe(self.values)
        if self.open is None:
            self.open = Alert(self.rule, message, self.start, step)
            return self.open
        self.open.last_step, self.open.message = step, message
        return None


class AlertMonitor:
    """Feed records in step order with :meth:`observe`; every alert so far is in :attr:`alerts`."""

    def __init__(self, config: Optional[AlertConfig] = None):
        self.cfg = cfg = config or AlertConfig()
        self.alerts: List[Alert] = []
        self._grad_high = _Streak(
            "grad_norm_high",
            cfg.streak,
            lambda v: v > cfg.grad_high,
            lambda vs: f"gradient norm above {cfg.grad_high:g} for {len(vs)} consecutive logs (max {max(vs):.3g})",
        )
        self._grad_low = _Streak(
            "grad_norm_low",
            cfg.streak,
            lambda v: v < cfg.grad_low,
            lambda vs: f"gradient norm below {cfg.grad_low:g} for {len(vs)} consecutive logs (min {min(vs):.3g})",
        )
        self._loads: Dict[str, Deque] = {}
        self._load_sums: Dict[str, List[float]] = {}
        self._starved_open: Dict[str, Alert] = {}
        self._starved_seen: Dict[str, Dict[int, float]] = {}
        self._losses: Deque[float] = deque(maxlen=cfg.spike_window)
        self._spike_open: Optional[Alert] = None
        self._nonfinite_open: Optional[Alert] = None
        self._tps: Deque[float] = deque(maxlen=cfg.throughput_window)
        self._tps_open: Optional[Alert] = None
        self._tps_baseline = 0.0
        self._fragmented = _Streak(
            "memory_fragmented",
            cfg.streak,
            lambda v: v > cfg.fragmentation,
            lambda vs: (
                f"memory fragmentation above {cfg.fragmentation:g} for {len(vs)} consecutive logs "
                f"(max {max(vs):.2f}): the allocator holds memory it cannot reuse"
            ),
        )
        self._mem: List[float] = []
        self._mem_baseline: Optional[float] = None
        self._mem_open: Optional[Alert] = None

    # -- public -------------------------------------------------------------------------------
    def observe(self, record: Dict[str, Any]) -> List[Alert]:
        """Alerts opened by ``record`` (episodes that continue are updated in place, not returned)."""
        rec = record  # number() / _f() read "NaN" / "Infinity" strings too: no copy of big load lists
        step = int(number(rec, "step") or 0)
        opened = [
            a
            for a in (
                self._grad_high.observe(step, number(rec, "grad_norm")),
                self._grad_low.observe(step, number(rec, "grad_norm")),
                self._non_finite(step, rec),
                self._loss_spike(step, number(rec, "loss")),
                self._throughput(step, number(rec, "tokens_per_s")),
                self._memory_growth(step, number(rec, "memory_allocated_gb")),
                self._fragmented.observe(step, number(rec, "memory_fragmentation")),
            )
            if a is not None
        ]
        opened += self._expert_starved(step, rec.get("expert_load"))
        self.alerts.extend(opened)
        return opened

    def observe_all(self, records: Iterable[Dict[str, Any]]) -> List[Alert]:
        for record in records:
            self.observe(record)
        return self.alerts

    # -- rules --------------------------------------------------------------------------------
    def _non_finite(self, step: int, rec: Dict[str, Any]) -> Optional[Alert]:
        bad = [k for k in FINITE_KEYS if number(rec, k) is not None and not math.isfinite(number(rec, k))]
        # With a dynamic loss scale an inf/NaN gradient norm alone is an overflow the trainer skips
        # (it logs overflow: true next to loss_scale).
        if bad == ["grad_norm"] and "loss_scale" in rec and rec.get("overflow", True) is not False:
            bad = []
        if not bad:
            self._nonfinite_open = None
            return None
        text = ", ".join(f"{k}={number(rec, k)}" for k in bad)
        if self._nonfinite_open is None:
            self._nonfinite_open = Alert("non_finite", f"non-finite values: {text}", step, step)
            return self._nonfinite_open
        self._nonfinite_open.last_step = step
        self._nonfinite_open.message = f"non-finite values (last: {text})"
        return None

    def _loss_spike(self, step: int, loss: Optional[float]) -> Optional[Alert]:
        if not finite(loss):
            return None
        history = self._losses
        opened = None
        if len(history) >= self.cfg.spike_min_history:
            mean = statistics.fmean(history)
            std = max(statistics.pstdev(history), self.cfg.spike_min_rel_std * abs(mean))
            sigmas = (loss - mean) / std
            if sigmas > self.cfg.spike_sigmas:
                text = (
                    f"loss {loss:.4g} is {sigmas:.1f} standard deviations above the mean {mean:.4g} "
                    f"of the last {len(history)} logs"
                )
                if self._spike_open is None:
                    self._spike_open = opened = Alert("loss_spike", text, step, step)
                else:
                    self._spike_open.last_step = step
            else:
                self._spike_open = None
        history.append(loss)
        return opened

    def _throughput(self, step: int, tps: Optional[float]) -> Optional[Alert]:
        if not finite(tps):
            return None
        cfg = self.cfg
        if self._tps_open is not None:
            if tps < cfg.throughput_fraction * self._tps_baseline:
                self._tps_open.last_step = step
                return None
            self._tps_open = None  # recovered
            self._tps.append(tps)
            return None
        if len(self._tps) >= cfg.throughput_min_history:
            baseline = statistics.median(self._tps)
            if tps < cfg.throughput_fraction * baseline:
                self._tps_baseline = baseline
                self._tps_open = Alert(
                    "throughput_drop",
                    f"tokens/s fell to {tps:.4g} from a median of {baseline:.4g} over the last {len(self._tps)} logs",
                    step,
                    step,
                )
                return self._tps_open
        self._tps.append(tps)
        return None

    def _memory_growth(self, step: int, gb: Optional[float]) -> Optional[Alert]:
        if not finite(gb):
            return None
        w = self.cfg.memory_window
        self._mem.append(gb)
        if self._mem_baseline is None:
            if len(self._mem) < 2 * w:
                return None
            # the first window is warm-up (compilation, allocator growth); the second is the baseline
            self._mem_baseline = statistics.median(self._mem[w : 2 * w])
        del self._mem[:-w]  # keep the last window only
        recent = statistics.median(self._mem)
        base = self._mem_baseline
        if recent <= base * (1 + self.cfg.memory_growth) + self.cfg.memory_slack_gb:
            self._mem_open = None
            return None
        text = (
            f"device memory allocated grew from {base:.2f} GB after warm-up to {recent:.2f} GB "
            f"(median of the last {w} logs): a leak or growing buffers end in out-of-memory"
        )
        if self._mem_open is None:
            self._mem_open = Alert("memory_growth", text, step, step)
            return self._mem_open
        self._mem_open.last_step, self._mem_open.message = step, text
        return None

    def _expert_starved(self, step: int, loads: Any) -> List[Alert]:
        if not isinstance(loads, dict):
            return []
        cfg, opened = self.cfg, []
        for layer, load in loads.items():
            if not isinstance(load, list) or not load:
                continue
            values = load if all(type(v) is float for v in load) else [_f(x) for x in load]
            if None in values or not all(map(math.isfinite, values)):
                continue
            window = self._loads.setdefault(layer, deque())
            sums = self._load_sums.get(layer)
            if sums is None or len(sums) != len(load):  # first record, or the expert count changed
                window.clear()
                sums = self._load_sums[layer] = [0.0] * len(load)
            window.append((step, values))
            sums = [a + b for a, b in zip(sums, values)]  # running sums: O(E) per record, not O(E * window)
            if len(window) > cfg.expert_window:
                sums = [a - b for a, b in zip(sums, window.popleft()[1])]
            self._load_sums[layer] = sums
            if len(window) < cfg.expert_window:
                continue
            n = len(load)
            mean = [x / len(window) for x in sums]
            fair = 1.0 / n
            starved = {e: m for e, m in enumerate(mean) if m < cfg.expert_fraction * fair}
            if not starved:
                self._starved_open.pop(layer, None)
                continue
            seen = self._starved_seen.setdefault(layer, {}) if layer in self._starved_open else {}
            for e, m in starved.items():
                seen[e] = min(m, seen.get(e, m))
            self._starved_seen[layer] = seen
            listing = ", ".join(f"{e} ({100 * m:.1f}%)" for e, m in sorted(seen.items())[:8])
            more = f" and {len(seen) - 8} more" if len(seen) > 8 else ""
            text = (
                f"MoE layer {layer}: expert(s) {listing}{more} below {100 * cfg.expert_fraction * fair:.1f}% "
                f"of routed slots over {len(window)} logs (fair share {100 * fair:.1f}%)"
            )
            if layer in self._starved_open:
                alert = self._starved_open[layer]
                alert.last_step, alert.message = step, text
            else:
                alert = Alert("expert_starved", text, window[0][0], step, key=str(layer))
                self._starved_open[layer] = alert
                opened.append(alert)
        return opened


def _f(x: Any) -> Optional[float]:
    if isinstance(x, str):
        return SPECIAL.get(x)
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def scan(records: Iterable[Dict[str, Any]], config: Optional[AlertConfig] = None) -> List[Alert]:
    """Every alert episode of a whole run (what the report shows)."""
    return AlertMonitor(config).observe_all(records)
