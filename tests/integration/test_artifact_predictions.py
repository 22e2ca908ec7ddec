"""Every table and figure of the ATC '24 artifact against the cost model (h3t_ext/costmodel/artifact.py; pure
arithmetic, integration tier with the other calibration checks, ~20 s): every row is predicted, the
out-of-memory entries are predicted out of memory, and the errors stay where they are now (pinned: a change of
the model or of fitted_efficiencies.json that moves them updates the pins and the figures of docs/DESIGN.md
"Reference numbers")."""
import pytest

from h3t_ext.costmodel.artifact import DEMO7B, FIG7, FIG9, TABLE8, artifact_report


@pytest.fixture(scope="module")
def report():
    return artifact_report()


def test_published_out_of_memory_entries_are_predicted_out_of_memory(report):
    oom_rows = [p for p in report.rows if not p.row.ran]
    oom_points = [p for p in report.points if not p.point.ran]
    assert [p.row.table for p in oom_rows] == [TABLE8]
    assert sorted(p.point.plan.offload_alpha for p in oom_points) == [0.0, 0.1, 0.2]
    assert not any(p.fits for p in oom_rows + oom_points)
    assert all(p.fits for p in report.rows if p.row.ran) and all(p.fits for p in report.points if p.point.ran)
    assert report.wrong_verdicts == []


def _summary(sums, group):
    return next(s for s in sums if s.group == group)


TOKENS_MAE = {FIG9: 0.0121, f"{FIG9} / llama-65b": 0.0041, f"{FIG9} / llama2-70b": 0.0234,
              f"{FIG9} / llama-175b": 0.0062, f"{FIG9} / held out": 0.0168, TABLE8: 0.0382, DEMO7B: 0.0233}
"""Mean absolute tokens/s error measured at the time of writing (scripts/reproduce_tables.py). Before the
schedule builder posted each receive one compute ahead, as Megatron's overlapped interleaved schedule does, the
timeline exposed a hop per transfer in the steady state and these were 4-8% (Figure 9: 5.36%)."""


CLOSED_FORM_MAE = {FIG9: 0.0119, f"{FIG9} / llama-65b": 0.0033, f"{FIG9} / llama2-70b": 0.0234,
                   f"{FIG9} / llama-175b": 0.0062, f"{FIG9} / held out": 0.0168, TABLE8: 0.0382, DEMO7B: 0.0233}
"""The same with the closed form (what the efficiencies were fitted on): the timeline agrees with it within
0.1 points per table (the offload is hidden on these plans and no steady-state hop is exposed)."""


@pytest.mark.parametrize("group", list(TOKENS_MAE))
def test_tokens_per_second_error_stays_where_it_is(report, group):
    s = _summary(report.tokens_errors, group)
    assert s.mean_abs == pytest.approx(TOKENS_MAE[group], abs=0.002), (group, s)


@pytest.mark.parametrize("group", list(CLOSED_FORM_MAE))
def test_closed_form_error_stays_where_it_is(report, group):
    s = _summary(report.closed_form_tokens_errors, group)
    assert s.mean_abs == pytest.approx(CLOSED_FORM_MAE[group], abs=0.001), (group, s)


def test_closed_form_errors_of_the_fitted_rows_are_the_fits_own(report):
    """The calibration rows' closed-form errors are what the fit saw (fit.relative_errors on published_runs)."""
    from h3t_ext.costmodel.published import published_runs
    from h3t_ext.costmodel.validation import errors_with
    fitted = errors_with(published_runs("atc24_65b"), {})
    rows = [p for p in report.table(FIG9) if not p.row.held_out]
    assert [p.closed_form_error for p in rows] == pytest.approx(fitted, abs=1e-9)


def test_every_row_is_predicted_with_its_error(report):
    assert [len(report.table(t)) for t in (FIG9, TABLE8, DEMO7B)] == [41, 4, 6] and len(report.points) == 22
    counts = {s.group: s.count for s in report.tokens_errors}
    assert counts[FIG9] == 41 and counts[TABLE8] == 3 and counts[DEMO7B] == 6  # Table 8's OOM row has no error
    for p in report.rows:
        if p.row.ran:
            assert p.error == pytest.approx(p.tokens_per_s_per_gpu / p.row.published_tokens_per_s_per_gpu - 1)
            assert p.published_mfu is not None and 0.2 < p.published_mfu < 0.7
    # the worst row, held out: Llama2-70B on 112 GPUs, t2 p4 l2, ckpt=ours, alpha 0.811, 4.0% fast
    assert max(abs(p.error) for p in report.table(FIG9)) == pytest.approx(0.0398, abs=0.002)


def test_alpha_and_memory_errors_stay_where_they_are(report):
    fig9 = _summary(report.alpha_errors, FIG9)
    assert fig9.count == 41 and fig9.mean_abs == pytest.approx(0.0039, abs=0.0005) and fig9.max_abs <= 0.018
    assert _summary(report.alpha_errors, f"{FIG9} / llama-65b").max_abs <= 0.0015  # the budget was chosen on these
    t8 = _summary(report.alpha_errors, TABLE8)
    assert t8.count == 2 and t8.max_abs <= 0.004  # "ours" 0.63 -> 0.627; the OOM row's alpha is no solver's
    mem = _summary(report.memory_errors, FIG7)
    assert mem.count == 19 and mem.mean_abs == pytest.approx(0.0054, abs=0.0005) and mem.max_abs <= 0.018
    assert _summary(report.memory_errors, f"{FIG7} / held out").count == 16
