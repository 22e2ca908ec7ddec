"""Megatron's TikTokenizer (h3t_training/data/tiktoken_vocab.py) on a vocabulary trained here: the id layout
(special tokens first, the BPE ranks after them, cut to --vocab-size), what differs between megatron.core.tokenizers'
and Megatron-LM 0.16's legacy one, and one-line errors for bad files and settings."""
import json

import pytest

from h3t_training.data.tiktoken_vocab import PATTERNS, TikTokenError, TikTokenizer
from h3t_training.data.tokenizer import TokenizerError, build_tokenizer
from tiktoken_files import train_ranks, write_vocab

TEXT = ("def tokenize(text):\n    return the tokens of the text, the tokens the model reads\n" * 8
        + "The TokenizerReads ThisText. Then the other thing.\n" * 4)


@pytest.fixture(scope="module")
def ranks():
    return train_ranks([TEXT], 300, PATTERNS["v2"])


@pytest.fixture
def vocab(tmp_path, ranks):
    return str(write_vocab(ranks, tmp_path / "vocab.json"))


def _tok(path, **kw):
    kw = {"pattern": "v2", "vocab_size": 310, "num_special_tokens": 10, **kw}
    return TikTokenizer(path, **kw)


def test_ids_are_the_ranks_after_the_special_tokens(vocab, ranks):
    tok = _tok(vocab)
    assert (tok.vocab_size, tok.bos, tok.eod, tok.pad) == (310, 1, 2, 4)
    ids = tok.tokenize("the tokens")
    assert min(ids) >= 10 and max(ids) < 310 and len(ids) < len("the tokens") / 2  # merged, not bytes
    assert b"".join(ranks[i - 10] for i in ids) == b"the tokens"
    assert tok.tokenize("~") == [10 + ord("~")]  # a byte no merge touches: its byte's rank after the specials
    assert tok.detokenize(ids + [tok.eod]) == "the tokens"


def test_vocab_size_cuts_the_ranks(vocab):
    cut = _tok(vocab, vocab_size=266)  # the bytes alone
    assert cut.tokenize("the") == [10 + b for b in b"the"]
    assert max(_tok(vocab).tokenize(TEXT)) >= 266


def test_the_two_systems_differ_where_megatron_lm_does(vocab):
    legacy, core = _tok(vocab, legacy=True), _tok(vocab)
    assert legacy.pad == -1 and core.pad == 4
    # the legacy one encodes special tokens written in a text as text; megatron.core.tokenizers' as the tokens
    assert core.tokenize("<s>x") == [1, *core.tokenize("x")]
    assert 1 not in legacy.tokenize("<s>x") and 4 not in legacy.tokenize("<pad>")
    assert legacy.detokenize(legacy.tokenize("<s>x<pad>")) == "<s>x<pad>"
    assert legacy.tokenize(TEXT) == core.tokenize(TEXT)  # no special token in it: the same ids
    # the legacy one (and 0.16's pretraining, which builds it for the vocabulary) requires the pattern; else v2
    for kw in ({"legacy": True}, {"pattern_required": True}):
        with pytest.raises(TikTokenError, match=r"needs --tiktoken-pattern \{v1,v2\}"):
            TikTokenizer(vocab, vocab_size=310, num_special_tokens=10, **kw)
    default = TikTokenizer(vocab, vocab_size=310, num_special_tokens=10)
    assert default.tokenize(TEXT) == core.tokenize(TEXT)


def test_patterns_split_differently(tmp_path):
    # one merge, "rR": v1 keeps a run of letters whole, so it applies; v2 splits at the case change first
    path = str(write_vocab([bytes([i]) for i in range(256)] + [b"rR"], tmp_path / "rr.json"))
    v1, v2 = (_tok(path, pattern=p, vocab_size=267) for p in ("v1", "v2"))
    assert v1.tokenize("TokenizerReads")[8] == 10 + 256 and len(v1.tokenize("TokenizerReads")) == 13
    assert v2.tokenize("TokenizerReads") == [10 + b for b in b"TokenizerReads"]
    assert v1.detokenize(v1.tokenize("TokenizerReads")) == "TokenizerReads"


def _bad(tmp_path, content, name="v.json"):
    p = tmp_path / name
    p.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(p)


def _entry(i, b=None):
    import base64
    b = bytes([i]) if b is None else b
    return {"rank": i, "token_bytes": base64.b64encode(b).decode(), "token_str": ""}


@pytest.mark.parametrize("content, name, message", [
    ("[]", "v.txt", r"reads a \.json vocabulary"),
    ("{not json", "v.json", r"is not a JSON file"),
    ({"a": 1}, "v.json", r"a TikTokenizer vocabulary is a JSON list, got dict"),
    ([{"rank": 0}], "v.json", r"entry 0 must be \{rank: 0, token_bytes, token_str\}"),
    ([_entry(0), {"rank": 2, "token_bytes": "", "token_str": ""}], "v.json", r"entry 1 must be \{rank: 1"),
    ([_entry(0), {"rank": 1, "token_bytes": "!!", "token_str": ""}], "v.json", r"entry 1's token_bytes is not base64"),
    ([_entry(0), _entry(1, b"a")], "v.json", r"entry 1 must be the single byte 1"),
    ([_entry(i) for i in range(256)] + [_entry(256, b"\x00")], "v.json", r"entry 256 repeats entry 0's bytes"),
    ([_entry(i) for i in range(256)], "v.json", r"has 256 entries; --vocab-size 310 with 10 special tokens needs 300"),
])
def test_bad_vocabulary_files_are_one_line(tmp_path, content, name, message):
    with pytest.raises(TikTokenError, match=message) as e:
        _tok(_bad(tmp_path, content, name))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kw, message", [
    ({"num_special_tokens": 2}, r"--tiktoken-num-special-tokens 2 is outside \[7, 309\]"),
    ({"num_special_tokens": 310}, r"--tiktoken-num-special-tokens 310 is outside \[7, 309\]"),
    ({"pattern": "v3"}, r"--tiktoken-pattern 'v3' is not one of v1, v2"),
])
def test_bad_settings_are_one_line(vocab, kw, message):
    with pytest.raises(TikTokenError, match=message):
        _tok(vocab, **kw)
    if "num_special_tokens" in kw and kw["num_special_tokens"] == 2:  # the legacy one names three special tokens
        with pytest.raises(TikTokenError, match=r"outside \[3, 309\]"):
            _tok(vocab, legacy=True, **kw)
        assert _tok(vocab, legacy=True, num_special_tokens=3, vocab_size=303).tokenize("~") == [3 + ord("~")]


def test_build_tokenizer_names_the_flag(tmp_path, vocab):
    with pytest.raises(TokenizerError, match=r"^--tokenizer-type TikTokenizer needs --tokenizer-model PATH$"):
        build_tokenizer("TikTokenizer")
    tok = build_tokenizer("TikTokenizer", 310, tokenizer_model=vocab, tiktoken_pattern="v2",
                          tiktoken_num_special_tokens=10)
    assert tok.vocab_size == 310 and tok.unique_identifiers["class"] == "TikTokenizer"
    with pytest.raises(TokenizerError, match=r"needs 131062"):  # Megatron's default vocabulary: 2**17 ids
        build_tokenizer("TikTokenizer", tokenizer_model=vocab, tiktoken_pattern="v2", tiktoken_num_special_tokens=10)
