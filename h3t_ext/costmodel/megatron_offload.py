"""Megatron-LM's activation offload requests as h3t-ext's one offload fraction alpha.

Megatron-LM (megatron-core 0.19) has two activation offloads; h3t-ext has one, ``--offload-alpha``: the first
alpha of each microbatch-chunk's saved bytes in save order (layer by layer at pipeline size 1,
:func:`h3t_ext.schedule.actions.layer_offload_fractions`). Each Megatron request maps to the alpha that moves
the same saved bytes:

* **fine-grained** (``--fine-grained-activation-offloading --offload-modules M ...``,
  ``megatron/core/pipeline_parallel/fine_grained_activation_offload.py``): every listed module of every layer is
  an offload *group*; the tensors autograd saves during that module's forward go to the host when they have at
  least ``--min-offloaded-tensor-size`` elements. ``--activation-offload-fraction F`` keeps the first F of the
  eligible groups of a chunk (forward order) offloaded: over a chunk of identical layers that is F of the
  listed modules' bytes. So

      alpha = F * (bytes of the listed modules' saved tensors that pass the size filter) / (the layer's saved bytes)

  with the bytes of the cost model's per-tensor terms (:func:`~h3t_ext.costmodel.activations.
  activation_bytes_per_layer_token`) over the rank's tokens. Which terms a module's group saves depends on the
  layer spec (:data:`MODULE_TERMS`): with TransformerEngine's spec the norms are fused into the next linear
  (``attn_norm``/``mlp_norm`` are IdentityOp and Megatron skips them; the QKV group holds the fused norm's input,
  rstd and output). Flash attention's output is saved by the core attention and again by the projection: its
  bytes leave the device only when both ``core_attn`` and ``attn_proj`` are offloaded. Dense GPT has no
  MLP-side module in Megatron's list, so the MLP's saved tensors stay.
  Left out: Megatron's rounding of F to whole groups and its margin (the last group of each module in the
  first chunk of backward stays; h3t-ext's last layer never offloads either).
* **layer** (``--cpu-offloading-num-layers N``, TransformerEngine's ``get_cpu_offload_context``): the activations
  of the first N of the L layers go to the host: alpha = N / L (h3t-ext's layer rule moves layers 0 .. N-1
  whole). megatron-core's TransformerConfig allows it only at pipeline size 1, N < L, without recompute.

Every refusal is a :class:`MegatronOffloadError` (a ``ValueError``) of one line naming the flag and the reason.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from h3t_ext.costmodel.activations import REPLICATED_WITHOUT_SP, activation_bytes_per_layer_token, \
    layer_kept_bytes, local_tokens, mlp_activation_impl, unfused_scores_bytes_per_layer
from h3t_ext.costmodel.recompute import plan_recompute, selective_terms
from h3t_ext.costmodel.specs import ModelSpec
from h3t_ext.dtypes import BF16, BOOL

MEGATRON_OFFLOAD_SOURCE = ("https://github.com/NVIDIA/Megatron-LM/blob/d98e8a64ddf34856e74b24714e3bedb2f5a39553/"
                           "megatron/core/pipeline_parallel/fine_grained_activation_offload.py")
MIN_OFFLOADED_TENSOR_SIZE = 1024 * 1024
"""Megatron-LM's default --min-offloaded-tensor-size, in elements (TransformerConfig.min_offloaded_tensor_size)."""
DENSE_OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm")
"""Megatron's --offload-modules of a dense GPT layer."""
MOE_OFFLOAD_MODULES = ("expert_fc1", "moe_act", "fused_group_mlp")
OTHER_MIXER_OFFLOAD_MODULES = ("gdp_qkv",)
OFFLOAD_MODULES = DENSE_OFFLOAD_MODULES + MOE_OFFLOAD_MODULES + OTHER_MIXER_OFFLOAD_MODULES
"""Every --offload-modules choice of megatron-core 0.19 (TransformerConfig.__post_init__'s allowed set)."""

_ATTENTION = ("query", "key_value", "softmax_lse", "attention_output", "unfused_scores")
MODULE_TERMS: dict[str, dict[str, tuple[str, ...]]] = {
    "te": {"attn_norm": (), "qkv_linear": ("layer_input", "norm1_rstd", "norm1_output"), "core_attn": _ATTENTION,
           "attn_proj": ("attention_output", "projection_input_fp8"), "mlp_norm": ()},
    "local": {"attn_norm": ("layer_input", "norm1_rstd"), "qkv_linear": ("norm1_output",), "core_attn": _ATTENTION,
              "attn_proj": ("attention_output",), "mlp_norm": ("norm2_input", "norm2_rstd")},
}
"""Layer spec -> module -> the cost model's terms its offload group saves. TransformerEngine's spec fuses each norm
into the next linear (TELayerNormColumnParallelLinear saves the norm's input, rstd and output): ``attn_norm`` and
``mlp_norm`` are IdentityOp, skipped by Megatron, and the QKV group holds the norm's tensors."""
SHARED_TERMS = {"attention_output": ("core_attn", "attn_proj")}
"""Terms saved by several modules (one storage): they leave the device only when every one of them is offloaded."""


