#!/usr/bin/env python3
"""Run the GPU checks and write one JSON report plus a short table (called by scripts/gpu_check.sh).

Report fields: ``gpu``, ``date``, ``tests_passed``, ``tests_failed`` (the ``gpu`` pytest tier),
``stage_memory_max_error`` (the largest relative error of a stage's ``torch.cuda.max_memory_allocated``
against the cost model's ``stage_memory(...).peak_bytes``: two gloo ranks on the one GPU with host-staged
pipeline transfers, pipeline 2 interleaved, ckpt=ours, alpha 0.5, scripts/gpu/stage_memory.py; per stage
under ``details["stage_memory"]``), ``offload_step_time_ratio`` (alpha 0.5 over
alpha 0, one rank), ``copy_speedup_small`` (native batched over the copy_ loop, 2,000 x 64 KiB, the
worse direction) and ``copy_bandwidth_share`` (of one large copy, the worse of both cases and
directions), ``attention_dropout_slowdown`` (per SDPA backend that runs, the measured forward and
backward slowdown of attention dropout 0.1 at the Megatron 1.7B row's shape, next to the data file's
stated values; scripts/gpu/bench_attention_dropout.py), ``ground_truth`` (scripts/gpu/ground_truth.py: the cost
model's terms measured beside its predictions; its own JSON lands beside this report as
``<date>-<gpu>-ground-truth.json``, here its path, the rows measured and those within 10% of the model);
the raw results of each part are kept under
``details`` (with ``megatron_native``: a
tiny pretrain_gpt.py run on Megatron's own loop where megatron-core 0.17+ was carried in). A field is
null only where its part failed; ``missing`` then holds that part's last stderr line.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_json(cmd: list[str], timeout_s: int) -> tuple[object, str]:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        return None, (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    return json.loads(proc.stdout.strip().splitlines()[-1]), ""


def sustained_gemm(precision: str, seconds: int) -> object:
    """scripts/gpu/sustained_gemm.py's JSON (None where it failed)."""
    path = os.path.join(tempfile.mkdtemp(), "sustained.json")
    subprocess.run([sys.executable, "scripts/gpu/sustained_gemm.py", "--precision", precision, "--seconds",
                    str(seconds), "--json", path], cwd=ROOT, capture_output=True, text=True, timeout=seconds + 120)
    return _json_file(path)[0]


def gpu_tests(timeout_s: int) -> dict:
    xml = os.path.join(tempfile.mkdtemp(), "gpu.xml")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests", f"--junitxml={xml}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    return {**junit_counts(xml), "tail": proc.stdout.strip().splitlines()[-1:]}


def junit_counts(xml: str) -> dict:
    """passed / failed / skipped and the failed tests' names of a pytest --junitxml file."""
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, failures, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    failed = [f"{c.get('classname')}.{c.get('name')}" for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    return {"passed": total - failures - errors - skipped, "failed": failures + errors, "skipped": skipped,
            "failed_tests": failed}


VERBOSE_RESULT = re.compile(r"(?:\[gw\d+\] (?:\[\s*\d+%\] )?)?(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+::\S+)"
                            r"|(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")


def verbose_counts(text: str) -> dict:
    """passed / failed / skipped of a ``pytest -v`` log, for a run stopped before it wrote its --junitxml (the lease's
    time cap): each test's last result line counts; ``partial`` says the counts are of the tests that finished."""
    last: dict[str, str] = {}
    for m in VERBOSE_RESULT.finditer(text):
        word, name = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
        last[name] = word
    failed = sorted(n for n, w in last.items() if w in ("FAILED", "ERROR"))
    return {"passed": sum(w in ("PASSED", "XFAIL") for w in last.values()), "failed": len(failed),
            "skipped": sum(w == "SKIPPED" for w in last.values()), "failed_tests": failed, "partial": True}


def stage_memory(timeout_s: int, device: str = "cuda") -> tuple[Optional[float], Optional[dict], str]:
    """(max relative error, the script's JSON, why it is missing) of scripts/gpu/stage_memory.py."""
    try:
        result, why = _run_json([sys.executable, "scripts/gpu/stage_memory.py", "--device", device, "--json"],
                                timeout_s)
    except subprocess.TimeoutExpired:
        return None, None, f"scripts/gpu/stage_memory.py did not finish within {timeout_s}s"
    return (None if result is None else result["max_error"]), result, why


NATIVE_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
                "--max-position-embeddings", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
                "--train-iters", "3", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
                "--vocab-size", "1000", "--bf16", "--transformer-impl", "local", "--no-persist-layer-norm",
                "--ckpt", "ours", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
                "--no-gradient-accumulation-fusion"]  # (see lease_run.sh: no apex there; 0.19 needs the interval)
