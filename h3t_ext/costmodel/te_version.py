"""The TransformerEngine version a run imports (``Plan.transformer_engine_version``) and the rules that depend on it.

Where TransformerEngine changed what one of its kernels saves or moves, the cost model keeps both rules and the
plan's version picks one; a plan without a version gets the newest rule this package knows (what a fresh install
runs). ``h3t-plan --transformer-engine-version`` sets it, and the driver's plan reads it from the installed
TransformerEngine.

* **The fused cross entropy** (Megatron's --cross-entropy-loss-fusion --cross-entropy-fusion-impl te, TE's triton
  ``parallel_cross_entropy``). Through TE 2.17 its forward writes the logits' gradient in place into the bf16 logits
  and saves them: 2 bytes a logit, the logits' own buffer, and no other copy (``triton/cross_entropy.py``
  ``cross_entropy_forward`` returns its input, which ``CrossEntropyFunction`` saves; the backward scales it in place).
  From TE 2.18 (PR #3193, "Fix the numerical issue with the Fused CE loss", July 2026) it writes the gradient to a
  new fp32 tensor ("so it is not quantized before backward") and saves that: 4 bytes a logit, next to the bf16
  logits while the forward runs, and autograd casts the gradient back to bf16 in the backward.
"""
from __future__ import annotations

import re
from typing import Optional

FP32_CROSS_ENTROPY_GRADIENT = (2, 18)
"""The first TransformerEngine whose fused cross entropy keeps the logits' gradient in fp32 (module docstring)."""
_VERSION = re.compile(r"(\d+)\.(\d+)(?:[.+\-][0-9A-Za-z.+\-]*)?")


def parse_te_version(text: str) -> tuple[int, int]:
    """(major, minor) of a TransformerEngine version string ('2.9', '2.9.0', '2.9.0+a1b2c3d'); ValueError naming the
    valid form otherwise."""
    m = _VERSION.fullmatch(str(text).strip())
    if m is None:
        raise ValueError(f"transformer_engine_version must look like MAJOR.MINOR (e.g. 2.9), got {text!r}")
    return int(m.group(1)), int(m.group(2))


def cross_entropy_impl(plan) -> Optional[str]:
    """The fused cross entropy a plan runs, as :data:`h3t_ext.costmodel.elementwise.FUSED_CROSS_ENTROPY` keys it:
    None without --cross-entropy-loss-fusion; 'native'; 'te' (TE 2.18 on, or no version given: the fp32 gradient);
    'te-bf16' (an earlier TE: the gradient in place in the bf16 logits)."""
    if not plan.cross_entropy_loss_fusion:
        return None
    impl = plan.cross_entropy_fusion_impl
    version = plan.transformer_engine_version
    if impl == "te" and version is not None and parse_te_version(version) < FP32_CROSS_ENTROPY_GRADIENT:
        return "te-bf16"
    return impl


__all__ = ["FP32_CROSS_ENTROPY_GRADIENT", "cross_entropy_impl", "parse_te_version"]
