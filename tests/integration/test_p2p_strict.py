"""Strict P2P mode (NCCL's semantics on gloo) and NCCL's device-side waits.

* The runtime schedules under ``H3TConfig(strict_p2p=True)`` reproduce the single-process
  reference bitwise, for plain and interleaved 1F1B and both communicator mappings, and post
  exactly the builder's batches.
* A posting order that deadlocks under NCCL (the earlier just-in-time order of interleaved 1F1B,
  or two ranks that each send before they receive) passes on plain gloo but ends under strict
  mode with one P2PTimeoutError line per rank, naming the rank, its peer and the pending transfers.
* On NCCL a receive is ``work.wait()`` (the stream waits), elsewhere ``work.wait(timeout)``.
"""
from __future__ import annotations

import datetime

import pytest

from h3t_ext.testing import run_distributed
from gpt_harness import (
    MBS, SEQ, build_stage, compare_grads, forward_step_func, init_parallel, load_reference, make_batches,
    model_config, recording_factory, reference_run,
)
from schedule_harness import just_in_time_schedule

DEADLOCK_TIMEOUT_S = 5.0


# ---- NCCL waits: no host polling -----------------------------------------------------------------

class _FakeWork:
    def __init__(self, fail: bool = False):
        self.calls, self.fail = [], fail

    def wait(self, *args):
        self.calls.append(args)
        if self.fail:
            raise RuntimeError("Timed out waiting 1000ms for recv operation to complete\nmore detail")
        return True


