"""FP8 training as Megatron-LM runs it through TransformerEngine (``--fp8-format``, ``--fp8-recipe``,
``--fp8-param-gather``): the plan's rules, the time of the casts, and the memory of the FP8 copies.

What runs in FP8 (TransformerEngine's ``Linear`` / ``LayerNormLinear`` in megatron-core's TE layer spec): the
four GEMMs of every transformer layer -- QKV, projection, FC1, FC2 -- forward (input x weight, E4M3), data
gradient (dY x W^T) and weight gradient (X^T x dY), the gradients in E5M2 with ``hybrid`` and E4M3 with
``e4m3`` (Hopper's tensor cores run both at the same rate, so the format changes neither time nor bytes). The
GEMM rates are ``kernels.gemm_seconds(..., fp8=True)``. Attention stays BF16 (TransformerEngine's
``fp8_dot_product_attention`` is off by default), as do the output layer (megatron-core's own
``ColumnParallelLinear``), the norms, the element-wise kernels and the communication here.

Casts (``cast_bytes``), priced as HBM traffic (``kernels.elementwise_seconds``): per layer and microbatch,
each GEMM's activation input is read in bf16 and written in FP8 twice (row-wise for the forward GEMM and the
transposed, column-wise copy the weight-gradient GEMM reads) -- ``CAST_TRANSPOSE_BYTES`` per element, one fused
cast-transpose kernel that also reduces the amax; in the backward the same for each GEMM's output gradient.
The weights are cast once per iteration (megatron-core passes ``is_first_microbatch`` to TransformerEngine,
which caches the FP8 weight and its transpose for the other microbatches), priced with the optimizer step
(``step_seconds``); with ``--fp8-param-gather`` the parameters already are FP8 (the optimizer writes them from
the fp32 main params) and only the transpose is made. On a GPU whose FP8 GEMMs take any operand layout
(``kernels.any_layout_fp8_gemm``: Blackwell's compute capability 10.x) a per-tensor-scaled tensor (``delayed``,
``tensorwise``) is one buffer that both GEMM directions read: no transpose is written, cached or made
(``fp8_copies``; TransformerEngine's ``Float8Tensor`` on such a GPU). The recipes differ in their scaling:

* ``delayed``: scales from an amax history (Megatron's ``--fp8-amax-history-len``, default 1); the amax comes
  out of the cast kernel, and one fused kernel per iteration updates the histories and scales.
* ``tensorwise`` (current scaling): the scale of a tensor is its own amax, so an extra pass reads every input
  (``AMAX_PASS_BYTES``) before the cast.
* ``blockwise``: a scale per 1x128 (activations, gradients) or 128x128 (weights) block, computed inside the
  cast: no extra pass, fp32 scales written beside both copies (``BLOCKWISE_SCALE_BYTES``).
* ``mxfp8``: Blackwell's microscaling, a 1-byte E8M0 scale per 32 elements (``MXFP8_SCALE_BYTES``); refused on
  GPUs before compute capability 10.0.

Memory (``memory.py`` and ``activations.py`` read the byte rules here): the FP8 weight cache (an FP8 copy and
its transpose per GEMM weight, ``WEIGHT_CACHE_BYTES``), the scaling state of every FP8 tensor (small), and the
saved inputs of the four GEMMs in FP8 (``activations.py``).

BF16 first and last layers (Megatron's ``--first-last-layers-bf16`` with ``--num-layers-at-start-in-bf16`` N1 and
``--num-layers-at-end-in-bf16`` N2, default 1 each): megatron-core builds and runs the model's first N1 and last N2
transformer layers (global layer numbers, ``fp8_utils.is_first_last_bf16_layer``) outside the FP8 context, so
they are BF16 layers in every respect priced here: BF16 GEMMs, no casts, no FP8 weight copies or scaling state,
bf16 saved inputs, bf16 parameters under --fp8-param-gather. :func:`bf16_layers_in` counts them in a span of
layers (``Plan.chunk_bf16_layers`` per model chunk); the time and memory models price each pipeline rank and
model chunk with its own count. Megatron refuses
them with the delayed recipe and N1 or N2 above L / p (``TransformerConfig.__post_init__``), and so does
:func:`validate_fp8` / :func:`validate_bf16_layers`.
"""
from __future__ import annotations

