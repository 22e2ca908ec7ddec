"""Mixture-of-experts pricing (h3t_ext.costmodel.moe and its hooks): parameter and FLOPs counts against the published
models and Megatron-LM's own count, expert sharding of states and gradients, the token exchanges, saved activations,
the planner's flags, refusals and search."""
from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from h3t_ext.ckpt import Recompute
from h3t_ext.costmodel import InvalidPlanError, estimate, get_model, get_system
from h3t_ext.costmodel import moe
from h3t_ext.costmodel.collectives import all_to_all_seconds
from h3t_ext.costmodel.data_parallel import dp_comm, _group_comm
from h3t_ext.costmodel.memory import stage_memory, stage_params
from h3t_ext.costmodel.mfu import model_flops_per_token
from h3t_ext.costmodel.plan import Plan
from h3t_ext.costmodel.plan_checks import validate_plan
from h3t_ext.costmodel.published_moe import published_moe_runs
from h3t_ext.costmodel.specs import ModelSpec
from h3t_ext.layout import LayoutError, ParallelLayout
from h3t_ext.planner.cli import main
from h3t_ext.planner.flags import megatron_flags, plan_from_megatron_flags
from h3t_ext.planner.search import search
from h3t_ext.planner.space import SearchConstraints

H100 = get_system("h100-sxm")


@pytest.mark.parametrize("name, total, active", [
    ("mixtral-8x7b", 46.7e9, 12.9e9),      # Mixtral paper (arXiv:2401.04088): 47B total, 13B active
    ("mixtral-8x22b", 141e9, 39e9),        # Mistral's 8x22B release: 141B total, 39B active
    ("qwen3-30b-a3b", 30.5e9, 3.3e9),      # Qwen3 report (arXiv:2505.09388), Table 2
    ("qwen3-235b-a22b", 235e9, 22e9),
])
def test_zoo_moe_models_have_their_published_sizes(name, total, active):
    m = get_model(name)
    routed_idle = m.num_layers * (m.num_experts - m.moe_router_topk) * m.expert_params
    router = m.num_layers * m.router_params_per_layer
    assert m.num_parameters == pytest.approx(total, rel=0.01)
    assert m.num_parameters - routed_idle - router == pytest.approx(active, rel=0.02)


def test_flops_per_token_is_megatrons_count_of_the_published_qwen3_runs():
    """The model zoo's published rows give both a step time and Megatron-LM's TFLOP/s per GPU: the one FLOPs formula
    reproduces Megatron's count from the step time (routed experts k f_e wide, router left out)."""
    runs = [r for r in published_moe_runs() if r.iteration_time_s is not None]
    assert len(runs) >= 4
    for r in runs:
        tflops = r.plan.tokens_per_iteration * model_flops_per_token(r.model, r.plan.seq_length) / (
            r.iteration_time_s * r.plan.num_gpus) / 1e12
        assert tflops == pytest.approx(r.model_tflops_per_s_per_gpu, rel=0.006), r.label


def test_one_expert_routed_to_once_is_the_dense_mlp():
    """E = 1, k = 1, f_e = f: the same FLOPs as the dense model, and its weights plus the router's h."""
    dense = get_model("llama3-8b")
    one = dataclasses.replace(dense, num_experts=1, moe_router_topk=1)
    assert model_flops_per_token(one, 4096) == model_flops_per_token(dense, 4096)
    assert one.params_per_layer == dense.params_per_layer + dense.hidden_size
    assert one.num_parameters == dense.num_parameters + dense.num_layers * dense.hidden_size


def test_moe_fields_are_checked_in_one_line():
    base = get_model("mixtral-8x7b")
    with pytest.raises(ValueError, match=r"moe_router_topk must be in \[1, num_experts=8\], got 9"):
        dataclasses.replace(base, moe_router_topk=9)
    with pytest.raises(ValueError, match="moe_ffn_hidden_size needs num_experts"):
        dataclasses.replace(get_model("llama3-8b"), moe_ffn_hidden_size=1024)
    with pytest.raises(ValueError, match="add_bias_linear with num_experts"):
        dataclasses.replace(base, add_bias_linear=True)


def _plan(**kw) -> Plan:
    base = dict(num_gpus=64, seq_length=4096, global_batch_size=256, tensor_model_parallel_size=1,
                pipeline_model_parallel_size=4, expert_model_parallel_size=8, moe_token_dispatcher_type="alltoall",
                moe_grouped_gemm=True)
    return Plan(**{**base, **kw})


