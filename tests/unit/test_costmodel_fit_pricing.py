"""The fit's pricing (costmodel/estimate.closed_form_terms, used by fit.relative_errors) is estimate()'s closed form
without the memory terms: the same time terms on every published run, and the same refusals."""
from dataclasses import replace

import pytest

from h3t_ext.costmodel import estimate, get_model, get_system
from h3t_ext.costmodel.errors import InvalidPlanError
from h3t_ext.costmodel.estimate import closed_form_terms
from h3t_ext.costmodel.fit import relative_errors, with_efficiencies
from h3t_ext.costmodel.published import published_runs


def test_the_fit_prices_every_published_run_as_estimate_does():
    runs = published_runs()
    assert len(runs) == 45
    for run in runs:
        assert closed_form_terms(run.model, run.plan, run.system) == \
            estimate(run.model, run.plan, run.system, timeline=False).time_terms, run
    # the errors the fit minimises, on a system whose efficiencies moved (so no cached value could stand in)
    h800 = with_efficiencies(get_system("h800"), {"gemm_peak_fraction": 0.6, "network_fraction": 0.5})
    atc = [r for r in runs if r.source == "atc24_65b"]
    expected = [estimate(r.model, r.plan, h800, timeline=False).tokens_per_second_per_gpu / r.tokens_per_s_per_gpu - 1
                for r in atc]
    assert relative_errors(atc, h800) == pytest.approx(expected, rel=1e-12)
    assert relative_errors(atc, h800) != pytest.approx(relative_errors(atc, get_system("h800")), rel=1e-3)


def test_the_fit_refuses_what_estimate_refuses():
    run = published_runs()[0]
    bad_plan = replace(run.plan, tensor_model_parallel_size=3)
    slow = with_efficiencies(run.system, {"gemm_peak_fraction": 0.0})
    for model, plan, system in ((run.model, bad_plan, run.system), (get_model("llama-65b"), run.plan, slow)):
        with pytest.raises(InvalidPlanError) as by_estimate:
            estimate(model, plan, system, timeline=False)
        with pytest.raises(InvalidPlanError) as by_fit:
            closed_form_terms(model, plan, system)
        assert str(by_fit.value) == str(by_estimate.value)
