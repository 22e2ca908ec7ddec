"""Resolve steps of the model's architecture flags beyond its sizes: the MLP activation Megatron-LM allows
(``--squared-relu``) and sliding-window attention (``--window-size``, ``--window-attn-skip-freq``, read by
:mod:`h3t_ext.attention_window`). Each problem is one :class:`~h3t_training.errors.ArgumentError` line."""
from __future__ import annotations

from h3t_ext.attention_window import WindowFlagError, check_window, parse_skip_freq, parse_window_size
from h3t_training.config.flag_table import table_value
from h3t_training.errors import ArgumentError


def check_activation(args):
    """Megatron-LM's rules for --squared-relu: it replaces GeLU, not SwiGLU (Megatron-LM asserts), and megatron-core
    fuses only GeLU and SwiGLU with the linear bias (its MLP raises on a squared ReLU with the fusion on, which
    Megatron-LM keeps on with linear biases unless --no-bias-gelu-fusion)."""
    if not args.squared_relu:
        return args
    if args.swiglu:
        raise ArgumentError("--squared-relu excludes --swiglu (pretrain_llama.py turns --swiglu on: train a "
                            "squared-ReLU model with pretrain_gpt.py)")
    if not args.disable_bias_linear and table_value(args, "--no-bias-gelu-fusion") is None:
        raise ArgumentError("--squared-relu with linear biases needs --no-bias-gelu-fusion (megatron-core fuses "
                            "only GeLU and SwiGLU with the bias), or --disable-bias-linear")
    return args


def resolve_window(args):
    """--window-size as megatron-core's (LEFT, 0) and --window-attn-skip-freq as an int or a 0/1 tuple
    (:mod:`h3t_ext.attention_window`, one line on a bad value); a frequency without a window is Megatron-LM's no-op,
    said in a notice. Context parallelism is refused with a window: the CPU ring attention has none, and the cost
    model does not price a windowed ring."""
    if args.window_size is None and args.window_attn_skip_freq is None:
        return args
    try:
        left = None if args.window_size is None else parse_window_size(args.window_size)
        freq = None if args.window_attn_skip_freq is None else parse_skip_freq(args.window_attn_skip_freq)
        check_window(left, freq, args.num_layers)
    except WindowFlagError as e:
        raise ArgumentError(str(e)) from None
    if left is None:
        return args.replace(window_attn_skip_freq=freq, flag_notices=(
            *args.flag_notices, "note: --window-attn-skip-freq: no effect without --window-size (Megatron-LM's layers "
                                "then all attend fully too): same result"))
    if (args.context_parallel_size or 1) > 1:
        raise ArgumentError(f"--window-size with --context-parallel-size {args.context_parallel_size}: context-parallel "
                            f"attention here is a causal ring without a sliding window; valid: "
                            f"--context-parallel-size 1")
    return args.replace(window_size=(left, 0), window_attn_skip_freq=freq)


__all__ = ["check_activation", "resolve_window"]
