"""Cost model v2 against published runs of three sources (ATC '24 65B on H800, Megatron-LM's H100 table,
Korthikanti et al. 2022 on A100): leave-one-source-out accuracy, calibration, feasibility, the structure of
the fitted numbers, and the switches (pure arithmetic)."""
import json
import math
from dataclasses import replace

import pytest

from h3t_ext.costmodel import Plan, estimate, get_model, get_system
from h3t_ext.costmodel.fit import FAMILY_KEYS, FITTABLE, SHARED_KEYS, MeasuredRun, fit_system
from h3t_ext.costmodel.published import SOURCES, TRAINING_ONLY, published_runs
from h3t_ext.costmodel.pooling import calibration_prior
from h3t_ext.costmodel.uncertainty import throughput_uncertainty
from h3t_ext.costmodel.efficiency_sets import OPTIONAL_EFFICIENCIES, efficiency_set, plausible_ranges
from h3t_ext.costmodel.specs import DATA_DIR
from h3t_ext.costmodel.data_parallel import bucketed_exposed as _bucketed_exposed
from h3t_ext.costmodel.validation import leave_one_source_out
from h3t_ext.planner.cli import main
from h3t_ext.planner.search import search
from h3t_ext.planner.space import SearchConstraints
from h3t_ext.schedule import ActionKind, build_schedule


@pytest.fixture(scope="module")
def loso():
    return {h.source: h for h in leave_one_source_out()}


def test_sources_and_row_counts():
    runs = published_runs()
    counts = {s: sum(r.source == s for r in runs) for s in SOURCES + TRAINING_ONLY}
    # 15 ATC rows, 9 Megatron rows, 5 Korthikanti configurations x (selective + SP, full recompute), the 7 NeMo
    # FP8 rows with a Llama 2/3 or GPT-3 175B shape
    assert counts == {"atc24_65b": 15, "megatron_h100": 9, "korthikanti": 10, "nemo_fp8_h100": 7, "atc24_demo7b": 4}


@pytest.mark.parametrize("source,threshold",
                         [("atc24_65b", 0.016), ("megatron_h100", 0.027), ("korthikanti", 0.030),
                          ("nemo_fp8_h100", 0.029)])
def test_held_out_source_within_six_percent_without_calibration(loso, source, threshold):
    h = loso[source]
    assert h.mae_uncalibrated <= threshold, (source, h.errors_uncalibrated)


@pytest.mark.parametrize("source,median", [("atc24_65b", 0.015), ("megatron_h100", 0.029), ("korthikanti", 0.026),
                                          ("nemo_fp8_h100", 0.028)])
