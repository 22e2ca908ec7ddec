"""The activation manager inside the h3t pipeline executor: 4 gloo ranks, cpu-thread device layer."""
from __future__ import annotations

import pytest

from h3t_ext.testing import run_distributed
from gpt_harness import (
    NUM_MICROBATCHES,
    SEQ,
    MBS,
    build_stage,
    compare_grads,
    forward_step_func,
    init_parallel,
    load_reference,
    make_batches,
    model_config,
    reference_run,
)

PP, TOL = 4, 2e-6


def _reference_worker(rank, world):
    return reference_run(seed=0)


def _worker(rank, world, v, ref):
    from h3t_ext.runtime.memory.activations import ActivationManager
    from h3t_ext.runtime.config import H3TConfig
    from h3t_ext.runtime.memory.device import make_device_layer
    from h3t_ext.runtime.pipeline.schedules import H3TSchedules

    def factory(cfg, pp_rank, pp_size, device):
        layer = make_device_layer(cfg.device_mode, device, copy_delay_s=0.001)
        return ActivationManager(cfg.stage_alpha(pp_rank, pp_size), layer, track_storages=True)

    init_parallel(1, PP, v)
    chunks = build_stage(model_config(1, PP, v), v, ckpt="ours")
    load_reference(chunks, ref["state"])
    sched = H3TSchedules(H3TConfig(ckpt="ours", offload_alpha=0.5, device_mode="cpu-thread"),
                         manager_factory=factory)
    run = sched.forward_backward_pipelining_with_interleaving if v > 1 else \
        sched.forward_backward_pipelining_without_interleaving
    pools, worst = [], []
    for _ in range(2):
        iters = [iter(make_batches()) for _ in range(v)]
        run(forward_step_func=forward_step_func, data_iterator=iters if v > 1 else iters[0],
            model=chunks if v > 1 else chunks[0], num_microbatches=NUM_MICROBATCHES, seq_length=SEQ,
            micro_batch_size=MBS, forward_only=False)
        worst.append(compare_grads(chunks, ref["grads"])[1])
        for c in chunks:
            c.zero_grad(set_to_none=True)
        (mgr,) = [m for m in sched.preparer.managers if m is not None]
        pools.append((mgr.stats.host_pool_bytes, mgr.stats.host_pool_allocations))
    mgr.device.close()
    return {"worst": worst, "pools": pools, "offloaded": mgr.stats.offloaded_bytes,
            "recomputed": sum(mgr.stats.recomputed.values())}


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_reference_worker, 1, timeout_s=300)[0]


@pytest.mark.parametrize("v", [1, 2])
def test_thread_mode_offload_and_ours_in_the_pipeline(reference, v):
    per_rank = run_distributed(_worker, PP, (v, reference), timeout_s=600)
    for rank, r in enumerate(per_rank):
        assert max(r["worst"]) < TOL, (rank, r["worst"])
        assert r["pools"][1] == r["pools"][0], (rank, r["pools"])  # no growth in iteration 2
        assert r["recomputed"] > 0
    assert per_rank[0]["offloaded"] > 0 and per_rank[0]["pools"][0][0] > 0
