"""What the ground-truth run measures: one frozen record per measurement, each priced by the cost model's own
function for exactly that work (``h3t_ext/costmodel``; nothing is restated here), and the subset that fits
the time budget.

Kinds (``KINDS``):

* ``gemm``: one pass (``kernels.LINEAR_PASSES``: forward, data gradient, weight gradient) of one linear layer
  (QKV, projection, FC1, FC2: ``timing.layer_gemm_shapes``; the output layer: ``timing.output_layer_gemm_shape``)
  of a zoo model at tensor-parallel size t and micro-batch tokens, in BF16 or FP8; priced by
  ``kernels.linear_pass_seconds``. The BF16 weight gradient accumulates into an fp32 buffer as Megatron's
  gradient-accumulation fusion does (``out_bytes`` None: the model's own wgrad pricing); where the GPU's
  PyTorch cannot (``torch.addmm(..., out_dtype=float32)`` missing) it writes bf16 and ``out_bytes`` says so.
  The FP8 weight gradient (``torch._scaled_mm``) writes a plain fp32 output: ``out_bytes`` = 4.
  ``during_copy``: the same GEMM while pinned host<->device copies run on another stream.
* ``attention``: PyTorch SDPA (``backend`` flash or cuDNN), causal, forward or backward, priced by
  ``kernels.flash_attention_seconds`` (GQA does not change the model's price; the measurement says if it
  should).
* ``elementwise``: one kernel (or the short kernel sequence Megatron runs) as HBM traffic, priced by the
  per-kernel rules of ``costmodel/elementwise.py``.
* ``copy``: one pinned host<->device copy, alone or while a GEMM runs on another stream, priced by
  ``collectives.host_copy_seconds`` (the model assumes no interference either way).
* ``experts``: one pass of a MoE layer's expert FC1 or FC2 over a rank's local experts as one batched GEMM (what
  ``--moe-grouped-gemm`` runs; measured with ``torch.bmm``), the shapes of ``moe.expert_shapes`` for a zoo MoE model
  at an expert-parallel size and local tokens, priced by ``moe.grouped_pass_seconds`` (the weight gradient writes
  bf16: ``out_bytes`` 2).

Every case names the efficiency it identifies (``efficiency_key``): the one its predicted time is most
sensitive to among the candidates of its kind (a memory-bound GEMM identifies ``hbm_fraction``, not the GEMM
rate).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar, Optional, Union

from h3t_ext.costmodel import elementwise as ew
from h3t_ext.costmodel import moe
from h3t_ext.costmodel.collectives import host_copy_seconds
from h3t_ext.costmodel.kernels import (
    LINEAR_PASSES,
    flash_attention_flops,
    flash_attention_seconds,
    kernel_rates,
    linear_pass_gemm,
    linear_pass_seconds,
)
from h3t_ext.costmodel.plan import Plan
from h3t_ext.costmodel.specs import ModelSpec, SystemSpec, get_model
from h3t_ext.costmodel.timing import LAYER_GEMMS, layer_gemm_shapes, output_layer_gemm_shape
from h3t_ext.dtypes import BF16, FP32

KINDS = ("copy", "elementwise", "attention", "experts", "gemm")
"""Measured in this order: the fixed, short lists first, then GEMMs in priority order (a run stopped by
the budget loses the least informative GEMMs)."""
GEMM_MODELS = ("llama2-7b", "llama2-70b", "gpt3-175b")
"""The 7B, 70B (GQA) and 175B (GeLU, tied embeddings) of the zoo."""
GEMM_LAYERS = LAYER_GEMMS + ("output",)
TENSOR_PARALLEL = (1, 2, 4, 8)
TOKENS = (2048, 4096, 8192, 16384)
PRECISIONS = ("bf16", "fp8")
ATTENTION_BACKENDS = ("flash", "cudnn")
ATTENTION_TOKENS = 16384
"""Tokens per attention call (micro batch = this / sequence length), so every sequence length does alike work."""
ATTENTION_HIDDEN = 4096
"""Query heads x head dim of the attention cases (heads = this / head dim: 32 x 128 as Llama 7B)."""
GQA_GROUP = 8
"""Query heads per key/value head with GQA (Llama 2 70B: 64 / 8)."""
COPY_BYTES = 256 << 20
"""One offload copy: large enough (~5 ms at PCIe 5.0) that launch and synchronization are noise."""
HEAD_START_S = 1e-3
"""GPU time queued before the start event of every timed repeat (``torch.cuda._sleep``): the host dispatches the
work while the GPU still sleeps, so the events time the kernels as a training loop runs them, back to back behind
a host that is ahead. Without it an idle GPU waits for the first kernel's dispatch (Python, the PyTorch
dispatcher, cuBLAS's heuristics): 16-23 us per isolated GEMM on the H200 of 2026-11-28 (the constant term of
t = c + 2MNK/R over its 1,296 GEMM rows), which the cost model rightly does not price. 1 ms covers the dispatch
of one autograd backward; work that takes longer to dispatch still shows part of it."""
CASE_OVERHEAD_S = 0.03
"""Per case, beside the kernels: allocating and filling operands, one synchronization per repeat, Python."""
STARTUP_S = 20.0
"""CUDA context, cuBLAS/cuDNN handles and the first kernels' loading, before the first case."""
BUDGET_SAFETY = 2.0
"""The selection keeps its estimate under budget / this: the model's times may be off, and a run that
overshoots is stopped at the budget anyway (rows left ``skipped``)."""


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _replace_efficiency(system: SystemSpec, key: str, value: float) -> SystemSpec:
    return dataclasses.replace(system, efficiencies=MappingProxyType({**system.efficiencies, key: value}))


