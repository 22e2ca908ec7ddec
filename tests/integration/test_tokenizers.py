"""Megatron's tokenizer types from files made here (BPE and SentencePiece trained on the project's
corpus): tools/preprocess_data.py writes what megatron-core reads, and the driver trains on it."""
from __future__ import annotations

import json
import subprocess

import numpy
import pytest

from driver_harness import PYTHON, REPO, TINY_MODEL, _env, check_ok, losses, run_pretrain
from h3t_training.data.tokenizer import TokenizerError, build_tokenizer

BPE_VOCAB = 400
SP_VOCAB = 300


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The stdlib corpus, a byte-level BPE (tokenizer.json and GPT-2 vocab/merges) and a SentencePiece model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    import sentencepiece

    d = tmp_path_factory.mktemp("tok")
    corpus = d / "corpus.jsonl"
    subprocess.run([PYTHON, str(REPO / "tools/make_stdlib_corpus.py"), "--output", str(corpus), "--min-bytes",
                    "100000"], check=True, cwd=REPO, env=_env(), capture_output=True, timeout=300)
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    (d / "corpus.txt").write_text("\n".join(texts))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=BPE_VOCAB, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(d / "tokenizer.json"))
    tok.model.save(str(d))  # GPT-2 files: vocab.json, merges.txt
    sentencepiece.SentencePieceTrainer.train(input=str(d / "corpus.txt"), model_prefix=str(d / "sp"),
                                             vocab_size=SP_VOCAB, minloglevel=2)
    return d


def _flags(kind: str, d) -> list[str]:
    return {
        "ByteTokenizer": ["--tokenizer-type", "ByteTokenizer"],
        "HuggingFaceTokenizer": ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(d / "tokenizer.json")],
        "GPT2BPETokenizer": ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(d / "vocab.json"),
                             "--merge-file", str(d / "merges.txt")],
        "SentencePieceTokenizer": ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(d / "sp.model")],
        "Llama2Tokenizer": ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", str(d / "sp.model")],
    }[kind]


KINDS = ["HuggingFaceTokenizer", "GPT2BPETokenizer", "SentencePieceTokenizer"]


@pytest.mark.parametrize("kind", KINDS)
def test_tokenizer_round_trip_and_vocabulary(files, kind):
    flags = dict(zip(_flags(kind, files)[0::2], _flags(kind, files)[1::2]))
    tok = build_tokenizer(kind, tokenizer_model=flags.get("--tokenizer-model"), vocab_file=flags.get("--vocab-file"),
                          merge_file=flags.get("--merge-file"))
    text = "Return the number of items in a container."
    ids = tok.tokenize(text)
    assert 0 < len(ids) < len(text) / 1.5  # subwords, not bytes
    assert max(ids) < tok.vocab_size and tok.eod < tok.vocab_size and tok.eod not in ids
    assert tok.detokenize(ids + [tok.eod]).strip() == text
    from h3t_training.megatron_release import CORE_TOKENIZERS_FROM, installed_megatron_core

    legacy_specials = 5 if installed_megatron_core() < CORE_TOKENIZERS_FROM else 0  # Megatron-LM 0.16's, below
    expected = {"HuggingFaceTokenizer": BPE_VOCAB, "GPT2BPETokenizer": BPE_VOCAB,
                "SentencePieceTokenizer": SP_VOCAB + legacy_specials}
    assert tok.vocab_size == expected[kind]  # the trained eod is in the vocabulary: no extra id


