"""Partial pooling of a calibration (``costmodel.pooling``): the moment estimates of the random-effects model,
the weight of n runs, the log-space move of the efficiencies, and the stored prior."""
import json
import math
import random

import pytest

from h3t_ext.costmodel import get_system
from h3t_ext.costmodel.pooling import PRIOR_KEY, CalibrationPrior, calibration_prior, pooled, prior_from_errors
from h3t_ext.costmodel.uncertainty import UNCERTAINTY_FILE


def test_moment_estimates_by_hand():
    # source means 0.02 and -0.02 (deviations +-0.01 about them), so sigma^2 = 4 * 1e-4 / 2 = 2e-4 and
    # tau^2 = mean(m^2) - sigma^2 / 2 = 4e-4 - 1e-4 = 3e-4
    prior = prior_from_errors({"a": [0.03, 0.01], "b": [-0.01, -0.03]})
    assert prior.within_source_sd == pytest.approx(math.sqrt(2e-4), abs=1e-6)
    assert prior.between_source_sd == pytest.approx(math.sqrt(3e-4), abs=1e-6)
    assert (prior.sources, prior.rows) == (2, 4)
    # (the stored sds are rounded to 1e-6)
    assert prior.weight(1) == pytest.approx(3e-4 / (3e-4 + 2e-4), rel=1e-4)
    assert prior.weight(4) == pytest.approx(3e-4 / (3e-4 + 0.5e-4), rel=1e-4)


def test_moment_estimates_recover_a_simulated_spread():
    rng = random.Random(7)
    tau, sigma = 0.02, 0.015
    errors = {}
    for s in range(400):
        b = rng.gauss(0.0, tau)
        errors[f"s{s}"] = [b + rng.gauss(0.0, sigma) for _ in range(rng.randint(3, 12))]
    prior = prior_from_errors(errors)
    assert prior.between_source_sd == pytest.approx(tau, rel=0.1)
    assert prior.within_source_sd == pytest.approx(sigma, rel=0.05)


def test_no_spread_across_sources_gives_no_weight():
    prior = prior_from_errors({"a": [0.02, -0.02], "b": [-0.02, 0.02]})
    assert prior.between_source_sd == 0.0 and prior.weight(1) == 0.0


@pytest.mark.parametrize("errors", [{"a": [0.01, 0.02]}, {"a": [0.01], "b": [0.02]}, {"a": [], "b": [0.1, 0.2]}])
def test_too_few_errors_refused(errors):
    with pytest.raises(ValueError, match="at least two sources"):
        prior_from_errors(errors)


def test_weight_grows_with_runs_to_one():
    prior = CalibrationPrior(0.018, 0.02, 4, 41)
    weights = [prior.weight(n) for n in (1, 2, 5, 20, 10000)]
    assert weights == sorted(weights) and 0.4 < weights[0] < 0.5 and weights[-1] > 0.999
    with pytest.raises(ValueError, match="at least one run"):
        prior.weight(0)


def test_pooled_moves_in_log_space():
    system = get_system("h800")
    before = system.efficiency("gemm_peak_fraction")
    fitted = {"gemm_peak_fraction": before * 1.21}
    assert pooled(system, fitted, 0.0) == pytest.approx({"gemm_peak_fraction": before})
    assert pooled(system, fitted, 1.0) == pytest.approx(fitted)
    assert pooled(system, fitted, 0.5) == pytest.approx({"gemm_peak_fraction": before * 1.1})
    for w in (-0.1, 1.01, math.nan):
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            pooled(system, fitted, w)


def test_stored_prior_reads_back_and_weighs_one_run_about_a_third():
    with open(UNCERTAINTY_FILE, encoding="utf-8") as f:
        stored = json.load(f)[PRIOR_KEY]
    prior = calibration_prior()
    assert prior.to_dict() == stored
    assert prior.sources == 4 and prior.rows == 41 and "prior_from_errors" in prior.computed_from
    # the sources' offsets spread less than their rows (tau 1.49% < sigma 2.12%): one run weighs 0.33, ten 0.83
    assert 0.28 < prior.weight(1) < 0.4 and 0.75 < prior.weight(10) < 0.9
