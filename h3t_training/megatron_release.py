"""The Megatron-LM release a run's flags mean what they mean in: the one that ships with the installed megatron-core.

Users run this driver with the megatron-core of their Megatron-LM checkout (0.16 to 0.19), and a few of Megatron-LM's
flag semantics changed between those releases. Each change is one named constant here, with the release that made
it and the commit or file where it shows; the code that acts on the flag asks :func:`installed_megatron_core` there.
Reading the version from the package metadata imports nothing (the flag parser imports no torch).
"""
from __future__ import annotations

Release = tuple[int, int]

CORE_TOKENIZERS_FROM: Release = (0, 17)
"""Megatron-LM core_v0.17.0 removed the legacy tokenizer system (commit 3257093930 "fully remove legacy tokenizer
system"). Before it, 0.16 tokenizes the data (tools/preprocess_data.py's ``Encoder``, pretrain_gpt.py's
``core_gpt_dataset_config_from_args``) with ``megatron.core.tokenizers`` unless ``--legacy-tokenizer`` is given, and
always sizes the padded vocabulary with the legacy tokenizer (``global_vars._build_tokenizer``: SentencePieceTokenizer
counts the special pieces it adds, and TikTokenizer asserts a ``--tiktoken-pattern``); its core HuggingFace tokenizer
leaves the special tokens out unless ``--tokenizer-hf-include-special-tokens``. From 0.17 there is no
``--legacy-tokenizer``, and the HuggingFace tokenizer includes them unless ``--tokenizer-hf-no-include-special-tokens``
(``--tokenizer-hf-include-special-tokens`` is kept as a deprecated no-op)."""

HF_INCLUDE_SPECIAL_TOKENS_FLAG_UNTIL: Release = (0, 18)
"""Megatron-LM core_v0.18.0 no longer defines ``--tokenizer-hf-include-special-tokens`` (0.17's deprecated no-op)."""

NULL_TOKENIZER_EOD_IN_VOCAB_FROM: Release = (0, 18)
"""Megatron-LM core_v0.18.0 (commit c9dfe34 "Enable NullTokenizer for pretraining to reduce I/O access"): the
NullTokenizer's vocabulary is ``--vocab-size`` ids, the end of document the last (``--null-tokenizer-eod-id``), no
padding id; before it (0.16, 0.17) ``--vocab-size`` ids plus the end of document after them."""

SHARD_EVERYTHING_BY_DEFAULT_FROM: Release = (0, 18)
"""Megatron-LM core_v0.18.0's ``--data-parallel-sharding-strategy`` default is ``optim_grads_params`` (Megatron FSDP
shards the optimizer state, gradients and parameters); 0.16 and 0.17 default to ``no_shard``
(``megatron/training/arguments.py`` at each tag). It acts only with ``--use-megatron-fsdp``."""

ITERATIONS_TO_SKIP_COUNT_FROM_ONE_FROM: Release = (0, 17)
"""Megatron-LM core_v0.17.0 (commit b4e4d9618e "Small quality-of-life improvements in megatron/training") skips the
iteration whose number its log line prints (``(iteration + 1) in args.iterations_to_skip``); 0.16 compares the
count of iterations done before it (``iteration in args.iterations_to_skip``), so ``--iterations-to-skip 5`` skips the
iteration logged as 6 there."""


def installed_megatron_core() -> Release:
    """(major, minor) of the installed megatron-core, read from its package metadata."""
    from importlib.metadata import version

    major, minor = (int("".join(c for c in part if c.isdigit()) or 0)
                    for part in version("megatron-core").split(".")[:2])
    return major, minor


def first_skippable(release: Release) -> int:
    """The value of ``--iterations-to-skip`` that names the run's first iteration in ``release``: 1 (the logged
    number) from 0.17, 0 (the iterations done before it) in 0.16."""
    return 1 if release >= ITERATIONS_TO_SKIP_COUNT_FROM_ONE_FROM else 0


def skipped_iterations(values, release: Release) -> frozenset[int]:
    """The (1-based, as logged) iterations ``--iterations-to-skip values`` skips in ``release``."""
    return frozenset(v + 1 - first_skippable(release) for v in values)


def default_sharding_strategy(release: Release) -> str:
    """Megatron-LM's ``--data-parallel-sharding-strategy`` when the command line leaves it out, in ``release``."""
    return "optim_grads_params" if release >= SHARD_EVERYTHING_BY_DEFAULT_FROM else "no_shard"


__all__ = ["CORE_TOKENIZERS_FROM", "HF_INCLUDE_SPECIAL_TOKENS_FLAG_UNTIL", "ITERATIONS_TO_SKIP_COUNT_FROM_ONE_FROM", "NULL_TOKENIZER_EOD_IN_VOCAB_FROM",
           "Release", "SHARD_EVERYTHING_BY_DEFAULT_FROM", "default_sharding_strategy", "first_skippable",
           "installed_megatron_core", "skipped_iterations"]
