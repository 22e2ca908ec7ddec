"""Every table and figure of the ATC '24 artifact as plans, next to the cost model's predictions.

The published numbers (one copy each, under ``data/reference``):

* Figure 9, 41 rows of cluster tokens/s with the layout and alpha the authors' planner chose: the 15 Llama-65B
  rows are ``atc24_calibration.json`` ``throughput_table``, the 26 Llama2-70B and Llama-175B rows
  ``atc24_fig9_70b_175b.json``;
* Table 8, Llama-175B at seq 8192 on 256 GPUs, four methods (tokens/s per GPU and MFU; one out of memory):
  ``atc24_memory.json`` ``table8``;
* the 7B demo, scripts 1-4 on A800 and H800: ``atc24_calibration.json`` ``demo7b``;
* Figure 7, 22 points of ``max_memory_allocated`` against alpha (three out of memory): ``atc24_memory.json``.

Each row and point says what it was used for (``used_for``; empty = held out, the honest test):

* ``USE_EFFICIENCY_FIT``: the run is one of :func:`published.published_runs`, on which
  ``scripts/costmodel_calibration.py --fit`` fitted ``data/fitted_efficiencies.json`` (sources ``atc24_65b`` and
  ``atc24_demo7b``); found by comparing (model, plan, system), not by a list kept here.
* ``USE_ALPHA_BUDGET``: one of the ``atc24_65b`` runs whose 15 alphas chose the memory budget of
  ``run_settings.json`` (69.085 GB) that every predicted alpha here is solved against.
* ``USE_MEMORY_MODEL``: one of ``atc24_calibration.json``'s memory-versus-alpha points, the ones the memory model
  was built and checked on (:func:`calibration.calibration_report`). No memory term is fitted to a number.

Predictions: tokens/s and MFU at the published alpha (the simulated timeline, what ``estimate`` and ``h3t-plan``
report), and the closed form's tokens/s beside them (what the efficiencies were fitted on,
``fit.relative_errors``; on these cross-node interleaved pipelines the timeline is a few percent slower, DESIGN.md
"Timeline"); alpha solved with
``solve_offload_alpha(mode='auto')`` against the runs' own budget; the peak memory and the out-of-memory verdict
against the plan's default budget (``reserve.py``: HBM less the CUDA context, the NCCL buffers of the layout's
communicators and the allocator gap), which is what decides whether a run fits on the GPU. Pure arithmetic.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from h3t_ext.costmodel.calibration import memory_points, memory_verdict_runs, reference_model
from h3t_ext.costmodel.errors import InfeasiblePlanError
from h3t_ext.costmodel.estimate import estimate
from h3t_ext.costmodel.mfu import mfu
from h3t_ext.costmodel.offload import solve_offload_alpha
from h3t_ext.costmodel.plan import Plan
from h3t_ext.costmodel.published import atc24_memory_budget_bytes, published_runs, settings, stated_switches
from h3t_ext.costmodel.specs import ModelSpec, SystemSpec, get_system, reference_json

FIG9, TABLE8, DEMO7B, FIG7 = "Figure 9", "Table 8", "7B demo", "Figure 7"
TABLES = (FIG9, TABLE8, DEMO7B)
"""The throughput tables, in the artifact's order; Figure 7 is the memory figure."""
FIG9_FILES = ("atc24_calibration.json", "atc24_fig9_70b_175b.json")
"""Figure 9's rows: the Llama-65B ones (``throughput_table``) and the others (``rows``)."""
USE_EFFICIENCY_FIT = "efficiency fit"
USE_ALPHA_BUDGET = "alpha budget"
USE_MEMORY_MODEL = "memory model"
STOCK_MEGATRON = "origin-megatron"
"""Table 8's and the demo's stock Megatron-LM rows: full recompute, no alpha; priced as ckpt=full, alpha 0."""