"""A tiny run of pretrain_gpt.py through Megatron's own pretrain() (h3t_training.loop.megatron_native)."""


def megatron_native(timeout_s: int) -> dict:
    """pretrain_gpt.py on Megatron's own loop, where megatron.training is importable (megatron-core 0.17+)."""
    sys.path.insert(0, ROOT)
    from h3t_training.loop import megatron_native as native

    if not native.available():
        return {"ran": False, "why": "megatron.training is not importable (megatron-core < 0.17)"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "pretrain_gpt.py", *NATIVE_FLAGS]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    return {"ran": True, "returncode": proc.returncode, "losses": _lm_losses(proc.stdout),
            "last_error": (proc.stderr.strip().splitlines() or [""])[-1] if proc.returncode else ""}


def ground_truth(path: str, budget_s: float) -> tuple[Optional[dict], str]:
    """scripts/gpu/ground_truth.py --json PATH: (its summary, why it is missing)."""
    cmd = [sys.executable, "scripts/gpu/ground_truth.py", "--budget-s", f"{budget_s:g}", "--json", path]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=budget_s + 300)
    except subprocess.TimeoutExpired:
        return None, f"scripts/gpu/ground_truth.py did not finish within {budget_s + 300:g}s"
    if proc.returncode != 0 or not os.path.isfile(path):
        return None, (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    return ground_truth_summary(path), ""


def ground_truth_summary(path: str) -> dict:
    """The rows measured, within 10% of the model, and not measured, of a ground-truth JSON."""
    with open(path) as f:
        doc = json.load(f)
    rows = doc["rows"]
    measured = [r for r in rows if r["status"] == "measured"]
    return {"json": os.path.relpath(path, ROOT), "system": doc.get("system"), "measured": len(measured),
            "within_10_percent": sum(abs(r["ratio"] - 1) <= 0.10 for r in measured),
            "not_measured": sum(r["status"] in ("skipped", "failed") for r in rows)}


def _json_file(path: str) -> tuple[object, str]:
    """(the JSON of a part's file, or None and its last line) -- lease_run.sh writes each part's stdout and stderr."""
    if not os.path.isfile(path):
        return None, f"{os.path.basename(path)} was not written (the part did not run)"
    with open(path, encoding="utf-8") as f:
        text = f.read()
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    try:
        return json.loads(lines[-1] if lines and lines[-1].lstrip().startswith(("{", "[")) else text), ""
    except (json.JSONDecodeError, IndexError):
        errors = [ln.strip() for ln in lines if "error" in ln.lower() and "warn" not in ln.lower()]
        return None, (errors[-1] if errors else "no result: the process died without a message (see the lease log)")


NAMED_ERROR = re.compile(r"\b\w*(Error|Exception): ")


def _native_losses(path: str) -> dict:
    if not os.path.isfile(path):
        return {"ran": False, "why": f"{os.path.basename(path)} was not written"}
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    # the driver's one line (": error: "), or a traceback's last exception line (a rank's "[rank0]: ...Error: ...")
    # before torchrun's own ChildFailedError, which follows it
    errors = [ln for ln in text.splitlines() if ": error: " in ln or (NAMED_ERROR.search(ln) and "Warning" not in ln)]
    ranks = [ln for ln in errors if ln.startswith("[rank")]
    return {"ran": True, "losses": _lm_losses(text), "last_error": (ranks or errors or [""])[-1]}


def _lm_losses(text: str) -> list[float]:
    """The ``lm loss`` of each logged iteration in Megatron's log lines."""
    return [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", text)]


SUSTAINED = {"bf16": 20, "fp8": 10}
"""scripts/gpu/sustained_gemm.py's runs: precision -> seconds (scripts/gpu/lease_run.sh runs the same)."""


NATIVE_RUNS = ("ours", "no")
"""Megatron's own pretrain() runs of the lease: ckpt=ours alpha 0.5 and ckpt=no alpha 0."""
PART_FILES = {"meta": "meta.json", "tests": "gpu_tests.xml", "tests_log": "gpu_tests.txt",
              "stage_memory": "stage_memory.json",
              "overlap": "overlap.json", "copies": "copies.json", "dropout": "attention_dropout.json",
              **{f"native-{n}": f"native-{n}.log" for n in NATIVE_RUNS}, "driver_steps": "driver_steps.json",
              "driver_profile": "driver_profile.json", "driver_host": "driver_host.json",
              **{f"sustained-{p}": f"sustained-{p}.json" for p in SUSTAINED}, "ground_truth": "ground_truth.json"}
"""Every file of scripts/gpu/lease_run.sh's parts that the report reads (tests/integration/test_gpu_check.py checks
that the lease writes each one)."""


def parts_from_dir(parts: str) -> tuple[dict, dict]:
    """(meta, raw results) of the files scripts/gpu/lease_run.sh leaves in ``parts``."""
    path = {key: os.path.join(parts, name) for key, name in PART_FILES.items()}
    meta, why = _json_file(path["meta"])
    if meta is None:
        raise SystemExit(f"report.py: error: --from-parts {parts}: {PART_FILES['meta']}: {why}")
    tests = junit_counts(path["tests"]) if os.path.isfile(path["tests"]) else \
        verbose_counts(open(path["tests_log"]).read()) if os.path.isfile(path["tests_log"]) else None
    raw = {"tests": tests,
           "stage_memory": _json_file(path["stage_memory"]),
           "overlap": _json_file(path["overlap"]),
           "copies": _json_file(path["copies"]),
           "dropout": _json_file(path["dropout"]),
           "native": {name: _native_losses(path[f"native-{name}"]) for name in NATIVE_RUNS},
           "driver_steps": _json_file(path["driver_steps"])[0],
           "driver_profile": _json_file(path["driver_profile"])[0],
           "driver_host": _json_file(path["driver_host"])[0],
           "sustained": {prec: _json_file(path[f"sustained-{prec}"])[0] for prec in SUSTAINED},
           "ground_truth": path["ground_truth"]}
    return meta, raw


def parts_live(budget_s: float) -> tuple[dict, dict]:
    """(meta, raw results) of running every part here, one after the other."""
    import torch

    meta = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
            "torch": torch.__version__, "cuda": torch.version.cuda}
    tests = gpu_tests(timeout_s=1800)
    _, sm, why = stage_memory(timeout_s=900)
    raw = {"tests": tests, "stage_memory": (sm, why),
           "overlap": _run_json([sys.executable, "scripts/gpu/bench_offload_overlap.py", "--json"], 1200),
           "copies": _run_json([sys.executable, "scripts/gpu/bench_copy_cuda.py", "--json"], 1200),
           "dropout": _run_json([sys.executable, "scripts/gpu/bench_attention_dropout.py", "--json"], 600),
           "native": megatron_native(timeout_s=600), "driver_steps": None, "driver_profile": None,
           "driver_host": None,
           "sustained": {prec: sustained_gemm(prec, seconds) for prec, seconds in SUSTAINED.items()},
           "ground_truth": None,
           "ground_truth_budget_s": budget_s}
    return meta, raw


def build_report(meta: dict, raw: dict, out_dir: str, tag: str = "") -> tuple[dict, str]:
    """The report (and its path under ``out_dir``; ``tag`` tells apart two leases of one day) from the parts' raw
    results; the ground truth's JSON is written beside it."""
    report: dict = {**meta, "missing": {}, "details": {}}
    tests = raw["tests"]
    report.update(tests_passed=None if tests is None else tests["passed"],
                  tests_failed=None if tests is None else tests["failed"])
    report["details"]["tests"] = tests
    sm, why = raw["stage_memory"]
    report["details"]["stage_memory"] = sm
    report["stage_memory_max_error"] = None if sm is None else sm["max_error"]
    if sm is None:
        report["missing"]["stage_memory_max_error"] = why
    overlap, why = raw["overlap"]
    report["details"]["offload_overlap"] = overlap
    # alpha 0.5 of the compute-bound shape, where the copies can hide (bench_offload_overlap.py's CASES; a report
    # before the cases had one shape, the copy-bound one)
    report["offload_step_time_ratio"] = None if overlap is None else next(
        r["step_time_ratio"] for r in sorted(overlap, key=lambda r: r.get("case") != "compute_bound")
        if r["alpha"] == 0.5)
    if overlap is None:
        report["missing"]["offload_step_time_ratio"] = why
    copies, why = raw["copies"]
    report["details"]["copies"] = copies
    if copies is None:
        report["missing"]["copy"] = why
        report["copy_speedup_small"] = report["copy_bandwidth_share"] = None
    else:
        report["copy_speedup_small"] = min(d["speedup_over_loop"] for d in copies["many_small"].values())
        report["copy_bandwidth_share"] = min(d["share_of_one_copy"] for name, c in copies.items()
                                             if name != "beside_gemm" for d in c.values())
    dropout, why = raw["dropout"]
    report["details"]["attention_dropout"] = dropout
    report["attention_dropout_slowdown"] = None if dropout is None else {
        name: {"fwd": r["fwd_slowdown"], "bwd": r["bwd_slowdown"]} for name, r in dropout["backends"].items()
        if r["ran"]}
    if dropout is None:
        report["missing"]["attention_dropout_slowdown"] = why
    report["details"]["megatron_native"] = raw["native"]
    report["details"]["driver_steps"] = raw["driver_steps"]
    report["details"]["driver_kernel_profile"] = raw.get("driver_profile")
    report["details"]["driver_host_dispatch"] = raw.get("driver_host")
    report["details"]["sustained_gemm"] = raw.get("sustained")
    os.makedirs(out_dir, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", meta["gpu"] + (f" {tag}" if tag else "")).strip("-").lower()
    path = os.path.join(out_dir, f"{meta['date']}-{slug}.json")
    gt_path = os.path.join(out_dir, f"{meta['date']}-{slug}-ground-truth.json")
    report["ground_truth"], why = None, "not run"
    if raw["ground_truth"] is not None and os.path.isfile(raw["ground_truth"]):
        shutil.copyfile(raw["ground_truth"], gt_path)
        report["ground_truth"] = ground_truth_summary(gt_path)
    elif raw.get("ground_truth_budget_s"):
        report["ground_truth"], why = ground_truth(gt_path, raw["ground_truth_budget_s"])
    if report["ground_truth"] is None:
        report["missing"]["ground_truth"] = why
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    return report, path


def print_table(report: dict, path: str) -> None:
    dropout = report["details"]["attention_dropout"]
    rows = [("GPU tests passed / failed", f"{report['tests_passed']} / {report['tests_failed']}", "all pass"),
            ("stage memory max error", report["stage_memory_max_error"], "<= 3%"),
            ("offload step, alpha 0.5 / 0, compute-bound", report["offload_step_time_ratio"], "<= 1.05"),
            ("batched copy vs copy_ loop, 2,000 x 64 KiB", report["copy_speedup_small"], ">= 3x"),
            ("share of one large copy (worse case)", report["copy_bandwidth_share"], ">= 0.8")]
    stated = "stated " + ("?" if dropout is None else
                          f"{dropout['stated']['fwd_slowdown']:.2f} / {dropout['stated']['bwd_slowdown']:.2f}")
    gt = report["ground_truth"]
    rows.append(("cost-model terms within 10% (ground truth)",
                 None if gt is None else f"{gt['within_10_percent']} / {gt['measured']}", "all, after the refit"))
    for name, r in (report["attention_dropout_slowdown"] or {"flash": None}).items():
        rows.append((f"attention dropout slowdown fwd / bwd ({name})",
                     None if r is None else f"{r['fwd']:.2f} / {r['bwd']:.2f}", stated))
    print(f"GPU check on {report['gpu']}, {report['date']} -> {os.path.relpath(path, ROOT)}")
    for what, value, target in rows:
        shown = "missing" if value is None else (f"{value:.3f}" if isinstance(value, float) else str(value))
        print(f"  {what:45s} {shown:>12s}   (target {target})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default=os.path.join(ROOT, "docs", "gpu-reports"))
    p.add_argument("--ground-truth-budget-s", type=float, default=420.0,
                   help="time budget of scripts/gpu/ground_truth.py (0: skip it)")
    p.add_argument("--from-parts", metavar="DIR",
                   help="write the report from the files scripts/gpu/lease_run.sh left in DIR (no GPU needed)")
    p.add_argument("--tag", default="", help="appended to the report's file name (a second lease of the same day)")
    args = p.parse_args(argv)
    if not re.fullmatch(r"[A-Za-z0-9-]*", args.tag):
        p.error(f"--tag {args.tag!r}: letters, digits and '-' only")
    meta, raw = parts_from_dir(args.from_parts) if args.from_parts else parts_live(args.ground_truth_budget_s)
    report, path = build_report(meta, raw, args.out_dir, args.tag)
    print_table(report, path)
    return 0 if report["tests_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
