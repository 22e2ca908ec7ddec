"""Ring attention (context parallelism on CPU) against single-process causal SDPA.

Unit level: c = 2 and c = 4 gloo ranks each hold Megatron's two load-balanced chunks of q, k, v;
the ring's output and dq/dk/dv equal those of ``scaled_dot_product_attention`` on the whole
sequence (this rank's chunks of them), with GQA, MHA and one key/value head, run twice
bitwise-identically; in float32 within 1e-5 and in float64 within 1e-12 (float64 inputs keep float64
accumulators). A rank whose peer never answers fails with a one-line timeout.
"""
from __future__ import annotations

import pytest

from h3t_ext.testing import run_distributed

SEQ, BATCH, HEAD_DIM = 32, 2, 8
HEADS_GROUPS = [(4, 2), (4, 4), (4, 1)]
TOL = {"float32": 1e-5, "float64": 1e-12}


def _attention_worker(rank, world, dtype_name):
    import torch
    import torch.nn.functional as F

    from h3t_ext.runtime.modules.ring_attention import ring_attention, shard_sequence

    from h3t_training.data.datasets import batch_on_this_cp_rank  # megatron-core's split, any version's signature

    dtype = getattr(torch, dtype_name)
    group = torch.distributed.new_group(list(range(world)))
    tokens = torch.arange(2 * SEQ).view(2, SEQ)
    out = {"layout": torch.equal(batch_on_this_cp_rank({"tokens": tokens.clone()}, cp_group=group)["tokens"],
                                 shard_sequence(tokens, 1, rank, world))}
    for heads, groups in HEADS_GROUPS:
        g = torch.Generator().manual_seed(heads * 10 + groups)
        q = torch.randn(SEQ, BATCH, heads, HEAD_DIM, generator=g, dtype=dtype)
        k = torch.randn(SEQ, BATCH, groups, HEAD_DIM, generator=g, dtype=dtype)
        v = torch.randn(SEQ, BATCH, groups, HEAD_DIM, generator=g, dtype=dtype)
        grad = torch.randn(SEQ, BATCH, heads * HEAD_DIM, generator=g, dtype=dtype)
        scale = HEAD_DIM ** -0.5

        full = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in full), is_causal=True, scale=scale,
                                             enable_gqa=groups < heads)
        ref = ref.permute(2, 0, 1, 3).reshape(SEQ, BATCH, heads * HEAD_DIM)
        ref.backward(grad)
        expected = [ref.detach()] + [t.grad for t in full]

        runs = []
        for _ in range(2):
            local = [shard_sequence(t, 0, rank, world).requires_grad_(True) for t in (q, k, v)]
            got = ring_attention(*local, group, softmax_scale=scale, timeout_s=60)
            got.backward(shard_sequence(grad, 0, rank, world))
            runs.append([got.detach()] + [t.grad for t in local])
        diffs = [(a - shard_sequence(e, 0, rank, world)).abs().max().item() for a, e in zip(runs[0], expected)]
        out[(heads, groups)] = {"diffs": diffs, "deterministic": all(torch.equal(a, b) for a, b in zip(*runs)),
                                "local_tokens": runs[0][0].size(0), "dtype": str(runs[0][0].dtype)}
    return out


@pytest.mark.parametrize("cp,dtype", [(2, "float32"), (4, "float32"), (2, "float64")])
def test_ring_attention_matches_full_causal_sdpa(cp, dtype):
    per_rank = run_distributed(_attention_worker, cp, (dtype,), timeout_s=300)
    for rank, res in enumerate(per_rank):
        assert res.pop("layout"), f"rank {rank}: shard_sequence differs from megatron's get_batch_on_this_cp_rank"
        for (heads, groups), r in res.items():
            assert r["local_tokens"] == SEQ // cp and r["dtype"] == f"torch.{dtype}"
            names = ("output", "dq", "dk", "dv")
            assert max(r["diffs"]) < TOL[dtype], f"c={cp} rank {rank} heads={heads} groups={groups}: " + ", ".join(
                f"{n} {d:.2g}" for n, d in zip(names, r["diffs"]))
            assert r["deterministic"], f"c={cp} rank {rank} heads={heads} groups={groups}: two runs differ"


def test_unshard_inverts_shard():
    import torch

    from h3t_ext.runtime.modules.ring_attention import shard_sequence, unshard_sequence

    full = torch.arange(2 * 24).view(2, 24)
    for c in (2, 3, 4):
        shards = [shard_sequence(full, 1, r, c) for r in range(c)]
        assert [s[0, 0].item() for s in shards] == [12 * r // c for r in range(c)]
        assert torch.equal(unshard_sequence(shards, 1), full)
    with pytest.raises(ValueError, match="not a multiple of 2 x context-parallel size 4"):
        shard_sequence(torch.zeros(2, 12), 1, 0, 4)


def _timeout_worker(rank, world):
    import torch
    import torch.distributed as dist

    from h3t_ext.runtime.modules.ring_attention import CPTimeoutError, ring_attention

    group = dist.new_group([0, 1])
    msg = None
    if rank == 0:  # rank 1 never joins the ring
        t = torch.randn(8, 1, 2, 4)
        try:
            ring_attention(t, t, t, group, softmax_scale=0.5, timeout_s=2)
        except CPTimeoutError as e:
            msg = str(e)
    dist.barrier()
    return msg


def test_a_missing_peer_is_a_one_line_timeout():
    msg = run_distributed(_timeout_worker, 2, timeout_s=120)[0]
    assert msg is not None and "\n" not in msg
    assert msg.startswith("context-parallel rank 0: forward K/V exchange, step 1") and "cp_timeout_s" in msg


def test_core_attention_refuses_what_it_does_not_implement():
    from megatron.core.transformer.enums import AttnMaskType

    from h3t_ext.runtime.modules.gpt import tiny_llama_config
    from h3t_ext.runtime.modules.ring_attention import RingSDPACoreAttention

    class _Collection:
        cp = object()  # taken as the group as it is; nothing is communicated at construction

    cfg = tiny_llama_config(context_parallel_size=2)
    attn = RingSDPACoreAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=_Collection())
    assert attn.cp_group is _Collection.cp and attn.softmax_scale == cfg.kv_channels ** -0.5
    for kw, match in ((dict(cp_comm_type="a2a"), "cp_comm_type 'p2p', got 'a2a'"),
                      (dict(attention_dropout=0.1), "--attention-dropout 0.1"),
                      (dict(attn_mask_type=AttnMaskType.no_mask), "causal masks only")):
        args = dict(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                    pg_collection=_Collection())
        args.update(kw)
        with pytest.raises(ValueError, match=match):
            RingSDPACoreAttention(**args)
