"""scripts/gpu/groundtruth/gemm_form.py: the fit of c + 2MNK/R + output bytes/W recovers the terms of rows made
from them, per pass's GEMM and output traffic, and reports the cost model's own residual beside it."""
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "gpu"))

from groundtruth.gemm_form import fit_form, format_forms, output_bytes  # noqa: E402

C, R, W = 18e-6, 720e12, 2.6e12


def _row(pass_, m, n, k, precision="bf16", out_bytes=None, predicted_over=1.2, during_copy=False):
    case = {"pass_": pass_, "m": m, "n": n, "k": k, "precision": precision, "out_bytes": out_bytes,
            "during_copy": during_copy}
    gm, gn, gk = {"fwd": (m, n, k), "dgrad": (m, k, n), "wgrad": (k, n, m)}[pass_]
    t = C + 2 * gm * gn * gk / R + output_bytes(case) / W
    return {"kind": "gemm", "status": "measured", "case": case, "measured_s": t, "predicted_s": t * predicted_over}


def _doc():
    rows = [_row(p, m, n, k) for p in ("fwd", "dgrad", "wgrad") for m in (2048, 8192) for n, k in
            ((1536, 4096), (4096, 512), (12288, 12288), (8192, 28672))]
    rows.append(_row("fwd", 4096, 4096, 4096, during_copy=True))  # run beside copies: not in the fit
    rows[-1]["measured_s"] *= 3
    return {"rows": rows}


def test_output_bytes_by_pass():
    assert output_bytes({"pass_": "fwd", "m": 4, "n": 8, "k": 16, "out_bytes": None}) == 4 * 8 * 2
    assert output_bytes({"pass_": "dgrad", "m": 4, "n": 8, "k": 16, "out_bytes": None}) == 4 * 16 * 2
    assert output_bytes({"pass_": "wgrad", "m": 4, "n": 8, "k": 16, "out_bytes": None}) == 16 * 8 * 8  # fp32 r+w
    assert output_bytes({"pass_": "wgrad", "m": 4, "n": 8, "k": 16, "out_bytes": 4}) == 16 * 8 * 4


def test_fit_recovers_the_terms_and_the_models_residual():
    f = fit_form(_doc(), "bf16")
    assert f.rows == 24
    assert f.call_s == pytest.approx(C, rel=1e-6) and f.rate_flops == pytest.approx(R, rel=1e-6)
    assert f.output_bytes_per_s == pytest.approx(W, rel=1e-6) and f.rms_log_error < 1e-9
    assert f.model_rms_log_error == pytest.approx(math.log(1.2)) and f.model_mean_log_error_by_pass["wgrad"] == \
        pytest.approx(math.log(1.2))
    assert fit_form(_doc(), "fp8") is None  # no FP8 rows
    text = format_forms(_doc(), 989.4e12, 1979e12)
    assert "bf16: 24 rows; c 18.0 us, R 720 TFLOP/s (0.728 of peak), W 2,600 GB/s; residual 0.000" in text
