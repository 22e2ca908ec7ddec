"""Tokenizers named by Megatron's ``--tokenizer-type``, all from local files (no model hub).

Each carries what megatron-core's GPT datasets and the driver read (``vocab_size``, ``eod``,
``pad``, ``unique_identifiers``) and ``tokenize``/``detokenize`` for tools/preprocess_data.py.

=========================  ===================================================================
``--tokenizer-type``       files
=========================  ===================================================================
``HuggingFaceTokenizer``   ``--tokenizer-model``: a ``tokenizer.json`` or a directory holding one
                           (read with the ``tokenizers`` package; a directory without one is
                           read with ``transformers`` when that is installed)
``GPT2BPETokenizer``       ``--vocab-file`` (vocab.json) and ``--merge-file`` (merges.txt):
                           byte-level BPE, end of document ``<|endoftext|>``
``SentencePieceTokenizer`` ``--tokenizer-model``: a SentencePiece ``.model`` file
``GPTSentencePieceTokenizer`` ``--tokenizer-model``: as ``SentencePieceTokenizer`` (Megatron's: the model's
                           pieces, end of document its ``</s>``)
``Llama2Tokenizer``        ``--tokenizer-model``: as ``SentencePieceTokenizer``, and each text tokenized
                           starts with the model's BOS (Megatron's ``tokenize(s, bos=True)``)
``NullTokenizer``          none: text is whitespace-separated ids; ``--vocab-size`` of them, the end of
                           document the last (``--null-tokenizer-eod-id``) from Megatron-LM 0.18, one more
                           before it (:class:`NullTokenizer`)
``TikTokenizer``           ``--tokenizer-model``: Megatron's tiktoken JSON vocabulary, with
                           ``--tiktoken-pattern``, ``--tiktoken-num-special-tokens`` and
                           ``--vocab-size`` (:mod:`h3t_training.data.tiktoken_vocab`)
``ByteTokenizer``          none: UTF-8 bytes (h3t-ext's own, the default)
=========================  ===================================================================

Megatron's other names (:data:`REFUSED_TOKENIZER_TYPES`: BERT's WordPiece, multimodal, SFT) are
one line saying why, as is a name Megatron does not have.

Where a tokenizer has no end-of-document token of its own, one id is appended after its
vocabulary (``vocab_size`` grows by one), as Megatron does for SentencePiece.
"""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import Optional

import numpy

from h3t_training import megatron_release
from h3t_training.data.tiktoken_vocab import DEFAULT_NUM_SPECIAL_TOKENS, TikTokenError, TikTokenizer
from h3t_training.megatron_release import CORE_TOKENIZERS_FROM, HF_INCLUDE_SPECIAL_TOKENS_FLAG_UNTIL, \
    NULL_TOKENIZER_EOD_IN_VOCAB_FROM