@dataclass(frozen=True)
class GemmCase:
    kind: ClassVar[str] = "gemm"
    model: str
    layer: str
    pass_: str
    precision: str
    t: int
    tokens: int
    m: int
    n: int
    k: int
    """The linear layer X[m, k] -> Y[m, n] (the pass's GEMM: ``kernels.linear_pass_gemm``)."""
    out_bytes: Optional[int] = None
    """Bytes per output element where the measured GEMM writes something else than the model's pass does."""
    during_copy: bool = False

    @property
    def fp8(self) -> bool:
        return self.precision == "fp8"

    @property
    def gemm(self) -> tuple[int, int, int]:
        return linear_pass_gemm(self.pass_, self.m, self.n, self.k)

    @property
    def name(self) -> str:
        extra = " during copies" if self.during_copy else ""
        return f"{self.model} {self.layer} {self.pass_} {self.precision} t{self.t} {_tokens(self.tokens)}{extra}"

    @property
    def work(self) -> float:
        gm, gn, gk = self.gemm
        return 2.0 * gm * gn * gk

    work_unit: ClassVar[str] = "flop"

    def predict(self, system: SystemSpec) -> float:
        return linear_pass_seconds(self.pass_, self.m, self.n, self.k, kernel_rates(system), fp8=self.fp8,
                                   out_bytes=self.out_bytes)

    def candidates(self) -> tuple[str, ...]:
        return ("gemm_fp8_peak_fraction" if self.fp8 else "gemm_peak_fraction", "hbm_fraction")

    def group(self) -> str:
        return f"gemm {self.precision}" + (" during copies" if self.during_copy else "")


@dataclass(frozen=True)
class AttentionCase:
    kind: ClassVar[str] = "attention"
    backend: str
    pass_: str
    seq: int
    head_dim: int
    heads: int
    kv_heads: int
    batch: int

    @property
    def name(self) -> str:
        gqa = f" gqa {self.heads}/{self.kv_heads}" if self.kv_heads != self.heads else ""
        return f"sdpa {self.backend} {self.pass_} s{self.seq} d{self.head_dim} b{self.batch}{gqa}"

    @property
    def work(self) -> float:
        return flash_attention_flops(self.batch * self.heads, self.seq, self.seq, self.head_dim, causal=True,
                                     backward=self.pass_ == "bwd")

    work_unit: ClassVar[str] = "flop"

    @property
    def kernel(self) -> str:
        """The cost model's kernel of this SDPA backend: cuDNN's is the fused attention TransformerEngine runs."""
        return "fused" if self.backend == "cudnn" else "flash"

    def predict(self, system: SystemSpec) -> float:
        return flash_attention_seconds(self.batch * self.heads, self.seq, self.seq, self.head_dim,
                                       kernel_rates(system), causal=True, backward=self.pass_ == "bwd",
                                       kernel=self.kernel)

    def candidates(self) -> tuple[str, ...]:
        # the fused kernel's own rate where the family has it measured (efficiency_key keeps those it has)
        return ("fused_attention_gemm_ratio", "attention_peak_fraction") if self.kernel == "fused" \
            else ("attention_peak_fraction",)

    def group(self) -> str:
        return f"attention {self.backend}" + (" gqa" if self.kv_heads != self.heads else "")


