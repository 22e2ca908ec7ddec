"""Megatron-LM's own training loop with h3t-ext inside, where ``megatron.training`` is importable.

megatron-core 0.17 and later ship Megatron's ``megatron.training`` (Python 3.12+). There,
``pretrain_gpt.py`` hands the run to Megatron's ``pretrain()``, so every Megatron feature comes from
Megatron itself. h3t-ext joins it through Megatron's own seams:

* flags: :func:`add_h3t_arguments` is the ``extra_args_provider``: ``--ckpt {no,ours}``,
  ``--offload-alpha`` (one ratio or one per pipeline stage) and Megatron-Kwai's
  ``--kaimm-offload-activation-ratio`` / ``--kaimm-recompute-norm`` /
  ``--kaimm-recompute-mlp-activation-func`` aliases; ``--ckpt full`` is Megatron's own
  ``--recompute-granularity full``;
* model: :func:`model_provider` builds megatron-core's GPTModel from h3t-ext's layer spec (ckpt=ours
  swaps the norm and MLP activation modules), with Megatron's TransformerConfig from the flags;
* schedules: the first model build installs h3t-ext's schedules (:func:`h3t_ext.install`), which
  Megatron's loop then gets from ``get_forward_backward_func()``;
* data: Megatron's GPT datasets through ``BlendedMegatronDatasetBuilder``.

Two generations of ``pretrain()`` exist: 0.17-0.18 take the providers and parse the flags
themselves (``extra_args_provider``, ``args_defaults``); 0.19+ take a config container built by
``parse_and_validate_args`` + ``pretrain_cfg_container_from_args``. :func:`run` picks by signature.
Our own driver (:mod:`h3t_training.loop.training`) serves CPU runs and megatron-core 0.16.1.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import os
from typing import Optional, Sequence

from h3t_ext.offload_alpha import OffloadAlpha
from h3t_training.errors import ArgumentError
from h3t_training.config.h3t_flags import add_h3t_flags
from h3t_training.config.megatron_compat import kwai_aliases


def available() -> bool:
    """True where Megatron's own ``megatron.training`` is importable (megatron-core 0.17+)."""
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except (ImportError, ValueError):
        return False


def missing_dataset_makefile() -> Optional[str]:
    """Why Megatron's own ``pretrain()`` cannot start here although ``megatron.training`` imports, or None.

    ``initialize_megatron`` runs ``make`` in ``megatron/core/datasets`` on rank 0 and exits when it fails: a Megatron-LM
    checkout has that Makefile, a megatron-core wheel ships the built helpers but no Makefile (the first GPU run of
    ``pretrain_gpt.py`` with the 0.19.2 wheel stopped there)."""
    try:
        spec = importlib.util.find_spec("megatron.core.datasets")
    except (ImportError, ValueError):
        return "megatron.core.datasets is not importable"
    folders = list(getattr(spec, "submodule_search_locations", None) or [])
    if not any(os.path.isfile(os.path.join(f, "Makefile")) for f in folders):
        where = folders[0] if folders else "megatron/core/datasets"
        return (f"{where} has no Makefile (a megatron-core wheel), and Megatron's initialize_megatron runs make there; "
                f"put a Megatron-LM checkout first on PYTHONPATH to use Megatron's loop")
    return None


def add_h3t_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's ``extra_args_provider``: h3t-ext's flags and Megatron-Kwai's aliases."""
    g = parser.add_argument_group("h3t-ext")
    add_h3t_flags(g)
    return parser


