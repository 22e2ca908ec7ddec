"""What a ground-truth report's GEMM rows say about the form of GEMM time, not only its scale.

Fits, per precision, t = c + 2 M N K / R + (output bytes) / W over the measured GEMM rows (weighted least squares
on relative error; M, N, K the GEMM each pass runs, ``kernels.linear_pass_gemm``; output bytes M N x 2 for a
bf16 output, x 8 for the weight gradient accumulated into fp32 main grads: read and written, x 4 for FP8's
plain fp32 weight-gradient output). What the terms mean:

* ``c``: a constant per call. In the report of 2026-11-28 (each repeat timed on an idle GPU) it is the host's
  dispatch of one isolated call, 16-23 us, which a training loop hides; reports taken with the head start of
  ``cases.HEAD_START_S`` should show it near the kernel launch cost alone.
* ``R``: the GEMM rate, continuous in M N (no tile or wave quantization term: on that H200 a GEMM of 0.6 waves of
  128 x 256 tiles ran at the rate of a 4-wave one, cuBLAS choosing smaller tiles or splitting K).
* ``W``: the output's traffic left exposed by the epilogue; it is what makes the fp32-accumulating weight gradient
  slower than the forward on the same shapes.

The residual (root mean square of log(fit / measured)) and its mean by pass say whether the form holds; the
same statistics of the cost model's own prediction (its tile/wave form, its efficiencies) stand beside it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from h3t_ext.costmodel.kernels import linear_pass_gemm
from h3t_ext.dtypes import BF16, FP32


@dataclass(frozen=True)
class GemmForm:
    precision: str
    rows: int
    call_s: float
    """c: seconds per call beside the work."""
    rate_flops: float
    """R: FLOP/s."""
    output_bytes_per_s: float
    """W: bytes/s of the exposed output traffic (inf where the fit finds none)."""
    rms_log_error: float
    mean_log_error_by_pass: dict
    model_rms_log_error: float
    """The same residual for the cost model's own predictions of these rows."""
    model_mean_log_error_by_pass: dict


def output_bytes(case: dict) -> int:
    """Bytes of the GEMM's output traffic: bf16 written, or what ``out_bytes`` says; the bf16 weight gradient
    (``out_bytes`` None) reads and writes the fp32 main grad."""
    m, n, _ = linear_pass_gemm(case["pass_"], case["m"], case["n"], case["k"])
    if case.get("out_bytes") is not None:
        per = case["out_bytes"]
    else:
        per = 2 * FP32 if case["pass_"] == "wgrad" else BF16
    return m * n * per


def _by_pass(rows: list[dict], logs: np.ndarray) -> dict:
    out = {}
    for p in ("fwd", "dgrad", "wgrad"):
        sel = [x for r, x in zip(rows, logs) if r["case"]["pass_"] == p]
        if sel:
            out[p] = float(np.mean(sel))
    return out


def fit_form(doc: dict, precision: str) -> GemmForm | None:
    """The fit over the report's measured GEMM rows of ``precision`` run alone (None: fewer than 4 rows)."""
    rows = [r for r in doc["rows"] if r.get("kind") == "gemm" and r.get("status") == "measured"
            and r["case"]["precision"] == precision and not r["case"].get("during_copy")]
    if len(rows) < 4:
        return None
    x = np.array([[1.0, 2.0 * math.prod(linear_pass_gemm(r["case"]["pass_"], r["case"]["m"], r["case"]["n"],
                                                              r["case"]["k"])), float(output_bytes(r["case"]))]
                  for r in rows])
    y = np.array([r["measured_s"] for r in rows])
    w = 1.0 / y
    coef, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
    fit = np.log((x @ coef) / y)
    model = np.log(np.array([r["predicted_s"] for r in rows]) / y)
    return GemmForm(precision, len(rows), float(coef[0]), float(1.0 / coef[1]),
                    float(1.0 / coef[2]) if coef[2] > 0 else math.inf,
                    float(np.sqrt(np.mean(fit ** 2))), _by_pass(rows, fit),
                    float(np.sqrt(np.mean(model ** 2))), _by_pass(rows, model))


def format_forms(doc: dict, peak_bf16: float, peak_fp8: float) -> str:
    lines = ["GEMM time as c + 2MNK/R + output bytes/W (rows run alone; residual = rms of log(fit/measured)):"]
    for prec, peak in (("bf16", peak_bf16), ("fp8", peak_fp8)):
        f = fit_form(doc, prec)
        if f is None:
            continue
        by = ", ".join(f"{p} {v:+.3f}" for p, v in f.mean_log_error_by_pass.items())
        model_by = ", ".join(f"{p} {v:+.3f}" for p, v in f.model_mean_log_error_by_pass.items())
        w = "none exposed" if math.isinf(f.output_bytes_per_s) else f"{f.output_bytes_per_s / 1e9:,.0f} GB/s"
        lines.append(f"  {prec}: {f.rows} rows; c {f.call_s * 1e6:.1f} us, R {f.rate_flops / 1e12:,.0f} TFLOP/s "
                     f"({f.rate_flops / peak:.3f} of peak), W {w}; residual {f.rms_log_error:.3f} (by pass {by}); "
                     f"the cost model's own: {f.model_rms_log_error:.3f} ({model_by})")
    return "\n".join(lines)
