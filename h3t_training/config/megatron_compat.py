"""Megatron-LM's (and Megatron-Kwai's) flag semantics mapped onto this driver's fields, before validation.

* Megatron-Kwai aliases: ``--kaimm-offload-activation-ratio A`` is ``--offload-alpha A``;
  ``--kaimm-recompute-norm`` with ``--kaimm-recompute-mlp-activation-func`` is ``--ckpt ours``.
* sample-based training: ``--train-samples`` / ``--lr-decay-samples`` / ``--lr-warmup-samples`` (or
  ``--lr-warmup-fraction`` of the decay span); the schedule runs in samples, as Megatron's
  ``OptimizerParamScheduler`` does (iteration-based flags are multiplied by the global batch size).
* the learning-rate and weight-decay schedule in samples (``lr_warmup_steps``, ``lr_decay_steps``,
  ``lr_wsd_decay_steps``, ``wd_incr_steps``), checked as Megatron-LM checks it;
* batch-size schedules: ``--step-batch-size-schedule`` / ``--rampup-batch-size`` as a
  :class:`~h3t_training.data.batch_schedule.BatchSchedule` (``batch_schedule``);
* ``--num-virtual-stages-per-pipeline-rank`` -> layers per virtual stage; ``--split`` checked here;
* ``--distributed-backend nccl`` without CUDA -> gloo, with a notice.
Each step reads the config and returns the fields it sets (a dict); every problem is an
:class:`~h3t_training.errors.ArgumentError` (one line).
"""
from __future__ import annotations

from typing import Optional

from h3t_training.config import feature_checks
from h3t_training.data.batch_schedule import BatchSchedule, parse_step_schedule, rampup_schedule
from h3t_training.data.data_checks import DataFileError, parse_split
from h3t_training import megatron_release
from h3t_training.errors import ArgumentError


def kwai_aliases(args) -> dict:
    """Megatron-Kwai's offload and recompute flags as the fields they stand for (ckpt, offload_alpha)."""
    changes = {}
    ratio = args.kaimm_offload_ratio
    if ratio is not None:
        if args.offload_alpha is not None and str(args.offload_alpha) != str(ratio):
            raise ArgumentError(f"--kaimm-offload-activation-ratio {ratio} contradicts --offload-alpha "
                                f"{args.offload_alpha}")
        changes["offload_alpha"] = str(ratio)
    norm, act = args.kaimm_recompute_norm, args.kaimm_recompute_mlp_activation_func
    if norm and act:
        if args.ckpt not in (None, "ours"):
            raise ArgumentError(f"--kaimm-recompute-norm --kaimm-recompute-mlp-activation-func (--ckpt ours) "
                                f"contradict --ckpt {args.ckpt}")
        changes["ckpt"] = "ours"
    elif norm or act:
        one = "--kaimm-recompute-norm" if norm else "--kaimm-recompute-mlp-activation-func"
        raise ArgumentError(f"{one} alone is not supported (recomputing only one of the two parts); give both "
                            "--kaimm-recompute-norm --kaimm-recompute-mlp-activation-func (= --ckpt ours)")
    return changes


def _distributed_backend(args) -> dict:
    """``--distributed-backend nccl`` (Megatron-LM's default, in nearly every recipe) on a machine without CUDA runs
    on gloo, with one notice: on CPU gloo gives the same result. On a GPU it stays nccl. The resolved backend is
    what :func:`~h3t_training.loop.initialize.initialize_distributed` is given."""
    if args.distributed_backend != "nccl" or feature_checks.cuda_available():
        return {}
    return {"distributed_backend": "gloo", "flag_notices": (
        *args.flag_notices, "note: --distributed-backend nccl: no CUDA device on this machine; the process groups "
                            "run on gloo (the same result on CPU)")}


