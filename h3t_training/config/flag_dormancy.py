"""Refused flags that change nothing on a given command line, as Megatron-LM reads them.

A flag of a feature this driver does not implement is refused (:mod:`~h3t_training.config.flag_rows`), but Megatron-LM
reads many such flags only while their feature is on: a MoE setting without ``--num-experts``, a YaRN setting without
``--position-embedding-type yarn``, a SentencePiece setting under a GPT-2 BPE tokenizer. A working Megatron-LM script
that carries one (scripts are often templates with every knob spelled out) trains the same model here, so such a flag
is noticed, not refused. So is a refused flag given its Megatron-LM default (``--softmax-type vanilla``).

Each group below names the flags, the condition under which Megatron-LM leaves them unread (a function of the parsed
command line and of the table-only flags' values), and the notice. Where the condition is read from
Megatron-LM's code it is cited (Megatron-LM core_v0.16.1 and core_v0.19.0, the releases users of megatron-core 0.16
to 0.19 run); a flag whose effect differs between them is left refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from h3t_training.config.flag_rows import MEGATRON_LM

Given = Callable[[str], Any]
"""The value a table-only flag was given on the command line (None when it was not)."""

SENTENCEPIECE = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")


def _flags(key: str, *, leave_out: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The flags of the table group ``key`` (``MEGATRON_LM``'s), less those starting with ``leave_out``."""
    return tuple(f for f in (t.split("=")[0] for t in MEGATRON_LM[key].split()) if not f.startswith(leave_out))


@dataclass(frozen=True)
class Dormancy:
    """Refused flags that Megatron-LM reads only while a feature is on: ``inert(args, given)`` is True where this
    command line leaves the feature off, and ``text`` is the notice then."""

    flags: tuple[str, ...]
    inert: Callable[[Any, Given], bool]
    text: str


def _tokenizer_in(*types: str) -> Callable[[Any, Given], bool]:
    return lambda args, given: args.tokenizer_type in types


