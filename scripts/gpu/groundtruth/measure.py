"""Timing the cases of ``cases.py`` with PyTorch: CUDA events around the work, warm-up runs first, the median
of the repeats; on CPU (``--device cpu --smoke``) the same code with wall-clock marks and no streams.

What runs for each kind:

* GEMM (bf16): ``torch.mm`` with the operand layouts of a linear layer (forward X W^T, data gradient dY W,
  weight gradient X^T dY); the weight gradient as ``torch.addmm(main_grad, X^T, dY, out_dtype=float32)``
  (bf16 inputs, fp32 accumulation buffer read and written: Megatron's gradient-accumulation fusion) where this
  PyTorch has it, else a bf16 ``torch.mm`` (the case's ``out_bytes`` then says bf16).
  FP8: ``torch._scaled_mm`` on E4M3 operands (A row-major, B column-major: cuBLASLt's FP8 "TN" layout, the
  transposes TransformerEngine's cast-transpose makes), per-tensor fp32 scales, bf16 output (fp32 for the
  weight gradient); fast accumulation in the forward, split accumulation in the backward GEMMs (as
  TransformerEngine's ``use_split_accumulator``).
* attention: ``scaled_dot_product_attention(is_causal=True)`` under ``sdpa_kernel([backend])``, with
  ``enable_gqa`` where K/V have fewer heads; the backward is ``torch.autograd.grad`` of a fresh forward.
* element-wise: ``F.rms_norm`` / ``F.layer_norm`` (with weight; LayerNorm with bias), a residual add, the
  activation (SwiGLU as ``F.glu``: the same traffic in one kernel as Megatron's fused bias-SwiGLU, which
  plain PyTorch lacks; GeLU with the tanh approximation), backward through ``torch.autograd.grad``; the cross
  entropy as the kernel sequence megatron-core 0.16.1's vocab-parallel cross entropy runs at t = 1
  (``elementwise.CROSS_ENTROPY_KERNELS_FWD`` / ``_BWD`` describe it).
* copies: ``copy_(non_blocking=True)`` between a pinned host buffer and the GPU on a side stream; "during" a
  GEMM (or a GEMM during copies) the other work is queued first on the other stream, long enough (by the
  model's times) to cover the timed one twice.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

from groundtruth.cases import HEAD_START_S, AttentionCase, Case, CopyCase, ElementwiseCase, ExpertGemmCase, GemmCase, \
    op_parts
from h3t_ext.costmodel.kernels import linear_pass_gemm
from h3t_ext.dtypes import BF16
from h3t_ext.costmodel.specs import SystemSpec


class _WallEvent:
    """A CPU stand-in for ``torch.cuda.Event``: CPU work is synchronous, so a wall-clock mark is its end."""

    def __init__(self):
        self.t = 0.0

    def record(self, stream=None):
        self.t = time.perf_counter()

    def elapsed_time(self, end: "_WallEvent") -> float:
        return (end.t - self.t) * 1e3


class Device:
    """CUDA (events, a side stream for copies, pinned host memory) or CPU (wall clock, no streams)."""

    def __init__(self, name: str):
        import torch

        self.name, self.torch = name, torch
        self.device = torch.device(name)
        self.cuda = name == "cuda"
        self.side = torch.cuda.Stream() if self.cuda else None
        self.main = torch.cuda.current_stream() if self.cuda else None

    def event(self):
        return self.torch.cuda.Event(enable_timing=True) if self.cuda else _WallEvent()

    def on(self, stream):
        return self.torch.cuda.stream(stream) if self.cuda and stream is not None else contextlib.nullcontext()

    def head_start(self) -> None:
        """Queue ``HEAD_START_S`` of GPU sleep on the current stream (nothing on CPU, whose work is synchronous)."""
        if self.cuda:
            self.torch.cuda._sleep(int(HEAD_START_S * SLEEP_CYCLES_PER_S))

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def host(self, nbytes: int):
        """A host buffer: pinned on CUDA (the offload path's), pageable on CPU (no pinned allocator there)."""
        return self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=self.cuda)

    def randn(self, *shape, dtype=None):
        return self.torch.randn(*shape, device=self.device, dtype=dtype or self.torch.bfloat16)


SLEEP_CYCLES_PER_S = 2.0e9
"""Cycles ``torch.cuda._sleep`` spins per second: about the SM clock of a Hopper GPU (1.98 GHz boost); the head
start only has to outlast the dispatch, so a lower clock just makes it longer."""