def _positions(args) -> dict:
    if args.no_position_embedding and args.position_embedding_type != "rope":
        raise ArgumentError("--no-position-embedding without --use-rotary-position-embeddings (or "
                            "--position-embedding-type rope) is refused, as Megatron-LM refuses it; for a model "
                            "without positions give --position-embedding-type none")
    return {}


def _batch_schedule(args) -> dict:
    """--global-batch-size, --step-batch-size-schedule or --rampup-batch-size as one BatchSchedule; the global
    batch size of the config is the final one (the learning-rate flags in iterations count it)."""
    step, rampup = args.step_batch_size_schedule, args.rampup_batch_size
    if step is not None and rampup is not None:
        raise ArgumentError("give one of --step-batch-size-schedule and --rampup-batch-size")
    if step is not None:
        if args.decrease_batch_size_if_needed:
            raise ArgumentError("--decrease-batch-size-if-needed does not apply to --step-batch-size-schedule (as in "
                                "Megatron-LM); leave it out")
        schedule = parse_step_schedule(step, args.seq_length)
        if args.global_batch_size is not None and args.global_batch_size != schedule.final_batch_size:
            raise ArgumentError(f"--global-batch-size {args.global_batch_size} contradicts --step-batch-size-schedule, "
                                f"whose last batch size is {schedule.final_batch_size}; leave one out")
        return {"batch_schedule": schedule, "global_batch_size": schedule.final_batch_size}
    if args.global_batch_size is None:
        raise ArgumentError("--global-batch-size is required (or --step-batch-size-schedule)")
    if rampup is not None:
        return {"batch_schedule": rampup_schedule(*rampup, args.global_batch_size)}
    return {"batch_schedule": BatchSchedule.constant(args.global_batch_size)}


