"""Small context shards: exposed context-parallel K/V traffic under its data dependencies, the K/V gather
buffer, and weight-gradient GEMMs bound by the fp32 main-grad traffic (pure arithmetic)."""
import pytest

from h3t_ext.costmodel import Plan, estimate, get_model, get_system
from h3t_ext.costmodel.memory import stage_memory
from h3t_ext.costmodel.timing import _cp_exposed, _layer_times, _rates

H800 = get_system("h800")
M65 = get_model("llama-65b")


def cp_plan(**kw):
    base = dict(num_gpus=64, seq_length=4096, global_batch_size=256, tensor_model_parallel_size=1,
                context_parallel_size=4, pipeline_model_parallel_size=8, num_layers_per_virtual_pipeline_stage=2,
                ckpt="ours")
    base.update(kw)
    return Plan(**base)


@pytest.fixture(scope="module")
def lt():
    return _layer_times(M65, cp_plan(), _rates(H800))


def test_small_gather_hides_and_large_gather_cannot(lt):
    assert _cp_exposed(0.1 * lt["kv_gemm"], lt, overlap=True, full_recompute=False) == 0.0
    for gather in (0.5 * lt["q_gemm"], lt["qkv_gemm"], 3 * lt["qkv_gemm"]):
        on = _cp_exposed(gather, lt, overlap=True, full_recompute=False)
        off = _cp_exposed(gather, lt, overlap=False, full_recompute=False)
        assert 0.0 <= on <= off
        # the forward gather cannot start before the K GEMM ends, so it hides behind at most the V and Q GEMMs
        assert on >= gather - lt["kv_gemm"] - lt["q_gemm"] - 1e-15


def test_backward_regather_hides_behind_mlp_backward(lt):
    gather = lt["qkv_gemm"]  # far shorter than the MLP + projection backward
    assert _cp_exposed(gather, lt, overlap=False, full_recompute=False) == pytest.approx(2 * gather)
    huge = 10 * lt["gemm_f"]
    mlp_bwd = 2 * (lt["gemm_f"] - lt["qkv_gemm"])
    assert _cp_exposed(huge, lt, overlap=False, full_recompute=False) == pytest.approx(3 * huge - mlp_bwd)


def test_full_recompute_gathers_twice_forward(lt):
    gather = 3 * lt["qkv_gemm"]
    on = _cp_exposed(gather, lt, overlap=True, full_recompute=True)
    fwd_rs = _cp_exposed(gather, lt, overlap=True, full_recompute=False)  # regather hidden here
    assert on > fwd_rs
    assert _cp_exposed(gather, lt, overlap=False, full_recompute=True) == pytest.approx(3 * gather)


def test_estimate_prices_cp_only_with_cp():
    e4 = estimate(M65, cp_plan(offload_alpha=0.8), H800)
    e1 = estimate(M65, cp_plan(context_parallel_size=1, num_gpus=16, global_batch_size=64, offload_alpha=0.8), H800)
    assert e1.time_terms["cp_comm"] == 0.0
    # 65B, s/c = 1024 tokens, t=1: one K/V gather over NVLink outlasts the Q GEMM
    assert e4.time_terms["cp_comm"] > 0.0


def test_cp_kv_gather_buffer():
    for t, c in ((1, 4), (2, 2), (2, 1)):
        plan = cp_plan(tensor_model_parallel_size=t, context_parallel_size=c, num_gpus=8 * t * c * 2)
        terms = stage_memory(M65, plan, 0, 0.0).terms
        want = 4096 * 2 * M65.kv_hidden_size // t * 2 if c > 1 else 0
        assert terms["cp_kv_gather_buffer"] == want


def test_wgrad_is_bound_by_main_grad_traffic_only_for_few_tokens():
    r = _rates(H800)
    params = M65.params_per_layer
    for t, c, bound in ((1, 8, True), (1, 4, False), (2, 1, False)):
        x = _layer_times(M65, cp_plan(tensor_model_parallel_size=t, context_parallel_size=c), r)
        rest = 2 * x["attn_f"] + 2 * x["elem_f"]
        main_grad = 8 * params / t / r.hbm  # fp32 read + write per parameter
        assert (main_grad > x["gemm_f"]) == bound
        assert x["bwd"] - rest == pytest.approx(x["gemm_f"] + max(x["gemm_f"], main_grad))