def test_experts_are_split_over_ep_and_etp_and_their_states_over_edp():
    m = get_model("mixtral-8x7b")
    for ep, etp in ((1, 1), (2, 1), (8, 1), (4, 2), (2, 4)):
        per_rank = m.expert_layer_params_per_rank(ep, etp)
        assert per_rank * ep * etp == m.num_experts * m.expert_params
    plan = _plan(expert_model_parallel_size=8, expert_tensor_parallel_size=1)  # t c d = 16 ranks a stage: edp 2
    assert moe.expert_data_parallel_size(plan) == 2 and plan.data_parallel_size == 16
    layers = 8
    experts = layers * m.expert_layer_params_per_rank(8, 1)
    dense = stage_params(m, plan, 1) - experts
    assert dense == layers * m.dense_layer_params_per_rank(1)
    states = stage_memory(m, plan, 1, 0.0).terms["optimizer_states"]
    assert states == round((dense / 16 + experts / 2) * 12)  # fp32 master, m, v: dense over d, experts over edp


def test_expert_gradients_are_reduced_over_their_own_group():
    """With ep = every rank of a stage (edp = 1) the experts' gradients need no reduction: the data-parallel
    traffic is the dense parameters' alone; with edp > 1 it adds the experts' over edp."""
    m = get_model("mixtral-8x7b")
    whole = _plan(num_gpus=32, expert_model_parallel_size=8, expert_tensor_parallel_size=1, pipeline_model_parallel_size=4)
    assert moe.expert_data_parallel_size(whole) == 1
    experts = 8 * m.expert_layer_params_per_rank(8, 1)
    n = stage_params(m, whole, 3)
    assert dp_comm(m, whole, H100).grad_seconds == _group_comm(m, whole, H100, n - experts, 8, 1).grad_seconds
    half = dataclasses.replace(whole, expert_model_parallel_size=4)
    assert dp_comm(m, half, H100).grad_seconds == pytest.approx(
        _group_comm(m, half, H100, stage_params(m, half, 3) - 2 * experts, 8, 1).grad_seconds
        + _group_comm(m, half, H100, 2 * experts, 2, 4).grad_seconds)


