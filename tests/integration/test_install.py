"""install()/uninstall(), start-up validation, Megatron's sync hooks, and P2P timeouts."""
from __future__ import annotations

import subprocess
import sys

import pytest

from h3t_ext.testing import run_distributed
from gpt_harness import MBS, NUM_MICROBATCHES, SEQ, build_stage, forward_step_func, init_parallel, make_batches, \
    model_config, recording_factory

NAMES = (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)


def test_package_import_stays_torch_free():
    code = "import sys, h3t_ext; assert callable(h3t_ext.install); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_install_rebinds_and_uninstall_restores():
    from megatron.core.pipeline_parallel import schedules

    import h3t_ext
    from h3t_ext.runtime.config import H3TConfig
    from h3t_ext.runtime.pipeline.schedules import H3TSchedules

    originals = {n: getattr(schedules, n) for n in NAMES}
    runtime = h3t_ext.install(H3TConfig(ckpt="full"))
    try:
        assert isinstance(runtime, H3TSchedules)
        for n in NAMES:
            assert getattr(schedules, n) == getattr(runtime, n)
        assert schedules.get_forward_backward_func(pp_size=2, vp_size=2) == runtime.forward_backward_pipelining_with_interleaving
        assert schedules.get_forward_backward_func(pp_size=2, vp_size=None) == \
            runtime.forward_backward_pipelining_without_interleaving
        second = h3t_ext.install(H3TConfig(offload_alpha=0.5))  # re-install replaces, originals kept
        assert schedules.forward_backward_no_pipelining == second.forward_backward_no_pipelining
    finally:
        h3t_ext.uninstall()
    for n in NAMES:
        assert getattr(schedules, n) is originals[n]
    h3t_ext.uninstall()  # idempotent
    with pytest.raises(ValueError, match="H3TConfig"):
        h3t_ext.install({"ckpt": "full"})


def _one_line(exc) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("alpha", [-0.1, 1.5, (0.2, 2.0)])
def test_alpha_out_of_range(alpha):
    from h3t_ext.runtime.config import H3TConfig, RuntimeConfigError

    with pytest.raises(RuntimeConfigError) as exc:
        H3TConfig(offload_alpha=alpha)
    assert "--offload-alpha" in _one_line(exc) and "[0, 1]" in _one_line(exc)


def test_layout_validation():
    from h3t_ext.runtime.config import H3TConfig, RuntimeConfigError
    from h3t_ext.runtime.pipeline.prepare import validate_layout
    from h3t_ext.schedule.builder import build_schedule

    def check(cfg, p, m, v=1, forward_only=False):
        sched = build_schedule(p, m, v, forward_only=forward_only)
        for r in range(p):  # every rank reaches the same verdict
            validate_layout(cfg, sched, r)

    check(H3TConfig(offload_alpha=0.3), 2, 4)
    check(H3TConfig(offload_alpha=(0.5, 0.0)), 2, 4)
    check(H3TConfig(offload_alpha=(0.5, 0.5)), 2, 4, v=2)
    check(H3TConfig(offload_alpha=0.3), 1, 4, forward_only=True)  # evaluation: runs without offload
    cases = [
        (H3TConfig(offload_alpha=(0.5, 0.5, 0.5)), 2, 4, 1, "3 per-stage values"),
        (H3TConfig(offload_alpha=0.3), 1, 4, 1, "cannot be overlapped"),
        (H3TConfig(offload_alpha=0.3), 2, 1, 1, "cannot be overlapped"),
        (H3TConfig(offload_alpha=(0.5, 0.5)), 2, 4, 1, "stage(s) [1]"),
    ]
    for cfg, p, m, v, text in cases:
        for r in range(p):
            with pytest.raises(RuntimeConfigError) as exc:
                validate_layout(cfg, build_schedule(p, m, v), r)
            assert text in _one_line(exc), _one_line(exc)


class _Recorder:
    def __init__(self):
        self.events = []

    def no_sync(self):
        rec = self

        class _Ctx:
            def __enter__(self):
                rec.events.append("no_sync_enter")

            def __exit__(self, *a):
                rec.events.append("no_sync_exit")

        return _Ctx()

    def sync(self, kind, chunk):
        return lambda params: self.events.append((kind, chunk, len(list(params))))

    def finalize(self, model, num_tokens, pg_collection=None, force_all_reduce=False):
        self.events.append(("finalize", len(model), pg_collection is not None))


