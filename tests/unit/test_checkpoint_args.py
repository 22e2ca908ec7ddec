"""--use-checkpoint-args: the model's flags taken from the args a checkpoint saved, by Megatron-LM's rule
(megatron/training/checkpointing.py load_args_from_checkpoint, core_v0.16.1 and core_v0.19.0): a forced field is the
checkpoint's whatever the command line said, another only where the command line left it None; the tokenizer unless
--no-use-tokenizer-model-from-checkpoint-args, the parallel sizes only with --use-mp-args-from-checkpoint-args;
--pretrained-checkpoint's first, then --load's. The reader is a stand-in here (the checkpoint files are read by
h3t_training.loop.saved_args, tested through the driver in tests/integration/test_use_checkpoint_args.py)."""
from __future__ import annotations

import argparse

import pytest

from h3t_training.config.checkpoint_args import SavedArgs, megatron_args
from h3t_training.config.sections import parse_args
from h3t_training.data.tokenizer import run_padded_vocab_size

RUN = ["--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--use-checkpoint-args"]
SAVED = dict(num_layers=6, hidden_size=96, num_attention_heads=6, seq_length=128, ffn_hidden_size=256,
             kv_channels=16, max_position_embeddings=256, group_query_attention=True, num_query_groups=2,
             swiglu=False, normalization="LayerNorm", add_bias_linear=True, position_embedding_type="learned_absolute",
             untie_embeddings_and_output_weights=False, attention_dropout=0.1, hidden_dropout=0.0, rotary_base=500000,
             rotary_percent=1.0, tokenizer_type="NullTokenizer", tokenizer_model=None, tensor_model_parallel_size=2,
             pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=None, num_experts=None,
             apply_query_key_layer_scaling=False, use_rotary_position_embeddings=False)


def reader(by_root: dict):
    """A reader over {root: saved fields}; a root it does not know holds no checkpoint."""
    def read(root, step):
        if root not in by_root:
            return None
        values = by_root[root]
        return SavedArgs(f"{root}: checkpoint iteration {step or 5}", values,
                         3.0 if values is None else values.pop("_version", 3.0))
    return read


def parse(argv, saved=None, *, world_size=4, **kw):
    return parse_args([*RUN, "--vocab-size", "100", *argv], world_size=world_size,
                      read_checkpoint_args=reader({"ckpt": dict(SAVED, **(saved or {}))}), **kw)


def test_the_shape_comes_from_the_checkpoint_and_a_given_flag_of_a_not_forced_field_wins():
    config = parse(["--load", "ckpt", "--num-layers", "4", "--seq-length", "64"], prog="pretrain_gpt.py")
    assert (config.num_layers, config.seq_length) == (4, 64)  # given: Megatron-LM keeps them
    assert (config.hidden_size, config.num_attention_heads, config.ffn_hidden_size, config.kv_channels,
            config.max_position_embeddings) == (96, 6, 256, 16, 256)
    assert (config.group_query_attention, config.num_query_groups, config.rotary_base) == (True, 2, 500000)
    notes = [n for n in config.flag_notices if "--use-checkpoint-args" in n]
    assert notes == ["note: --use-checkpoint-args: from --load ckpt: checkpoint iteration 5: hidden_size=96, "
                     "ffn_hidden_size=256, num_attention_heads=6, num_query_groups=2, group_query_attention=True, "
                     "kv_channels=16, max_position_embeddings=256, rotary_base=500000, hidden_dropout=0.0, "
                     "tokenizer_type=NullTokenizer"]


def test_a_forced_field_is_the_checkpoints_over_the_command_line():
    """pretrain_llama.py's defaults (and flags) say a Llama: the checkpoint's GPT switches win, as in Megatron-LM."""
    config = parse(["--load", "ckpt", "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
                    "--position-embedding-type", "rope", "--hidden-dropout", "0.2"])
    assert (config.swiglu, config.normalization, config.disable_bias_linear, config.position_embedding_type,
            config.untie_embeddings_and_output_weights, config.hidden_dropout, config.attention_dropout) == (
        False, "LayerNorm", False, "learned_absolute", False, 0.0, 0.1)
    assert config.ffn_hidden_size == 256  # the checkpoint's, not SwiGLU's derived size


def test_query_groups_count_only_with_group_query_attention():
    """Megatron-LM saves its default num_query_groups 1 without GQA (and this driver the number of heads): unread,
    so the run has as many groups as heads, whatever the command line said."""
    for saved in ({"group_query_attention": False, "num_query_groups": 1},
                  {"group_query_attention": False, "num_query_groups": 6}):
        config = parse(["--load", "ckpt", "--group-query-attention", "--num-query-groups", "3"], saved)
        assert (config.group_query_attention, config.num_query_groups) == (False, 6)
    config = parse(["--load", "ckpt"], {"group_query_attention": False, "num_query_groups": None})
    assert config.num_query_groups == 6