@pytest.mark.parametrize("kind", KINDS + ["ByteTokenizer", "Llama2Tokenizer"])
def test_preprocess_and_train_with_each_tokenizer(files, kind, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = tmp_path / "data"
    proc = subprocess.run([PYTHON, str(REPO / "tools/preprocess_data.py"), "--input", str(files / "corpus.jsonl"),
                           "--output-prefix", str(prefix), "--append-eod", "--workers", "2", *_flags(kind, files)],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    ds = IndexedDataset(f"{prefix}_text_document")
    first = json.loads((files / "corpus.jsonl").read_text().splitlines()[0])["text"]
    flags = dict(zip(_flags(kind, files)[0::2], _flags(kind, files)[1::2]))
    tok = build_tokenizer(kind, tokenizer_model=flags.get("--tokenizer-model"), vocab_file=flags.get("--vocab-file"),
                          merge_file=flags.get("--merge-file"))
    numpy.testing.assert_array_equal(ds[0], numpy.asarray(tok.tokenize(first) + [tok.eod]))
    out = tmp_path / "m.json"
    run = run_pretrain([*TINY_MODEL, "--global-batch-size", "4", "--micro-batch-size", "2", "--train-iters", "6",
                        "--data-path", f"{prefix}_text_document", "--metrics-json", str(out), *_flags(kind, files)])
    check_ok(run)
    got = losses(out)
    assert len(got) == 6 and all(numpy.isfinite(got))
    assert got[-1] < got[0]  # it learns from these tokens


@pytest.mark.parametrize("kind, flags, expected", [
    ("SentencePieceTokenizer", [], "--tokenizer-type SentencePieceTokenizer needs --tokenizer-model PATH"),
    ("GPT2BPETokenizer", ["--vocab-file", "/nonexistent/vocab.json", "--merge-file", "x"],
     "--vocab-file /nonexistent/vocab.json does not exist"),
])
def test_missing_tokenizer_files_are_one_line(kind, flags, expected, tmp_path):
    proc = subprocess.run([PYTHON, str(REPO / "pretrain_llama.py"), *TINY_MODEL, "--global-batch-size", "4",
                           "--train-iters", "1", "--mock-data", "--tokenizer-type", kind, *flags],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == f"pretrain_llama.py: error: {expected}"


def test_a_file_that_is_no_tokenizer_is_one_line(tmp_path):
    bad = tmp_path / "sp.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match=r"^--tokenizer-model .*sp.model is not a SentencePiece model"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(bad))
    with pytest.raises(TokenizerError, match=r"is not a tokenizer.json the tokenizers package reads"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(bad))


def test_megatron_sentencepiece_names(files):
    """GPTSentencePieceTokenizer is the model's pieces (eod its </s>); Llama2Tokenizer starts each text with the
    model's BOS in Megatron-LM 0.16 (its ``tokenize(s, bos=True)``) and not from 0.17 (megatron.core.tokenizers'
    SentencePiece encoding), following the installed megatron-core; all have the model's vocabulary."""
    from h3t_training.data.tokenizer import Llama2Tokenizer
    from h3t_training.megatron_release import CORE_TOKENIZERS_FROM, installed_megatron_core

    from h3t_training.data.tokenizer import SentencePieceTokenizer

    model = str(files / "sp.model")
    gpt, llama = (build_tokenizer(k, tokenizer_model=model) for k in ("GPTSentencePieceTokenizer", "Llama2Tokenizer"))
    sp = SentencePieceTokenizer(model)  # the model's pieces: every type from Megatron-LM 0.17
    text = "Return the number of items in a container."
    assert gpt.tokenize(text) == sp.tokenize(text) and len(sp.tokenize(text)) > 1
    legacy, core = Llama2Tokenizer(model, with_bos=True), Llama2Tokenizer(model, with_bos=False)
    assert legacy.tokenize(text) == [legacy.bos, *sp.tokenize(text)] and legacy.bos not in sp.tokenize(text)
    assert core.tokenize(text) == sp.tokenize(text)
    assert llama.tokenize(text) == (legacy if installed_megatron_core() < CORE_TOKENIZERS_FROM else core).tokenize(text)
    assert legacy.detokenize(legacy.tokenize(text) + [legacy.eod]).strip() == text
    assert sp.vocab_size == gpt.vocab_size == llama.vocab_size == SP_VOCAB and sp.eod == gpt.eod == llama.eod
    assert (gpt.unique_identifiers["class"], llama.unique_identifiers["class"]) == \
        ("GPTSentencePieceTokenizer", "Llama2Tokenizer")  # other ids, other dataset caches


@pytest.mark.parametrize("kind, expected", [
    ("BertWordPieceCase", "--tokenizer-type BertWordPieceCase is not supported: BERT's WordPiece vocabulary and its "
     "special tokens are not implemented; its ids would differ (instead: one of ByteTokenizer, NullTokenizer, "
     "HuggingFaceTokenizer, GPT2BPETokenizer, SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer)"),
    ("NoSuchTokenizer", "--tokenizer-type 'NoSuchTokenizer' is not one of ByteTokenizer, NullTokenizer, "
     "HuggingFaceTokenizer, GPT2BPETokenizer, SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer"),
])
def test_other_megatron_tokenizer_names_are_one_line(kind, expected, capsys):
    from h3t_training.config.sections import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args([*TINY_MODEL, "--global-batch-size", "4", "--train-iters", "1", "--mock-data",
                    "--max-position-embeddings", "64", "--tokenizer-type", kind], prog="pretrain_gpt.py", defaults={})
    assert exc.value.code == 2 and capsys.readouterr().err == f"pretrain_gpt.py: error: {expected}\n"


def test_megatron_lm_0_16s_sentencepiece_tokenizer(files):
    """Megatron-LM 0.16's SentencePieceTokenizer (its legacy tokenizer): <CLS> <SEP> <EOD> <MASK> and a <PAD> (this
    model has no padding piece) after the model's pieces, documents ending with <EOD>, special pieces in a text kept
    whole; from 0.17 the type is the model's pieces. The installed megatron-core picks which."""
    import sentencepiece

    from h3t_training.data.tokenizer import LegacySentencePieceTokenizer, SentencePieceTokenizer
    from h3t_training.megatron_release import CORE_TOKENIZERS_FROM, installed_megatron_core

    model = str(files / "sp.model")
    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    legacy = LegacySentencePieceTokenizer(model)
    assert (sp.pad_id(), sp.id_to_piece(sp.bos_id()), sp.id_to_piece(sp.eos_id())) == (-1, "<s>", "</s>")
    assert legacy.vocab_size == SP_VOCAB + 5 and legacy.eod == SP_VOCAB + 2  # <CLS> <SEP> <EOD> <MASK> <PAD>
    assert legacy.special_ids == {"<CLS>": SP_VOCAB, "<SEP>": SP_VOCAB + 1, "<EOD>": SP_VOCAB + 2,
                                  "<MASK>": SP_VOCAB + 3, "<PAD>": SP_VOCAB + 4, "<s>": sp.bos_id(),
                                  "</s>": sp.eos_id()}
    text = "first part<SEP>second</s>third"
    assert legacy.tokenize(text) == [*sp.encode("first part"), SP_VOCAB + 1, *sp.encode("second"), sp.eos_id(),
                                     *sp.encode("third")]
    assert legacy.tokenize("no special pieces") == sp.encode("no special pieces")
    assert legacy.detokenize(legacy.tokenize("first part<SEP>second<MASK>")) == "first part<SEP>second<MASK>"
    built = build_tokenizer("SentencePieceTokenizer", tokenizer_model=model)
    expected = LegacySentencePieceTokenizer if installed_megatron_core() < CORE_TOKENIZERS_FROM else \
        SentencePieceTokenizer
    assert type(built) is expected and built.unique_identifiers["class"] == "SentencePieceTokenizer"
