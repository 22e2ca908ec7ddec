"""h3t-plan command line: estimate/search output, JSON keys, one-line errors (pure arithmetic, no torch)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from h3t_ext.costmodel import get_model, get_system
from h3t_ext.planner.evaluate import evaluate
from h3t_ext.planner.flags import plan_from_megatron_flags
from planner_harness import run_main
from h3t_ext.costmodel import Plan

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = ["--seq-length", "4096", "--num-gpus", "8", "--global-batch-size", "16"]
SMALL = ["--model", "llama-7b", *RUN]
PLAN65 = ["--model", "llama-65b", "--seq-length", "4096", "--num-gpus", "256", "--global-batch-size", "256",
          "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "8",
          "--num-layers-per-virtual-pipeline-stage", "2"]
ESTIMATE_KEYS = {"peak_memory_bytes", "fits", "offload_alpha", "tokens_per_second", "tokens_per_second_per_gpu", "mfu"}
SEARCH_KEYS = ESTIMATE_KEYS | {"tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size",
                               "num_layers_per_virtual_pipeline_stage", "ckpt", "micro_batch_size", "megatron_flags"}


def test_estimate_json_keys_and_consistency(capsys):
    code, out, err = run_main(["estimate", *PLAN65, "--ckpt", "no", "--offload-alpha", "auto", "--json"], capsys)
    assert code == 0, err
    d = json.loads(out)
    assert ESTIMATE_KEYS <= d.keys()
    assert d["fits"] is True
    assert d["peak_memory_bytes"] <= d["memory_budget_bytes"]
    assert 0.0 < d["offload_alpha"] <= 1.0  # 65B, ckpt=no, t=2 p=8 needs offload (published alpha 0.355)
    assert d["tokens_per_second"] == pytest.approx(d["tokens_per_second_per_gpu"] * 256)
    assert 0.0 < d["mfu"] < 1.0


def test_estimate_auto_is_the_smallest_alpha_that_fits(capsys):
    code, out, _ = run_main(["estimate", *PLAN65, "--ckpt", "ours", "--offload-alpha", "auto", "--json",
                             "--memory-budget", "50GB"], capsys)
    assert code == 0
    alpha = json.loads(out)["offload_alpha"]
    assert alpha > 0
    code, out, _ = run_main(["estimate", *PLAN65, "--ckpt", "ours", "--offload-alpha", f"{alpha - 0.001:.3f}",
                             "--json", "--memory-budget", "50GB"], capsys)
    assert code == 0
    below = json.loads(out)
    assert below["fits"] is False and below["over_budget"]["excess_bytes"] > 0


def test_estimate_balanced_reports_pcie_savings(capsys):
    code, out, _ = run_main(["estimate", *PLAN65, "--ckpt", "ours", "--offload-alpha", "balanced", "--json",
                             "--memory-budget", "50GB"], capsys)
    assert code == 0
    d = json.loads(out)
    assert isinstance(d["offload_alpha"], list) and len(d["offload_alpha"]) == 8
    assert max(d["offload_alpha"]) == pytest.approx(d["auto_offload_alpha"])
    assert d["pcie_bytes_saved_vs_auto"] > 0
    code, out, _ = run_main(["estimate", *PLAN65, "--ckpt", "ours", "--offload-alpha", "balanced",
                             "--memory-budget", "50GB"], capsys)
    assert "PCIe" in out


def test_estimate_per_stage_alpha_list(capsys):
    code, out, err = run_main(["estimate", *SMALL, "--pipeline-model-parallel-size", "4", "--offload-alpha",
                               "0.25,0.5,0.75,0", "--json"], capsys)
    assert code == 0, err
    d = json.loads(out)
    assert d["offload_alpha"] == [0.25, 0.5, 0.75, 0.0]
    assert "0.250,0.500,0.750,0.000" in d["megatron_flags"]
    # the last stage of plain 1F1B has no place to hide an offload (each microbatch's backward follows its forward):
    # a value > 0 there is refused, as the runtime refuses it, not priced as 0
    code, _, err = run_main(["estimate", *SMALL, "--pipeline-model-parallel-size", "4", "--offload-alpha",
                             "0.25,0.5,0.75,0.5"], capsys)
    assert code == 2 and "stage(s) [3] that cannot overlap an offload" in err


def test_estimate_explain_prints_every_term(capsys):
    code, out, _ = run_main(["estimate", *PLAN65, "--ckpt", "ours", "--explain"], capsys)
    assert code == 0
    model, system = get_model("llama-65b"), get_system("h800")
    ev = evaluate(model, Plan(num_gpus=256, seq_length=4096, global_batch_size=256, tensor_model_parallel_size=2,
                              pipeline_model_parallel_size=8, num_layers_per_virtual_pipeline_stage=2, ckpt="ours"),
                  system, alpha_mode=0.0)
    for stage in ev.estimate.stages:
        assert f"stage {stage.stage}" in out
        for term in stage.terms:
            assert term in out
    for term in ev.estimate.time_terms.as_dict():
        assert term in out


def test_search_json_best_first_with_flags_round_trip(capsys):
    code, out, err = run_main(["search", *SMALL, "--json", "--top", "50"], capsys)
    assert code == 0, err
    rows = json.loads(out)
    assert 1 < len(rows) <= 50
    tps = [r["tokens_per_second"] for r in rows]
    assert tps == sorted(tps, reverse=True)
    for r in rows:
        assert SEARCH_KEYS <= r.keys()
        assert r["fits"] is True
        plan = plan_from_megatron_flags(r["megatron_flags"], num_gpus=8, seq_length=4096)
        assert plan.tensor_model_parallel_size == r["tensor_model_parallel_size"]
        assert plan.context_parallel_size == r["context_parallel_size"]
        assert plan.pipeline_model_parallel_size == r["pipeline_model_parallel_size"]
        assert plan.num_layers_per_virtual_pipeline_stage == r["num_layers_per_virtual_pipeline_stage"]
        assert plan.ckpt == r["ckpt"] and plan.micro_batch_size == r["micro_batch_size"]
        assert plan.offload_alpha == pytest.approx(r["offload_alpha"])


def test_search_table_and_fixed_dimensions(capsys):
    code, out, _ = run_main(["search", *SMALL, "--tensor-model-parallel-size", "2", "--ckpt", "ours", "--top", "3"],
                            capsys)
    assert code == 0
    assert "tokens/s" in out and "rejected" in out
    flag_lines = [line for line in out.splitlines() if line.startswith("#")]
    assert len(flag_lines) == 3
    for line in flag_lines:
        assert "--tensor-model-parallel-size 2 " in line and "--ckpt ours" in line


def test_search_custom_model(capsys):
    custom = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--num-query-groups", "4",
              "--ffn-hidden-size", "2816", "--vocab-size", "32000", "--no-swiglu", "--tie-embeddings-and-output-weights"]
    code, out, err = run_main(["search", *custom, *RUN, "--json", "--top", "5"], capsys)
    assert code == 0, err
    rows = json.loads(out)
    assert all(16 % r["tensor_model_parallel_size"] == 0 and 4 % r["tensor_model_parallel_size"] == 0 for r in rows)


BAD_INPUTS = [
    (["estimate", "--model", "no-such-model", *RUN], "--model"),
    (["estimate", *SMALL, "--gpu", "no-such-gpu"], "--gpu"),
    (["estimate", *SMALL, "--offload-alpha", "1.5"], "--offload-alpha"),
    (["estimate", *SMALL, "--offload-alpha", "-0.1"], "--offload-alpha"),
    (["estimate", *SMALL, "--offload-alpha", "lots"], "--offload-alpha"),
    (["estimate", *SMALL, "--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size"),
    (["estimate", *SMALL, "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
     "--num-layers-per-virtual-pipeline-stage"),
    (["estimate", *SMALL, "--micro-batch-size", "3"], "--micro-batch-size"),
    (["estimate", *SMALL, "--context-parallel-size", "3"], "--context-parallel-size"),
    (["estimate", "--model", "llama-7b", "--num-gpus", "8"], "required"),
    (["estimate", *RUN, "--hidden-size", "1024"], "--num-layers"),
    (["estimate", *SMALL, "--memory-budget", "12XB"], "--memory-budget"),
    (["estimate", *SMALL, "--ckpt", "sometimes"], "--ckpt"),
    (["estimate", *SMALL, "--micro-batch-size", "0"], "--micro-batch-size"),
    (["estimate", *SMALL, "--memory-budget", "1GB", "--offload-alpha", "auto"], "over"),
    (["search", *SMALL, "--memory-budget", "2GB"], "over budget by"),
    (["search", *SMALL, "--offload-alpha", "0.1,0.2"], "--offload-alpha"),
    (["estimate", *SMALL, "--pipeline-model-parallel-size", "2", "--offload-alpha", "0.1,0.2,0.3"], "--offload-alpha"),
    ([], "required"),
    (["estimate", *SMALL, "--attention-dropout", "1"], "--attention-dropout"),
    (["estimate", *SMALL, "--hidden-dropout", "x"], "--hidden-dropout"),
]


def test_dropout_flags_reach_the_model(capsys):
    """--attention-dropout / --hidden-dropout override the zoo model's (0 for Llama): any p > 0 costs the
    same (the mask is drawn whatever p is), and more than none."""
    tokens = {}
    for p in ("0", "0.1", "0.5"):
        code, out, _ = run_main(["estimate", *SMALL, "--attention-dropout", p, "--hidden-dropout", p, "--json"],
                                capsys)
        assert code == 0
        tokens[p] = json.loads(out)["tokens_per_second"]
    assert tokens["0.1"] == tokens["0.5"] < tokens["0"]


def test_bias_flags_reach_the_model(capsys):
    """--add-bias-linear prices the fused bias-activation's bias gradient (one more pass in the backward) and
    the biases' parameters; --disable-bias-linear is the Llama default; the two exclude each other."""
    tokens = {}
    for flag in ("--add-bias-linear", "--disable-bias-linear"):
        code, out, _ = run_main(["estimate", *SMALL, flag, "--json"], capsys)
        assert code == 0
        tokens[flag] = json.loads(out)["tokens_per_second"]
    assert tokens["--add-bias-linear"] < tokens["--disable-bias-linear"]
    code, out, err = run_main(["estimate", *SMALL, "--add-bias-linear", "--disable-bias-linear"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--disable-bias-linear" in err


@pytest.mark.parametrize("argv,needle", BAD_INPUTS)
def test_bad_input_is_one_line_exit_2(argv, needle, capsys):
    code, out, err = run_main(argv, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("h3t-plan: error: ")
    assert needle in lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", [BAD_INPUTS[0][0], BAD_INPUTS[2][0], BAD_INPUTS[15][0]])
def test_bad_input_process_has_no_traceback(argv):
    proc = subprocess.run([sys.executable, "-m", "h3t_ext.planner", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("h3t-plan: error: ")


def test_module_entry_point_runs_estimate():
    proc = subprocess.run([sys.executable, "-m", "h3t_ext.planner", "estimate", *SMALL, "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert ESTIMATE_KEYS <= json.loads(proc.stdout).keys()


def test_bench_script_reports_its_figures():
    """Smoke test of scripts/bench_planner.py on a small case (keys only; tests never assert timings)."""
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_planner.py"), "--model", "llama-7b",
                           "--num-gpus", "8", "--seq-length", "4096", "--global-batch-size", "16", "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    for key in ("search_wall_s", "search_cpu_s", "cli_wall_s", "plans_priced", "plans_feasible"):
        assert key in d
    assert d["cli_exit_code"] == 0 and d["plans_feasible"] > 0


def test_bench_script_takes_a_memory_budget_to_both_runs():
    """--memory-budget reaches the in-process search (a tighter budget prices a different set of plans) and the CLI
    run (its command carries it); a bad byte count is argparse's usage and one error line naming the flag, no
    traceback (as every script under scripts/ reports a bad flag)."""
    def bench(*extra):
        return subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_planner.py"), "--model",
                               "llama-7b", "--gpu", "h800", "--num-gpus", "8", "--seq-length", "4096",
                               "--global-batch-size", "16", "--precision", "bf16", *extra],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
    free, tight = (json.loads(bench("--json", *extra).stdout) for extra in ((), ("--memory-budget", "20GB")))
    assert "--memory-budget 20GB" in tight["cli_command"] and tight["cli_exit_code"] == 0
    assert tight["plans_priced"] != free["plans_priced"]
    bad = bench("--memory-budget", "x")
    last = bad.stderr.strip().splitlines()[-1]
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert last.startswith("bench_planner.py: error: argument --memory-budget: 'x' is not a byte count"), last


def test_bench_script_takes_a_fixed_alpha_to_both_runs():
    """--offload-alpha reaches the in-process search (its best plan offloads that fraction) and the CLI run; a
    per-stage list is refused as h3t-plan search refuses it, in one line."""
    def bench(*extra):
        return subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_planner.py"), "--model",
                               "llama-7b", "--gpu", "b200", "--num-gpus", "8", "--seq-length", "4096",
                               "--global-batch-size", "16", "--precision", "bf16", *extra],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
    d = json.loads(bench("--json", "--offload-alpha", "0.5").stdout)
    assert d["cli_command"].endswith("--offload-alpha 0.500") and d["cli_exit_code"] == 0
    flags = d["best_megatron_flags"]
    assert flags[flags.index("--offload-alpha") + 1] == "0.500"
    bad = bench("--offload-alpha", "0.5,0.2")
    last = bad.stderr.strip().splitlines()[-1]
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert last.startswith("bench_planner.py: error: argument --offload-alpha: search takes one number"), last


def test_search_precision_auto_chooses_fp8_on_h100_and_prints_its_flags(capsys):
    code, out, err = run_main(["search", "--model", "llama-65b", "--seq-length", "4096", "--num-gpus", "256",
                               "--global-batch-size", "256", "--gpu", "h100-sxm", "--precision", "auto", "--top", "3",
                               "--json"], capsys)
    assert code == 0, err
    rows = json.loads(out)
    assert rows[0]["precision"] == "fp8" and rows[0]["fp8"] == "hybrid" and rows[0]["fp8_recipe"] == "delayed"
    flags = rows[0]["megatron_flags"]
    assert flags[flags.index("--fp8-format") + 1] == "hybrid" and "--fp8-recipe" in flags
    plan = plan_from_megatron_flags(flags, num_gpus=256, seq_length=4096)
    assert plan.fp8 == "hybrid"
    code, out, _ = run_main(["search", "--model", "llama-65b", "--seq-length", "4096", "--num-gpus", "256",
                             "--global-batch-size", "256", "--gpu", "h100-sxm", "--top", "1", "--json"], capsys)
    bf16 = json.loads(out)[0]
    assert bf16["precision"] == "bf16" and "--fp8-format" not in bf16["megatron_flags"]
    assert rows[0]["tokens_per_second"] > 1.1 * bf16["tokens_per_second"]


def test_search_precision_auto_on_a100_keeps_bf16(capsys):
    code, out, err = run_main(["search", *SMALL, "--gpu", "a100-80g", "--precision", "auto", "--top", "2", "--json"],
                              capsys)
    assert code == 0, err
    assert {r["precision"] for r in json.loads(out)} == {"bf16"}


def test_estimate_fp8_flags(capsys):
    code, out, err = run_main(["estimate", *SMALL, "--gpu", "h100-sxm", "--fp8-format", "e4m3", "--fp8-recipe",
                               "tensorwise", "--fp8-param-gather", "--json"], capsys)
    assert code == 0, err
    row = json.loads(out)
    assert (row["fp8"], row["fp8_recipe"], row["fp8_param_gather"]) == ("e4m3", "tensorwise", True)
    assert row["megatron_flags"][-5:] == ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--fp8-param-gather"]


@pytest.mark.parametrize("argv, needle", [
    (["estimate", *SMALL, "--gpu", "a100-80g", "--fp8-format", "hybrid"], "--fp8-format needs FP8 tensor cores"),
    (["estimate", *SMALL, "--gpu", "h100-sxm", "--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"],
     "--fp8-recipe mxfp8 needs Blackwell"),
    (["estimate", *SMALL, "--fp8-param-gather"], "--fp8-param-gather needs --fp8-format"),
    (["estimate", *SMALL, "--fp8-format", "e5m2"], "--fp8-format"),
    (["search", *SMALL, "--precision", "bf16", "--fp8-format", "hybrid"], "need --precision fp8 or auto"),
    (["search", *SMALL, "--precision", "fp16"], "--precision"),
])
def test_bad_fp8_input_is_one_line_exit_2(argv, needle, capsys):
    code, out, err = run_main(argv, capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("h3t-plan: error:") and needle in err


def test_mfu_ceilings_come_from_the_published_runs():
    from h3t_ext.costmodel.plausibility import plausibility, published_mfu_ceilings
    ceilings = published_mfu_ceilings()
    amp = ceilings[("ampere", "bf16")]
    assert (amp.source, amp.gpu) == ("atc24_demo7b", "a800") and 0.60 < amp.mfu < 0.61  # published MFU 0.601
    assert ceilings[("hopper", "fp8")].source == "nemo_fp8_h100"
    assert plausibility(amp.mfu + 0.001, "ampere", "bf16").above_ceiling
    assert not plausibility(amp.mfu - 0.001, "ampere", "bf16").above_ceiling
    assert plausibility(0.5, "ampere", "fp8").ceiling is None  # no FP8 run on A100/A800 to compare with


def test_search_flags_plans_above_the_published_mfu_ceiling(capsys):
    """Issue #20's case: GPT-3 175B on 64 A100-80G tops above every published A100-class MFU and says so."""
    argv = ["search", "--model", "gpt3-175b", "--num-gpus", "64", "--gpu", "a100-80g", "--seq-length", "2048",
            "--global-batch-size", "512", "--top", "3"]
    code, out, _ = run_main([*argv, "--json"], capsys)
    assert code == 0
    best = json.loads(out)[0]
    assert best["mfu"] > 0.601 and best["plausibility"]["above_ceiling"]
    assert best["plausibility"]["ceiling_run"]["source"] == "atc24_demo7b"
    code, text, _ = run_main(argv, capsys)
    assert code == 0 and "rows #1" in text and "ABOVE the best published MFU" in text


def test_a_reader_that_stops_early_gets_no_traceback():
    """``h3t-plan ... --json | head``: the reader closes the pipe before the output is written; the CLI exits 1
    with nothing on stderr (it printed a BrokenPipeError traceback)."""
    proc = subprocess.Popen([sys.executable, "-m", "h3t_ext.planner", "estimate", "--model", "llama-7b", "--num-gpus",
                             "8", "--seq-length", "4096", "--global-batch-size", "64", "--json"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first write
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1 and err == ""