@dataclass(frozen=True)
class ExpertGemmCase:
    kind: ClassVar[str] = "experts"
    model: str
    layer: str
    pass_: str
    ep: int
    tokens: int
    """Local tokens T of the rank (its experts run T k of them)."""
    experts: int
    m: int
    n: int
    k: int
    """Each local expert's linear layer X[m, k] -> Y[m, n] (m: its share of the T k token copies)."""
    out_bytes: int = BF16
    """Bytes per output element of the measured GEMM (``torch.bmm`` writes bf16, the weight gradient too)."""

    @property
    def name(self) -> str:
        return f"{self.model} experts {self.layer} {self.pass_} ep{self.ep} {_tokens(self.tokens)} x{self.experts}"

    @property
    def work(self) -> float:
        return 2.0 * self.experts * self.m * self.n * self.k

    work_unit: ClassVar[str] = "flop"

    def predict(self, system: SystemSpec) -> float:
        return moe.grouped_pass_seconds(self.pass_, self.m, self.n, self.k, self.experts, kernel_rates(system),
                                        out_bytes=self.out_bytes)

    def candidates(self) -> tuple[str, ...]:
        return ("gemm_peak_fraction", "hbm_fraction")

    def group(self) -> str:
        return "experts bf16"


ELEMENTWISE_OPS = ("rmsnorm_fwd", "rmsnorm_bwd", "layernorm_fwd", "layernorm_bwd", "residual_add", "swiglu_fwd",
                   "swiglu_bwd", "gelu_fwd", "gelu_bwd", "cross_entropy_fwd", "cross_entropy_bwd")


def op_parts(op: str) -> tuple[str, bool]:
    """(kernel, backward) of an element-wise op name: ``rmsnorm_bwd`` -> (``rmsnorm``, True)."""
    if op.endswith(("_fwd", "_bwd")):
        return op[:-4], op.endswith("_bwd")
    return op, False


@dataclass(frozen=True)
class ElementwiseCase:
    kind: ClassVar[str] = "elementwise"
    op: str
    model: str
    tokens: int
    width: int
    """h for norms and adds, f for the activation (its FC1 is 2f wide with SwiGLU), the padded vocabulary
    for the cross entropy."""

    @property
    def name(self) -> str:
        return f"{self.op} {self.model} {_tokens(self.tokens)} x {self.width}"

    @property
    def work(self) -> float:
        """Bytes the kernel moves by the model's rule: the predicted time at zero launch cost x HBM rate."""
        return self.predict(None)

    work_unit: ClassVar[str] = "byte"

    def predict(self, system: Optional[SystemSpec]) -> float:
        """Seconds on ``system``; with None, the bytes (a unit HBM rate and no launch cost)."""
        from h3t_ext.costmodel.kernels import KernelRates

        r = kernel_rates(system) if system is not None else KernelRates(
            sms=1, tile_m=1, tile_n=1, tile_overhead_k=0, sm_flops=1, fp8_sm_flops=1, attention_flops=1,
            head_dim_overhead=0, attention_backward_fraction=1.0, dropout_fwd_slowdown=0, dropout_bwd_slowdown=0,
            hbm=1.0, launch_s=0.0)
        op, backward = op_parts(self.op)
        if op in ("rmsnorm", "layernorm"):
            return ew.norm_seconds(self.tokens, self.width, r, backward=backward)
        if op == "residual_add":
            return ew.residual_add_seconds(self.tokens, self.width, r)
        if op == "swiglu":
            return ew.activation_seconds(self.tokens, 2 * self.width, self.width, r, backward=backward)
        if op == "gelu":
            return ew.activation_seconds(self.tokens, self.width, self.width, r, backward=backward)
        if op == "cross_entropy":
            return ew.cross_entropy_seconds(self.tokens, self.width, r, backward=backward)
        raise ValueError(f"unknown element-wise op {self.op!r} (valid: {', '.join(ELEMENTWISE_OPS)})")

    def candidates(self) -> tuple[str, ...]:
        return ("hbm_fraction",)

    def group(self) -> str:
        return "elementwise " + ("cross entropy" if self.op.startswith("cross") else "kernels")


