"""The run's configuration: parsed once, resolved by pure steps, then frozen.

:func:`parse_args` turns the command line into a :class:`TrainConfig` through a fixed sequence of
steps, each a function ``TrainConfig -> TrainConfig`` that returns a new config (nothing is changed
in place): Megatron-LM's flag semantics, derived model sizes, ``--auto-plan`` (a new config with the
planner's layout), parallel defaults, and validation with the derived sizes (data-parallel size,
microbatches, virtual stages). A bad flag ends the program with one Megatron-style line
(``pretrain_llama.py: error: ...``, exit status 2) before any process group exists.

Later changes are new configs too: a checkpoint's schedule under
``--use-checkpoint-opt_param-scheduler`` is ``config.replace(...)``.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

from h3t_training.config import arguments, checkpoint_args

from h3t_training.config import auto_plan


from h3t_training.config import megatron_compat
from h3t_training.config import megatron_offload
from h3t_training.config import model_flags


from h3t_training.config import validation
from h3t_training.errors import ArgumentError, said_by_its_node
from h3t_training.config import feature_checks
from h3t_training.config.flag_table import RunDevice, given_table_flags, notice_lines, refusal, without_refused
from h3t_training.config.feature_checks import check_cuda_connections, check_gpu_slots, check_optimizer_offload, \
    check_sdc_flags, check_sharding_flags
from h3t_training.config.memory_hygiene import check_memory_hygiene
from h3t_training.config.megatron_fields import check_gpu_flags, check_layer_spec
from h3t_training.data.tokenizer import TokenizerError


class FrozenConfigError(AttributeError):
    """An attempt to change a field of a :class:`TrainConfig` (use :meth:`TrainConfig.replace`)."""


class UnknownConfigFieldError(AttributeError):
    """A field name that is neither a flag's destination nor a declared derived field (a misspelling), raised
    where it is written (``config.replace(num_layer=...)``) or read (``config.num_layer``)."""


DERIVED_FIELDS: dict[str, tuple[object, str]] = {
    "world_size": (1, "ranks of the job (the launcher's WORLD_SIZE, passed to parse_args)"),
    "ranks_per_node": (1, "ranks the launcher starts on this rank's node (LaunchEnv.ranks_per_node, passed to "
                          "parse_args); a GPU run needs as many CUDA devices there"),
    "flag_notices": ((), "one-line notices printed once by rank 0 at start-up (flag table, auto-plan, alpha)"),
    "batch_schedule": (None, "the global batch size per iteration (BatchSchedule: constant, step or ramp-up)"),
    "lr_warmup_steps": (None, "warm-up in samples, when the schedule counts samples (Megatron's scheduler)"),
    "lr_decay_steps": (None, "decay span in samples, when the schedule counts samples"),
    "lr_wsd_decay_steps": (None, "the WSD annealing in samples (--lr-decay-style WSD), else None"),
    "wd_incr_steps": (None, "the weight-decay increment span in samples (Megatron: the training's samples)"),
    "parallel_layout": (None, "the h3t_ext.layout.ParallelLayout of the final global batch size"),
    "data_parallel_size": (None, "Megatron's data-parallel size world / (t c p)"),
    "num_microbatches": (None, "microbatches per iteration at the final global batch size"),
    "virtual_pipeline_model_parallel_size": (None, "v with interleaving, else None"),
    "auto_plan_flags": (None, "the Megatron flags of the plan --auto-plan chose, or None"),
    "recompute": (None, "Megatron's --recompute-* flags as one h3t_ext.ckpt.Recompute (resolve_ckpt)"),
    "tokenizer_vocab_size": (None, "the tokenizer's vocabulary V before padding, its files read once "
                                   "(validation.resolve_tokenizer)"),
    "samples_left_out_per_iteration": (0, "the samples --decrease-batch-size-if-needed leaves out of each "
                                          "iteration's batch (Megatron-LM counts them as skipped samples)"),
    "skipped_iterations": (frozenset(), "the 1-based (logged) iterations --iterations-to-skip skips, as the "
                                        "installed megatron-core's Megatron-LM counts them "
                                        "(arguments.resolve_iterations_to_skip)"),
}
"""Every field a resolve step may add beyond the flags' destinations, with its value before the step runs and
what it holds. A field outside the flags and this table does not exist."""


def _closest(name: str, names) -> str:
    import difflib
    match = difflib.get_close_matches(name, list(names), n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


class TrainConfig:
    """The resolved flags of one run under Megatron's field names (``config.num_layers``, ...).

    Read like Megatron's ``args``; immutable (:meth:`replace` returns a changed copy) and closed: its fields are
    the parser's destinations plus :data:`DERIVED_FIELDS`, each present from the start, so a reader never needs a
    default and a misspelled name raises :class:`UnknownConfigFieldError` where it is written or read."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, Any]):
        object.__setattr__(self, "_values", dict(values))

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace, **derived: Any) -> "TrainConfig":
        """The flags' values, every derived field at its initial value, then ``derived``'s."""
        values = {**{k: v for k, (v, _) in DERIVED_FIELDS.items()}, **vars(namespace)}
        return cls(values).replace(**derived)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            if name.startswith("__"):
                raise AttributeError(name) from None
            raise UnknownConfigFieldError(f"TrainConfig has no field {name!r}{_closest(name, self._values)}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenConfigError(f"TrainConfig is frozen: {name} cannot be set (use config.replace({name}=...))")

    def __delattr__(self, name: str) -> None:
        raise FrozenConfigError(f"TrainConfig is frozen: {name} cannot be deleted")

    def replace(self, **changes: Any) -> "TrainConfig":
        """A new config with ``changes`` applied; a name that is not a field raises here."""
        unknown = [k for k in changes if k not in self._values]
        if unknown:
            k = unknown[0]
            raise UnknownConfigFieldError(f"TrainConfig has no field {k!r}{_closest(k, self._values)}; its fields are "
                                          "the flags' destinations and h3t_training.config.sections.DERIVED_FIELDS")
        return TrainConfig({**self._values, **changes})

    def as_dict(self) -> dict:
        """A copy of every field (for logging and for APIs that want a plain mapping)."""
        return dict(self._values)

    def as_namespace(self) -> argparse.Namespace:
        """An ``argparse.Namespace`` copy, for APIs that want Megatron's mutable ``args``."""
        return argparse.Namespace(**self._values)

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TrainConfig) and self._values == other._values

    __hash__ = None  # fields may be lists

    def __repr__(self) -> str:
        return f"TrainConfig({len(self._values)} fields, num_layers={self._values.get('num_layers')})"

    def __reduce__(self):
        return TrainConfig, (self._values,)


