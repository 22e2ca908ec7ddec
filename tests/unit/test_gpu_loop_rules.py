"""Rules of the GPU path the CPU tier cannot see by running: NCCL reduces CUDA tensors only, megatron-core's
distributed optimizer without TransformerEngine needs torch Adam's per-parameter ``step`` to load, and Megatron FSDP's
adapter has no DDP buffer list. Each was a failure of the first GPU run (docs/gpu-reports/)."""
from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from h3t_training.loop import collectives
from h3t_training.loop.mcore_buffers import ddp_buffers
from h3t_training.loop.optimizer import MegatronOptimizerAdapter

REPO = Path(__file__).resolve().parents[2]
COLLECTIVES = {"all_reduce", "reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor"}
HOST_MAKERS = {"tensor", "zeros", "ones", "empty", "full"}


def _host_made(call: ast.AST) -> bool:
    """``torch.tensor(...)`` / ``torch.zeros(...)`` ... without ``device=``: a CPU tensor."""
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr in HOST_MAKERS
            and isinstance(call.func.value, ast.Name) and call.func.value.id == "torch"
            and not any(k.arg == "device" for k in call.keywords))


def host_tensor_collectives(source: str) -> list[int]:
    """Lines where a ``dist`` collective gets a tensor made on the host in the same function (NCCL refuses it)."""
    bad = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        host = {t.id for node in ast.walk(fn) if isinstance(node, ast.Assign) and _host_made(node.value)
                for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(fn):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "dist" and node.args):
                arg = node.args[0]
                if _host_made(arg) or (isinstance(arg, ast.Name) and arg.id in host):
                    bad.append(node.lineno)
    return bad


def test_the_scan_finds_a_host_tensor_collective():
    src = "def f(g):\n    flag = torch.tensor([1])\n    dist.all_reduce(flag, group=g)\n    dist.all_reduce(torch.zeros(2))\n"
    assert host_tensor_collectives(src) == [3, 4]
    ok = "def f(g, d):\n    t = torch.zeros(2, device=d)\n    dist.all_reduce(t, group=g)\n"
    assert host_tensor_collectives(ok) == []


def test_no_collective_of_the_driver_or_runtime_takes_a_host_tensor():
    """Host values are reduced through collectives.all_reduce_host, which moves them to the group's device."""
    found = {str(p.relative_to(REPO)): lines for p in sorted([*REPO.glob("h3t_training/**/*.py"),
                                                               *REPO.glob("h3t_ext/**/*.py")])
             if p.name != "collectives.py" and (lines := host_tensor_collectives(p.read_text()))}
    assert found == {}


def test_collective_device_follows_the_backend(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collectives.collective_device() == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert collectives.collective_device() == torch.device("cpu")


def test_all_reduce_host_moves_the_value_and_back(monkeypatch):
    seen = []
    monkeypatch.setattr(collectives, "collective_device", lambda group=None: torch.device("meta"))
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None: seen.append(t.device))
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self: torch.full(self.shape, 7))
    out = collectives.all_reduce_host(torch.tensor([1]))
    assert seen == [torch.device("meta")] and out.tolist() == [7]


def _adapter(*optimizers):
    fake = SimpleNamespace(opt=SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=o) for o in optimizers]))
    return fake


def test_materialized_adam_state_is_torch_adams_first_state_and_keeps_existing_state():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([a, b], lr=0.1)
    b.grad = torch.ones(2)
    opt.step()  # b has state (step 1), a has none
    before = {k: v.clone() for k, v in opt.state[b].items()}
    MegatronOptimizerAdapter._materialize_state(_adapter(opt))
    assert float(opt.state[a]["step"]) == 0.0 and torch.equal(opt.state[a]["exp_avg"], torch.zeros(3))
    assert torch.equal(opt.state[a]["exp_avg_sq"], torch.zeros(3))
    assert all(torch.equal(opt.state[b][k], v) for k, v in before.items())
    # the state torch's own Adam makes at its first step has the same keys and kinds
    c = torch.nn.Parameter(torch.ones(3))
    ref = torch.optim.AdamW([c], lr=0.1)
    c.grad = torch.zeros(3)
    ref.step()
    assert set(ref.state[c]) == set(opt.state[a]) and ref.state[c]["step"].dtype == opt.state[a]["step"].dtype


def test_only_adam_members_are_materialized():
    p = torch.nn.Parameter(torch.ones(2))
    sgd = torch.optim.SGD([p], lr=0.1)
    MegatronOptimizerAdapter._materialize_state(_adapter(sgd))
    assert not sgd.state.get(p)


@pytest.mark.parametrize("chunk, expected", [
    (SimpleNamespace(buffers=["b0", "b1"]), ["b0", "b1"]),  # megatron-core DDP: its buffer list
    (torch.nn.Linear(2, 2), []),  # a module whose `buffers` is nn.Module.buffers (Megatron FSDP's adapter)
    (SimpleNamespace(), []),
])
def test_ddp_buffers(chunk, expected):
    assert ddp_buffers(chunk, "buffers") == expected