@dataclass(frozen=True)
class CopyCase:
    kind: ClassVar[str] = "copy"
    direction: str
    """``h2d`` (reload) or ``d2h`` (offload)."""
    nbytes: int
    during_gemm: bool = False

    @property
    def name(self) -> str:
        return f"pinned {self.direction} {self.nbytes / (1 << 20):g} MiB" + (" during GEMM" if self.during_gemm else "")

    @property
    def work(self) -> float:
        return float(self.nbytes)

    work_unit: ClassVar[str] = "byte"

    def predict(self, system: SystemSpec) -> float:
        return host_copy_seconds(self.nbytes, system)

    def candidates(self) -> tuple[str, ...]:
        return ("pcie_fraction",)

    def group(self) -> str:
        return "copy" + (" during GEMM" if self.during_gemm else " alone")


Case = Union[ExpertGemmCase, GemmCase, AttentionCase, ElementwiseCase, CopyCase]
_CASE_TYPES = {c.kind: c for c in (GemmCase, AttentionCase, ElementwiseCase, CopyCase, ExpertGemmCase)}


def case_to_dict(case: Case) -> dict:
    return {"kind": case.kind, **dataclasses.asdict(case)}


def case_from_dict(d: dict) -> Case:
    """The case a report's row describes (``case_to_dict``); ValueError naming the field otherwise."""
    kind = d.get("kind")
    if kind not in _CASE_TYPES:
        raise ValueError(f"case field 'kind' must be one of {', '.join(KINDS)}, got {kind!r}")
    cls = _CASE_TYPES[kind]
    names = {f.name for f in dataclasses.fields(cls)}
    missing = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.name not in d]
    if missing:
        raise ValueError(f"{kind} case lacks field(s) {', '.join(sorted(missing))}")
    return cls(**{k: v for k, v in d.items() if k in names})


def efficiency_key(case: Case, system: SystemSpec) -> str:
    """The efficiency the case's predicted time is most sensitive to (relative change for a 10% change)."""
    cands = tuple(k for k in case.candidates() if k in system.efficiencies)
    if len(cands) == 1:
        return cands[0]
    base = case.predict(system)

    def sensitivity(key: str) -> float:
        return abs(case.predict(_replace_efficiency(system, key, 1.1 * system.efficiency(key))) - base)

    return max(cands, key=sensitivity)


def implied_efficiency(case: Case, system: SystemSpec, key: str, measured_s: float) -> Optional[float]:
    """The value of efficiency ``key`` with which the model prices ``case`` at ``measured_s`` (bisection on the
    model's own prediction, which falls as the efficiency grows); None when no value in (0.001, 2] does (a
    launch-bound kernel, or a measurement faster than the model at any rate)."""
    lo, hi = 1e-3, 2.0

    def f(x: float) -> float:
        return case.predict(_replace_efficiency(system, key, x)) - measured_s

    if f(lo) < 0 or f(hi) > 0:
        return None
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        if f(mid) > 0:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


# ---------------------------------------------------------------------------------------------- catalogue
def _spread_pairs() -> list[tuple[int, int]]:
    """All (t, tokens) pairs, ordered as a Latin square: every four consecutive pairs cover each t and each
    token count once, so any prefix samples both axes evenly."""
    out = []
    for r in range(len(TOKENS)):
        for j, t in enumerate(TENSOR_PARALLEL):
            out.append((t, TOKENS[(r + 3 * j + 1) % len(TOKENS)]))
    return out


def _plan(t: int, tokens: int) -> Plan:
    return Plan(num_gpus=t, seq_length=tokens, global_batch_size=1, micro_batch_size=1, tensor_model_parallel_size=t)


