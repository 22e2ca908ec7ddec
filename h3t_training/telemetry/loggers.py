"""Scalar writers for ``--tensorboard-dir`` and ``--wandb-project``, behind one small interface.

The driver talks to a :class:`ScalarWriter` (``add_scalar(tag, value, step)``, ``flush``,
``close``); :func:`build_writer` returns TensorBoard's ``SummaryWriter``, a wandb run, both (a
:class:`FanOutWriter`) or a :class:`NullWriter`. As in Megatron-LM, only the last rank writes.
Both backends are optional packages: :func:`h3t_training.config.feature_checks.check_writer_packages` runs with
the other flag checks, so a missing package ends the program with one line naming it before any process starts.

wandb has a single step axis, so it receives the scalars keyed by iteration and skips Megatron's
``... vs samples`` twins (those have the consumed-sample count as their step). Without
``WANDB_MODE`` in the environment, the run is offline unless ``WANDB_API_KEY`` is set, so a
machine without network never waits on the wandb service.
"""
from __future__ import annotations

import os
from typing import Optional, Protocol


SAMPLES_SUFFIX = " vs samples"


class ScalarWriter(Protocol):
    """What the training loop writes to: one scalar per (tag, step)."""

    def add_scalar(self, tag: str, value: float, step: int) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class NullWriter:
    """No --tensorboard-dir, no --wandb-project, or not the last rank."""

    enabled = False

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardWriter:
    """``torch.utils.tensorboard.SummaryWriter`` in ``--tensorboard-dir`` (queue ``--tensorboard-queue-size``)."""

    enabled = True

    def __init__(self, log_dir: str, max_queue: int):
        from torch.utils.tensorboard import SummaryWriter
        self._w = SummaryWriter(log_dir=log_dir, max_queue=max_queue)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._w.add_scalar(tag, value, step)

    def flush(self) -> None:
        self._w.flush()

    def close(self) -> None:
        self._w.close()


def wandb_mode(environ=os.environ) -> str:
    """``WANDB_MODE`` when set; else online only with ``WANDB_API_KEY``, offline otherwise."""
    if environ.get("WANDB_MODE"):
        return environ["WANDB_MODE"]
    return "online" if environ.get("WANDB_API_KEY") else "offline"


class WandbWriter:
    """A wandb run; scalars of one step are sent together when the step changes or on flush."""

    enabled = True

    def __init__(self, *, project: str, name: Optional[str], entity: Optional[str], save_dir: str,
                 config: Optional[dict] = None, module=None):
        if module is None:
            import wandb as module  # noqa: PLC0415 - optional dependency
        os.makedirs(save_dir, exist_ok=True)
        self._run = module.init(project=project, name=name, entity=entity, dir=save_dir, config=config,
                                mode=wandb_mode())
        self._step: Optional[int] = None
        self._pending: dict = {}

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        if tag.endswith(SAMPLES_SUFFIX):
            return
        if self._step is not None and step != self._step:
            self.flush()
        self._step = step
        self._pending[tag] = value

    def flush(self) -> None:
        if self._pending:
            self._run.log(self._pending, step=self._step)
            self._pending = {}

    def close(self) -> None:
        self.flush()
        self._run.finish()


class FanOutWriter:
    """Every scalar to every writer (TensorBoard and wandb together)."""

    enabled = True

    def __init__(self, writers: list):
        self.writers = writers

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        for w in self.writers:
            w.add_scalar(tag, value, step)

    def flush(self) -> None:
        for w in self.writers:
            w.flush()

    def close(self) -> None:
        for w in self.writers:
            w.close()


def wandb_save_dir(args) -> str:
    """``--wandb-save-dir``, else ``<--save>/wandb`` as in Megatron-LM, else ``./wandb``."""
    if args.wandb_save_dir:
        return args.wandb_save_dir
    return os.path.join(args.save, "wandb") if args.save else os.path.abspath("wandb")


def build_writer(args, is_logging_rank: bool) -> ScalarWriter:
    """The writer of this rank: real ones on the logging (last) rank, a NullWriter elsewhere."""
    if not is_logging_rank:
        return NullWriter()
    writers = []
    if args.tensorboard_dir is not None:
        writers.append(TensorBoardWriter(args.tensorboard_dir, args.tensorboard_queue_size))
    if args.wandb_project is not None:
        writers.append(WandbWriter(project=args.wandb_project, name=args.wandb_exp_name, entity=args.wandb_entity,
                                   save_dir=wandb_save_dir(args), config=_plain_config(args)))
    if not writers:
        return NullWriter()
    return writers[0] if len(writers) == 1 else FanOutWriter(writers)


def _plain_config(args) -> dict:
    fields = args.as_dict() if hasattr(args, "as_dict") else vars(args)
    return {k: v for k, v in fields.items() if isinstance(v, (int, float, str, bool, type(None), list, tuple))}


def writers_requested(args) -> bool:
    """True on every rank when some writer is configured (collectives for its scalars run everywhere)."""
    return args.tensorboard_dir is not None or args.wandb_project is not None
