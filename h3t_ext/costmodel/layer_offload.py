"""Layer-granular activation offload at pipeline size 1, priced: resident bytes, PCIe bytes, exposed copy time.

At p = 1 no microbatch has a compute action between its forward and its backward, so the schedule builder
offloads layer by layer (:mod:`h3t_ext.schedule.builder`; the rule of which layers, and how much of each, is
:func:`h3t_ext.schedule.actions.layer_offload_fractions`, fractions f_l of a layer's bytes, f_{L-1} = 0). With
L layers of a = A / L saved bytes each (A: one microbatch's, :func:`memory.chunk_activation_bytes`):

* **memory** (what the runtime's manager holds, :mod:`h3t_ext.runtime.memory.activations`): one microbatch is
  held at a time; its peak is at the end of its forward, when layers 0 .. L-3 have been offloaded and dropped
  (layer l's bytes go when layer l+2's forward starts; layer L-2's copy still overlaps layer L-1's forward).
  Saved bytes there: A - a * sum_{l <= L-3} f_l. The reload buffers, two slots of one layer each, are allocated
  at the microbatch's first reload and freed when its backward ends, so they add to that peak only what the
  backward has not freed by then: the first reload (of the last offloaded layer j) starts when layer j+1's backward
  does, after layers j+2 .. L-1 have freed theirs, which covers both slots unless j = L-2. Then the slot takes
  the place of layer L-2's dropped f_{L-2} a, and the backward holds (1 - f_{L-2}) a more than the forward's end
  (one slot of a whole layer; the second comes once layer L-1's a is freed). At the embedding's backward, after
  layer 0's, one slot (layer 0's) is still held;
* **PCIe**: sum_l f_l * a each way per microbatch (at most (L-1)/L of A: the last layer never offloads);
* **time**: layer l's copy to the host starts when layer l+1's forward starts and hides behind it; its copy
  back starts when layer l+1's backward starts and hides behind it; copies in one direction run one after the
  other on their stream. A layer's backward waits for its reload: that wait, when a copy is longer than the
  compute it hides behind, is the exposed part (``offload_exposed``), :func:`exposed_seconds_per_microbatch`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from h3t_ext.costmodel.collectives import host_copy_seconds
from h3t_ext.schedule.actions import layer_offload_fractions


@dataclass(frozen=True)
class LayerOffload:
    """What one alpha means at pipeline size 1 for a chunk of ``num_layers`` layers (fractions of A)."""

    num_layers: int
    fractions: tuple[float, ...]
    """Per layer, the fraction of its saved bytes copied to the host (the schedule's one rule)."""

    @property
    def offloaded(self) -> float:
        """Fraction of a microbatch's saved bytes copied to the host (and back)."""
        return sum(self.fractions) / self.num_layers

    @property
    def resident(self) -> float:
        """Saved bytes on the device at the peak (end of the forward), as a fraction of A."""
        return 1.0 - sum(self.fractions[:max(0, self.num_layers - 2)]) / self.num_layers

    @property
    def reload_buffer(self) -> float:
        """What the reload slots (one layer each, allocated in the backward) add to the peak, as a fraction of A:
        (1 - f_{L-2}) / L when layer L-2 is offloaded, else 0 (module docstring)."""
        last = self.fractions[self.num_layers - 2] if self.num_layers >= 2 else 0.0
        return (1.0 - last) / self.num_layers if last > 0 else 0.0

    @property
    def embedding_slot(self) -> float:
        """The reload slot held at the embedding's backward (layer 0's), as a fraction of A; 0 when layer 0 stays."""
        return 1.0 / self.num_layers if self.fractions and self.fractions[0] > 0 else 0.0


def layer_offload(alpha: float, num_layers: int) -> LayerOffload:
    return LayerOffload(num_layers, layer_offload_fractions(alpha, num_layers))


def layers_per_chunk(model, plan) -> Optional[int]:
    """Layers of the one model chunk when the plan's offload is layer-granular (pipeline size 1), else None."""
    if plan.pipeline_model_parallel_size != 1:
        return None
    return plan.stage_layers(model.num_layers, 0)


def exposed_seconds_per_microbatch(lo: LayerOffload, layer_bytes: float, layer_forward_s: float,
                                   layer_backward_s: float, head_s: float, copy_seconds) -> float:
    """Seconds one microbatch's backward waits for its layers' reloads (module docstring). ``copy_seconds``:
    bytes -> seconds of one host<->device copy; ``head_s``: the output layer's forward and backward, between
    the last layer's forward and its backward."""
    L = lo.num_layers
    d2h, off_end = 0.0, {}
    for l, f in enumerate(lo.fractions):
        if f > 0:  # issued when layer l+1's forward starts
            d2h = off_end[l] = max(d2h, (l + 1) * layer_forward_s) + copy_seconds(f * layer_bytes)
    t = L * layer_forward_s + head_s  # layer L-1's backward starts
    h2d = stall = 0.0
    for k in range(L - 1, 0, -1):  # layer k's backward; the reload of layer k-1 hides behind it
        end_k = t + layer_backward_s
        f = lo.fractions[k - 1]
        if f > 0:
            h2d = max(h2d, off_end[k - 1], t) + copy_seconds(f * layer_bytes)
            if h2d > end_k:
                stall += h2d - end_k
                end_k = h2d
        t = end_k
    return stall


@dataclass(frozen=True)
class OffloadTraffic:
    """The PCIe traffic of layer-granular offload and what it hides behind (``h3t-plan estimate --explain``)."""

    offloaded_layers: int
    """Layers with an offload/reload pair (of ``num_layers``)."""
    num_layers: int
    bytes_per_microbatch: int
    """Bytes copied to the host per microbatch (the same back)."""
    layer_copy_bytes: int
    """Bytes of the largest one-layer copy."""
    layer_copy_s: float
    """Seconds of that copy at the system's PCIe rate."""
    next_forward_s: float
    """The layer forward a layer's offload hides behind."""
    next_backward_s: float
    """The layer backward a layer's reload hides behind."""
    exposed_per_microbatch_s: float
    """Seconds a microbatch's backward waits for reloads."""

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def p1_traffic(layer_time, head_s: float, chunk_bytes: float, layers: int, alpha: float, system) -> OffloadTraffic:
    """:class:`OffloadTraffic` of a pipeline-size-1 plan (arguments as :func:`p1_exposed_seconds`)."""
    lo = layer_offload(alpha, layers)
    largest = max(lo.fractions) * chunk_bytes / layers
    return OffloadTraffic(
        offloaded_layers=sum(f > 0 for f in lo.fractions), num_layers=layers,
        bytes_per_microbatch=int(lo.offloaded * chunk_bytes), layer_copy_bytes=int(largest),
        layer_copy_s=host_copy_seconds(largest, system), next_forward_s=layer_time.forward_action,
        next_backward_s=layer_time.backward_action,
        exposed_per_microbatch_s=p1_exposed_seconds(layer_time, head_s, chunk_bytes, layers, alpha, system))


def p1_exposed_seconds(layer_time, head_s: float, chunk_bytes: float, layers: int, alpha: float, system) -> float:
    """:func:`exposed_seconds_per_microbatch` of a pipeline-size-1 plan: ``layer_time`` is the cost model's
    per-layer record (``timing.LayerTime``: its forward and backward actions), the copies at the system's PCIe
    rate (``collectives.host_copy_seconds``)."""
    return exposed_seconds_per_microbatch(layer_offload(alpha, layers), chunk_bytes / layers, layer_time.forward_action,
                                          layer_time.backward_action, head_s, lambda b: host_copy_seconds(b, system))


__all__ = ["LayerOffload", "OffloadTraffic", "exposed_seconds_per_microbatch", "layer_offload", "layers_per_chunk",
           "p1_exposed_seconds", "p1_traffic"]
