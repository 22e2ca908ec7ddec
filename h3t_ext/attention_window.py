"""Sliding-window attention (Megatron's ``--window-size`` and ``--window-attn-skip-freq``): the one reading of the
two flags and the one rule of which layers are windowed, shared by the driver, the runtime's core attention, the
cost model and the planner.

Megatron-LM's flags, as its parser and megatron-core read them (core_v0.16.1 to core_v0.19.0):

* ``--window-size L,R`` (or ``(L,R)``): a query at position i attends to the keys at positions i - L .. i + R.
  A GPT is causal, so R must be 0 (TransformerEngine sets it to 0 for causal masks; megatron-core's unfused
  attention would let a token see later ones). L >= 0 tokens; L = -1 is TransformerEngine's "infinite", which is
  plain causal attention, refused here as a window (leave the flag out).
* ``--window-attn-skip-freq``: which layers (numbered from 1) are windowed. An integer N windows every layer whose
  number is not a multiple of N (N - 1 windowed layers, then one full-attention layer); a pattern such as
  ``[1,1,1,0]*3`` (Python list arithmetic of 0 and 1) gives each layer's choice, 1 windowed, and must have one entry
  per layer. Without it every layer is windowed (megatron-core's ``is_layer_window_attention``).

Work of a windowed causal layer: query i attends to min(i + 1, L + 1) keys. Flash-attention kernels skip the blocks
outside the band, so the score pairs a layer computes are the band's area, s L - L^2 / 2 for L < s (and s^2 / 2, the
causal triangle, otherwise): :func:`attended_pairs`. The same area convention as the causal triangle's s^2 / 2.
"""
from __future__ import annotations

from typing import Optional, Union

from h3t_ext.layer_pattern import evaluate_pattern

SkipFreq = Union[int, tuple[int, ...]]
"""``--window-attn-skip-freq``: an integer N, or one 0/1 entry per layer (1: windowed)."""


class WindowFlagError(ValueError):
    """A ``--window-size`` / ``--window-attn-skip-freq`` value outside its range; the message is one line naming the
    flag, the value and what is valid."""


def parse_window_size(text: Union[str, tuple, list]) -> int:
    """``--window-size``'s value (``"L,R"``, ``"(L,R)"`` or a pair) as the left window L in tokens."""
    if isinstance(text, (tuple, list)):
        parts = [str(x) for x in text]
    else:
        parts = str(text).strip().strip("()").split(",")
    try:
        left, right = (int(p.strip()) for p in parts)
    except ValueError:
        raise WindowFlagError(f"--window-size {text!r} is not two integers LEFT,RIGHT (e.g. 4096,0)") from None
    if right != 0:
        raise WindowFlagError(f"--window-size {left},{right}: a GPT's attention is causal, so the right window must be "
                              f"0 (TransformerEngine sets it to 0 for causal masks); valid: LEFT,0 with LEFT >= 0")
    if left == -1:
        raise WindowFlagError("--window-size -1,0 is an unbounded window, plain causal attention: leave --window-size "
                              "out; valid: LEFT,0 with LEFT >= 0")
    if left < 0:
        raise WindowFlagError(f"--window-size {left},0: the left window is outside [0, inf)")
    return left


def parse_skip_freq(text: Union[str, int, list, tuple]) -> SkipFreq:
    """``--window-attn-skip-freq``'s value: an integer >= 1, or a pattern of 0/1 entries (``[1,1,1,0]*3``, as
    Megatron-LM evaluates it: lists, ``+``, ``*`` and parentheses) as a tuple."""
    if isinstance(text, int) and not isinstance(text, bool):
        value: object = text
    elif isinstance(text, (list, tuple)):
        value = list(text)
    else:
        try:
            value = evaluate_pattern(str(text))
        except ValueError:
            if "[" not in str(text):
                raise WindowFlagError(f"--window-attn-skip-freq {text!r} is neither an integer N >= 1 nor a pattern "
                                      f"of 0/1 entries such as [1,1,1,0]*3") from None
            raise WindowFlagError(f"--window-attn-skip-freq {text!r} is not a pattern of 0/1 entries such as "
                                  f"[1,1,1,0]*3 (lists, + and *)") from None
    if isinstance(value, int):
        if value < 1:
            raise WindowFlagError(f"--window-attn-skip-freq {value} is outside [1, inf) (N: every N-th layer attends "
                                  f"fully)")
        return value
    if not isinstance(value, list) or not value or any(type(v) is not int or v not in (0, 1) for v in value):
        raise WindowFlagError(f"--window-attn-skip-freq {text!r}: a pattern's entries are 0 (full attention) or 1 "
                              f"(windowed), at least one")
    return tuple(value)


