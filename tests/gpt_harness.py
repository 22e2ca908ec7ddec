"""Shared pieces of the multi-process GPT tests: tiny model, data, reference run, stage loading.

The reference is the full model (all layers, one process) built from a seed; pipeline and
tensor-parallel stages are built separately and get the reference's weights by layer number
(``decoder.layers.i`` of a stage is global layer ``layer_number``) and by tensor-parallel shard.
"""
from __future__ import annotations

import contextlib
import re
from typing import Optional

import torch

VOCAB, SEQ, MBS, NUM_LAYERS, NUM_MICROBATCHES = 128, 32, 2, 8, 4


def model_config(tp: int = 1, pp: int = 1, v: int = 1, **overrides):
    from h3t_ext.runtime.modules.gpt import tiny_llama_config

    return tiny_llama_config(
        num_layers=NUM_LAYERS, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=v if v > 1 else None, **overrides,
    )


def make_batches(m: int = NUM_MICROBATCHES, seed: int = 1234) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(m):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
        out.append({
            "tokens": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "position_ids": torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ).contiguous(),
        })
    return out


def forward_step_func(data_iterator, model):
    from h3t_ext.runtime.modules.gpt import mean_loss_forward_step

    return mean_loss_forward_step(data_iterator, model)


def init_parallel(tp: int = 1, pp: int = 1, v: int = 1) -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=v if v > 1 else None,
    )


def build_stage(config, v: int = 1, ckpt: str = "no") -> list:
    """This rank's model chunks (pre/post process from the pipeline position), h3t spec of ``ckpt``."""
    from megatron.core import parallel_state as ps

    from h3t_ext.runtime.modules.gpt import build_stage_chunks

    assert (config.virtual_pipeline_model_parallel_size or 1) == v
    assert config.pipeline_model_parallel_size == ps.get_pipeline_model_parallel_world_size()
    return build_stage_chunks(config, vocab_size=VOCAB, max_sequence_length=SEQ,
                              pipeline_rank=ps.get_pipeline_model_parallel_rank(), ckpt=ckpt, device_type="cpu")


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def reference_name(chunk, name: str) -> str:
    """Name in the full model of parameter ``name`` of a stage chunk."""
    match = _LAYER.match(name)
    if not match:
        return name
    number = chunk.decoder.layers[int(match.group(1))].layer_number
    return f"decoder.layers.{number - 1}." + name[match.end():]


def shard(ref_name: str, full: torch.Tensor, shape: torch.Size, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This tensor-parallel rank's slice of a full-model tensor."""
    if tuple(full.shape) == tuple(shape):
        return full
    if ref_name.endswith("mlp.linear_fc1.weight"):  # gated: [gate; up], each split separately
        gate, up = full.chunk(2, dim=0)
        return torch.cat([shard(ref_name + ".half", t, (shape[0] // 2,) + tuple(shape[1:]), tp_rank, tp_size)
                          for t in (gate, up)], dim=0)
    dims = [d for d in range(full.dim()) if full.shape[d] != shape[d]]
    assert len(dims) == 1 and full.shape[dims[0]] == tp_size * shape[dims[0]], (ref_name, full.shape, shape)
    d = dims[0]
    return full.narrow(d, tp_rank * shape[d], shape[d])


def load_reference(chunks: list, ref_state: dict) -> None:
    from megatron.core import parallel_state as ps

    tr, ts = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                ref = reference_name(chunk, name)
                p.copy_(shard(ref, ref_state[ref], p.shape, tr, ts))


def compare_grads(chunks: list, ref_grads: dict) -> tuple[bool, float, int]:
    """(all bitwise equal, max abs difference, number of parameters compared)."""
    from megatron.core import parallel_state as ps

    tr, ts = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    exact, worst, n = True, 0.0, 0
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            ref = reference_name(chunk, name)
            expected = shard(ref, ref_grads[ref], p.shape, tr, ts)
            got = p.grad if p.grad is not None else torch.zeros_like(p)
            exact = exact and torch.equal(got, expected)
            diff = (got - expected).abs().max().item()
            worst = max(worst, diff if diff == diff else float("inf"))  # a NaN is the worst difference
            n += 1
    return exact, worst, n


def reference_run(seed: int = 0, m: int = NUM_MICROBATCHES, ckpt_full: bool = False, **overrides) -> dict:
    """Full model in this (single) process: state, per-microbatch losses, gradients of loss/m."""
    from h3t_ext.runtime.modules.gpt import build_gpt_model

    init_parallel()
    torch.manual_seed(seed)
    model = build_gpt_model(model_config(**overrides), vocab_size=VOCAB, max_sequence_length=SEQ,
                            ckpt="full" if ckpt_full else "no", device_type="cpu")
    state = {k: v.detach().clone() for k, v in model.named_parameters()}
    losses = []
    it = iter(make_batches(m))
    torch.manual_seed(seed + 1)
    for _ in range(m):
        out, loss_func = forward_step_func(it, model)
        loss, info = loss_func(out)
        (loss / m).backward()
        losses.append(info["lm loss"])
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    return {"state": state, "losses": losses, "grads": grads}


class RecordingManager:
    """Stand-in activation manager: records the executor's calls and checks their order."""

    def __init__(self, alpha: float):
        self.alpha = alpha
        self.state: dict[tuple, str] = {}
        self.events: list[tuple] = []
        self.suspend_depth = 0
        self.iterations = 0

    def _move(self, key, expect: tuple, new: str, what: str):
        got = self.state.get(key)
        assert got in expect, f"{what}{key}: state {got}, expected one of {expect}"
        self.state[key] = new
        self.events.append((what,) + key)

    @contextlib.contextmanager
    def forward_scope(self, mb, chunk):
        self._move((mb, chunk), (None,), "in_fwd", "forward_scope")
        yield
        self._move((mb, chunk), ("in_fwd",), "fwd_done", "forward_end")

    def offload(self, mb, chunk):
        self._move((mb, chunk), ("fwd_done",), "offloaded", "offload")

    def reload(self, mb, chunk):
        self._move((mb, chunk), ("offloaded",), "reloading", "reload")

    @contextlib.contextmanager
    def backward_scope(self, mb, chunk):
        self._move((mb, chunk), ("fwd_done", "reloading"), "in_bwd", "backward_scope")
        yield
        self._move((mb, chunk), ("in_bwd",), "bwd_done", "backward_end")

    def release(self, mb, chunk):
        self._move((mb, chunk), ("bwd_done",), None, "release")
        del self.state[(mb, chunk)]

    @contextlib.contextmanager
    def suspended(self):
        self.suspend_depth += 1
        self.events.append(("suspended",))
        yield
        self.suspend_depth -= 1

    def end_iteration(self):
        assert not self.state, f"microbatch-chunks not released at end of iteration: {sorted(self.state)}"
        self.iterations += 1

    @property
    def stats(self) -> dict:
        return {"offloads": sum(e[0] == "offload" for e in self.events)}


def recording_factory(config, pipeline_rank: int, pipeline_size: int, device) -> Optional[RecordingManager]:
    return RecordingManager(config.stage_alpha(pipeline_rank, pipeline_size))
