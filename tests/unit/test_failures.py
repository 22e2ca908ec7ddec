"""h3t_training.launch.failures in-process: what each known failure and Ctrl-C become (one line, exit status), and a
checkpoint load whose failure is a BaseException (PyTorch DCP's CheckpointException)."""
from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest
import torch

from driver_harness import TINY_MODEL
from h3t_training.launch import failures
from h3t_training.config.sections import parse_args

PP2 = [*TINY_MODEL, "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "2", "--mock-data",
       "--pipeline-model-parallel-size", "2"]


@pytest.fixture(autouse=True)
def no_model_parallel_groups():
    """These tests stand for a rank whose megatron-core groups do not exist yet (or no more): groups another
    in-process test of the same pytest run left behind would give every rank that test's pipeline stage."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    yield


@pytest.fixture(scope="module")
def pp2_args():
    return parse_args(PP2, world_size=2)


def _reported(body, args=None, rank=0):
    def run(progress):
        progress.args = args
        return body(progress)
    return failures.run_reported(run, prog="pretrain_llama.py", rank=rank)


@pytest.mark.parametrize("error, where", [
    (RuntimeError("[enforce fail at alloc_cpu.cpp:118] data. DefaultCPUAllocator: can't allocate memory: you tried "
                  "to allocate 1073741824 bytes. Error code 12 (Cannot allocate memory)"), "CPU"),
    (MemoryError(), "CPU"),
    (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB."), "CPU"),  # on a CPU run
])
def test_out_of_memory_is_one_line_naming_stage_terms_and_flags(pp2_args, capsys, error, where):
    from h3t_ext.costmodel.memory import stage_memory
    from h3t_training.config.run_spec import model_spec, run_plan
    from h3t_training.data.tokenizer import padded_vocab_size, tokenizer_from_args

    def body(progress):
        raise error

    assert _reported(body, pp2_args, rank=1) == failures.EXIT_OUT_OF_MEMORY
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith(f"pretrain_llama.py: error: rank 1 (pipeline stage 1 of 2): out of {where} memory "
                           f"({type(error).__name__}")
    vocab = padded_vocab_size(tokenizer_from_args(pp2_args).vocab_size, pp2_args.make_vocab_size_divisible_by, 1)
    terms = stage_memory(model_spec(pp2_args, vocab), run_plan(pp2_args), 1, 0.0).terms
    top = sorted(terms, key=lambda k: -terms[k])[:3]
    assert line.index(f"largest terms for this stage: {top[0]} ") < line.index(f", {top[1]} ") < line.index(f", {top[2]} ")
    assert "--offload-alpha (now 0" in line and "--ckpt ours (now no)" in line
    assert "more pipeline stages (--pipeline-model-parallel-size, now 2)" in line


def test_the_stage_before_the_groups_exist_follows_megatrons_rank_order(pp2_args):
    assert [failures.pipeline_rank(pp2_args, r) for r in (0, 1)] == [0, 1]


def test_an_unknown_error_keeps_its_traceback(pp2_args):
    def body(progress):
        raise RuntimeError("an internal bug")
    with pytest.raises(RuntimeError, match="an internal bug"):
        _reported(body, pp2_args)


@pytest.mark.parametrize("rank", [0, 1])
def test_sigint_is_one_line_from_rank_0_and_status_130(pp2_args, tmp_path, capsys, rank):
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("2\n")
    args = pp2_args.replace(save=str(save))

    def body(progress):
        progress.iteration = 3
        try:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C at the terminal
            for _ in range(10_000):  # the handler runs at the next bytecode
                pass
            raise AssertionError("SIGINT did not stop the run")
        finally:
            os.kill(os.getpid(), signal.SIGINT)  # the launcher forwards it again while the rank unwinds
            raise RuntimeError("Connection closed by peer")  # and a collective fails because a peer stopped

    previous = signal.getsignal(signal.SIGINT)
    try:
        assert _reported(body, args, rank=rank) == failures.EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGINT, previous)
    err = capsys.readouterr().err
    expected = ["pretrain_llama.py: interrupted at iteration 3; last complete checkpoint: iteration 2"] if rank == 0 else []
    assert err.strip().splitlines() == expected


def test_a_checkpoint_load_failing_with_a_base_exception_is_one_checkpoint_error(monkeypatch, tmp_path):
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    from h3t_training.loop import checkpointing as ckpt_io

    inner = RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory")
    monkeypatch.setattr(dist_checkpointing, "load", lambda template, directory: (_ for _ in ()).throw(
        CheckpointException("load failed", {0: (inner, None)})))
    monkeypatch.setattr(ckpt_io, "_sharded_state", lambda *a, **k: {})
    monkeypatch.setattr(ckpt_io, "verify_layout", lambda *a: None)  # the files are in place: DCP still fails
    found = ckpt_io.FoundCheckpoint(str(tmp_path / "iter_0000001"), 1, True, {})
    args = parse_args([*TINY_MODEL, "--global-batch-size", "2", "--train-iters", "2", "--mock-data", "--load", str(tmp_path)])
    with pytest.raises(ckpt_io.CheckpointError) as e:
        ckpt_io.load_checkpoint(found, args, [], SimpleNamespace(load_blocker=lambda: None))
    assert str(e.value) == (f"checkpoint {tmp_path / 'iter_0000001'} cannot be loaded into this model: RuntimeError: "
                            "PytorchStreamReader failed reading zip archive: failed finding central directory")


@pytest.mark.parametrize("rank", [0, 1])
def test_replicas_with_other_weights_are_said_once_by_rank_0_with_status_5(pp2_args, capsys, rank):
    from h3t_training.loop.sdc_guards import WeightHashMismatchError

    def body(progress):
        progress.args = pp2_args
        raise WeightHashMismatchError("iteration 4: the weights differ across data-parallel replicas")

    assert failures.run_reported(body, prog="pretrain_llama.py", rank=rank) == failures.EXIT_SILENT_DATA_CORRUPTION
    err = capsys.readouterr().err
    assert err == ("pretrain_llama.py: error: iteration 4: the weights differ across data-parallel replicas\n"
                   if rank == 0 else "")


def test_the_weight_hash_mismatch_line_names_the_odd_ranks_of_each_replica_set():
    from h3t_training.loop.sdc_guards import mismatch_line

    good, bad = "a" * 64, "b" * 64
    # 8 ranks: tensor ranks 0/1 on one stage, 4 data-parallel replicas each; rank 5 (tensor rank 1) differs
    digests = [(r, (0, r % 2), bad if r == 5 else good) for r in range(8)]
    assert mismatch_line(6, 3, [(r, k, good) for r, k, _ in digests]) is None
    line = mismatch_line(6, 3, digests)
    assert line == ("iteration 6: the weights differ across data-parallel replicas "
                    "(--check-weight-hash-across-dp-replicas-interval 3): pipeline stage 0, tensor rank 1: rank 5 "
                    "holds other weights than ranks 1, 3, 7; stopped before saving (silent data corruption: check "
                    "the hardware of the ranks named)")
    two = mismatch_line(2, 1, [(0, (0, 0), good), (1, (0, 0), bad)])  # a tie: the lowest rank is the reference
    assert "tensor rank 0: rank 1 holds other weights than rank 0;" in two
