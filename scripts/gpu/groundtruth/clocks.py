"""The GPU's SM clock, power and throttle state while work runs, sampled by ``nvidia-smi`` in the background.

Why: isolated GEMMs on the H200 of 2026-11-28 reached 0.72 of the datasheet bf16 peak (net of dispatch), the
published end-to-end runs imply 0.59. A GPU held at its power limit for seconds runs below the clock that a
short burst of kernels sees; this module reads that clock beside the work (``scripts/gpu/sustained_gemm.py``,
``scripts/gpu/driver_steps.py``) so the two rates can be told apart.

``Sampler`` starts ``nvidia-smi --query-gpu=... --loop-ms=PERIOD`` and parses its lines when stopped; where
``nvidia-smi`` is missing or fails, the samples are empty and ``why`` says so (the measurement around it still
runs). ``parse_lines`` and ``summary`` are pure (tested on CPU).
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

FIELDS = ("clocks.sm", "clocks.max.sm", "power.draw", "power.limit", "temperature.gpu",
          "clocks_throttle_reasons.active")
"""What each sample reads (``nvidia-smi --help-query-gpu``): SM clock and its maximum (MHz), board power and
its limit (W), GPU temperature (C), and the bit mask of active clock-throttle reasons (0x4: software power cap,
0x20/0x40: thermal slowdown)."""
PERIOD_MS = 200


@dataclass(frozen=True)
class ClockSample:
    sm_mhz: float
    max_sm_mhz: float
    power_w: Optional[float]
    power_limit_w: Optional[float]
    temperature_c: Optional[float]
    throttle_reasons: int
    """Bit mask of ``clocks_throttle_reasons.active`` (0 where the driver reports none)."""


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def parse_lines(lines: Sequence[str]) -> list[ClockSample]:
    """Samples of ``nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits`` lines (or of FIELDS without the
    throttle reasons, which some drivers name differently: reasons 0); lines that do not parse (a header, an
    error message) are skipped."""
    out = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == len(FIELDS) - 1:
            parts.append("0")
        if len(parts) != len(FIELDS):
            continue
        sm, max_sm = _number(parts[0]), _number(parts[1])
        if sm is None or max_sm is None:
            continue
        try:
            reasons = int(parts[5], 16) if parts[5].lower().startswith("0x") else int(parts[5])
        except ValueError:
            reasons = 0
        out.append(ClockSample(sm, max_sm, _number(parts[2]), _number(parts[3]), _number(parts[4]), reasons))
    return out


POWER_CAP = 0x4
THERMAL = 0x20 | 0x40


def summary(samples: Sequence[ClockSample]) -> dict:
    """Median SM clock and its share of the maximum, median power and its share of the limit, the share of
    samples throttled by the power cap or by heat; empty samples give an empty dict."""
    if not samples:
        return {}
    sm = statistics.median(s.sm_mhz for s in samples)
    max_sm = max(s.max_sm_mhz for s in samples)
    powers = [s.power_w for s in samples if s.power_w is not None]
    limits = [s.power_limit_w for s in samples if s.power_limit_w is not None]
    out = {"samples": len(samples), "sm_clock_mhz_median": sm, "sm_clock_max_mhz": max_sm,
           "sm_clock_share_of_max": sm / max_sm if max_sm else None,
           "power_cap_throttled_share": sum(bool(s.throttle_reasons & POWER_CAP) for s in samples) / len(samples),
           "thermal_throttled_share": sum(bool(s.throttle_reasons & THERMAL) for s in samples) / len(samples)}
    if powers:
        out["power_w_median"] = statistics.median(powers)
        if limits:
            out["power_share_of_limit"] = out["power_w_median"] / max(limits)
    return out


class Sampler:
    """``with Sampler() as s: work()`` then ``s.samples`` (and ``s.why`` where nothing could be read)."""

    def __init__(self, period_ms: int = PERIOD_MS, gpu_index: int = 0):
        self.period_ms, self.gpu_index = period_ms, gpu_index
        self.samples: list[ClockSample] = []
        self.why = ""
        self._proc: Optional[subprocess.Popen] = None

    def command(self, fields: Sequence[str] = FIELDS) -> list[str]:
        return ["nvidia-smi", f"--id={self.gpu_index}", f"--query-gpu={','.join(fields)}",
                "--format=csv,noheader,nounits", f"--loop-ms={self.period_ms}"]

    def __enter__(self) -> "Sampler":
        if shutil.which("nvidia-smi") is None:
            self.why = "nvidia-smi is not on PATH: no clock samples"
            return self
        fields = FIELDS
        once = self.command(fields)[:-1]  # one sample: does this driver know every field?
        if subprocess.run(once, capture_output=True, text=True, timeout=30).returncode != 0:
            fields = FIELDS[:-1]  # newer drivers call the throttle reasons clocks_event_reasons
        self._proc = subprocess.Popen(self.command(fields), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            out, err = self._proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, err = self._proc.communicate()
        self.samples = parse_lines(out.splitlines())
        if not self.samples:
            self.why = f"nvidia-smi gave no samples: {(err.strip().splitlines() or ['(no message)'])[-1][:200]}"

    def record(self, *, with_samples: bool = True) -> dict:
        """The samples' summary, the samples themselves (``with_samples``), and why there are none where there are
        none."""
        return {"summary": summary(self.samples),
                **({"samples": [asdict(s) for s in self.samples]} if with_samples else {}),
                **({"why": self.why} if self.why else {})}
