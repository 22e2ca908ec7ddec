"""Megatron-LM's HuggingFaceTokenizer as it reads a tokenizer directory (transformers' AutoTokenizer): documents end
with the eos_token that special_tokens_map.json or tokenizer_config.json names, and a text is tokenized with the
special tokens the tokenizer's post-processor adds (a BOS), unless --tokenizer-hf-no-include-special-tokens (Megatron-LM
0.17+; 0.16 leaves them out unless --tokenizer-hf-include-special-tokens or --legacy-tokenizer)."""
from __future__ import annotations

import json
import subprocess

import numpy
import pytest

from driver_harness import PYTHON, REPO, _env
from h3t_training.data.tokenizer import TokenizerError, build_tokenizer

SPECIAL = ["<|endoftext|>", "<s>", "</s>", "<|eot|>"]
TEXT = "Return the number of items in a container."


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE tokenizer.json with four special tokens and a post-processor that starts a text with <s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [TEXT * 3, "a container of items, the number returned", "documents end with their end of text"] * 20
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    d = tmp_path_factory.mktemp("hf")
    tok.save(str(d / "tokenizer.json"))
    return d, tok


def _dir(tmp_path, bpe, **files) -> str:
    d = tmp_path / "tok"
    d.mkdir(parents=True)
    (d / "tokenizer.json").write_text((bpe[0] / "tokenizer.json").read_text())
    for name, content in files.items():
        (d / f"{name}.json").write_text(json.dumps(content))
    return str(d)


def test_the_eos_token_the_directory_names_ends_documents(tmp_path, bpe):
    tok = bpe[1]
    bare = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=_dir(tmp_path / "a", bpe))
    assert bare.eod == tok.token_to_id("<|endoftext|>")  # no config: the first end-of-text name the vocabulary has
    config = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=_dir(tmp_path / "b", bpe,
                                                                           tokenizer_config={"eos_token": "<|eot|>"}))
    assert config.eod == tok.token_to_id("<|eot|>")
    both = _dir(tmp_path / "c", bpe, tokenizer_config={"eos_token": "<|eot|>"},
                special_tokens_map={"eos_token": {"content": "</s>", "special": True}})
    assert build_tokenizer("HuggingFaceTokenizer", tokenizer_model=both).eod == tok.token_to_id("</s>")
    # the tokenizer.json file itself reads the same directory's files
    file = str(tmp_path / "b" / "tok" / "tokenizer.json")
    assert build_tokenizer("HuggingFaceTokenizer", tokenizer_model=file).eod == tok.token_to_id("<|eot|>")
    assert config.vocab_size == bare.vocab_size == tok.get_vocab_size(with_added_tokens=True)


def test_an_eos_token_outside_the_vocabulary_is_one_line(tmp_path, bpe):
    d = _dir(tmp_path, bpe, tokenizer_config={"eos_token": "<eos>"})
    with pytest.raises(TokenizerError) as e:
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=d)
    assert str(e.value) == f"--tokenizer-model {d}: its eos_token '<eos>' is not in {d}/tokenizer.json"


def test_texts_carry_the_post_processors_special_tokens_unless_told(tmp_path, bpe):
    d = _dir(tmp_path, bpe)
    bos = bpe[1].token_to_id("<s>")
    plain = bpe[1].encode(TEXT, add_special_tokens=False).ids
    assert build_tokenizer("HuggingFaceTokenizer", tokenizer_model=d).tokenize(TEXT) == [bos, *plain]
    assert build_tokenizer("HuggingFaceTokenizer", tokenizer_model=d,
                           hf_include_special_tokens=False).tokenize(TEXT) == plain
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps({"text": TEXT}) + "\n")
    from h3t_training.megatron_release import CORE_TOKENIZERS_FROM, installed_megatron_core

    if installed_megatron_core() < CORE_TOKENIZERS_FROM:  # 0.16: left out unless asked; the legacy one includes them
        cases = (([], plain), (["--tokenizer-hf-include-special-tokens"], [bos, *plain]),
                 (["--legacy-tokenizer"], [bos, *plain]))
    else:
        cases = (([], [bos, *plain]), (["--tokenizer-hf-no-include-special-tokens"], plain))
    for i, (extra, first) in enumerate(cases):
        out = tmp_path / f"out{i}"
        subprocess.run([PYTHON, str(REPO / "tools/preprocess_data.py"), "--input", str(src), "--output-prefix",
                        str(out), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", d, "--append-eod",
                        *extra], check=True, cwd=REPO, env=_env(), capture_output=True, timeout=120)
        from megatron.core.datasets.indexed_dataset import IndexedDataset
        eod = bpe[1].token_to_id("<|endoftext|>")
        ds = IndexedDataset(str(out) + "_text_document")  # held: the sample is a view of its memory map
        numpy.testing.assert_array_equal(ds[0], numpy.array([*first, eod]))
