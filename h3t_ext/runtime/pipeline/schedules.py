"""Device-agnostic pipeline schedules that execute :func:`h3t_ext.schedule.builder.build_schedule`.

:class:`H3TSchedules` carries one :class:`H3TConfig` and exposes the three functions that
``megatron.core.pipeline_parallel.schedules.get_forward_backward_func()`` hands out
(:meth:`~H3TSchedules.forward_backward_no_pipelining`,
:meth:`~H3TSchedules.forward_backward_pipelining_without_interleaving`,
:meth:`~H3TSchedules.forward_backward_pipelining_with_interleaving`), with Megatron's
keyword-only arguments and return value (the list of loss dicts of the last stage, empty
elsewhere). All three run one loop over this rank's action list: FORWARD/BACKWARD call
megatron-core's own ``forward_step``/``backward_step`` (they do not touch CUDA on a CPU model
unless ``enable_autocast`` is set), sends and receives go through :class:`PipelineP2P` (every
run of them between two compute actions is posted as one batch, before the compute that follows,
so the posting order is the builder's), and
OFFLOAD/RELOAD drive the activation manager of this stage. At pipeline size 1 the offload is layer-granular:
the layer actions that follow a compute action in the list run inside it, so the executor hands them to the
manager's ``forward_scope`` / ``backward_scope`` with that compute action (the manager issues each at its
layer boundary).

Gradient synchronisation follows Megatron: ``no_sync_func`` is entered for the iteration and
left before the backward of each chunk's last microbatch (on every rank when
``grad_sync_func`` is None, else as Megatron does per schedule), ``grad_sync_func`` /
``param_sync_func`` are called per model chunk, ``finalize_model_grads_func`` at the end.
Interleaved schedules launch a chunk's ``param_sync_func`` at the first forward of the chunk
before it, without Megatron's per-rank look-ahead offset (the sync is the same, its overlap
differs).
"""
from __future__ import annotations

import contextlib
import enum
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import (
    backward_step,
    check_first_val_step,
    clear_embedding_activation_buffer,
    deallocate_output_tensor,
    finish_embedding_wgrad_compute,
    forward_step,
    get_tensor_shapes,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_model_config, get_model_type

from ...schedule.builder import Action, ActionKind, build_schedule
from ..config import H3TConfig, RuntimeConfigError
from .p2p import BACKWARD, FORWARD, PipelineP2P
from .prepare import ModelPreparer, validate_layout

_BACKWARD_STEP_TAKES_MODEL_TYPE = "model_type" in inspect.signature(backward_step).parameters
"""megatron-core 0.16's ``backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config)``; 0.19
dropped ``model_type``."""


def _backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config):
    """megatron-core's ``backward_step`` in the signature of the installed version."""
    if _BACKWARD_STEP_TAKES_MODEL_TYPE:
        return backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config)
    return backward_step(input_tensor, output_tensor, output_tensor_grad, config)


class ScheduleMode(enum.Enum):
    """Which of Megatron's three forward-backward functions was called."""

    NO_PIPELINING = "no_pipelining"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"


@dataclass(frozen=True)
class MegatronCallArgs:
    """The keyword arguments of Megatron's forward-backward functions (one call), named as Megatron names them."""

    forward_step_func: Callable
    data_iterator: Any
    model: Any
    num_microbatches: int
    seq_length: Optional[int] = None
    micro_batch_size: Optional[int] = None
    decoder_seq_length: Optional[int] = None
    forward_only: bool = False
    collect_non_loss_data: bool = False
    first_val_step: Optional[bool] = None
    adjust_tensor_shapes_fn: Optional[Callable] = None
    p2p_communicator: Any = None
    pg_collection: Any = None
    force_all_reduce: bool = False


@dataclass
class _Call:
    """Everything one forward-backward call needs, resolved from Megatron's arguments."""

    forward_step_func: Callable
    data_iterators: list
    model: list
    num_microbatches: int
    forward_only: bool
    collect_non_loss_data: bool
    first_val_step: Optional[bool]
    shapes: list
    pg_collection: Any
    pp_group: Any
    pp_rank: int
    pp_size: int
    interleaved: bool
    force_all_reduce: bool


