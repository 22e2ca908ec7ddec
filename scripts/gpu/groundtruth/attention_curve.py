"""cuDNN's fused attention as a ground-truth report measured it: the two numbers the cost model states for it.

Per (pass, head dim), the measured seconds per FLOP of a causal call over a sequence s follow

    1 / rate = (1 / R) * (1 + K0 * s_q / pairs),       pairs = s^2 / 2 (causal), so s_q / pairs = 2 / s

R is the kernel's rate at infinite sequence and K0 its fixed work per query row, in keys' work (loading the query
tile, the last rescale, writing the output and its logsumexp). One K0 is fitted over every group (both passes, head
dims 64 and 128, with and without GQA; each group its own R) by least relative squares: a grid over K0, each R in
closed form. The cost model's ``fused_attention_gemm_ratio`` is R of the forward at head dim 128 over the bf16 GEMM
plateau of the same report (the median rate of its forward GEMMs of at least ``GEMM_PLATEAU_MIN_FLOP``), carried to
infinite head dim by the model's d / (d + ``attention_head_dim_overhead``); ``fused_attention_row_overhead_keys`` is
K0. ``scripts/gpu/ground_truth.py --attention-curve REPORT`` prints them beside ``fitted_efficiencies.json``'s.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Iterable, Mapping

from h3t_ext.costmodel.kernels import score_pairs

GEMM_PLATEAU_MIN_FLOP = 2.0 ** 38
"""Forward bf16 GEMMs at least this large make the plateau (below it the launch and the tile quantization show)."""
REFERENCE_HEAD_DIM = 128
"""The head dim whose forward rate the ratio is taken at (the published models': Llama, Qwen, GPT-3 175B)."""
_K0_GRID = tuple(range(0, 1025))


@dataclass(frozen=True)
class AttentionCurve:
    """The fit: K0, each group's R (FLOP/s) and its worst relative error, and the GEMM plateau."""

    row_overhead_keys: float
    rates: Mapping[tuple[str, int], float]
    """R of each (pass, head dim)."""
    worst_error: float
    """Largest |fitted / measured - 1| of a row's rate."""
    rows: int
    gemm_plateau: float

    def gemm_ratio(self, head_dim_overhead: float) -> float:
        """``fused_attention_gemm_ratio``: R(forward, head dim 128) / the GEMM plateau at infinite head dim."""
        rate = self.rates[("fwd", REFERENCE_HEAD_DIM)]
        return rate / self.gemm_plateau * (REFERENCE_HEAD_DIM + head_dim_overhead) / REFERENCE_HEAD_DIM


def _points(rows: Iterable[Mapping], backend: str) -> dict[tuple[str, int], list[tuple[float, float]]]:
    """(s_q / pairs, seconds per FLOP) of each measured causal attention row of ``backend``, by (pass, head dim)."""
    out: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in rows:
        case = r.get("case", {})
        if r.get("kind") != "attention" or r.get("status") != "measured" or case.get("backend") != backend:
            continue
        s = int(case["seq"])
        out.setdefault((case["pass_"], int(case["head_dim"])), []).append(
            (s / score_pairs(s, s, causal=True), r["measured_s"] / r["work"]))
    return out


def _fit_rate(points: list[tuple[float, float]], k0: float) -> tuple[float, float]:
    """The R minimising the relative squared error at ``k0`` (closed form), and that error."""
    u = [(1.0 + k0 * x) / y for x, y in points]
    inverse_rate = sum(u) / sum(v * v for v in u)  # 1 / R
    return 1.0 / inverse_rate, sum((inverse_rate * v - 1.0) ** 2 for v in u)


def attention_curve(rows: Iterable[Mapping], backend: str = "cudnn") -> AttentionCurve:
    """Fit the report's measured ``backend`` attention rows (ValueError when it has none or no GEMM plateau)."""
    rows = list(rows)
    groups = _points(rows, backend)
    if not groups or ("fwd", REFERENCE_HEAD_DIM) not in groups:
        raise ValueError(f"the report has no measured {backend} attention forward at head dim {REFERENCE_HEAD_DIM}")
    plateau = [r["work"] / r["measured_s"] for r in rows
               if r.get("kind") == "gemm" and r.get("status") == "measured" and r.get("group") == "gemm bf16"
               and r.get("case", {}).get("pass_") == "fwd" and r["work"] >= GEMM_PLATEAU_MIN_FLOP]
    if not plateau:
        raise ValueError(f"the report has no measured bf16 forward GEMM of at least {GEMM_PLATEAU_MIN_FLOP:g} FLOP")
    k0 = min(_K0_GRID, key=lambda k: sum(_fit_rate(p, k)[1] for p in groups.values()))
    rates = {g: _fit_rate(p, k0)[0] for g, p in groups.items()}
    worst = max(abs(y * rates[g] / (1.0 + k0 * x) - 1.0) for g, p in groups.items() for x, y in p)
    return AttentionCurve(float(k0), rates, worst, sum(len(p) for p in groups.values()), statistics.median(plateau))


def format_curve(curve: AttentionCurve, head_dim_overhead: float, stated: Mapping[str, float],
                 backend: str = "cudnn") -> str:
    """The fit beside the values ``fitted_efficiencies.json`` states (for the fused kernel: ``backend`` cudnn)."""
    lines = [f"SDPA {backend} attention, {curve.rows} measured rows: fixed work per query row "
             f"K0 = {curve.row_overhead_keys:.0f} keys (fitted over every group), worst row {100 * curve.worst_error:.1f}%"]
    for (pass_, d), rate in sorted(curve.rates.items()):
        lines.append(f"  {pass_:3s} head dim {d:3d}: R = {rate / 1e12:6.0f} TFLOP/s at infinite sequence")
    lines.append(f"bf16 forward GEMM plateau (>= 2^{math.log2(GEMM_PLATEAU_MIN_FLOP):.0f} FLOP, median): "
                 f"{curve.gemm_plateau / 1e12:.0f} TFLOP/s")
    lines.append(f"fused_attention_gemm_ratio        {curve.gemm_ratio(head_dim_overhead):.3f}   "
                 f"(stated: {stated.get('fused_attention_gemm_ratio', 'none')})")
    lines.append(f"fused_attention_row_overhead_keys {curve.row_overhead_keys:.0f}     "
                 f"(stated: {stated.get('fused_attention_row_overhead_keys', 'none')})")
    return "\n".join(lines)
