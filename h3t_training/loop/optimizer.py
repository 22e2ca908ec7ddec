"""Optimizer: megatron-core's distributed optimizer on GPU, an exact equivalent on CPU.

CPU path (:class:`DataParallelAdamW`): gradients of sequence-parallel parameters (norm weights,
marked ``sequence_parallel=True``) are first summed over the tensor-parallel group (Megatron's
``finalize_model_grads`` step), then gradients are averaged over the data-parallel group with
one all-reduce of a flat buffer, the global gradient norm is summed over the model-parallel group
(tensor-parallel replicas of a parameter counted once) and clipped as Megatron does, then AdamW
(decoupled weight decay, no decay on 1-D weights) steps. A word embedding tied to the output layer with
p > 1 has a copy on the first and the last stage; their gradients are summed over megatron-core's
embedding group (``finalize_model_grads``' step) and the last stage's copy (``shared``) is left out of
the norm, as Megatron does. With ``--use-distributed-optimizer``
each data-parallel rank keeps Adam state only for its share of the elements, cut as megatron-core cuts its
gradient buffer (:mod:`h3t_training.loop.optimizer_shards`: 1/d of every bucket, across parameter boundaries),
steps that share (views into the parameters) and broadcasts it to the other replicas; the numbers are the same as
without sharding, bit for bit (Adam is element-wise). With
``--optimizer-cpu-offload`` the share megatron-core's split picks steps in a host partition
(:mod:`h3t_training.loop.optimizer_offload`), with the same numbers.
"""
from __future__ import annotations

import math
import os
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from h3t_training.loop.optimizer_offload import HostPartition, OptimizerOffload, split_groups
from h3t_training.loop.collectives import all_reduce_host
from h3t_training.loop.mcore_buffers import ddp_buffers, fsdp_buffers
from h3t_training.loop.optimizer_shards import OwnedSlice, bucket_size, owned_slices
from h3t_training.loop.param_schedule import ParamSchedule
from h3t_training.loop.param_stats import counted, zeros_in_grads


def decoupled_lr_group(args) -> dict:
    """The learning-rate fields of the embedding and output-layer group under --decoupled-lr (as
    megatron-core's optimizer: ``max_lr``, and ``min_lr`` when --decoupled-min-lr is given); empty without it."""
    if args.decoupled_lr is None:
        return {}
    fields = {"max_lr": args.decoupled_lr}
    if args.decoupled_min_lr is not None:
        fields["min_lr"] = args.decoupled_min_lr
    return fields


class NonFiniteError(RuntimeError):
    """A loss or gradient norm that is NaN or infinite; one line naming the iteration and the value.
    Raised on every rank alike (the values it looks at are reduced over all ranks), before the
    optimizer applies anything."""


def check_grad_norm(norm: float, iteration: int) -> None:
    """Stop before a step with a non-finite gradient norm (``iteration`` is 1-based)."""
    if not math.isfinite(norm):
        raise NonFiniteError(f"iteration {iteration}: the gradient norm is {norm}; stopped before the optimizer "
                             f"step (--no-check-for-nan-in-loss-and-grad goes on)")


