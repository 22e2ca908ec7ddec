"""The kernel profile of a driver step (scripts/gpu/groundtruth/kernel_profile.py) on CPU: kernel names as the
profiler reports them on Hopper sorted into the cost model's kinds, the per-iteration table, and driver_steps.py's
--profile commands and --compare of a profiled row beside the model's terms."""
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "gpu"))

import driver_steps  # noqa: E402
from groundtruth.kernel_profile import KINDS, kind_of, main, summarize  # noqa: E402

NAMES = {  # as torch.profiler's key_averages() names them (PyTorch 2.x on an H100/H200)
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off": "gemm",
    "nvjet_tst_192x192_64x3_2x1_v_bz_coopA_NNT": "gemm",
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(Params)": "gemm",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, true>(Flash_fwd_params)":
        "attention",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0": "attention",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::"
    "(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)": "loss",
    "void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>": "loss",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor>": "optimizer",
    "Memcpy HtoD (Pinned -> Device)": "copy",
    "Memset (Device)": "copy",
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "nccl",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>": "elementwise",
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>": "elementwise",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t>>": "elementwise",
    "void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel(at::TensorIteratorBase&)::"
    "{lambda()#1}::operator()() const::{lambda(c10::BFloat16)#1}>": "elementwise",  # not an optimizer's 'lamb'
}


@pytest.mark.parametrize("name,kind", NAMES.items())
def test_each_kernel_lands_in_its_kind(name, kind):
    assert kind_of(name) == kind


def test_the_table_is_per_iteration_by_kind():
    out = summarize([("nvjet_tst_a", 4000.0, 6), ("nvjet_tst_a", 2000.0, 2), ("flash_fwd_kernel", 1000.0, 4),
                     ("Memcpy DtoH (Device -> Pinned)", 500.0, 2), ("vectorized_elementwise_kernel", 250.0, 40),
                     ("idle", 0.0, 8)], iterations=2)
    assert out["by_kind_ms_per_iteration"] == {**{k: 0.0 for k in KINDS}, "gemm": 3.0, "attention": 0.5,
                                               "copy": 0.25, "elementwise": 0.125}
    assert out["total_ms_per_iteration"] == pytest.approx(3.875)
    assert out["top_ms_per_iteration"][0] == ["nvjet_tst_a", 3.0, "gemm"]
    assert out["launches_per_iteration"] == {**{k: 0.0 for k in KINDS}, "gemm": 4.0, "attention": 2.0, "copy": 1.0,
                                             "elementwise": 20.0}
    assert summarize([("nvjet_tst_a", 10.0)], iterations=1)["launches_per_iteration"]["gemm"] == 0  # no counts given
    with pytest.raises(ValueError, match="iterations must be >= 1"):
        summarize([], iterations=0)


def test_the_profile_needs_a_run():
    with pytest.raises(SystemExit, match="give the run after --"):
        main(["--iterations", "2", "--json", "x.json"])


def test_driver_steps_profiles_and_compares_a_profiled_row(tmp_path, capsys):
    case = next(c for c in driver_steps.CASES if c[0] == "llama-1b/ours/0.5")
    cmd = driver_steps.profile_command(case, 4, "M.json", "K.json")
    assert cmd[1].endswith("kernel_profile.py") and cmd[2:7] == ["--iterations", "4", "--json", "K.json", "--"]
    assert cmd[7:] == driver_steps.command(case, 4, "M.json")[1:]
    kinds = {k: 1.0 for k in KINDS}
    doc = {"rows": [{"case": case[0], "status": "profiled", "kernels": {"by_kind_ms_per_iteration": kinds}}]}
    (tmp_path / "p.json").write_text(json.dumps(doc))
    assert driver_steps.main(["--compare", str(tmp_path / "p.json")]) == 0
    kernels_line, model_line = capsys.readouterr().out.strip().splitlines()
    assert kernels_line.startswith("llama-1b/ours/0.5") and "gemm 1.0" in kernels_line
    model = driver_steps.model_kinds_ms(case, "h200")
    assert model["recompute"] > 0 and model["offload_exposed"] > 0  # ckpt ours, alpha 0.5 at p = 1
    assert model_line.split("model: ")[1].startswith(f"gemm {model['gemm']:.1f}")


def test_a_failed_case_says_its_error_not_the_shutdown_warning_after_it():
    err = ("Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: the real reason\n"
           "[rank0]:[W1128 19:34:36 ProcessGroupNCCL.cpp:1575] Warning: WARNING: destroy_process_group() was not "
           "called before program exit")
    assert driver_steps.failure_line(err, "") == "ValueError: the real reason"
    line = "pretrain_llama.py: error: --foo: bad"
    assert driver_steps.failure_line("", line + "\n") == line
    assert driver_steps.failure_line("just a last line\n", "") == "just a last line"


def test_driver_steps_host_runs_a_case_at_narrow_widths_and_compares_its_dispatch_time(tmp_path, capsys):
    """--host keeps everything that sets what a step dispatches (layers, sequence, micro and global batch, ckpt,
    alpha, entry) and narrows only the widths; --compare prints its step as the host's time beside the case."""
    for case in driver_steps.CASES:
        narrow = driver_steps.host_case(case)
        wide_cmd, narrow_cmd = driver_steps.command(case, 6, "M.json"), driver_steps.command(narrow, 6, "M.json")
        assert len(wide_cmd) == len(narrow_cmd) and narrow[0] == case[0]
        changed = {wide_cmd[i - 1]: (w, n) for i, (w, n) in enumerate(zip(wide_cmd, narrow_cmd)) if w != n}
        assert set(changed) <= set(driver_steps.HOST_WIDTHS) and "--hidden-size" in changed, changed
        assert all(int(n) < int(w) for w, n in changed.values()), changed
        assert ("--num-query-groups" in changed) == ("--num-query-groups" in case[2])
    doc = {"rows": [{"case": "llama-1b/no/0", "status": "host", "step_time_ms": 612.5}]}
    (tmp_path / "h.json").write_text(json.dumps(doc))
    assert driver_steps.main(["--compare", str(tmp_path / "h.json")]) == 0
    assert capsys.readouterr().out.split() == ["llama-1b/no/0", "host", "(narrow", "widths)", "612.5", "ms"]
    with pytest.raises(SystemExit):
        driver_steps.main(["--host", "--profile", "--dry-run"])