def check_window(window_size: Optional[int], skip_freq: Optional[SkipFreq], num_layers: int) -> None:
    """WindowFlagError (one line) unless the pair describes ``num_layers`` layers: a window of >= 0 tokens, a
    frequency >= 1, a pattern of one 0/1 entry per layer. A frequency without a window is Megatron-LM's no-op."""
    if window_size is not None and (type(window_size) is not int or window_size < 0):
        raise WindowFlagError(f"--window-size {window_size}: the left window is outside [0, inf)")
    if skip_freq is None or isinstance(skip_freq, int):
        if skip_freq is not None and skip_freq < 1:
            raise WindowFlagError(f"--window-attn-skip-freq {skip_freq} is outside [1, inf)")
        return
    parse_skip_freq(list(skip_freq))
    if window_size is not None and len(skip_freq) != num_layers:
        raise WindowFlagError(f"--window-attn-skip-freq has {len(skip_freq)} entries but the model has {num_layers} "
                              f"layers (--num-layers); valid: one 0/1 entry per layer")


def is_windowed(window_size: Optional[int], skip_freq: Optional[SkipFreq], layer_number: int) -> bool:
    """Whether layer ``layer_number`` (1-based, over the whole model) attends through the window (the rule of
    megatron-core's ``is_layer_window_attention``)."""
    if window_size is None:
        return False
    if skip_freq is None:
        return True
    if isinstance(skip_freq, int):
        return layer_number % skip_freq != 0
    return bool(skip_freq[layer_number - 1])


def windowed_layer_count(window_size: Optional[int], skip_freq: Optional[SkipFreq], num_layers: int) -> int:
    """How many of the model's layers are windowed."""
    if window_size is None:
        return 0
    return sum(is_windowed(window_size, skip_freq, n) for n in range(1, num_layers + 1))


def attended_pairs(seq_length: int, window_size: Optional[int] = None) -> float:
    """Score pairs (query, key) of one causal attention head over ``seq_length`` tokens: the causal triangle s^2/2,
    or with a left window L < s the band's area s L - L^2/2 (what a flash kernel computes, block by block)."""
    s = float(seq_length)
    if window_size is None or window_size >= seq_length:
        return s * s / 2
    w = float(window_size)
    return s * w - w * w / 2


def megatron_window_fields(window_size: Optional[int], skip_freq: Optional[SkipFreq]) -> dict:
    """megatron-core's ``TransformerConfig`` fields of the pair: ``window_size`` (L, 0) and
    ``window_attn_skip_freq`` (an int, or a list as Megatron-LM's parser gives it)."""
    return {"window_size": None if window_size is None else (window_size, 0),
            "window_attn_skip_freq": list(skip_freq) if isinstance(skip_freq, tuple) else skip_freq}


def window_from_config(config) -> tuple[Optional[int], Optional[SkipFreq]]:
    """(left window, skip frequency) of a megatron-core ``TransformerConfig`` (Megatron-LM's own loop builds it from
    its parser), checked as the flags are: WindowFlagError for a right window, a negative one or a bad pattern."""
    size = getattr(config, "window_size", None)
    freq = getattr(config, "window_attn_skip_freq", None)
    if size is None and freq is None:
        return None, None
    left = None if size is None else parse_window_size(size)
    skip = None if freq is None else parse_skip_freq(freq)
    check_window(left, skip, int(config.num_layers))
    return left, skip


__all__ = ["SkipFreq", "WindowFlagError", "attended_pairs", "check_window", "is_windowed", "megatron_window_fields",
           "parse_skip_freq", "parse_window_size", "window_from_config", "windowed_layer_count"]
