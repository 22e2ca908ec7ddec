"""The driver's configuration is closed and typed; the library's one ckpt enum, one alpha type, one flags-to-Plan
translation and one FLOPs formula are what the driver uses."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from h3t_ext.ckpt import Ckpt
from h3t_ext.costmodel import ModelSpec
from h3t_ext.costmodel.mfu import mfu
from h3t_ext.offload_alpha import OffloadAlpha, format_alpha
from h3t_ext.planner.translate import plan_from_args
from h3t_training.config.sections import TrainConfig, UnknownConfigFieldError, parse_args
from h3t_training.telemetry.training_log import IterationLogger
from h3t_training.data.tokenizer import NullTokenizer  # the driver's V for --vocab-size 32000

REPO = Path(__file__).resolve().parents[2]
BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3", "--mock-data"]


def test_a_misspelled_field_raises_where_it_is_written():
    config = parse_args(BASE, world_size=1)
    with pytest.raises(UnknownConfigFieldError, match=r"'num_layer'.*did you mean 'num_layers'"):
        config.replace(num_layer=8)
    with pytest.raises(UnknownConfigFieldError, match="did you mean 'micro_batch_size'"):
        config.micro_batch_sise  # noqa: B018 - the read is the test
    with pytest.raises(UnknownConfigFieldError):
        TrainConfig.from_namespace(parse_args.__globals__["arguments"].build_parser().parse_args(BASE),
                                   world_sise=2)
    assert config.replace(num_layers=8).num_layers == 8 and config.num_layers == 4


def test_derived_fields_exist_from_the_start():
    """Readers never need a default: the derived fields are there (None or empty) before any step sets them."""
    config = parse_args(BASE, world_size=1)
    assert config.auto_plan_flags is None and config.flag_notices == () and config.world_size == 1
    assert config.batch_schedule is not None and config.data_parallel_size == 1


def test_no_getattr_default_on_the_config_in_the_driver():
    """``getattr(config, name, default)`` would hide a misspelled name; the config is closed instead."""
    offenders = []
    for path in sorted((REPO / "h3t_training").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) == 3 \
                    and isinstance(node.args[0], ast.Name) and node.args[0].id in ("args", "config", "cfg"):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert offenders == []


def test_ckpt_is_one_enum_everywhere():
    config = parse_args(BASE + ["--ckpt", "ours"], world_size=1)
    assert config.ckpt is Ckpt.OURS
    plan = plan_from_args(config, num_gpus=1)
    assert plan.ckpt is Ckpt.OURS and str(plan.ckpt) == "ours" and json.dumps(plan.ckpt) == '"ours"'
    assert parse_args(BASE + ["--recompute-granularity", "full"], world_size=1).ckpt is Ckpt.FULL
    with pytest.raises(ValueError, match=r"--ckpt 'some' is not one of \{no,full,ours,selective\}"):
        Ckpt.parse("some")


@pytest.mark.parametrize("text,values", [("0.5", 0.5), ("0.1,0.2", (0.1, 0.2)), ("1", 1.0), ("0", 0.0)])
def test_offload_alpha_round_trips(text, values):
    alpha = OffloadAlpha.parse(text)
    assert alpha.alpha == values and OffloadAlpha.parse(str(alpha)).alpha == values
    assert OffloadAlpha.parse(format_alpha(values)) == alpha


@pytest.mark.parametrize("text,message", [
    ("1.5", "--offload-alpha 1.5 is outside [0, 1]"), ("-0.1", "--offload-alpha -0.1 is outside [0, 1]"),
    ("nan", "--offload-alpha nan is outside [0, 1]"), ("inf", "--offload-alpha inf is outside [0, 1]"),
    ("half", "--offload-alpha 'half' is not a number"), ("0.1,", "is not a number"),
])
def test_offload_alpha_errors_name_the_flag_and_range(text, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")) as e:
        OffloadAlpha.parse(text)
    assert "valid: a number in [0, 1]" in str(e.value)


def test_offload_alpha_per_stage_count_is_checked():
    assert OffloadAlpha.parse("0.1,0.2").per_stage(2) == (0.1, 0.2)
    assert OffloadAlpha.parse("0.3").per_stage(3) == (0.3, 0.3, 0.3)
    with pytest.raises(ValueError, match="has 2 values; give 1 or one per pipeline stage"):
        OffloadAlpha.parse("0.1,0.2").for_pipeline(4)
    with pytest.raises(ValueError, match="resolved by the cost model"):
        OffloadAlpha.parse("auto").alpha


def test_the_translation_takes_megatron_defaults_not_the_plans():
    """A run that does not name sequence parallelism or the distributed optimizer ran without them (Megatron's
    defaults), whatever Plan's own defaults are."""
    run = {"seq_length": 2048, "global_batch_size": 8, "tensor_model_parallel_size": 2, "ckpt": "no"}
    plan = plan_from_args(run, num_gpus=4)
    assert plan.sequence_parallel is False and plan.use_distributed_optimizer is False
    assert plan.overlap_p2p_comm is True and plan.data_parallel_sharding_strategy is None
    assert plan_from_args({**run, "use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim_grads"},
                          num_gpus=4).data_parallel_sharding_strategy == "optim_grads"
    assert plan_from_args({k: v for k, v in run.items() if k != "ckpt"}, num_gpus=4).ckpt is Ckpt.NO
    assert plan_from_args({**{k: v for k, v in run.items() if k != "ckpt"}, "recompute_granularity": "full"},
                          num_gpus=4).ckpt is Ckpt.FULL
    with pytest.raises(ValueError, match="does not name global_batch_size"):
        plan_from_args({"seq_length": 2048, "ckpt": "no"}, num_gpus=1)