@dataclass(frozen=True)
class ArtifactRow:
    """One published throughput row as a plan (alpha as published, 0 where none is given)."""

    table: str
    label: str
    model: ModelSpec
    plan: Plan
    system: SystemSpec
    published_alpha: Optional[float]
    """None: the artifact gives none (stock Megatron)."""
    published_tokens_per_s_per_gpu: Optional[float]
    """None: the run went out of memory."""
    printed_mfu: Optional[float]
    """MFU as the artifact prints it (Table 8, the demo); None where it prints tokens/s only (Figure 9)."""
    used_for: tuple[str, ...]

    @property
    def ran(self) -> bool:
        return self.published_tokens_per_s_per_gpu is not None

    @property
    def held_out(self) -> bool:
        return not self.used_for


@dataclass(frozen=True)
class ArtifactPoint:
    """One point of Figure 7: a plan and its measured ``max_memory_allocated`` (None: out of memory)."""

    label: str
    model: ModelSpec
    plan: Plan
    system: SystemSpec
    published_bytes: Optional[int]
    used_for: tuple[str, ...]

    @property
    def ran(self) -> bool:
        return self.published_bytes is not None

    @property
    def held_out(self) -> bool:
        return not self.used_for


def _run_switches(tensor_model_parallel_size: int) -> dict:
    """Plan switches of every ATC '24 run (TP comm overlap where t > 1, no DP overlap, ...): run_settings.json
    atc24_65b (:func:`~h3t_ext.costmodel.published.stated_switches`)."""
    return stated_switches(settings()["sources"]["atc24_65b"]["plan"], tensor_model_parallel_size)


@functools.lru_cache(maxsize=1)
def _fit_uses() -> dict[tuple[str, Plan, str, float], tuple[str, ...]]:
    """(model name, plan, system name, measured tokens/s per GPU) of every run the data file's efficiencies were
    fitted on, with its uses (the measurement is in the key: stock Megatron's demo row has the baseline's plan)."""
    out = {}
    for r in published_runs():
        uses = (USE_EFFICIENCY_FIT, USE_ALPHA_BUDGET) if r.source == "atc24_65b" else (USE_EFFICIENCY_FIT,)
        out[(r.model.name, r.plan, r.system.name, r.tokens_per_s_per_gpu)] = uses
    return out


def _row(table: str, label: str, model: ModelSpec, plan: Plan, system: SystemSpec, alpha: Optional[float],
         tokens_per_gpu: Optional[float], printed_mfu: Optional[float]) -> ArtifactRow:
    uses = _fit_uses().get((model.name, plan, system.name, tokens_per_gpu), ())
    return ArtifactRow(table, label, model, plan, system, alpha, tokens_per_gpu, printed_mfu, uses)


def figure9_rows() -> list[ArtifactRow]:
    """Figure 9's 41 rows (whole-cluster tokens/s as published, divided by the GPUs)."""
    h800 = get_system("h800")
    published = reference_json(FIG9_FILES[0])["throughput_table"] + reference_json(FIG9_FILES[1])["rows"]
    out = []
    for r in published:
        model = reference_model(r["model"])
        plan = Plan(num_gpus=int(r["num_gpus"]), seq_length=int(r["seq_length"]),
                    global_batch_size=int(r["global_batch"]), tensor_model_parallel_size=int(r["t"]),
                    context_parallel_size=int(r["c"]), pipeline_model_parallel_size=int(r["p"]),
                    num_layers_per_virtual_pipeline_stage=int(r["l"]), ckpt=r["ckpt"],
                    offload_alpha=float(r["alpha"]), **_run_switches(int(r["t"])))
        label = f"{r['model']} {r['num_gpus']} GPUs t{r['t']} c{r['c']} p{r['p']} l{r['l']} {r['ckpt']}"
        out.append(_row(FIG9, label, model, plan, h800, float(r["alpha"]),
                        float(r["tokens_per_s"]) / int(r["num_gpus"]), None))
    return out


def _method_rows(table: str, rows: Iterable[dict], label: Callable[[dict], str]) -> list[ArtifactRow]:
    """Table 8 / demo rows (per-GPU tokens/s and MFU as printed; stock Megatron as ckpt=full, alpha 0)."""
    out = []
    for r in rows:
        alpha = None if r["alpha"] is None else float(r["alpha"])
        plan = Plan(num_gpus=r["num_gpus"], seq_length=r["seq_length"], global_batch_size=r["global_batch_size"],
                    tensor_model_parallel_size=r["t"], context_parallel_size=r["c"],
                    pipeline_model_parallel_size=r["p"], num_layers_per_virtual_pipeline_stage=r["l"],
                    ckpt=r["ckpt"], offload_alpha=0.0 if alpha is None else alpha, **_run_switches(r["t"]))
        tokens = r["tokens_per_s_per_gpu"]
        out.append(_row(table, label(r), reference_model(r["model"]), plan, get_system(r.get("gpu", "h800")), alpha,
                        None if tokens is None else float(tokens), r["mfu"]))
    return out


