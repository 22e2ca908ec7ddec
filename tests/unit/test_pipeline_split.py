"""Megatron's layer split over the pipeline (issue #23 item 4): uneven first/last stages
(--decoder-first/last-pipeline-num-layers) and --account-for-embedding/loss-in-pipeline-split, with and without
interleaving. One rule (h3t_ext.layout.PipelineSplit) that megatron-core 0.16.1's own helpers confirm, the cost
model's Plan.stage_layers on it, the refusals Megatron makes in one line, and the round trip of the flags."""
from __future__ import annotations

import pytest

from h3t_ext.costmodel import ModelSpec, Plan
from h3t_ext.costmodel.errors import InvalidPlanError
from h3t_ext.costmodel.plan_checks import validate_plan
from h3t_ext.costmodel.specs import get_system
from h3t_ext.layout import LayoutError, PipelineSplit, pipeline_split
from h3t_ext.planner.flags import megatron_flags, plan_from_megatron_flags
from h3t_ext.planner.translate import plan_from_args

# (num_layers, p, split keyword arguments, the layers of each stage's chunks)
CASES = [
    (12, 4, dict(decoder_first_pipeline_num_layers=2, decoder_last_pipeline_num_layers=2), [[2], [4], [4], [2]]),
    (12, 4, dict(decoder_first_pipeline_num_layers=3), [[3], [3], [3], [3]]),
    (10, 4, dict(decoder_last_pipeline_num_layers=1), [[3], [3], [3], [1]]),
    (6, 2, dict(decoder_first_pipeline_num_layers=2), [[2], [4]]),
    (6, 2, dict(decoder_last_pipeline_num_layers=4, num_virtual_stages_per_pipeline_rank=2), [[1, 1], [2, 2]]),
    (16, 4, dict(decoder_first_pipeline_num_layers=2, decoder_last_pipeline_num_layers=2,
                 num_virtual_stages_per_pipeline_rank=2), [[1, 1], [3, 3], [3, 3], [1, 1]]),
    (6, 4, dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True),
     [[1], [2], [2], [1]]),
    (7, 2, dict(account_for_embedding_in_pipeline_split=True), [[3], [4]]),
    (7, 2, dict(account_for_loss_in_pipeline_split=True), [[4], [3]]),
    (6, 2, dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True,
                num_layers_per_virtual_pipeline_stage=2), [[1, 2], [2, 1]]),
    (14, 4, dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True,
                 num_virtual_stages_per_pipeline_rank=4), [[0, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]]),
    (5, 1, dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True), [[5]]),
    (8, 2, dict(num_layers_per_virtual_pipeline_stage=2), [[2, 2], [2, 2]]),
]


@pytest.mark.parametrize("L, p, kw, chunks", CASES)
def test_the_split_is_megatrons_rule(L, p, kw, chunks):
    split = pipeline_split(L, p, **kw)
    v = split.virtual_pipeline_model_parallel_size
    assert [[split.chunk_layers(r, c) for c in range(v)] for r in range(p)] == chunks
    assert [split.stage_layers(r) for r in range(p)] == [sum(c) for c in chunks]
    # every layer once, chunk-major (virtual stage 0 of every rank, then virtual stage 1, ...)
    order = [(c, r) for c in range(v) for r in range(p)]
    assert [split.layer_offset(r, c) for c, r in order] == \
        [sum(chunks[r2][c2] for c2, r2 in order[:i]) for i in range(len(order))]
    assert sum(map(sum, chunks)) == L