def test_after_calibrating_on_one_row_current_level(loso, source, median):
    """Median over the choice of the calibration row of the MAE on the source's other rows (pooled as
    ``h3t-plan calibrate`` pools one row): a regression bound at what the model achieves today."""
    after = sorted(loso[source].mae_after_one_row)
    assert after[len(after) // 2] <= median, after


@pytest.mark.parametrize("source", SOURCES)
def test_within_three_percent_after_one_row(loso, source):
    assert loso[source].mae_after_one_row_mean <= 0.03, loso[source].mae_after_one_row


def test_the_stored_interval_is_what_these_held_out_errors_give(loso):
    """data/uncertainty.json's dense interval and per-source errors, against the held-out fits this tier runs anyway
    (the whole file's check is in the slow tier: tests/integration/test_calibration.py); the file had drifted by 1e-6
    from a cost-model change that no default test noticed."""
    from h3t_ext.costmodel.uncertainty import UNCERTAINTY_FILE, half_width_from_errors
    stored = json.loads(UNCERTAINTY_FILE.read_text())
    errors = [e for s in SOURCES for e in loso[s].errors_uncalibrated]
    assert stored["per_source_mae_uncalibrated"] == {s: round(loso[s].mae_uncalibrated, 6) for s in SOURCES}
    assert stored["relative_half_width"] == round(half_width_from_errors(errors), 6)
    assert stored["held_out_rows"] == len(errors) == 41


def test_prediction_interval_still_covers_after_one_row(loso):
    """An estimate's interval (the uncalibrated held-out errors' 90% quantile, data/uncertainty.json) is kept
    after a calibration: on every held-out source's pooled one-row calibrations (each row in turn, the other rows
    predicted: 414 predictions) it still covers at least 90%. A narrower interval scaled by the random-effects
    model's posterior variance (0.89x for one run) would cover less than 90% of them."""
    errors = [e for h in loso.values() for e in h.errors_after_one_row]
    assert len(errors) == sum(h.rows * (h.rows - 1) for h in loso.values()) == 414
    width = throughput_uncertainty().relative_half_width
    assert sum(abs(e) <= width for e in errors) >= 0.9 * len(errors)
    assert sum(abs(e) <= 0.89 * width for e in errors) < 0.9 * len(errors)


@pytest.mark.parametrize("source,weight", [("atc24_65b", (0.0, 0.05)), ("megatron_h100", (0.40, 0.51)),
                                          ("korthikanti", (0.28, 0.40)), ("nemo_fp8_h100", (0.26, 0.38))])
def test_one_row_weight_comes_from_the_other_sources(loso, source, weight):
    """Each held-out source's one-row weight is its own (a prior of the other three sources' errors, fitted
    without it). Pooling trades: with the fit taken whole, Megatron's H100 rows end further from their
    measurements than with no calibration (their errors fall in two groups about 5% apart; one row's fit carries
    its group's offset to the other group), while ATC '24's rows, which share one offset, keep less of the
    calibration's gain."""
    h = loso[source]
    assert weight[0] <= h.one_row_weight <= weight[1]
    if source == "atc24_65b":
        assert h.mae_after_one_row_full_weight_mean < h.mae_after_one_row_mean < h.mae_uncalibrated
    else:
        assert h.mae_after_one_row_mean < h.mae_after_one_row_full_weight_mean
    if source == "megatron_h100":
        assert h.mae_after_one_row_full_weight_mean > 0.03 > h.mae_uncalibrated


def test_assumed_megatron_interleaving_is_what_the_model_ranks_best():
    """run_settings.json assumes one layer per virtual stage on Megatron's pipelined rows (the source does not
    say; l = 2 on the 70B row, where each of l = 1's 42 chunks pays its own DDP bucket's NCCL latency): the
    assumption stands only while the cost model ranks it first, or within 0.5% of first, among every
    l that divides a stage's layers, with t, p, d and the batch as published. The closed form ranks them (it is
    what the fit and the calibration figures price); the timeline of the action lists ranks l = 3 first on the
    70B row (+3.6%: its transfers at l = 1 are more than the closed form's 2 (p v - 1) hops), an open question."""
    for run in published_runs("megatron_h100"):
        p = run.plan.pipeline_model_parallel_size
        if p == 1:
            continue
        assumed = run.plan.num_layers_per_virtual_pipeline_stage
        assert assumed == (2 if run.label.startswith("70B ") else 1)
        per_stage = run.model.num_layers // p
        speed = {l: estimate(run.model, replace(run.plan, num_layers_per_virtual_pipeline_stage=l if l < per_stage
                                                else None), run.system, timeline=False).tokens_per_second_per_gpu
                 for l in range(1, per_stage + 1) if per_stage % l == 0}
        assert speed[assumed] >= 0.995 * max(speed.values()), (run.label, speed)
        assert speed[assumed] > speed[per_stage], run.label  # interleaving beats plain 1F1B on every row


def _layout(plan):
    return (plan.tensor_model_parallel_size, plan.context_parallel_size, plan.pipeline_model_parallel_size,
            plan.num_layers_per_virtual_pipeline_stage, plan.ckpt, plan.micro_batch_size)


def test_published_atc24_layouts_rank_in_the_top_three():
    """The planner searches every layout of each ATC '24 65B row (same GPUs, batch, run switches, planning budget and
    Megatron-Kwai's legacy model) that Megatron-Kwai could run, even layer splits (it has no
    --pipeline-model-parallel-layout); the
    published layout is in its top 3 and within 1% of its best on at least 12 of 15 rows (the
    search re-ranks its best 3 on the timeline, which since the early receives of schedule/posting.py no
    longer prices the interleaved layouts up to ~6% slower than the closed form)."""
    good = 0
    for run in published_runs("atc24_65b"):
        p = run.plan
        res = search(run.model, run.system, num_gpus=p.num_gpus, seq_length=p.seq_length,
                     global_batch_size=p.global_batch_size,
                     constraints=SearchConstraints(tp_comm_overlap=True, pipeline_layouts=False,
                                                   use_legacy_models=True),
                     memory_budget_bytes=run.memory_budget_bytes)
        assert not any(r.plan.pipeline_model_parallel_layout for r in res.plans)
        ranks = [i for i, r in enumerate(res.plans) if _layout(r.plan) == _layout(p)]
        assert ranks, run.label  # the published layout is always feasible and ranked
        rank = ranks[0]
        good += rank < 3 and res.plans[rank].tokens_per_second >= 0.99 * res.plans[0].tokens_per_second
    assert good >= 12


PREDICTED_OVER_BUDGET: dict[str, float] = {}
"""Rows that ran but that the memory model puts over their GPU's budget: none (NeMo's FP8 GPT3-175B / 512 and
Llama-3 8B rows fit since they reduce gradients in bf16, as NeMo's performance recipes set)."""


def test_every_published_configuration_fits_its_gpu():
    for r in published_runs():
        est = estimate(r.model, r.plan, r.system)  # the GPU's own budget, not the ATC planning budget
        if r.label in PREDICTED_OVER_BUDGET:
            assert not est.fits and est.peak_memory_bytes == pytest.approx(PREDICTED_OVER_BUDGET[r.label], rel=0.01)
            continue
        assert est.fits, (r.label, est.peak_memory_bytes, est.memory_budget_bytes)


def test_fitted_numbers_are_named_in_range_and_counted():
    ranges = plausible_ranges()
    data = json.loads((DATA_DIR / "fitted_efficiencies.json").read_text())
    assert set(ranges) == set(data["meanings"])  # every efficiency has a stated physical meaning
    for fam in ("hopper", "ampere", "blackwell", "grace-blackwell",
                "grace-blackwell-ultra"):  # Blackwell's: Hopper's carried over, and its
        eff = {k: v for k, v in efficiency_set(fam).items() if not k.startswith("_")}  # own kernel measurements
        # the fused attention's two numbers are given for Hopper and Blackwell (Ampere prices it as FlashAttention),
        # MXFP8's GEMM rate for Blackwell only (MXFP8 needs it)
        missing = {"ampere": set(OPTIONAL_EFFICIENCIES), "hopper": {"mxfp8_gemm_rate_fraction"}}.get(fam, set())
        assert set(eff) == set(ranges) - missing, fam
        for k, v in eff.items():
            lo, hi = ranges[k]
            assert lo <= v <= hi, (fam, k, v)
    # fitted: 4 per GPU family (2 families) + 3 shared = 11 numbers, on 45 published runs; Ampere has no FP8
    assert len(FAMILY_KEYS) * 2 + len(SHARED_KEYS) == 11
    # a user's calibration may also fit the fused attention's measured ratio (an older stack's kernel); the published
    # runs do not: its value is the H200 measurement
    assert set(FITTABLE) - set(FAMILY_KEYS + SHARED_KEYS) == {"fused_attention_gemm_ratio"}
    assert set(FAMILY_KEYS + SHARED_KEYS) < set(FITTABLE)
    assert len(published_runs()) == 45
    assert "not identified: gemm_fp8_peak_fraction" in data["efficiencies"]["ampere"]["_fitted_on"]
    assert "gemm_fp8_peak_fraction" in data["efficiencies"]["hopper"]
    # the rest are stated assumptions, not fitted
    fitted = set(FAMILY_KEYS + SHARED_KEYS)
    assert set(ranges) - fitted == {"attention_head_dim_overhead", "nvlink_fraction", "pcie_fraction",
                                    "attention_dropout_fwd_slowdown", "attention_dropout_bwd_slowdown",
                                    "host_memory_fraction", "attention_backward_rate_fraction", *OPTIONAL_EFFICIENCIES}
    assert set(ranges) - fitted - {"attention_head_dim_overhead", "nvlink_fraction", "pcie_fraction"} <= set(
        data["stated_sources"])  # the dropout slowdowns carry their public source


def test_memory_budget_is_first_principles():
    """The plan's reserve: context + the NCCL buffers of the communicators it uses + the allocator gap; a
    single node without data parallelism holds fewer communicators than a multi-node t, d, p layout."""
    from h3t_ext.costmodel.reserve import memory_reserve
    for name in ("h100-sxm", "h800", "a100-80g"):
        s = get_system(name)
        small = memory_reserve(M405, Plan(num_gpus=8, seq_length=4096, global_batch_size=8,
                                          tensor_model_parallel_size=8), s)
        big = memory_reserve(M405, Plan(num_gpus=1024, seq_length=4096, global_batch_size=1024,
                                        tensor_model_parallel_size=8, pipeline_model_parallel_size=16), s)
        assert [c.group for c in small.communicators] == ["WORLD", "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP",
                                                          "TENSOR_MODEL_PARALLEL_GROUP"]
        assert len(big.communicators) == 5  # + data parallel and pipeline p2p (untied: no embedding group)
        assert small.budget_bytes > big.budget_bytes
        for r in (small, big):
            reserve = s.hbm_bytes - r.budget_bytes
            # CUDA context + NCCL buffers + allocator fragmentation: a few GB, not a fitted 16.8 GB
            assert 1e9 + r.nccl_bytes < reserve < 1e9 + r.nccl_bytes + 0.06 * r.budget_bytes, (name, reserve)
            assert 3e9 < reserve < 10e9, (name, reserve)


@pytest.mark.parametrize("source,label,efficiency", [("megatron_h100", "177B", "gemm_peak_fraction"),
                                                     ("nemo_fp8_h100", "LLAMA2-70B", "gemm_fp8_peak_fraction")])
def test_one_row_identifies_one_efficiency(source, label, efficiency):
    """One BF16 row identifies the BF16 GEMM rate, one FP8 row the FP8 GEMM rate, and nothing else."""
    run = next(r for r in published_runs(source) if r.label.startswith(label))
    fit = fit_system(run.system, [MeasuredRun(run.model, run.plan, run.tokens_per_s_per_gpu)])
    assert list(fit.fitted) == [efficiency]
    assert set(fit.unidentified) == set(FITTABLE) - {efficiency}
    assert fit.mae_after < 0.002


M405 = get_model("llama3-405b")
H100 = get_system("h100-sxm")


def test_uneven_first_and_last_stages():
    """126 layers over 16 stages: Megatron's --decoder-first/last-pipeline-num-layers."""
    base = dict(num_gpus=16 * 8 * 8, seq_length=8192, global_batch_size=512, tensor_model_parallel_size=8,
                pipeline_model_parallel_size=16, ckpt="full")
    with pytest.raises(ValueError):
        estimate(M405, Plan(**base), H100)
    plan = Plan(**base, decoder_first_pipeline_num_layers=7, decoder_last_pipeline_num_layers=7)
    assert [plan.stage_layers(126, k) for k in (0, 1, 14, 15)] == [7, 8, 8, 7]
    est = estimate(M405, plan, H100)
    assert est.stages[0].params < est.stages[1].params  # 7 layers (+ embedding) vs 8


def test_switches():
    m = get_model("llama2-70b")
    base = Plan(num_gpus=512, seq_length=4096, global_batch_size=512, tensor_model_parallel_size=8,
                pipeline_model_parallel_size=4, num_layers_per_virtual_pipeline_stage=5, ckpt="no")
    e = estimate(m, base, H100)
    no_dist = estimate(m, Plan(**{**base.__dict__, "use_distributed_optimizer": False}), H100)
    assert no_dist.stages[0].terms["optimizer_states"] == pytest.approx(16 * e.stages[0].terms["optimizer_states"],
                                                                        rel=0.01)
    no_sp = estimate(m, Plan(**{**base.__dict__, "sequence_parallel": False}), H100)
    assert no_sp.stages[0].terms["activations"] > e.stages[0].terms["activations"]
    overlap = estimate(m, Plan(**{**base.__dict__, "tp_comm_overlap": True}), H100)
    assert overlap.closed_form.tp_comm < 0.6 * e.closed_form.tp_comm
    dp = estimate(m, Plan(**{**base.__dict__, "overlap_grad_reduce": True, "overlap_param_gather": True}), H100)
    assert dp.closed_form.dp_exposed < 0.5 * e.closed_form.dp_exposed
    # --no-overlap-p2p-communication: every one of the m v interleaved steps waits for its exchange; here each
    # stage is one node (t = 8), so a hop is one NIC: latency + mb s / t h bf16 bytes over it
    blocking = estimate(m, Plan(**{**base.__dict__, "overlap_p2p_comm": False}), H100)
    hop = H100.network_latency_s + 4096 // 8 * m.hidden_size * 2 / (
        H100.network_bandwidth * H100.efficiency("network_fraction"))
    v, micro = 80 // (4 * 5), 512 // (512 // (8 * 4))  # 4 chunks per rank; d = 16, so 32 microbatches
    assert blocking.closed_form.pp_p2p - e.closed_form.pp_p2p == pytest.approx(micro * v * hop, rel=1e-9)
    plain = Plan(**{**base.__dict__, "num_layers_per_virtual_pipeline_stage": None})  # 1F1B blocks either way
    assert estimate(m, Plan(**{**plain.__dict__, "overlap_p2p_comm": False}), H100).closed_form.pp_p2p == \
        estimate(m, plain, H100).closed_form.pp_p2p