def table8_rows() -> list[ArtifactRow]:
    """Table 8's four rows (Llama-175B, seq 8192, 256 H800); the ckpt=no one went out of memory."""
    return _method_rows(TABLE8, reference_json("atc24_memory.json")["table8"]["rows"],
                        lambda r: f"{r['method']} t{r['t']} c{r['c']} p{r['p']} l{r['l']} ckpt={r['ckpt']}")


def demo7b_rows() -> list[ArtifactRow]:
    """The 7B demo's six rows (4 GPUs, seq 12288; A800 and H800)."""
    return _method_rows(DEMO7B, reference_json("atc24_calibration.json")["demo7b"],
                        lambda r: f"{r['gpu']} {r['method']} ckpt={r['ckpt']}")


def figure7_points() -> list[ArtifactPoint]:
    """Figure 7's 22 points (ckpt ours and no, alpha 0 to 1), as ``calibration.memory_verdict_runs`` reads them."""
    calibration_plans = [plan for plan, _ in memory_points()]
    return [ArtifactPoint(r.label, r.model, r.plan, r.system, r.measured_bytes,
                          (USE_MEMORY_MODEL,) if r.plan in calibration_plans else ())
            for r in memory_verdict_runs() if r.label.startswith(FIG7)]


def artifact_rows() -> list[ArtifactRow]:
    """Every throughput row of the artifact: Figure 9, Table 8, the 7B demo."""
    return figure9_rows() + table8_rows() + demo7b_rows()


@dataclass(frozen=True)
class RowPrediction:
    row: ArtifactRow
    tokens_per_s_per_gpu: float
    """At the published alpha (0 where none), on the simulated timeline."""
    closed_form_tokens_per_s_per_gpu: float
    """The same plan priced by the closed form (``estimate(..., timeline=False)``), which the fit uses."""
    mfu: float
    published_mfu: Optional[float]
    """As printed, else from the published tokens/s with ``mfu.py``'s FLOPs (None: out of memory)."""
    alpha: Optional[float]
    """Smallest alpha under the runs' alpha budget (None: not even alpha 1 fits it)."""
    peak_memory_bytes: int
    """Largest stage peak at the published alpha."""
    memory_budget_bytes: int
    """The plan's default budget (``reserve.py``)."""
    fits: bool

    @property
    def error(self) -> Optional[float]:
        """Predicted over published tokens/s, minus 1 (None for a run that went out of memory)."""
        pub = self.row.published_tokens_per_s_per_gpu
        return None if pub is None else self.tokens_per_s_per_gpu / pub - 1.0

    @property
    def closed_form_error(self) -> Optional[float]:
        pub = self.row.published_tokens_per_s_per_gpu
        return None if pub is None else self.closed_form_tokens_per_s_per_gpu / pub - 1.0

    @property
    def alpha_error(self) -> Optional[float]:
        """Solved minus published alpha, for rows that ran with a given alpha (an out-of-memory row's alpha is
        the setting that failed, not a solver's answer)."""
        if self.alpha is None or self.row.published_alpha is None or not self.row.ran:
            return None
        return self.alpha - self.row.published_alpha

    @property
    def verdict_right(self) -> bool:
        """Predicted to fit exactly when it ran."""
        return self.fits == self.row.ran


@dataclass(frozen=True)
class PointPrediction:
    point: ArtifactPoint
    peak_memory_bytes: int
    memory_budget_bytes: int
    fits: bool

    @property
    def error(self) -> Optional[float]:
        pub = self.point.published_bytes
        return None if pub is None else self.peak_memory_bytes / pub - 1.0

    @property
    def verdict_right(self) -> bool:
        return self.fits == self.point.ran