def test_older_names_of_the_bias_and_rope_switches():
    config = parse(["--load", "ckpt"], {"disable_bias_linear": True, "use_rotary_position_embeddings": True})
    assert config.disable_bias_linear and config.position_embedding_type == "rope"
    # this driver's own older legacy files: its destinations only
    older = {"add_bias_linear": None, "add_position_embedding": None, "no_position_embedding": True,
             "position_embedding_type": "rope"}
    assert parse(["--load", "ckpt"], older).no_position_embedding


def test_the_tokenizer_is_taken_unless_told_otherwise():
    saved = {"tokenizer_type": "GPT2BPETokenizer"}
    assert parse(["--load", "ckpt", "--tokenizer-type", "NullTokenizer"], {"tokenizer_type": "NullTokenizer"}
                 ).tokenizer_type == "NullTokenizer"
    with pytest.raises(SystemExit):  # GPT2BPETokenizer taken: its --vocab-file is missing
        parse(["--load", "ckpt", "--tokenizer-type", "NullTokenizer"], saved)
    for flag in ("--no-use-tokenizer-model-from-checkpoint-args", "--disable-use-tokenizer-model-from-checkpoint-args"):
        assert parse(["--load", "ckpt", "--tokenizer-type", "NullTokenizer", flag], saved
                     ).tokenizer_type == "NullTokenizer"


def test_the_padded_vocabulary_is_taken_where_the_command_line_has_none():
    """Megatron-LM's _set_arg('padded_vocab_size'): the checkpoint's rows unless --padded-vocab-size is given."""
    assert run_padded_vocab_size(parse(["--load", "ckpt"], {"padded_vocab_size": 512})) == 512
    assert run_padded_vocab_size(parse(["--load", "ckpt", "--padded-vocab-size", "256"],
                                       {"padded_vocab_size": 512})) == 256


def test_parallel_sizes_only_with_use_mp_args():
    assert parse(["--load", "ckpt", "--tensor-model-parallel-size", "1"]).tensor_model_parallel_size == 1
    config = parse(["--load", "ckpt", "--tensor-model-parallel-size", "1", "--use-mp-args-from-checkpoint-args"])
    assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size) == (2, 2)
    # before checkpoint version 3.0 Megatron-LM read model_parallel_size, and only where the command line has none
    old = {"_version": 2.0, "model_parallel_size": 2, "tensor_model_parallel_size": None}
    config = parse(["--load", "ckpt", "--use-mp-args-from-checkpoint-args"], old)
    assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size) == (2, 1)
    assert parse(["--load", "ckpt", "--use-mp-args-from-checkpoint-args", "--tensor-model-parallel-size", "1"], old
                 ).tensor_model_parallel_size == 1


def test_pretrained_checkpoint_first_then_load():
    """Megatron-LM calls load_args_from_checkpoint for --pretrained-checkpoint, then for --load: a forced field ends
    as --load's, another as the first checkpoint's that holds it."""
    read = reader({"base": dict(SAVED), "run": dict(SAVED, hidden_size=128, normalization="RMSNorm")})
    config = parse_args([*RUN, "--vocab-size", "100", "--pretrained-checkpoint", "base", "--load", "run"],
                        world_size=4, read_checkpoint_args=read)
    assert (config.hidden_size, config.normalization) == (96, "RMSNorm")
    config = parse_args([*RUN, "--vocab-size", "100", "--pretrained-checkpoint", "base", "--load", "empty"],
                        world_size=4, read_checkpoint_args=read)
    assert config.hidden_size == 96 and "note: --use-checkpoint-args: --load empty holds no checkpoint" in \
        config.flag_notices


def _error(capsys, argv, saved=None, **kw) -> str:
    with pytest.raises(SystemExit) as e:
        parse(argv, saved, **kw)
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_what_cannot_run_is_one_line(capsys):
    assert _error(capsys, []).endswith("--use-checkpoint-args requires --load or --pretrained-checkpoint (the "
                                       "checkpoint to take the model's arguments from)")
    assert _error(capsys, ["--load", "nowhere"]).endswith(
        "the following arguments are required: --num-layers, --hidden-size, --num-attention-heads, --seq-length "
        "(--use-checkpoint-args: --load holds no checkpoint)")
    assert _error(capsys, ["--load", "ckpt"], {"hidden_size": None, "seq_length": None}).endswith(
        "the following arguments are required: --hidden-size, --seq-length (--use-checkpoint-args: --load ckpt: "
        "checkpoint iteration 5 does not hold them)")
    assert _error(capsys, ["--load", "ckpt"], {"position_embedding_type": "yarn"}).endswith(
        "--use-checkpoint-args: --load ckpt: checkpoint iteration 5 has --position-embedding-type 'yarn', which this "
        "driver does not build (choose from learned_absolute, rope, none)")
    line = _error(capsys, ["--load", "ckpt"], {"num_experts": 8})  # the flag table refuses it as if typed
    assert "--num-experts is not supported: mixture-of-experts layers are not implemented" in line
    assert "(--use-checkpoint-args: from --load ckpt: checkpoint iteration 5: num_layers=6, hidden_size=96, " in line
    assert line.endswith(", num_experts=8, tokenizer_type=NullTokenizer)"), line