def _call_args(kw: dict) -> MegatronCallArgs:
    """One entry point's keyword arguments as the typed record, at the boundary of Megatron's API (nothing past it
    reads a dict)."""
    return MegatronCallArgs(**{k: v for k, v in kw.items() if k != "self"})


def _default_pg_collection() -> ProcessGroupCollection:
    """Megatron's global groups, only when the caller passed none (the Megatron-API boundary)."""
    pgc = ProcessGroupCollection()
    pgc.tp = parallel_state.get_tensor_model_parallel_group()
    pgc.cp = parallel_state.get_context_parallel_group()
    pgc.embd = parallel_state.get_embedding_group(check_initialized=False)
    pgc.pos_embd = parallel_state.get_position_embedding_group(check_initialized=False)
    pgc.pp = parallel_state.get_pipeline_model_parallel_group()
    pgc.dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=False)
    return pgc


def _group_rank_size(group) -> tuple[int, int]:
    if group is None or not torch.distributed.is_initialized():
        return 0, 1
    return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)


def _as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


class _GradSync:
    """Megatron's no_sync / grad_sync_func / param_sync_func protocol for one call.

    The sync functions are read from Megatron's model config once and held here, one per model chunk under
    interleaving (Megatron's own interleaved schedule writes that list back into the config; this does not,
    and a forward-only call uses none of them without touching the config either)."""

    def __init__(self, config, model: list, mode: ScheduleMode, pp_rank: int, forward_only: bool):
        self.model, self.mode, self.pp_rank = model, mode, pp_rank
        self.interleaved = mode is ScheduleMode.INTERLEAVED
        no_sync = config.no_sync_func
        if isinstance(no_sync, list):
            funcs = no_sync
            no_sync = lambda: _enter_all(funcs)  # noqa: E731
        self.no_sync_func = no_sync or contextlib.nullcontext
        self._ctx = None
        self.synced: set[int] = set()
        self.grad_sync, self.param_sync = config.grad_sync_func, config.param_sync_func
        if self.interleaved:
            self.grad_sync, self.param_sync = (
                None if forward_only or f is None else (f if isinstance(f, list) else [f for _ in model])
                for f in (self.grad_sync, self.param_sync))
        self.disable()

    def disable(self) -> None:
        if self._ctx is None:
            self._ctx = self.no_sync_func()
            self._ctx.__enter__()

    def enable(self) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None

    def start(self) -> None:
        psf = self.param_sync
        if self.interleaved and psf is not None:
            for c in range(min(2, len(self.model))):
                psf[c](self.model[c].parameters())

    def before_forward(self, a: Action, is_first_mb: bool) -> None:
        psf = self.param_sync
        if self.interleaved and psf is not None and is_first_mb and 1 < a.chunk + 1 < len(self.model):
            psf[a.chunk + 1](self.model[a.chunk + 1].parameters())

    def before_backward(self, a: Action, is_last_mb: bool) -> None:
        gsf = self.grad_sync
        if not is_last_mb:
            return
        if self.interleaved:
            if gsf is None:
                self.enable()
                self.synced.add(a.chunk)
        elif gsf is None or self.pp_rank == 0 or self.mode is ScheduleMode.NO_PIPELINING:
            self.enable()

    def after_backward(self, a: Action, is_last_mb: bool) -> None:
        if not self.interleaved:
            return
        gsf = self.grad_sync
        if gsf is not None and is_last_mb:
            self.enable()
            gsf[a.chunk](self.model[a.chunk].parameters())
            self.synced.add(a.chunk)
        self.disable()

    def finish(self, forward_only: bool) -> None:
        gsf = self.grad_sync
        if forward_only:
            self.enable()
        elif self.interleaved:
            self.enable()
            for c in range(len(self.model)):
                if gsf is not None and c not in self.synced:
                    gsf[c](self.model[c].parameters())
        elif self._ctx is not None:
            self.enable()
            if gsf is not None and self.mode is not ScheduleMode.NO_PIPELINING:
                gsf(self.model[0].parameters())


