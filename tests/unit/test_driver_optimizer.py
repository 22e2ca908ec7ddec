"""The CPU optimizer equals AdamW on the data-parallel mean gradient, sharded (ZeRO-1) or not."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from h3t_ext.testing import run_distributed
from h3t_training.loop.optimizer import DataParallelAdamW
from h3t_training.loop.param_schedule import ParamSchedule

ARGS = SimpleNamespace(lr=1e-2, min_lr=1e-3, lr_warmup_iters=2, lr_decay_iters=6, lr_decay_style="cosine",
                       weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=0.5,
                       check_for_nan_in_loss_and_grad=True, lr_warmup_init=0.0, decoupled_lr=None,
                       decoupled_min_lr=None, lr_warmup_steps=None, lr_decay_steps=None,
                       optimizer_cpu_offload=False, optimizer_offload_fraction=None, overlap_cpu_optimizer_d2h_h2d=False,
                       use_torch_optimizer_for_cpu_offload=False, pin_cpu_grads=True, pin_cpu_params=True,
                       overlap_grad_reduce=False, fp16=False, lr_wsd_decay_steps=None, lr_wsd_decay_style="exponential",
                       start_weight_decay=0.1, end_weight_decay=0.1, wd_incr_steps=None,
                       weight_decay_incr_style="constant", calculate_per_token_loss=False, log_num_zeros_in_grad=False)
"""The optimizer's fields of the driver's config (which is closed: every field is present, None when unset)."""
SCHEDULE = ParamSchedule.from_args(ARGS)
"""Counted in iterations (no sample counts): the update of iteration s runs at num_steps s, as Megatron-LM's."""
STEPS = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def _worker(rank: int, world: int):
    return {distributed: _train(rank, distributed) for distributed in (False, True)}


def _train(rank: int, distributed: bool):
    import torch.distributed as dist
    model = _model()
    opt = DataParallelAdamW([model], ARGS, dp_group=dist.group.WORLD, model_parallel_group=None, tp_rank=0,
                            distributed=distributed)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, *_batch(rank, step)).backward()
        norms.append(opt.step(step, step)[1])
    n_state = len(opt.adam.state) if opt.has_params else 0  # parameters with Adam state here
    return [p.detach().clone() for p in model.parameters()], norms, n_state


def _reference(world: int):
    model = _model()
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    adam = torch.optim.AdamW([{"params": decay, "weight_decay": ARGS.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=ARGS.lr,
                             betas=(ARGS.adam_beta1, ARGS.adam_beta2), eps=ARGS.adam_eps)
    norms = []
    for step in range(STEPS):
        adam.zero_grad()
        sum(_loss(model, *_batch(r, step)) for r in range(world)).div(world).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), ARGS.clip_grad)
        norms.append(float(norm))
        for g in adam.param_groups:
            g["lr"] = SCHEDULE.lr(step)
        adam.step()
    return [p.detach() for p in model.parameters()], norms


@pytest.fixture(scope="module")
def two_rank_results():
    return run_distributed(_worker, world_size=2, timeout_s=240)


@pytest.mark.parametrize("distributed", [False, True])
def test_data_parallel_adamw_matches_single_process_adamw(distributed, two_rank_results):
    results = [r[distributed] for r in two_rank_results]
    ref_params, ref_norms = _reference(2)
    for params, norms, _ in results:
        for p, q in zip(params, ref_params):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert norms == pytest.approx(ref_norms, rel=1e-6)
    states = [n for _, _, n in results]
    if distributed:  # each rank keeps Adam state for its share only: 3 parameters' slices each (optimizer_shards)
        assert states == [3, 3]
    else:
        assert states == [6, 6]


def test_learning_rate_schedule():
    assert SCHEDULE.lr(0) == 0.0  # the first update runs at --lr-warmup-init
    assert SCHEDULE.lr(1) == pytest.approx(ARGS.lr / 2)  # warm-up
    assert SCHEDULE.lr(2) == pytest.approx(ARGS.lr)
    assert SCHEDULE.lr(6) == pytest.approx(ARGS.min_lr)  # end of the cosine
    assert SCHEDULE.lr(4) == pytest.approx(ARGS.min_lr + 0.5 * (ARGS.lr - ARGS.min_lr))


DECOUPLED = SimpleNamespace(**{**vars(ARGS), "decoupled_lr": 3e-2, "decoupled_min_lr": 2e-3})


def _flag_embedding(model: torch.nn.Module) -> torch.nn.Module:
    model[0].weight.is_embedding_or_output_parameter = True  # as megatron-core's LanguageModule marks them
    return model


def _decoupled_worker(rank: int, world: int):
    import torch.distributed as dist
    model = _flag_embedding(_model())
    opt = DataParallelAdamW([model], DECOUPLED, dp_group=dist.group.WORLD, model_parallel_group=None, tp_rank=0,
                            distributed=True)
    lrs = []
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, *_batch(rank, step)).backward()
        lrs.append(opt.step(step, step)[0])
    return [p.detach().clone() for p in model.parameters()], lrs


def test_decoupled_lr_gives_the_embedding_and_output_weights_their_own_schedule():
    """Megatron's --decoupled-lr/--decoupled-min-lr: same warm-up and decay, their own peak and floor."""
    results = run_distributed(_decoupled_worker, world_size=2, timeout_s=240)
    model = _flag_embedding(_model())
    own = [model[0].weight]
    rest = [p for p in model.parameters() if p is not model[0].weight]
    adam = torch.optim.AdamW([{"params": own, "weight_decay": ARGS.weight_decay, "own": True},
                              {"params": [p for p in rest if p.dim() > 1], "weight_decay": ARGS.weight_decay},
                              {"params": [p for p in rest if p.dim() <= 1], "weight_decay": 0.0}], lr=ARGS.lr,
                             betas=(ARGS.adam_beta1, ARGS.adam_beta2), eps=ARGS.adam_eps)
    for step in range(STEPS):
        adam.zero_grad()
        sum(_loss(model, *_batch(r, step)) for r in range(2)).div(2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), ARGS.clip_grad)
        for g in adam.param_groups:
            g["lr"] = SCHEDULE.lr(step, 3e-2, 2e-3) if g.get("own") else SCHEDULE.lr(step)
        adam.step()
    assert SCHEDULE.lr(2, 3e-2, 2e-3) == pytest.approx(3e-2)  # the group's own peak after warm-up
    assert SCHEDULE.lr(6, 3e-2, 2e-3) == pytest.approx(2e-3)  # and its own floor
    for params, lrs in results:
        assert lrs == [pytest.approx(SCHEDULE.lr(s)) for s in range(STEPS)]  # the applied (default) lr
        for p, q in zip(params, model.parameters()):
            torch.testing.assert_close(p, q.detach(), rtol=1e-5, atol=1e-6)
