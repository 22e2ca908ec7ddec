"""Schedules for tests that are not the builder's: the earlier just-in-time posting order (which can deadlock
under NCCL's semantics), for tests that show the checker and the strict P2P layer catch it."""
from h3t_ext.schedule.builder import Action, ActionKind as K, PipelineSchedule, ScheduleConfig, _compute_order


def just_in_time_schedule(p, m, v=1):
    """The earlier posting order: each receive right before its compute, each send right after."""
    cfg = ScheduleConfig(p, m, v, offload=False)
    last, ranks = p * v - 1, []
    for r in range(p):
        out = []
        for a in _compute_order(cfg, r):
            stage, fwd = a.chunk * p + r, a.kind is K.FORWARD
            src_ok, dst_ok = (stage > 0, stage < last) if fwd else (stage < last, stage > 0)
            if src_ok:
                out.append(Action(K.RECV_FORWARD if fwd else K.RECV_BACKWARD, a.microbatch, a.chunk,
                                  (r - 1) % p if fwd else (r + 1) % p))
            out.append(a)
            if dst_ok:
                out.append(Action(K.SEND_FORWARD if fwd else K.SEND_BACKWARD, a.microbatch, a.chunk,
                                  (r + 1) % p if fwd else (r - 1) % p))
        ranks.append(tuple(out))
    return PipelineSchedule(cfg, tuple(ranks))