def test_remote_nodes_per_token_is_the_count_over_every_routing():
    """DeepEP sends a token once per other node its k experts lie in: the closed form against every k-subset."""
    model = dataclasses.replace(get_model("mixtral-8x7b"), num_experts=12, moe_router_topk=3)
    ep, per_node = 6, 2  # 3 nodes, 4 experts each; the token's own rank is on node 0
    node = [e * ep // model.num_experts // per_node for e in range(model.num_experts)]
    subsets = list(itertools.combinations(range(model.num_experts), model.moe_router_topk))
    brute = sum(len({node[e] for e in s} - {0}) for s in subsets) / len(subsets)
    assert moe.remote_nodes_per_token(model, ep, per_node) == pytest.approx(brute, rel=1e-12)


def test_all_to_all_inside_a_node_and_across_nodes():
    n = 1 << 28
    nvlink = H100.nvlink_bandwidth * H100.efficiency("nvlink_fraction")
    nic = H100.network_bandwidth * H100.efficiency("network_fraction")
    assert all_to_all_seconds(n, 8, 1, H100) == pytest.approx(H100.nvlink_latency_s + 7 / 8 * n / nvlink)
    # 32 ranks, 8 to a node: 24/32 of the buffer leaves the node through the rank's NIC
    assert all_to_all_seconds(n, 32, 1, H100) == pytest.approx(H100.network_latency_s + 24 / 32 * n / nic)
    assert all_to_all_seconds(n, 1, 1, H100) == 0.0


def test_deepep_crosses_the_network_once_per_node():
    m = get_model("qwen3-235b-a22b")
    tokens = 2048
    inside = moe.deepep_seconds(m, tokens, 8, 1, H100)
    assert inside == all_to_all_seconds(tokens * m.moe_router_topk * m.hidden_size * 2, 8, 1, H100)
    across = moe.deepep_seconds(m, tokens, 32, 1, H100)
    a2a = all_to_all_seconds(tokens * m.moe_router_topk * m.hidden_size * 2, 32, 1, H100)
    assert across < 0.5 * a2a  # k = 8 copies, 6 of them off-node on average, against < 3 remote nodes
    top1 = dataclasses.replace(m, moe_router_topk=1)  # one copy: nothing to deduplicate
    assert moe.deepep_seconds(top1, tokens, 32, 1, H100) == pytest.approx(
        all_to_all_seconds(tokens * m.hidden_size * 2, 32, 1, H100))


def test_saved_expert_bytes_by_recompute():
    m = get_model("qwen3-235b-a22b")
    plan = _plan(num_gpus=256, global_batch_size=2048, tensor_model_parallel_size=2, pipeline_model_parallel_size=8,
                 expert_tensor_parallel_size=1)
    k, h, f = m.moe_router_topk, m.hidden_size, m.expert_ffn_hidden_size
    terms = moe.expert_terms(m, plan)
    assert terms == {"router_scores": 2 * 128 * 4, "routing_map": 128 * 5, "routing_indices": k * 24,
                     "expert_input": 2 * k * h, "expert_fc1_output": 2 * k * 2 * f, "expert_act_output": 2 * k * f}
    everything = sum(terms.values())
    assert moe.kept_expert_bytes(m, plan, "no", ()) == everything
    assert moe.kept_expert_bytes(m, plan, "ours", ()) == everything - 2 * k * f
    assert moe.kept_expert_bytes(m, plan, "no", ("layernorm", "moe_act")) == everything - 2 * k * f
    assert moe.kept_expert_bytes(m, plan, "no", ("moe",)) == 0
    etp2 = dataclasses.replace(plan, expert_tensor_parallel_size=2)  # FC1's input is all-gathered over etp
    assert moe.expert_terms(m, etp2)["expert_input"] == 2 * terms["expert_input"]


def test_layout_rules_of_the_expert_grid():
    with pytest.raises(LayoutError, match=r"--expert-model-parallel-size 16 x --expert-tensor-parallel-size 1 = 16 "
                                          r"does not divide the 8 ranks"):
        ParallelLayout(data_parallel_size=8, expert_model_parallel_size=16, expert_tensor_parallel_size=1)
    layout = ParallelLayout(tensor_model_parallel_size=2, data_parallel_size=4, expert_model_parallel_size=4)
    assert layout.effective_expert_tensor_parallel_size == 2  # Megatron's default etp = t: 4 x 2 ranks, edp 1
    with pytest.raises(LayoutError, match="= 16 does not divide the 8 ranks"):
        ParallelLayout(tensor_model_parallel_size=2, data_parallel_size=4, expert_model_parallel_size=8)
    with pytest.raises(LayoutError, match="--num-experts 8 is not a multiple of --expert-model-parallel-size 3"):
        ParallelLayout(data_parallel_size=6, expert_model_parallel_size=3, expert_tensor_parallel_size=1
                       ).check_experts(num_experts=8)
    with pytest.raises(LayoutError, match="needs --num-experts"):
        ParallelLayout(data_parallel_size=2, expert_model_parallel_size=2).check_experts(num_experts=None)


@pytest.mark.parametrize("change, reason", [
    (dict(fp8="hybrid"), "does not price FP8 expert GEMMs"),
    (dict(use_torch_fsdp2=True, use_distributed_optimizer=False, pipeline_model_parallel_size=1),
     "Megatron FSDP / torch FSDP2 over experts"),
    (dict(optimizer_cpu_offload=True), "the CPU optimizer over expert states"),
    (dict(ckpt="ours"), "ckpt ours with a mixture-of-experts model"),
    (dict(offload_alpha=0.5), "offload_alpha 0.5 with a mixture-of-experts model"),
    (dict(tensor_model_parallel_size=2, sequence_parallel=False), "needs sequence_parallel"),
    (dict(recompute=Recompute.parse("selective", modules=["mlp"])), "recompute module mlp reruns dense MLPs"),
    (dict(recompute=Recompute.parse("selective", modules=["shared_experts"], moe=True)), "has no shared expert"),
])
def test_moe_plans_refuse_what_is_not_priced(change, reason):
    with pytest.raises(InvalidPlanError, match=reason):
        validate_plan(get_model("mixtral-8x7b"), _plan(**change), H100)


@pytest.mark.parametrize("change", [dict(moe_grouped_gemm=True), dict(moe_token_dispatcher_type="alltoall"),
                                    dict(expert_tensor_parallel_size=1)])
def test_dense_plans_refuse_expert_switches(change):
    plan = Plan(num_gpus=8, seq_length=4096, global_batch_size=64, **change)
    with pytest.raises(InvalidPlanError, match="needs num_experts"):
        validate_plan(get_model("llama3-8b"), plan, H100)


def test_recompute_modules_of_experts_need_a_moe_model():
    with pytest.raises(ValueError, match="recomputes MoE layers; the model is dense"):
        Recompute.parse("selective", modules=["moe_act"])
    assert Recompute.parse("selective", modules=["layernorm", "moe_act"], moe=True).modules == ("layernorm", "moe_act")


def test_moe_time_terms_add_up_and_include_the_exchanges():
    m = get_model("mixtral-8x7b")
    est = estimate(m, _plan(num_layers_per_virtual_pipeline_stage=1, expert_tensor_parallel_size=1), H100)
    terms = est.time_terms.as_dict()
    assert terms["ep_comm"] > 0 and sum(terms.values()) == pytest.approx(est.iteration_time_s, rel=1e-9)
    one = estimate(m, _plan(num_layers_per_virtual_pipeline_stage=1, expert_model_parallel_size=1,
                            expert_tensor_parallel_size=1), H100)
    assert one.time_terms.ep_comm == 0.0  # every expert on every rank: no exchange
    grouped = est.iteration_time_s
    looped = estimate(m, _plan(num_layers_per_virtual_pipeline_stage=1, expert_model_parallel_size=1,
                               expert_tensor_parallel_size=1, moe_grouped_gemm=False), H100).iteration_time_s
    assert looped > one.iteration_time_s and grouped > 0  # eight launches and waves per FC instead of one


def test_flags_round_trip_and_leave_out_h3t_only_flags():
    plan = _plan(expert_tensor_parallel_size=1, recompute=Recompute.parse("selective", modules=["layernorm", "moe_act"],
                                                                        moe=True))
    flags = megatron_flags(plan, moe=True)
    assert "--ckpt" not in flags and "--offload-alpha" not in flags
    assert flags[flags.index("--expert-model-parallel-size") + 1] == "8" and "--moe-grouped-gemm" in flags
    back = plan_from_megatron_flags(flags, num_gpus=64, seq_length=4096, num_experts=8)
    assert dataclasses.replace(back, sequence_parallel=plan.sequence_parallel) == plan


def test_search_chooses_expert_parallelism_and_best_first_equals_exhaustive():
    m = get_model("mixtral-8x7b")
    kw = dict(num_gpus=32, seq_length=4096, global_batch_size=128,
              constraints=SearchConstraints(pipeline_model_parallel_size=4, overlap_grad_reduce=True,
                                            overlap_param_gather=True))
    best = search(m, H100, top=1, **kw).best
    full = search(m, H100, exhaustive=True, **kw)
    assert best.plan.expert_model_parallel_size > 1 and best.plan.moe_grouped_gemm
    assert best.tokens_per_second == pytest.approx(full.best.tokens_per_second, rel=1e-9)
    assert {r.plan.expert_model_parallel_size for r in full.plans} > {best.plan.expert_model_parallel_size}
    # with t = 2 both expert tensor-parallel sizes are searched: 1 (the folding) and t (Megatron's default)
    assert {r.plan.expert_tensor_parallel_size for r in full.plans if r.plan.tensor_model_parallel_size == 2} == {1, 2}
    assert not any(r.plan.ckpt.value == "ours" or any(r.plan.alphas()) for r in full.plans)


def _error(argv, capsys) -> str:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors leave through SystemExit
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("h3t-plan: error: "), err
    return err


RUN = ["--seq-length", "4096", "--num-gpus", "64", "--global-batch-size", "256", "--gpu", "h100-sxm"]


def test_cli_estimates_a_moe_model_and_names_its_expert_layout(capsys):
    assert main(["estimate", "--model", "mixtral-8x7b", *RUN, "--pipeline-model-parallel-size", "4",
                 "--expert-model-parallel-size", "8", "--moe-token-dispatcher-type", "alltoall",
                 "--moe-grouped-gemm"]) == 0
    out = capsys.readouterr().out
    assert "ep=8 etp=1 dispatcher=alltoall" in out and "--expert-model-parallel-size 8" in out


@pytest.mark.parametrize("extra, fragment", [
    (["--model", "mixtral-8x7b", "--moe-token-drop-policy", "probs"], "--moe-token-drop-policy: the cost model does "
                                                                      "not price"),
    (["--model", "mixtral-8x7b", "--moe-shared-expert-overlap"], "--moe-shared-expert-overlap needs a shared expert"),
    (["--model", "mixtral-8x7b", "--expert-model-parallel-size", "3"], "= 3 does not divide the 64 ranks of a pipeline "
                                                                       "stage"),
    (["--model", "mixtral-8x7b", "--expert-model-parallel-size", "16", "--expert-tensor-parallel-size", "1"],
     "--num-experts 8 is not a multiple of --expert-model-parallel-size 16"),
    (["--model", "llama3-8b", "--expert-model-parallel-size", "2"], "needs --num-experts"),
    (["--model", "llama3-8b", "--moe-grouped-gemm"], "--moe-grouped-gemm needs --num-experts"),
    (["--model", "mixtral-8x7b", "--moe-router-topk", "9"], "--moe-router-topk must be in [1, --num-experts=8], got 9"),
    (["--model", "mixtral-8x7b", "--ckpt", "ours"], "--recompute-modules layernorm moe_act drops the same"),
    (["--model", "mixtral-8x7b", "--multi-latent-attention"], "does not price multi-latent attention"),
    (["--model", "mixtral-8x7b", "--offload-alpha", "auto"], "argument --offload-alpha auto: activation offload is "
                                                              "not priced with mixture-of-experts layers"),
    (["--model", "mixtral-8x7b", "--fine-grained-activation-offloading", "--offload-modules", "core_attn"],
     "argument Megatron's activation offload flags: activation offload is not priced"),
])
def test_cli_moe_errors_are_one_line(capsys, extra, fragment):
    err = _error(["estimate", *RUN, *extra], capsys)
    assert fragment in err, err


@pytest.mark.parametrize("extra, fragment", [
    (["--precision", "fp8"], "with a mixture-of-experts model: the cost model does not price FP8 expert GEMMs"),
    (["--ckpt", "ours"], "--ckpt ours with a mixture-of-experts model"),
    (["--offload-alpha", "0.5"], "--offload-alpha 0.5 with a mixture-of-experts model"),
    (["--overlap-cpu-optimizer-d2h-h2d"], "--overlap-cpu-optimizer-d2h-h2d with a mixture-of-experts model: it "
                                          "overlaps the copies of the optimizer offload the memory ladder tries"),
])
def test_cli_moe_search_refusals_are_one_line(capsys, extra, fragment):
    err = _error(["search", "--model", "mixtral-8x7b", *RUN, *extra], capsys)
    assert fragment in err, err


@pytest.mark.parametrize("extra, fragment", [
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size 2 needs --num-experts"),
    (["--expert-tensor-parallel-size", "1"], "--expert-tensor-parallel-size 1 needs --num-experts"),
    (["--moe-token-dispatcher-type", "alltoall"], "--moe-token-dispatcher-type 'alltoall' needs --num-experts"),
    (["--moe-grouped-gemm"], "--moe-grouped-gemm needs --num-experts"),
    (["--moe-shared-expert-overlap"], "--moe-shared-expert-overlap needs --num-experts"),
    (["--overlap-moe-expert-parallel-comm"], "--overlap-moe-expert-parallel-comm needs --num-experts"),
])
def test_a_dense_models_search_refuses_the_expert_switches_its_estimate_refuses(capsys, extra, fragment):
    """Each is one line from both subcommands (the search priced the dense plans without them, as if not given)."""
    for command in ("estimate", "search"):
        err = _error([command, "--model", "llama3-8b", *RUN, *extra], capsys)
        assert fragment in err, (command, err)


def test_a_dense_models_search_keeps_the_expert_defaults(capsys):
    """Megatron-LM's defaults, given, are not a MoE switch: the search runs."""
    assert main(["search", "--model", "llama3-8b", *RUN, "--expert-model-parallel-size", "1",
                             "--moe-token-dispatcher-type", "allgather", "--top", "1"]) == 0
    assert "--expert-model-parallel-size" not in capsys.readouterr().out


def test_estimate_moe_through_flags_and_search_reads_them(capsys):
    assert main(["search", "--model", "mixtral-8x7b", *RUN, "--expert-model-parallel-size", "4", "--top", "1",
                 "--json"]) == 0
    import json
    best = json.loads(capsys.readouterr().out)[0]
    flags = best["megatron_flags"]
    assert flags[flags.index("--expert-model-parallel-size") + 1] == "4"
    assert math.isfinite(best["tokens_per_second"])


def test_calibrate_reads_a_moe_runs_expert_layout(tmp_path):
    """A run file's expert fields price the run as it ran (before, calibrate dropped them: every expert on every
    rank, no exchange)."""
    from h3t_ext.planner.calibrate import read_runs
    path = tmp_path / "mixtral.csv"
    path.write_text("num_gpus,seq_length,global_batch_size,pipeline_model_parallel_size,expert_model_parallel_size,"
                    "expert_tensor_parallel_size,moe_token_dispatcher_type,moe_grouped_gemm,use_distributed_optimizer,"
                    "tokens_per_second_per_gpu\n64,4096,256,4,8,1,alltoall,true,true,5000\n")
    plan = read_runs([str(path)], get_model("mixtral-8x7b"), H100)[0].plan
    assert (plan.expert_model_parallel_size, plan.expert_tensor_parallel_size, plan.moe_token_dispatcher_type,
            plan.moe_grouped_gemm) == (8, 1, "alltoall", True)


def test_a_moe_runs_interleaving_reads_the_same_with_its_expert_switches(tmp_path):
    """--moe-grouped-gemm and --moe-shared-expert-overlap are switches, not layer-split flags: a run's
    virtual_pipeline_model_parallel_size is its layers per chunk with them as without them (they were read as split
    flags, which made the run's chunks --num-virtual-stages-per-pipeline-rank)."""
    from h3t_ext.planner.calibrate import read_runs
    head = ("num_gpus,seq_length,global_batch_size,pipeline_model_parallel_size,virtual_pipeline_model_parallel_size,"
            "expert_model_parallel_size,moe_token_dispatcher_type,use_distributed_optimizer,tokens_per_second_per_gpu")
    plans = []
    for extra_head, extra in (("", ""), (",moe_grouped_gemm", ",true")):
        path = tmp_path / f"mixtral{len(plans)}.csv"
        path.write_text(f"{head}{extra_head}\n64,4096,256,4,2,8,alltoall,true,5000{extra}\n")
        plans.append(read_runs([str(path)], get_model("mixtral-8x7b"), H100)[0].plan)
    assert [(p.num_layers_per_virtual_pipeline_stage, p.num_virtual_stages_per_pipeline_rank) for p in plans] == \
        [(4, None), (4, None)]
    assert dataclasses.replace(plans[1], moe_grouped_gemm=False) == plans[0]


def test_moe_plans_hold_nccl_buffers_for_their_expert_groups():
    from h3t_ext.costmodel.reserve import communicators
    m = get_model("mixtral-8x7b")
    plan = _plan(expert_model_parallel_size=4, expert_tensor_parallel_size=1)  # 16 ranks a stage: edp 4
    groups = {c.group: c for c in communicators(m, plan, H100)}
    assert groups["EXPERT_MODEL_PARALLEL_GROUP"].peers == 3  # p2p with the 3 others of the all-to-all
    assert groups["EXPERT_DATA_PARALLEL_GROUP"].peers == 4
    assert "EXPERT_TENSOR_PARALLEL_GROUP" not in groups
    gathered = {c.group for c in communicators(m, dataclasses.replace(plan, moe_token_dispatcher_type="allgather",
                                                                      expert_tensor_parallel_size=2), H100)}
    assert "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP" in gathered and "EXPERT_MODEL_PARALLEL_GROUP" not in gathered
    dense = {c.group for c in communicators(get_model("llama3-8b"), Plan(num_gpus=64, seq_length=4096,
                                                                         global_batch_size=256), H100)}
    assert not any(g.startswith("EXPERT") for g in dense)


def test_moe_interval_is_the_published_moe_runs_and_stored():
    """MoE estimates carry the interval of the published MoE runs, stored as validation computes it now (the dense
    interval's check, tests/integration/test_calibration.py, covers the file as a whole)."""
    import json

    from h3t_ext.costmodel.uncertainty import UNCERTAINTY_FILE, throughput_uncertainty
    from h3t_ext.costmodel.validation import moe_uncertainty
    assert json.loads(UNCERTAINTY_FILE.read_text())["moe"] == moe_uncertainty()
    est = estimate(get_model("mixtral-8x7b"), _plan(expert_tensor_parallel_size=1), H100)
    w = throughput_uncertainty(moe=True).relative_half_width
    assert est.moe and est.tokens_per_second_interval == pytest.approx(
        (est.tokens_per_second * (1 - w), est.tokens_per_second * (1 + w)))
    assert w > throughput_uncertainty().relative_half_width


def test_dropless_slowdowns_are_the_published_pairs():
    from h3t_ext.costmodel.published_moe import dropless_slowdowns
    assert dropless_slowdowns() == pytest.approx((295 / 237 - 1, 335 / 277 - 1, 368 / 320 - 1, 389 / 357 - 1))


def test_expert_terms_are_what_megatron_cores_moe_saves():
    """megatron-core's own MoE token dispatcher (allgather, one rank), its SequentialMLP experts (the 'local' spec) and
    its router's routing run on CPU in float32: the tensors they keep for the backward, per token, are
    ``moe.expert_terms`` exactly (the router's input, the norm output the dense terms count, left out). Among them:
    no copy of the experts' output (megatron-core weighs the k outputs in the activation, so the unpermute keeps
    nothing), and the activation's output once (FC2 keeps the same tensor)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tests.activation_harness import init_single_process_megatron
    init_single_process_megatron()
    h, experts_n, k, f, tokens = 64, 4, 2, 48, 32
    cfg = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=4, ffn_hidden_size=f,
                            num_moe_experts=experts_n, moe_router_topk=k, moe_ffn_hidden_size=f, gated_linear_unit=True,
                            activation_func=F.silu, add_bias_linear=False, moe_token_dispatcher_type="allgather",
                            bias_activation_fusion=True, use_cpu_initialization=True, params_dtype=torch.float32)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    torch.manual_seed(0)
    experts = SequentialMLP(experts_n, cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                          linear_fc2=RowParallelLinear), pg_collection=pgc)
    dispatcher = MoEAllGatherTokenDispatcher(num_local_experts=experts_n, local_expert_indices=list(range(experts_n)),
                                             config=cfg, pg_collection=pgc)
    router = TopKRouter(config=cfg, pg_collection=pgc)
    x = torch.randn(tokens, 1, h, requires_grad=True)
    saved: dict[int, int] = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter) and t is not flat:
            saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    flat = x.view(-1, h)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        probs, routing_map = router.routing(F.linear(flat, router.weight))  # the gating GEMM: router.py moves it to CUDA
        hs, pr = dispatcher.token_dispatch(*dispatcher.dispatch_preprocess(x, routing_map, probs))
        hs, per_expert, pr = dispatcher.dispatch_postprocess(hs, pr)
        out, _ = experts(hs, per_expert, pr)
        out = dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(out)))
    out.sum().backward()
    assert x.grad is not None and out.shape == x.shape
    model = ModelSpec(name="tiny-moe", num_layers=1, hidden_size=h, num_attention_heads=4, num_query_groups=4,
                      ffn_hidden_size=f, vocab_size=128, num_experts=experts_n, moe_router_topk=k)
    plan = Plan(num_gpus=1, seq_length=tokens, global_batch_size=1, expert_tensor_parallel_size=1)
    terms = moe.expert_terms(model, plan, dtype_bytes=4)
    assert sum(saved.values()) == tokens * sum(terms.values()), (sorted(saved.values()), terms)


def test_moe_layer_freq_mixes_dense_and_moe_layers():
    """--moe-layer-freq N (or its pattern) makes every N-th layer a MoE layer: the FLOPs are Megatron's per-kind sum,
    every stage holds the parameters of the layers it builds (summing to the model's), and an int and its pattern
    price the same plan."""
    base = get_model("mixtral-8x7b")
    dense = base.dense_variant()
    every_other = dataclasses.replace(base, moe_layer_freq=2)
    as_pattern = dataclasses.replace(base, moe_layer_freq=(1, 0) * 16)
    assert every_other.moe_layers == 16 and every_other.mixed_moe and not base.mixed_moe
    flops = model_flops_per_token(every_other, 4096)
    assert flops == pytest.approx((model_flops_per_token(dense, 4096) + model_flops_per_token(base, 4096)) / 2)
    plan = _plan(expert_tensor_parallel_size=1)
    assert estimate(every_other, plan, H100).iteration_time_s == estimate(as_pattern, plan, H100).iteration_time_s
    # the first half of the layers MoE: stage 0 and 1 hold them, 2 and 3 none (p = 4, 8 layers each)
    front = dataclasses.replace(base, moe_layer_freq=(1,) * 16 + (0,) * 16)
    whole = Plan(num_gpus=4, seq_length=4096, global_batch_size=4, pipeline_model_parallel_size=4,
                 expert_tensor_parallel_size=1)
    params = [stage_params(front, whole, k) for k in range(4)]
    moe_layer = front.moe_variant().layer_params_per_rank(1, 1, 1)
    dense_layer = dense.layer_params_per_rank(1)
    assert params[1] - params[2] == 8 * (moe_layer - dense_layer) > 0
    padding = 2 * (front.padded_vocab_size(1) - front.vocab_size) * front.hidden_size  # embedding and output rows
    assert sum(params) == front.num_parameters + padding
    peaks = [s.peak_bytes for s in estimate(front, whole, H100).stages]
    assert peaks[1] > peaks[2]  # not one middle stage standing for the other


@pytest.mark.parametrize("freq, fragment", [
    ("[1]*5", "--moe-layer-freq has 5 entries for --num-layers 32"),
    ("0", "--moe-layer-freq 0 is outside [1, inf)"),
    ("[2]*32", "one 0/1 entry per layer (1: a MoE layer), at least one 1"),
    ("[0]*32", "one 0/1 entry per layer (1: a MoE layer), at least one 1"),
    ("abc", "'abc' is neither an integer N >= 1 nor a pattern"),
])
def test_cli_moe_layer_freq_errors_are_one_line(capsys, freq, fragment):
    err = _error(["estimate", "--model", "mixtral-8x7b", *RUN, "--moe-layer-freq", freq], capsys)
    assert fragment in err, err


def test_routing_flags_of_a_training_script_are_priced_alike(capsys):
    """A Qwen3-MoE script's routing flags (aux loss, router dtype, fusions, pre-softmax) change what the router
    computes, not the step's cost: the estimate is the same with them; a capacity factor changes the cost and is
    refused."""
    import json
    base = ["estimate", "--model", "qwen3-30b-a3b", *RUN, "--expert-model-parallel-size", "8", "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*base, "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-3",
                 "--moe-router-pre-softmax", "--moe-permute-fusion", "--moe-router-fusion", "--moe-router-dtype",
                 "fp32", "--moe-router-force-load-balancing"]) == 0
    scripted = json.loads(capsys.readouterr().out)
    assert scripted["tokens_per_second"] == plain["tokens_per_second"]
    assert scripted["peak_memory_bytes"] == plain["peak_memory_bytes"]
    err = _error(["estimate", "--model", "qwen3-30b-a3b", *RUN, "--moe-expert-capacity-factor", "1.0"], capsys)
    assert "--moe-expert-capacity-factor: the cost model does not price these mixture-of-experts settings" in err


def test_shared_expert_overlap_hides_the_exchange_up_to_the_shared_experts_compute():
    from h3t_ext.costmodel.kernels import kernel_rates, linear_pass_seconds
    from h3t_ext.costmodel.timing import layer_gemm_shapes, layer_time
    m = dataclasses.replace(get_model("qwen3-235b-a22b"), moe_shared_expert_intermediate_size=4096)
    plan = Plan(num_gpus=256, seq_length=4096, global_batch_size=2048, tensor_model_parallel_size=2,
                pipeline_model_parallel_size=2, expert_model_parallel_size=32, expert_tensor_parallel_size=1,
                moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True)
    r, shapes = kernel_rates(H100), layer_gemm_shapes(m, plan)

    def shared(p_):
        return sum(linear_pass_seconds(p_, *shapes[k], r) for k in ("fc1", "fc2"))

    plain = layer_time(m, plan, H100)
    hidden = layer_time(m, dataclasses.replace(plan, moe_shared_expert_overlap=True), H100)
    assert plain.ep_fwd > shared("fwd") > 0  # cross-node EP32: the exchange outlasts the shared expert
    assert hidden.ep_fwd == pytest.approx(plain.ep_fwd - shared("fwd"))
    assert hidden.ep_bwd == pytest.approx(plain.ep_bwd - shared("dgrad") - shared("wgrad"))
    assert hidden.fwd == plain.fwd and hidden.bwd == plain.bwd  # the shared expert still computes
    flags = megatron_flags(dataclasses.replace(plan, moe_shared_expert_overlap=True), moe=True)
    assert "--moe-shared-expert-overlap" in flags
    assert plan_from_megatron_flags(flags, num_gpus=256, seq_length=4096, num_experts=128).moe_shared_expert_overlap
    kw = dict(constraints=SearchConstraints(pipeline_model_parallel_size=2, tensor_model_parallel_size=2,
                                            expert_model_parallel_size=32))
    best = search(m, H100, num_gpus=256, seq_length=4096, global_batch_size=2048, top=1, **kw).best
    assert best.plan.moe_shared_expert_overlap  # on wherever it applies


@pytest.mark.parametrize("model_change, plan_change, reason", [
    ({}, {}, "needs a shared expert"),
    ({"moe_shared_expert_intermediate_size": 4096}, {"moe_token_dispatcher_type": "allgather"},
     "only works with moe_token_dispatcher_type alltoall"),
    ({"moe_shared_expert_intermediate_size": 4096},
     {"recompute": Recompute.parse("selective", modules=["shared_experts"], moe=True)}, "cannot work with"),
])
def test_shared_expert_overlap_refusals(model_change, plan_change, reason):
    m = dataclasses.replace(get_model("mixtral-8x7b"), **model_change)
    with pytest.raises(InvalidPlanError, match=reason):
        validate_plan(m, _plan(expert_tensor_parallel_size=1, moe_shared_expert_overlap=True, **plan_change), H100)