def test_nccl_waits_are_stream_waits_and_gloo_waits_have_a_deadline():
    from h3t_ext.runtime.pipeline.errors import P2PTimeoutError
    from h3t_ext.runtime.pipeline.p2p import uses_stream_waits, wait_work

    assert uses_stream_waits("nccl") and not uses_stream_waits("gloo") and not uses_stream_waits("mpi")
    timeout = datetime.timedelta(seconds=7)
    w = _FakeWork()
    wait_work(w, timeout, "RECV_FORWARD microbatch 0", 1, stream_wait=True)
    assert w.calls == [()]  # work.wait() without a timeout: the current CUDA stream waits
    w = _FakeWork()
    wait_work(w, timeout, "RECV_FORWARD microbatch 0", 1, stream_wait=False)
    assert w.calls == [(timeout,)]
    with pytest.raises(P2PTimeoutError) as e:
        wait_work(_FakeWork(fail=True), timeout, "RECV_FORWARD microbatch 0", 1, stream_wait=False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("pipeline rank 1: RECV_FORWARD microbatch 0") and "7s" in msg


def test_strict_p2p_config_is_validated():
    from h3t_ext.runtime.config import H3TConfig, RuntimeConfigError

    assert H3TConfig().strict_p2p is False and H3TConfig().strict_p2p_comm == "group"
    H3TConfig(strict_p2p=True, strict_p2p_comm="pair")
    with pytest.raises(RuntimeConfigError, match=r"strict_p2p_comm must be one of \{group,pair\}, got 'ring'"):
        H3TConfig(strict_p2p=True, strict_p2p_comm="ring")


# ---- replaying posting orders on PipelineP2P ------------------------------------------------------

def _linger() -> None:
    """After a deadlock error, stay until the peers' deadlines have passed too: tearing this
    process's group down earlier would fail their waits with a closed connection instead."""
    import time

    time.sleep(3.0)


def _replay(schedule, rank: int, strict, timeout_s: float) -> dict:
    """Post ``schedule``'s transfers for ``rank`` as the executor does (batches between computes,
    receives waited for by the compute that needs them); data identify the transfer."""
    import torch
    import torch.distributed as dist

    from h3t_ext.runtime.pipeline.errors import P2PTimeoutError
    from h3t_ext.runtime.pipeline.p2p import BACKWARD, FORWARD, PipelineP2P
    from h3t_ext.schedule.builder import ActionKind as K

    cfg = schedule.config
    p, v = cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size
    last = p * v - 1
    p2p = PipelineP2P(dist.group.WORLD, p * v, timeout_s, strict=strict)

    def value(direction, mb, sender):
        return float(1000 * direction + 10 * mb + sender)

    try:
        for a in schedule.ranks[rank]:
            stage = a.chunk * p + rank
            what = f"{a.kind.name} microbatch {a.microbatch} chunk {a.chunk} with pipeline rank {a.peer}"
            if a.kind in (K.SEND_FORWARD, K.SEND_BACKWARD):
                d = FORWARD if a.kind is K.SEND_FORWARD else BACKWARD
                p2p.queue_send([torch.full((64, 64), value(d, a.microbatch, stage))], a.peer, d, a.microbatch,
                               stage, what)
            elif a.kind in (K.RECV_FORWARD, K.RECV_BACKWARD):
                d, sender = (FORWARD, stage - 1) if a.kind is K.RECV_FORWARD else (BACKWARD, stage + 1)
                p2p.queue_recv((d, a.microbatch, a.chunk), [(64, 64)], torch.float32, torch.device("cpu"), a.peer,
                               d, a.microbatch, sender, what)
            elif a.kind in (K.FORWARD, K.BACKWARD):
                d = FORWARD if a.kind is K.FORWARD else BACKWARD
                if (d == FORWARD and stage > 0) or (d == BACKWARD and stage < last):
                    sender = stage - 1 if d == FORWARD else stage + 1
                    (t,) = p2p.wait_recv((d, a.microbatch, a.chunk))
                    assert torch.all(t == value(d, a.microbatch, sender)), (rank, str(a))
                else:
                    p2p.flush()
        p2p.wait_all()
    except P2PTimeoutError as exc:
        _linger()
        return {"error": str(exc), "posted": p2p.posted}
    return {"error": None, "posted": p2p.posted}


def _replay_worker(rank, world, schedules, strict, timeout_s):
    return [_replay(s, rank, strict, timeout_s) for s in schedules]


def test_strict_mode_replays_the_builder_order_for_both_mappings():
    from h3t_ext.schedule import build_schedule

    schedules = [build_schedule(2, 4, 2), build_schedule(2, 5, 2, microbatch_group_size_per_vp_stage=5),
                 build_schedule(2, 4, 1), build_schedule(2, 6, 3)]
    for strict in ("group", "pair"):
        for res in run_distributed(_replay_worker, 2, (schedules, strict, 60.0), timeout_s=120):
            assert [r["error"] for r in res] == [None] * len(schedules)


def test_strict_mode_replays_the_builder_order_on_four_ranks():
    from h3t_ext.schedule import build_schedule

    schedules = [build_schedule(4, 8, 2), build_schedule(4, 9, 2, microbatch_group_size_per_vp_stage=9),
                 build_schedule(4, 8, 1)]
    res = run_distributed(_replay_worker, 4, (schedules, "pair", 60.0), timeout_s=120)
    assert all(r["error"] is None for per_rank in res for r in per_rank)


def test_strict_mode_catches_the_just_in_time_order():
    bad = just_in_time_schedule(2, 4, 2)
    # plain gloo buffers the sends: the order that hangs under NCCL passes
    plain = run_distributed(_replay_worker, 2, ([bad], None, 60.0), timeout_s=120)
    assert [r[0]["error"] for r in plain] == [None, None]
    for strict in ("group", "pair"):
        res = run_distributed(_replay_worker, 2, ([bad], strict, DEADLOCK_TIMEOUT_S), timeout_s=120)
        for rank, (r,) in enumerate(res):
            msg = r["error"]
            assert msg is not None and "\n" not in msg, msg
            assert msg.startswith(f"pipeline rank {rank}: ") and f"within {DEADLOCK_TIMEOUT_S:g}s" in msg, msg
            assert f"peers [{1 - rank}]" in msg and f"under strict P2P ({strict} communicators)" in msg, msg
            # the send each rank is stuck on: SB0.1 on rank 0, SB1.1 on rank 1 (p2p_model's finding)
            assert f"send SEND_BACKWARD microbatch {rank} chunk 1 with pipeline rank {1 - rank} to pipeline " \
                   f"rank {1 - rank} (waits for its receive to start)" in msg, msg


def _head_to_head_worker(rank, world, strict):
    """Both ranks post [send] and then [recv]: fine for gloo, a deadlock for NCCL."""
    import torch
    import torch.distributed as dist

    from h3t_ext.runtime.pipeline.errors import P2PTimeoutError
    from h3t_ext.runtime.pipeline.p2p import FORWARD, PipelineP2P

    p2p = PipelineP2P(dist.group.WORLD, 2, DEADLOCK_TIMEOUT_S, strict=strict)
    peer = 1 - rank
    try:
        p2p.queue_send([torch.ones(1024)], peer, FORWARD, 0, rank, "SEND_FORWARD microbatch 0")
        p2p.flush()
        p2p.queue_recv("x", [(1024,)], torch.float32, torch.device("cpu"), peer, FORWARD, 0, peer,
                       "RECV_FORWARD microbatch 0")
        p2p.wait_recv("x")
        p2p.wait_all()
    except P2PTimeoutError as exc:
        _linger()
        return str(exc)
    return None


def test_strict_mode_catches_two_ranks_that_both_send_first():
    assert run_distributed(_head_to_head_worker, 2, (None,), timeout_s=60) == [None, None]
    for strict in ("group", "pair"):
        msgs = run_distributed(_head_to_head_worker, 2, (strict,), timeout_s=60)
        for rank, msg in enumerate(msgs):
            assert msg is not None and "\n" not in msg
            assert msg.startswith(f"pipeline rank {rank}: RECV_FORWARD microbatch 0 did not complete within 5s")
            assert f"peers [{1 - rank}]" in msg and "batch 0 (running): send SEND_FORWARD microbatch 0" in msg


# ---- the runtime schedules under strict mode --------------------------------------------------------

LAYOUTS = [(2, 1, 4), (2, 2, 4), (4, 1, 8), (4, 2, 8)]


def _reference_worker(rank, world, m):
    return reference_run(seed=0, m=m)


def _strict_worker(rank, world, pp, layouts, refs):
    import torch
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    import h3t_ext
    from h3t_ext.runtime.config import H3TConfig
    from h3t_ext.schedule import build_schedule
    from h3t_ext.schedule.posting import posting_batches

    out = {}
    for v, m, comm, alpha in layouts:
        init_parallel(1, pp, v)
        chunks = build_stage(model_config(1, pp, v), v)
        load_reference(chunks, refs[m]["state"])
        runtime = h3t_ext.install(H3TConfig(offload_alpha=alpha, strict_p2p=True, strict_p2p_comm=comm,
                                            p2p_timeout_s=120.0), manager_factory=recording_factory)
        try:
            fb = get_forward_backward_func(pp, v if v > 1 else None)
            iters = [iter(make_batches(m)) for _ in range(v)]
            store = fb(forward_step_func=forward_step_func, data_iterator=iters if v > 1 else iters[0],
                       model=chunks if v > 1 else chunks[0], num_microbatches=m, seq_length=SEQ,
                       micro_batch_size=MBS, forward_only=False)
            posted = runtime.last_posted
        finally:
            h3t_ext.uninstall()
        expected = [tuple(f"{a.kind.name} microbatch {a.microbatch} chunk {a.chunk} with pipeline rank {a.peer}"
                          for a in batch) for batch in posting_batches(build_schedule(pp, m, v).ranks[rank])]
        exact, worst, n = compare_grads(chunks, refs[m]["grads"])
        out[(v, m, comm, alpha)] = {"exact": exact, "worst": worst, "n": n,
                                    "losses": [d["lm loss"] for d in store], "posted_ok": posted == expected,
                                    "batches": len(posted)}
    return out


@pytest.mark.parametrize("pp", [2, 4])
def test_runtime_schedules_under_strict_p2p_match_the_reference(pp):
    import torch

    layouts = [(v, m, comm, alpha) for p, v, m in LAYOUTS if p == pp
               for comm, alpha in (("group", 0.0), ("pair", 0.3))]
    ms = sorted({m for _, m, _, _ in layouts})
    refs = {m: run_distributed(_reference_worker, 1, (m,), timeout_s=300)[0] for m in ms}
    per_rank = run_distributed(_strict_worker, pp, (pp, layouts, refs), timeout_s=600)
    for key in layouts:
        for rank, res in enumerate(per_rank):
            r = res[key]
            assert r["n"] > 0 and r["exact"], f"{key} rank {rank}: gradients differ by up to {r['worst']:.3g}"
            assert r["posted_ok"] and r["batches"] > 0, f"{key} rank {rank}: posted batches differ from the builder's"
        got = torch.stack(per_rank[-1][key]["losses"])
        assert torch.equal(got, torch.stack(refs[key[1]]["losses"])), key
        assert all(res[key]["losses"] == [] for res in per_rank[:-1])


def _crossed_order_worker(rank, world):
    """Rank 0 sends microbatches 0, 1; rank 1 receives 1, 0 (gloo matches tags, NCCL order)."""
    import torch
    import torch.distributed as dist

    from h3t_ext.runtime.pipeline.errors import P2PTimeoutError
    from h3t_ext.runtime.pipeline.p2p import FORWARD, PipelineP2P
    from h3t_ext.runtime.pipeline.p2p_strict import P2POrderError

    p2p = PipelineP2P(dist.group.WORLD, 2, DEADLOCK_TIMEOUT_S, strict="group")
    try:
        if rank == 0:
            for mb in (0, 1):
                p2p.queue_send([torch.full((8,), float(mb))], 1, FORWARD, mb, 0, f"SEND_FORWARD microbatch {mb}")
        else:
            for mb in (1, 0):
                p2p.queue_recv(mb, [(8,)], torch.float32, torch.device("cpu"), 0, FORWARD, mb, 0,
                               f"RECV_FORWARD microbatch {mb}")
        p2p.flush()
        if rank == 1:
            p2p.wait_recv(1)
            p2p.wait_recv(0)
        p2p.wait_all()
    except (P2POrderError, P2PTimeoutError) as exc:
        return type(exc).__name__, str(exc)
    return None


def test_strict_mode_rejects_sends_and_receives_posted_in_different_orders():
    (kind0, msg0), (kind1, _) = run_distributed(_crossed_order_worker, 2, timeout_s=60)
    assert kind0 == "P2POrderError" and kind1 == "P2PTimeoutError"
    assert "\n" not in msg0 and msg0.startswith("pipeline rank 0: send SEND_FORWARD microbatch 0 to pipeline rank 1")
    assert "NCCL matches by order" in msg0