def gemm_cases(models: tuple[ModelSpec, ...], pairs: list[tuple[int, int]]) -> list[GemmCase]:
    """Every layer, pass and precision of ``models`` at each (t, tokens) pair, pair by pair."""
    out = []
    for t, tokens in pairs:
        plan = _plan(t, tokens)
        for spec in models:
            shapes = {**layer_gemm_shapes(spec, plan), "output": output_layer_gemm_shape(spec, plan)}
            for layer in GEMM_LAYERS:
                m, n, k = shapes[layer]
                for precision in PRECISIONS:
                    if layer == "output" and precision == "fp8":
                        continue  # megatron-core's own ColumnParallelLinear: BF16 under --fp8-format too
                    for pass_ in LINEAR_PASSES:
                        out_bytes = FP32 if (precision == "fp8" and pass_ == "wgrad") else None
                        out.append(GemmCase(spec.name, layer, pass_, precision, t, tokens, m, n, k, out_bytes))
    return out


EXPERT_LAYOUTS = (("mixtral-8x7b", 8, 4096), ("mixtral-8x7b", 2, 4096), ("qwen3-235b-a22b", 8, 2048),
                  ("qwen3-235b-a22b", 32, 2048))
"""(model, ep, local tokens) of the expert GEMM cases: one expert a rank and four (Mixtral 8x7B, t = 1 at sequence
4096), sixteen and four (Qwen3-235B-A22B, t = 2 at sequence 4096: the published runs' layouts)."""


def expert_cases(layouts=EXPERT_LAYOUTS, models: Optional[dict] = None) -> list[ExpertGemmCase]:
    """FC1 and FC2, every pass, of each (model, ep, tokens) (``moe.expert_shapes``; etp 1)."""
    out = []
    for name, ep, tokens in layouts:
        spec = (models or {}).get(name) or get_model(name)
        plan = Plan(num_gpus=ep, seq_length=tokens, global_batch_size=ep, expert_model_parallel_size=ep,
                    expert_tensor_parallel_size=1)
        shapes = moe.expert_shapes(spec, plan)
        for layer, (n, k) in (("fc1", shapes.fc1), ("fc2", shapes.fc2)):
            for pass_ in LINEAR_PASSES:
                out.append(ExpertGemmCase(spec.name, layer, pass_, ep, tokens, shapes.experts, shapes.tokens, n, k))
    return out