def runtime_config(args):
    """h3t-ext's runtime configuration from Megatron's parsed ``args`` (ArgumentError when they clash)."""
    from h3t_ext.runtime.config import H3TConfig  # noqa: PLC0415

    fields = {"ckpt": args.ckpt, "offload_alpha": args.offload_alpha, **kwai_aliases(args)}
    ckpt = fields["ckpt"] or "no"
    if ckpt == "full":
        raise ArgumentError("--ckpt full: with Megatron's own training loop use its --recompute-granularity full "
                            "--recompute-method uniform --recompute-num-layers 1")
    if ckpt == "ours" and args.recompute_granularity is not None:
        raise ArgumentError(f"--ckpt ours contradicts --recompute-granularity {args.recompute_granularity}")
    try:
        alpha = OffloadAlpha.parse("0" if fields["offload_alpha"] is None else fields["offload_alpha"])
        numbers = None if alpha.is_mode else alpha.for_pipeline(args.pipeline_model_parallel_size)
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    if numbers is None:
        raise ArgumentError(f"--offload-alpha {alpha.mode}: with Megatron's own training loop give the numbers "
                            f"(h3t-plan estimate --offload-alpha {alpha.mode} prints them)")
    _check_gradient_accumulation_fusion(args)
    _check_eval_interval(args)
    return H3TConfig(ckpt=ckpt, offload_alpha=numbers)


FUSED_WGRAD_MODULE = "fused_weight_gradient_mlp_cuda"
"""NVIDIA apex's CUDA extension that megatron-core's local ColumnParallelLinear/RowParallelLinear need for
``gradient_accumulation_fusion`` (TransformerEngine's linear layers fuse it themselves)."""


def _check_gradient_accumulation_fusion(megatron_args) -> None:
    """Megatron-LM turns gradient accumulation fusion on by default; with the local layers and no apex extension
    megatron-core fails deep inside the model build. Say so in one line, before anything is built.
    (``megatron_args``: Megatron's own namespace, whose fields differ between its versions.)"""
    fusion = getattr(megatron_args, "gradient_accumulation_fusion", False)
    if (fusion and getattr(megatron_args, "transformer_impl", None) == "local"
            and importlib.util.find_spec(FUSED_WGRAD_MODULE) is None):
        raise ArgumentError(f"--gradient-accumulation-fusion (Megatron's default) with --transformer-impl local needs "
                            f"NVIDIA apex's {FUSED_WGRAD_MODULE} extension, which is not importable: install apex with "
                            f"--cpp_ext --cuda_ext or pass --no-gradient-accumulation-fusion")


def _check_eval_interval(megatron_args) -> None:
    """megatron-core 0.19's loop sizes its validation set as ``train_iters // eval_interval`` with no default for
    ``--eval-interval`` (a TypeError deep in the data setup when it is missing): one line instead."""
    m = megatron_args
    if (getattr(m, "train_iters", None) is not None and hasattr(m, "eval_interval") and m.eval_interval is None
            and not getattr(m, "skip_train", False) and not getattr(m, "full_validation", False)):
        raise ArgumentError("--eval-interval is required by Megatron's own training loop with --train-iters (it sizes "
                            "the validation set by train_iters // eval_interval); give a positive number of "
                            "iterations, e.g. --eval-interval 1000")


def _megatron(module: str):
    return importlib.import_module(f"megatron.training{module}")


def _ensure_installed(args):
    """The installed h3t-ext schedules (installed now from ``args`` on the first call)."""
    from h3t_ext.runtime.pipeline.install import install, installed  # noqa: PLC0415

    runtime = installed()
    return runtime if runtime is not None else install(runtime_config(args))


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None,
                   config=None, pg_collection=None, **_unused):
    """Megatron's ``model_provider``: a GPTModel from h3t-ext's layer spec; installs the schedules."""
    from megatron.core import parallel_state as ps  # noqa: PLC0415

    from h3t_ext.runtime.modules.gpt import build_gpt_model  # noqa: PLC0415
    from h3t_training.config.feature_checks import uses_gpu  # noqa: PLC0415
    from h3t_training.loop.model_provider import layer_spec_backend  # noqa: PLC0415

    args = _megatron("").get_args()
    runtime = _ensure_installed(args)
    if config is None:
        config = _megatron(".arguments").core_transformer_config_from_args(args)
    return build_gpt_model(
        config, vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
        ckpt=runtime.config.ckpt, backend=layer_spec_backend(True),
        pipeline_rank=ps.get_pipeline_model_parallel_rank(), pg_collection=pg_collection,
        position_embedding_type=args.position_embedding_type,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling, rope_scaling_factor=args.rope_scaling_factor,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        device_type="cuda" if uses_gpu(args) else "cpu")


