"""Checks of the parsed flags that need no process group (world size comes from WORLD_SIZE).

Each ``_validate_*`` step takes the config and returns it, or a new one with what it derived
(``data_parallel_size``, ``virtual_pipeline_model_parallel_size``, ``num_microbatches``, the
parsed ``offload_alpha``); a problem is an :class:`ArgumentError` with one line naming the flag,
its value and the valid range.
"""
from __future__ import annotations

import errno
import os

from h3t_ext.layout import LayoutError, ParallelLayout
from h3t_ext.offload_alpha import OffloadAlpha
from h3t_ext.planner.translate import MEGATRON_FSDP_CKPT_FORMAT
from h3t_ext.runtime.config import H3TConfig, RuntimeConfigError
from h3t_ext.runtime.pipeline.prepare import validate_parallel_layout
from h3t_training.config.arguments import split_flags
from h3t_training.config.auto_plan import resolve_alpha
from h3t_training.data.batch_schedule import BatchSchedule, schedule_of
from h3t_training.data.data_checks import DataFileError, check_indexed_dataset, parse_blend, parse_split
from h3t_training.errors import ArgumentError
from h3t_training.config import feature_checks
from h3t_training.config.feature_checks import check_writer_packages
from h3t_training.config.flag_table import table_int, table_value
from h3t_training.config.megatron_fields import spec_backend
from h3t_training.data.tokenizer import TokenizerError, tokenizer_from_args


def validate_args(config):
    """Validate and derive; the order matters (later checks use derived sizes)."""
    for step in (_validate_rope, _validate_layout, _validate_sequence_parallel,
                 check_overlap, _validate_precision, _validate_context_parallel, _validate_alpha,
                 _validate_offload_overlap, _validate_data, _validate_io, _validate_eval_and_logging):
        config = step(config)
    return config


def check_model_shape(args):
    """A resolve step as soon as the model's sizes are filled (``arguments.fill_model_defaults``), ahead of every step
    that prices the model (the offload mapping, ``--auto-plan``): heads that divide the hidden size, query groups
    that divide the heads, the sequence within the positions."""
    if args.hidden_size % args.num_attention_heads:
        raise ArgumentError(f"--hidden-size {args.hidden_size} is not a multiple of --num-attention-heads "
                            f"{args.num_attention_heads}")
    if args.num_attention_heads % args.num_query_groups:
        raise ArgumentError(f"--num-query-groups {args.num_query_groups} does not divide --num-attention-heads "
                            f"{args.num_attention_heads}")
    if args.seq_length > args.max_position_embeddings:
        raise ArgumentError(f"--seq-length {args.seq_length} is outside [1, --max-position-embeddings "
                            f"{args.max_position_embeddings}]")
    return args


ROPE_SCALING_FACTOR = 8.0
"""Megatron-LM's default ``--rope-scaling-factor`` (Llama 3.1's)."""


def _validate_rope(args):
    """RoPE's scaling flags act only on rotary positions; --rope-scaling-factor only with --use-rope-scaling (Megatron-LM
    ignores it without; here it is refused in one line rather than ignored)."""
    given = [f for f, on in (("--use-rope-scaling", args.use_rope_scaling),
                             ("--rotary-seq-len-interpolation-factor",
                              args.rotary_seq_len_interpolation_factor is not None)) if on]
    if given and args.position_embedding_type != "rope":
        raise ArgumentError(f"{given[0]} scales rotary positions; this run has --position-embedding-type "
                            f"{args.position_embedding_type}: add --position-embedding-type rope or drop it")
    factor = args.rope_scaling_factor
    if factor is not None and not args.use_rope_scaling:
        raise ArgumentError(f"--rope-scaling-factor {factor} needs --use-rope-scaling (Llama 3.x's RoPE scaling); "
                            f"add it or drop the factor")
    if factor is not None and not factor > 0:
        raise ArgumentError(f"--rope-scaling-factor {factor} is outside (0, inf)")
    return args.replace(rope_scaling_factor=ROPE_SCALING_FACTOR if factor is None else factor)