def attention_cases(seqs=(2048, 4096, 8192, 16384), head_dims=(64, 128), tokens=ATTENTION_TOKENS,
                    hidden=ATTENTION_HIDDEN, backends=ATTENTION_BACKENDS) -> list[AttentionCase]:
    out = []
    for backend in backends:
        for seq in seqs:
            for d in head_dims:
                heads = hidden // d
                for kv in (heads, heads // GQA_GROUP):
                    for pass_ in ("fwd", "bwd"):
                        out.append(AttentionCase(backend, pass_, seq, d, heads, max(1, kv), max(1, tokens // seq)))
    return out


def elementwise_cases(models: tuple[ModelSpec, ...], tokens=(2048, 16384)) -> list[ElementwiseCase]:
    out = []
    for spec in models:
        act = "swiglu" if spec.swiglu else "gelu"
        for n in tokens:
            h = spec.hidden_size
            for op in ELEMENTWISE_OPS:
                if op.startswith(("swiglu", "gelu")) and not op.startswith(act):
                    continue
                width = (spec.ffn_hidden_size if op.startswith(act) else
                         spec.padded_vocab_size(1) if op.startswith("cross") else h)
                out.append(ElementwiseCase(op, spec.name, n, width))
    return out


def copy_cases(nbytes: int = COPY_BYTES) -> list[CopyCase]:
    return [CopyCase(d, nbytes, g) for g in (False, True) for d in ("h2d", "d2h")]


GEMM_DURING_COPY = ("llama2-70b", "fc1", 1, 8192)
"""The GEMM measured while copies run (and that runs beside the copies ``during_gemm``): a large one."""


def gemm_during_copy_case(spec: ModelSpec, t: int, tokens: int) -> GemmCase:
    m, n, k = layer_gemm_shapes(spec, _plan(t, tokens))["fc1"]
    return GemmCase(spec.name, "fc1", "fwd", "bf16", t, tokens, m, n, k, during_copy=True)


SMOKE_MODEL = ModelSpec(name="smoke", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=4,
                        ffn_hidden_size=176, vocab_size=500)
"""Tiny shapes for ``--smoke`` (the code paths, not the timings)."""
SMOKE_MOE = dataclasses.replace(SMOKE_MODEL, name="smoke-moe", num_experts=4, moe_router_topk=2)
"""... and of its expert GEMMs."""


@dataclass(frozen=True)
class Selection:
    """The cases of one run: ``selected`` in measurement order, ``left_out`` by the budget, and how."""

    selected: tuple[Case, ...]
    left_out: tuple[Case, ...]
    gemm_pairs: tuple[tuple[int, int], ...]
    """(t, tokens) pairs whose GEMMs were kept (every model, layer, pass and precision of each)."""
    estimate_s: float
    budget_s: float
    description: str


def case_cost_s(case: Case, system: SystemSpec, warmup: int, repeats: int) -> float:
    """Estimated wall time of measuring ``case``: every repeat and warm-up of the work (and of what a backward
    needs run before it, or what runs beside a concurrent copy), plus the per-case overhead."""
    t = case.predict(system)
    if isinstance(case, AttentionCase) and case.pass_ == "bwd":
        t += dataclasses.replace(case, pass_="fwd").predict(system)
    if isinstance(case, ElementwiseCase) and op_parts(case.op)[1]:
        t *= 2
    if isinstance(case, (CopyCase,)) and case.during_gemm or isinstance(case, GemmCase) and case.during_copy:
        t *= 3
    return (warmup + repeats) * (t + HEAD_START_S) + CASE_OVERHEAD_S


def select(system: SystemSpec, budget_s: float, warmup: int, repeats: int, smoke: bool = False) -> Selection:
    """The fixed lists (copies, element-wise, attention, the GEMM under copies) and as many (t, tokens) pairs
    of GEMMs, in ``_spread_pairs`` order, as keep the estimate under budget / ``BUDGET_SAFETY``."""
    if smoke:
        models = (SMOKE_MODEL,)
        pairs = [(1, 32), (2, 64)]
        fixed: list[Case] = [*copy_cases(1 << 16), *elementwise_cases(models, tokens=(32,)),
                             *expert_cases(((SMOKE_MOE.name, 2, 32),), {SMOKE_MOE.name: SMOKE_MOE}),
                             *attention_cases(seqs=(32, 64), head_dims=(16,), tokens=64, hidden=64,
                                              backends=ATTENTION_BACKENDS),
                             gemm_during_copy_case(SMOKE_MODEL, 1, 32)]
    else:
        models = tuple(get_model(m) for m in GEMM_MODELS)
        pairs = _spread_pairs()
        spec, _, t, tokens = GEMM_DURING_COPY
        fixed = [*copy_cases(), *elementwise_cases(models), *attention_cases(), *expert_cases(),
                 gemm_during_copy_case(get_model(spec), t, tokens)]
    allowed = budget_s / BUDGET_SAFETY
    estimate = STARTUP_S + sum(case_cost_s(c, system, warmup, repeats) for c in fixed)
    kept, left, kept_pairs = list(fixed), [], []
    for pair in pairs:
        block = gemm_cases(models, [pair])
        cost = sum(case_cost_s(c, system, warmup, repeats) for c in block)
        if estimate + cost <= allowed and len(left) == 0:
            kept.extend(block)
            kept_pairs.append(pair)
            estimate += cost
        else:
            left.extend(block)
    n_gemm = sum(isinstance(c, GemmCase) and not c.during_copy for c in kept)
    desc = (f"GEMMs of {', '.join(m.name for m in models)} (QKV, projection, FC1, FC2, output layer; forward, dgrad, "
            f"wgrad; BF16 and FP8, the output layer BF16 only) at (t, tokens) = "
            f"{', '.join(f'({t}, {n})' for t, n in kept_pairs) or 'none'}: {n_gemm} of {n_gemm + len(left)} GEMM "
            f"rows ({len(left)} left out by --budget-s {budget_s:g}: estimate {estimate:.0f} s of "
            f"{allowed:.0f} s allowed = budget / {BUDGET_SAFETY:g})")
    kept.sort(key=lambda c: KINDS.index(c.kind))  # stable: GEMMs keep their pair order
    return Selection(tuple(kept), tuple(left), tuple(kept_pairs), estimate, budget_s, desc)
