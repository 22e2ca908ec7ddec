"""Published training runs as (model, plan, system, measured tokens/s per GPU), one list per source.

Sources (copies under ``data/reference``): ``atc24_65b`` (the ATC '24 Llama-65B throughput table, H800),
``megatron_h100`` (Megatron-LM's H100 weak-scaling table), ``korthikanti`` (Korthikanti et al. 2022,
A100) and ``nemo_fp8_h100`` (NeMo 24.07's FP8 pre-training table, DGX-H100). How each row becomes a Plan, and which settings the sources leave unstated and are assumed, is in
``data/reference/run_settings.json``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from h3t_ext.costmodel.plan import Plan
from h3t_ext.costmodel.plan_checks import applicable_switches
from h3t_ext.costmodel.specs import REFERENCE_DIR  # noqa: F401 (re-exported: its readers import it from here)
from h3t_ext.costmodel.specs import ModelSpec, SystemSpec, get_model, get_system, reference_json

SOURCES = ("atc24_65b", "megatron_h100", "korthikanti", "nemo_fp8_h100")
"""The held-out-checked sources of the leave-one-source-out test."""
TRAINING_ONLY = ("atc24_demo7b",)
"""Runs used for fitting only: the ATC '24 7B demo (A800 and H800, the only Ampere runs besides Korthikanti)."""
MEGATRON_VOCAB = 131072
KORTHIKANTI_VOCAB, KORTHIKANTI_SEQ = 51200, 2048


@dataclass(frozen=True)
class PublishedRun:
    """One measured run."""

    source: str
    label: str
    model: ModelSpec
    plan: Plan
    system: SystemSpec
    tokens_per_s_per_gpu: float
    memory_budget_bytes: Optional[int] = None
    """The run's own memory budget when the source planned against one (ATC '24), else None (the GPU's)."""


def settings() -> dict:
    """``run_settings.json``: stated and assumed settings per source."""
    return reference_json("run_settings.json")


def stated_switches(plan: dict, tensor_model_parallel_size: int) -> dict:
    """A source's stated run switches (``run_settings.json`` ``plan``) for one of its runs: ``tp_comm_overlap`` only
    where t > 1 (a source that states --tp-comm-overlap for its runs means its tensor-parallel ones:
    :func:`~h3t_ext.costmodel.plan_checks.applicable_switches`)."""
    return applicable_switches(plan, tensor_model_parallel_size)


def _gpt(label: str, heads: int, hidden: int, layers: int, vocab: int, settings: dict) -> ModelSpec:
    """A GPT-3 style model of a source; its dropout comes from the source's ``model`` settings."""
    return ModelSpec(name=label, num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                     num_query_groups=heads, ffn_hidden_size=4 * hidden, vocab_size=vocab, swiglu=False,
                     untie_embeddings_and_output_weights=False, **settings["model"])


def megatron_flops_per_token(model: ModelSpec, seq_length: int) -> float:
    """Megatron-LM's training FLOPs per token (training.py num_floating_point_operations): 12 L h^2 (1 +
    g/a + s/h + f/h + V_pad/(2 L h)) with non-causal attention and the vocabulary padded to 128."""
    L, h = model.num_layers, model.hidden_size
    ratio = model.num_query_groups / model.num_attention_heads
    return 12 * L * h * h * (1 + ratio + seq_length / h + model.ffn_hidden_size / h
                             + model.padded_vocab_size(1) / (2 * L * h))


def _atc24() -> list[PublishedRun]:
    ref = reference_json("atc24_calibration.json")
    cfg = settings()["sources"]["atc24_65b"]
    model = ModelSpec(name="llama-65b", **ref["models"]["llama-65b"])
    system = get_system(cfg["system"])
    runs = []
    for r in ref["throughput_table"]:
        plan = Plan(num_gpus=int(r["num_gpus"]), seq_length=int(r["seq_length"]), global_batch_size=int(r["global_batch"]),
                    tensor_model_parallel_size=int(r["t"]), context_parallel_size=int(r["c"]),
                    pipeline_model_parallel_size=int(r["p"]), num_layers_per_virtual_pipeline_stage=int(r["l"]),
                    ckpt=r["ckpt"], offload_alpha=float(r["alpha"]), **stated_switches(cfg["plan"], int(r["t"])))
        label = f"65B {r['num_gpus']} GPUs t{r['t']} p{r['p']} {r['ckpt']}"
        runs.append(PublishedRun("atc24_65b", label, model, plan, system,
                                 float(r["tokens_per_s"]) / int(r["num_gpus"]), cfg["memory_budget_bytes"]))
    return runs


def _demo7b() -> list[PublishedRun]:
    ref = reference_json("atc24_calibration.json")
    cfg = settings()["sources"]["atc24_65b"]
    model = ModelSpec(name="llama-7b", **ref["models"]["llama-7b"])
    runs = []
    for r in ref["demo7b"]:
        if r["method"] == "origin-megatron":  # stock Megatron's recompute path, not the plan's runtime
            continue
        plan = Plan(num_gpus=r["num_gpus"], seq_length=r["seq_length"], global_batch_size=r["global_batch_size"],
                    tensor_model_parallel_size=r["t"], context_parallel_size=r["c"], pipeline_model_parallel_size=r["p"],
                    num_layers_per_virtual_pipeline_stage=r["l"], ckpt=r["ckpt"], offload_alpha=float(r["alpha"]),
                    **stated_switches(cfg["plan"], r["t"]))
        runs.append(PublishedRun("atc24_demo7b", f"7B demo {r['gpu']} {r['method']}", model, plan,
                                 get_system(r["gpu"]), float(r["tokens_per_s_per_gpu"]), cfg["memory_budget_bytes"]))
    return runs


