"""torch FSDP2 (--use-torch-fsdp2) through megatron-core's TorchFullyShardedDataParallel on CPU (gloo), and the
one-line refusals of what megatron-core / Megatron-LM refuse with it and of Megatron FSDP.

An FSDP2 run saved halfway resumes bit-exact (its losses, its measured ``state_bytes`` and its checkpoint at the
end, parameters and Adam moments, equal the uninterrupted run's), at d=2, t=2 x d=2, and d=3 (dim 0 of every
parameter uneven over 3 ranks: 64 rows are 22, 22, 20); a run without FSDP2 loads the FSDP2 checkpoint and continues
within 1e-6 relative of the FSDP2 run.

From one checkpoint of a single-rank run, d=2 (and t=2 with sequence parallelism x d=2) with FSDP2 and --ckpt ours
gives the single-rank losses within 1e-6 relative, and every rank's measured ``state_bytes`` (DTensor local shards) are half the single rank's parameters,
gradients and Adam moments (the tiny Llama's dimensions are all even, so FSDP2's dim-0 shards are exact halves
without padding); Adam's step counts (one 4-byte scalar per parameter) stay whole on each rank."""
from __future__ import annotations

import pytest
import torch

from driver_harness import TINY_MODEL, check_ok, losses, metrics, read_common, run_pretrain, single_rank_reference
from h3t_training.config.sections import parse_args

COMMON = ["--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "4", "--lr-warmup-iters", "1",
          "--make-vocab-size-divisible-by", "256", "--ckpt", "ours", "--mock-data"]
BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64",
        "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3", "--mock-data"]
N_PARAMS = 27  # embedding, 4 x 6 per layer, final norm, output layer (test_optimizer_offload_driver's shapes)


def _error(argv, capsys, prog="pretrain_llama.py", world_size=2) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, prog=prog, world_size=world_size)
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("extra, expected", [
    (["--use-megatron-fsdp"], "--use-megatron-fsdp is not supported: megatron-core 0.16.1's MegatronFSDP needs CUDA"),
    (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"],
     "--use-megatron-fsdp is not supported"),
    (["--data-parallel-sharding-strategy", "optim_grads"],
     "--data-parallel-sharding-strategy optim_grads is Megatron FSDP's and needs --use-megatron-fsdp"),
    (["--data-parallel-sharding-strategy", "bogus"], "argument --data-parallel-sharding-strategy: invalid choice"),
    (["--torch-fsdp2-no-reshard-after-forward"], "--torch-fsdp2-no-reshard-after-forward needs --use-torch-fsdp2"),
    (["--use-torch-fsdp2", "--pipeline-model-parallel-size", "2"],
     "--use-torch-fsdp2 is not supported with --pipeline-model-parallel-size 2 (pipeline parallelism)"),
    (["--use-torch-fsdp2", "--use-distributed-optimizer"],
     "--use-torch-fsdp2 is not supported with --use-distributed-optimizer"),
    (["--use-torch-fsdp2", "--fp16"], "--use-torch-fsdp2 is not supported with --fp16"),
    (["--use-torch-fsdp2", "--calculate-per-token-loss"],
     "--use-torch-fsdp2 is not supported with --calculate-per-token-loss (megatron-core's torch FSDP2"),
])
def test_sharding_flags_are_refused_in_one_line(extra, expected, capsys, tmp_path):
    extra = [str(tmp_path) if a == "{tmp}" else a for a in extra]
    assert expected in _error(BASE + extra, capsys)


def test_fsdp2_save_is_refused_on_a_gpu_only(monkeypatch, capsys, tmp_path):
    """The CPU path saves FSDP2's shards; megatron-core's GPU optimizer cannot map its state to them."""
    assert parse_args(BASE + ["--use-torch-fsdp2", "--save", str(tmp_path)], world_size=2).save == str(tmp_path)
    from h3t_training.config import feature_checks
    monkeypatch.setattr(feature_checks, "cuda_available", lambda: True)  # as on a GPU host
    assert "--use-torch-fsdp2 is not supported with --save on a GPU (megatron-core's optimizer" in \
        _error(BASE + ["--use-torch-fsdp2", "--save", str(tmp_path)], capsys)


def test_torch_fsdp2_needs_untied_embeddings(capsys):
    """pretrain_gpt.py ties them by default (Megatron-LM); pretrain_llama.py unties them."""
    line = _error(BASE + ["--use-torch-fsdp2"], capsys, prog="pretrain_gpt.py")
    assert "--use-torch-fsdp2 is not supported with tied embedding and output weights" in line
    assert parse_args(BASE + ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"], prog="pretrain_gpt.py",
                      world_size=2).use_torch_fsdp2


def test_accepted_sharding_flags():
    """no_shard is Megatron-LM's default (no sharding); --use-torch-fsdp2 at t=2 d=2 is accepted."""
    assert parse_args(BASE + ["--data-parallel-sharding-strategy", "no_shard"], world_size=2).data_parallel_size == 2
    cfg = parse_args(BASE + ["--use-torch-fsdp2", "--torch-fsdp2-no-reshard-after-forward"], world_size=2)
    assert cfg.use_torch_fsdp2 and not cfg.torch_fsdp2_reshard_after_forward


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory):
    argv = [*TINY_MODEL, *COMMON]
    ckpt, ref = single_rank_reference(tmp_path_factory.mktemp("single"), argv)
    assert len(ref["iterations"]) == 3 and len({r["loss"] for r in ref["iterations"]}) == 3
    return argv, ckpt, ref


