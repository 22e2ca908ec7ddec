"""Context parallelism through the h3t-ext runtime: GPTModel with ring attention against one process.

The tiny model of tests/gpt_harness.py runs with c = 2 (2 ranks) and c = 2 x p = 2 (4 ranks) through
``h3t_ext.install`` + ``get_forward_backward_func()`` for ckpt in {no, ours} (offload alpha 0.5 where
the schedule can offload, p = 2). Each context-parallel rank gets Megatron's two sequence chunks of
every microbatch; gradients are averaged over the context-parallel group (what the data-parallel
gradient reduction over data x context ranks does). Asserted: per-microbatch losses (loss sums and
token counts added over the context-parallel group) equal the single-process reference within 1e-5
relative, every gradient within float32 tolerance, and the first stage offloads at alpha 0.5.

Memory: every stage has a counting activation manager (every saved tensor offloadable, as in
tests/integration/test_memory_prediction.py); its measured peak is compared with the cost model's
``stage_activation_peak_bytes`` for the same plan (c = 2, 'local' spec, fp32).
"""
from __future__ import annotations

import pytest

from h3t_ext.testing import run_distributed
from gpt_harness import MBS, NUM_LAYERS, NUM_MICROBATCHES, SEQ, VOCAB, make_batches, reference_run

LAYOUTS = [(2, 1), (2, 2)]  # (c, p)
MEMORY_TOL = 0.01
GRAD_TOL = 1e-7


def _variants(pp: int) -> list[tuple[str, float]]:
    alpha = 0.5 if pp > 1 else 0.0  # p = 1 runs each backward right after its forward: nothing to offload
    return [(ckpt, alpha) for ckpt in ("no", "ours")]


def _forward_step(data_iterator, model):
    """Megatron's 3-tuple loss: this rank's loss sum and token count (the schedule divides)."""
    import torch

    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(output_tensor):
        loss_sum = output_tensor.float().sum()
        n = torch.tensor(output_tensor.numel(), dtype=torch.int)
        return loss_sum, n, {"lm loss": torch.stack([loss_sum.detach(), n.detach().float()])}

    return output, loss_func


def _counting_factory(config, pipeline_rank, pipeline_size, device):
    from h3t_ext.runtime.memory.activations import ActivationManager
    from h3t_ext.runtime.memory.device import make_device_layer

    return ActivationManager(config.stage_alpha(pipeline_rank, pipeline_size), make_device_layer("cpu-sync", device),
                             min_offload_bytes=0)


def _reference_worker(rank, world):
    return reference_run(seed=0)


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_reference_worker, 1, timeout_s=300)[0]


def _layout_worker(rank, world, cp, pp, ref):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    import h3t_ext
    from gpt_harness import compare_grads, load_reference, model_config
    from h3t_ext.runtime.config import H3TConfig
    from h3t_ext.runtime.modules.gpt import build_stage_chunks
    from h3t_ext.runtime.modules.ring_attention import RingSDPACoreAttention, shard_sequence

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(pipeline_model_parallel_size=pp, context_parallel_size=cp)
    cp_group, cp_rank = ps.get_context_parallel_group(), ps.get_context_parallel_rank()

    def batches():
        return iter([{k: shard_sequence(v, 1, cp_rank, cp) for k, v in b.items()} for b in make_batches()])

    results = {}
    for ckpt, alpha in _variants(pp):
        cfg = model_config(1, pp, 1, context_parallel_size=cp)
        (chunk,) = build_stage_chunks(cfg, vocab_size=VOCAB, max_sequence_length=SEQ,
                                      pipeline_rank=ps.get_pipeline_model_parallel_rank(), ckpt=ckpt,
                                      core_attention=RingSDPACoreAttention, device_type="cpu")
        load_reference([chunk], ref["state"])
        runtime = h3t_ext.install(H3TConfig(ckpt=ckpt, offload_alpha=alpha, device_mode="cpu-sync"),
                                  manager_factory=_counting_factory)
        try:
            store = get_forward_backward_func(pp, None)(
                forward_step_func=_forward_step, data_iterator=batches(), model=chunk,
                num_microbatches=NUM_MICROBATCHES, seq_length=SEQ, micro_batch_size=MBS, forward_only=False)
            (mgr,) = [m for m in runtime.preparer.managers if m is not None]
            stats = mgr.stats
        finally:
            h3t_ext.uninstall()
        for p in chunk.parameters():  # the data x context parallel gradient average (d = 1 here)
            dist.all_reduce(p.grad, group=cp_group)
            p.grad /= cp
        losses = []
        for d in store:
            total = d["lm loss"].double()
            dist.all_reduce(total, group=cp_group)
            losses.append(float(total[0] / total[1]))
        _, worst, n = compare_grads([chunk], ref["grads"])
        results[(ckpt, alpha)] = {"losses": losses, "worst": worst, "n": n, "peak": stats.peak_resident_bytes,
                                  "offloaded": stats.offloaded_bytes, "pp_rank": ps.get_pipeline_model_parallel_rank(),
                                  "recomputed": sum(stats.recomputed.values())}
    return results