def test_megatron_fsdp_buffers_are_megatron_cores_and_counted_once():
    """Megatron FSDP keeps its weights, main gradients and main weights in the parameter groups of the adapter's
    ``param_and_grad_buffer`` (not in DDP's ``buffers``): the measured state_bytes count each buffer once, in the
    category the cost model gives it. The names are megatron-core's own, read from its classes: every buffer field of
    the installed version (0.16.1 here; 0.19.2's renamed hybrid-sharding buffers are in the list too) has a
    category."""
    import dataclasses
    import inspect

    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as mfsdp

    from h3t_training.loop.mcore_buffers import FSDP_BUFFERS, fsdp_buffers
    from h3t_training.telemetry.state_bytes import measure

    fields = {f.name for f in dataclasses.fields(mfsdp.ParameterGroup)}
    buffers = {f for f in fields if f.endswith(("_buffer", "buf"))}
    assert buffers <= {name for name, _ in FSDP_BUFFERS} and len(buffers) >= 5
    assert {"model_weight_buffer", "main_grad_buffer", "main_weight_buffer", "transpose_weight_buffer"} <= buffers
    assert "self.param_and_grad_buffer = " in inspect.getsource(FullyShardedDataParallel.__init__)
    from megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp import MegatronFSDP
    assert "self.param_and_grad_buffer.parameter_groups" in inspect.getsource(MegatronFSDP)  # megatron-core's own path
    assert "self.data = data" in inspect.getsource(mfsdp.DataParallelBuffer.init_data)

    weights, grads, main = torch.zeros(10, dtype=torch.bfloat16), torch.zeros(10), torch.zeros(10)
    group = mfsdp.ParameterGroup(params=[], model_weight_buffer=SimpleNamespace(data=weights),
                                 main_grad_buffer=SimpleNamespace(data=grads), main_weight_buffer=SimpleNamespace(data=main),
                                 transpose_weight_buffer=SimpleNamespace(data=None))  # a buffer not yet allocated
    chunk = torch.nn.Module()
    chunk.param_and_grad_buffer = SimpleNamespace(parameter_groups=[group, group])  # one group seen twice
    assert [c for c, _ in fsdp_buffers(chunk)] == ["params", "grads", "optimizer"] * 2
    assert list(fsdp_buffers(torch.nn.Linear(2, 2))) == []  # DDP or no wrapper: nothing
    adam_state = torch.zeros(20)
    fake = SimpleNamespace(chunks=[chunk], opt=SimpleNamespace(chained_optimizers=[SimpleNamespace(
        optimizer=SimpleNamespace(param_groups=[{"params": [main]}], state={main: {"exp_avg": adam_state}}))]))
    held = measure(MegatronOptimizerAdapter.state_tensors(fake))  # placed by device: these CPU tensors on the host
    assert (held.host.params, held.host.grads, held.host.optimizer) == (20, 40, 40 + 80)  # main weights + moment
    assert held.device.params == held.device.grads == held.device.optimizer == 0


def test_megatron_loop_needs_the_dataset_makefile(tmp_path, monkeypatch, capsys):
    """Megatron's initialize_megatron runs make in megatron/core/datasets: without Megatron-LM's Makefile (a wheel)
    pretrain_gpt.py says so in one line and runs the driver."""
    import importlib.util

    import pretrain_gpt
    from h3t_training.loop import megatron_native

    folder = tmp_path / "datasets"
    folder.mkdir()
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: SimpleNamespace(submodule_search_locations=[str(folder)]))
    assert "has no Makefile" in megatron_native.missing_dataset_makefile()
    monkeypatch.setattr(megatron_native, "available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not pretrain_gpt.use_megatron_loop(["--num-layers", "2"], note=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pretrain_gpt.py: note: Megatron's own training loop cannot start")
    (folder / "Makefile").write_text("all:\n")
    assert megatron_native.missing_dataset_makefile() is None
    assert pretrain_gpt.use_megatron_loop(["--num-layers", "2"], note=True)
    assert not pretrain_gpt.use_megatron_loop(["--num-layers", "2", "--auto-plan"])  # a driver-only flag


def test_megatron_loop_on_a_node_with_fewer_gpus_than_ranks_is_one_line(monkeypatch, capsys):
    """Megatron's own loop sets each rank's device to its local rank (a traceback past the last GPU): pretrain_gpt.py
    says so in one line before Megatron starts."""
    import pretrain_gpt
    from h3t_training.loop import megatron_native

    for k, v in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "6000"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(pretrain_gpt, "use_megatron_loop", lambda argv, note=False: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    started = []
    monkeypatch.setattr(megatron_native, "run", lambda *a, **k: started.append(a) or 0)
    assert pretrain_gpt.main(["--num-layers", "2"]) == 2 and not started
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["pretrain_gpt.py: error: the launcher starts 4 ranks on this node but it shows 2 CUDA devices "
                   "(NCCL takes one GPU per rank): start at most 2 per node (torchrun --nproc-per-node 2, mpirun "
                   "--npernode 2) or make more GPUs visible (CUDA_VISIBLE_DEVICES)"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert pretrain_gpt.main(["--num-layers", "2"]) == 0 and len(started) == 1


@pytest.mark.parametrize("rank, local_rank, said", [(4, 0, True), (5, 1, False)])
def test_megatron_loop_on_another_node_short_of_gpus_is_said_by_its_first_rank(monkeypatch, capsys, rank, local_rank,
                                                                              said):
    """Nodes of one job may differ (rank 0's may have its GPUs): a short node's first rank says the line, with its
    host and rank; its other ranks do not."""
    import pretrain_gpt
    from h3t_training.config.feature_checks import gpu_slots_refusal
    from h3t_training.errors import node_line
    from h3t_training.loop import megatron_native

    for k, v in {"RANK": str(rank), "WORLD_SIZE": "8", "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": "4",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "6000"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(pretrain_gpt, "use_megatron_loop", lambda argv, note=False: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(megatron_native, "run", lambda *a, **k: 0)
    assert pretrain_gpt.main(["--num-layers", "2"]) == 2
    expected = f"pretrain_gpt.py: error: {node_line(gpu_slots_refusal(4, 2), rank)}\n" if said else ""
    assert capsys.readouterr().err == expected