def _old_three_hf_flops(config, vocab: int) -> float:
    """The driver's formula before it used the cost model's: 3hf MLP FLOPs whatever the activation."""
    L, h, f, s = config.num_layers, config.hidden_size, config.ffn_hidden_size, config.seq_length
    h_kv = config.num_query_groups * (h // config.num_attention_heads)
    return 3 * (2 * L * (2 * h * h + 2 * h * h_kv + 3 * h * f) + 2 * s * h * L + 2 * vocab * h)


@pytest.mark.parametrize("prog,swiglu", [("pretrain_gpt.py", False), ("pretrain_llama.py", True)])
def test_logged_mfu_is_the_cost_models_for_the_measured_time(prog, swiglu):
    flags = BASE + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--ffn-hidden-size", "256",
                    "--max-position-embeddings", "32"]
    config = parse_args(flags + (["--untie-embeddings-and-output-weights"] if not swiglu else []), prog=prog,
                        world_size=1)
    vocab = 1001  # NullTokenizer: --vocab-size plus its end-of-document token
    logger = IterationLogger(config, vocab_size=vocab, on_gpu=False, is_logging_rank=False)  # peak 1 FLOP/s
    elapsed = 0.25
    rec = logger.record(1, 3.0, elapsed, 1e-3, 1.0)
    model = ModelSpec(name="by-hand", num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=4,
                      ffn_hidden_size=256, vocab_size=vocab, swiglu=swiglu)
    tokens_per_s = 4 * 32 / elapsed
    assert rec["tokens_per_second_per_gpu"] == pytest.approx(tokens_per_s, rel=1e-12)
    assert rec["mfu"] == pytest.approx(mfu(model, 32, tokens_per_s, 1.0), rel=1e-12)
    old = _old_three_hf_flops(config, vocab) * tokens_per_s
    assert (rec["mfu"] == pytest.approx(old, rel=1e-12)) is swiglu  # GeLU's FC1 is f wide: 2hf, not 3hf


MODEL = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--ffn-hidden-size", "11008",
         "--seq-length", "4096", "--global-batch-size", "16", "--micro-batch-size", "1"]
LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
          "--num-layers-per-virtual-pipeline-stage", "4", "--ckpt", "no"]


@pytest.mark.parametrize("switches", [[], ["--use-distributed-optimizer"], ["--sequence-parallel"],
                                      ["--use-distributed-optimizer", "--sequence-parallel"], ["--fp16"]])
def test_driver_auto_alpha_is_the_planners_for_the_same_flags(switches, capsys):
    """--offload-alpha auto through the driver sizes alpha for the run it launches: the alpha of
    ``h3t-plan estimate`` given the same flags (the planner spells 'off' as --no-...)."""
    from h3t_ext.planner.cli import main as plan_main

    def planned(*extra) -> dict:
        capsys.readouterr()
        assert plan_main(planner + list(extra)) == 0
        return json.loads(capsys.readouterr().out)

    planner = ["estimate", *MODEL, *LAYOUT, "--vocab-size", str(NullTokenizer(32000).vocab_size), "--num-gpus", "8", "--gpu", "h800", "--json"]
    planner += [] if "--use-distributed-optimizer" in switches else ["--no-use-distributed-optimizer"]
    planner += [] if "--sequence-parallel" in switches else ["--no-sequence-parallel"]
    planner += [s for s in switches if s == "--fp16"]  # fp16 gradients (Megatron-LM's) on both sides
    low, high = (planned("--offload-alpha", a)["peak_memory_bytes"] for a in ("1", "0"))
    assert low < high
    budget = str(int((low + high) / 2))  # alpha 0 does not fit, alpha 1 does
    expected = planned("--memory-budget", budget, "--offload-alpha", "auto")["offload_alpha"]
    config = parse_args(MODEL + LAYOUT + switches + [
        "--train-iters", "1", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
        "32000", "--offload-alpha", "auto", "--memory-budget", budget, "--gpu", "h800"], world_size=8)
    assert 0.0 < config.offload_alpha < 1.0
    assert config.offload_alpha == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("prog,norm,positions", [("pretrain_gpt.py", "LayerNorm", "learned_absolute"),
                                                 ("pretrain_llama.py", "RMSNorm", "rope")])
def test_the_driver_prices_the_norm_and_positions_it_builds(prog, norm, positions):
    from h3t_training.config.run_spec import model_spec

    # pretrain_gpt.py requires --max-position-embeddings, as Megatron-LM does; pretrain_llama.py fills it in
    config = parse_args(BASE + (["--max-position-embeddings", "32"] if prog == "pretrain_gpt.py" else []), prog=prog,
                        world_size=1)
    model = model_spec(config, vocab_size=1000)
    assert (model.normalization, model.position_embedding_type) == (norm, positions)
    assert model.max_position_embeddings == 32  # --seq-length, as the driver fills it in
    assert model_spec(parse_args(BASE + ["--max-position-embeddings", "64"], prog=prog, world_size=1),
                      vocab_size=1000).max_position_embeddings == 64