def predict_row(row: ArtifactRow, alpha_budget_bytes: Optional[int] = None) -> RowPrediction:
    """The model's numbers for one row (alpha solved against ``alpha_budget_bytes``, default the runs' own)."""
    budget = atc24_memory_budget_bytes() if alpha_budget_bytes is None else alpha_budget_bytes
    est = estimate(row.model, row.plan, row.system)
    try:
        alpha = float(solve_offload_alpha(row.model, row.plan, row.system, memory_budget_bytes=budget, mode="auto"))
    except InfeasiblePlanError:
        alpha = None
    pub = row.printed_mfu
    if pub is None and row.ran:
        pub = mfu(row.model, row.plan.seq_length, row.published_tokens_per_s_per_gpu, row.system.peak_bf16_flops)
    closed = est.tokens_per_iteration / est.closed_form_time_s / est.num_gpus
    return RowPrediction(row, est.tokens_per_second_per_gpu, closed, est.mfu, pub, alpha, est.peak_memory_bytes,
                         est.memory_budget_bytes, est.fits)


def predict_point(point: ArtifactPoint) -> PointPrediction:
    est = estimate(point.model, point.plan, point.system, timeline=False)
    return PointPrediction(point, est.peak_memory_bytes, est.memory_budget_bytes, est.fits)


@dataclass(frozen=True)
class ErrorSummary:
    """Mean and largest absolute error of a group of rows."""

    group: str
    count: int
    mean_abs: Optional[float]
    max_abs: Optional[float]

    @classmethod
    def of(cls, group: str, errors: Iterable[Optional[float]]) -> "ErrorSummary":
        e = [abs(x) for x in errors if x is not None]
        return cls(group, len(e), sum(e) / len(e) if e else None, max(e) if e else None)

    def to_dict(self) -> dict:
        return {"group": self.group, "count": self.count, "mean_abs": self.mean_abs, "max_abs": self.max_abs}


CALIBRATION, HELD_OUT = "calibration rows", "held out"
"""Group names of the rows used for a fit (or to build the memory model) and of the others."""


def _groups(table: str, preds: list, model: Callable, held_out: Callable) -> list[tuple[str, list]]:
    """The table, then each model of it, then its calibration and held-out rows."""
    out = [(table, preds)]
    models = list(dict.fromkeys(model(p) for p in preds))
    if len(models) > 1:
        out += [(f"{table} / {m}", [p for p in preds if model(p) == m]) for m in models]
    used = [p for p in preds if not held_out(p)]
    if used:
        out += [(f"{table} / {CALIBRATION}", used), (f"{table} / {HELD_OUT}", [p for p in preds if held_out(p)])]
    return out


