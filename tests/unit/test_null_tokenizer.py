"""NullTokenizer as the Megatron-LM release of the installed megatron-core builds it: from 0.18 the end of document
is the last of --vocab-size ids (--null-tokenizer-eod-id / --null-tokenizer-pad-id), before it one id more."""
from __future__ import annotations

import argparse
from importlib.metadata import version

import pytest

from h3t_training.data.tokenizer import (NullTokenizer, TokenizerError, add_tokenizer_flags, padded_vocab_size,
                                         tokenizer_from_args)
from h3t_training.megatron_release import NULL_TOKENIZER_EOD_IN_VOCAB_FROM, installed_megatron_core


def test_megatron_lm_0_18_and_later_keep_the_end_of_document_inside_the_vocabulary():
    tok = NullTokenizer(128256, eod_in_vocab=True)
    assert (tok.vocab_size, tok.eod, tok.pad) == (128256, 128255, -1)
    assert padded_vocab_size(tok.vocab_size, 128, 1) == 128256  # Llama-3's vocabulary pads to itself
    assert tok.tokenize("3 4 99") == [3, 4, 99]


def test_megatron_lm_0_16_and_0_17_add_the_end_of_document_after_it():
    tok = NullTokenizer(128256, eod_in_vocab=False)
    assert (tok.vocab_size, tok.eod, tok.pad) == (128257, 128256, -1)
    assert padded_vocab_size(tok.vocab_size, 128, 1) == 128384


@pytest.mark.parametrize("eod_in_vocab", [True, False])
def test_named_end_of_document_and_padding_ids(eod_in_vocab):
    tok = NullTokenizer(100, eod_id=7, pad_id=9, eod_in_vocab=eod_in_vocab)
    assert (tok.eod, tok.pad, tok.vocab_size) == (7, 9, 100 if eod_in_vocab else 101)
    assert tok.unique_identifiers["eod_id"] == 7 and tok.unique_identifiers["pad_id"] == 9


@pytest.mark.parametrize("kwargs, message", [
    (dict(eod_id=100), "--null-tokenizer-eod-id 100 is outside [0, 99] (the NullTokenizer's ids)"),
    (dict(eod_id=-1), "--null-tokenizer-eod-id -1 is outside [0, 99]"),
    (dict(pad_id=-2), "--null-tokenizer-pad-id -2 is outside [0, 99] (the NullTokenizer's ids, or -1 for none)"),
])
def test_ids_outside_the_vocabulary_are_one_line_errors(kwargs, message):
    with pytest.raises(TokenizerError) as e:
        NullTokenizer(100, eod_in_vocab=True, **kwargs)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_pad_id_minus_one_is_none():
    assert NullTokenizer(100, pad_id=-1, eod_in_vocab=True).pad == -1


def test_the_installed_megatron_core_chooses_the_generation():
    installed = tuple(int(p) for p in version("megatron-core").split(".")[:2])
    assert installed_megatron_core() == installed
    tok = NullTokenizer(1000)
    assert tok.vocab_size == (1000 if installed >= NULL_TOKENIZER_EOD_IN_VOCAB_FROM else 1001)
    assert tok.eod == tok.vocab_size - 1


def test_the_flags_reach_the_tokenizer():
    parser = argparse.ArgumentParser()
    add_tokenizer_flags(parser)
    args = parser.parse_args(["--tokenizer-type", "NullTokenizer", "--vocab-size", "50",
                              "--null-tokenizer-eod-id", "3", "--null-tokenizer-pad-id", "4"])
    tok = tokenizer_from_args(args)
    assert (tok.eod, tok.pad) == (3, 4)
