"""Llama 3.x's RoPE scaling and linear position interpolation through pretrain_llama.py (Megatron-LM's
--use-rope-scaling, --rope-scaling-factor, --rotary-seq-len-interpolation-factor; its gpt_builders hands them to
GPTModel, which hands them to megatron-core's RotaryEmbedding).

The driver's model rotates by exactly the angles megatron-core's own RotaryEmbedding computes for the same flags (the
host copy of the embedding must not drop them); each flag changes the trained losses; context parallelism (the
positions cut in Megatron's 2c chunks) keeps the single rank's losses with them; and the flags are refused in one
line where they would do nothing."""
from __future__ import annotations

import pytest

from driver_harness import check_ok, metrics, run_pretrain
from h3t_ext.testing import run_distributed

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
         "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "64", "--lr", "1e-3",
         "--lr-decay-style", "constant", "--log-interval", "1", "--no-progress-bar", "--seed", "7", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--micro-batch-size", "1",
         "--global-batch-size", "2", "--train-iters", "2", "--eval-iters", "0", "--position-embedding-type", "rope",
         "--rotary-base", "500000"]  # Llama 3's base: its lowest frequencies fall in the band the scaling divides
SCALED = ["--use-rope-scaling", "--rope-scaling-factor", "32"]
INTERPOLATED = ["--rotary-seq-len-interpolation-factor", "4"]


def _angles(rank: int, world_size: int, flags: list[str]):
    """(the driver's rotation angles for 64 positions, megatron-core RotaryEmbedding's for the same flags)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron.core import parallel_state as ps

    from h3t_training.config.sections import parse_args
    from h3t_training.loop.model_provider import build_model_chunks

    args = parse_args([*MODEL, *flags], world_size=world_size)
    ps.initialize_model_parallel()  # one rank: the default group is run_distributed's
    (chunk,) = build_model_chunks(args, on_gpu=False, vocab_size=256)
    stock = RotaryEmbedding(kv_channels=args.kv_channels, rotary_percent=1.0, rotary_base=args.rotary_base,
                            rope_scaling=args.use_rope_scaling, rope_scaling_factor=args.rope_scaling_factor,
                            seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
                            use_cpu_initialization=True)
    return chunk.rotary_pos_emb.get_freqs_non_repeated(64), stock.get_freqs_non_repeated(64)


@pytest.mark.parametrize("flags", [[], SCALED, INTERPOLATED, [*SCALED, *INTERPOLATED]],
                         ids=["plain", "scaled", "interpolated", "both"])
def test_the_model_rotates_by_megatron_cores_angles_for_the_flags(flags):
    (got, stock), = run_distributed(_angles, 1, (flags,))
    assert got.dtype == stock.dtype and bool((got == stock).all())
    if flags:
        (plain, _), = run_distributed(_angles, 1, ([],))
        assert not bool((got == plain).all())


def _losses(tmp_path, name: str, flags: list[str], nproc: int = 1) -> list[float]:
    out = tmp_path / f"{name}.json"
    check_ok(run_pretrain([*MODEL, *flags, "--metrics-json", str(out)], nproc=nproc))
    return [r["loss"] for r in metrics(out)["iterations"]]


def test_each_flag_trains_its_own_model_and_context_parallelism_keeps_it(tmp_path):
    plain = _losses(tmp_path, "plain", [])
    scaled = _losses(tmp_path, "scaled", [*SCALED, *INTERPOLATED])
    assert scaled[1] != plain[1] and scaled[1] != pytest.approx(plain[1], rel=1e-6)
    cp2 = _losses(tmp_path, "cp2", [*SCALED, *INTERPOLATED, "--context-parallel-size", "2"], nproc=2)
    assert cp2 == pytest.approx(scaled, rel=1e-5, abs=0)


@pytest.mark.parametrize("flags, message", [
    (["--position-embedding-type", "learned_absolute", "--use-rope-scaling"],
     "--use-rope-scaling scales rotary positions; this run has --position-embedding-type learned_absolute"),
    (["--rope-scaling-factor", "16"], "--rope-scaling-factor 16.0 needs --use-rope-scaling"),
    (["--use-rope-scaling", "--rope-scaling-factor", "0"], "--rope-scaling-factor 0.0 is outside (0, inf)"),
    (["--rotary-seq-len-interpolation-factor", "0"], "--rotary-seq-len-interpolation-factor 0 is outside [1, inf)"),
], ids=["learned-positions", "factor-alone", "zero-factor", "zero-interpolation"])
def test_flags_that_would_do_nothing_or_break_are_one_line(tmp_path, flags, message):
    proc = run_pretrain([*MODEL, *flags])
    assert proc.returncode == 2
    assert message in proc.stderr and proc.stderr.strip().count("\n") == 0, proc.stderr