DORMANCIES: dict[str, Dormancy] = {
    # megatron/core/transformer/moe: every MoE setting is read by the expert layers --num-experts builds; the
    # generalized tensor-parallel remat flags act on dense layers too (kept refused). Expert parallelism above 1
    # without experts is asserted by Megatron-LM: refused (flag_table.dormant).
    "experts": Dormancy(
        _flags("moe", leave_out=("--num-experts", "--gtp-")),
        lambda args, given: given("--num-experts") is None,
        "a MoE setting; without --num-experts the model has no expert layers and Megatron-LM ignores it too: "
        "same result"),
    # megatron/core/optimizer/__init__.py builds the optimizer --optimizer names; the others' settings are unread.
    "optimizer": Dormancy(
        ("--lion-beta1", "--lion-beta2", "--sgd-momentum") + tuple(
            f for f in _flags("optimizer") if f.startswith("--muon-")),
        lambda args, given: args.optimizer == "adam",
        "a setting of another optimizer; with --optimizer adam Megatron-LM ignores it too: same result"),
    # megatron/training/training.py: clip_qk() runs only under --qk-clip (0.19); its alpha and threshold nowhere else.
    "qk_clip": Dormancy(
        ("--qk-clip-alpha", "--qk-clip-threshold"),
        lambda args, given: given("--qk-clip") is None,
        "a --qk-clip setting; without --qk-clip Megatron-LM never clips the query and key weights: same result"),
    # transformer_config.py: the MuP widths, head scale and embedding multiplier are read inside `if self.use_mup`
    # (and training.py's optimizer overrides likewise); --mup-output-mult is not (language_module.py scales the
    # logits by it whenever it is not 1.0), so it stays refused unless given 1.0 (SAME_AS_DEFAULT).
    "mup": Dormancy(
        ("--mup-base-hidden-size", "--mup-base-head-dim", "--mup-attn-scale-power", "--mup-embedding-mult",
         "--mup-width-mult"),
        lambda args, given: given("--use-mup") is None,
        "a MuP setting; without --use-mup Megatron-LM reads it nowhere: same result"),
    # pretrain_gpt.py: the fill-in-the-middle settings go into the dataset config only `if args.fim_data`.
    "fim": Dormancy(
        tuple(f for f in _flags("data") if f.startswith("--fim-") and f != "--fim-data"),
        lambda args, given: given("--fim-data") is None,
        "a fill-in-the-middle setting; without --fim-data Megatron-LM builds plain GPT samples: same result"),
    # gpt_model.py: YarnRotaryEmbedding, the only reader of these in a GPT model without multi-latent attention, is
    # built for --position-embedding-type yarn.
    "yarn": Dormancy(
        ("--yarn-beta-fast", "--yarn-beta-slow", "--yarn-correction-range-round-to-int",
         "--no-yarn-correction-range-round-to-int", "--yarn-original-max-position-embeddings"),
        lambda args, given: args.position_embedding_type != "yarn",
        "a YaRN setting; Megatron-LM reads it only with --position-embedding-type yarn: same result"),
    # T5's relative position buckets (models/T5, examples/t5): a GPT model never reads them.
    "relative": Dormancy(
        ("--relative-attention-num-buckets", "--relative-attention-max-distance"),
        lambda args, given: args.position_embedding_type != "relative",
        "a T5 relative-position setting; Megatron-LM's GPT model never reads it: same result"),
    # Read only by Megatron-LM's legacy models (megatron/legacy/model, --use-legacy-models); megatron-core's
    # TransformerLayer and MLP never read them (core_v0.16.1 to core_v0.19.0), so a megatron-core GPT ignores them.
    "legacy_models": Dormancy(
        ("--openai-gelu", "--apply-residual-connection-post-layernorm"),
        lambda args, given: True,
        "read only by Megatron-LM's legacy models; the megatron-core GPT model it builds (and this driver builds) "
        "never reads it: same result"),
    # optimizer/__init__.py: these only move the query and key norms' parameters into the decayed group.
    "qk_layernorm_decay": Dormancy(
        ("--apply-wd-to-qk-layernorm", "--no-weight-decay-cond-type"),
        lambda args, given: not args.qk_layernorm,
        "weight decay of the query and key norms; without --qk-layernorm the model has none: same result"),
    # checkpointing.py: strict_fsdp_dtensor_load is read in the fsdp_dtensor branch of the checkpoint load only.
    "fsdp_dtensor": Dormancy(
        ("--no-strict-fsdp-dtensor-load", "--disable-strict-fsdp-dtensor-load"),
        lambda args, given: args.ckpt_format != "fsdp_dtensor",
        "a setting of --ckpt-format fsdp_dtensor loads; Megatron-LM reads it under no other format: same result"),
    # The tokenizer builders (0.16: megatron/training/tokenizer/tokenizer.py; 0.19:
    # megatron/core/tokenizers/utils/build_tokenizer.py) read each of these only for some --tokenizer-type.
    "sft_tokenizer": Dormancy(
        ("--sft-tokenizer-prompt-format",),
        lambda args, given: args.tokenizer_type != "SFTTokenizer",
        "SFTTokenizer's prompt format; Megatron-LM reads it under no other --tokenizer-type: same result"),
    "hf_tokenizer": Dormancy(
        ("--trust-remote-code", "--tokenizer-hf-no-use-fast"),
        _tokenizer_in(*SENTENCEPIECE, "NullTokenizer"),
        "a HuggingFace tokenizer setting; Megatron-LM's SentencePiece and Null tokenizers never read it: "
        "same result"),
    "sentencepiece_tokenizer": Dormancy(
        ("--tokenizer-sentencepiece-legacy", "--no-tokenizer-sentencepiece-ignore-extra-whitespaces",
         "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces"),
        _tokenizer_in("GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer"),
        "a SentencePiece tokenizer setting; Megatron-LM reads it under no other --tokenizer-type: same result"),
    "chat_template": Dormancy(
        ("--chat-template",),
        _tokenizer_in("GPT2BPETokenizer", "NullTokenizer"),
        "a chat template; Megatron-LM's GPT-2 BPE and Null tokenizers never read it: same result"),
    "null_tokenizer": Dormancy(
        ("--tokenizer-metadata", "--tokenizer-special-tokens"),
        _tokenizer_in("NullTokenizer"),
        "a tokenizer file setting; Megatron-LM's NullTokenizer reads no file: same result"),
    # 0.16 adds <extra_id_N> tokens for BERT's WordPiece and SentencePieceTokenizer only; 0.17+ read it nowhere.
    "vocab_extra_ids": Dormancy(
        ("--vocab-extra-ids",),
        _tokenizer_in("GPT2BPETokenizer", "HuggingFaceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                      "NullTokenizer"),
        "extra T5 sentinel tokens; Megatron-LM adds them under no GPT --tokenizer-type: same result"),
}
"""Each group of refused flags that changes nothing while its feature is off, with the condition and the notice."""

SAME_AS_DEFAULT: dict[str, object] = {
    "--softmax-type": "vanilla",
    "--rope-type": "rope",  # read only by multi-latent attention; Megatron-LM asserts it is rope without it
    "--vocab-extra-ids": 0,
    "--mup-output-mult": 1.0,
}
"""Refused flags given the value that is Megatron-LM's behaviour without them (``arguments.py``'s default, or the
only value Megatron-LM accepts for a GPT model): the same model."""


def _equal(text: Any, default: object) -> bool:
    text = str(text).strip().strip("'\"")
    if isinstance(default, str):
        return text == default
    try:
        return float(text) == float(default)
    except ValueError:
        return False


def inert_text(flag: str, args: Any, given: Given) -> Optional[str]:
    """The notice of a refused ``flag`` that changes nothing on this command line (``args``: the parsed flags;
    ``given``: a table-only flag's value), or None where it would change the model or the run."""
    if flag in SAME_AS_DEFAULT and _equal(given(flag), SAME_AS_DEFAULT[flag]):
        return f"given Megatron-LM's default ({SAME_AS_DEFAULT[flag]}), what this driver does: same result"
    for dormancy in DORMANCIES.values():
        if flag in dormancy.flags and dormancy.inert(args, given):
            return dormancy.text
    return None


DORMANT_EXPERTS = DORMANCIES["experts"].flags
DORMANT_OPTIMIZER = DORMANCIES["optimizer"].flags

__all__ = ["DORMANCIES", "DORMANT_EXPERTS", "DORMANT_OPTIMIZER", "Dormancy", "SAME_AS_DEFAULT", "inert_text"]
