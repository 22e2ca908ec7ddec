"""pretrain_gpt.py's Megatron-native path (megatron-core 0.17+ ships ``megatron.training``) through its seams.

megatron-core 0.16.1 (the newest for Python 3.11) has no ``megatron.training``, so these tests put a
stand-in for it on the path, in a subprocess: a ``pretrain()`` of each signature generation (0.17-0.18:
providers + ``extra_args_provider``; 0.19+: a config container from ``parse_and_validate_args``) that
does what Megatron's does with the callbacks: parse the flags with our ``extra_args_provider``, build
the model with our ``model_provider``, and run one training step through
``get_forward_backward_func()`` with our ``forward_step``. What is checked is ours: the flags, the
layer spec, the installed schedules and the losses. Megatron's real loop runs on a GPU
(``scripts/gpu_check.sh``).
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_COMMON = '''
import argparse, json, os, sys
import torch

_ARGS = None
OUT = os.environ["FAKE_MEGATRON_OUT"]


def get_args():
    return _ARGS


def get_tokenizer():
    raise AssertionError("not used")


def _parse(extra_args_provider, args_defaults):
    global _ARGS
    p = argparse.ArgumentParser()
    for flag, kind, default in (("--num-layers", int, 2), ("--pipeline-model-parallel-size", int, 1),
                                ("--recompute-granularity", str, None), ("--seed", int, 1234)):
        p.add_argument(flag, type=kind, default=default)
    p = extra_args_provider(p)
    args = p.parse_args(sys.argv[1:])
    for k, v in args_defaults.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    args.padded_vocab_size, args.max_position_embeddings, args.position_embedding_type = 128, 32, "rope"
    args.untie_embeddings_and_output_weights, args.rotary_percent, args.rotary_base = True, 1.0, 10000
    args.use_rope_scaling, args.rope_scaling_factor, args.rotary_seq_len_interpolation_factor = False, 8.0, None
    _ARGS = args
    return args


def _train(model_provider, forward_step_func, model_type):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from h3t_training.loop.initialize import set_random_seed
    from h3t_ext.runtime.pipeline.install import installed
    from h3t_ext.runtime.modules.layer_specs import built_for_ckpt

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["FAKE_MEGATRON_PORT"])
    dist.init_process_group("gloo", rank=0, world_size=1)
    ps.initialize_model_parallel()
    set_random_seed(_ARGS.seed, on_gpu=False)  # Megatron seeds its CUDA trackers; on CPU the driver's seeding
    model = model_provider(pre_process=True, post_process=True, config=None, pg_collection=None)
    g = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(2):
        tokens = torch.randint(0, 128, (2, 33), generator=g)
        batches.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(2, 32),
                        "position_ids": torch.arange(32).expand(2, 32), "attention_mask": None})
    fb = get_forward_backward_func()
    out = fb(forward_step_func=forward_step_func, data_iterator=iter(batches), model=model, num_microbatches=2,
             seq_length=32, micro_batch_size=2, forward_only=False)
    runtime = installed()
    json.dump({"losses": [float(d["lm loss"][0] / d["lm loss"][1]) for d in out],
               "schedule": fb.__qualname__, "ckpt": runtime.config.ckpt,
               "alpha": runtime.config.offload_alpha, "built_for": built_for_ckpt([model]),
               "grad_norm": float(sum(p.grad.norm() ** 2 for p in model.parameters() if p.grad is not None))},
              open(OUT, "w"))
'''

_V17 = _COMMON + '''

def pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
             process_non_loss_data_func=None, extra_args_provider=None, args_defaults={}, get_embedding_ranks=None,
             get_position_embedding_ranks=None, non_loss_data_func=None, store=None, inprocess_call_wrapper=None):
    assert getattr(train_valid_test_dataset_provider, "is_distributed", False)
    _parse(extra_args_provider, args_defaults)
    _train(model_provider, forward_step_func, model_type)
'''

_V19 = _COMMON + '''

def pretrain(cfg_container, train_valid_test_dataset_provider, model_type, forward_step_func, model_provider=None,
             process_non_loss_data_func=None, get_embedding_ranks=None, get_position_embedding_ranks=None,
             non_loss_data_func=None, store=None, inprocess_call_wrapper=None, p2p_communicator=None,
             pg_collection=None, skip_model_parallel_init=False):
    assert cfg_container == {"container-of": _ARGS}
    _train(model_provider, forward_step_func, model_type)
'''

_ARGUMENTS = '''
from megatron.training import _parse


def core_transformer_config_from_args(args):
    from h3t_ext.runtime.modules.gpt import tiny_llama_config
    return tiny_llama_config(num_layers=args.num_layers)


def parse_and_validate_args(extra_args_provider=None, ignore_unknown_args=False, args_defaults={}):
    return _parse(extra_args_provider, args_defaults)
'''

_UTILS = '''
def get_batch_on_this_tp_rank(data_iterator, mtp_on_this_rank=False):
    return next(data_iterator)
'''

_ARGUMENT_UTILS = '''
def pretrain_cfg_container_from_args(args, model_cfg=None):
    return {"container-of": args}
'''


def _stand_in(root: Path, generation: str) -> Path:
    pkg = root / "megatron" / "training"  # megatron is a namespace package: this joins megatron-core's
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(_V17 if generation == "0.17" else _V19)
    (pkg / "arguments.py").write_text(_ARGUMENTS)
    (pkg / "utils.py").write_text(_UTILS)
    if generation == "0.19":
        (pkg / "argument_utils.py").write_text(_ARGUMENT_UTILS)
    return root


def _run(tmp_path: Path, generation: str, flags: list[str]) -> tuple[subprocess.CompletedProcess, dict]:
    from h3t_ext.testing import free_port

    root = _stand_in(tmp_path / generation, generation) if not (tmp_path / generation).exists() else tmp_path / generation
    out = tmp_path / f"out-{len(list(tmp_path.glob('out-*')))}.json"
    code = textwrap.dedent(f"""
        import sys, warnings
        warnings.filterwarnings("ignore")
        sys.path[:0] = [{str(root)!r}, {str(REPO)!r}]
        from h3t_training.loop import megatron_native
        assert megatron_native.available()
        sys.exit(megatron_native.run({flags!r}, defaults={{"num_layers": 2}}))
    """)
    env = {"PATH": "/usr/bin:/bin", "FAKE_MEGATRON_OUT": str(out), "FAKE_MEGATRON_PORT": str(free_port()),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{root}:{REPO}"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    return proc, (json.loads(out.read_text()) if out.exists() else {})


@pytest.mark.parametrize("generation", ["0.17", "0.19"])
def test_kwai_flags_run_ckpt_ours_inside_megatrons_loop(tmp_path, generation):
    proc, kwai = _run(tmp_path, generation, ["--kaimm-recompute-norm", "--kaimm-recompute-mlp-activation-func"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert kwai["schedule"].startswith("H3TSchedules.") and kwai["ckpt"] == "ours" and kwai["alpha"] == 0.0
    assert kwai["built_for"] == "ours"  # the layer spec swapped the norm and activation modules
    proc, ours = _run(tmp_path, generation, ["--ckpt", "ours"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ours["losses"] == kwai["losses"] and ours["grad_norm"] == kwai["grad_norm"]
    proc, plain = _run(tmp_path, generation, [])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert plain["ckpt"] == "no" and plain["built_for"] == "no"
    assert plain["losses"] == pytest.approx(ours["losses"], rel=1e-5)  # same model, same data: same losses
    assert plain["grad_norm"] == pytest.approx(ours["grad_norm"], rel=1e-4)


def test_kwai_offload_ratio_reaches_the_runtime_and_its_layout_check(tmp_path):
    """One pipeline stage offloads layer by layer: the Kwai ratio trains with the losses of no offload; with one
    layer nothing hides a layer's copy and the runtime refuses it in one line."""
    proc, kwai = _run(tmp_path, "0.17", ["--kaimm-offload-activation-ratio", "0.5"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert kwai["alpha"] == 0.5
    proc, plain = _run(tmp_path, "0.17", [])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert kwai["losses"] == pytest.approx(plain["losses"], rel=1e-6, abs=0)
    proc, _ = _run(tmp_path, "0.17", ["--kaimm-offload-activation-ratio", "0.5", "--num-layers", "1"])
    assert proc.returncode != 0
    assert "RuntimeConfigError: --offload-alpha 0.5 cannot be overlapped: at --pipeline-model-parallel-size 1" \
        in proc.stderr


def test_megatron_loop_refuses_what_its_own_flags_do(tmp_path):
    from h3t_training.errors import ArgumentError
    from h3t_training.loop.megatron_native import add_h3t_arguments, runtime_config
    import argparse

    parser = add_h3t_arguments(argparse.ArgumentParser())
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=2)
    parser.add_argument("--recompute-granularity", default=None)
    with pytest.raises(ArgumentError, match="--ckpt full: with Megatron's own training loop use its "
                                            "--recompute-granularity full"):
        runtime_config(parser.parse_args(["--ckpt", "full"]))
    with pytest.raises(ArgumentError, match="--ckpt ours contradicts --recompute-granularity selective"):
        runtime_config(parser.parse_args(["--ckpt", "ours", "--recompute-granularity", "selective"]))
    with pytest.raises(ArgumentError, match="--offload-alpha has 3 values; give 1 or one per pipeline stage"):
        runtime_config(parser.parse_args(["--offload-alpha", "0.1,0.2,0.3"]))
    assert runtime_config(parser.parse_args(["--offload-alpha", "0.1,0.2"])).offload_alpha == (0.1, 0.2)
    # Megatron-LM's default gradient accumulation fusion, local layers, no apex extension (none here): one line
    parser.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion",
                        action="store_false")
    parser.add_argument("--transformer-impl", default="transformer_engine")
    with pytest.raises(ArgumentError, match="--gradient-accumulation-fusion .Megatron's default. with "
                                            "--transformer-impl local needs NVIDIA apex's "
                                            "fused_weight_gradient_mlp_cuda extension, which is not importable"):
        runtime_config(parser.parse_args(["--transformer-impl", "local"]))
    assert runtime_config(parser.parse_args(["--transformer-impl", "local", "--no-gradient-accumulation-fusion"]))
    assert runtime_config(parser.parse_args([]))  # TransformerEngine's layers fuse it themselves
    # megatron-core 0.19's loop divides train_iters by eval_interval, which has no default there
    parser.add_argument("--train-iters", type=int)
    parser.add_argument("--eval-interval", type=int)
    with pytest.raises(ArgumentError, match="--eval-interval is required by Megatron's own training loop with "
                                            "--train-iters"):
        runtime_config(parser.parse_args(["--train-iters", "20"]))
    assert runtime_config(parser.parse_args(["--train-iters", "20", "--eval-interval", "1000"]))


def test_pretrain_gpt_keeps_the_driver_without_megatron_training_or_a_gpu():
    import pretrain_gpt

    assert not pretrain_gpt.use_megatron_loop(["--num-layers", "2"])  # 0.16.1 here: no megatron.training