def test_dp_overlap_without_virtual_pipeline_on_h100_rows():
    """Bucketed overlap with p = 1: the 32B row's gradient traffic hides behind the backward."""
    run = next(r for r in published_runs("megatron_h100") if r.label.startswith("32B"))
    on = estimate(run.model, run.plan, run.system)
    off = estimate(run.model, Plan(**{**run.plan.__dict__, "overlap_grad_reduce": False,
                                      "overlap_param_gather": False}), run.system)
    assert on.closed_form.dp_exposed < 0.1 * off.closed_form.dp_exposed
    assert on.tokens_per_second_per_gpu > 1.15 * off.tokens_per_second_per_gpu


_CAL_ESTIMATE = ["estimate", "--model", "llama-65b", "--seq-length", "4096", "--num-gpus", "128",
                 "--global-batch-size", "256", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                 "8", "--num-layers-per-virtual-pipeline-stage", "2", "--ckpt", "ours", "--tp-comm-overlap", "--json"]


def _closed_form_rate(capsys, *system) -> float:
    assert main(_CAL_ESTIMATE + list(system)) == 0
    est = json.loads(capsys.readouterr().out)
    # the fit prices the closed form; the estimate's time is the timeline (slower on this row: open question)
    closed = 256 * 4096 / est["closed_form_iteration_time_s"] / 128
    assert est["tokens_per_second_per_gpu"] <= closed * 1.01
    return closed