def _fsdp2_run(single_rank, flags, nproc, tmp_path) -> dict:
    """The metrics of an FSDP2 run from the single-rank checkpoint, its losses checked against the single rank's."""
    argv, ckpt, ref = single_rank
    out = tmp_path / "m.json"
    check_ok(run_pretrain([*argv, "--use-torch-fsdp2", *flags, "--load", str(ckpt), "--metrics-json", str(out)],
                          nproc=nproc))
    want = [r["loss"] for r in ref["iterations"]]
    assert len(losses(out)) == len(want)
    for a, b in zip(want, losses(out)):
        assert abs(a - b) <= 1e-6 * abs(a), (want, losses(out))
    return metrics(out)


def test_fsdp2_t2_sp_d2_gives_the_single_rank_losses(single_rank, tmp_path):
    got = _fsdp2_run(single_rank, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 4, tmp_path)
    assert len(got["state_bytes"]) == 4


@pytest.mark.parametrize("flags", [[], ["--torch-fsdp2-no-reshard-after-forward"]], ids=["reshard", "no-reshard"])
def test_fsdp2_d2_gives_the_single_rank_losses_with_half_the_state(single_rank, flags, tmp_path):
    ref = single_rank[2]
    got = _fsdp2_run(single_rank, flags, 2, tmp_path)
    (one,) = ref["state_bytes"]
    steps = 4 * N_PARAMS
    assert one["device"]["params"] == 4 * 213568  # the tiny Llama's 213,568 float32 parameters
    assert one["device"]["optimizer"] == 2 * one["device"]["params"] + steps
    assert len(got["state_bytes"]) == 2
    for rank in got["state_bytes"]:
        assert rank["device"] == {"params": one["device"]["params"] // 2, "grads": one["device"]["grads"] // 2,
                                  "optimizer": (one["device"]["optimizer"] - steps) // 2 + steps}, rank
        assert rank["host"] == {"params": 0, "grads": 0, "optimizer": 0}
    # the cost model prices this run's FSDP2 (the driver's own translation of the same flags) with these bytes
    from h3t_ext.costmodel.memory import stage_state_bytes
    from h3t_training.config.run_spec import model_spec, run_plan
    config = parse_args([*single_rank[0], "--use-torch-fsdp2", *flags], world_size=2)
    plan = run_plan(config)
    assert plan.use_torch_fsdp2 and plan.torch_fsdp2_reshard_after_forward == (not flags)
    predicted = stage_state_bytes(model_spec(config, 512), plan, 0, param_bytes=4, master_weights=False)
    for rank in got["state_bytes"]:
        for kind in ("params", "grads"):
            assert predicted["device"][kind] == rank["device"][kind], (kind, predicted, rank)
        assert abs(predicted["device"]["optimizer"] - rank["device"]["optimizer"]) <= steps  # Adam's step counts


SAVE_LAYOUTS = {  # name: (FSDP2 flags, ranks; the run without FSDP2 that loads its checkpoint: flags, ranks)
    "d2": ([], 2, [], 2),
    "t2-sp-d2": (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 4, [], 1),
    "d3-uneven": (["--global-batch-size", "6"], 3, ["--global-batch-size", "6"], 1),
}


def _tensors(directory, out):
    """Every tensor of a checkpoint directory by key (read whole by torch.distributed.checkpoint, one process)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(str(directory), str(out))
    return {k: v for k, v in torch.load(out, weights_only=False).items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("layout", list(SAVE_LAYOUTS))
def test_fsdp2_saves_and_resumes_bit_exact(layout, tmp_path):
    flags, nproc, other_flags, other_nproc = SAVE_LAYOUTS[layout]
    argv = [*TINY_MODEL, *COMMON]
    fsdp2 = [*argv, "--use-torch-fsdp2", *flags]
    full, resumed, other = (tmp_path / f"{n}.json" for n in ("full", "resumed", "other"))
    check_ok(run_pretrain([*fsdp2, "--save", str(tmp_path / "a"), "--save-interval", "2", "--metrics-json", str(full)],
                          nproc=nproc))
    proc = run_pretrain([*fsdp2, "--load", str(tmp_path / "a"), "--ckpt-step", "2", "--save", str(tmp_path / "b"),
                         "--metrics-json", str(resumed)], nproc=nproc)
    check_ok(proc)
    assert "iterations from 2" in proc.stdout and "resharded" not in proc.stdout  # RNG states restored too
    want = losses(full)
    assert len(want) == 4 and len(set(want)) == 4
    assert losses(resumed) == want[2:]
    assert metrics(resumed)["state_bytes"] == metrics(full)["state_bytes"]

    saved = _tensors(tmp_path / "a" / "iter_0000002", tmp_path / "a2.pt")
    ends = [_tensors(tmp_path / d / "iter_0000004", tmp_path / f"{d}4.pt") for d in ("a", "b")]
    moments = [k for k in saved if k.startswith("optimizer.state.exp_avg")]
    assert len(moments) == 2 * 9 and sorted(ends[0]) == sorted(ends[1]) == sorted(saved)  # 9 keys: layers stacked
    assert all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])  # weights and Adam moments, bit for bit
    assert not any(torch.equal(saved[k], ends[0][k]) for k in moments)  # (they moved in iterations 3 and 4)
    steps = [read_common(tmp_path / d / it)["optimizer"]["steps"]
             for d, it in (("a", "iter_0000002"), ("a", "iter_0000004"), ("b", "iter_0000004"))]
    assert steps == [2, 4, 4]

    check_ok(run_pretrain([*argv, *other_flags, "--load", str(tmp_path / "a"), "--ckpt-step", "2",
                           "--metrics-json", str(other)], nproc=other_nproc))
    assert len(losses(other)) == 2
    for a, b in zip(want[2:], losses(other)):
        assert abs(a - b) <= 1e-6 * abs(a), (want, losses(other))