@pytest.fixture(scope="module")
def runs(reference):
    return {(cp, pp): run_distributed(_layout_worker, cp * pp, (cp, pp, reference), timeout_s=600)
            for cp, pp in LAYOUTS}


@pytest.mark.parametrize("cp,pp", LAYOUTS, ids=[f"cp{c}-pp{p}" for c, p in LAYOUTS])
def test_context_parallel_matches_reference(reference, runs, cp, pp):
    ref = [float(x) for x in reference["losses"]]
    for ckpt, alpha in _variants(pp):
        last = [r[(ckpt, alpha)] for r in runs[(cp, pp)] if r[(ckpt, alpha)]["pp_rank"] == pp - 1]
        assert len(last) == cp
        for r in last:
            assert r["losses"] == pytest.approx(ref, rel=1e-5, abs=0), (ckpt, alpha)
        for rank, res in enumerate(runs[(cp, pp)]):
            r = res[(ckpt, alpha)]
            assert r["n"] > 0 and r["worst"] < GRAD_TOL, f"{ckpt},{alpha} rank {rank}: gradient off by {r['worst']:.3g}"
            if ckpt == "ours":
                assert r["recomputed"] > 0, f"rank {rank}: ckpt=ours recomputed nothing"
            if alpha > 0 and r["pp_rank"] == 0:
                assert r["offloaded"] > 0, f"rank {rank}: first stage never offloaded"


def _predicted(cp, pp, ckpt, alpha) -> tuple:
    from h3t_ext.costmodel import ModelSpec, Plan, stage_activation_peak_bytes
    from gpt_harness import model_config

    cfg = model_config()
    spec = ModelSpec("ring-test", NUM_LAYERS, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups,
                     cfg.ffn_hidden_size, VOCAB)
    plan = Plan(num_gpus=cp * pp, seq_length=SEQ, global_batch_size=NUM_MICROBATCHES * MBS, micro_batch_size=MBS,
                context_parallel_size=cp, pipeline_model_parallel_size=pp, ckpt=ckpt, offload_alpha=alpha)
    return stage_activation_peak_bytes(spec, plan, dtype_bytes=4, layer_spec="local", sequence_parallel=False)


@pytest.mark.parametrize("cp,pp", LAYOUTS, ids=[f"cp{c}-pp{p}" for c, p in LAYOUTS])
def test_measured_stage_peaks_match_cost_model(runs, cp, pp):
    for ckpt, alpha in _variants(pp):
        predicted = _predicted(cp, pp, ckpt, alpha)
        for rank, res in enumerate(runs[(cp, pp)]):
            r = res[(ckpt, alpha)]
            want = predicted[r["pp_rank"]]
            assert r["peak"] == pytest.approx(want, rel=MEMORY_TOL), (
                f"{ckpt},{alpha} rank {rank} (stage {r['pp_rank']}): measured {r['peak']}, predicted {want} "
                f"({r['peak'] / want - 1:+.2%})")
