"""--optimizer-cpu-offload on the CPU path, in process: the split is megatron-core's HybridDeviceOptimizer's
(checked against its own code), the host partition steps to the same numbers bit for bit (sharded or not,
with or without --overlap-cpu-optimizer-d2h-h2d), its measured bytes are the tensors it holds, and bad
flags are one line."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from h3t_ext.testing import run_distributed
from h3t_training.config.sections import parse_args
from h3t_training.loop.optimizer import DataParallelAdamW
from h3t_training.loop.optimizer_offload import offloaded_prefix
from h3t_training.telemetry.state_bytes import measure
from test_driver_optimizer import ARGS, STEPS, _batch, _loss, _model


class _FakeCudaParam:
    """What HybridDeviceOptimizer's split reads of a GPU parameter: numel, is_cuda, and the copy it offloads."""

    def __init__(self, n: int, index: int):
        self.n, self.index, self.is_cuda, self.dtype = n, index, True, torch.float32

    def numel(self):
        return self.n

    def detach(self):
        return _FakeHostCopy(self)


class _FakeHostCopy:
    def __init__(self, of):
        self.of, self.is_cuda, self.dtype = of, False, torch.float32

    def clone(self):
        return self

    def cpu(self):
        return self

    def pin_memory(self):
        return self

    def numel(self):
        return self.of.n