def _validate_layout(args):
    """The parallel layout (:class:`~h3t_ext.layout.ParallelLayout`, the library's one set of layout rules)
    for every global batch size the run will use; the config gets the final one's sizes
    (``data_parallel_size``, ``virtual_pipeline_model_parallel_size``, ``num_microbatches``, ``parallel_layout``)."""
    if args.decrease_batch_size_if_needed and schedule_of(args).is_constant:
        args = _decrease_batch_size(args)
    layout = check_layout_for(args)
    try:
        layout.check_tensor_split(num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                                  ffn_hidden_size=args.ffn_hidden_size)
    except LayoutError as e:
        raise ArgumentError(e.reason) from None
    notices = args.flag_notices
    if args.microbatch_group_size_per_vp_stage is not None and not layout.interleaved:
        notices = (*notices, "note: --microbatch-group-size-per-virtual-pipeline-stage: no effect without interleaving "
                             "(Megatron's 1F1B schedule has one model chunk per rank, nothing to group): same result")
    return args.replace(data_parallel_size=layout.data_parallel_size, num_microbatches=layout.num_microbatches,
                        virtual_pipeline_model_parallel_size=layout.virtual_pipeline_model_parallel_size
                        if layout.interleaved else None, parallel_layout=layout, flag_notices=notices)


def check_layout_for(args) -> ParallelLayout:
    """The layout of every global batch size ``args``' batch schedule runs up to ``--train-iters`` (and of
    ``--global-batch-size``); the last one. :class:`~h3t_training.errors.ArgumentError` names the rule a batch
    size breaks (and the schedule flag that makes it)."""
    schedule = schedule_of(args)
    source = None if schedule.is_constant else (
        "--step-batch-size-schedule" if args.step_batch_size_schedule is not None else "--rampup-batch-size")
    layout = None
    for batch in schedule.batch_sizes(args.train_iters) + (args.global_batch_size,):
        try:
            layout = _layout(args, batch)
        except LayoutError as e:
            raise ArgumentError(e.reason if source is None else f"{source}: " + e.reason.replace(
                f"--global-batch-size {batch}", f"its batch size {batch}")) from None
    return layout


def _layout(args, global_batch_size: int) -> ParallelLayout:
    return ParallelLayout.from_sizes(
        world_size=args.world_size, global_batch_size=global_batch_size, micro_batch_size=args.micro_batch_size,
        tensor_model_parallel_size=args.tensor_model_parallel_size, context_parallel_size=args.context_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size, num_layers=args.num_layers,
        num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage,
        microbatch_group_size_per_vp_stage=args.microbatch_group_size_per_vp_stage, **split_flags(args))