def time_calls(dev: Device, fn: Callable, *, warmup: int, repeats: int, setup: Optional[Callable] = None,
               before: Optional[Callable] = None, stream=None) -> list[float]:
    """Seconds of ``fn(setup())`` on ``stream`` for each repeat after ``warmup`` untimed runs; ``before()`` runs
    first each time (queues concurrent work on the other stream). On CUDA the timed work is queued behind a
    ``HEAD_START_S`` sleep so that the events time the kernels, not the host's dispatch of them. Synchronizes after
    every run."""
    samples = []
    for i in range(warmup + repeats):
        arg = setup() if setup is not None else None
        if before is not None:
            before()
        start, end = dev.event(), dev.event()
        with dev.on(stream):
            dev.head_start()
            start.record(stream)
            fn(arg)
            end.record(stream)
        dev.sync()
        if i >= warmup:
            samples.append(start.elapsed_time(end) / 1e3)
        del arg
    return samples


@dataclass(frozen=True)
class Capabilities:
    """What this PyTorch on this device can run, probed once on tiny shapes (the reason where not)."""

    fp8: Optional[str]
    """None where ``torch._scaled_mm`` E4M3 runs, else why not."""
    fp32_accumulate: bool
    """``torch.addmm(..., out_dtype=torch.float32)`` on bf16 operands runs."""


def probe(dev: Device) -> Capabilities:
    torch = dev.torch
    fp8: Optional[str] = None
    if not dev.cuda:
        fp8 = "FP8 GEMMs (torch._scaled_mm) need CUDA: skipped on CPU"
    else:
        try:
            a = torch.zeros(32, 32, device=dev.device).to(torch.float8_e4m3fn)
            one = torch.ones((), device=dev.device)
            torch._scaled_mm(a, a.t(), one, one, out_dtype=torch.bfloat16)
        except (RuntimeError, AttributeError, TypeError) as e:
            fp8 = f"torch._scaled_mm E4M3 does not run here: {str(e).strip().splitlines()[0][:160]}"
    try:
        a = dev.randn(32, 32)
        torch.addmm(torch.zeros(32, 32, device=dev.device), a, a, out_dtype=torch.float32)
        acc = True
    except (RuntimeError, TypeError, NotImplementedError):
        acc = False
    return Capabilities(fp8=fp8, fp32_accumulate=acc)


# ---------------------------------------------------------------------------------------------- GEMMs
_LAYOUT = {"fwd": (False, True), "dgrad": (False, False), "wgrad": (True, False)}
"""(A stored transposed, B stored transposed) of each pass: forward X[M,K] W[N,K]^T, data gradient dY W,
weight gradient X^T dY."""


def _operand(dev: Device, rows: int, cols: int, transposed: bool, dtype=None):
    return dev.randn(cols, rows, dtype=dtype).t() if transposed else dev.randn(rows, cols, dtype=dtype)


def gemm_runner(dev: Device, case: GemmCase, caps: Capabilities) -> tuple[Callable, GemmCase]:
    """A function running the case's GEMM once, and the case as run (its ``out_bytes`` where it differs)."""
    torch = dev.torch
    gm, gn, gk = case.gemm
    if case.fp8:
        a = dev.randn(gm, gk).to(torch.float8_e4m3fn)
        b = dev.randn(gn, gk).to(torch.float8_e4m3fn).t()  # column-major [K, N]
        one = torch.ones((), device=dev.device)
        out = torch.float32 if case.out_bytes == 4 else torch.bfloat16
        fast = case.pass_ == "fwd"
        return (lambda _: torch._scaled_mm(a, b, one, one, out_dtype=out, use_fast_accum=fast)), case
    a_t, b_t = _LAYOUT[case.pass_]
    a, b = _operand(dev, gm, gk, a_t), _operand(dev, gk, gn, b_t)
    if case.pass_ == "wgrad" and case.out_bytes is None:
        if caps.fp32_accumulate:
            acc = torch.zeros(gm, gn, device=dev.device, dtype=torch.float32)
            return (lambda _: torch.addmm(acc, a, b, out_dtype=torch.float32)), case
        case = dataclasses.replace(case, out_bytes=BF16)
    return (lambda _: torch.mm(a, b)), case


def measure_experts(dev: Device, case: ExpertGemmCase, warmup: int, repeats: int) -> list[float]:
    """The local experts' GEMMs of one pass as one ``torch.bmm`` (``kernels.linear_pass_gemm``'s shapes, batched)."""
    gm, gn, gk = linear_pass_gemm(case.pass_, case.m, case.n, case.k)
    a, b = dev.randn(case.experts, gm, gk), dev.randn(case.experts, gk, gn)
    return time_calls(dev, lambda _: dev.torch.bmm(a, b), warmup=warmup, repeats=repeats, stream=dev.main)


