"""Kernels and context parallelism of the structural time model: tile/wave quantization and the
memory-bound regime of GEMMs, flash attention by chunk, the context-parallel K/V ring against each step's
attention, and the K/V buffer (pure arithmetic)."""
import pytest

from h3t_ext.costmodel import Plan, estimate, get_model, get_system
from h3t_ext.costmodel.collectives import p2p_seconds
from h3t_ext.costmodel.kernels import flash_attention_seconds, gemm_seconds, kernel_rates, wgrad_seconds
from h3t_ext.costmodel.memory import stage_memory
from h3t_ext.costmodel.timing import _cp_link, attention_seconds

H800 = get_system("h800")
M65 = get_model("llama-65b")
R = kernel_rates(H800)


def cp_plan(**kw):
    base = dict(num_gpus=64, seq_length=4096, global_batch_size=256, tensor_model_parallel_size=1,
                context_parallel_size=4, pipeline_model_parallel_size=8, num_layers_per_virtual_pipeline_stage=2,
                ckpt="ours")
    base.update(kw)
    return Plan(**base)


def test_wave_quantization():
    """One tile more than the SMs hold takes a second wave: almost twice the time of a full wave."""
    tm, tn = H800.gemm_tile_m, H800.gemm_tile_n
    rows, cols = 12, 11  # 132 tiles, one per SM, far from the memory-bound regime
    assert rows * cols == H800.num_sms
    full = gemm_seconds(tm * rows, tn * cols, 8192, R)
    one_more = gemm_seconds(tm * rows + 1, tn * cols, 8192, R)  # a 13th row of tiles: 143 tiles
    assert one_more / full == pytest.approx(2.0, rel=0.05)
    # a tile that is mostly empty costs a whole tile (tile quantization)
    assert gemm_seconds(tm * rows - tm + 1, tn * cols, 8192, R) == pytest.approx(full)


def test_thin_gemms_are_memory_bound_and_small_k_is_slow():
    big = gemm_seconds(8192, 8192, 8192, R)
    assert big == pytest.approx(2 * 8192**3 / (H800.peak_bf16_flops * H800.efficiency("gemm_peak_fraction")),
                                rel=0.1)
    # [8, 8192] x [8192, 8192]: a few rows read the whole weight; HBM traffic sets the time
    thin = gemm_seconds(8, 8192, 8192, R)
    assert thin >= 2 * 8192 * 8192 / R.hbm
    # same FLOPs with K = 512 instead of 8192: the per-tile prologue/epilogue makes it slower per FLOP
    small_k = gemm_seconds(8192, 8192 * 16, 512, R)
    assert small_k > 1.1 * big


def test_wgrad_accumulates_into_fp32_main_grads():
    tokens = 64  # few tokens: the fp32 read + write of the main grad dominates
    assert wgrad_seconds(8192, 8192, tokens, R) >= 8192 * 8192 * 8 / R.hbm
    assert wgrad_seconds(8192, 8192, 8192, R) == pytest.approx(gemm_seconds(8192, 8192, 8192, R), rel=0.05)


def test_flash_attention_by_chunk_and_head_dim():
    causal = flash_attention_seconds(64, 4096, 4096, 128, R, causal=True, backward=False)
    full = flash_attention_seconds(64, 4096, 4096, 128, R, causal=False, backward=False)
    assert full / causal == pytest.approx(2.0, rel=0.02)
    bwd = flash_attention_seconds(64, 4096, 4096, 128, R, causal=True, backward=True)
    # 2.5x the forward's FLOPs at the backward's lower rate (0.85 of the forward's, measured and stated)
    assert R.attention_backward_fraction == 0.85
    assert bwd / causal == pytest.approx(2.5 / 0.85, rel=0.02)
    # same FLOPs at head dim 64 is slower (softmax work per score is not amortised over d)
    assert flash_attention_seconds(128, 4096, 4096, 64, R, causal=True, backward=False) > 1.05 * causal


def test_ring_exchange_hides_behind_long_steps_and_shows_for_short_ones():
    long_plan = cp_plan(seq_length=32768, context_parallel_size=2, num_gpus=32)
    a = attention_seconds(M65, long_plan, H800, R)
    assert a["cp_fwd"] == 0.0 and a["cp_bwd"] == 0.0
    short = cp_plan(seq_length=2048, context_parallel_size=8, num_gpus=128, global_batch_size=128)
    s = attention_seconds(M65, short, H800, R)
    assert s["cp_fwd"] > 0.0 and s["cp_bwd"] > s["cp_fwd"]
    # never more than the exchanges themselves: c - 1 sends forward, of K and V
    q = 2048 // 8
    send = p2p_seconds(q * 2 * M65.kv_hidden_size * 2, _cp_link(short, H800))
    assert s["cp_fwd"] <= 7 * send + 1e-12


def test_shorter_rank_sequence_costs_attention_efficiency():
    """The c steps of a ring over s/c-token chunks take at least the attention of the whole causal sequence
    divided by c (quantization of fewer blocks can only add)."""
    for c in (2, 4, 8):
        plan = cp_plan(context_parallel_size=c, num_gpus=16 * c)
        ring = attention_seconds(M65, plan, H800, R)["fwd"]
        whole = flash_attention_seconds(64, 4096, 4096, 128, R, causal=True, backward=False)
        assert ring >= whole / c * 0.99


def test_estimate_prices_cp_only_with_cp():
    e4 = estimate(M65, cp_plan(seq_length=2048, context_parallel_size=8, num_gpus=128, global_batch_size=128,
                               offload_alpha=0.8), H800)
    e1 = estimate(M65, cp_plan(context_parallel_size=1, num_gpus=16, global_batch_size=64, offload_alpha=0.8), H800)
    assert e1.closed_form.cp_comm == 0.0
    assert e4.closed_form.cp_comm > 0.0


def test_cp_kv_gather_buffer():
    for t, c in ((1, 4), (2, 2), (2, 1)):
        plan = cp_plan(tensor_model_parallel_size=t, context_parallel_size=c, num_gpus=8 * t * c * 2)
        terms = stage_memory(M65, plan, 0, 0.0).terms
        want = 4096 * 2 * M65.kv_hidden_size // t * 2 if c > 1 else 0
        assert terms["cp_kv_gather_buffer"] == want