TOKENIZER_TYPES = ("ByteTokenizer", "NullTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer",
                   "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "TikTokenizer")
_BERT = "BERT's WordPiece vocabulary and its special tokens are not implemented; its ids would differ"
REFUSED_TOKENIZER_TYPES = {
    "BertWordPieceCase": _BERT, "BertWordPieceLowerCase": _BERT,
    "MultimodalTokenizer": "multimodal tokenizers belong to other Megatron-LM models",
    "NullMultimodalTokenizer": "multimodal tokenizers belong to other Megatron-LM models",
    "SFTTokenizer": "supervised fine-tuning chat templates are not implemented",
}
"""Megatron-LM's other ``--tokenizer-type`` names, each with why it is refused (one line, not argparse's
"invalid choice")."""
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<eod>")
"""End-of-document spellings looked up, in order, in a vocabulary that does not name its own."""


class TokenizerError(ValueError):
    """Tokenizer files that cannot be used; one line naming the flag and the file."""


class ByteTokenizer:
    """UTF-8 bytes 0..255, then end-of-document 256 and padding 257."""

    def __init__(self) -> None:
        self.vocab_size = 258
        self.eod = 256
        self.pad = 257
        self.unique_identifiers = OrderedDict(**{"class": type(self).__name__})

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class NullTokenizer:
    """Megatron's NullTokenizer: text is whitespace-separated integer ids. ``eod_in_vocab`` (Megatron-LM 0.18+, the
    default where the installed megatron-core is: :data:`NULL_TOKENIZER_EOD_IN_VOCAB_FROM`): ``vocab_size`` ids, the
    end of document the last of them unless ``eod_id`` names another; else (0.16, 0.17) one id more, the end of
    document that one. ``pad_id``: -1 (none) unless given; megatron-core's GPT datasets leave labels equal to it out
    of the loss."""

    def __init__(self, vocab_size: int, *, eod_id: Optional[int] = None, pad_id: Optional[int] = None,
                 eod_in_vocab: Optional[bool] = None) -> None:
        if eod_in_vocab is None:
            eod_in_vocab = megatron_release.installed_megatron_core() >= NULL_TOKENIZER_EOD_IN_VOCAB_FROM
        if vocab_size < 1 + (eod_id is None and eod_in_vocab):
            raise TokenizerError(f"--vocab-size {vocab_size} is outside [{1 + (eod_id is None and eod_in_vocab)}, inf) "
                                 "for --tokenizer-type NullTokenizer")
        self.vocab_size = vocab_size if eod_in_vocab else vocab_size + 1
        for flag, value in (("--null-tokenizer-eod-id", eod_id), ("--null-tokenizer-pad-id", pad_id)):
            if value is not None and not (flag.endswith("pad-id") and value == -1) and not 0 <= value < self.vocab_size:
                raise TokenizerError(f"{flag} {value} is outside [0, {self.vocab_size - 1}] (the NullTokenizer's "
                                     f"ids{', or -1 for none' if flag.endswith('pad-id') else ''})")
        self.eod = self.vocab_size - 1 if eod_id is None else eod_id
        self.pad = -1 if pad_id is None else pad_id
        self.unique_identifiers = OrderedDict(**{"class": type(self).__name__, "vocab_size": self.vocab_size,
                                                 "eod_id": self.eod, "pad_id": self.pad})

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in numpy.asarray(ids).ravel())


class _FastTokenizer:
    """A ``tokenizers.Tokenizer`` (HuggingFace tokenizer.json, or GPT-2 byte-level BPE files)."""

    def __init__(self, tok, kind: str, source: str, eod_token: Optional[str] = None,
                 include_special_tokens: bool = False) -> None:
        self._tok = tok
        self._special = include_special_tokens
        size = tok.get_vocab_size(with_added_tokens=True)
        eod = None
        for name in ((eod_token,) if eod_token else EOD_CANDIDATES):
            eod = tok.token_to_id(name)
            if eod is not None:
                break
        self.eod = size if eod is None else eod  # no end-of-document token: one id after the vocabulary
        self.vocab_size = size + (eod is None)
        self.pad = self.eod
        self.unique_identifiers = OrderedDict(**{"class": kind, "source": os.path.abspath(source)})

    def tokenize(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=self._special).ids)

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in numpy.asarray(ids).ravel() if int(i) != self.eod])


class _TransformersTokenizer:
    """A tokenizer directory ``transformers.AutoTokenizer`` reads (local files only)."""

    def __init__(self, path: str, include_special_tokens: bool = True) -> None:
        from transformers import AutoTokenizer  # optional dependency

        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self._special = include_special_tokens
        eos = self._tok.eos_token_id
        self.vocab_size = len(self._tok) + (eos is None)
        self.eod = len(self._tok) if eos is None else eos
        self.pad = self.eod
        self.unique_identifiers = OrderedDict(**{"class": "HuggingFaceTokenizer", "source": os.path.abspath(path)})

    def tokenize(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=self._special))

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in numpy.asarray(ids).ravel() if int(i) != self.eod])