class DataParallelAdamW:
    """AdamW over this rank's chunks with data-parallel gradient averaging (CPU, gloo)."""

    def __init__(self, chunks, args, *, dp_group, model_parallel_group, tp_rank: int, distributed: bool,
                 tp_group=None, fsdp: bool = False, embedding_group=None, pipeline_group=None):
        self.args = args
        self.schedule = ParamSchedule.from_args(args)
        self.fsdp = fsdp
        """Over torch FSDP2's DTensor shards (--use-torch-fsdp2, :mod:`h3t_training.loop.fsdp`): the gradients arrive
        reduce-scattered and averaged over ``dp_group``; the norm sums the local shards over it."""
        assert not (fsdp and distributed), "--use-torch-fsdp2 excludes the distributed optimizer"
        self._fsdp_loading: dict = {}
        """Parameter index -> moment name -> (local buffer, its row-piece views) a FSDP2 load reads into."""
        self.tied_embedding, self.embedding_group = tied_embedding_weight(chunks, embedding_group, pipeline_group), \
            embedding_group
        """This rank's copy of a tied word embedding duplicated on the first and last pipeline stage (or None),
        and the group its gradient is summed over (megatron-core's embedding group)."""
        self.params = [p for c in chunks for p in c.parameters() if p.requires_grad]
        self.dp_group, self.mp_group, self.tp_rank = dp_group, model_parallel_group, tp_rank
        self.tp_group = tp_group  # sums the gradients of sequence-parallel parameters
        self.dp_size = dist.get_world_size(dp_group)
        self.dp_rank = dist.get_rank(dp_group)
        self.dp_ranks = dist.get_process_group_ranks(dp_group)
        self.sharded = distributed and self.dp_size > 1
        self.skipped = False
        """Whether the last step was skipped (never here: float32 has no loss scaling)."""
        self.num_zeros_in_grad: Optional[float] = None
        """Zero elements of the last step's gradients, with --log-num-zeros-in-grad (:mod:`param_stats`)."""
        self.slices = self._layout(chunks, args, pipeline_group) if self.sharded else \
            [OwnedSlice(i, self.dp_rank, 0, p.numel()) for i, p in enumerate(self.params)]
        """Which elements of which parameter every data-parallel rank steps (this rank's only without the
        distributed optimizer)."""
        self.owned: dict[int, OwnedSlice] = {s.param: s for s in self.slices if s.rank == self.dp_rank}
        """Parameter index -> the slice of it this rank steps (parameters it steps none of are absent)."""
        self.views: dict[int, torch.Tensor] = {i: self._view(s) for i, s in self.owned.items()}
        """Parameter index -> what this rank's optimizer steps for it: the parameter, or the slice it owns (a
        view into the parameter's data, so that the step updates the parameter in place)."""
        decoupled = decoupled_lr_group(args)
        groups = []
        for own_lr in (False, True):  # --decoupled-lr: the embedding and output weights get their own schedule
            mine = [i for i in self.views if bool(decoupled and getattr(
                self.params[i], "is_embedding_or_output_parameter", False)) == own_lr]
            extra = decoupled if own_lr else {}
            groups += [{"params": [self.views[i] for i in mine if self.params[i].dim() > 1],
                        "weight_decay": args.weight_decay, "wd_mult": 1.0, **extra},
                       {"params": [self.views[i] for i in mine if self.params[i].dim() <= 1], "weight_decay": 0.0,
                        "wd_mult": 0.0, **extra}]
        groups = [g for g in groups if g["params"]]
        self.offload = OptimizerOffload.from_args(args)
        self.host: Optional[HostPartition] = None
        """The offloaded share's master copies, gradient copies and Adam states (--optimizer-cpu-offload)."""
        if self.offload.enabled:
            groups, host_groups = split_groups(groups, self.offload.fraction)
            if host_groups:
                self.host = HostPartition(host_groups, self._adamw, overlap=self.offload.overlap_d2h_h2d)
        self.adam = self._adamw(groups or [{"params": [torch.nn.Parameter(torch.zeros(1))]}])
        self.has_params = bool(groups)
        self.steps = 0
        """Optimizer steps taken (Adam's bias-correction count; the same for every parameter)."""

    def _layout(self, chunks, args, pipeline_group) -> list[OwnedSlice]:
        """megatron-core's ownership of the gradient buffer of every chunk (:func:`optimizer_shards.owned_slices`)."""
        from h3t_training.config.megatron_fields import ddp_fields  # noqa: PLC0415

        pp_rank = dist.get_rank(pipeline_group) if pipeline_group is not None else 0
        per_chunk = [[p for p in c.parameters() if p.requires_grad] for c in chunks]
        given = ddp_fields(args).get("bucket_size")
        sizes = [bucket_size(self.dp_size, ddp_bucket_size=given, overlap_grad_reduce=args.overlap_grad_reduce,
                             pipeline_rank=pp_rank, chunk=c) for c in range(len(chunks))]
        return owned_slices([[p.numel() for p in ps] for ps in per_chunk], self.dp_size, sizes,
                            [[bool(getattr(p, "shared_embedding", False)) for p in ps] for ps in per_chunk])

    def _view(self, s: OwnedSlice) -> torch.Tensor:
        p = self.params[s.param]
        if s.start == 0 and s.end == p.numel():
            return p
        return torch.nn.Parameter(p.data.view(-1)[s.start:s.end])

    def _attach_grads(self) -> None:
        """Each owned slice's gradient: the same elements of its parameter's (reduced, clipped) gradient."""
        for i, s in self.owned.items():
            if self.views[i] is not self.params[i]:
                self.views[i].grad = self.params[i].grad.view(-1)[s.start:s.end]

    def _adamw(self, groups: list[dict]) -> torch.optim.AdamW:
        a = self.args
        return torch.optim.AdamW(groups, lr=a.lr, betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_eps)

    def _param_groups(self) -> list[dict]:
        return [*self.adam.param_groups, *(self.host.param_groups if self.host is not None else ())]

    def _state(self, p) -> dict:
        """Adam's state of the optimizer's tensor ``p`` (a parameter or an owned slice) wherever it lives (empty
        before the first step)."""
        if self.host is not None and p in self.host.master:
            return self.host.state(p)
        return self.adam.state.get(p, {})

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def get_loss_scale(self) -> float:
        """1.0: float32 training scales no loss."""
        return 1.0

    def _reduce_grads(self) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        from h3t_ext.runtime.modules.sequence_parallel import (  # noqa: PLC0415
            allreduce_flat_, allreduce_sequence_parallel_grads)

        allreduce_sequence_parallel_grads(self.params, self.tp_group)
        if self.fsdp:  # reduce-scattered over the data-parallel group by FSDP2 already
            return
        if self.tied_embedding is not None:  # finalize_model_grads' word-embedding step: both copies get the sum
            dist.all_reduce(self.tied_embedding.grad, group=self.embedding_group)
        if self.dp_size == 1:
            return
        allreduce_flat_([p.grad for p in self.params], self.dp_group)
        for p in self.params:
            p.grad /= self.dp_size

    def _per_token_scale(self, num_tokens: int) -> None:
        """--calculate-per-token-loss as megatron-core's ``finalize_model_grads``: the microbatches' loss sums' gradients,
        summed over the data-parallel (and context-parallel) ranks, over the tokens of the whole batch. Here they arrive
        averaged over the ranks, hence x ranks / tokens."""
        total = all_reduce_host(torch.tensor([num_tokens], dtype=torch.float64), group=self.dp_group) \
            if self.dp_size > 1 else torch.tensor([num_tokens], dtype=torch.float64)
        if total.item() > 0:
            for p in self.params:
                p.grad.mul_(self.dp_size / total.item())

    def _grad_norm(self) -> float:
        from h3t_training.loop.fsdp import local  # noqa: PLC0415

        sq = torch.zeros(1, dtype=torch.float64)
        for p in self.params:  # the last stage's copy of a tied embedding (``shared``) is counted once, as Megatron
            if counted(p, self.tp_rank):
                sq += local(p.grad).double().pow(2).sum()
        if self.fsdp and self.dp_size > 1:  # each rank holds one shard of every gradient
            sq = all_reduce_host(sq, group=self.dp_group)
        if self.mp_group is not None and dist.get_world_size(self.mp_group) > 1:
            sq = all_reduce_host(sq, group=self.mp_group)
        return float(sq.sqrt())

    def _broadcast_shards(self) -> None:
        """Every rank's stepped slices to the other replicas (the distributed optimizer's parameter all-gather)."""
        for owner in range(self.dp_size):
            mine = [s for s in self.slices if s.rank == owner]
            if not mine:
                continue
            flat = torch.cat([self.params[s.param].data.view(-1)[s.start:s.end] for s in mine])
            dist.broadcast(flat, src=self.dp_ranks[owner], group=self.dp_group)
            if owner == self.dp_rank:
                continue
            offset = 0
            for s in mine:
                self.params[s.param].data.view(-1)[s.start:s.end].copy_(flat[offset:offset + s.numel])
                offset += s.numel

    def step(self, iteration: int, num_steps: int, num_tokens: int = 0) -> tuple[float, float]:
        """Average, clip and apply the gradients with the schedule at ``num_steps``
        (:mod:`h3t_training.loop.param_schedule`); returns (learning rate applied, gradient norm). ``num_tokens``: the
        loss tokens of this data-parallel rank's share of the batch, with --calculate-per-token-loss."""
        self._reduce_grads()
        if self.args.calculate_per_token_loss:
            self._per_token_scale(num_tokens)
        norm = self._grad_norm()
        if self.args.check_for_nan_in_loss_and_grad:
            check_grad_norm(norm, iteration + 1)
        clip = self.args.clip_grad
        coeff = clip / (norm + 1e-6) if clip > 0 else 1.0  # megatron-core's clip_grad_by_total_norm_fp32
        if coeff < 1.0:
            for p in self.params:
                p.grad.mul_(coeff)
        self.num_zeros_in_grad = zeros_in_grads(  # after clipping, as megatron-core counts them
            self.params, tp_rank=self.tp_rank, model_parallel_group=self.mp_group,
            shard_group=self.dp_group if self.fsdp else None) if self.args.log_num_zeros_in_grad else None
        lr = self.schedule.apply(self._param_groups(), num_steps)
        self._attach_grads()
        if self.has_params:
            self.adam.step()
        if self.host is not None:
            self.host.step()
        self.steps += 1
        if self.sharded:
            self._broadcast_shards()
        return lr, norm

    def sharded_state_dict(self, model_sharded_state_dicts: list, *, is_loading: bool = False) -> dict:
        """Adam's moments as ShardedTensors keyed like the parameters they belong to (so they reshard with the
        model and with the data-parallel size), replicated as the model is; the step count in common. With the
        distributed optimizer each parameter's moments are first put together from the ranks' slices
        (:meth:`_whole_moments`: collective over the data-parallel group)."""
        from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

        if self.fsdp:
            return {"state": self._fsdp_sharded_state(model_sharded_state_dicts, is_loading), "steps": self.steps}
        by_storage = _sharded_params(model_sharded_state_dicts)
        whole = {} if is_loading else self._whole_moments()
        state: dict = {}
        for i, p in enumerate(self.params):
            model_sh = by_storage.get((p.data_ptr(), tuple(p.shape)))
            assert model_sh is not None, f"parameter {i} {tuple(p.shape)} is not in the model's sharded state dict"
            held = whole.get(i, {})
            state[i] = {name: make_sharded_optimizer_tensor(
                model_sh, torch.zeros_like(p) if name not in held else held[name], f"optimizer.state.{name}")
                for name in MOMENTS}
        return {"state": state, "steps": self.steps}

    def _fsdp_sharded_state(self, model_sharded_state_dicts: list, is_loading: bool) -> dict:
        """Over FSDP2's shards: each moment cut into the row pieces of its parameter's local shard
        (:func:`h3t_training.loop.fsdp.pieces_of`), keyed as those pieces."""
        from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

        from h3t_training.loop.fsdp import local, piece_index, pieces_of  # noqa: PLC0415
        index = piece_index(model_sharded_state_dicts)
        state: dict = {}
        for i, p in enumerate(self.params):
            shard, held = local(p), self._state(p)
            pieces = pieces_of(index, shard)
            assert pieces or shard.numel() == 0, f"parameter {i} {tuple(p.shape)} has no rows in the model's state"
            entry = {}
            for name in ("exp_avg", "exp_avg_sq"):
                data = torch.zeros_like(shard) if is_loading or name not in held else local(held[name])
                views = [data[rows].view(sh.local_shape) for sh, rows in pieces]
                entry[name] = [make_sharded_optimizer_tensor(sh, v, f"optimizer.state.{name}")
                               for (sh, _), v in zip(pieces, views)]
                if is_loading:  # read in place; load_sharded_state_dict installs them
                    self._fsdp_loading.setdefault(i, {})[name] = (data, views)
            state[i] = entry
        return state

    def _load_fsdp_state(self, loaded: dict) -> None:
        """Adam's moments of FSDP2's shards from the pieces :meth:`_fsdp_sharded_state` asked for (this rank's
        rows only: each moment is read into a buffer of its local shard's size), as DTensors laid out as their
        parameters."""
        from h3t_training.loop.fsdp import from_local_like  # noqa: PLC0415
        buffers, self._fsdp_loading = self._fsdp_loading, {}
        for i, entry in loaded["state"].items():
            p = self.params[i]
            state = {"step": torch.tensor(float(self.steps), dtype=torch.float32)}
            for name in ("exp_avg", "exp_avg_sq"):
                data, views = buffers[i][name]
                for view, got in zip(views, entry[name]):
                    if got.data_ptr() != view.data_ptr():
                        view.copy_(got.view(view.shape))
                state[name] = from_local_like(data, p)
            self.adam.state[p] = state

    def load_sharded_state_dict(self, loaded: dict) -> None:
        """Install what :meth:`sharded_state_dict` loaded (bit-exact moments and step count)."""
        self.steps = int(loaded["steps"])
        if self.fsdp:
            self._load_fsdp_state(loaded)
            return
        for i, entry in loaded["state"].items():
            self._install(i, {"exp_avg": entry["exp_avg"], "exp_avg_sq": entry["exp_avg_sq"]})
        self.reload_model_params()

    def load_blocker(self) -> Optional[str]:
        """Why this optimizer's state cannot be loaded here, or None: this optimizer loads every checkpoint whose
        model it builds."""
        return None

    def _whole_moments(self) -> dict[int, dict[str, torch.Tensor]]:
        """Every parameter's Adam moments, whole and shaped as the parameter (none before the first step). With
        the distributed optimizer each rank holds slices: they are summed into zeros over the data-parallel group
        (one all-reduce; x + 0 is exact), so every rank gets them all (collective)."""
        if self.steps == 0:
            return {}
        if not self.sharded:
            return {i: {name: self._state(v)[name] for name in MOMENTS} for i, v in self.views.items()}
        sizes = [p.numel() for p in self.params]
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        flat = torch.zeros(len(MOMENTS), offsets[-1], dtype=torch.float32)  # the CPU path's Adam states are fp32
        for i, s in self.owned.items():
            held = self._state(self.views[i])
            for k, name in enumerate(MOMENTS):
                flat[k, offsets[i] + s.start:offsets[i] + s.end] = held[name].view(-1)
        flat = all_reduce_host(flat, group=self.dp_group)
        return {i: {name: flat[k, offsets[i]:offsets[i + 1]].view_as(p) for k, name in enumerate(MOMENTS)}
                for i, p in enumerate(self.params)}

    def _install(self, i: int, moments: dict) -> None:
        """Parameter ``i``'s whole moments, as saved: the part this rank steps (nothing where it steps none)."""
        if i not in self.owned:
            return
        s, view = self.owned[i], self.views[i]
        state = {"step": torch.tensor(float(self.steps), dtype=torch.float32),
                 **{k: v.reshape(-1)[s.start:s.end].clone().view_as(view) for k, v in moments.items()}}
        if self.host is not None and view in self.host.master:
            self.host.set_state(view, state)
        else:
            self.adam.state[view] = state

    def legacy_state_dict(self) -> dict:
        """The ``optimizer`` entry of a ``--ckpt-format torch`` file (:mod:`h3t_training.loop.legacy_checkpoint`):
        the step count, and every parameter's moments by index unless they are sharded over data-parallel ranks
        (then :meth:`save_parameter_state` writes them)."""
        assert not self.fsdp, "--ckpt-format torch with --use-torch-fsdp2 is refused with the flags"
        if self.sharded:
            return {"steps": self.steps}
        return {"steps": self.steps, "state": self._whole_moments()}

    def save_parameter_state(self, path: str) -> bool:
        """With the distributed optimizer, every parameter's moments put together from the ranks' slices, written
        by data-parallel rank 0 to ``path`` (megatron-core's name; collective over the data-parallel group); returns
        whether this rank wrote the file. Without it nothing (the moments are in :meth:`legacy_state_dict`)."""
        if not self.sharded:
            return False
        whole = self._whole_moments()
        if self.dp_rank != 0:
            return False
        torch.save({i: {k: v.clone() for k, v in m.items()} for i, m in whole.items()}, path)
        return True

    def load_legacy_state_dict(self, state: dict, parameter_state_path: Optional[str]) -> None:
        """Install what :meth:`legacy_state_dict` and :meth:`save_parameter_state` saved (this rank's share;
        bit-exact, at another data-parallel size too: every parameter's whole moments are in the file)."""
        self.steps = int(state["steps"])
        if "state" in state:
            moments = state["state"]
        elif parameter_state_path is not None and os.path.isfile(parameter_state_path):
            moments = torch.load(parameter_state_path, map_location="cpu", weights_only=False)
        else:
            raise RuntimeError(f"the distributed optimizer's state {parameter_state_path} is missing")
        for i in range(len(self.params)):
            if moments.get(i):
                self._install(i, moments[i])
        self.reload_model_params()

    def reload_model_params(self) -> None:
        """After a checkpoint loaded the model: the host partition's master copies from the parameters
        (megatron-core's name; the device side's master weights are the float32 parameters themselves)."""
        if self.host is not None:
            self.host.reload_model_params()

    def state_tensors(self) -> Iterator[tuple[str, str, torch.Tensor]]:
        """(category, placement, tensor) of the gradients and optimizer state this rank holds (the model's
        parameters are the caller's): the gradients of the parameters, Adam's moments and step counts of the
        device share; the host partition's gradient copies, master copies and states."""
        for p in self.params:
            if p.grad is not None:
                yield "grads", "device", p.grad
        if self.has_params:
            for state in self.adam.state.values():
                yield from (("optimizer", "device", v) for v in state.values() if isinstance(v, torch.Tensor))
        if self.host is not None:
            yield from ((category, "host", t) for category, t in self.host.tensors())