def _elements_per_token(model: ModelSpec, term: str) -> tuple[int, ...]:
    """The saved tensors of ``term``: elements of each per local token."""
    h, q, hkv = model.hidden_size, model.query_hidden_size, model.kv_hidden_size
    return {"layer_input": (h,), "norm1_rstd": (1,), "norm1_output": (h,), "query": (q,), "key_value": (hkv, hkv),
            "softmax_lse": (model.num_attention_heads,), "attention_output": (q,), "norm2_input": (h,),
            "norm2_rstd": (1,), "projection_input_fp8": (q,)}[term]


def _unfused_score_tensors(model: ModelSpec, plan, dtype_bytes: int, dropout_mask_bytes: int) -> list[tuple[int, int]]:
    """(elements, bytes) of the s^2 tensors unfused core attention saves (the probabilities; with attention dropout
    also its mask and the dropped probabilities), as :func:`~h3t_ext.costmodel.activations.
    unfused_scores_bytes_per_layer` prices them."""
    total = unfused_scores_bytes_per_layer(model, plan, dtype_bytes=dtype_bytes, dropout_mask_bytes=dropout_mask_bytes)
    if not total:
        return []
    n = plan.micro_batch_size * (model.num_attention_heads // plan.tensor_model_parallel_size) * \
        (plan.seq_length // plan.context_parallel_size) ** 2
    out = [(n, n * dtype_bytes)]
    if model.attention_dropout > 0:
        out += [(n, n * dropout_mask_bytes), (n, n * dtype_bytes)]
    return out


class MegatronOffloadError(ValueError):
    """A Megatron offload request this mapping refuses; the message is one line naming the flag and why."""


@dataclass(frozen=True)
class MegatronOffload:
    """Megatron-LM's activation offload flags (its TransformerConfig field names and defaults)."""

    fine_grained_activation_offloading: bool = False
    offload_modules: tuple[str, ...] = ()
    activation_offload_fraction: float = 1.0
    min_offloaded_tensor_size: int = MIN_OFFLOADED_TENSOR_SIZE
    delta_offload_bytes_across_pp_ranks: int = 0
    cpu_offloading_num_layers: int = 0

    @property
    def requested(self) -> bool:
        """Whether these flags ask for an offload at all."""
        return self.fine_grained_activation_offloading or self.cpu_offloading_num_layers > 0

    def flags(self) -> str:
        """The request as Megatron's command-line flags (what a notice names)."""
        if not self.fine_grained_activation_offloading:
            return f"--cpu-offloading-num-layers {self.cpu_offloading_num_layers}"
        out = ["--fine-grained-activation-offloading", "--offload-modules", *self.offload_modules]
        if self.activation_offload_fraction != 1.0:
            out += ["--activation-offload-fraction", f"{self.activation_offload_fraction:g}"]
        if self.min_offloaded_tensor_size != MIN_OFFLOADED_TENSOR_SIZE:
            out += ["--min-offloaded-tensor-size", str(self.min_offloaded_tensor_size)]
        return " ".join(out)


@dataclass(frozen=True)
class OffloadedTensor:
    """One saved tensor of a listed module's group, per layer and microbatch on a rank."""

    module: str
    term: str
    """The cost model's term (:func:`~h3t_ext.costmodel.activations.activation_bytes_per_layer_token`)."""
    elements: int
    nbytes: int
    counted: bool
    """Whether its bytes leave the device (size filter passed and, for a shared term, every saver listed)."""


@dataclass(frozen=True)
class MegatronOffloadMapping:
    """The alpha of a Megatron offload request and what it was computed from (per layer and microbatch)."""

    alpha: float
    tensors: tuple[OffloadedTensor, ...]
    """Fine-grained: the listed modules' saved tensors (counted or not); empty for layer offload."""
    offloaded_bytes: int
    """Bytes the request moves per layer (fine-grained, before the fraction) or per chunk (layer offload)."""
    layer_bytes: int
    """One layer's saved bytes (fine-grained) or the chunk's layers (layer offload): alpha's denominator."""
    skipped_modules: tuple[str, ...] = ()
    """Listed modules with no group of their own in this layer spec (fused norms)."""


def check_request(request: MegatronOffload, *, num_layers: int, pipeline_model_parallel_size: int = 1,
                  recompute_granularity: Optional[str] = None) -> None:
    """Megatron-LM's own rules for the flags (TransformerConfig.__post_init__) and what this mapping cannot take;
    :class:`MegatronOffloadError` (one line) on the first problem."""
    r = request
    if r.offload_modules and not r.fine_grained_activation_offloading:
        raise MegatronOffloadError(f"--offload-modules {' '.join(r.offload_modules)} needs "
                                   "--fine-grained-activation-offloading (without it Megatron-LM offloads nothing)")
    n = r.cpu_offloading_num_layers
    if not 0 <= n < num_layers:
        raise MegatronOffloadError(f"--cpu-offloading-num-layers {n} is outside [0, {num_layers - 1}] (megatron-core "
                                   f"offloads only layers less than --num-layers {num_layers})")
    if n > 0:
        if r.fine_grained_activation_offloading:
            raise MegatronOffloadError("--fine-grained-activation-offloading cannot be enabled with "
                                       "--cpu-offloading-num-layers (megatron-core's TransformerConfig asserts it)")
        if pipeline_model_parallel_size > 1:
            raise MegatronOffloadError(f"--cpu-offloading-num-layers {n} is not supported with "
                                       f"--pipeline-model-parallel-size {pipeline_model_parallel_size} (megatron-core "
                                       "has no pipeline parallelism with CPU offloading; use --offload-alpha)")
        if recompute_granularity is not None:
            raise MegatronOffloadError(f"--cpu-offloading-num-layers {n} does not work with --recompute-granularity "
                                       f"{recompute_granularity} (megatron-core's TransformerConfig refuses it)")
    if not r.fine_grained_activation_offloading:
        return
    if not r.offload_modules:
        raise MegatronOffloadError("--fine-grained-activation-offloading needs --offload-modules (one or more of "
                                   f"{', '.join(DENSE_OFFLOAD_MODULES)})")
    unknown = [m for m in r.offload_modules if m not in OFFLOAD_MODULES]
    if unknown:
        raise MegatronOffloadError(f"--offload-modules {' '.join(unknown)}: not a module Megatron-LM offloads "
                                   f"(valid: {', '.join(OFFLOAD_MODULES)})")
    moe = [m for m in r.offload_modules if m in MOE_OFFLOAD_MODULES + OTHER_MIXER_OFFLOAD_MODULES]
    if moe:
        raise MegatronOffloadError(f"--offload-modules {' '.join(moe)} is not supported: it offloads inside MoE "
                                   "experts or a gated delta-net mixer, which this model does not have (valid: "
                                   f"{', '.join(DENSE_OFFLOAD_MODULES)})")
    if "attn_proj" in r.offload_modules and "core_attn" not in r.offload_modules:
        raise MegatronOffloadError("--offload-modules attn_proj needs core_attn too (as megatron-core asserts: the "
                                   "projection's input is the core attention's output, which its backward keeps)")
    if not (0.0 <= r.activation_offload_fraction <= 1.0):
        raise MegatronOffloadError(f"--activation-offload-fraction {r.activation_offload_fraction} is outside [0, 1]")
    if r.min_offloaded_tensor_size < 0:
        raise MegatronOffloadError(f"--min-offloaded-tensor-size {r.min_offloaded_tensor_size} is outside [0, inf)")
    if r.delta_offload_bytes_across_pp_ranks < 0:
        raise MegatronOffloadError(f"--delta-offload-bytes-across-pp-ranks {r.delta_offload_bytes_across_pp_ranks} "
                                   "is outside [0, inf)")
    if r.delta_offload_bytes_across_pp_ranks > 0:
        raise MegatronOffloadError(
            f"--delta-offload-bytes-across-pp-ranks {r.delta_offload_bytes_across_pp_ranks} is not supported: "
            "Megatron keeps pp_rank x delta bytes of whole groups of the first chunks in backward order on the "
            "device, which no per-stage fraction of every chunk reproduces (use --offload-alpha with one value per "
            "stage instead)")
    if recompute_granularity == "full":
        raise MegatronOffloadError("--fine-grained-activation-offloading is not mapped with --recompute-granularity "
                                   "full (a recomputed layer keeps only its input; use --offload-alpha)")


def _checked(model: ModelSpec, plan, request: MegatronOffload):
    """``plan``'s (ckpt, recompute) after :func:`check_request` of ``request`` on it."""
    base, recompute = plan_recompute(plan)
    check_request(request, num_layers=model.num_layers, pipeline_model_parallel_size=plan.pipeline_model_parallel_size,
                  recompute_granularity=recompute.granularity)
    return base, recompute


def fine_grained_alpha(model: ModelSpec, plan, request: MegatronOffload, *, dtype_bytes: int = BF16,
                       layer_spec: str = "te", dropout_mask_bytes: int = BOOL,
                       fp8: bool = False) -> MegatronOffloadMapping:
    """The alpha that offloads the bytes Megatron's fine-grained offload of ``request`` moves (module docstring),
    for ``plan``'s micro batch, sequence shard, sequence parallelism and ckpt/selective recompute, in
    ``layer_spec``'s terms (``dtype_bytes``, ``dropout_mask_bytes``, ``fp8`` as
    :func:`~h3t_ext.costmodel.activations.activation_bytes_per_layer_token` takes them)."""
    base, recompute = _checked(model, plan, request)
    if layer_spec not in MODULE_TERMS:
        raise ValueError(f"layer_spec must be 'te' or 'local', got {layer_spec!r}")
    t, sp = plan.tensor_model_parallel_size, plan.sequence_parallel
    tokens = local_tokens(plan)
    terms = selective_terms(activation_bytes_per_layer_token(model, base, dtype_bytes=dtype_bytes,
                                                             layer_spec=layer_spec,
                                                             dropout_mask_bytes=dropout_mask_bytes, fp8=fp8,
                                                             activation_impl=mlp_activation_impl(plan)),
                            recompute)
    listed = set(request.offload_modules)
    tensors: list[OffloadedTensor] = []
    for module in (m for m in DENSE_OFFLOAD_MODULES if m in listed):
        for term in MODULE_TERMS[layer_spec][module]:
            savers = SHARED_TERMS.get(term, (module,))
            if module != savers[0]:  # one storage: listed under its first saver
                continue
            if term == "unfused_scores":
                sizes = _unfused_score_tensors(model, plan, dtype_bytes, dropout_mask_bytes)
            elif terms.get(term, 0):
                n_tok = tokens * (t if (term in REPLICATED_WITHOUT_SP and not sp) else 1)
                per_token = _elements_per_token(model, term)
                sizes = [(e * n_tok, terms[term] * n_tok * e // sum(per_token)) for e in per_token]
            else:
                sizes = []
            every_saver = all(m in listed for m in savers)
            tensors += [OffloadedTensor(module, term, e, nb, every_saver and e >= request.min_offloaded_tensor_size)
                        for e, nb in sizes]
    offloaded = sum(x.nbytes for x in tensors if x.counted)
    layer = layer_kept_bytes(model, plan, tensor_model_parallel_size=t, sequence_parallel=sp, dtype_bytes=dtype_bytes,
                             layer_spec=layer_spec, dropout_mask_bytes=dropout_mask_bytes, fp8=fp8)
    alpha = min(1.0, request.activation_offload_fraction * offloaded / layer) if layer else 0.0
    skipped = tuple(m for m in request.offload_modules if not MODULE_TERMS[layer_spec][m])
    return MegatronOffloadMapping(alpha, tuple(tensors), offloaded, layer, skipped)


def layer_offload_alpha(model: ModelSpec, plan, request: MegatronOffload) -> MegatronOffloadMapping:
    """``--cpu-offloading-num-layers N``: alpha = N / L (h3t-ext's layer rule moves the first N layers whole, as
    TransformerEngine's layer offload does), with megatron-core's rules (:func:`check_request`)."""
    _checked(model, plan, request)
    n, layers = request.cpu_offloading_num_layers, model.num_layers
    return MegatronOffloadMapping(n / layers, (), n, layers)


def megatron_offload_alpha(model: ModelSpec, plan, request: MegatronOffload, **spec) -> Optional[MegatronOffloadMapping]:
    """The mapping of ``request`` (fine-grained or layer offload), or None when it asks for no offload (after
    :func:`check_request`). ``spec``: the layer spec keywords of :func:`fine_grained_alpha`."""
    if request.fine_grained_activation_offloading:
        return fine_grained_alpha(model, plan, request, **spec)
    if request.cpu_offloading_num_layers:
        return layer_offload_alpha(model, plan, request)
    _checked(model, plan, request)
    return None


__all__ = ["DENSE_OFFLOAD_MODULES", "MIN_OFFLOADED_TENSOR_SIZE", "MODULE_TERMS", "MegatronOffload",
           "MegatronOffloadError", "MegatronOffloadMapping", "OFFLOAD_MODULES", "OffloadedTensor", "check_request",
           "fine_grained_alpha", "layer_offload_alpha", "megatron_offload_alpha"]