def forward_step(data_iterator, model):
    """Megatron's ``forward_step``: a batch from Megatron's loader, the loss as Megatron reports it."""
    from functools import partial  # noqa: PLC0415

    from h3t_training.data.datasets import batch_on_this_cp_rank  # noqa: PLC0415
    from h3t_training.loop.training import loss_func  # noqa: PLC0415

    batch = batch_on_this_cp_rank(batch_on_this_tp_rank(data_iterator))
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")
"""The GPT batch's tensors that tensor-parallel rank 0 moves to the GPU before megatron-core 0.19's broadcast."""


def _to_gpu(t):
    return t.cuda(non_blocking=True)


def batch_on_this_tp_rank(data_iterator, *, to_device=_to_gpu) -> dict:
    """The next batch on this tensor-parallel rank, as the installed Megatron-LM gets it: up to 0.18
    ``megatron.training.utils.get_batch_on_this_tp_rank(data_iterator)``; from 0.19 tensor-parallel rank 0 takes
    the batch from the iterator and moves its tensors with ``to_device`` (to the GPU, as Megatron-LM's training
    loop does), and ``megatron.core.utils.get_batch_on_this_tp_rank`` broadcasts them over the tensor-parallel
    group (with Megatron-LM's arguments: no packed sequences here)."""
    legacy = getattr(_megatron(".utils"), "get_batch_on_this_tp_rank", None)
    if legacy is not None:
        return legacy(data_iterator)
    import torch  # noqa: PLC0415
    from megatron.core import parallel_state as ps  # noqa: PLC0415
    from megatron.core import utils as core_utils  # noqa: PLC0415

    args = _megatron("").get_args()
    tp_rank = ps.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        batch = next(data_iterator)
        for key in BATCH_KEYS:
            value = batch.get(key)
            batch[key] = to_device(value) if isinstance(value, torch.Tensor) else None
    return core_utils.get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=False, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=ps.get_tensor_model_parallel_src_rank(),
        broadcast_group=ps.get_tensor_model_parallel_group(), cp_size=args.context_parallel_size, tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size, seq_length=args.seq_length, mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=ps.is_pipeline_first_stage(), is_pipeline_last_stage=ps.is_pipeline_last_stage())


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's dataset provider: GPT datasets (or mock ones) from Megatron's data flags."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig  # noqa: PLC0415

    from h3t_training.data.datasets import TrainingGPTDataset, TrainingMockGPTDataset  # noqa: PLC0415

    training = _megatron("")
    args = training.get_args()
    utils = _megatron(".utils")
    blend, blend_per_split = utils.get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, path_to_cache=args.data_cache_path, tokenizer=training.get_tokenizer(),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=args.create_attention_mask_in_dataloader)
    dataset_type = TrainingMockGPTDataset if args.mock_data else TrainingGPTDataset  # each sample's own mask
    return BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples, lambda: True, config).build()


datasets_provider.is_distributed = True  # Megatron builds the datasets on every rank (as its pretrain_gpt.py)


def run(argv: Optional[Sequence[str]] = None, defaults: Optional[dict] = None) -> int:
    """Train with Megatron's ``pretrain()``; ``argv`` replaces ``sys.argv[1:]`` (Megatron parses it)."""
    import sys  # noqa: PLC0415

    from megatron.core.enums import ModelType  # noqa: PLC0415

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    training = _megatron("")
    pretrain = training.pretrain
    defaults = dict(defaults or {})
    if "cfg_container" in inspect.signature(pretrain).parameters:  # megatron-core 0.19+
        arguments = _megatron(".arguments")
        args = arguments.parse_and_validate_args(extra_args_provider=add_h3t_arguments, args_defaults=defaults)
        runtime_config(args)  # a clash is one line now, before any model is built
        container = _megatron(".argument_utils").pretrain_cfg_container_from_args(args)
        pretrain(container, datasets_provider, ModelType.encoder_or_decoder, forward_step,
                 model_provider=model_provider)
    else:  # 0.17-0.18: pretrain parses the flags itself
        pretrain(datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
                 extra_args_provider=add_h3t_arguments, args_defaults=defaults)
    return 0


__all__ = ["add_h3t_arguments", "available", "datasets_provider", "forward_step", "model_provider", "run",
           "runtime_config"]