def _hooks_worker(rank, world, v):
    import torch
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from megatron.core.process_groups_config import ProcessGroupCollection

    import h3t_ext
    from h3t_ext.runtime.config import H3TConfig
    from h3t_ext.runtime.pipeline.errors import P2PTimeoutError

    init_parallel(1, 2, v)
    cfg = model_config(1, 2, v)
    torch.manual_seed(0)
    chunks = build_stage(cfg, v)
    rec = _Recorder()
    cfg.no_sync_func = rec.no_sync
    cfg.grad_sync_func = [rec.sync("grad", c) for c in range(v)] if v > 1 else rec.sync("grad", 0)
    cfg.param_sync_func = [rec.sync("param", c) for c in range(v)] if v > 1 else None
    cfg.finalize_model_grads_func = rec.finalize
    pgc = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp", "pp", "embd", "pos_embd", "dp_cp"])
    kw = dict(forward_step_func=forward_step_func, model=chunks if v > 1 else chunks[0],
              num_microbatches=NUM_MICROBATCHES, seq_length=SEQ, micro_batch_size=MBS,
              pg_collection=pgc, p2p_communicator=P2PCommunicator(pp_group=pgc.pp, config=cfg))
    h3t_ext.install(H3TConfig(offload_alpha=0.5, p2p_timeout_s=3.0), manager_factory=recording_factory)
    try:
        fb = get_forward_backward_func(2, v if v > 1 else None)
        iters = [iter(make_batches()) for _ in range(v)]
        store = fb(data_iterator=iters if v > 1 else iters[0], **kw)
        train_events = list(rec.events)
        rec.events.clear()
        iters = [iter(make_batches()) for _ in range(v)]
        fb(data_iterator=iters if v > 1 else iters[0], forward_only=True, **kw)
        eval_events = list(rec.events)
        funcs_restored = cfg.grad_sync_func is not None
        # A peer that never sends: rank 0 runs an iteration rank 1 does not join.
        timeout_msg = ""
        if rank == 0:
            try:
                iters = [iter(make_batches()) for _ in range(v)]
                fb(data_iterator=iters if v > 1 else iters[0], **kw)
            except P2PTimeoutError as exc:
                timeout_msg = str(exc)
        else:  # alive but silent past the 3 s deadline (a peer that exits is reported as gone instead)
            import time
            time.sleep(6.0)
    finally:
        h3t_ext.uninstall()
    return {"train": train_events, "eval": eval_events, "losses": len(store), "restored": funcs_restored,
            "timeout": timeout_msg}


@pytest.mark.parametrize("v", [1, 2])
def test_megatron_hooks_and_timeout(v):
    res = run_distributed(_hooks_worker, 2, (v,), timeout_s=300)
    for rank, r in enumerate(res):
        train = r["train"]
        assert train[0] == "no_sync_enter" and train.count(("finalize", v, True)) == 1 and train[-1][0] == "finalize"
        grads = [e for e in train if isinstance(e, tuple) and e[0] == "grad"]
        if v == 1:  # Megatron: with a grad_sync_func the first stage syncs by leaving no_sync, others call it
            assert [g[1] for g in grads] == ([] if rank == 0 else [0]), grads
        else:
            assert sorted(g[1] for g in grads) == list(range(v)), grads
            params = [e[1] for e in train if isinstance(e, tuple) and e[0] == "param"]
            assert params[:2] == [0, 1]
        assert train.count("no_sync_enter") == train.count("no_sync_exit")
        assert not any(isinstance(e, tuple) and e[0] in ("finalize", "grad") for e in r["eval"])
        assert r["restored"]
    assert res[1]["losses"] == NUM_MICROBATCHES and res[0]["losses"] == 0
    msg = res[0]["timeout"]
    assert "pipeline rank 0" in msg and "with pipeline rank 1" in msg and "p2p_timeout_s" in msg, msg
    assert "\n" not in msg


def _unsupported_worker(rank, world):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    import h3t_ext
    from h3t_ext.runtime.config import H3TConfig, RuntimeConfigError
    from h3t_ext.runtime.modules.attention import SDPACoreAttention
    from h3t_ext.runtime.modules.gpt import build_gpt_model

    init_parallel()
    spec = get_gpt_layer_local_spec(normalization="LayerNorm")
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    model = build_gpt_model(model_config(normalization="LayerNorm"), vocab_size=128, max_sequence_length=SEQ,
                            layer_spec=spec, device_type="cpu")
    h3t_ext.install(H3TConfig(ckpt="ours"))
    try:
        get_forward_backward_func(1, None)(
            forward_step_func=forward_step_func, data_iterator=iter(make_batches()), model=model,
            num_microbatches=2, seq_length=SEQ, micro_batch_size=MBS)
    except RuntimeConfigError as exc:
        return str(exc)
    finally:
        h3t_ext.uninstall()
    return None


def test_ckpt_ours_on_unsupported_spec_fails_clearly():
    msg = run_distributed(_unsupported_worker, 1, timeout_s=300)[0]
    assert msg and "\n" not in msg and "ours" in msg, msg
