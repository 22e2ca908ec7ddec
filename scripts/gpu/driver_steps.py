#!/usr/bin/env python3
"""Training steps of ~1B and ~3B Llama and GPT models through the driver on one GPU (t = p = 1), measured.

Each case runs ``pretrain_llama.py`` or ``pretrain_gpt.py`` (the h3t-ext driver, megatron-core 0.16.1) with
``--mock-data`` for ``--iters`` iterations and records the median ``elapsed_ms`` of the iterations after the
first two (``--metrics-json``) and the last logged ``max memory (MB)`` (``torch.cuda.max_memory_allocated``). The
cost model's figures for the same runs come from ``h3t-plan estimate`` with the same flags (``--compare``, on
any machine: the local layer spec the driver ran, no TransformerEngine).

``--profile`` runs each case under ``torch.profiler`` instead (``groundtruth/kernel_profile.py``): its GPU time per
iteration by kernel kind, which ``--compare`` prints beside the cost model's GEMM, attention, element-wise,
recompute, output-layer, optimizer and offload seconds for the same run.

``--host`` runs each case at narrow widths instead (:data:`HOST_WIDTHS`: the same layers, sequence, microbatches,
ckpt and alpha, so the same kernels and autograd nodes, each a few microseconds of GPU work): its step time is the
host's time to dispatch the case's iteration, which ``--compare`` prints beside the case's step. The eager local
stack's steps ran 1.4-1.8x the model's GPU-bound estimate with a third of the step not GPU time (second and third
leases); this measures the other side of that, on the GPU machine's own host.

  python scripts/gpu/driver_steps.py [--json PATH] [--iters 6] [--only NAME ...] [--profile | --host]  # on the GPU
  python scripts/gpu/driver_steps.py --dry-run [--profile | --host]                        # the commands
  python scripts/gpu/driver_steps.py --compare PATH [--gpu h200]                           # beside estimate
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # groundtruth/ (the clock sampler)

LLAMA_1B = ["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "32", "--group-query-attention",
            "--num-query-groups", "8", "--ffn-hidden-size", "8192", "--vocab-size", "32000"]
LLAMA_3B = ["--num-layers", "28", "--hidden-size", "3072", "--num-attention-heads", "24", "--group-query-attention",
            "--num-query-groups", "8", "--ffn-hidden-size", "8192", "--vocab-size", "32000"]
GPT_1B = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--vocab-size", "50304"]
GPT_3B = ["--num-layers", "32", "--hidden-size", "2560", "--num-attention-heads", "32", "--vocab-size", "50304"]
COMMON = ["--seq-length", "2048", "--max-position-embeddings", "2048", "--micro-batch-size", "2",
          "--global-batch-size", "16", "--bf16", "--use-distributed-optimizer", "--lr", "1e-4", "--mock-data",
          "--tokenizer-type", "NullTokenizer", "--log-interval", "1", "--eval-iters", "0", "--seed", "1234"]
CASES = [  # (name, entry, model flags, ckpt, alpha): the first of each model is its reference
    ("llama-1b/no/0", "pretrain_llama.py", LLAMA_1B, "no", "0"),
    ("llama-1b/ours/0", "pretrain_llama.py", LLAMA_1B, "ours", "0"),
    ("llama-1b/ours/0.5", "pretrain_llama.py", LLAMA_1B, "ours", "0.5"),
    ("llama-1b/ours/1", "pretrain_llama.py", LLAMA_1B, "ours", "1"),
    ("llama-1b/full/0", "pretrain_llama.py", LLAMA_1B, "full", "0"),
    ("gpt-1b/no/0", "pretrain_gpt.py", GPT_1B, "no", "0"),
    ("gpt-1b/ours/0.5", "pretrain_gpt.py", GPT_1B, "ours", "0.5"),
    ("llama-3b/no/0", "pretrain_llama.py", LLAMA_3B, "no", "0"),
    ("llama-3b/ours/0.5", "pretrain_llama.py", LLAMA_3B, "ours", "0.5"),
    ("gpt-3b/ours/0", "pretrain_gpt.py", GPT_3B, "ours", "0"),
]
MEMORY = re.compile(r"max memory \(MB\): ([0-9.]+)")
HOST_WIDTHS = {"--hidden-size": "64", "--ffn-hidden-size": "128", "--num-attention-heads": "4",
               "--num-query-groups": "2", "--vocab-size": "256"}
"""``--host``'s widths: every GEMM, attention and element-wise kernel of a case a few microseconds on the GPU (4 heads
of 16, 2 query groups where the case has groups), its saved tensors still over the offload's minimum size (the
sequence and micro batch are the case's), so its iteration dispatches what the case's does."""


def host_case(case):
    """``case`` at :data:`HOST_WIDTHS` (the same name, entry, layers, ckpt and alpha)."""
    name, entry, model, ckpt, alpha = case
    narrow = list(model)
    for i, flag in enumerate(narrow[:-1]):
        if flag in HOST_WIDTHS:
            narrow[i + 1] = HOST_WIDTHS[flag]
    return name, entry, narrow, ckpt, alpha


def command(case, iters: int, metrics: str) -> list[str]:
    name, entry, model, ckpt, alpha = case
    return [sys.executable, os.path.join(ROOT, entry), *model, *COMMON, "--train-iters", str(iters), "--ckpt", ckpt,
            "--offload-alpha", alpha, "--metrics-json", metrics]


def _run(case, cmd: list[str], wanted: str, timeout_s: float):
    """(the finished process, None), or (None, the case's failed row) when ``cmd`` timed out, failed or left no
    ``wanted`` file."""
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, {"case": case[0], "status": "failed", "why": f"did not finish within {timeout_s:g}s"}
    if proc.returncode != 0 or not os.path.isfile(wanted):
        return None, {"case": case[0], "status": "failed", "why": failure_line(proc.stderr, proc.stdout)[-400:]}
    return proc, None


FAILURE = re.compile(r"\b\w*(Error|Exception|error:)|Killed|out of memory")


def failure_line(stderr: str, stdout: str) -> str:
    """The line of a failed run that says why: the last one naming an error (a rank's last stderr line is often a
    NCCL shutdown warning, printed after the error), else the last line."""
    lines = stderr.strip().splitlines() or stdout.strip().splitlines() or ["?"]
    named = [ln for ln in lines if FAILURE.search(ln) and "Warning" not in ln]
    return (named or lines)[-1]


def measure(case, iters: int, timeout_s: float) -> dict:
    from groundtruth.clocks import Sampler

    with tempfile.TemporaryDirectory() as tmp, Sampler() as clocks:
        metrics = os.path.join(tmp, "m.json")
        proc, failed = _run(case, command(case, iters, metrics), metrics, timeout_s)
        if failed:
            return failed
        with open(metrics) as f:
            recs = json.load(f)["iterations"]
    memory = MEMORY.findall(proc.stdout)
    times = [r["elapsed_ms"] for r in recs[2:]] or [r["elapsed_ms"] for r in recs]
    return {"case": case[0], "status": "measured", "step_time_ms": statistics.median(times),
            "step_times_ms": [r["elapsed_ms"] for r in recs], "losses": [r["loss"] for r in recs],
            "max_memory_allocated_mib": float(memory[-1]) if memory else None,
            "clocks": clocks.record(with_samples=False)}


KERNEL_PROFILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "groundtruth", "kernel_profile.py")


def profile_command(case, iters: int, metrics: str, out: str) -> list[str]:
    """``command`` run under the kernel profiler, which writes its per-kind table to ``out``."""
    return [sys.executable, KERNEL_PROFILE, "--iterations", str(iters), "--json", out, "--",
            *command(case, iters, metrics)[1:]]


def profile_case(case, iters: int, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "k.json")
        _, failed = _run(case, profile_command(case, iters, os.path.join(tmp, "m.json"), out), out, timeout_s)
        if failed:
            return failed
        with open(out) as f:
            return {"case": case[0], "status": "profiled", "kernels": json.load(f)}


def model_kinds_ms(case, gpu: str) -> dict:
    """The cost model's seconds of one iteration of ``case`` by the kinds a kernel profile sees, in ms: the layers'
    GEMMs, attention and element-wise kernels (forward and backward), their recompute, the output layer and loss,
    the optimizer step and the exposed offload copies."""
    from h3t_ext.costmodel.estimate import estimate
    from h3t_ext.costmodel.kernels import kernel_rates
    from h3t_ext.costmodel.timing import attention_seconds, layer_gemm_seconds, layer_time, shape_times
    from h3t_ext.planner.args import build_parser
    from h3t_ext.planner.from_args import model_from_args, plan_from_args, system_from_args

    ns = build_parser().parse_args(estimate_flags(case, gpu))
    model, system = model_from_args(ns), system_from_args(ns)
    plan = plan_from_args(ns, model=model)
    rates = kernel_rates(system)
    g, a = layer_gemm_seconds(model, plan, rates), attention_seconds(model, plan, system, rates)
    layer, head = layer_time(model, plan, system), shape_times(model, plan, system).head
    terms = estimate(model, plan, system).time_terms
    per_layers = plan.num_microbatches * model.num_layers * 1e3
    gemm, attn = g["fwd"] + g["dgrad"] + g["wgrad"], a["fwd"] + a["bwd"]
    return {"gemm": per_layers * gemm, "attention": per_layers * attn,
            "elementwise": per_layers * (layer.fwd + layer.bwd - gemm - attn),
            "recompute": per_layers * layer.recompute, "output_layer": plan.num_microbatches * head.total * 1e3,
            "optimizer": terms.optimizer * 1e3, "offload_exposed": terms.offload_exposed * 1e3}


def estimate_flags(case, gpu: str) -> list[str]:
    """``h3t-plan estimate`` flags of one case: its model (Llama: SwiGLU, untied, no biases; GPT: Megatron's
    pretrain_gpt.py defaults), one GPU, its batch, ckpt and alpha, the local layer spec the driver ran and torch's
    AdamW (megatron-core's optimizer without TransformerEngine and apex, as on the GPU machine)."""
    name, entry, model, ckpt, alpha = case
    shape = [a for a in model if a != "--group-query-attention"]
    arch = ([] if entry == "pretrain_gpt.py" else
            ["--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear"])
    return ["estimate", *shape, *arch, "--seq-length", "2048", "--micro-batch-size", "2", "--global-batch-size", "16",
            "--num-gpus", "1", "--gpu", gpu, "--ckpt", ckpt, "--offload-alpha", alpha, "--transformer-impl", "local",
            "--optimizer-impl", "torch", "--json"]


def compare(path: str, gpu: str) -> list[dict]:
    """Each measured row of a driver_steps.py JSON beside ``h3t-plan estimate`` for the same run."""
    from h3t_ext.planner.cli import main as plan_main
    import contextlib
    import io

    with open(path) as f:
        doc = json.load(f)
    by_name = {c[0]: c for c in CASES}
    out = []
    for r in doc["rows"]:
        if r.get("status") == "profiled" and r["case"] in by_name:
            out.append({"case": r["case"], "kernels_ms": r["kernels"]["by_kind_ms_per_iteration"],
                        "model_ms": model_kinds_ms(by_name[r["case"]], gpu)})
            continue
        if r.get("status") == "host" and r["case"] in by_name:
            out.append({"case": r["case"], "host_ms": r["step_time_ms"]})
            continue
        if r.get("status") != "measured" or r["case"] not in by_name:
            continue
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            plan_main(estimate_flags(by_name[r["case"]], gpu))
        est = json.loads(buf.getvalue())
        measured_gib = r["max_memory_allocated_mib"] / 1024 if r["max_memory_allocated_mib"] else None
        out.append({"case": r["case"], "step_ms": r["step_time_ms"], "estimate_ms": 1e3 * est["iteration_time_s"],
                    "peak_gib": measured_gib, "estimate_gib": est["peak_memory_bytes"] / 2**30})
    return out


def main(argv=None) -> int:
    from h3t_training.config.arguments import OneLineParser

    p = OneLineParser(prog="driver_steps.py", description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--timeout-s", type=float, default=180.0, help="limit of one case")
    p.add_argument("--only", nargs="*", default=None, help="case names to run (default: all)")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--compare", metavar="PATH", help="a driver_steps.py JSON: print it beside h3t-plan estimate")
    p.add_argument("--gpu", default="h200", help="the system file of --compare's estimate")
    p.add_argument("--profile", action="store_true", help="run each case under torch.profiler: its kernels by kind")
    p.add_argument("--host", action="store_true",
                   help="run each case at narrow widths: its step time is the host's dispatch of the iteration")
    args = p.parse_args(argv)
    if args.profile and args.host:
        p.error("--profile and --host are two runs of a case: give one")
    if args.compare:
        for r in compare(args.compare, args.gpu):
            if "host_ms" in r:
                print(f"{r['case']:20s} host (narrow widths) {r['host_ms']:8.1f} ms")
                continue
            if "kernels_ms" in r:
                kernels = ", ".join(f"{k} {v:.1f}" for k, v in r["kernels_ms"].items())
                model = ", ".join(f"{k} {v:.1f}" for k, v in r["model_ms"].items())
                print(f"{r['case']:20s} kernels (ms/iteration): {kernels}\n{'':20s} model: {model}")
                continue
            gib = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
            print(f"{r['case']:20s} step {r['step_ms']:8.1f} ms, estimate {r['estimate_ms']:8.1f} ms | peak {gib} GiB, "
                  f"estimate {r['estimate_gib']:.2f} GiB")
        return 0
    if args.iters < 3:
        p.error(f"--iters must be >= 3 (the first two are warm-up), got {args.iters}")
    names = [c[0] for c in CASES]
    if args.only is not None and set(args.only) - set(names):
        p.error(f"--only: unknown case {sorted(set(args.only) - set(names))[0]} (valid: {', '.join(names)})")
    cases = [c for c in CASES if args.only is None or c[0] in args.only]
    if args.host:
        cases = [host_case(c) for c in cases]
    if args.dry_run:
        for c in cases:
            cmd = profile_command(c, args.iters, "M.json", "K.json") if args.profile else command(c, args.iters, "M.json")
            print(c[0] + ": " + " ".join(cmd[1:]))
        return 0
    import torch

    if not torch.cuda.is_available():
        p.error("no CUDA GPU (use --dry-run to list the commands)")
    rows = []
    for c in cases:
        rows.append(profile_case(c, args.iters, args.timeout_s) if args.profile else measure(c, args.iters,
                                                                                              args.timeout_s))
        r = rows[-1]
        if args.host and r["status"] == "measured":
            r["status"], r["widths"] = "host", dict(HOST_WIDTHS)
        if r["status"] == "profiled":
            kinds = r["kernels"]["by_kind_ms_per_iteration"]
            print(f"{r['case']:20s} kernels {r['kernels']['total_ms_per_iteration']:.1f} ms/iteration: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in kinds.items()), flush=True)
            continue
        print(f"{r['case']:20s} " + (f"{r['step_time_ms']:9.1f} ms  {r['max_memory_allocated_mib']} MiB"
                                     if r["status"] == "measured" else f"failed: {r['why']}"), flush=True)
    doc = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "iters": args.iters, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