class SentencePieceTokenizer:
    """A SentencePiece model; end of document is its ``</s>`` (or one id after the vocabulary)."""

    def __init__(self, model_file: str) -> None:
        import sentencepiece

        self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        size, eos = self._sp.get_piece_size(), self._sp.eos_id()
        self.eod = size if eos < 0 else eos
        self.vocab_size = size + (eos < 0)
        self.pad = self.eod
        self.unique_identifiers = OrderedDict(**{"class": type(self).__name__, "source": os.path.abspath(model_file)})

    def tokenize(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def detokenize(self, ids) -> str:
        return self._sp.decode([int(i) for i in numpy.asarray(ids).ravel() if int(i) != self.eod])


class LegacySentencePieceTokenizer:
    """Megatron-LM 0.16's legacy ``SentencePieceTokenizer`` (its ``_SentencePieceTokenizer``: the data's tokenizer
    with ``--legacy-tokenizer``, and the padded vocabulary's in 0.16's pretraining always; otherwise the type is the
    model's pieces, as :class:`SentencePieceTokenizer`): after the model's pieces come ``<CLS>``, ``<SEP>``,
    ``<EOD>``, ``<MASK>`` and the padding, BOS and EOS pieces (``<PAD>``, ``<BOS>``, ``<EOS>`` where the model has no
    such id), each only where the model lacks that piece; documents end with ``<EOD>``; a text is split at every
    occurrence of one of those special pieces, which keeps its own id, and the rest is the model's encoding."""

    SPECIALS = ("<CLS>", "<SEP>", "<EOD>", "<MASK>")

    def __init__(self, model_file: str) -> None:
        import sentencepiece

        self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self._pieces = self._sp.get_piece_size()
        vocab = {self._sp.id_to_piece(i): i for i in range(self._pieces)}
        self.special_ids: dict[str, int] = {}
        for token in (*self.SPECIALS, *(self._piece(i, default) for i, default in (
                (self._sp.pad_id(), "<PAD>"), (self._sp.bos_id(), "<BOS>"), (self._sp.eos_id(), "<EOS>")))):
            self.special_ids[token] = vocab.setdefault(token, len(vocab))
        self.vocab_size = len(vocab)
        self.eod = self.special_ids["<EOD>"]
        self.pad = -1  # Megatron's GPT datasets take no padding id from it (the <PAD> piece is not one)
        self._names = {i: t for t, i in self.special_ids.items()}
        self.unique_identifiers = OrderedDict(**{"class": "SentencePieceTokenizer", "legacy": True,
                                                 "source": os.path.abspath(model_file)})

    def _piece(self, piece_id: int, default: str) -> str:
        return self._sp.id_to_piece(piece_id) if 0 <= piece_id < self._pieces else default

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        while True:
            found = [(text.find(t), order, t) for order, t in enumerate(self.special_ids) if t in text]
            if not found:
                return ids + list(self._sp.encode(text))
            at, _, token = min(found)  # the earliest special piece (the first of the set where two start together)
            ids += [*self._sp.encode(text[:at]), self.special_ids[token]]
            text = text[at + len(token):]

    def detokenize(self, ids) -> str:
        out, run = [], []
        for i in (int(i) for i in numpy.asarray(ids).ravel() if int(i) != self.eod):
            if i < self._pieces:
                run.append(i)
                continue
            out += [self._sp.decode(run), self._names.get(i, "")]
            run = []
        return "".join([*out, self._sp.decode(run)])


class Llama2Tokenizer(SentencePieceTokenizer):
    """Megatron's Llama2Tokenizer: a SentencePiece model. megatron.core.tokenizers' (0.17+, and 0.16 without
    ``--legacy-tokenizer``) is the plain SentencePiece encoding, as GPTSentencePieceTokenizer's; 0.16's legacy
    ``_Llama2Tokenizer`` (``with_bos``: ``--legacy-tokenizer``) starts each text with the model's BOS (``tokenize(s,
    bos=True, eos=False)``; tools/preprocess_data.py then appends the end of document)."""

    def __init__(self, model_file: str, with_bos: bool = False) -> None:
        super().__init__(model_file)
        self.bos = self._sp.bos_id()
        self.with_bos = with_bos
        if self.with_bos and self.bos < 0:
            raise TokenizerError(f"--tokenizer-model {model_file} has no BOS piece; Llama2Tokenizer starts every "
                                 "text with one (use --tokenizer-type GPTSentencePieceTokenizer)")

    def tokenize(self, text: str) -> list[int]:
        return [self.bos, *self._sp.encode(text)] if self.with_bos else list(self._sp.encode(text))

    def detokenize(self, ids) -> str:
        return super().detokenize([i for i in numpy.asarray(ids).ravel() if int(i) != self.bos])


def _need_file(flag: str, path: Optional[str], tokenizer_type: str) -> str:
    if path is None:
        raise TokenizerError(f"--tokenizer-type {tokenizer_type} needs {flag} PATH")
    if not os.path.exists(path):
        raise TokenizerError(f"{flag} {path} does not exist")
    return path


HF_SPECIAL_TOKEN_FILES = ("special_tokens_map.json", "tokenizer_config.json")
"""Where a HuggingFace tokenizer directory names its special tokens, the first file that names one winning (as
``transformers``' ``from_pretrained`` lets the special-tokens map override the tokenizer config)."""


def hf_eos_token(directory: str) -> Optional[str]:
    """The ``eos_token`` a HuggingFace tokenizer directory names (a string, or an added-token object's ``content``):
    Megatron-LM's HuggingFaceTokenizer ends documents with it (its ``eod`` is ``transformers``' ``eos_token_id``)."""
    for name in HF_SPECIAL_TOKEN_FILES:
        file = os.path.join(directory, name)
        if not os.path.isfile(file):
            continue
        try:
            with open(file, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token")
        except (OSError, ValueError, AttributeError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise TokenizerError(f"{file} is not a JSON object ({why})") from None
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str):
            return eos
    return None


def _huggingface(path: str, include_special_tokens: bool = True):
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "tokenizer.json")):
        try:
            return _TransformersTokenizer(path, include_special_tokens)
        except ImportError:
            raise TokenizerError(f"--tokenizer-model {path}: no tokenizer.json in the directory, and reading "
                                 f"other tokenizer formats needs the 'transformers' package") from None
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    from tokenizers import Tokenizer

    eos = hf_eos_token(os.path.dirname(os.path.abspath(file)))
    try:
        tok = Tokenizer.from_file(file)
    except Exception as e:  # the tokenizers package raises its own exception types
        raise TokenizerError(f"--tokenizer-model {file} is not a tokenizer.json the tokenizers package reads "
                             f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if eos is not None and tok.token_to_id(eos) is None:
        raise TokenizerError(f"--tokenizer-model {path}: its eos_token {eos!r} is not in {file}")
    return _FastTokenizer(tok, "HuggingFaceTokenizer", file, eod_token=eos,
                          include_special_tokens=include_special_tokens)


def _gpt2_bpe(vocab_file: str, merge_file: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    try:
        with open(vocab_file, encoding="utf-8") as f:
            json.load(f)
        bpe = models.BPE.from_file(vocab_file, merge_file)
    except Exception as e:
        raise TokenizerError(f"--vocab-file {vocab_file} / --merge-file {merge_file} are not GPT-2 BPE files "
                             f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return _FastTokenizer(tok, "GPT2BPETokenizer", vocab_file, eod_token="<|endoftext|>")


def build_tokenizer(tokenizer_type: str, vocab_size: Optional[int] = None, *, tokenizer_model: Optional[str] = None,
                    vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
                    null_tokenizer_eod_id: Optional[int] = None, null_tokenizer_pad_id: Optional[int] = None,
                    hf_include_special_tokens: bool = True, tiktoken_pattern: Optional[str] = None,
                    tiktoken_num_special_tokens: int = DEFAULT_NUM_SPECIAL_TOKENS, legacy: bool = False,
                    legacy_vocabulary: bool = False, tiktoken_pattern_required: bool = False):
    """The tokenizer named by ``--tokenizer-type``; :class:`TokenizerError` (one line) on bad files. ``legacy``:
    Megatron-LM 0.16's legacy tokenizer (``--legacy-tokenizer``) tokenizes; ``legacy_vocabulary``: its vocabulary
    sizes the model (0.16's pretraining); ``tiktoken_pattern_required``: that legacy TikTokenizer is built."""
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise TokenizerError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size, eod_id=null_tokenizer_eod_id, pad_id=null_tokenizer_pad_id)
    if tokenizer_type == "HuggingFaceTokenizer":
        return _huggingface(_need_file("--tokenizer-model", tokenizer_model, tokenizer_type), hf_include_special_tokens)
    if tokenizer_type == "GPT2BPETokenizer":
        return _gpt2_bpe(_need_file("--vocab-file", vocab_file, tokenizer_type),
                         _need_file("--merge-file", merge_file, tokenizer_type))
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        path = _need_file("--tokenizer-model", tokenizer_model, tokenizer_type)
        try:
            if tokenizer_type == "Llama2Tokenizer":
                tok = Llama2Tokenizer(path, with_bos=legacy)
            elif tokenizer_type == "SentencePieceTokenizer" and legacy:
                tok = LegacySentencePieceTokenizer(path)
            else:
                tok = SentencePieceTokenizer(path)
                if tokenizer_type == "SentencePieceTokenizer" and legacy_vocabulary:
                    tok.vocab_size = LegacySentencePieceTokenizer(path).vocab_size  # the model's rows, not the data's
        except (OSError, RuntimeError) as e:
            raise TokenizerError(f"--tokenizer-model {path} is not a SentencePiece model "
                                 f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        tok.unique_identifiers["class"] = tokenizer_type
        return tok
    if tokenizer_type == "TikTokenizer":
        path = _need_file("--tokenizer-model", tokenizer_model, tokenizer_type)
        try:
            return TikTokenizer(path, pattern=tiktoken_pattern, vocab_size=vocab_size,
                                num_special_tokens=tiktoken_num_special_tokens, legacy=legacy,
                                pattern_required=tiktoken_pattern_required)
        except TikTokenError as e:
            raise TokenizerError(str(e)) from None
    if tokenizer_type in REFUSED_TOKENIZER_TYPES:
        raise TokenizerError(f"--tokenizer-type {tokenizer_type} is not supported: "
                             f"{REFUSED_TOKENIZER_TYPES[tokenizer_type]} (instead: one of {', '.join(TOKENIZER_TYPES)})")
    raise TokenizerError(f"--tokenizer-type {tokenizer_type!r} is not one of {', '.join(TOKENIZER_TYPES)}")


def release_tokenizer_flags(args, release: megatron_release.Release) -> None:
    """Refuse, in one line, a tokenizer flag that ``release``'s Megatron-LM does not define (its parser would stop
    there): ``--legacy-tokenizer`` before 0.17 only, ``--tokenizer-hf-include-special-tokens`` before 0.18 only,
    ``--tokenizer-hf-no-include-special-tokens`` from 0.17 only."""
    installed = ".".join(map(str, release))
    if args.legacy_tokenizer and release >= CORE_TOKENIZERS_FROM:
        raise TokenizerError(f"--legacy-tokenizer: Megatron-LM 0.17 removed the legacy tokenizers (the installed "
                             f"megatron-core is {installed}); leave it out")
    if args.tokenizer_hf_include_special_tokens and release >= HF_INCLUDE_SPECIAL_TOKENS_FLAG_UNTIL:
        raise TokenizerError(f"--tokenizer-hf-include-special-tokens: Megatron-LM 0.18 removed it (the installed "
                             f"megatron-core is {installed}); special tokens are included unless "
                             "--tokenizer-hf-no-include-special-tokens")
    if args.tokenizer_hf_no_include_special_tokens and release < CORE_TOKENIZERS_FROM:
        raise TokenizerError(f"--tokenizer-hf-no-include-special-tokens is Megatron-LM 0.17's (the installed "
                             f"megatron-core is {installed}); 0.16 leaves special tokens out unless "
                             "--tokenizer-hf-include-special-tokens")


def tokenizer_from_args(args, *, pretraining: bool = True):
    """The tokenizer of a parsed command line (the driver's, ``pretraining``, or tools/preprocess_data.py's), as the
    installed megatron-core's Megatron-LM builds it (:data:`~h3t_training.megatron_release.CORE_TOKENIZERS_FROM`):
    its tokenizer system, the HuggingFace special tokens' default, and in 0.16's pretraining the legacy
    tokenizer's vocabulary."""
    release = megatron_release.installed_megatron_core()
    release_tokenizer_flags(args, release)
    legacy = bool(args.legacy_tokenizer)
    before_core = release < CORE_TOKENIZERS_FROM
    if before_core:
        include = legacy or bool(args.tokenizer_hf_include_special_tokens)  # the legacy one always includes them
    else:
        include = not args.tokenizer_hf_no_include_special_tokens
    return build_tokenizer(args.tokenizer_type, args.vocab_size, tokenizer_model=args.tokenizer_model,
                           vocab_file=args.vocab_file, merge_file=args.merge_file,
                           null_tokenizer_eod_id=args.null_tokenizer_eod_id,
                           null_tokenizer_pad_id=args.null_tokenizer_pad_id,
                           hf_include_special_tokens=include, tiktoken_pattern=args.tiktoken_pattern,
                           tiktoken_num_special_tokens=(DEFAULT_NUM_SPECIAL_TOKENS if args.tiktoken_num_special_tokens
                                                        is None else args.tiktoken_num_special_tokens),
                           legacy=legacy, legacy_vocabulary=pretraining and before_core,
                           tiktoken_pattern_required=legacy or (pretraining and before_core))


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_model_parallel_size: int) -> int:
    """Megatron's padding: a multiple of ``--make-vocab-size-divisible-by`` x TP size."""
    q = divisible_by * tensor_model_parallel_size
    return -(-vocab_size // q) * q


def run_padded_vocab_size(config) -> int:
    """The run's padded vocabulary: :func:`padded_vocab_size` of the tokenizer's V, which the driver's config read
    once (``tokenizer_vocab_size``), at its ``--make-vocab-size-divisible-by`` and tensor-parallel size."""
    return padded_vocab_size(config.tokenizer_vocab_size, config.make_vocab_size_divisible_by,
                             config.tensor_model_parallel_size)


def add_tokenizer_flags(group, *, default: str = "ByteTokenizer") -> None:
    """Megatron's tokenizer flags, shared by the driver and tools/preprocess_data.py."""
    group.add_argument("--tokenizer-type", default=default, metavar="{" + ",".join(TOKENIZER_TYPES) + "}",
                       help="checked when the tokenizer is built: Megatron's other names are one line saying why")
    group.add_argument("--tokenizer-model", default=None,
                       help="tokenizer.json (or its directory), a SentencePiece .model file, or a TikTokenizer .json")
    group.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT-2 BPE merges.txt")
    group.add_argument("--vocab-size", type=int, default=None,
                       help="vocabulary of NullTokenizer, and of TikTokenizer (default 131072)")
    group.add_argument("--tiktoken-pattern", default=None, metavar="{v1,v2}",
                       help="TikTokenizer's split before the merges (Megatron-LM 0.16 requires it; 0.17+ default v2)")
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=None,
                       help=f"TikTokenizer's special tokens before the BPE ranks (default {DEFAULT_NUM_SPECIAL_TOKENS})")
    group.add_argument("--tokenizer-hf-no-include-special-tokens", action="store_true",
                       help="HuggingFaceTokenizer: tokenize without the special tokens its post-processor adds (a "
                            "BOS); Megatron-LM 0.17+'s default includes them")
    group.add_argument("--tokenizer-hf-include-special-tokens", action="store_true",
                       help="HuggingFaceTokenizer in Megatron-LM 0.16 (0.17: a no-op; 0.18 removed it): tokenize with "
                            "the special tokens its post-processor adds")
    group.add_argument("--legacy-tokenizer", action="store_true",
                       help="Megatron-LM 0.16: tokenize with its legacy tokenizers (0.17 removed them)")
    group.add_argument("--null-tokenizer-eod-id", type=int, default=None,
                       help="NullTokenizer's end-of-document id (default: its last id)")
    group.add_argument("--null-tokenizer-pad-id", type=int, default=None,
                       help="NullTokenizer's padding id, whose labels the loss leaves out (default: -1, none)")


__all__ = ["REFUSED_TOKENIZER_TYPES", "TOKENIZER_TYPES", "TokenizerError", "add_tokenizer_flags", "build_tokenizer",
           "padded_vocab_size", "release_tokenizer_flags", "run_padded_vocab_size", "tokenizer_from_args"]
