"""Single-process harness shared by the activation tests: a tiny GPTModel driven through one
pipeline rank's action list from the schedule builder (send/recv actions skipped)."""
from __future__ import annotations

import os
from typing import Optional

import torch

from h3t_ext.costmodel.specs import ModelSpec
from h3t_ext.schedule import ActionKind, build_schedule

HIDDEN, HEADS, GROUPS, FFN = 64, 4, 2, 128  # tiny_llama_config's sizes
VOCAB = 256


def init_single_process_megatron() -> None:
    """A world of one gloo rank with megatron-core's model-parallel state (idempotent)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        from h3t_ext.testing import free_port

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)


def _build(seed: int, num_layers: int, layers_only: bool, ckpt: Optional[str], **overrides):
    from h3t_ext.runtime.modules.gpt import build_gpt_model, local_layer_spec, tiny_llama_config

    torch.manual_seed(seed)
    cfg = tiny_llama_config(num_layers=num_layers, **overrides)
    stock = local_layer_spec() if ckpt is None else None
    return build_gpt_model(cfg, vocab_size=VOCAB, max_sequence_length=128, pre_process=not layers_only,
                           post_process=not layers_only, ckpt=ckpt or "no", layer_spec=stock, device_type="cpu")


def tiny_model(seed: int = 0, num_layers: int = 2, ckpt: Optional[str] = None, **overrides):
    """The whole tiny GPT (embedding, layers, output layer); ``ckpt=None``: megatron-core's stock local
    spec (no h3t modules), else the h3t layer spec of that ckpt."""
    return _build(seed, num_layers, False, ckpt, **overrides)


def tiny_model_spec(num_layers: int) -> ModelSpec:
    """The cost model's description of :func:`tiny_model`."""
    return ModelSpec("tiny", num_layers, HIDDEN, HEADS, GROUPS, FFN, VOCAB)


def rope_bytes(seq: int, dtype_bytes: int = 4) -> int:
    """Per layer: megatron's unfused RoPE saves cos and sin ([s,1,1,d]) for q and for k."""
    return 4 * seq * (HIDDEN // HEADS) * dtype_bytes


def batches(num_microbatches: int, micro_batch: int = 2, seq: int = 32, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_microbatches):
        ids = torch.randint(0, VOCAB, (micro_batch, seq), generator=g)
        pos = torch.arange(seq).unsqueeze(0).expand(micro_batch, seq)
        out.append((ids, pos))
    return out


def run_rank_schedule(model, data, mgr=None, *, pipeline_size: int = 4, rank: int = 0,
                      check_live: Optional[list] = None, offload_alphas: Optional[tuple[float, ...]] = None,
                      num_layers_per_chunk: Optional[int] = None):
    """Run one iteration in the order of ``rank``'s action list; return (losses, grads).

    With ``offload_alphas`` and ``num_layers_per_chunk`` the builder adds its layer-granular actions (pipeline size
    1): those that follow a compute action are handed to that action's forward or backward scope."""
    sched = build_schedule(pipeline_size, len(data), offload_alphas=offload_alphas,
                           num_layers_per_chunk=num_layers_per_chunk)
    acts = list(sched.ranks[rank])
    outputs, losses = {}, {}
    i = 0
    while i < len(acts):
        a, j = acts[i], i + 1
        while j < len(acts) and acts[j].layer is not None:
            j += 1
        inside, i = tuple(acts[i + 1:j]), j
        key = (a.microbatch, a.chunk)
        granular = num_layers_per_chunk is not None
        layer_kw = {"layer_actions": inside, "num_layers": num_layers_per_chunk} if granular else {}
        if a.kind is ActionKind.FORWARD:
            ids, pos = data[a.microbatch]
            if mgr is None:
                out = model(ids, pos, None)
            else:
                with mgr.forward_scope(*key, **layer_kw):
                    out = model(ids, pos, None)
            loss = out.float().pow(2).mean()
            outputs[key] = loss
            losses[a.microbatch] = loss.detach().clone()
            del out
        elif a.kind is ActionKind.BACKWARD:
            loss = outputs.pop(key)
            if mgr is None:
                loss.backward()
            else:
                with mgr.backward_scope(*key, **({"layer_actions": inside} if granular else {})):
                    loss.backward()
                del loss
                mgr.release(*key)
        elif a.kind is ActionKind.OFFLOAD and mgr is not None:
            mgr.offload(*key)
        elif a.kind is ActionKind.RELOAD and mgr is not None:
            mgr.reload(*key)
        if check_live is not None and mgr is not None and a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD):
            mgr.device.synchronize()
            check_live.append((mgr.resident_bytes, mgr.live_storage_bytes()))
    if mgr is not None:
        mgr.end_iteration()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return [losses[i] for i in sorted(losses)], grads


def middle_stage_model(seed: int = 0, num_layers: int = 2, ckpt: Optional[str] = None, **overrides):
    """A pipeline stage without embedding and loss: only transformer layers (what a middle rank holds);
    ``ckpt`` as in :func:`tiny_model`."""
    return _build(seed, num_layers, True, ckpt, **overrides)


def run_middle_stage(model, mgr, *, pipeline_size: int, rank: int, num_microbatches: int, micro_batch: int,
                     seq: int, hidden: int, seed: int = 3, check_live: Optional[list] = None, virtual_size: int = 1,
                     group_size: Optional[int] = None):
    """One iteration of ``rank``'s action list on a layers-only chunk fed with random stage inputs. With
    ``virtual_size`` v > 1 the list is interleaved 1F1B's (microbatch groups of ``group_size``) and ``model`` stands
    for each of the rank's v chunks (same layers, so the same saved bytes per microbatch-chunk)."""
    sched = build_schedule(pipeline_size, num_microbatches, virtual_size,
                           microbatch_group_size_per_vp_stage=group_size)
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(seq).unsqueeze(0).expand(micro_batch, seq)
    outputs, inputs, input_grads = {}, {}, {}
    for a in sched.ranks[rank]:
        key = (a.microbatch, a.chunk)
        if a.kind is ActionKind.FORWARD:
            x = torch.randn(seq, micro_batch, hidden, generator=g).requires_grad_()
            model.set_input_tensor(x)
            with mgr.forward_scope(*key):
                out = model(None, pos, None)
            outputs[key], inputs[key] = out.pow(2).mean(), x  # kept like an executor keeps received inputs
            del x, out
        elif a.kind is ActionKind.BACKWARD:
            loss = outputs.pop(key)
            with mgr.backward_scope(*key):
                loss.backward()
            del loss
            mgr.release(*key)
            input_grads[key] = inputs.pop(key).grad
        if check_live is not None and a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD):
            mgr.device.synchronize()
            check_live.append((mgr.resident_bytes, mgr.live_storage_bytes()))
        elif a.kind is ActionKind.OFFLOAD:
            mgr.offload(*key)
        elif a.kind is ActionKind.RELOAD:
            mgr.reload(*key)
    model.set_input_tensor(None)
    mgr.end_iteration()
    model.zero_grad(set_to_none=True)
    assert all(gr is not None and gr.shape == (seq, micro_batch, hidden) for gr in input_grads.values())
    return mgr.stats
