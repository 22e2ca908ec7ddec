"""Megatron's --optimizer-cpu-offload priced (device and host bytes, PCIe and CPU time), the host memory limit,
and the search's memory ladder (Megatron FSDP's sharding, then optimizer offload): H3T's headline cases."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from h3t_ext.costmodel import InvalidPlanError, Plan, estimate, get_model, get_system
from h3t_ext.costmodel.memory import optimizer_shards, stage_fixed_terms, stage_host_bytes, stage_params
from h3t_ext.costmodel.optimizer_offload import step_time
from h3t_ext.planner.cli import main
from h3t_ext.planner.flags import megatron_flags, plan_from_megatron_flags
from h3t_ext.planner.search import search
from h3t_ext.planner.space import MEMORY_LADDER, SearchConstraints

GPT3 = get_model("gpt3-175b")
A100 = get_system("a100-80g")
BASE = Plan(num_gpus=64, seq_length=2048, global_batch_size=512, tensor_model_parallel_size=8,
            pipeline_model_parallel_size=4, ckpt="full", use_distributed_optimizer=True)


def test_offloaded_share_leaves_the_device_and_lands_on_the_host():
    half = replace(BASE, optimizer_cpu_offload=True, optimizer_offload_fraction=0.5)
    shard = stage_params(GPT3, BASE, 1) / optimizer_shards(BASE)
    before = stage_fixed_terms(GPT3, BASE, 1)["optimizer_states"]
    after = stage_fixed_terms(GPT3, half, 1)["optimizer_states"]
    assert before == pytest.approx(12 * shard, rel=1e-6) and after == pytest.approx(before / 2, rel=1e-6)
    host = stage_host_bytes(GPT3, half, 1)
    assert host["optimizer_states"] == pytest.approx(12 * shard / 2, rel=1e-6)  # fp32 master, m, v
    assert host["grads"] == pytest.approx(4 * shard / 2, rel=1e-6)  # the pinned fp32 gradient copy
    assert stage_host_bytes(GPT3, BASE, 1) == {"optimizer_states": 0, "grads": 0}


def test_step_pays_pcie_both_ways_and_the_cpu_adam_unless_overlapped():
    full = replace(BASE, optimizer_cpu_offload=True, optimizer_offload_fraction=1.0)
    shard = max(stage_params(GPT3, BASE, k) for k in (0, 3)) / optimizer_shards(BASE)
    t = step_time(shard, full, A100)
    pcie = A100.pcie_bandwidth * A100.efficiency("pcie_fraction")
    assert t.d2h_seconds == pytest.approx(4 * shard / pcie) and t.h2d_seconds == pytest.approx(4 * shard / pcie)
    cpu = 28 * shard / (A100.host_memory_bandwidth * A100.efficiency("host_memory_fraction") / 8)
    assert t.cpu_seconds == pytest.approx(cpu)
    base_opt = estimate(GPT3, BASE, A100, timeline=False).closed_form.optimizer
    off_opt = estimate(GPT3, full, A100, timeline=False).closed_form.optimizer
    assert off_opt > base_opt + t.cpu_seconds * 0.99  # the CPU step is not hidden; the GPU Adam of nothing is cheap
    overlapped = replace(full, overlap_cpu_optimizer_d2h_h2d=True)
    assert estimate(GPT3, overlapped, A100, timeline=False).closed_form.optimizer == pytest.approx(off_opt - t.d2h_seconds - t.h2d_seconds)


@pytest.mark.parametrize("change,named", [(dict(optimizer_offload_fraction=1.5), "optimizer_offload_fraction"),
                                          (dict(use_distributed_optimizer=False), "use_distributed_optimizer"),
                                          (dict(data_parallel_sharding_strategy="optim_grads"), "Megatron FSDP")])
def test_invalid_offload_is_one_line(change, named):
    with pytest.raises(InvalidPlanError) as e:
        estimate(GPT3, replace(BASE, optimizer_cpu_offload=True, **change), A100)
    assert named in e.value.reason and "\n" not in e.value.reason


def test_fp8_parameters_with_offload_need_the_delayed_recipe_and_the_search_never_prints_otherwise(capsys):
    """Megatron-LM 0.16-0.19 assert --fp8-recipe delayed for --optimizer-cpu-offload with --fp8-param-gather: such a
    plan is one line, and a search over FP8 parameters in another recipe leaves the offload rung out (before, its best
    plans for Llama-3 70B on 8 H100s were offload lines Megatron-LM refused to start; without them none fits)."""
    h100, llama = get_system("h100-sxm"), get_model("llama3-70b")
    fp8 = Plan(num_gpus=8, seq_length=8192, global_batch_size=128, tensor_model_parallel_size=4,
               pipeline_model_parallel_size=2, use_distributed_optimizer=True, fp8="hybrid", fp8_recipe="tensorwise",
               fp8_param_gather=True, optimizer_cpu_offload=True)
    with pytest.raises(InvalidPlanError) as e:
        estimate(llama, fp8, h100)
    assert e.value.reason == ("--optimizer-cpu-offload with --fp8-param-gather needs --fp8-recipe delayed, got "
                              "tensorwise (Megatron-LM asserts it); valid: --fp8-recipe delayed, or leave out "
                              "--fp8-param-gather")
    assert estimate(llama, replace(fp8, fp8_recipe="delayed"), h100).plan.optimizer_cpu_offload
    assert estimate(llama, replace(fp8, fp8_param_gather=False), h100).plan.optimizer_cpu_offload
    argv = ["search", "--model", "llama3-70b", "--gpu", "h100-sxm", "--num-gpus", "8", "--seq-length", "8192",
            "--global-batch-size", "128", "--fp8-format", "hybrid", "--fp8-param-gather", "--use-distributed-optimizer",
            "--top", "5", "--json"]
    assert main([*argv, "--fp8-recipe", "delayed"]) == 0  # only the offload makes 70B fit on 8 H100s
    plans = json.loads(capsys.readouterr().out)
    assert plans and all(p["optimizer_cpu_offload"] for p in plans)
    assert main([*argv, "--fp8-recipe", "tensorwise"]) == 2  # so without it nothing fits, and the reason says so
    err = capsys.readouterr().err
    assert err.startswith("h3t-plan: error: no plan fits the memory budget; closest: ") and "cpu-adam" not in err


def test_host_memory_over_its_budget_is_the_reason(capsys):
    plan = replace(BASE, optimizer_cpu_offload=True)
    fits = estimate(GPT3, plan, A100)
    assert fits.host_fits and fits.host_memory_budget_bytes == int(0.8 * A100.host_memory_bytes)
    assert fits.to_dict()["host_memory"]["terms_per_rank"] == dict(stage_host_bytes(GPT3, plan, 0)) or \
        fits.to_dict()["host_memory"]["terms_per_rank"] == dict(stage_host_bytes(GPT3, plan, 3))
    est = estimate(GPT3, plan, A100, host_memory_budget_bytes=10**9)
    assert not est.fits and est.peak_memory_bytes <= est.memory_budget_bytes
    err = est.infeasibility()
    assert err.term == "host_memory" and "host budget" in err.reason and "\n" not in err.reason
    assert est.host_bytes_per_node == 8 * est.host_bytes_per_rank
    kw = dict(num_gpus=32, seq_length=2048, global_batch_size=512, top=1,
              constraints=SearchConstraints(memory_ladder=MEMORY_LADDER))
    starved = search(GPT3, A100, host_memory_budget_bytes=10**9, **kw)  # optimizer offload is what fits 32 GPUs
    assert starved.plans == () and starved.rejected["memory: host_memory over budget"] > 0
    assert search(GPT3, A100, **kw).plans


def test_offload_flags_round_trip():
    plan = replace(BASE, optimizer_cpu_offload=True, optimizer_offload_fraction=0.35,
                   overlap_cpu_optimizer_d2h_h2d=True)
    flags = megatron_flags(plan)
    assert flags.count("--optimizer-cpu-offload") == 1 and "--use-precision-aware-optimizer" in flags
    assert plan_from_megatron_flags(flags, num_gpus=64, seq_length=2048) == plan


def test_bad_fraction_flag_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["estimate", "--model", "gpt3-175b", "--num-gpus", "64", "--seq-length", "2048",
              "--global-batch-size", "512", "--optimizer-offload-fraction", "nan"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--optimizer-offload-fraction" in err and "[0, 1]" in err


@pytest.mark.parametrize("gpu,num_gpus", [("a100-40g", 64), ("a100-80g", 32)])
def test_h3ts_headline_fits_only_through_the_memory_ladder(gpu, num_gpus):
    """GPT-3 175B, seq 2048, global batch 512 (H3T, NeurIPS '23): on 64 A100-40G and on 32 A100-80G the
    distributed optimizer alone leaves no plan that fits; sharding and optimizer offload find some."""
    system = get_system(gpu)
    kw = dict(num_gpus=num_gpus, seq_length=2048, global_batch_size=512, top=3)
    assert search(GPT3, system, **kw).plans == ()
    found = search(GPT3, system, constraints=SearchConstraints(memory_ladder=MEMORY_LADDER), **kw)
    assert found.plans
    for r in found.plans[:3]:
        est = r.evaluation.estimate
        assert est.fits and (r.plan.optimizer_cpu_offload or r.plan.data_parallel_sharding_strategy)
        assert est.peak_memory_bytes <= est.memory_budget_bytes and est.host_fits


def test_no_plan_says_term_by_term_why(capsys):
    """Llama-3 70B at 128K tokens on 4 H100: nothing fits (bf16 weights and fp32 gradients alone are 106 GB a GPU at
    t = 4); the message lists the closest plan's memory terms."""
    code = main(["search", "--model", "llama3-70b", "--num-gpus", "4", "--gpu", "h100-sxm", "--seq-length", "131072",
                 "--global-batch-size", "8"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "its terms: " in err and "weights" in err and "grads" in err


TINY_LLAMA = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                  vocab_size=512, swiglu=True, untie_embeddings_and_output_weights=True)
"""tests/driver_harness.py's TINY_MODEL as the driver builds it (vocabulary padded to 512)."""


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_state_bytes_are_what_the_driver_measures(fraction):
    """The cost model's state bytes of one rank (CPU stand-in precision: fp32 parameters, no separate master)
    against the bytes the driver measures from its tensors (tests/integration/test_optimizer_offload_driver.py asserts the
    measurement equals ``_expected``), within 1% per kind and side; at d=1, where both shard nothing."""
    from h3t_ext.costmodel import ModelSpec
    from h3t_ext.costmodel.memory import stage_state_bytes
    from state_bytes_harness import expected_state_bytes

    model = ModelSpec(name="tiny", **TINY_LLAMA)
    plan = Plan(num_gpus=1, seq_length=64, global_batch_size=4, use_distributed_optimizer=True,
                optimizer_cpu_offload=fraction > 0, optimizer_offload_fraction=fraction or 1.0)
    assert stage_params(model, plan, 0) == 213_568  # the driver's parameter count of this model
    predicted = stage_state_bytes(model, plan, 0, param_bytes=4, master_weights=False)
    measured = expected_state_bytes(1, fraction)[0]
    # megatron-core's split offloads whole tensors (the shortest prefix holding F of the elements): off F in
    # {0, 1} the measurement is off the model's F * n by up to one tensor, here the 512 x 64 embedding (8 bytes
    # of moments and master or gradient per element); Adam's step counts are 4 bytes per tensor.
    granularity = 0 if fraction in (0.0, 1.0) else 512 * 64 * 16
    steps = 4 * 28
    for side in ("device", "host"):
        for kind in ("params", "grads", "optimizer"):
            want, got = measured[side][kind], predicted[side][kind]
            assert abs(got - want) <= 0.01 * want + granularity + steps, (side, kind, got, want)