def _decrease_batch_size(args):
    """--decrease-batch-size-if-needed: a constant batch size rounded down to micro batch x data-parallel size."""
    ranks = args.tensor_model_parallel_size * args.context_parallel_size * args.pipeline_model_parallel_size
    if args.world_size % ranks:
        return args  # the layout's world-size rule says why, in one line
    shard = args.micro_batch_size * (args.world_size // ranks)
    if args.global_batch_size % shard == 0:
        return args
    running = args.global_batch_size // shard * shard
    if running == 0:
        raise ArgumentError(f"--decrease-batch-size-if-needed: --global-batch-size {args.global_batch_size} is "
                            f"below one micro batch x data-parallel size ({shard})")
    return args.replace(global_batch_size=running, batch_schedule=BatchSchedule.constant(running),
                        samples_left_out_per_iteration=args.global_batch_size - running, flag_notices=(
        *args.flag_notices, f"note: --decrease-batch-size-if-needed: --global-batch-size {args.global_batch_size} "
                            f"runs as {running} (a multiple of --micro-batch-size x data-parallel size {shard})"))


def _validate_sequence_parallel(args):
    t = args.tensor_model_parallel_size
    if args.sequence_parallel and t == 1:  # as Megatron-LM: disabled, with a notice
        args = args.replace(sequence_parallel=False, flag_notices=(
            *args.flag_notices,
            "note: --sequence-parallel: disabled with --tensor-model-parallel-size 1 (as Megatron-LM does)"))
    try:  # with c > 1 the sequence is 2c chunks; --sequence-parallel splits each rank's shard over t
        args.parallel_layout.check_seq_length(args.seq_length, sequence_parallel=args.sequence_parallel)
    except LayoutError as e:
        raise ArgumentError(e.reason) from None
    return args


def _validate_precision(args):
    if args.fp16 and args.bf16:
        raise ArgumentError("--fp16 and --bf16 are exclusive; give one")
    if args.h3t_float64 and (args.fp16 or args.bf16):
        raise ArgumentError(f"--h3t-float64 and {'--fp16' if args.fp16 else '--bf16'} are exclusive; give one")
    for flag, v in (("--initial-loss-scale", args.initial_loss_scale), ("--min-loss-scale", args.min_loss_scale),
                    ("--loss-scale-window", args.loss_scale_window)):
        if not v > 0:
            raise ArgumentError(f"{flag} {v} is outside (0, inf)")
    if args.loss_scale is not None and not args.loss_scale > 0:
        raise ArgumentError(f"--loss-scale {args.loss_scale} is outside (0, inf)")
    if args.hysteresis < 1:
        raise ArgumentError(f"--hysteresis {args.hysteresis} is outside [1, inf)")
    if args.fp16 and args.loss_scale is None and args.check_for_nan_in_loss_and_grad:
        # as Megatron-LM's validate_args: a dynamic loss scale reads NaN gradients as overflow and skips the step
        args = args.replace(check_for_nan_in_loss_and_grad=False, flag_notices=(
            *args.flag_notices, "note: --check-for-nan-in-loss-and-grad: off with --fp16's dynamic loss scale, whose "
                                "overflowed steps are skipped (as Megatron-LM does)"))
    return args


def check_overlap(args):
    """Megatron-LM's rules for ``--overlap-param-gather`` (a resolve step ahead of the steps that price the run, which
    price the overlaps they are given, and again in :func:`validate_args`): the distributed optimizer's part waits
    for ``--auto-plan``, which switches that optimizer on itself."""
    undecided = args.auto_plan and args.auto_plan_flags is None
    if args.overlap_param_gather and not args.use_distributed_optimizer and not undecided:
        raise ArgumentError("--overlap-param-gather needs --use-distributed-optimizer (it overlaps that "
                            "optimizer's parameter all-gather)")
    if args.overlap_param_gather and not args.overlap_grad_reduce:
        raise ArgumentError("--overlap-param-gather needs --overlap-grad-reduce (its all-gathers are issued by the "
                            "gradient buckets; Megatron-LM asserts it)")
    return args


def _validate_context_parallel(args):
    """c > 1 runs TransformerEngine's attention on a GPU and h3t-ext's ring attention
    (``h3t_ext.runtime.modules.ring_attention``) elsewhere; both need Megatron's 2c sequence chunks. On a GPU whose
    layer spec is the local one (no TransformerEngine, or ``--transformer-impl local``) megatron-core's attention
    asserts c = 1 when the model is built: one line here instead."""
    c = args.context_parallel_size
    if c > 1 and args.attention_dropout and not feature_checks.cuda_available():
        raise ArgumentError(f"--attention-dropout {args.attention_dropout} is not supported with "
                            f"--context-parallel-size {c} on CPU (ring attention); use 0")
    if c > 1 and feature_checks.uses_gpu(args) and spec_backend(args, on_gpu=True) == "local":
        if table_value(args, "--transformer-impl") == "local":
            why, fix = "the run gives --transformer-impl local", "leave --transformer-impl local out"
        else:
            why, fix = feature_checks.transformer_engine_reason(), "install TransformerEngine"
        raise ArgumentError(f"--context-parallel-size {c} on a GPU runs in TransformerEngine's attention "
                            f"(megatron-core's local attention takes context parallel size 1 only), and {why}: "
                            f"{fix}, or train with --context-parallel-size 1")
    return args


def _validate_alpha(args):
    """``--offload-alpha`` parsed once (:class:`~h3t_ext.offload_alpha.OffloadAlpha`), ``auto``/``balanced``
    resolved by the cost model; the config keeps the numbers that run (one float, or one per stage)."""
    try:
        alpha = OffloadAlpha.parse(args.offload_alpha)
        if alpha.is_mode:
            args = resolve_alpha(args.replace(offload_alpha=alpha))
            alpha = args.offload_alpha
        return args.replace(offload_alpha=alpha.for_pipeline(args.pipeline_model_parallel_size))
    except ValueError as e:
        raise ArgumentError(str(e)) from None


def _validate_data(args):
    per_split = [f for f in ("train", "valid", "test") if getattr(args, f"{f}_data_path") is not None]
    if (args.mock_data + (args.data_path is not None) + bool(per_split)) != 1:
        raise ArgumentError("give exactly one of --data-path PREFIX and --mock-data (or --train-data-path, "
                            "--valid-data-path, --test-data-path)")
    if per_split and "train" not in per_split and not args.skip_train:
        raise ArgumentError("--valid-data-path/--test-data-path need --train-data-path (or --skip-train)")
    try:  # the data files (the tokenizer's were read by resolve_tokenizer): a damaged or mismatched one is one
        # line here, not a traceback per rank
        if args.data_path is not None and not args.skip_train:  # evaluation alone may have no training share
            parse_split(args.split)
    except DataFileError as e:
        raise ArgumentError(str(e)) from None
    for field in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        if getattr(args, field) is None:
            continue
        flag = _blend_source(args, field)
        try:
            prefixes, _ = parse_blend(getattr(args, field), flag)
            for prefix in prefixes:
                check_indexed_dataset(prefix, vocab_size=args.tokenizer_vocab_size)
        except DataFileError as e:  # the checks name --data-path; say which flag or file gave the prefix
            raise ArgumentError(str(e).replace("--data-path", flag, 1)) from None
    return args


def _blend_source(args, field: str) -> str:
    """The flag (or blend file) a blend field came from, as the user gave it: ``--train-data-path``, or
    ``--per-split-data-args-path FILE ('train')`` when Megatron's blend file filled the field."""
    if field == "data_path" and args.data_args_path is not None:
        return f"--data-args-path {args.data_args_path}"
    if field != "data_path" and args.per_split_data_args_path is not None:
        return f"--per-split-data-args-path {args.per_split_data_args_path} ({field.split('_')[0]!r})"
    return "--" + field.replace("_", "-")


def resolve_tokenizer(args):
    """The tokenizer's files are read once, here, so a bad one stops every rank before any process group; its
    vocabulary size is kept (``tokenizer_vocab_size``) for everything that pads the vocabulary or prices the
    model (:func:`h3t_training.data.tokenizer.run_padded_vocab_size`)."""
    try:
        tokenizer = tokenizer_from_args(args)
    except TokenizerError as e:
        raise ArgumentError(str(e)) from None
    return args.replace(tokenizer_vocab_size=tokenizer.vocab_size)


def _eval_batches(args):
    """--eval-global-batch-size and --eval-micro-batch-size, defaulting to the training's final batch and microbatch (as
    Megatron-LM's validate_args); the global one a multiple of the micro one times the data-parallel size."""
    gbs = args.global_batch_size if args.eval_global_batch_size is None else args.eval_global_batch_size
    mbs = args.micro_batch_size if args.eval_micro_batch_size is None else args.eval_micro_batch_size
    if gbs % (mbs * args.data_parallel_size):
        raise ArgumentError(f"--eval-global-batch-size {gbs} is not a multiple of --eval-micro-batch-size {mbs} x "
                            f"data-parallel size {args.data_parallel_size}")
    return args.replace(eval_global_batch_size=gbs, eval_micro_batch_size=mbs)


def _validate_sampling(args):
    """--dataloader-type: single and cyclic are sampled as Megatron-LM samples them; external (the user's own
    loader, which Megatron-LM takes from a custom dataset provider) and cyclic without data sharding are not."""
    if args.dataloader_type == "external":
        raise ArgumentError("--dataloader-type external hands Megatron-LM a loader from the user's own dataset provider, "
                            "which this driver does not take; use single or cyclic with --data-path")
    if args.dataloader_type == "cyclic" and not args.data_sharding:
        raise ArgumentError("--no-data-sharding with --dataloader-type cyclic (one permutation over all ranks) is not "
                            "implemented; leave it out (each rank samples its own bucket, Megatron-LM's default)")
    return args


def _validate_eval_and_logging(args):
    args = _validate_sampling(_eval_batches(args))
    try:  # the one --split parser (also run earlier with the Megatron-compat step); unset with per-split paths
        shares = None if args.split is None else parse_split(str(args.split), allow_no_train=True)
    except DataFileError as e:
        raise ArgumentError(str(e)) from None
    if shares is not None and sum(shares) <= 0:
        raise ArgumentError(f"--split {args.split} has no positive share (train,valid,test)")
    if args.skip_train and args.eval_iters == 0:
        raise ArgumentError("--skip-train with --eval-iters 0 has nothing to do; give --eval-iters >= 1")
    from h3t_training.data.datasets import splits_wanted
    if args.skip_train and not any(splits_wanted(args)):
        raise ArgumentError(f"--skip-train with --split {args.split} has no validation or test data; give --split "
                            f"with nonzero valid/test parts (e.g. 98,1,1) or --valid-data-path/--test-data-path")
    memory_interval = table_int(args, "--log-memory-interval", 0, 1)  # Megatron-LM divides the iteration by it
    if memory_interval and memory_interval % args.log_interval:
        raise ArgumentError(f"--log-memory-interval {memory_interval} is not a multiple of --log-interval "
                            f"{args.log_interval} (Megatron-LM asserts it)")
    check_writer_packages(args)
    return args


def _check_save_intervals(args) -> None:
    """Megatron-LM's validate_args rules on the intervals of a run that saves (core_v0.16.1 to core_v0.19.0): the
    retained checkpoints' interval a positive multiple of --save-interval, and (core_v0.18.0 on) no
    --save-params-interval with --overlap-param-gather. (Megatron-LM also asserts --save-interval with --save; this
    driver saves at the end of training without it, as Megatron-LM's last save does.)"""
    retain = table_int(args, "--save-retain-interval", 0, 1)
    if retain:
        if args.save_interval is None:
            raise ArgumentError(f"--save-retain-interval {retain} needs --save-interval (the checkpoints it keeps "
                                "are a multiple of it; Megatron-LM asserts it)")
        if retain % args.save_interval:
            raise ArgumentError(f"--save-retain-interval {retain} is not a multiple of --save-interval "
                                f"{args.save_interval} (Megatron-LM asserts it)")
    if table_value(args, "--save-params-interval") is not None and args.overlap_param_gather:
        raise ArgumentError("--save-params-interval with --overlap-param-gather and --save: Megatron-LM asserts "
                            "they are not given together; leave one out")


CKPT_FORMATS = ("torch_dist", "torch")
"""torch_dist (megatron-core dist_checkpointing, resharding on load) and Megatron-LM's legacy per-rank files
(h3t_training.loop.legacy_checkpoint). --load reads either, whatever --ckpt-format says."""
CKPT_FORMATS_REFUSED = {
    "torch_dcp": "use --ckpt-format torch_dist (megatron-core dist_checkpointing over PyTorch DCP)",
    "zarr": "zarr is deprecated in megatron-core; use --ckpt-format torch_dist",
}


def _validate_io(args):
    if args.ckpt_format == MEGATRON_FSDP_CKPT_FORMAT:
        if not args.use_megatron_fsdp:  # with it: check_megatron_fsdp's (no --save/--load: nothing written or read)
            raise ArgumentError(f"--ckpt-format {args.ckpt_format} is Megatron FSDP's checkpoint format and needs "
                                "--use-megatron-fsdp (Megatron-LM refuses it without); use --ckpt-format torch_dist")
    elif args.ckpt_format not in CKPT_FORMATS:
        reason = CKPT_FORMATS_REFUSED.get(args.ckpt_format, "the valid values are " + ", ".join(CKPT_FORMATS))
        raise ArgumentError(f"--ckpt-format {args.ckpt_format}: {reason}")
    if args.ckpt_format == "torch" and args.use_torch_fsdp2 and args.save is not None:
        raise ArgumentError("--ckpt-format torch with --use-torch-fsdp2: Megatron's legacy per-rank files hold whole "
                            "tensor-parallel shards, FSDP2's are cut over data-parallel ranks; use --ckpt-format "
                            "torch_dist")
    if args.ckpt_step is not None and args.ckpt_step < 0:
        raise ArgumentError(f"--ckpt-step {args.ckpt_step} is outside [0, inf)")
    if args.ckpt_step is not None and args.load is None and args.pretrained_checkpoint is None:
        raise ArgumentError("--ckpt-step needs --load DIR (or --pretrained-checkpoint DIR)")
    for flag, path in (("--load", args.load), ("--pretrained-checkpoint", args.pretrained_checkpoint)):
        if path is not None and os.path.exists(path) and not os.path.isdir(path):
            raise ArgumentError(f"{flag} {path} is a file, not a directory")
    if args.save is not None:
        _check_writable_dir("--save", args.save)
        _check_save_intervals(args)
    for flag in ("tensorboard_dir", "wandb_save_dir"):
        if getattr(args, flag):
            _check_writable_dir("--" + flag.replace("_", "-"), getattr(args, flag))
    if args.metrics_json is not None:  # written once, at the end: every way it could fail is found now
        if os.path.isdir(args.metrics_json):
            raise ArgumentError(f"--metrics-json {args.metrics_json} is a directory; give the path of a file")
        parent = os.path.dirname(os.path.abspath(args.metrics_json))
        if not os.path.isdir(parent):
            raise ArgumentError(f"--metrics-json {args.metrics_json}: directory {parent} does not exist")
        _check_writable_dir("--metrics-json", parent)
    return args


def _check_writable_dir(flag: str, path: str) -> None:
    """Write a probe file into ``path``, or where it does not exist yet into its nearest existing ancestor (where
    the run will create it: the checkpoint save, the loggers and the run lock make their directories), so an
    unwritable directory is found now, in one line, and not at the first save after hours of training. Nothing is
    created: a parse that fails at a later flag leaves no directory behind."""
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), existing)
        probe = os.path.join(existing, f".h3t_write_probe_{os.getpid()}")
        with open(probe, "wb") as f:
            f.write(b"x")
        os.remove(probe)
    except OSError as e:
        raise ArgumentError(f"{flag} {path} is not writable ({e.strerror or type(e).__name__})") from None


def _validate_offload_overlap(args):
    """The runtime's own check of the offload on every pipeline rank's schedule, for each microbatch count
    the run will use, before any process starts."""
    try:
        config = H3TConfig(ckpt=args.ckpt, offload_alpha=args.offload_alpha)
        for batch in schedule_of(args).batch_sizes(args.train_iters):
            validate_parallel_layout(config, _layout(args, batch), num_layers_per_chunk=(
                args.num_layers if args.pipeline_model_parallel_size == 1 else None))  # p=1: layer-granular
    except RuntimeConfigError as e:
        raise ArgumentError(str(e)) from None
    return args
