"""--use-checkpoint-args through the driver: a run that leaves the model's flags out takes them from the args its
checkpoint saved (this driver's torch_dist and --ckpt-format torch checkpoints, and one Megatron-LM wrote) and trains
exactly as the run that gives them all."""
from __future__ import annotations

import importlib.util
import json
import subprocess

import pytest

from driver_harness import PYTHON, REPO, TINY_MODEL, _env, check_ok, losses, read_common, \
    run_pretrain  # noqa: F401

SHAPE = {"--num-layers", "--hidden-size", "--num-attention-heads", "--group-query-attention", "--num-query-groups",
         "--ffn-hidden-size", "--seq-length"}
"""The model flags of TINY_MODEL the runs under test leave out (--group-query-attention takes no value)."""
RUN = ["--micro-batch-size", "1", "--global-batch-size", "2", "--lr-warmup-iters", "0", "--train-iters", "4"]


def _without_shape(flags: list[str]) -> list[str]:
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
        elif f in SHAPE:
            skip = f != "--group-query-attention"
        else:
            out.append(f)
    return out


@pytest.fixture(scope="module")
def saved(corpus_prefix, tmp_path_factory):
    """Checkpoints at iteration 2 in both formats (the same run twice) and the full-flag finetune of one."""
    root = tmp_path_factory.mktemp("ckptargs")
    flags = [*TINY_MODEL, *RUN, "--data-path", corpus_prefix]
    for fmt in ("torch_dist", "torch"):
        check_ok(run_pretrain([*flags, "--save", str(root / fmt), "--ckpt-format", fmt, "--exit-interval", "2"]))
    check_ok(run_pretrain([*flags, "--load", str(root / "torch_dist"), "--finetune", "--metrics-json",
                           str(root / "ref.json")]))
    return root, flags


def test_the_driver_saves_its_flags_as_megatron_lm_args(saved):
    root, _ = saved
    ns = read_common(root / "torch_dist" / "iter_0000002")["args"]
    assert (ns.num_layers, ns.hidden_size, ns.num_query_groups, ns.ffn_hidden_size, ns.seq_length, ns.swiglu,
            ns.add_bias_linear, ns.padded_vocab_size) == (4, 64, 2, 128, 64, True, False, 384)


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_a_run_without_the_model_flags_trains_the_checkpoints_model(saved, fmt):
    root, flags = saved
    out = root / f"taken-{fmt}.json"
    # pretrain_gpt.py: Megatron-LM's GPT defaults (LayerNorm, GeLU, biases), all forced to the checkpoint's Llama
    proc = run_pretrain([*_without_shape(flags), "--load", str(root / fmt), "--finetune", "--use-checkpoint-args",
                         "--metrics-json", str(out)], entry="pretrain_gpt.py")
    check_ok(proc)
    note = [line for line in proc.stdout.splitlines() if line.startswith("note: --use-checkpoint-args")]
    assert len(note) == 1 and note[0].startswith(f"note: --use-checkpoint-args: from --load {root / fmt}: checkpoint "
                                                 "iteration 2: num_layers=4, hidden_size=64, ffn_hidden_size=128, "
                                                 "seq_length=64, num_attention_heads=4"), note
    assert "swiglu=True" in note[0] and "normalization=RMSNorm" in note[0] and "add_bias_linear=False" in note[0]
    assert losses(out) == losses(root / "ref.json")


def test_a_megatron_lm_checkpoints_args_are_read_too(saved, tmp_path):
    """The checkpoint rewritten into Megatron-LM's own layout (its args Namespace in the common state, no 'h3t'
    section): the same run from its args."""
    root, flags = saved
    dst = tmp_path / "megatron"
    proc = subprocess.run([PYTHON, str(REPO / "tests" / "megatron_written_checkpoint.py"), str(root / "torch_dist"),
                           str(dst), "torch_dist", "--", *flags], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "h3t" not in read_common(dst / "iter_0000002")
    out = tmp_path / "m.json"
    proc = run_pretrain([*_without_shape(flags), "--load", str(dst), "--finetune", "--use-checkpoint-args",
                         "--metrics-json", str(out)])
    check_ok(proc)
    assert f"note: --use-checkpoint-args: from --load {dst}: checkpoint iteration 2: num_layers=4, " in proc.stdout
    assert losses(out) == losses(root / "ref.json")


def test_without_a_checkpoint_the_missing_flags_are_one_line(saved, tmp_path):
    _, flags = saved
    proc = run_pretrain([*_without_shape(flags), "--load", str(tmp_path / "none"), "--use-checkpoint-args"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(
        "the following arguments are required: --num-layers, --hidden-size, --num-attention-heads, --seq-length "
        "(--use-checkpoint-args: --load holds no checkpoint)"), proc.stderr


def test_the_launch_scripts_preflight_reads_the_checkpoints_args(saved):
    root, flags = saved
    cmd = [PYTHON, "-m", "h3t_training.launch.preflight", "--world-size", "1", "--", *_without_shape(flags)]
    ok = subprocess.run([*cmd, "--load", str(root / "torch"), "--finetune", "--use-checkpoint-args"], cwd=REPO,
                        env=_env(), capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and ok.stderr == "", ok.stderr[-3000:]
    bad = subprocess.run([*cmd, "--load", str(root / "torch")], cwd=REPO, env=_env(), capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().endswith(
        "the following arguments are required: --num-layers, --hidden-size, --num-attention-heads, --seq-length")


_MEGATRON_READS = """
import json, sys
from megatron.training import arguments, checkpointing
args, _ = checkpointing.load_args_from_checkpoint(arguments.parse_args(ignore_unknown_args=True))
json.dump([args.num_layers, args.hidden_size, args.num_attention_heads, args.group_query_attention,
           args.num_query_groups, args.ffn_hidden_size, args.seq_length, args.swiglu, args.normalization,
           args.add_bias_linear, args.position_embedding_type, args.untie_embeddings_and_output_weights,
           args.padded_vocab_size], sys.stdout)
"""
"""Megatron-LM's own reader in a process of its own, as a run reads it: with torch.distributed initialized (an
earlier test of this process may leave it so) its read_metadata all-reduces on a CUDA tensor."""


@pytest.mark.skipif(importlib.util.find_spec("megatron.training") is None,
                    reason="megatron.training ships with megatron-core 0.17+ (scripts/megatron_compat_probe.sh runs "
                           "this file with the 0.19.2 wheel)")
@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_megatron_lm_reads_the_drivers_checkpoint_args(saved, fmt):
    """Megatron-LM's own load_args_from_checkpoint on this driver's checkpoint (nothing stubbed: its checkpoint
    reader, its parser): the model fields it takes are the ones the driver's run saved."""
    root, flags = saved
    proc = subprocess.run([PYTHON, "-c", _MEGATRON_READS, *_without_shape(flags), "--use-checkpoint-args", "--load",
                           str(root / fmt)], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert tuple(json.loads(proc.stdout.strip().splitlines()[-1])) == (4, 64, 4, True, 2, 128, 64, True, "RMSNorm",
                                                                        False, "rope", True, 384)