def _cover(covered_s: float, unit_s: float) -> int:
    """Units of the concurrent work (``unit_s`` each) that outlast the head start and twice the timed work."""
    return max(1, math.ceil((HEAD_START_S + 2.0 * covered_s) / max(unit_s, 1e-9)))


def measure_gemm(dev: Device, case: GemmCase, caps: Capabilities, system: SystemSpec, warmup: int, repeats: int,
                 copy: Optional[CopyCase] = None) -> tuple[list[float], GemmCase]:
    fn, case = gemm_runner(dev, case, caps)
    before = None
    if case.during_copy:
        copy = copy or CopyCase("h2d", 256 << 20)
        host, devbuf = dev.host(copy.nbytes), dev.torch.empty(copy.nbytes, dtype=dev.torch.uint8, device=dev.device)
        n = _cover(case.predict(system), copy.predict(system))

        def queue_copies():
            with dev.on(dev.side):
                for i in range(n):
                    (devbuf.copy_(host, non_blocking=True) if i % 2 == 0 else host.copy_(devbuf, non_blocking=True))
        before = queue_copies
    return time_calls(dev, fn, warmup=warmup, repeats=repeats, before=before, stream=dev.main), case


# ---------------------------------------------------------------------------------------------- attention
def measure_attention(dev: Device, case: AttentionCase, warmup: int, repeats: int) -> list[float]:
    torch = dev.torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[case.backend]
    grad_needed = case.pass_ == "bwd"
    q = dev.randn(case.batch, case.heads, case.seq, case.head_dim).requires_grad_(grad_needed)
    k, v = (dev.randn(case.batch, case.kv_heads, case.seq, case.head_dim).requires_grad_(grad_needed)
            for _ in range(2))
    gqa = {"enable_gqa": True} if case.kv_heads != case.heads else {}

    def forward(_=None):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)

    with sdpa_kernel([backend]):
        if not grad_needed:
            with torch.no_grad():
                return time_calls(dev, forward, warmup=warmup, repeats=repeats)
        dout = dev.randn(case.batch, case.heads, case.seq, case.head_dim)
        return time_calls(dev, lambda o: torch.autograd.grad(o, (q, k, v), dout), setup=forward, warmup=warmup,
                          repeats=repeats)


# ---------------------------------------------------------------------------------------------- element-wise
def _cross_entropy_forward(torch, logits, target):
    """megatron-core 0.16.1's vocab-parallel cross entropy forward at t = 1, kernel by kernel (the vocabulary
    range of the one rank is [0, V)): returns the loss and what the backward keeps."""
    v = logits.shape[-1]
    x = logits.float()
    x.sub_(x.max(dim=-1)[0].unsqueeze(-1))
    mask = (target < 0) | (target >= v)
    masked = target.clone() - 0
    masked[mask] = 0
    rows = torch.arange(x.shape[0], device=x.device)
    predicted = x[rows, masked].clone().contiguous()
    predicted[mask] = 0.0
    torch.exp(x, out=x)
    total = x.sum(dim=-1)
    loss = torch.log(total) - predicted
    x.div_(total.unsqueeze(-1))
    return loss, (x, mask, masked)


def _cross_entropy_backward(torch, saved, grad_loss):
    softmax, mask, masked = saved
    rows = torch.arange(softmax.shape[0], device=softmax.device)
    update = 1.0 - mask.view(-1).float()
    softmax[rows, masked] -= update
    softmax.mul_(grad_loss.unsqueeze(-1))
    return softmax.to(torch.bfloat16)