Step = Callable[[TrainConfig], TrainConfig]


def resolve(config: TrainConfig) -> TrainConfig:
    """Every step after parsing, in order (later steps read what earlier ones derived)."""
    steps: list[Step] = [check_optimizer_offload, arguments.check_finite, arguments.check_positive, megatron_compat.apply_megatron_behaviours,
                         model_flags.check_activation, arguments.fill_model_defaults, model_flags.resolve_window,
                         arguments.check_positive, validation.check_model_shape,
                         arguments.resolve_ckpt, arguments.resolve_iterations_to_skip,
                         validation.resolve_tokenizer, check_layer_spec, validation.check_overlap,
                         megatron_offload.check_offload_requests]
    if config.auto_plan:
        steps.append(auto_plan.plan_config)
    steps += [arguments.fill_parallel_defaults, arguments.apply_padded_vocab_size, megatron_offload.map_offload_request,
              check_sharding_flags, check_gpu_slots, check_cuda_connections, check_sdc_flags, check_memory_hygiene,
              check_gpu_flags, validation.validate_args]
    for step in steps:
        config = step(config)
        assert isinstance(config, TrainConfig), f"{step.__name__} must return a TrainConfig"
    return config


def run_device(args) -> RunDevice:
    """Where the run trains (a GPU: ``uses_gpu``) and whether TransformerEngine is importable there: the flag
    table's classes depend on it."""
    on_gpu = feature_checks.uses_gpu(args)
    te = on_gpu and feature_checks.transformer_engine_available()
    if not on_gpu or te:
        return RunDevice(on_gpu, te)
    return RunDevice(on_gpu, te, feature_checks.transformer_engine_reason())