@dataclass(frozen=True)
class ArtifactReport:
    """Every row and point with its prediction, and the error summaries."""

    rows: tuple[RowPrediction, ...]
    points: tuple[PointPrediction, ...]

    def table(self, name: str) -> list[RowPrediction]:
        return [p for p in self.rows if p.row.table == name]

    @property
    def tokens_errors(self) -> list[ErrorSummary]:
        """tokens/s: per table, per model of the table, fitted-on and held-out rows."""
        return [ErrorSummary.of(g, (p.error for p in ps)) for t in TABLES
                for g, ps in _groups(t, self.table(t), lambda p: p.row.model.name, lambda p: p.row.held_out)]

    @property
    def closed_form_tokens_errors(self) -> list[ErrorSummary]:
        """The closed form's tokens/s, grouped as :attr:`tokens_errors`."""
        return [ErrorSummary.of(g, (p.closed_form_error for p in ps)) for t in TABLES
                for g, ps in _groups(t, self.table(t), lambda p: p.row.model.name, lambda p: p.row.held_out)]

    @property
    def mfu_errors(self) -> list[ErrorSummary]:
        """MFU, absolute (predicted minus published, in MFU units), per table."""
        return [ErrorSummary.of(t, (None if p.published_mfu is None else p.mfu - p.published_mfu
                                    for p in self.table(t))) for t in TABLES]

    @property
    def alpha_errors(self) -> list[ErrorSummary]:
        """Solved minus published alpha, where the artifact gives one, per table and model."""
        return [ErrorSummary.of(g, (p.alpha_error for p in ps)) for t in TABLES
                for g, ps in _groups(t, self.table(t), lambda p: p.row.model.name, lambda p: p.row.held_out)]

    @property
    def memory_errors(self) -> list[ErrorSummary]:
        """Figure 7 peaks: all measured points, per ckpt, and the memory model's own points against the rest."""
        groups = _groups(FIG7, list(self.points), lambda p: f"ckpt={p.point.plan.ckpt}", lambda p: p.point.held_out)
        return [ErrorSummary.of(g, (p.error for p in ps)) for g, ps in groups]

    @property
    def wrong_verdicts(self) -> list[str]:
        """Labels of rows and points predicted to fit that went out of memory, or the other way round."""
        return ([f"{p.row.table} {p.row.label}" for p in self.rows if not p.verdict_right]
                + [p.point.label for p in self.points if not p.verdict_right])

    def to_dict(self) -> dict:
        def row(p: RowPrediction) -> dict:
            r, plan = p.row, p.row.plan
            return {
                "table": r.table, "label": r.label, "model": r.model.name, "gpu": r.system.name,
                "num_gpus": plan.num_gpus, "seq_length": plan.seq_length, "global_batch_size": plan.global_batch_size,
                "tensor_model_parallel_size": plan.tensor_model_parallel_size,
                "context_parallel_size": plan.context_parallel_size,
                "pipeline_model_parallel_size": plan.pipeline_model_parallel_size,
                "num_layers_per_virtual_pipeline_stage": plan.num_layers_per_virtual_pipeline_stage,
                "ckpt": plan.ckpt, "used_for": list(r.used_for), "held_out": r.held_out,
                "published_alpha": r.published_alpha, "predicted_alpha": p.alpha, "alpha_error": p.alpha_error,
                "published_tokens_per_s_per_gpu": r.published_tokens_per_s_per_gpu,
                "predicted_tokens_per_s_per_gpu": p.tokens_per_s_per_gpu,
                "published_tokens_per_s": None if not r.ran else r.published_tokens_per_s_per_gpu * plan.num_gpus,
                "predicted_tokens_per_s": p.tokens_per_s_per_gpu * plan.num_gpus, "error": p.error,
                "closed_form_tokens_per_s_per_gpu": p.closed_form_tokens_per_s_per_gpu,
                "closed_form_error": p.closed_form_error,
                "published_mfu": p.published_mfu, "mfu_printed": r.printed_mfu is not None, "predicted_mfu": p.mfu,
                "published_out_of_memory": not r.ran, "predicted_peak_memory_bytes": p.peak_memory_bytes,
                "memory_budget_bytes": p.memory_budget_bytes, "predicted_fits": p.fits,
                "verdict_right": p.verdict_right,
            }

        def point(p: PointPrediction) -> dict:
            pt = p.point
            return {"label": pt.label, "ckpt": pt.plan.ckpt, "alpha": pt.plan.offload_alpha,
                    "used_for": list(pt.used_for), "held_out": pt.held_out, "published_bytes": pt.published_bytes,
                    "published_out_of_memory": not pt.ran, "predicted_bytes": p.peak_memory_bytes,
                    "memory_budget_bytes": p.memory_budget_bytes, "predicted_fits": p.fits, "error": p.error,
                    "verdict_right": p.verdict_right}

        return {
            "tables": {t: [row(p) for p in self.table(t)] for t in TABLES},
            "figure7": [point(p) for p in self.points],
            "tokens_per_s_error": [s.to_dict() for s in self.tokens_errors],
            "closed_form_tokens_per_s_error": [s.to_dict() for s in self.closed_form_tokens_errors],
            "mfu_error": [s.to_dict() for s in self.mfu_errors],
            "alpha_error": [s.to_dict() for s in self.alpha_errors],
            "memory_error": [s.to_dict() for s in self.memory_errors],
            "wrong_memory_verdicts": self.wrong_verdicts,
            "alpha_budget_bytes": atc24_memory_budget_bytes(),
        }


def artifact_report() -> ArtifactReport:
    """Predict every row and point of the artifact."""
    return ArtifactReport(tuple(predict_row(r) for r in artifact_rows()),
                          tuple(predict_point(p) for p in figure7_points()))
