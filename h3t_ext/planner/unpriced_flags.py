"""Megatron-LM's flags the cost model does not price: a command line pasted from such a run is refused naming them
and what the model prices instead, not only as unknown flags (``h3t-plan``'s parser asks :func:`unpriced_reason`
when argparse finds unrecognized arguments)."""
from __future__ import annotations

from typing import Optional

_PRICES_DECODERS = ("it prices decoder-only transformers: multi-head or grouped-query attention, a dense or "
                    "mixture-of-experts MLP); leave the flags out to price the rest of the model")
UNPRICED_MODEL_FLAGS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("--moe-",), "these mixture-of-experts settings (it prices --num-experts, --moe-router-topk, "
                  "--moe-ffn-hidden-size, --moe-shared-expert-intermediate-size, --moe-layer-freq, "
                  "--expert-model-parallel-size, --expert-tensor-parallel-size, --moe-token-dispatcher-type, "
                  "--moe-grouped-gemm and --moe-shared-expert-overlap, and takes the routing flags such as "
                  "--moe-aux-loss-coeff as written, priced alike); leave them out"),
    (("--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
      "--v-head-dim"), f"multi-latent attention ({_PRICES_DECODERS}"),
    (("--mtp-",), f"multi-token prediction layers ({_PRICES_DECODERS}"),
    (("--hybrid-", "--mamba-", "--is-hybrid-model"), f"Mamba / hybrid layers ({_PRICES_DECODERS}"),
    (("--fp4-",), "FP4 training (it prices BF16, FP16 and --fp8-format's FP8); leave them out"),
)
"""Megatron-LM's flags the cost model does not price (prefixes), and what it does not price (with what it prices
instead and what to do): a command line pasted from such a run is refused naming them, not only as unknown flags."""


def unpriced_reason(message: str) -> Optional[str]:
    """The one-line reason for an 'unrecognized arguments' message whose flags Megatron-LM has and the cost model
    does not price, if any."""
    flags = [w.split("=")[0] for w in message.removeprefix("unrecognized arguments:").split() if w.startswith("--")]
    for prefixes, what in UNPRICED_MODEL_FLAGS:
        named = [f for f in flags if f.startswith(prefixes)]
        if named:
            return f"{', '.join(named)}: the cost model does not price {what}"
    return None


__all__ = ["UNPRICED_MODEL_FLAGS", "unpriced_reason"]