def _schedule(args) -> dict:
    B = args.global_batch_size
    if (args.train_iters is None) == (args.train_samples is None):
        raise ArgumentError("give exactly one of --train-iters and --train-samples")
    if args.train_samples is not None:
        if args.lr_decay_iters is not None or args.lr_warmup_iters:
            raise ArgumentError("--train-samples needs the sample-based --lr-decay-samples / --lr-warmup-samples "
                                "(not --lr-decay-iters / --lr-warmup-iters)")
        first = args.batch_schedule.batch_size(0)
        if args.train_samples < first:
            raise ArgumentError(f"--train-samples {args.train_samples} is less than one global batch ({first} samples)")
        train_iters = args.train_samples // B if args.batch_schedule.is_constant \
            else args.batch_schedule.iterations_for_samples(args.train_samples)  # as Megatron-LM counts each
        decay = args.lr_decay_samples if args.lr_decay_samples is not None else args.train_samples
        warm = args.lr_warmup_samples
    else:
        if args.lr_decay_samples is not None or args.lr_warmup_samples:
            raise ArgumentError("--lr-decay-samples / --lr-warmup-samples need --train-samples (not --train-iters)")
        train_iters = args.train_iters
        decay = (args.lr_decay_iters if args.lr_decay_iters is not None else train_iters) * B
        warm = args.lr_warmup_iters * B
    if args.lr_warmup_fraction is not None:
        if warm:
            raise ArgumentError("give one of --lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples")
        if not 0 <= args.lr_warmup_fraction <= 1:
            raise ArgumentError(f"--lr-warmup-fraction {args.lr_warmup_fraction} is outside [0, 1]")
        warm = args.lr_warmup_fraction * decay  # a float, as Megatron-LM hands it to megatron-core's scheduler
    if warm >= decay:  # megatron-core's scheduler asserts it
        raise ArgumentError(f"the learning-rate warm-up ({warm:g} samples) must be shorter than the decay span ({decay} "
                            f"samples: --lr-decay-iters x --global-batch-size, or --lr-decay-samples)")
    lr_decay_iters = -(-decay // B) if args.lr_decay_iters is None else args.lr_decay_iters
    wd_incr = args.train_samples if args.train_samples is not None else train_iters * B
    return dict(train_iters=train_iters, lr_decay_iters=lr_decay_iters, lr_warmup_steps=warm, lr_decay_steps=decay,
                lr_wsd_decay_steps=_wsd_steps(args, B), wd_incr_steps=wd_incr)  # steps in samples, as Megatron's


def _wsd_steps(args, B: int) -> Optional[int]:
    """The WSD annealing in samples (Megatron-LM: --lr-wsd-decay-iters x the global batch, or
    --lr-wsd-decay-samples); None without --lr-decay-style WSD."""
    for name in ("lr_wsd_decay_iters", "lr_wsd_decay_samples"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} {v} is outside [1, inf)")
    # as --lr-decay-samples / --lr-decay-iters: the span of the run's kind
    if args.train_samples is not None and args.lr_wsd_decay_iters is not None:
        raise ArgumentError("--lr-wsd-decay-iters needs --train-iters")
    if args.train_samples is None and args.lr_wsd_decay_samples is not None:
        raise ArgumentError("--lr-wsd-decay-samples needs --train-samples")
    if args.lr_decay_style != "WSD":
        return None
    if args.train_samples is not None:
        if args.lr_wsd_decay_samples is None:
            raise ArgumentError("--lr-decay-style WSD with --train-samples needs --lr-wsd-decay-samples (the samples "
                                "of its annealing)")
        return args.lr_wsd_decay_samples
    if args.lr_wsd_decay_iters is None:
        raise ArgumentError("--lr-decay-style WSD with --train-iters needs --lr-wsd-decay-iters (the iterations of "
                            "its annealing)")
    return args.lr_wsd_decay_iters * B


def _weight_decay(args) -> dict:
    """Megatron-LM's rule: a constant --weight-decay-incr-style takes neither --start- nor --end-weight-decay and
    runs from --weight-decay to --weight-decay (the fields it sets, as Megatron-LM's ``validate_args`` does); the
    others take both, with 0 <= start <= end (megatron-core's scheduler asserts it)."""
    start, end = args.start_weight_decay, args.end_weight_decay
    if args.weight_decay_incr_style == "constant":
        for name, v in (("--start-weight-decay", start), ("--end-weight-decay", end)):
            if v is not None:
                raise ArgumentError(f"{name} needs --weight-decay-incr-style linear or cosine (constant uses "
                                    f"--weight-decay)")
        return {"start_weight_decay": args.weight_decay, "end_weight_decay": args.weight_decay}
    if start is None or end is None:
        raise ArgumentError(f"--weight-decay-incr-style {args.weight_decay_incr_style} needs --start-weight-decay "
                            f"and --end-weight-decay")
    if not 0 <= start <= end:
        raise ArgumentError(f"--start-weight-decay {start} is outside [0, --end-weight-decay {end}]")
    return {}


def _virtual_stages(args) -> dict:
    """--num-virtual-stages-per-pipeline-rank V as Megatron-LM reads it: with an even split (the --account-for-*
    slots counted) it is --num-layers-per-virtual-pipeline-stage (L + slots) / (p V); with uneven first/last
    stages (which refuse that flag) V stays as given and the layout checks it."""
    v = args.num_virtual_stages_per_pipeline_rank
    if v is None:
        return {}
    p = args.pipeline_model_parallel_size or 1
    if args.num_layers_per_virtual_pipeline_stage is not None:
        raise ArgumentError("give one of --num-virtual-stages-per-pipeline-rank and "
                            "--num-layers-per-virtual-pipeline-stage")
    if args.decoder_first_pipeline_num_layers is not None or args.decoder_last_pipeline_num_layers is not None \
            or args.pipeline_model_parallel_layout is not None:  # the split's own refusal names the flags
        return {}
    n = args.num_layers + args.account_for_embedding_in_pipeline_split + args.account_for_loss_in_pipeline_split
    if v < 1 or n % (p * v):
        slots = f" + {n - args.num_layers} --account-for-* slot(s)" if n != args.num_layers else ""
        raise ArgumentError(f"--num-virtual-stages-per-pipeline-rank {v} does not divide the layers per pipeline rank "
                            f"(--num-layers {args.num_layers}{slots} over --pipeline-model-parallel-size {p}); valid: "
                            f"V with {n} a multiple of {p} x V")
    return {"num_layers_per_virtual_pipeline_stage": n // (p * v), "num_virtual_stages_per_pipeline_rank": None}


def _data_args_files(args) -> dict:
    """Megatron-LM's blend files as the blend flags they stand for (:mod:`h3t_training.data.data_args_files`):
    ``--data-args-path`` fills ``data_path``, ``--per-split-data-args-path`` the three per-split paths. A file
    beside another data source is one line (Megatron-LM asserts ``--data-path`` and ``--data-args-path`` exclusive,
    and a per-split file beside per-split flags; a per-split source beside ``--data-path`` it would drop silently),
    as is ``--data-args-path`` without ``--split``: Megatron-LM applies its legacy split to ``--data-path`` alone and
    its dataset config then asserts "split must be provided"."""
    from h3t_training.data.data_args_files import DataArgsFileError, read_data_args, read_per_split_data_args

    if args.data_args_path is None and args.per_split_data_args_path is None:
        return {}
    sources = [f for f in ("data_path", "train_data_path", "valid_data_path", "test_data_path", "data_args_path",
                           "per_split_data_args_path") if getattr(args, f) is not None]
    sources += ["mock_data"] if args.mock_data else []
    if len(sources) > 1:
        names = " and ".join("--" + f.replace("_", "-") for f in sources)
        raise ArgumentError(f"{names} each give the training data; give one of --data-path, --data-args-path, "
                            "--train/valid/test-data-path, --per-split-data-args-path and --mock-data")
    try:
        if args.data_args_path is not None:
            if args.split is None:
                raise ArgumentError(f"--data-args-path {args.data_args_path} needs --split (e.g. 969,30,1): "
                                    "Megatron-LM's legacy default applies to --data-path alone")
            return {"data_path": read_data_args(args.data_args_path)}
        lists = read_per_split_data_args(args.per_split_data_args_path)
    except DataArgsFileError as e:
        raise ArgumentError(str(e)) from None
    if lists["train"] is None and not args.skip_train:
        raise ArgumentError(f"--per-split-data-args-path {args.per_split_data_args_path}: 'train' is null; training "
                            "needs data (or give --skip-train)")
    if all(v is None for v in lists.values()):  # Megatron-LM would fall back to mock data here
        raise ArgumentError(f"--per-split-data-args-path {args.per_split_data_args_path} names no data for any split")
    return {f"{k}_data_path": v for k, v in lists.items()}


MEGATRON_LEGACY_SPLIT = "969,30,1"
"""Megatron-LM's ``--split`` when ``--data-path`` is given without one (megatron/training/arguments.py,
``validate_args``: "Please specify --split when using --data-path. Using legacy default value")."""
MOCK_SPLIT = "1,1,1"
"""megatron-core's split of mock data given none (``BlendedMegatronDatasetConfig.__post_init__``: "an arbitrarily
even split, as mock is True"), so Megatron's mock data has validation and test splits."""


def _split(args) -> dict:
    """``--split`` as Megatron resolves it: left out, the legacy 969,30,1 with ``--data-path`` (with Megatron's
    notice) and megatron-core's even 1,1,1 with ``--mock-data`` (with per-split paths it stays unset: they need
    none). Megatron's scripts quote ``--split`` inside a shell string ('99,1,0'): the quotes are dropped; the
    shares are checked by :func:`~h3t_training.data.data_checks.parse_split` (training data unless
    ``--skip-train``)."""
    notices = ()
    if args.split is not None and any(getattr(args, f"{k}_data_path") is not None for k in ("train", "valid", "test")):
        source = "--per-split-data-args-path" if args.per_split_data_args_path else "--train/valid/test-data-path"
        raise ArgumentError(f"--split {args.split} does not apply with {source}: each split has its own blend "
                            "(Megatron-LM asserts 'split and blend_per_split are incompatible'); leave --split out")
    if args.split is None:
        if args.data_path is not None:
            notices = (f"note: --split not given with --data-path: Megatron-LM's legacy default {MEGATRON_LEGACY_SPLIT} "
                       "(train,valid,test), as Megatron-LM uses it",)
            text = MEGATRON_LEGACY_SPLIT
        elif args.mock_data:
            text = MOCK_SPLIT
        else:
            return {}
    else:
        text = args.split.strip().strip("'\"")
    try:
        parse_split(text, allow_no_train=args.data_path is None or args.skip_train)
    except DataFileError as e:
        raise ArgumentError(str(e)) from None
    return {"split": text, "flag_notices": args.flag_notices + notices}


TOKENIZER_TYPE_FLAGS = {"null_tokenizer_eod_id": "NullTokenizer", "null_tokenizer_pad_id": "NullTokenizer",
                         "tokenizer_hf_no_include_special_tokens": "HuggingFaceTokenizer",
                         "tokenizer_hf_include_special_tokens": "HuggingFaceTokenizer",
                         "tiktoken_pattern": "TikTokenizer", "tiktoken_num_special_tokens": "TikTokenizer"}
"""The driver's flags that one ``--tokenizer-type`` alone reads (destination -> that type)."""


def _tokenizer_files(args) -> dict:
    """Tokenizer files given to this driver's own ByteTokenizer (pretrain_llama.py's default; not a Megatron
    tokenizer) would be ignored: an error instead (Megatron's tokenizers ignore what they do not read, as there).
    A flag of another tokenizer type (:data:`TOKENIZER_TYPE_FLAGS`): a notice, as Megatron-LM ignores it."""
    if args.tokenizer_type == "ByteTokenizer":
        for name in ("vocab_file", "merge_file", "tokenizer_model", "vocab_size"):
            if getattr(args, name) is not None:
                raise ArgumentError(f"--{name.replace('_', '-')} is not read by --tokenizer-type ByteTokenizer; give "
                                    "the --tokenizer-type that uses it (e.g. GPT2BPETokenizer, HuggingFaceTokenizer, "
                                    "NullTokenizer)")
    notices = tuple(f"note: --{name.replace('_', '-')}: read only by --tokenizer-type {kind}; Megatron-LM ignores it "
                    f"under {args.tokenizer_type} too: same result" for name, kind in TOKENIZER_TYPE_FLAGS.items()
                    if getattr(args, name) not in (None, False) and args.tokenizer_type != kind)
    return {"flag_notices": (*args.flag_notices, *notices)} if notices else {}


def _sharding_strategy(args) -> dict:
    """--data-parallel-sharding-strategy left out: the installed megatron-core's Megatron-LM default under
    --use-megatron-fsdp (optim_grads_params from 0.18, no_shard before: :mod:`h3t_training.megatron_release`), so
    that a GPU run shards what Megatron-LM would; without Megatron FSDP nothing is sharded (no_shard)."""
    if args.data_parallel_sharding_strategy is not None:
        return {}
    strategy = megatron_release.default_sharding_strategy(megatron_release.installed_megatron_core()) \
        if args.use_megatron_fsdp else "no_shard"
    return {"data_parallel_sharding_strategy": strategy}


def apply_megatron_behaviours(config):
    """A new config with Megatron's flags mapped onto this driver's fields; ArgumentError on a contradiction."""
    for step in (kwai_aliases, _distributed_backend, _positions, _batch_schedule, _weight_decay, _schedule,
                 _virtual_stages,
                 _data_args_files, _split, _tokenizer_files, _sharding_strategy):
        config = config.replace(**step(config))
    return config