def test_calibrate_cli_writes_a_system_file(tmp_path, capsys):
    csv = tmp_path / "runs.csv"
    csv.write_text("num_gpus,seq_length,global_batch_size,tensor_model_parallel_size,pipeline_model_parallel_size,"
                   "num_layers_per_virtual_pipeline_stage,ckpt,offload_alpha,tp_comm_overlap,sequence_parallel,"
                   "use_distributed_optimizer,tokens_per_second_per_gpu\n"
                   "128,4096,256,2,8,2,ours,0.0,1,1,1,1100\n")  # switches a run leaves out are Megatron's (off)
    prior_rate = _closed_form_rate(capsys, "--gpu", "h800")
    assert prior_rate < 1060  # the row is measurably away from the model, so the weight shows
    reports = {}
    for weight in ("1", "auto"):
        out = tmp_path / f"h800-cal-{weight}.json"
        assert main(["calibrate", "--model", "llama-65b", "--gpu", "h800", "--runs", str(csv), "--output", str(out),
                     "--calibration-weight", weight, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert list(report["fitted"]) == ["gemm_peak_fraction"] and report["rows"] == 1
        assert "attention_peak_fraction" in report["not_identified"]
        reports[weight] = (report, _closed_form_rate(capsys, "--system-file", str(out)))
    whole, whole_rate = reports["1"]
    assert whole["weight"] == 1.0 and whole_rate == pytest.approx(1100, rel=0.005)
    assert whole["tokens_per_s_mae_after"] == pytest.approx(whole["tokens_per_s_mae_fit_whole"])
    auto, auto_rate = reports["auto"]
    # one row is pooled with the published sources' spread: it moves the log rate by the weight of the way
    assert auto["weight"] == pytest.approx(calibration_prior().weight(1)) and 0.3 < auto["weight"] < 0.7
    assert math.log(auto_rate / prior_rate) / math.log(1100 / prior_rate) == pytest.approx(auto["weight"], abs=0.02)
    fitted = auto["fitted"]["gemm_peak_fraction"]
    assert fitted["fit_to_runs"] == pytest.approx(whole["fitted"]["gemm_peak_fraction"]["value"])
    assert fitted["prior"] < fitted["value"] < fitted["fit_to_runs"]
    assert whole["tokens_per_s_mae_before"] > auto["tokens_per_s_mae_after"] > 0.3 * whole["tokens_per_s_mae_before"]


@pytest.mark.parametrize("value", ["0", "-0.5", "1.5", "nan", "half"])
def test_calibration_weight_out_of_range_is_one_line(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--model", "llama-65b", "--runs", str(tmp_path / "r.csv"), "--output",
              str(tmp_path / "x.json"), "--calibration-weight", value])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "--calibration-weight" in err[-1] and "(0, 1]" in err[-1]


def test_calibrate_cli_bad_file_is_one_line(tmp_path, capsys):
    assert main(["calibrate", "--model", "llama-65b", "--runs", str(tmp_path / "missing.json"), "--output",
                 str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing.json" in err


def test_gradient_sharding_switch():
    """Megatron FSDP's optim_grads shards the fp32 gradients over d (reduce-scattered after every microbatch),
    optim_grads_params the bf16 weights too (all-gathered for every microbatch's forward and backward)."""
    m = get_model("llama2-70b")
    base = Plan(num_gpus=512, seq_length=4096, global_batch_size=512, tensor_model_parallel_size=8,
                pipeline_model_parallel_size=4, num_layers_per_virtual_pipeline_stage=5, ckpt="no",
                overlap_grad_reduce=True, overlap_param_gather=True)
    d = base.data_parallel_size
    ddp = estimate(m, base, H100)
    zero2 = estimate(m, Plan(**{**base.__dict__, "data_parallel_sharding_strategy": "optim_grads"}), H100)
    zero3 = estimate(m, Plan(**{**base.__dict__, "data_parallel_sharding_strategy": "optim_grads_params"}), H100)
    t0, t2, t3 = ddp.stages[0].terms, zero2.stages[0].terms, zero3.stages[0].terms
    assert t2["grads"] == pytest.approx(t0["grads"] / d, rel=1e-6) and t2["weights"] == t0["weights"]
    assert t3["weights"] == pytest.approx(t0["weights"] / d, rel=1e-6) and t3["grads"] == t2["grads"]
    assert 0 < t2["fsdp_buffers"] < t3["fsdp_buffers"] < t0["grads"] / 4
    assert ddp.peak_memory_bytes > zero2.peak_memory_bytes > zero3.peak_memory_bytes
    # m = 32 reduce-scatters instead of one, and 64 parameter all-gathers: not all hidden behind compute
    assert ddp.closed_form.dp_exposed < zero2.closed_form.dp_exposed < zero3.closed_form.dp_exposed
    with pytest.raises(ValueError, match="data_parallel_sharding_strategy"):
        estimate(m, Plan(**{**base.__dict__, "data_parallel_sharding_strategy": "optim"}), H100)
    with pytest.raises(ValueError, match="use_distributed_optimizer"):
        estimate(m, Plan(**{**base.__dict__, "data_parallel_sharding_strategy": "optim_grads",
                            "use_distributed_optimizer": False}), H100)


def _simulated_dp_exposed(p, m, v, comm, buckets_per_chunk, fwd=0.5, bwd=1.0, g=None):
    """Timeline of the schedule builder's action lists (Megatron-core's order; every chunk forward takes
    ``fwd``, backward ``bwd``, p2p is free) and one link draining rank 0's gradient buckets as they
    complete (each chunk's buckets spread over its last backward): how long the link runs past rank 0's
    last backward. ``g``: --microbatch-group-size-per-virtual-pipeline-stage (None: p)."""
    sched = build_schedule(p, m, v, microbatch_group_size_per_vp_stage=g)
    lists = [sched.compute_actions(r) for r in range(p)]
    done, clock, pos = {}, [0.0] * p, [0] * p
    while any(pos[r] < len(lists[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while pos[r] < len(lists[r]):
                a = lists[r][pos[r]]
                mb, c, fw = a.microbatch, a.chunk, a.kind is ActionKind.FORWARD
                if fw:
                    dep = (r - 1, True, mb, c) if r > 0 else ((p - 1, True, mb, c - 1) if c > 0 else None)
                else:
                    dep = ((r + 1, False, mb, c) if r < p - 1 else
                           ((0, False, mb, c + 1) if c < v - 1 else (r, True, mb, c)))
                if dep is not None and dep not in done:
                    break
                clock[r] = max(clock[r], done[dep] if dep else 0.0) + (fwd if fw else bwd)
                done[(r, fw, mb, c)] = clock[r]
                pos[r] += 1
                moved = True
        assert moved, "the simulated schedule deadlocked"
    ready = sorted(last - bwd + bwd * (i + 1) / buckets_per_chunk
                   for last in (max(t for (r, fw, _, c), t in done.items() if r == 0 and not fw and c == chunk)
                                for chunk in range(v))
                   for i in range(buckets_per_chunk))
    link = 0.0
    for x in ready:
        link = max(link, x) + comm / (v * buckets_per_chunk)
    return max(0.0, link - clock[0])


@pytest.mark.parametrize("p,v,m", [(2, 7, 8), (4, 23, 16), (6, 4, 24), (8, 12, 32), (16, 7, 64), (2, 1, 8), (4, 2, 8), (8, 3, 16)])
def test_interleaved_dp_overlap_window_matches_the_schedule(p, v, m):
    """--overlap-grad-reduce with interleaving: chunk j's gradients are complete j p chunk-backwards before
    rank 0's end (Megatron's cool-down order), so a reduce-scatter of ``comm`` is exposed by
    max(comm - ((v - 1) p + 1) units, comm / v - 1 unit), within one bucket of a timeline of the schedule
    builder's lists. (The earlier window, v + (v - 1) p units, would leave p=2 v=7 comm=20 1 unit exposed,
    not 7.)"""
    buckets_per_chunk = 8
    for comm in (0.5, 3.0, 10.0, 20.0, 40.0):
        sim = _simulated_dp_exposed(p, m, v, comm, buckets_per_chunk)
        model = _bucketed_exposed(comm, buckets_per_chunk * v, v, 1.0, p)
        assert abs(model - sim) <= comm / (v * buckets_per_chunk) + 1e-9, (comm, sim, model)


@pytest.mark.parametrize("p,v,m,g", [(2, 3, 8, 3), (4, 2, 10, 6), (2, 4, 10, 4), (4, 3, 12, 6), (3, 2, 11, 4),
                                     (2, 5, 9, 9)])
def test_grouped_interleaving_moves_the_dp_overlap_window(p, v, m, g):
    """With --microbatch-group-size-per-virtual-pipeline-stage g the cool-down runs the last group (m mod g, or g)
    chunk by chunk, so the window is ((v - 1) g_last + 1) units, not ((v - 1) p + 1): the plan's window matches
    the simulated schedule within one bucket, and the p window misses it where g_last != p."""
    from h3t_ext.costmodel import Plan
    plan = Plan(num_gpus=p, seq_length=64, global_batch_size=m, pipeline_model_parallel_size=p,
                microbatch_group_size_per_vp_stage=g)
    last = plan.last_microbatch_group()
    assert last == (m % g or g)
    buckets_per_chunk = 8
    missed = 0
    for comm in (0.5, 3.0, 10.0, 20.0, 40.0):
        sim = _simulated_dp_exposed(p, m, v, comm, buckets_per_chunk, g=g)
        model = _bucketed_exposed(comm, buckets_per_chunk * v, v, 1.0, last)
        assert abs(model - sim) <= comm / (v * buckets_per_chunk) + 1e-9, (comm, sim, model)
        missed += abs(_bucketed_exposed(comm, buckets_per_chunk * v, v, 1.0, p) - sim) > comm / (v * buckets_per_chunk)
    assert (missed > 0) == (last != p)


def _megatron_row(size):
    return next(r for r in published_runs("megatron_h100") if r.label.startswith(size + " "))


def test_attention_dropout_prices_the_mask_not_its_probability():
    """Flash attention with dropout draws a random number per score whatever p is: the same time at p = 0.1
    and 0.5, more than without. The slowdown weighs on the model whose attention is the larger share: the
    1.7B row (h 2048, s 4096) slows several times more than the 314B row (h 16384)."""
    slowdown = {}
    for size in ("1.7B", "314B"):
        run = _megatron_row(size)
        t = {p: estimate(replace(run.model, attention_dropout=p), run.plan, run.system).iteration_time_s
             for p in (0.0, 0.1, 0.5)}
        assert t[0.1] == t[0.5] > t[0.0]
        slowdown[size] = t[0.1] / t[0.0] - 1
    assert slowdown["1.7B"] > 3 * slowdown["314B"] > 0


def test_hidden_dropout_adds_its_masks_to_the_element_wise_traffic():
    """The two bias-dropout-adds write a 1-byte mask per element of the rank's (sequence-parallel) shard in the
    forward and read it in the backward (whose dropout kernels also move the gradient), priced at the element-wise bandwidth; the saved masks add 2 h bytes
    per local token to the activation memory."""
    from h3t_ext.costmodel.activations import activation_bytes_per_layer_token
    from h3t_ext.costmodel.kernels import kernel_rates
    from h3t_ext.costmodel.timing import HIDDEN_DROPOUT_KERNELS_BWD, layer_time
    run = _megatron_row("16B")
    without = replace(run.model, hidden_dropout=0.0)
    a, b = layer_time(run.model, run.plan, run.system), layer_time(without, run.plan, run.system)
    p = run.plan
    mask_bytes = 2 * run.model.hidden_size * p.micro_batch_size * p.seq_length // p.tensor_model_parallel_size
    hbm = kernel_rates(run.system).hbm
    assert a.fwd - b.fwd == pytest.approx(mask_bytes / hbm, rel=1e-9)
    # backward: read the masks, and the two dropout backwards read dy and write the branch gradient (bf16),
    # which without dropout is dy itself
    dropout_bwd_bytes = 2 * (2 + 2) * run.model.hidden_size * p.micro_batch_size * p.seq_length \
        // p.tensor_model_parallel_size
    launches = HIDDEN_DROPOUT_KERNELS_BWD * kernel_rates(run.system).launch_s  # the two dropout backwards
    assert a.bwd - b.bwd == pytest.approx((mask_bytes + dropout_bwd_bytes) / hbm + launches, rel=1e-9)
    terms = activation_bytes_per_layer_token(run.model, "no")
    assert terms["hidden_dropout_mask"] == 2 * run.model.hidden_size
    assert terms["total"] - activation_bytes_per_layer_token(without, "no")["total"] == 2 * run.model.hidden_size
    assert activation_bytes_per_layer_token(run.model, "full")["hidden_dropout_mask"] == 0


def test_unfused_attention_prices_its_dropout_kernel():
    """Korthikanti's 2022 Megatron (no flash): attention dropout is a kernel over the s^2 scores in HBM."""
    run = next(r for r in published_runs("korthikanti") if r.label.startswith("22B") and "selective" in r.label)
    no_drop = replace(run.model, attention_dropout=0.0)
    with_drop = estimate(run.model, run.plan, run.system).iteration_time_s
    assert with_drop > estimate(no_drop, run.plan, run.system).iteration_time_s * 1.01


@pytest.mark.parametrize("swiglu,sequence_parallel,bias", [(False, True, False), (False, False, False),
                                                        (True, True, False), (False, True, True)])
def test_element_wise_bytes_kernel_by_kernel(swiglu, sequence_parallel, bias):
    """One layer's element-wise traffic, counted by hand per kernel for h 1024, f 4096 (SwiGLU: FC1 2f wide),
    T 4096 tokens, t 2, no dropout; bf16 elements. Forward: 2 norms (read x, write y), 2 residual adds (read
    2, write 1), the activation (read FC1's output, write FC2's input), RoPE on q and k for Llama. Backward:
    2 norm backwards (read x and dy, write dx), 2 gradient accumulations of the residual stream (read 2,
    write 1), the activation backward (read its input and dy, write FC1's gradient), RoPE on dq and dk; with
    linear biases, autograd's reduction of the fused bias-activation's full-size gradient into FC1's bias."""
    from h3t_ext.costmodel.specs import ModelSpec
    from h3t_ext.costmodel.elementwise import layer_elementwise_bytes as _elementwise_bytes
    h, f, tokens, t = 1024, 4096, 4096, 2
    model = ModelSpec(name="x", num_layers=2, hidden_size=h, num_attention_heads=8, num_query_groups=8, ffn_hidden_size=f,
                      vocab_size=1000, swiglu=swiglu, add_bias_linear=bias)
    plan = Plan(num_gpus=2, seq_length=tokens, global_batch_size=1, micro_batch_size=1,
                tensor_model_parallel_size=t, sequence_parallel=sequence_parallel)
    norm_tokens = tokens // t if sequence_parallel else tokens
    fc1 = 2 * f if swiglu else f
    rope = 2 * (h + h) * tokens // t if swiglu else 0
    fwd = 2 * (2 * (h + h) * norm_tokens + 2 * (2 * h + h) * norm_tokens + (fc1 + f) * tokens // t + rope)
    bias_grad = fc1 * tokens // t if bias else 0
    bwd = 2 * (2 * (2 * h + h) * norm_tokens + 2 * (2 * h + h) * norm_tokens + (2 * fc1 + f) * tokens // t + rope
               + bias_grad)
    ours = 2 * (2 * (h + h) * norm_tokens + (fc1 + f) * tokens // t)
    assert _elementwise_bytes(model, plan) == (fwd, bwd, ours, 0)


def test_linear_bias_parameters():
    """QKV's and FC1's biases are split with their columns over t, the projection's and FC2's are whole on
    every rank; they count in the stage's parameters (GPT-3 175B at t 8: 96 layers x (15h/8 + 2h))."""
    from h3t_ext.costmodel.memory import stage_params
    gpt = get_model("gpt3-175b")
    h = gpt.hidden_size
    assert gpt.add_bias_linear and not get_model("llama-65b").add_bias_linear
    assert gpt.bias_params_per_layer(8) == (h + 2 * h + 4 * h) // 8 + 2 * h
    plan = Plan(num_gpus=64, seq_length=2048, global_batch_size=64, tensor_model_parallel_size=8,
                pipeline_model_parallel_size=8)
    without = replace(gpt, add_bias_linear=False)
    assert stage_params(gpt, plan, 3) - stage_params(without, plan, 3) == 12 * gpt.bias_params_per_layer(8)
    assert gpt.num_parameters - without.num_parameters == 96 * 9 * h
