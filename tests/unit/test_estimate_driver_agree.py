"""One flag line, two readers: ``h3t-plan estimate`` and the training driver (its prediction of the run it launches,
``run_spec.run_plan`` on a faked GPU with TransformerEngine) price the same plan, to the byte and the token, for the
layout, recompute, offload, FP8, fusion, optimizer-offload and FSDP flags both take. The model is spelled out (the
driver's ``pretrain_llama.py`` and ``h3t-plan``'s custom shape share their defaults, but the planner's own defaults
for sequence parallelism and the distributed optimizer are said with ``--no-...``, as its help says)."""
from __future__ import annotations

import json

import pytest

from h3t_ext.costmodel import get_system
from h3t_ext.costmodel.estimate import estimate
from h3t_ext.planner.cli import main as plan_main
from h3t_ext.planner.units import parse_bytes
from h3t_training.config.run_spec import model_spec, run_plan
from h3t_training.config.sections import parse_args
from parse_harness import fake_device

MODEL = ["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "16", "--group-query-attention",
         "--num-query-groups", "8", "--ffn-hidden-size", "6144", "--seq-length", "4096", "--max-position-embeddings",
         "4096", "--global-batch-size", "128", "--swiglu", "--untie-embeddings-and-output-weights",
         "--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--attention-dropout", "0", "--hidden-dropout", "0", "--bf16"]
DRIVER = ["--train-iters", "1", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
          "32000"]
PLANNER_VOCAB = ["--vocab-size", "32001"]  # NullTokenizer's vocabulary: --vocab-size and its end-of-document token

LINES = [
    # (GPU, world size, flags)
    ("h100-sxm", 16, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel",
                      "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]),
    ("h100-sxm", 16, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4",
                      "--num-layers-per-virtual-pipeline-stage", "2", "--micro-batch-size", "2"]),
    ("h800", 16, ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4", "--ckpt", "ours",
                  "--offload-alpha", "0.5", "--use-distributed-optimizer"]),
    ("h800", 8, ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--ckpt", "full",
                 "--offload-alpha", "0.5"]),
    ("h100-sxm", 16, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                      "--context-parallel-size", "2", "--sequence-parallel", "--recompute-granularity", "selective",
                      "--recompute-modules", "core_attn", "mlp"]),
    ("h100-sxm", 8, ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
                     "--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"]),
    ("h100-sxm", 8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1", "--sequence-parallel",
                     "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-param-gather",
                     "--use-distributed-optimizer"]),
    ("b200", 8, ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--fp8-format", "e4m3",
                 "--fp8-recipe", "mxfp8", "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"]),
    ("h800", 8, ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
                 "--attention-backend", "unfused", "--no-bias-swiglu-fusion", "--grad-reduce-in-bf16",
                 "--use-distributed-optimizer"]),
    ("h800", 8, ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                 "--use-distributed-optimizer", "--optimizer-cpu-offload", "--use-precision-aware-optimizer",
                 "--optimizer-offload-fraction", "0.5"]),
    ("gb200", 16, ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
                   "--use-distributed-optimizer", "--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                   "optim_grads_params", "--ckpt-format", "fsdp_dtensor"]),
    ("h100-sxm", 16, ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4",
                      "--fine-grained-activation-offloading", "--offload-modules", "core_attn",
                      "--use-distributed-optimizer"]),
]


def _planner(gpu, world, flags, capsys) -> dict:
    on = set(flags)
    extra = ([] if "--sequence-parallel" in on else ["--no-sequence-parallel"]) + \
        ([] if "--use-distributed-optimizer" in on else ["--no-use-distributed-optimizer"])
    capsys.readouterr()
    assert plan_main(["estimate", "--gpu", gpu, "--num-gpus", str(world), *MODEL, *PLANNER_VOCAB, *flags, *extra,
                      "--optimizer-impl", "torch", "--json"]) == 0  # the Adam megatron-core falls back to here
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("gpu, world, flags", LINES, ids=[f"{g}-{w}-{i}" for i, (g, w, _) in enumerate(LINES)])
def test_estimate_and_the_driver_price_one_flag_line_alike(monkeypatch, capsys, gpu, world, flags):
    fake_device(monkeypatch, gpu=True, te=True, capability=10.0 if "b200" in gpu else 9.0)
    if "--use-megatron-fsdp" not in flags and gpu not in ("b200", "gb200"):
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # what Hopper's tensor parallelism needs
    config = parse_args([*MODEL, "--gpu", gpu, *flags, *DRIVER], world_size=world)
    plan = run_plan(config, offload_alpha=config.offload_alpha, on_gpu=True)
    driver = estimate(model_spec(config, config.tokenizer_vocab_size), plan, get_system(gpu))
    planner = _planner(gpu, world, flags, capsys)
    assert planner["peak_memory_bytes"] == driver.peak_memory_bytes
    assert planner["tokens_per_second"] == pytest.approx(driver.tokens_per_second, rel=1e-12)
    assert planner["offload_alpha"] == pytest.approx(float(plan.offload_alpha), abs=1e-12)


@pytest.mark.parametrize("gpu, world, budget", [("h100-sxm", 16, None), ("h800", 8, "30GB"), ("b200", 8, None)])
def test_searched_plans_launched_through_the_driver_are_the_plans_priced(monkeypatch, capsys, gpu, world, budget):
    """Each of ``h3t-plan search``'s plans, its printed flags and launch environment given to the driver, is the
    run the search priced (a tight budget brings in its memory ladder: optimizer offload, activation offload), on the
    timeline or, where its JSON says so, by the closed form."""
    fake_device(monkeypatch, gpu=True, te=True, capability=10.0 if "b200" in gpu else 9.0)
    capsys.readouterr()
    assert plan_main(["search", "--gpu", gpu, "--num-gpus", str(world), *MODEL, *PLANNER_VOCAB, "--optimizer-impl",
                      "torch", "--top", "5", *(["--memory-budget", budget] if budget else []), "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert len(plans) == 5
    for p in plans:
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
        for word in p["launch_env"]:
            monkeypatch.setenv(*word.split("=", 1))
        config = parse_args([*MODEL, "--gpu", gpu, *p["megatron_flags"], *DRIVER], world_size=world)
        plan = run_plan(config, offload_alpha=config.offload_alpha, on_gpu=True)
        # a row the search priced by the closed form (after its best, timeline-priced ones) says so
        driver = estimate(model_spec(config, config.tokenizer_vocab_size), plan, get_system(gpu),
                          memory_budget_bytes=None if budget is None else parse_bytes(budget),
                          timeline=p["priced_on_timeline"])
        assert p["peak_memory_bytes"] == driver.peak_memory_bytes and driver.fits
        assert p["tokens_per_second"] == pytest.approx(driver.tokens_per_second, rel=1e-12)
    assert plans[0]["priced_on_timeline"]


def test_the_search_table_marks_the_rows_priced_by_the_closed_form(capsys):
    argv = ["search", "--gpu", "h800", "--num-gpus", "8", *MODEL, *PLANNER_VOCAB, "--memory-budget", "30GB", "--top", "5"]
    capsys.readouterr()
    assert plan_main([*argv, "--json"]) == 0
    closed = [not p["priced_on_timeline"] for p in json.loads(capsys.readouterr().out)]
    assert any(closed) and not closed[0]
    assert plan_main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("│")]
    assert [("~" in row) for row in rows] == closed