@pytest.mark.parametrize("L, p, kw, chunks", [c for c in CASES if c[1] > 1])
def test_megatron_cores_helpers_build_the_same_layers(L, p, kw, chunks):
    """megatron-core 0.16.1's get_num_layers_to_build and get_transformer_layer_offset, called with its
    TransformerConfig of the same flags, give the split's chunk sizes and offsets."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from h3t_ext.runtime.modules.gpt import tiny_llama_config

    split = pipeline_split(L, p, **kw)
    v = split.virtual_pipeline_model_parallel_size
    config = tiny_llama_config(
        num_layers=L, pipeline_model_parallel_size=p, virtual_pipeline_model_parallel_size=v if v > 1 else None,
        num_layers_in_first_pipeline_stage=kw.get("decoder_first_pipeline_num_layers"),
        num_layers_in_last_pipeline_stage=kw.get("decoder_last_pipeline_num_layers"),
        account_for_embedding_in_pipeline_split=kw.get("account_for_embedding_in_pipeline_split", False),
        account_for_loss_in_pipeline_split=kw.get("account_for_loss_in_pipeline_split", False))
    for r in range(p):
        for c in range(v):
            vp = c if v > 1 else None
            assert get_num_layers_to_build(config, vp_stage=vp, pp_rank=r) == split.chunk_layers(r, c), (r, c)
            if split.chunk_layers(r, c):
                assert get_transformer_layer_offset(config, vp_stage=vp, pp_rank=r) == split.layer_offset(r, c)


# ---- refusals: one line naming the flags and the rule ----------------------------------------------------------

REFUSALS = [
    (6, 2, dict(decoder_first_pipeline_num_layers=2, account_for_loss_in_pipeline_split=True),
     ["--account-for-loss-in-pipeline-split cannot be combined with --decoder-first-pipeline-num-layers"]),
    (8, 2, dict(decoder_first_pipeline_num_layers=4, num_layers_per_virtual_pipeline_stage=2),
     ["--num-layers-per-virtual-pipeline-stage cannot be combined with --decoder-first-pipeline-num-layers",
      "valid: --num-virtual-stages-per-pipeline-rank"]),
    (8, 2, dict(decoder_first_pipeline_num_layers=3, num_virtual_stages_per_pipeline_rank=2),
     ["--decoder-first-pipeline-num-layers 3 is not a multiple of --num-virtual-stages-per-pipeline-rank 2"]),
    (14, 4, dict(decoder_first_pipeline_num_layers=4, decoder_last_pipeline_num_layers=4,
                 num_virtual_stages_per_pipeline_rank=2),
     ["the 3 layers of each middle pipeline stage", "not a multiple of --num-virtual-stages-per-pipeline-rank 2"]),
    (6, 2, dict(account_for_embedding_in_pipeline_split=True),
     ["(--num-layers 6 + 1 for --account-for-embedding-in-pipeline-split) = 7 is not a multiple of "
      "--pipeline-model-parallel-size 2", "valid: multiples of 2"]),
    (6, 2, dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True,
                num_layers_per_virtual_pipeline_stage=3),
     ["--num-layers-per-virtual-pipeline-stage 3 does not divide the 4 layers per pipeline rank"]),
    (6, 2, dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True,
                num_virtual_stages_per_pipeline_rank=3),
     ["--num-virtual-stages-per-pipeline-rank 3 does not divide the 4 layers per pipeline rank"]),
    (6, 1, dict(decoder_first_pipeline_num_layers=2), ["need --pipeline-model-parallel-size > 1"]),
]


@pytest.mark.parametrize("L, p, kw, parts", REFUSALS)
def test_refusals_name_the_flags(L, p, kw, parts):
    with pytest.raises(LayoutError) as exc:
        pipeline_split(L, p, **kw)
    assert "\n" not in exc.value.reason
    for part in parts:
        assert part in exc.value.reason, exc.value.reason


# ---- the cost model ----------------------------------------------------------------------------------------

MODEL = ModelSpec(name="split", num_layers=14, hidden_size=1024, num_attention_heads=8, num_query_groups=8,
                  ffn_hidden_size=4096, vocab_size=8192)


def _plan(**kw) -> Plan:
    base = dict(num_gpus=4, seq_length=2048, global_batch_size=8, pipeline_model_parallel_size=4, ckpt="no",
                use_distributed_optimizer=False, sequence_parallel=False)
    return Plan(**{**base, **kw})


@pytest.mark.parametrize("kw, stages", [
    (dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True), [3, 4, 4, 3]),
    (dict(decoder_first_pipeline_num_layers=2, decoder_last_pipeline_num_layers=4), [2, 4, 4, 4]),
    (dict(decoder_last_pipeline_num_layers=2), [4, 4, 4, 2]),
    (dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True,
          num_layers_per_virtual_pipeline_stage=2), [3, 4, 4, 3]),
    (dict(decoder_first_pipeline_num_layers=2, decoder_last_pipeline_num_layers=4,
          num_virtual_stages_per_pipeline_rank=2), [2, 4, 4, 4]),
])
def test_plan_stage_layers_follow_megatrons_rule(kw, stages):
    plan = _plan(**kw)
    validate_plan(MODEL, plan, get_system("h800"))
    assert [plan.stage_layers(14, r) for r in range(4)] == stages
    assert plan.layers_per_rank(14) == 4  # a middle stage
    v = 2 if ("num_layers_per_virtual_pipeline_stage" in kw or "num_virtual_stages_per_pipeline_rank" in kw) else 1
    assert plan.virtual_size(14) == v


def test_the_embedding_and_loss_slots_move_activation_memory():
    """With --account-for-* the first/last stage hold one layer fewer: their chunk's saved bytes are 3/4 of a
    middle stage's (the first stage's embedding dropout mask aside, 0 here)."""
    from h3t_ext.costmodel.activations import microbatch_chunk_bytes

    plan = _plan(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    model = ModelSpec(name="split", num_layers=14, hidden_size=1024, num_attention_heads=8, num_query_groups=8,
                      ffn_hidden_size=4096, vocab_size=8192, hidden_dropout=0.0)
    a = [microbatch_chunk_bytes(model, plan, r, sequence_parallel=False) for r in range(4)]
    assert 4 * a[0] == 3 * a[1] and a[1] == a[2] and 4 * a[3] == 3 * a[2]


@pytest.mark.parametrize("kw, needle", [
    (dict(account_for_embedding_in_pipeline_split=True), "= 15 is not a multiple of --pipeline-model-parallel-size 4"),
    (dict(account_for_loss_in_pipeline_split=True, decoder_first_pipeline_num_layers=2),
     "--account-for-loss-in-pipeline-split cannot be combined with"),
    (dict(decoder_first_pipeline_num_layers=2, num_layers_per_virtual_pipeline_stage=1),
     "--num-layers-per-virtual-pipeline-stage cannot be combined with"),
    (dict(decoder_first_pipeline_num_layers=3, decoder_last_pipeline_num_layers=3,
          num_virtual_stages_per_pipeline_rank=2), "is not a multiple of --num-virtual-stages-per-pipeline-rank 2"),
])
def test_plans_megatron_refuses_are_invalid(kw, needle):
    with pytest.raises(InvalidPlanError) as e:
        validate_plan(MODEL, _plan(**kw), get_system("h800"))
    assert needle in e.value.reason and "\n" not in e.value.reason


@pytest.mark.parametrize("kw", [
    dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True),
    dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True,
         num_layers_per_virtual_pipeline_stage=2),
    dict(decoder_first_pipeline_num_layers=2, decoder_last_pipeline_num_layers=4),
    dict(decoder_first_pipeline_num_layers=2, decoder_last_pipeline_num_layers=4, num_virtual_stages_per_pipeline_rank=2),
])
def test_split_flags_round_trip(kw):
    plan = _plan(sequence_parallel=True, **kw)  # at t = 1 the flags leave --sequence-parallel out: Plan's default
    flags = megatron_flags(plan)
    for name, value in kw.items():
        flag = "--" + name.replace("_", "-")
        assert flag in flags and (value is True or flags[flags.index(flag) + 1] == str(value))
    assert plan_from_megatron_flags(flags, num_gpus=4, seq_length=2048) == plan


def test_the_translation_reads_megatrons_names():
    args = dict(seq_length=2048, global_batch_size=8, pipeline_model_parallel_size=4, ckpt="no",
                account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    plan = plan_from_args(args, num_gpus=4)
    assert plan.account_for_embedding_in_pipeline_split and plan.account_for_loss_in_pipeline_split
    assert [plan.stage_layers(14, r) for r in range(4)] == [3, 4, 4, 3]
    even = plan_from_args({k: v for k, v in args.items() if not k.startswith("account")}, num_gpus=4)
    assert not even.account_for_embedding_in_pipeline_split and not even.account_for_loss_in_pipeline_split
    assert [even.stage_layers(16, r) for r in range(4)] == [PipelineSplit(16, 4).stage_layers(r) for r in range(4)] \
        == [4, 4, 4, 4]