def _enter_all(funcs):
    stack = contextlib.ExitStack()
    for f in funcs:
        stack.enter_context(f())
    return stack


def _validate_megatron_config(config) -> None:
    if config.num_microbatches_with_partial_activation_checkpoints is not None:
        raise RuntimeConfigError("--num-microbatches-with-partial-activation-checkpoints is not supported by h3t-ext")
    if getattr(config, "variable_seq_lengths", False):
        raise RuntimeConfigError("variable_seq_lengths is not supported by h3t-ext schedules (fixed shapes only)")


class H3TSchedules:
    """Megatron's three forward-backward functions, executing the builder's action lists."""

    def __init__(self, config: H3TConfig, *, manager_factory: Optional[Callable] = None):
        self.config = config
        self.preparer = ModelPreparer(config, manager_factory=manager_factory)
        self._schedules: dict[tuple, Any] = {}
        self.last_posted: list[tuple[str, ...]] = []
        """Batches the last call posted (``what`` of each transfer): the builder's
        :func:`~h3t_ext.schedule.posting.posting_batches` of this rank's list."""
        self.last_staging = None
        """Host-staging copies of the last call (:class:`~h3t_ext.runtime.pipeline.p2p.StagingStats`; None at PP=1)."""

    # -- Megatron's entry points -------------------------------------------------------------
    def forward_backward_no_pipelining(self, *, forward_step_func, data_iterator, model, num_microbatches,
                                       seq_length=None, micro_batch_size=None, decoder_seq_length=None,
                                       forward_only=False, collect_non_loss_data=False, first_val_step=None,
                                       adjust_tensor_shapes_fn=None, p2p_communicator=None, pg_collection=None,
                                       force_all_reduce=False):
        """Run all microbatches on one pipeline stage (PP=1)."""
        return self._run(ScheduleMode.NO_PIPELINING, _call_args(locals()))

    def forward_backward_pipelining_without_interleaving(self, *, forward_step_func, data_iterator, model,
                                                         num_microbatches, seq_length, micro_batch_size,
                                                         decoder_seq_length=None, forward_only=False,
                                                         collect_non_loss_data=False, first_val_step=None,
                                                         adjust_tensor_shapes_fn=None, p2p_communicator=None,
                                                         pg_collection=None, force_all_reduce=False):
        """1F1B over the pipeline group, one model chunk per rank."""
        return self._run(ScheduleMode.ONE_F_ONE_B, _call_args(locals()))

    def forward_backward_pipelining_with_interleaving(self, *, forward_step_func, data_iterator, model,
                                                      num_microbatches, seq_length, micro_batch_size,
                                                      decoder_seq_length=None, forward_only=False,
                                                      collect_non_loss_data=False, first_val_step=None,
                                                      adjust_tensor_shapes_fn=None, p2p_communicator=None,
                                                      pg_collection=None, force_all_reduce=False):
        """Interleaved 1F1B over the pipeline group, ``len(model)`` chunks per rank."""
        return self._run(ScheduleMode.INTERLEAVED, _call_args(locals()))

    def forward_backward_func(self, pipeline_model_parallel_size: int, num_model_chunks: int) -> Callable:
        """The one of the three functions megatron-core's ``get_forward_backward_func()`` hands out for this shape
        (a driver that holds the runtime calls it directly; :func:`~h3t_ext.runtime.pipeline.install.install` is
        the adapter for Megatron's own loop)."""
        if pipeline_model_parallel_size == 1:
            return self.forward_backward_no_pipelining
        if num_model_chunks > 1:
            return self.forward_backward_pipelining_with_interleaving
        return self.forward_backward_pipelining_without_interleaving

    # -- the one executor --------------------------------------------------------------------
    def _resolve(self, mode: ScheduleMode, kw: MegatronCallArgs) -> _Call:
        model, iters = _as_list(kw.model), _as_list(kw.data_iterator)
        if mode is not ScheduleMode.INTERLEAVED and len(model) != 1:
            raise ValueError(f"{mode.value} schedule runs one model chunk, got {len(model)}")
        if len(iters) != len(model):
            raise ValueError(f"need one data iterator per model chunk, got {len(iters)} for {len(model)} chunks")
        pgc = kw.pg_collection
        if pgc is None:
            pgc = _default_pg_collection()
        p2p_comm = kw.p2p_communicator
        pp_group = p2p_comm.pp_group if p2p_comm is not None else pgc.pp
        pp_rank, pp_size = _group_rank_size(pp_group)
        if mode is ScheduleMode.NO_PIPELINING:
            pp_rank, pp_size = 0, 1
        config = get_model_config(model[0])
        shapes: list = []
        if pp_size > 1:
            shapes = get_tensor_shapes(
                seq_length=kw.seq_length, micro_batch_size=kw.micro_batch_size,
                decoder_seq_length=kw.decoder_seq_length, config=config, tp_group=pgc.tp, cp_group=pgc.cp,
            )
            if kw.adjust_tensor_shapes_fn is not None:
                if mode is ScheduleMode.INTERLEAVED:
                    raise ValueError("adjust_tensor_shapes_fn is not supported with interleaving")
                recv, send = kw.adjust_tensor_shapes_fn(shapes, list(shapes))
                if list(map(tuple, recv)) != list(map(tuple, send)):
                    raise ValueError("adjust_tensor_shapes_fn must give the same send and receive shapes")
                shapes = list(recv)
        return _Call(
            forward_step_func=kw.forward_step_func, data_iterators=iters, model=model,
            num_microbatches=kw.num_microbatches, forward_only=kw.forward_only,
            collect_non_loss_data=kw.collect_non_loss_data, first_val_step=kw.first_val_step, shapes=shapes,
            pg_collection=pgc, pp_group=pp_group, pp_rank=pp_rank, pp_size=pp_size,
            interleaved=mode is ScheduleMode.INTERLEAVED, force_all_reduce=bool(kw.force_all_reduce),
        )

    def schedule(self, pp_rank: int, pp_size: int, num_microbatches: int, num_model_chunks: int, *,
                 microbatch_group_size_per_vp_stage: Optional[int] = None, forward_only: bool = False,
                 num_layers_per_chunk: Optional[int] = None):
        """The builder's schedule of one call's shape, checked for this rank (cached per shape).

        ``num_layers_per_chunk`` (the model chunk's transformer layers) makes the offload of pipeline size 1
        layer-granular. A shape the parallel layout rules refuse raises :class:`h3t_ext.layout.LayoutError` (the
        builder's, the cost model's and the driver's reason); an offload it cannot overlap raises
        RuntimeConfigError."""
        shape = (pp_size, num_microbatches, num_model_chunks, microbatch_group_size_per_vp_stage, forward_only,
                 num_layers_per_chunk)
        schedule = self._schedules.get(shape)
        if schedule is None:  # pure and the same every iteration: build and validate once per shape
            # the stages with alpha 0 get no OFFLOAD/RELOAD: the lists are what runs (and what the cost model prices)
            alphas = tuple(self.config.stage_alpha(r, pp_size) for r in range(pp_size))
            schedule = build_schedule(pp_size, num_microbatches, num_model_chunks,
                                      microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage,
                                      forward_only=forward_only, offload_alphas=alphas,
                                      num_layers_per_chunk=num_layers_per_chunk)
            validate_layout(self.config, schedule, pp_rank)
            self._schedules[shape] = schedule
        return schedule

    def _run(self, mode: ScheduleMode, kw: MegatronCallArgs) -> list:
        call = self._resolve(mode, kw)
        config = get_model_config(call.model[0])
        v = len(call.model)
        _validate_megatron_config(config)
        group = getattr(config, "microbatch_group_size_per_vp_stage", None) if v > 1 else None
        layers = None
        if call.pp_size == 1 and self.config.stage_alpha(0, 1) > 0 and not call.forward_only:
            layers = self.preparer.layers_per_chunk(call.model)  # layer-granular offload: one rank, one chunk
        schedule = self.schedule(call.pp_rank, call.pp_size, call.num_microbatches, v,
                                 microbatch_group_size_per_vp_stage=group, forward_only=call.forward_only,
                                 num_layers_per_chunk=layers)
        manager = self.preparer.prepare(call.model, call.pp_rank, call.pp_size)
        actions = list(schedule.ranks[call.pp_rank])  # OFFLOAD/RELOAD only where this stage's alpha > 0
        executor = _Executor(call, config, self.config, manager, mode, v, num_layers_per_chunk=layers)
        store = executor.run(actions)
        self.last_posted = executor.p2p.posted if executor.p2p is not None else []
        self.last_staging = executor.p2p.staging_stats if executor.p2p is not None else None
        return store