def _megatron() -> list[PublishedRun]:
    cfg = settings()["sources"]["megatron_h100"]
    system = get_system(cfg["system"])
    runs = []
    for row in reference_json("external_calibration.json")["rows"]:
        if row["source"] != "megatron_h100":
            continue
        r = row["published"]
        model = _gpt(f"gpt-{r['model_size'].lower()}", r["attention_heads"], r["hidden_size"], r["num_layers"],
                     MEGATRON_VOCAB, cfg)
        # one microbatch per replica without a pipeline, one sample per microbatch with one (run_settings.json)
        mb = r["batch_size"] // r["dp"] if r["pp"] == 1 else 1
        switches = {k: v for k, v in stated_switches(cfg["plan"], r["tp"]).items() if k != "micro_batch_size"}
        plan = Plan(num_gpus=r["num_gpus"], seq_length=4096, global_batch_size=r["batch_size"], micro_batch_size=mb,
                    tensor_model_parallel_size=r["tp"], pipeline_model_parallel_size=r["pp"],
                    num_layers_per_virtual_pipeline_stage=cfg["num_layers_per_virtual_pipeline_stage"].get(r["model_size"]),
                    **switches)
        tokens = r["per_gpu_tflops"] * 1e12 / megatron_flops_per_token(model, 4096)
        runs.append(PublishedRun("megatron_h100", f"{r['model_size']} {r['num_gpus']} GPUs", model, plan, system, tokens))
    return runs


def _korthikanti() -> list[PublishedRun]:
    cfg = settings()["sources"]["korthikanti"]
    system = get_system(cfg["system"])
    runs = []
    for row in reference_json("external_calibration.json")["rows"]:
        if row["source"] != "korthikanti":
            continue
        r = row["published"]
        model = _gpt(f"gpt-{r['model_size'].split()[0].lower()}", r["attention_heads"], r["hidden_size"],
                     r["num_layers"], KORTHIKANTI_VOCAB, cfg)
        base = Plan(num_gpus=r["num_gpus"], seq_length=KORTHIKANTI_SEQ, global_batch_size=r["global_batch"],
                    micro_batch_size=r["micro_batch"], tensor_model_parallel_size=r["tp"],
                    pipeline_model_parallel_size=r["pp"],
                    num_layers_per_virtual_pipeline_stage=cfg["num_layers_per_virtual_pipeline_stage"].get(r["model_size"]),
                    **cfg["plan"])
        present = r["iter_time_present_work_s"]
        if "iter_time_full_recompute_s" in r:
            full = r["iter_time_full_recompute_s"]
        else:  # 2240 GPUs: same work at the published full-recompute MFU
            full = present * float(r["mfu_present"].rstrip("%")) / float(r["mfu_full_recompute"].rstrip("%"))
        tokens = r["global_batch"] * KORTHIKANTI_SEQ / r["num_gpus"]
        for mode, seconds, plan in (("selective+SP", present, replace(base, ckpt="selective", sequence_parallel=True)),
                                    ("full", full, replace(base, ckpt="full", sequence_parallel=False))):
            runs.append(PublishedRun("korthikanti", f"{r['model_size']} {r['num_gpus']} GPUs {mode}", model, plan,
                                     system, tokens / seconds))
    return runs


def _nemo_fp8() -> list[PublishedRun]:
    """NeMo 24.07's FP8 rows whose model has a shape here (run_settings.json: models); VP chunks per rank
    become l = L / (p * VP), VP = 1 plain 1F1B; t > 1 runs sequence parallel with TP comm overlap."""
    cfg = settings()["sources"]["nemo_fp8_h100"]
    system = get_system(cfg["system"])
    runs = []
    for r in reference_json(cfg["file"])["rows"]:
        name = cfg["models"].get(r["model"])
        if name is None:
            continue
        model = replace(get_model(name), name=name, vocab_size=cfg["vocab_size"][r["model"]], **cfg["model"])
        t, p, vp = r["tp"], r["pp"], r["vp"]
        plan = Plan(num_gpus=r["num_gpus"], seq_length=r["seq_length"], global_batch_size=r["global_batch_size"],
                    micro_batch_size=r["micro_batch_size"], tensor_model_parallel_size=t,
                    context_parallel_size=r["cp"], pipeline_model_parallel_size=p,
                    num_layers_per_virtual_pipeline_stage=model.num_layers // (p * vp) if vp > 1 else None,
                    sequence_parallel=t > 1, tp_comm_overlap=t > 1, **cfg["plan"])
        runs.append(PublishedRun("nemo_fp8_h100", f"{r['model']} {r['num_gpus']} GPUs t{t} p{p} c{r['cp']} v{vp}",
                                 model, plan, system, float(r["tokens_per_s_per_gpu"])))
    return runs


def atc24_memory_budget_bytes() -> int:
    """The memory budget the ATC '24 runs planned their alphas against (run_settings.json)."""
    return int(settings()["sources"]["atc24_65b"]["memory_budget_bytes"])


def published_runs(source: str | None = None) -> list[PublishedRun]:
    """The runs of one source (or all of them)."""
    loaders = {"atc24_65b": _atc24, "megatron_h100": _megatron, "korthikanti": _korthikanti,
               "atc24_demo7b": _demo7b, "nemo_fp8_h100": _nemo_fp8}
    if source is not None and source not in loaders:
        raise ValueError(f"source must be one of {', '.join(loaders)}, got {source!r}")
    names = SOURCES + TRAINING_ONLY if source is None else (source,)
    return [run for name in names for run in loaders[name]()]
