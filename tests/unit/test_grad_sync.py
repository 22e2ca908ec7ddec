"""The executor's gradient-sync protocol (Megatron's no_sync / grad_sync_func / param_sync_func) reads Megatron's
model config and never writes it: Megatron's own interleaved schedule replaces a single sync function by a list
in the config; h3t-ext's keeps the list to itself, so the config a caller passed is the config it gets back."""
from types import SimpleNamespace

import torch

from h3t_ext.runtime.pipeline.schedules import ScheduleMode, _GradSync
from h3t_ext.schedule.actions import Action, ActionKind


def _config(calls):
    def grad_sync(params):
        calls.append(("grad", len(list(params))))

    def param_sync(params):
        calls.append(("param", len(list(params))))

    return SimpleNamespace(no_sync_func=None, grad_sync_func=grad_sync, param_sync_func=param_sync), grad_sync, \
        param_sync


def _chunks(n):
    return [torch.nn.Linear(2, 2, bias=c % 2 == 0) for c in range(n)]  # 2 and 1 parameters: tells chunks apart


def test_interleaved_sync_calls_each_chunk_and_leaves_the_config_alone():
    calls = []
    config, grad_sync, param_sync = _config(calls)
    model = _chunks(2)
    sync = _GradSync(config, model, ScheduleMode.INTERLEAVED, pp_rank=0, forward_only=False)
    sync.start()
    for c in range(2):
        a = Action(ActionKind.BACKWARD, 0, c)
        sync.before_backward(a, is_last_mb=True)
        sync.after_backward(a, is_last_mb=True)
    sync.finish(forward_only=False)
    assert config.grad_sync_func is grad_sync and config.param_sync_func is param_sync
    assert calls == [("param", 2), ("param", 1), ("grad", 2), ("grad", 1)]


def test_forward_only_interleaved_call_syncs_nothing_and_leaves_the_config_alone():
    calls = []
    config, grad_sync, param_sync = _config(calls)
    sync = _GradSync(config, _chunks(2), ScheduleMode.INTERLEAVED, pp_rank=0, forward_only=True)
    sync.start()
    sync.finish(forward_only=True)
    assert calls == []
    assert config.grad_sync_func is grad_sync and config.param_sync_func is param_sync


def test_1f1b_syncs_the_one_chunk_once_at_the_end():
    calls = []
    config, grad_sync, _ = _config(calls)
    sync = _GradSync(config, _chunks(1), ScheduleMode.ONE_F_ONE_B, pp_rank=1, forward_only=False)
    sync.before_backward(Action(ActionKind.BACKWARD, 3, 0), is_last_mb=True)
    sync.finish(forward_only=False)
    assert calls == [("grad", 2)] and config.grad_sync_func is grad_sync


def test_the_runtime_hands_out_the_function_megatron_would_for_the_shape():
    from h3t_ext.runtime.config import H3TConfig
    from h3t_ext.runtime.pipeline.schedules import H3TSchedules

    rt = H3TSchedules(H3TConfig())
    assert rt.forward_backward_func(1, 1) == rt.forward_backward_no_pipelining
    assert rt.forward_backward_func(2, 1) == rt.forward_backward_pipelining_without_interleaving
    assert rt.forward_backward_func(4, 3) == rt.forward_backward_pipelining_with_interleaving