def test_a_taken_switch_is_classed_by_the_flag_table_as_if_typed():
    """apply_query_key_layer_scaling changes only fp16 attention: the table notices it on CPU (refuses it on a GPU)."""
    notes = parse(["--load", "ckpt"], {"apply_query_key_layer_scaling": True}).flag_notices
    assert any(n.startswith("note: --apply-query-key-layer-scaling: ") for n in notes), notes
    assert not any("--apply-query-key-layer-scaling" in n for n in parse(["--load", "ckpt"]).flag_notices)


def test_exit_on_missing_checkpoint_exits_where_megatron_lm_does(capsys):
    """Megatron-LM's load_args_from_checkpoint exits (status 0) where a directory it reads holds no checkpoint
    under --exit-on-missing-checkpoint: --pretrained-checkpoint's first, and --load's even when the first holds one;
    no directory named, nothing read, no exit."""
    read = reader({"base": dict(SAVED)})
    for argv in (["--load", "empty"], ["--pretrained-checkpoint", "empty", "--load", "base"],
                 ["--pretrained-checkpoint", "base", "--load", "empty"]):
        with pytest.raises(SystemExit) as e:
            parse_args([*RUN, "--vocab-size", "100", "--exit-on-missing-checkpoint", *argv], world_size=4,
                       read_checkpoint_args=read)
        assert e.value.code == 0
        flag = "--load" if argv[-1] == "empty" else "--pretrained-checkpoint"
        assert capsys.readouterr().out == (f"note: no checkpoint in {flag} empty; --exit-on-missing-checkpoint: "
                                           "exiting (--use-checkpoint-args reads the checkpoint's arguments first, as "
                                           "Megatron-LM does)\n")
    config = parse_args([*RUN, "--vocab-size", "100", "--exit-on-missing-checkpoint", "--load", "base"],
                        world_size=4, read_checkpoint_args=read)
    assert config.hidden_size == 96


def test_a_caller_without_a_reader_says_so(capsys):
    with pytest.raises(SystemExit):
        parse_args([*RUN, "--load", "ckpt"], world_size=4)
    assert "--use-checkpoint-args is not available here" in capsys.readouterr().err


def test_the_saved_args_carry_megatrons_names_and_plain_values():
    config = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
                         "32", "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3", "--mock-data",
                         "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--no-position-embedding"],
                        world_size=1)
    ns = megatron_args(config, 128)
    assert isinstance(ns, argparse.Namespace)
    assert (ns.num_layers, ns.swiglu, ns.add_bias_linear, ns.add_position_embedding, ns.padded_vocab_size,
            ns.position_embedding_type, ns.ckpt) == (2, True, False, False, 128, "rope", "no")
    assert all(type(v) in (type(None), bool, int, float, str, list, tuple) for v in vars(ns).values())
    assert not any(k.startswith("_") for k in vars(ns))


MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32"]
COMPARED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "num_query_groups",
            "group_query_attention", "ffn_hidden_size", "kv_channels", "max_position_embeddings", "swiglu",
            "squared_relu", "normalization", "disable_bias_linear", "add_qkv_bias", "position_embedding_type",
            "no_position_embedding", "untie_embeddings_and_output_weights", "apply_layernorm_1p", "rotary_base",
            "rotary_percent", "rotary_interleaved", "hidden_dropout", "attention_dropout", "tokenizer_type")


@pytest.mark.parametrize("prog,argv", [
    ("pretrain_gpt.py", []),
    ("pretrain_llama.py", []),
    ("pretrain_llama.py", ["--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "96",
                           "--kv-channels", "8", "--rotary-base", "500000", "--qk-layernorm"]),
    ("pretrain_gpt.py", ["--use-rotary-position-embeddings", "--no-position-embedding", "--add-qkv-bias",
                         "--apply-layernorm-1p", "--max-position-embeddings", "64", "--attention-dropout", "0.0"]),
    ("pretrain_gpt.py", ["--squared-relu", "--disable-bias-linear", "--normalization", "RMSNorm",
                         "--untie-embeddings-and-output-weights"]),
])
def test_a_drivers_saved_args_give_back_its_model(prog, argv):
    """What this driver saves, read by --use-checkpoint-args into a command line without the model's flags (and with
    the other entry point's defaults), is the same model."""
    run = ["--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
           "NullTokenizer", "--vocab-size", "100"]
    saved = parse_args([*MODEL, *argv, *run], world_size=1, prog=prog)
    values = vars(megatron_args(saved, run_padded_vocab_size(saved)))
    other = "pretrain_gpt.py" if prog == "pretrain_llama.py" else "pretrain_llama.py"
    taken = parse_args([*run, "--use-checkpoint-args", "--load", "ckpt"], world_size=1, prog=other,
                       read_checkpoint_args=lambda root, step: SavedArgs("ckpt: checkpoint iteration 2", values))
    assert {k: getattr(taken, k) for k in COMPARED} == {k: getattr(saved, k) for k in COMPARED}
