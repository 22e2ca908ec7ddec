"""The clock sampler's parsing and summary (scripts/gpu/groundtruth/clocks.py) and the sustained-GEMM script's
summary (scripts/gpu/sustained_gemm.py), on CPU: the GPU runs read what these parse."""
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "gpu"))

from groundtruth.clocks import ClockSample, Sampler, parse_lines, summary  # noqa: E402
from sustained_gemm import summarize  # noqa: E402

# nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,
# clocks_throttle_reasons.active --format=csv,noheader,nounits, as an H100 SXM prints it under load
LINES = ["1980, 1980, 310.52, 700.00, 41, 0x0000000000000000",
         "1755, 1980, 699.10, 700.00, 63, 0x0000000000000004",
         "1740, 1980, 700.30, 700.00, 64, 0x0000000000000004",
         "garbage from a failing driver",
         "[N/A], 1980, 700.00, 700.00, 64, 0x4",
         "1725, 1980, [N/A], 700.00, 66, 0x0000000000000024",
         "1710, 1980, 698.00, 700.00, 67"]  # a driver that does not know the throttle-reasons field


def test_parse_keeps_the_samples_and_skips_what_does_not_parse():
    samples = parse_lines(LINES)
    assert [s.sm_mhz for s in samples] == [1980, 1755, 1740, 1725, 1710]
    assert samples[1] == ClockSample(1755, 1980, 699.10, 700.0, 63, 0x4)
    assert samples[3].power_w is None and samples[3].throttle_reasons == 0x24
    assert samples[4] == ClockSample(1710, 1980, 698.0, 700.0, 67, 0)


def test_summary_medians_and_throttle_shares():
    s = summary(parse_lines(LINES[:-1]))
    assert s["samples"] == 4 and s["sm_clock_mhz_median"] == pytest.approx((1755 + 1740) / 2)
    assert s["sm_clock_share_of_max"] == pytest.approx(1747.5 / 1980)
    assert s["power_w_median"] == pytest.approx(699.10) and s["power_share_of_limit"] == pytest.approx(699.1 / 700)
    assert s["power_cap_throttled_share"] == 0.75 and s["thermal_throttled_share"] == 0.25
    assert summary([]) == {}


def test_sampler_command_and_a_machine_without_nvidia_smi(monkeypatch):
    import groundtruth.clocks as clocks

    s = Sampler(period_ms=100, gpu_index=3)
    assert s.command()[:2] == ["nvidia-smi", "--id=3"] and s.command()[-1] == "--loop-ms=100"
    assert "clocks.sm,clocks.max.sm,power.draw" in s.command()[2]
    monkeypatch.setattr(clocks.shutil, "which", lambda _: None)
    with Sampler() as s:
        pass
    assert s.samples == [] and s.record() == {"summary": {}, "samples": [], "why": s.why}
    assert s.record(with_samples=False) == {"summary": {}, "why": s.why}
    assert "nvidia-smi is not on PATH" in s.why


def test_sustained_summary_burst_against_the_last_quarter():
    windows = [(0.0, 760e12), (0.25, 740e12), (0.5, 700e12), (0.75, 690e12), (1.0, 688e12), (1.25, 692e12),
               (1.5, 690e12), (1.75, 686e12)]
    s = summarize(windows, peak_flops=989.4e12)
    assert s["burst_tflops"] == pytest.approx(760) and s["sustained_tflops"] == pytest.approx(688)  # median of 2
    assert s["sustained_over_burst"] == pytest.approx(688 / 760)
    assert s["sustained_share_of_peak"] == pytest.approx(688e12 / 989.4e12)
    assert summarize([], 1.0) == {}