class _Executor:
    """Runs one rank's action list once."""

    def __init__(self, call: _Call, config, h3t: H3TConfig, manager, mode: ScheduleMode, v: int, *,
                 num_layers_per_chunk: Optional[int] = None):
        self.call, self.config, self.manager, self.mode, self.v = call, config, manager, mode, v
        self.num_layers_per_chunk = num_layers_per_chunk
        self.num_stages = call.pp_size * v
        self.last_stage = self.num_stages - 1
        param = next(call.model[0].parameters())
        self.device = param.device
        self.dtype = config.pipeline_dtype or param.dtype
        strict = h3t.strict_p2p_comm if h3t.strict_p2p else None
        self.p2p = PipelineP2P(call.pp_group, self.num_stages, h3t.p2p_timeout_s, strict=strict,
                               staging=h3t.p2p_staging) if call.pp_size > 1 else None
        self.model_type = get_model_type(call.model[0])
        self.inputs: dict[tuple[int, int], list] = {}
        self.outputs: dict[tuple[int, int], list] = {}
        self.input_grads: dict[tuple[int, int], list] = {}
        self.store: list = []
        self.tokens = torch.zeros([], dtype=torch.int, device=self.device)

    def stage(self, a: Action) -> int:
        return a.chunk * self.call.pp_size + self.call.pp_rank

    def run(self, actions: list[Action]) -> list:
        call, config = self.call, self.config
        is_last_rank = call.pp_rank == call.pp_size - 1
        embedding_module = None
        if config.finalize_model_grads_func is not None and not call.forward_only:
            embedding_module = clear_embedding_activation_buffer(
                config, call.model if self.v > 1 else call.model[0], is_last_rank)
        if config.timers is not None:
            config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
        sync = _GradSync(config, call.model, self.mode, call.pp_rank, call.forward_only)
        try:
            sync.start()
            i = 0
            while i < len(actions):  # a compute action with the layer actions that run inside it
                j = i + 1
                while j < len(actions) and actions[j].layer is not None:
                    j += 1
                self._step(actions[i], sync, tuple(actions[i + 1:j]))
                i = j
            if self.p2p is not None:
                self.p2p.wait_all()
        finally:
            sync.finish(call.forward_only)
        if self.manager is not None:
            self.manager.end_iteration()
        if config.finalize_model_grads_func is not None and not call.forward_only:
            finish_embedding_wgrad_compute(config, embedding_module, is_last_rank, call.pg_collection.tp)
            config.finalize_model_grads_func(
                call.model, self.tokens if config.calculate_per_token_loss else None,
                pg_collection=call.pg_collection, force_all_reduce=call.force_all_reduce,
            )
        if config.timers is not None:
            config.timers("forward-backward").stop()
        return self.store

    def _step(self, a: Action, sync: _GradSync, layer_actions: tuple = ()) -> None:
        k, key = a.kind, (a.microbatch, a.chunk)
        assert not layer_actions or k in (ActionKind.FORWARD, ActionKind.BACKWARD), "layer actions follow compute"
        what = f"{k.name} microbatch {a.microbatch} chunk {a.chunk} with pipeline rank {a.peer}"
        if k is ActionKind.RECV_FORWARD:
            self.p2p.queue_recv(("F",) + key, self.call.shapes, self.dtype, self.device,
                                a.peer, FORWARD, a.microbatch, self.stage(a) - 1, what)
        elif k is ActionKind.RECV_BACKWARD:
            self.p2p.queue_recv(("B",) + key, self.call.shapes, self.dtype, self.device,
                                a.peer, BACKWARD, a.microbatch, self.stage(a) + 1, what)
        elif k is ActionKind.SEND_FORWARD:
            out = self.outputs[key] if not self.call.forward_only else self.outputs.pop(key)
            self.p2p.queue_send(out, a.peer, FORWARD, a.microbatch, self.stage(a), what)
            if not self.call.forward_only:
                deallocate_output_tensor(out[0], self.config.deallocate_pipeline_outputs)
        elif k is ActionKind.SEND_BACKWARD:
            self.p2p.queue_send(self.input_grads.pop(key), a.peer, BACKWARD, a.microbatch, self.stage(a), what)
        elif k is ActionKind.FORWARD:
            self._forward(a, sync, layer_actions)
        elif k is ActionKind.BACKWARD:
            self._backward(a, sync, layer_actions)
        elif k is ActionKind.OFFLOAD:
            self.manager.offload(a.microbatch, a.chunk)
        elif k is ActionKind.RELOAD:
            self.manager.reload(a.microbatch, a.chunk)
        else:  # pragma: no cover - the builder emits nothing else
            raise AssertionError(f"unknown action {a}")

    def _forward(self, a: Action, sync: _GradSync, layer_actions: tuple = ()) -> None:
        call, key, stage = self.call, (a.microbatch, a.chunk), self.stage(a)
        if stage > 0:
            inp = self.p2p.wait_recv(("F",) + key)
            if not call.forward_only:
                for t in inp:
                    t.requires_grad_(True)
        else:
            if self.p2p is not None:
                self.p2p.flush()
            inp = [None]
        sync.before_forward(a, a.microbatch == 0)
        layered = {"layer_actions": layer_actions, "num_layers": self.num_layers_per_chunk} if layer_actions else {}
        scope = (self.manager.forward_scope(*key, **layered) if self.manager and not call.forward_only
                 else contextlib.nullcontext())
        with scope:
            out, tokens = forward_step(
                call.forward_step_func, call.data_iterators[a.chunk], call.model[a.chunk], call.num_microbatches,
                inp, self.store, self.config, call.pg_collection.cp.size(),
                collect_non_loss_data=call.collect_non_loss_data,
                is_first_microbatch=check_first_val_step(call.first_val_step, call.forward_only, a.microbatch == 0),
                current_microbatch=a.microbatch,
                vp_stage=a.chunk if call.interleaved else None,
                is_last_stage=stage == self.last_stage,
            )
        self.tokens += tokens
        if stage < self.last_stage:
            self.outputs[key] = out
        elif not call.forward_only:
            self.outputs[key] = out
            deallocate_output_tensor(out[0], self.config.deallocate_pipeline_outputs)
        if not call.forward_only:
            self.inputs[key] = inp

    def _backward(self, a: Action, sync: _GradSync, layer_actions: tuple = ()) -> None:
        key, stage = (a.microbatch, a.chunk), self.stage(a)
        if stage < self.last_stage:
            grad = self.p2p.wait_recv(("B",) + key)
        else:
            if self.p2p is not None:
                self.p2p.flush()
            grad = [None]
        is_last_mb = a.microbatch == self.call.num_microbatches - 1
        sync.before_backward(a, is_last_mb)
        layered = {"layer_actions": layer_actions} if layer_actions else {}
        scope = self.manager.backward_scope(*key, **layered) if self.manager else contextlib.nullcontext()
        with scope:
            in_grad = _backward_step(self.inputs.pop(key), self.outputs.pop(key), grad, self.model_type, self.config)
        if self.manager is not None:
            self.manager.release(*key)
        sync.after_backward(a, is_last_mb)
        if stage > 0:
            self.input_grads[key] = in_grad


__all__ = ["H3TSchedules", "MegatronCallArgs", "ScheduleMode"]