from typing import Optional

from h3t_ext.costmodel.errors import InvalidPlanError
from h3t_ext.costmodel.kernels import KernelRates, any_layout_fp8_gemm, elementwise_seconds, kernel_rates
from h3t_ext.dtypes import BF16, E8M0, FP8, FP32

FP8_FORMATS = ("e4m3", "hybrid")
"""Megatron-LM's ``--fp8-format`` choices (dest ``fp8``): E4M3 everywhere, or E4M3 forward and E5M2 gradients."""
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
"""Megatron-LM's ``--fp8-recipe`` choices."""
DEFAULT_FP8_RECIPE = "delayed"
"""Megatron-LM's ``--fp8-recipe`` default (and ``TransformerConfig.fp8_recipe``'s): the one every layer of this
project defaults to (the plan, the search space, the flags-to-Plan translation, both CLIs)."""
PRECISIONS = ("bf16", "fp8", "auto")
"""``h3t-plan search --precision``: BF16 plans, FP8 plans, or both."""
FP8_MIN_COMPUTE_CAPABILITY = 8.9
"""FP8 tensor cores: Ada (8.9) and Hopper (9.0) onwards (the system files' ``peak_fp8_flops`` is 0 before)."""
MXFP8_MIN_COMPUTE_CAPABILITY = 10.0
"""MXFP8 block scaling in the tensor cores: Blackwell (10.0) onwards (TransformerEngine refuses it before)."""
CAST_TRANSPOSE_BYTES = BF16 + FP8 + FP8
"""Per element cast: read bf16, write the FP8 row-wise copy and the FP8 transpose (TransformerEngine's fused
cast-transpose; the amax reduction rides in the same kernel)."""
PER_TENSOR_RECIPES = ("delayed", "tensorwise")
"""The recipes with one scale per tensor, whose FP8 data reads the same in either GEMM direction on a GPU whose FP8
GEMMs take any operand layout (:func:`fp8_copies`); block scales belong to one direction (``blockwise``, ``mxfp8``),
so those keep both copies."""
AMAX_PASS_BYTES = BF16
"""Current (tensorwise) scaling: the amax is needed before the cast, so every input is read once more."""
BLOCKWISE_SCALE_BYTES = 2 * FP32 / 128
"""Blockwise: an fp32 scale per 128 elements for each of the two copies, per element."""
MXFP8_SCALE_BYTES = 2 * E8M0 / 32
"""MXFP8: a 1-byte E8M0 scale per 32 elements for each of the two copies, per element."""
CAST_KERNELS_PER_TENSOR = 1
"""One fused cast-transpose kernel per cast tensor (a second, the amax pass, with current scaling)."""
WEIGHT_CACHE_BYTES = FP8 + FP8
"""Per GEMM weight parameter: the FP8 copy and its transpose TransformerEngine keeps for the iteration."""
FP8_TENSORS_PER_GEMM = 5
"""FP8 meta entries of one TransformerEngine GEMM module: forward input, weight and output, backward output
gradient and input gradient (``FP8FwdTensors`` / ``FP8BwdTensors``)."""
AMAX_HISTORY_LEN = 1
"""Megatron-LM's default ``--fp8-amax-history-len``."""
STEP_KERNELS = 1
"""The per-iteration fused amax-history and scale update (delayed scaling; counted for every recipe)."""