MOMENTS = ("exp_avg", "exp_avg_sq")
"""AdamW's per-element state (its step count is kept once, ``steps``)."""


def tied_embedding_weight(chunks, embedding_group, pipeline_group) -> Optional[torch.nn.Parameter]:
    """The word-embedding weight this rank holds a copy of when it is tied to the output layer and duplicated on
    the first and last pipeline stage (megatron-core's ``_allreduce_word_embedding_grads``: the first chunk of the
    first stage, the last chunk of the last stage), else None (one stage, untied, or a middle stage)."""
    if embedding_group is None or dist.get_world_size(embedding_group) == 1 or \
            dist.get_rank() not in dist.get_process_group_ranks(embedding_group):
        return None
    pp_rank, pp_size = dist.get_rank(pipeline_group), dist.get_world_size(pipeline_group)
    chunk = chunks[0] if pp_rank == 0 else chunks[-1] if pp_rank == pp_size - 1 else None
    if chunk is None or not getattr(chunk, "share_embeddings_and_output_weights", False):
        return None
    return chunk.shared_embedding_or_output_weight()


def _sharded_params(model_sharded_state_dicts: list) -> dict:
    """(storage pointer, shape) -> the model's ShardedTensor (or factory, e.g. a gated FC1 split
    over tensor-parallel ranks) of that parameter."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = {}
    for sd in model_sharded_state_dicts:
        for sh in nested_values(sd):
            if isinstance(sh, (ShardedTensor, ShardedTensorFactory)) and sh.data is not None:
                out[(sh.data.data_ptr(), tuple(sh.data.shape))] = sh
    return out


class MegatronOptimizerAdapter:
    """megatron-core's (distributed) optimizer behind the same step/zero_grad/state_dict calls (GPU)."""

    def __init__(self, chunks, args, tf_config):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from h3t_training.config.megatron_fields import optimizer_dtype_fields
        from h3t_training.loop.mcore_optimizer_limits import build_optimizer_config, require_transformer_engine
        from h3t_training.loop.optimizer_offload import optimizer_config_fields
        missing = require_transformer_engine(args)
        if missing:
            raise RuntimeError(missing)
        self.args, self.chunks = args, chunks
        cfg = build_optimizer_config(OptimizerConfig, dict(
            optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay, bf16=args.bf16,
            fp16=args.fp16, params_dtype=tf_config.params_dtype, adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
            use_distributed_optimizer=args.use_distributed_optimizer, loss_scale=args.loss_scale,
            initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
            loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis, decoupled_lr=args.decoupled_lr,
            log_num_zeros_in_grad=args.log_num_zeros_in_grad, decoupled_min_lr=args.decoupled_min_lr,
            **optimizer_config_fields(args), **optimizer_dtype_fields(args)))
        self.opt = get_megatron_optimizer(cfg, chunks)
        self.schedule = ParamSchedule.from_args(args)
        self.skipped = False
        """Whether the last step was skipped: with --fp16 an overflow skips it and lowers the loss scale
        (megatron-core's dynamic grad scaler, as in Megatron-LM)."""
        self.num_zeros_in_grad: Optional[float] = None
        """megatron-core's count of the last step's zero gradient elements, with --log-num-zeros-in-grad."""

    def get_loss_scale(self) -> float:
        scale = self.opt.get_loss_scale()
        return float(scale.item() if hasattr(scale, "item") else scale)

    def zero_grad(self) -> None:
        for c in self.chunks:
            c.zero_grad_buffer()
        self.opt.zero_grad()

    def step(self, iteration: int, num_steps: int, num_tokens: int = 0) -> tuple[float, Optional[float]]:
        # megatron-core's groups carry max_lr/min_lr (--decoupled-lr) and wd_mult (0: no decay); its
        # finalize_model_grads has divided the gradients by the batch's tokens already (--calculate-per-token-loss)
        lr = self.schedule.apply(self.opt.param_groups, num_steps)
        ok, norm, zeros = self.opt.step()
        self.skipped = not ok
        self.num_zeros_in_grad = zeros if self.args.log_num_zeros_in_grad else None
        return lr, norm

    def sharded_state_dict(self, model_sharded_state_dicts: list, *, is_loading: bool = False,
                           metadata: Optional[dict] = None) -> dict:
        """megatron-core's own sharded optimizer state (with the distributed optimizer: the fp32
        main weights and Adam moments of every shard), in its fully reshardable form; ``metadata``: the content
        metadata of a checkpoint Megatron-LM wrote, whose sharding type it reads (its default: dp_reshardable)."""
        model = {f"model{i}": sd for i, sd in enumerate(model_sharded_state_dicts)}
        if is_loading:
            self._materialize_state()
        return self.opt.sharded_state_dict(model, is_loading, metadata=metadata if metadata is not None else
                                           {"distrib_optim_sharding_type": "fully_reshardable"})

    def load_sharded_state_dict(self, loaded: dict) -> None:
        self.opt.load_state_dict(loaded)

    def load_blocker(self) -> Optional[str]:
        """Why this optimizer's state cannot be loaded here, or None
        (:func:`~h3t_training.loop.mcore_optimizer_limits.distributed_optimizer_load_blocker`)."""
        from h3t_training.loop.mcore_optimizer_limits import distributed_optimizer_load_blocker
        return distributed_optimizer_load_blocker(self.args)

    def legacy_state_dict(self) -> dict:
        """megatron-core's ``state_dict()``, as Megatron-LM's legacy save stores it."""
        return self.opt.state_dict()

    def save_parameter_state(self, path: str) -> bool:
        """With the distributed optimizer, megatron-core's ``save_parameter_state`` (gathered on data-parallel
        rank 0, which writes ``path``; collective); returns whether this rank wrote it."""
        if not self.args.use_distributed_optimizer:
            return False
        from megatron.core import parallel_state as ps
        self.opt.save_parameter_state(path)
        return ps.get_data_parallel_rank(with_context_parallel=True) == 0

    def load_legacy_state_dict(self, state: dict, parameter_state_path: Optional[str]) -> None:
        """megatron-core's ``load_state_dict`` and, with the distributed optimizer, ``load_parameter_state``,
        as Megatron-LM's legacy load calls them."""
        self._materialize_state()
        self.opt.load_state_dict(state)
        if self.args.use_distributed_optimizer:
            self.opt.load_parameter_state(parameter_state_path)

    def _materialize_state(self) -> None:
        """torch's Adam state (step 0, zero moments) for every parameter that has none yet, as its first step would
        make it. Without TransformerEngine or Apex, megatron-core's distributed optimizer steps torch's Adam and reads
        every parameter's ``step`` when it loads (``state_dict()`` first, then its own ``load_state_dict``), so a fresh
        optimizer could not load (Megatron-LM's runs have TE's FusedAdam, which keeps ``step`` per group). The
        load then overwrites these values."""
        for member in getattr(self.opt, "chained_optimizers", [self.opt]):
            inner = getattr(member, "optimizer", None)
            if not isinstance(inner, torch.optim.Adam):  # AdamW subclasses Adam; HybridDeviceOptimizer does its own
                continue
            for group in inner.param_groups:
                for p in group["params"]:
                    if not inner.state.get(p):
                        inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                          "exp_avg_sq": torch.zeros_like(p)}

    def reload_model_params(self) -> None:
        """After a checkpoint loaded the model without the optimizer: the fp32 main weights (host copies with
        --optimizer-cpu-offload) from the model's parameters, as Megatron-LM's load_checkpoint does."""
        self.opt.reload_model_params()

    def state_tensors(self) -> Iterator[tuple[str, str, torch.Tensor]]:
        """(category, placement, tensor) of what megatron-core holds: the DDP parameter and gradient buffers (or
        Megatron FSDP's, :data:`~h3t_training.loop.mcore_buffers.FSDP_BUFFERS`), the gradients, and every inner optimizer's parameters (fp32 main
        weights, host copies) and states;
        placement by the tensor's device (a CPU tensor of a GPU run is on the host)."""
        def place(t):
            return "device" if t.is_cuda else "host"
        for c in self.chunks:
            for buf in [*ddp_buffers(c, "buffers"), *ddp_buffers(c, "expert_parallel_buffers")]:
                if getattr(buf, "param_data", None) is not None:
                    yield "params", place(buf.param_data), buf.param_data
                yield "grads", place(buf.grad_data), buf.grad_data
            for category, t in fsdp_buffers(c):
                yield category, place(t), t
        for c in self.chunks:
            for p in c.parameters():
                for g in (getattr(p, "main_grad", None), p.grad):
                    if g is not None:
                        yield "grads", place(g), g
        for inner in _torch_optimizers(self.opt):
            for g in getattr(inner, "cpu_copy_map_grad", {}).values():  # HybridDeviceOptimizer's host grads
                yield "grads", place(g), g
            for group in inner.param_groups:
                yield from (("optimizer", place(p), p) for p in group["params"])
            for state in inner.state.values():
                yield from (("optimizer", place(v), v) for v in state.values() if isinstance(v, torch.Tensor))


def _torch_optimizers(opt) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers inside megatron-core's (chained, mixed-precision, distributed, hybrid) optimizer."""
    for member in getattr(opt, "chained_optimizers", [opt]):
        inner = getattr(member, "optimizer", None)
        if inner is None:
            continue
        yield inner
        yield from getattr(inner, "sub_optimizers", ())