def _checkpoint_args(namespace: argparse.Namespace, parser: argparse.ArgumentParser,
                     read: Optional[checkpoint_args.Reader]) -> tuple[argparse.Namespace, tuple[str, ...]]:
    """``--use-checkpoint-args``: the flags with the saved ones of ``--pretrained-checkpoint``, then ``--load``."""
    if read is None:
        raise ArgumentError(f"{checkpoint_args.USE_FLAG} is not available here: this caller reads no checkpoints "
                            f"(the training entry points pretrain_llama.py and pretrain_gpt.py do)")
    found = []
    for flag, root in (("--pretrained-checkpoint", namespace.pretrained_checkpoint), ("--load", namespace.load)):
        if root is not None:
            found.append((flag, read(root, namespace.ckpt_step)))
            if found[-1][1] is None and namespace.exit_on_missing_checkpoint:
                raise checkpoint_args.MissingCheckpointExit(flag, root)
    return checkpoint_args.apply(namespace, parser, found)


def parse_args(argv: Optional[Sequence[str]] = None, prog: str = "pretrain_llama.py",
               defaults: Optional[dict] = None, world_size: int = 1, rank: int = 0, ranks_per_node: int = 1,
               local_rank: int = 0, read_checkpoint_args: Optional[checkpoint_args.Reader] = None) -> TrainConfig:
    """Parse and resolve the command line; exit 2 with one line on a bad flag.

    ``defaults`` overrides the parser's (Megatron-LM's) defaults; pretrain_llama.py gets
    :data:`~h3t_training.config.arguments.LLAMA_DEFAULTS`. ``world_size`` is the job's and ``ranks_per_node`` this
    rank's node's (the entry point reads the launcher's; nothing here reads them from the environment); every rank
    parses, rank 0 (``rank``) writes the error line; a problem of the node (``NodeArgumentError``: its GPUs, its
    launch environment) is also written by each other node's first rank (``local_rank`` 0), with its host.
    ``read_checkpoint_args`` reads the args a checkpoint saved, for ``--use-checkpoint-args``
    (:func:`h3t_training.loop.saved_args.read_saved_args`; the entry points pass it).
    The flag table's refusals and the first problem the resolve steps find are one line together."""
    if defaults is None and prog == "pretrain_llama.py":
        defaults = arguments.LLAMA_DEFAULTS
    argv = sys.argv[1:] if argv is None else list(argv)
    from_checkpoint = checkpoint_args.requested(argv)
    parser = arguments.build_parser(prog, defaults, report=rank == 0, shape_required=not from_checkpoint)
    namespace = parser.parse_args(argv)
    taken: tuple[str, ...] = ()
    if from_checkpoint:
        try:
            namespace, taken = _checkpoint_args(namespace, parser, read_checkpoint_args)
        except ArgumentError as e:
            parser.error(str(e))
        except checkpoint_args.MissingCheckpointExit as e:  # Megatron-LM's sys.exit() in load_args_from_checkpoint
            if rank == 0:
                sys.stdout.write(f"{e}\n")
            sys.exit(0)
    if prog == "pretrain_gpt.py" and (missing := arguments.missing_megatron_required(namespace)):
        parser.error(missing)
    given = given_table_flags(namespace)
    device = run_device(namespace)
    refused = refusal(given, device, namespace)
    if refused and taken:
        refused += " (" + "; ".join(n.removeprefix("note: ") for n in taken) + ")"
    resolved = without_refused(given, device, namespace) if refused else namespace
    config = TrainConfig.from_namespace(resolved, world_size=world_size, ranks_per_node=ranks_per_node,
                                        flag_notices=(*taken, *notice_lines(given, device, namespace)))
    try:
        config = resolve(config)  # also with refused flags (left out: no step reads one): one launch names all
    except (ArgumentError, TokenizerError) as e:
        line = f"{refused}; {e}" if refused else str(e)
        if said_by_its_node(e, rank, local_rank):
            parser.node_error(line, rank)  # this node's problem: rank 0's node may not have it
        parser.error(line)
    if refused:
        parser.error(refused)
    return config


__all__ = ["DERIVED_FIELDS", "FrozenConfigError", "TrainConfig", "UnknownConfigFieldError", "parse_args", "resolve",
           "run_device"]