def validate_fp8(plan, system=None) -> None:
    """The plan's FP8 switches (and, with ``system``, the GPU's FP8 support); InvalidPlanError with a one-line
    reason naming Megatron's flag and the valid values."""
    fmt, recipe = plan.fp8, plan.fp8_recipe
    if fmt is not None and fmt not in FP8_FORMATS:
        raise InvalidPlanError(f"--fp8-format must be one of {', '.join(FP8_FORMATS)}, got {fmt!r}")
    if recipe not in FP8_RECIPES:
        raise InvalidPlanError(f"--fp8-recipe must be one of {', '.join(FP8_RECIPES)}, got {recipe!r}")
    if plan.fp8_param_gather and fmt is None:
        raise InvalidPlanError("--fp8-param-gather needs --fp8-format (e4m3 or hybrid)")
    if plan.first_last_layers_bf16 and fmt is None:
        raise InvalidPlanError("--first-last-layers-bf16 needs --fp8-format (e4m3 or hybrid): without FP8 every layer "
                               "is BF16 already")
    for flag, n in (("--num-layers-at-start-in-bf16", plan.num_layers_at_start_in_bf16),
                    ("--num-layers-at-end-in-bf16", plan.num_layers_at_end_in_bf16)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidPlanError(f"{flag} must be an integer >= 0, got {n!r}")
    if fmt is None:
        return
    refusal = fp8_switches_refusal(recipe, first_last_layers_bf16=plan.first_last_layers_bf16,
                                   fp8_param_gather=plan.fp8_param_gather,
                                   optimizer_cpu_offload=plan.optimizer_cpu_offload,
                                   use_distributed_optimizer=plan.use_distributed_optimizer,
                                   fsdp=plan.use_torch_fsdp2 or plan.data_parallel_sharding_strategy is not None)
    if refusal:
        raise InvalidPlanError(refusal)
    if plan.transformer_impl != "transformer_engine":
        raise InvalidPlanError("--fp8-format needs --transformer-impl transformer_engine (FP8 runs in TransformerEngine)")
    if system is None:
        return
    if system.peak_fp8_flops <= 0:
        raise InvalidPlanError(f"--fp8-format needs FP8 tensor cores (Hopper or newer, compute capability >= "
                               f"{FP8_MIN_COMPUTE_CAPABILITY}): {system.name} has none (peak_fp8_flops 0)")
    refusal = fp8_device_refusal(recipe, system.compute_capability, system.name)
    if refusal:
        raise InvalidPlanError(refusal)


def fp8_device_refusal(recipe: str, compute_capability: float, device: str) -> Optional[str]:
    """Why a GPU of ``compute_capability`` (``device`` names it) cannot run FP8 with ``recipe``, or None: FP8 tensor
    cores from compute capability 8.9 (:data:`FP8_MIN_COMPUTE_CAPABILITY`), MXFP8 from Blackwell's 10.0
    (:data:`MXFP8_MIN_COMPUTE_CAPABILITY`). The planner refuses a system file's GPU with this line and the training
    driver the GPU it runs on, where TransformerEngine would stop at the first FP8 layer's forward."""
    if compute_capability < FP8_MIN_COMPUTE_CAPABILITY:
        return (f"--fp8-format needs FP8 tensor cores (Hopper or newer, compute capability >= "
                f"{FP8_MIN_COMPUTE_CAPABILITY}): {device} has {compute_capability}")
    if recipe == "mxfp8" and compute_capability < MXFP8_MIN_COMPUTE_CAPABILITY:
        return (f"--fp8-recipe mxfp8 needs Blackwell (compute capability >= {MXFP8_MIN_COMPUTE_CAPABILITY}): {device} "
                f"has {compute_capability}")
    return None


def bf16_layers_recipe_refusal(first_last_layers_bf16: bool, recipe: str) -> Optional[str]:
    """Why an FP8 run cannot keep its first / last layers in BF16 under ``recipe`` (megatron-core refuses the delayed
    recipe), or None; the planner and the training driver refuse with this line."""
    if first_last_layers_bf16 and recipe == "delayed":
        return ("--first-last-layers-bf16 does not work with --fp8-recipe delayed (megatron-core: delayed scaling does "
                "not support first / last layers in BF16); valid: tensorwise, blockwise or mxfp8")
    return None


def param_gather_refusal(fp8_param_gather: bool, use_distributed_optimizer: bool, fsdp: bool) -> Optional[str]:
    """Why Megatron-LM refuses --fp8-param-gather here, or None: it keeps FP8 parameters only where the distributed
    optimizer, Megatron FSDP or torch FSDP2 (``fsdp``) holds the master weights (``validate_args`` asserts it in
    0.16-0.19); the planner and the training driver refuse with this line."""
    if fp8_param_gather and not (use_distributed_optimizer or fsdp):
        return ("--fp8-param-gather needs --use-distributed-optimizer (or Megatron FSDP or torch FSDP2: Megatron-LM "
                "asserts it, the FP8 parameters need a master copy the optimizer steps)")
    return None


def cpu_offload_param_gather_refusal(optimizer_cpu_offload: bool, fp8_param_gather: bool,
                                     recipe: str) -> Optional[str]:
    """Why Megatron-LM refuses the optimizer CPU offload with these FP8 switches, or None: with --fp8-param-gather its
    hybrid device optimizer runs with the delayed recipe only (``validate_args`` asserts it in 0.16-0.19); the planner
    and the training driver refuse with this line."""
    if optimizer_cpu_offload and fp8_param_gather and recipe != "delayed":
        return (f"--optimizer-cpu-offload with --fp8-param-gather needs --fp8-recipe delayed, got {recipe} "
                "(Megatron-LM asserts it); valid: --fp8-recipe delayed, or leave out --fp8-param-gather")
    return None


def fp8_switches_refusal(recipe: str, *, first_last_layers_bf16: bool, fp8_param_gather: bool,
                         optimizer_cpu_offload: bool, use_distributed_optimizer: bool, fsdp: bool) -> Optional[str]:
    """The first refusal of an FP8 run's switches with ``recipe`` (:func:`bf16_layers_recipe_refusal`,
    :func:`cpu_offload_param_gather_refusal`, :func:`param_gather_refusal`), or None: the one check the planner's plan
    and the training driver's flags make."""
    return (bf16_layers_recipe_refusal(first_last_layers_bf16, recipe)
            or cpu_offload_param_gather_refusal(optimizer_cpu_offload, fp8_param_gather, recipe)
            or param_gather_refusal(fp8_param_gather, use_distributed_optimizer, fsdp))


def bf16_layer_counts_refusal(at_start: int, at_end: int, num_layers: int,
                              pipeline_model_parallel_size: int) -> Optional[str]:
    """Why megatron-core refuses these BF16 layer counts (each at most L / p, integer division), or None; the planner
    and the training driver refuse with this line."""
    most = num_layers // pipeline_model_parallel_size
    for flag, n in (("--num-layers-at-start-in-bf16", at_start), ("--num-layers-at-end-in-bf16", at_end)):
        if n > most:
            return (f"{flag} must be between 0 and the layers per pipeline stage ({num_layers} // "
                    f"{pipeline_model_parallel_size} = {most}), got {n} (megatron-core's rule)")
    return None


def validate_bf16_layers(plan, num_layers: int) -> None:
    """Megatron's bound on an FP8 plan's BF16 first / last layers (:func:`bf16_layer_counts_refusal`)."""
    if plan.fp8 is None or not plan.first_last_layers_bf16:
        return
    refusal = bf16_layer_counts_refusal(plan.num_layers_at_start_in_bf16, plan.num_layers_at_end_in_bf16, num_layers,
                                        plan.pipeline_model_parallel_size)
    if refusal:
        raise InvalidPlanError(refusal)


def bf16_layers_in(at_start: int, at_end: int, num_layers: int, first: int, count: int) -> int:
    """How many of the global layers ``first`` .. ``first + count - 1`` of a ``num_layers``-layer model are among
    its first ``at_start`` and last ``at_end`` (--num-layers-at-start-in-bf16 / -at-end-in-bf16)."""
    fp8_layers = max(0, min(first + count, num_layers - at_end) - max(first, at_start))
    return max(0, count) - fp8_layers


def fp8_copies(recipe: str, any_layout: bool = False) -> int:
    """FP8 copies TransformerEngine makes of a cast tensor for its two GEMM directions: the row-wise data and its
    transpose (2), or, for a per-tensor-scaled recipe on a GPU whose FP8 GEMMs take any layout (``any_layout``:
    ``kernels.any_layout_fp8_gemm``), the one buffer both directions read (1: ``Float8Tensor`` keeps no transpose)."""
    return 1 if any_layout and recipe in PER_TENSOR_RECIPES else 2


def cast_bytes_per_element(recipe: str, copies: int = 2) -> float:
    """HBM bytes per element of one cast tensor under ``recipe`` (read bf16, write ``copies`` FP8 copies, the amax
    pass, scales)."""
    extra = {"delayed": 0.0, "tensorwise": AMAX_PASS_BYTES, "blockwise": BLOCKWISE_SCALE_BYTES,
             "mxfp8": MXFP8_SCALE_BYTES}[recipe]
    return CAST_TRANSPOSE_BYTES - (2 - copies) * FP8 + extra


def _cast_kernels(recipe: str) -> int:
    return CAST_KERNELS_PER_TENSOR + (1 if recipe == "tensorwise" else 0)


def cast_elements(model, plan) -> tuple[int, int]:
    """(forward, backward) elements one layer casts per microbatch on one rank: the activation inputs of QKV
    [T, h], projection [T, q/t], FC1 [T, h] and FC2 [T, f/t]; the output gradients of QKV [T, (q + 2 h_kv)/t],
    projection [T, h], FC1 [T, fc1/t] and FC2 [T, h] (T = micro batch x s / c, the GEMMs' tokens; q the query
    width, h unless --kv-channels)."""
    t = plan.tensor_model_parallel_size
    tokens = plan.micro_batch_size * plan.seq_length // plan.context_parallel_size
    h, q, hkv, f = model.hidden_size, model.query_hidden_size, model.kv_hidden_size, model.dense_ffn_hidden_size
    fwd = tokens * (h + q // t + h + f // t)
    bwd = tokens * ((q + 2 * hkv) // t + h + model.fc1_width // t + h)
    return fwd, bwd


def cast_seconds(model, plan, r: KernelRates) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's casts for one microbatch on one rank (0, 0 without FP8)."""
    if plan.fp8 is None:
        return 0.0, 0.0
    copies = fp8_copies(plan.fp8_recipe, r.fp8_any_layout)
    per, kernels = cast_bytes_per_element(plan.fp8_recipe, copies), 4 * _cast_kernels(plan.fp8_recipe)
    fwd, bwd = cast_elements(model, plan)
    return elementwise_seconds(fwd * per, r, kernels=kernels), elementwise_seconds(bwd * per, r, kernels=kernels)


def gemm_weight_params(model, plan, layers: int) -> int:
    """GEMM weights of ``layers`` layers on one tensor-parallel rank (what TransformerEngine casts to FP8)."""
    return layers * model.params_per_layer // plan.tensor_model_parallel_size


def step_seconds(model, plan, system, layers: int) -> float:
    """Once per iteration on a rank holding ``layers`` layers: the weights' cast (read bf16, write FP8 and, where it
    is kept (:func:`fp8_copies`), its transpose; with --fp8-param-gather only the transpose of the FP8 parameters,
    once per microbatch where Megatron FSDP drops it between uses, :func:`fsdp_drops_weight_transposes`) and the
    scale update."""
    if plan.fp8 is None:
        return 0.0
    w, r = gemm_weight_params(model, plan, layers), kernel_rates(system)
    copies = fp8_copies(plan.fp8_recipe, r.fp8_any_layout)
    per = (FP8 + FP8) * (copies - 1) if plan.fp8_param_gather else cast_bytes_per_element(plan.fp8_recipe, copies)
    if fsdp_drops_weight_transposes(plan):  # each microbatch's backward makes the gathered weights' transposes
        per *= plan.num_microbatches
    return elementwise_seconds(w * per, r, kernels=STEP_KERNELS + 4 * layers * _cast_kernels(plan.fp8_recipe))


def weight_bytes(model, plan, n: int, layers: int) -> int:
    """bf16 parameters of a rank holding ``n`` parameters, ``layers`` of its layers; with --fp8-param-gather
    the GEMM weights are held in FP8 (1 byte) and only the rest (embeddings, norms, biases) in bf16."""
    if plan.fp8 is None or not plan.fp8_param_gather:
        return n * BF16
    w = gemm_weight_params(model, plan, layers)
    return (n - w) * BF16 + w * FP8


def fsdp_drops_weight_transposes(plan) -> bool:
    """Whether Megatron FSDP drops the FP8 parameters' transposes between uses: with --fp8-param-gather and
    parameters sharded ('optim_grads_params'), megatron_fsdp makes a gathered FP8 parameter's transpose for its
    backward (``fp8_create_transpose_cache`` after the all-gather) and drops it when the module's forward or backward
    is done (``release_params_fp8_transpose_cache``; the DDP config's ``keep_fp8_transpose_cache`` is off by
    default). No FP8 copy is kept through the iteration then; the gathered layers hold theirs
    (``memory.fsdp_buffer_bytes``). With 'optim_grads' the parameters stay whole and TransformerEngine keeps each
    transpose, as without FSDP."""
    return (plan.fp8 is not None and plan.fp8_param_gather and not plan.use_torch_fsdp2
            and plan.data_parallel_sharding_strategy == "optim_grads_params")


def _weight_copies(plan, system=None) -> int:
    """:func:`fp8_copies` of the plan's recipe on ``system`` (None: a GPU that keeps the transpose)."""
    return fp8_copies(plan.fp8_recipe, system is not None and any_layout_fp8_gemm(system.compute_capability))


def gathered_weight_bytes(plan, system=None) -> int:
    """Bytes per GEMM-weight parameter of an FP8 layer's gathered parameters under Megatron FSDP with
    --fp8-param-gather, in its backward: the FP8 data and the transpose made for it where one is kept
    (:func:`fp8_copies` on ``system``; None: a GPU that keeps it)."""
    return FP8 * _weight_copies(plan, system)


def weight_cache_bytes(model, plan, layers: int, system=None) -> int:
    """TransformerEngine's FP8 weight copies kept through the iteration: the FP8 copy and its transpose per GEMM
    weight, or the copy alone where no transpose is kept (:func:`fp8_copies` on ``system``); with --fp8-param-gather
    the parameter is the FP8 copy, so only the transpose (none where none is kept), and none under Megatron FSDP
    sharding the parameters (:func:`fsdp_drops_weight_transposes`). ``system`` None: a GPU that keeps the
    transpose."""
    if plan.fp8 is None or fsdp_drops_weight_transposes(plan):
        return 0
    copies = _weight_copies(plan, system)
    per = FP8 * (copies - 1) if plan.fp8_param_gather else WEIGHT_CACHE_BYTES - (2 - copies) * FP8
    return gemm_weight_params(model, plan, layers) * per


def scaling_state_bytes(plan, layers: int) -> int:
    """FP8 meta of ``layers`` layers: per tensor an fp32 scale, its inverse and (delayed scaling) the amax
    history; a few kB per layer. Block scales travel with their tensors (in the cast traffic), not here."""
    if plan.fp8 is None:
        return 0
    history = AMAX_HISTORY_LEN if plan.fp8_recipe == "delayed" else 1
    return layers * 4 * FP8_TENSORS_PER_GEMM * (2 + history) * FP32


def param_gather_bytes(plan, params: int, fp8_params: int) -> float:
    """Bytes per parameter of the data-parallel parameter all-gather of ``params`` parameters, ``fp8_params`` of them
    the GEMM weights of FP8 layers: with --fp8-param-gather those travel in FP8 (TransformerEngine's FP8 weights) and
    the rest -- embeddings, norms, the output layer, BF16 first / last layers -- in bf16 (megatron-core keeps a buffer
    per dtype); BF16 without it."""
    if plan.fp8 is None or not plan.fp8_param_gather or params <= 0:
        return float(BF16)
    return (fp8_params * FP8 + (params - fp8_params) * BF16) / params