def measure_elementwise(dev: Device, case: ElementwiseCase, warmup: int, repeats: int) -> list[float]:
    torch = dev.torch
    import torch.nn.functional as F

    op, backward = op_parts(case.op)
    n, w = case.tokens, case.width
    if op == "cross_entropy":
        logits = dev.randn(n, w)
        target = torch.randint(0, w, (n,), device=dev.device)
        if not backward:
            return time_calls(dev, lambda _: _cross_entropy_forward(torch, logits, target), warmup=warmup,
                              repeats=repeats)
        grad = torch.ones(n, device=dev.device)
        return time_calls(dev, lambda saved: _cross_entropy_backward(torch, saved, grad),
                          setup=lambda: _cross_entropy_forward(torch, logits, target)[1], warmup=warmup,
                          repeats=repeats)
    if op == "residual_add":
        a, b = dev.randn(n, w), dev.randn(n, w)
        return time_calls(dev, lambda _: torch.add(a, b), warmup=warmup, repeats=repeats)
    in_width = 2 * w if op == "swiglu" else w
    x = dev.randn(n, in_width).requires_grad_(backward)
    weight = torch.ones(w, device=dev.device, dtype=torch.bfloat16, requires_grad=backward)
    bias = torch.zeros(w, device=dev.device, dtype=torch.bfloat16, requires_grad=backward)
    kernel = {"rmsnorm": lambda: F.rms_norm(x, (w,), weight, eps=1e-5),
              "layernorm": lambda: F.layer_norm(x, (w,), weight, bias, eps=1e-5),
              "swiglu": lambda: F.glu(x, dim=-1),
              "gelu": lambda: F.gelu(x, approximate="tanh")}[op]
    if not backward:
        with torch.no_grad():
            return time_calls(dev, lambda _: kernel(), warmup=warmup, repeats=repeats)
    inputs = {"rmsnorm": (x, weight), "layernorm": (x, weight, bias)}.get(op, (x,))
    dy = dev.randn(n, w)
    return time_calls(dev, lambda y: torch.autograd.grad(y, inputs, dy), setup=kernel, warmup=warmup, repeats=repeats)


# ---------------------------------------------------------------------------------------------- copies
def measure_copy(dev: Device, case: CopyCase, caps: Capabilities, system: SystemSpec, warmup: int, repeats: int,
                 gemm: Optional[GemmCase] = None) -> list[float]:
    torch = dev.torch
    host, devbuf = dev.host(case.nbytes), torch.empty(case.nbytes, dtype=torch.uint8, device=dev.device)
    dst, src = (devbuf, host) if case.direction == "h2d" else (host, devbuf)
    before = None
    if case.during_gemm:
        gemm_case = dataclasses.replace(gemm, during_copy=False)
        run, gemm_case = gemm_runner(dev, gemm_case, caps)
        n = _cover(case.predict(system), gemm_case.predict(system))

        def queue_gemms():
            with dev.on(dev.main):
                for _ in range(n):
                    run(None)
        before = queue_gemms
    return time_calls(dev, lambda _: dst.copy_(src, non_blocking=True), warmup=warmup, repeats=repeats,
                      before=before, stream=dev.side)


# ---------------------------------------------------------------------------------------------- one case
@dataclass(frozen=True)
class Outcome:
    """One case's result: the case as run, its status and the timed repeats."""

    case: Case
    status: str
    """``measured``, ``skipped`` (cannot run here / over the budget) or ``failed`` (an error, kept going)."""
    samples: tuple[float, ...] = ()
    why: str = ""

    @property
    def median_s(self) -> Optional[float]:
        return statistics.median(self.samples) if self.samples else None


def measure(dev: Device, case: Case, caps: Capabilities, system: SystemSpec, warmup: int, repeats: int,
            partner: Optional[GemmCase] = None) -> Outcome:
    """Time one case (``partner``: the GEMM that runs beside a copy ``during_gemm``); errors become a
    ``failed`` outcome with the error's first line, so one case cannot stop the run."""
    torch = dev.torch
    try:
        if isinstance(case, GemmCase):
            if case.fp8 and caps.fp8:
                return Outcome(case, "skipped", why=caps.fp8)
            samples, case = measure_gemm(dev, case, caps, system, warmup, repeats)
        elif isinstance(case, ExpertGemmCase):
            samples = measure_experts(dev, case, warmup, repeats)
        elif isinstance(case, AttentionCase):
            if case.backend == "cudnn" and not dev.cuda:
                return Outcome(case, "skipped", why="cuDNN attention needs CUDA: skipped on CPU")
            samples = measure_attention(dev, case, warmup, repeats)
        elif isinstance(case, ElementwiseCase):
            samples = measure_elementwise(dev, case, warmup, repeats)
        else:
            samples = measure_copy(dev, case, caps, system, warmup, repeats, gemm=partner)
    except (RuntimeError, ValueError, TypeError) as e:  # torch.cuda.OutOfMemoryError is a RuntimeError
        status = "skipped" if "No available kernel" in str(e) or "No viable backend" in str(e) else "failed"
        return Outcome(case, status, why=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}")
    finally:
        if dev.cuda:
            torch.cuda.synchronize()
    return Outcome(case, "measured", tuple(samples))
