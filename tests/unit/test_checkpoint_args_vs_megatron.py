"""--use-checkpoint-args against Megatron-LM's own load_args_from_checkpoint (megatron/training/checkpointing.py),
where the installed megatron-core ships megatron.training (0.17+; scripts/megatron_compat_probe.sh runs this with
the 0.19.2 wheel; under 0.16.1, which ships no megatron.training, it is skipped). The same command line and the same
saved args go through Megatron-LM's parser and function and through the driver's parse_args; the model fields the
run then has must agree."""
from __future__ import annotations

import argparse
import importlib.util
import sys

import pytest

from h3t_training.config.checkpoint_args import SavedArgs
from h3t_training.config.sections import parse_args

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron.training") is None,
                                reason="megatron.training ships with megatron-core 0.17+ (the compat probe's 0.19.2)")

ARGV = ["--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "100", "--use-checkpoint-args", "--load", "ckpt"]
SAVED = dict(num_layers=6, hidden_size=96, num_attention_heads=6, seq_length=128, ffn_hidden_size=256,
             kv_channels=16, max_position_embeddings=256, group_query_attention=True, num_query_groups=2,
             swiglu=True, normalization="RMSNorm", add_bias_linear=False, position_embedding_type="rope",
             add_position_embedding=False, use_rotary_position_embeddings=False,
             untie_embeddings_and_output_weights=True,
             attention_dropout=0.0, hidden_dropout=0.0, rotary_base=500000, rotary_percent=1.0,
             rotary_interleaved=False, add_qkv_bias=False, squared_relu=False, apply_layernorm_1p=False,
             apply_query_key_layer_scaling=False, tokenizer_type="NullTokenizer", tokenizer_model=None,
             tensor_model_parallel_size=2, pipeline_model_parallel_size=1, num_layers_per_virtual_pipeline_stage=None,
             num_experts=None)


def _megatron(argv: list[str], saved: dict, monkeypatch) -> argparse.Namespace:
    """Megatron-LM's args after its parser and load_args_from_checkpoint, the checkpoint read stubbed to ``saved``."""
    from megatron.training import arguments, checkpointing

    def base_checkpoint(load_dir, args, rank0=False, **kw):
        return {"args": argparse.Namespace(**saved), "iteration": 5, "checkpoint_version": 3.0}, load_dir, False, None

    monkeypatch.setattr(checkpointing, "_load_base_checkpoint", base_checkpoint)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    args = arguments.parse_args(ignore_unknown_args=True)
    return checkpointing.load_args_from_checkpoint(args)[0]


def _driver(argv: list[str], saved: dict):
    return parse_args(argv, world_size=2, prog="pretrain_gpt.py",
                      read_checkpoint_args=lambda root, step: SavedArgs(f"{root}: checkpoint iteration 5", dict(saved)))


def _effective(ns) -> dict:
    """The model a run's fields build, under Megatron-LM's names (num_query_groups only with GQA, as megatron-core
    reads it; the older rope switch as validate_args applies it)."""
    fields = {k: getattr(ns, k) for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                                         "ffn_hidden_size", "kv_channels", "max_position_embeddings", "swiglu",
                                         "normalization", "untie_embeddings_and_output_weights", "attention_dropout",
                                         "hidden_dropout", "rotary_base", "rotary_percent", "rotary_interleaved",
                                         "add_qkv_bias", "squared_relu", "apply_layernorm_1p", "tokenizer_type",
                                         "tensor_model_parallel_size", "pipeline_model_parallel_size")}
    fields["group_query_attention"] = bool(ns.group_query_attention)
    fields["num_query_groups"] = ns.num_query_groups if ns.group_query_attention else None
    if hasattr(ns, "add_bias_linear"):  # Megatron-LM's names
        fields.update(add_bias_linear=ns.add_bias_linear, add_position_embedding=ns.add_position_embedding,
                      position_embedding_type="rope" if ns.use_rotary_position_embeddings
                      else ns.position_embedding_type)
    else:
        fields.update(add_bias_linear=not ns.disable_bias_linear, add_position_embedding=not ns.no_position_embedding,
                      position_embedding_type=ns.position_embedding_type)
    return fields


@pytest.mark.parametrize("extra,saved", [
    ([], {}),
    (["--num-layers", "4", "--seq-length", "64", "--hidden-dropout", "0.2", "--normalization", "LayerNorm"], {}),
    (["--group-query-attention", "--num-query-groups", "3"], {"group_query_attention": False, "num_query_groups": 1}),
    (["--swiglu"], {"swiglu": False, "add_bias_linear": True, "normalization": "LayerNorm", "ffn_hidden_size": None,
                    "position_embedding_type": "learned_absolute", "add_position_embedding": True}),
    (["--tensor-model-parallel-size", "1", "--use-mp-args-from-checkpoint-args"], {}),
    (["--tensor-model-parallel-size", "1"], {}),
    (["--tokenizer-type", "NullTokenizer", "--no-use-tokenizer-model-from-checkpoint-args"],
     {"tokenizer_type": "GPT2BPETokenizer"}),
    ([], {"use_rotary_position_embeddings": True, "position_embedding_type": "learned_absolute",
          "kv_channels": None}),
    ([], {"disable_bias_linear": True, "add_bias_linear": True}),
])
def test_the_run_has_the_fields_megatron_lms_load_args_from_checkpoint_gives(extra, saved, monkeypatch):
    argv, values = [*ARGV, *extra], {**SAVED, **saved}
    megatron = _megatron(argv, values, monkeypatch)
    ours = _driver(argv, values)
    mine, theirs = _effective(ours), _effective(megatron)
    # what Megatron-LM's validate_args fills in after the load, the driver's resolution fills in the same way
    for k in ("ffn_hidden_size", "kv_channels"):
        if theirs[k] is None:
            theirs[k] = mine[k]
    assert mine == theirs