def _megatron_core_split(groups: list[list[int]], fraction: float) -> list[bool]:
    """megatron-core's own rule, run: HybridDeviceOptimizer._get_sub_optimizer_param_groups on stand-in GPU
    parameters (no GPU needed: it reads numel/is_cuda and copies)."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    params, param_groups = [], []
    for sizes in groups:
        group = [_FakeCudaParam(n, len(params) + i) for i, n in enumerate(sizes)]
        params += group
        param_groups.append({"params": group})
    me = SimpleNamespace(param_groups=param_groups, param_update_in_fp32=False)
    _, _, gpu_to_cpu, _, _ = HybridDeviceOptimizer._get_sub_optimizer_param_groups(me, fraction)
    return [p in gpu_to_cpu for p in params]


def test_split_rule_is_megatron_cores():
    rng = random.Random(3)
    cases = [([[100, 10], [90, 5, 5]], f) for f in (0.0, 0.05, 0.4, 0.5, 0.52, 0.9, 1.0)]
    cases += [([[rng.randint(1, 500) for _ in range(rng.randint(1, 6))] for _ in range(rng.randint(1, 3))],
                rng.random()) for _ in range(50)]
    for groups, f in cases:
        assert offloaded_prefix([n for g in groups for n in g], f) == _megatron_core_split(groups, f), (groups, f)
    assert offloaded_prefix([100, 10, 90, 5, 5], 0.5) == [True, True, False, False, False]  # 110 >= 105: stops
    assert offloaded_prefix([100, 10, 90, 5, 5], 0.4) == [True, False, False, False, False]


def _args(fraction=None, overlap=False):
    return SimpleNamespace(**{**vars(ARGS), "optimizer_cpu_offload": fraction is not None,
                              "optimizer_offload_fraction": fraction, "overlap_cpu_optimizer_d2h_h2d": overlap})


VARIANTS = {"none": (None, False), "half": (0.5, False), "half-overlap": (0.5, True), "all": (1.0, False),
            "small": (0.01, True)}


def _offload_worker(rank: int, world: int):
    import torch.distributed as dist
    out = {}
    for name, (fraction, overlap) in VARIANTS.items():
        for distributed in (False, True):
            model = _model()
            opt = DataParallelAdamW([model], _args(fraction, overlap), dp_group=dist.group.WORLD,
                                    model_parallel_group=None, tp_rank=0, distributed=distributed)
            norms = []
            for step in range(STEPS):
                opt.zero_grad()
                _loss(model, *_batch(rank, step)).backward()
                norms.append(opt.step(step, step)[1])
            held = measure([("params", "device", p) for p in model.parameters()] + list(opt.state_tensors()))
            host = [v.numel() for v in opt.views.values() if opt.host is not None and v in opt.host.master]
            owned = [s.numel for s in opt.slices if s.rank == opt.dp_rank]
            out[(name, distributed)] = ([p.detach().clone() for p in model.parameters()], norms, held, host, owned,
                                        len(opt.host.optimizers) if opt.host is not None else 0)
    return out


@pytest.fixture(scope="module")
def offload_results():
    return run_distributed(_offload_worker, world_size=2, timeout_s=240)


@pytest.mark.parametrize("name", sorted(set(VARIANTS) - {"none"}))
@pytest.mark.parametrize("distributed", [False, True])
def test_offload_steps_to_the_same_numbers_bit_for_bit(offload_results, name, distributed):
    for rank in offload_results:
        params, norms, *_ = rank[(name, distributed)]
        ref_params, ref_norms, *_ = rank[("none", False)]
        assert norms == ref_norms
        for p, q in zip(params, ref_params):
            assert torch.equal(p, q)


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("distributed", [False, True])
def test_measured_bytes_are_the_tensors_each_side_holds(offload_results, name, distributed):
    fraction, overlap = VARIANTS[name]
    model_elems = sum(p.numel() for p in _model().parameters())
    for rank in offload_results:
        _, _, held, host, owned, n_host_optimizers = rank[(name, distributed)]
        h, n_dev = sum(host), len(owned) - len(host)
        assert held.device.params == 4 * model_elems and held.device.grads == 4 * model_elems
        assert held.host.params == 0
        assert held.host.grads == 4 * h  # the gradient copies
        assert held.host.optimizer == 12 * h + 4 * len(host)  # master copy, exp_avg, exp_avg_sq, step
        assert held.device.optimizer == 8 * (sum(owned) - h) + 4 * n_dev
        if fraction is None:
            assert host == []
        else:  # the shortest prefix of this rank's share with at least the fraction of its elements
            assert h >= fraction * sum(owned) and h - max(host) < fraction * sum(owned)
        assert n_host_optimizers == (len(host) if overlap else int(bool(host)))  # one AdamW per parameter


def _moments(held) -> int:
    """Adam's moments and step counts on both sides (the optimizer bytes less the host's master copies, which
    are as large as its gradient copies)."""
    return held.device.optimizer + held.host.optimizer - held.host.grads


OWNED_BY_RANK = (35, 64)
"""megatron-core's cut of the model's gradient buffer over 2 ranks (optimizer_shards): the parameters in reverse
order, each starting at a multiple of 64 -- bias 3 [0, 3), weight 24 [64, 88), norm bias 8 [128, 136), norm
weight 8 [192, 200), bias 8 [256, 264), weight 48 [320, 368) -- padded to 384, rank 0 owning [0, 192) (3 + 24 +
8 elements), rank 1 [192, 384) (8 + 8 + 48)."""


def test_distributed_optimizer_halves_the_optimizer_bytes(offload_results):
    for name in VARIANTS:
        single = offload_results[0][(name, False)][2]
        shards = [r[(name, True)][2] for r in offload_results]
        assert sum(_moments(s) for s in shards) == _moments(single)  # every parameter's state held once
        total = sum(p.numel() for p in _model().parameters())
        assert sum(OWNED_BY_RANK) == total
        for r, want in zip(offload_results, OWNED_BY_RANK):  # each rank its half of the padded buffer
            _, _, held, _, owned, _ = r[(name, True)]
            assert _moments(held) == 8 * sum(owned) + 4 * len(owned)
            assert sum(owned) == want and len(owned) == 3


BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3", "--mock-data"]
OFFLOAD = ["--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--use-distributed-optimizer"]


@pytest.mark.parametrize("extra, expected", [
    (["--optimizer-offload-fraction", "-0.1"], "--optimizer-offload-fraction -0.1 is outside [0, 1]"),
    ([*OFFLOAD, "--optimizer-offload-fraction", "1.5"], "--optimizer-offload-fraction 1.5 is outside [0, 1]"),
    ([*OFFLOAD, "--optimizer-offload-fraction", "nan"], "--optimizer-offload-fraction nan is outside [0, 1]"),
    (["--optimizer-cpu-offload", "--use-distributed-optimizer"],
     "--optimizer-cpu-offload needs --use-precision-aware-optimizer"),
    (["--use-precision-aware-optimizer"], "--use-precision-aware-optimizer needs --use-distributed-optimizer"),
])
def test_bad_offload_flags_give_one_line(extra, expected, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(BASE + extra, world_size=2)
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pretrain_llama.py: error: ") and expected in lines[0], lines


def test_offload_flags_without_the_offload_are_noticed():
    config = parse_args(BASE + ["--overlap-cpu-optimizer-d2h-h2d", "--optimizer-offload-fraction", "0.3"],
                        world_size=2)
    assert ("note: --optimizer-offload-fraction, --overlap-cpu-optimizer-d2h-h2d: no effect without "
            "--optimizer-cpu-offload (as in Megatron-LM)") in config.flag_notices
    assert parse_args(BASE + OFFLOAD, world_size=2).flag_notices == ()


def test_optimizer_config_with_cpu_offload_builds_without_transformer_engine():
    """megatron-core 0.16's OptimizerConfig asks TE's version for the precision-aware optimizer and fails without TE;
    the driver's config for HybridDeviceOptimizer still carries the field, with store_param_remainders off as
    __post_init__ sets it below TE 2.1."""
    import importlib.util

    from megatron.core.optimizer import OptimizerConfig

    from h3t_training.loop.mcore_optimizer_limits import build_optimizer_config
    fields = dict(optimizer="adam", lr=1e-3, bf16=True, use_distributed_optimizer=True,
                  use_precision_aware_optimizer=True, optimizer_cpu_offload=True, optimizer_offload_fraction=0.5)
    cfg = build_optimizer_config(OptimizerConfig, fields)
    assert cfg.use_precision_aware_optimizer and cfg.optimizer_cpu_offload and cfg.optimizer_offload_fraction == 0.5
    if importlib.util.find_spec("transformer_engine") is None:
        assert cfg.store_param_remainders is False
    plain = build_optimizer_config(OptimizerConfig, dict(optimizer="adam", lr=1e-3, use_distributed_optimizer=True))
    assert not plain.use_precision_aware_optimizer and plain.store_param_remainders is True


def test_the_distributed_optimizer_with_torch_adam_cannot_load_and_says_why():
    """megatron-core without TE or apex (this machine) steps torch's Adam, whose per-parameter step its loaders drop
    (KeyError 'step' on an H200): the driver names that before loading; the CPU offload's HybridDeviceOptimizer and
    the plain optimizer load."""
    from types import SimpleNamespace

    from megatron.core.optimizer import distrib_optimizer

    from h3t_training.loop.mcore_optimizer_limits import distributed_optimizer_load_blocker

    def args(**kw):
        return SimpleNamespace(**{"use_distributed_optimizer": True, "optimizer_cpu_offload": False, **kw})
    assert distrib_optimizer.HAVE_APEX_OR_TE is False  # the CPU machines have neither
    assert "--no-load-optim" in distributed_optimizer_load_blocker(args())
    assert distributed_optimizer_load_blocker(args(optimizer_cpu_offload=True)) is None
    assert distributed_optimizer_load_blocker(args(use_distributed_optimizer=False)) is None
