"""Megatron's tokenizer types from files made here (BPE and SentencePiece trained on the project's
corpus): tools/preprocess_data.py writes what megatron-core reads, and the driver trains on it."""
from __future__ import annotations

import json
import subprocess

import numpy
import pytest

from driver_harness import PYTHON, REPO, TINY_MODEL, _env, check_ok, losses, run_pretrain
from h3t_training.data.tiktoken_vocab import PATTERNS
from h3t_training.data.tokenizer import TokenizerError, build_tokenizer
from tiktoken_files import train_ranks, write_vocab

BPE_VOCAB = 400
SP_VOCAB = 300
TIKTOKEN_RANKS = 400
TIKTOKEN_VOCAB = 1000 + TIKTOKEN_RANKS  # Megatron's 1000 special tokens first


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The stdlib corpus, a byte-level BPE (tokenizer.json and GPT-2 vocab/merges), a SentencePiece model and a
    tiktoken vocabulary in Megatron's JSON format."""
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
    write_vocab(train_ranks(texts, TIKTOKEN_RANKS, PATTERNS["v2"]), d / "tiktoken.json")
    return d


def _flags(kind: str, d) -> list[str]:
    return {
        "ByteTokenizer": ["--tokenizer-type", "ByteTokenizer"],
        "HuggingFaceTokenizer": ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(d / "tokenizer.json")],
        "GPT2BPETokenizer": ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(d / "vocab.json"),
                             "--merge-file", str(d / "merges.txt")],
        "SentencePieceTokenizer": ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(d / "sp.model")],
        "Llama2Tokenizer": ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", str(d / "sp.model")],
        "TikTokenizer": ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", str(d / "tiktoken.json"),
                         "--tiktoken-pattern", "v2", "--vocab-size", str(TIKTOKEN_VOCAB)],
    }[kind]


def _build(kind: str, d):
    """The tokenizer the flags of ``kind`` name, built as the driver builds it."""
    flags = dict(zip(_flags(kind, d)[2::2], _flags(kind, d)[3::2]))
    return build_tokenizer(kind, int(flags["--vocab-size"]) if "--vocab-size" in flags else None,
                           tokenizer_model=flags.get("--tokenizer-model"), vocab_file=flags.get("--vocab-file"),
                           merge_file=flags.get("--merge-file"), tiktoken_pattern=flags.get("--tiktoken-pattern"))


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
    expected = {"HuggingFaceTokenizer": BPE_VOCAB, "GPT2BPETokenizer": BPE_VOCAB, "SentencePieceTokenizer": SP_VOCAB}
    assert tok.vocab_size == expected[kind]  # the trained eod is in the vocabulary: no extra id


@pytest.mark.parametrize("kind", KINDS + ["ByteTokenizer", "Llama2Tokenizer", "TikTokenizer"])
def test_preprocess_and_train_with_each_tokenizer(files, kind, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = tmp_path / "data"
    proc = subprocess.run([PYTHON, str(REPO / "tools/preprocess_data.py"), "--input", str(files / "corpus.jsonl"),
                           "--output-prefix", str(prefix), "--append-eod", "--workers", "2", *_flags(kind, files)],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    ds = IndexedDataset(f"{prefix}_text_document")
    first = json.loads((files / "corpus.jsonl").read_text().splitlines()[0])["text"]
    tok = _build(kind, files)
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
    """GPTSentencePieceTokenizer is the model's pieces (eod its </s>); Llama2Tokenizer is too in
    megatron.core.tokenizers (0.17+, and 0.16 by default), and starts each text with the model's BOS in 0.16's legacy
    tokenizer (``--legacy-tokenizer``: its ``tokenize(s, bos=True)``); all have the model's vocabulary."""
    from h3t_training.data.tokenizer import Llama2Tokenizer

    from h3t_training.data.tokenizer import SentencePieceTokenizer

    model = str(files / "sp.model")
    gpt, llama = (build_tokenizer(k, tokenizer_model=model) for k in ("GPTSentencePieceTokenizer", "Llama2Tokenizer"))
    sp = SentencePieceTokenizer(model)  # the model's pieces: every type from Megatron-LM 0.17
    text = "Return the number of items in a container."
    assert gpt.tokenize(text) == sp.tokenize(text) and len(sp.tokenize(text)) > 1
    legacy, core = Llama2Tokenizer(model, with_bos=True), Llama2Tokenizer(model, with_bos=False)
    assert legacy.tokenize(text) == [legacy.bos, *sp.tokenize(text)] and legacy.bos not in sp.tokenize(text)
    assert core.tokenize(text) == sp.tokenize(text)
    assert llama.tokenize(text) == core.tokenize(text)
    assert build_tokenizer("Llama2Tokenizer", tokenizer_model=model, legacy=True).tokenize(text) == legacy.tokenize(text)
    assert legacy.detokenize(legacy.tokenize(text) + [legacy.eod]).strip() == text
    assert sp.vocab_size == gpt.vocab_size == llama.vocab_size == SP_VOCAB and sp.eod == gpt.eod == llama.eod
    assert (gpt.unique_identifiers["class"], llama.unique_identifiers["class"]) == \
        ("GPTSentencePieceTokenizer", "Llama2Tokenizer")  # other ids, other dataset caches


@pytest.mark.parametrize("kind, expected", [
    ("BertWordPieceCase", "--tokenizer-type BertWordPieceCase is not supported: BERT's WordPiece vocabulary and its "
     "special tokens are not implemented; its ids would differ (instead: one of ByteTokenizer, NullTokenizer, "
     "HuggingFaceTokenizer, GPT2BPETokenizer, SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer, "
     "TikTokenizer)"),
    ("NoSuchTokenizer", "--tokenizer-type 'NoSuchTokenizer' is not one of ByteTokenizer, NullTokenizer, "
     "HuggingFaceTokenizer, GPT2BPETokenizer, SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer, "
     "TikTokenizer"),
])
def test_other_megatron_tokenizer_names_are_one_line(kind, expected, capsys):
    from h3t_training.config.sections import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args([*TINY_MODEL, "--global-batch-size", "4", "--train-iters", "1", "--mock-data",
                    "--max-position-embeddings", "64", "--tokenizer-type", kind], prog="pretrain_gpt.py", defaults={})
    assert exc.value.code == 2 and capsys.readouterr().err == f"pretrain_gpt.py: error: {expected}\n"


def test_megatron_lm_0_16s_sentencepiece_tokenizer(files):
    """Megatron-LM 0.16's legacy SentencePieceTokenizer: <CLS> <SEP> <EOD> <MASK> and a <PAD> (this model has no
    padding piece) after the model's pieces, documents ending with <EOD>, special pieces in a text kept whole. It
    tokenizes the data only with --legacy-tokenizer (0.16's default, and every later release, is
    megatron.core.tokenizers': the model's pieces), but 0.16's pretraining always sizes the model's vocabulary
    with it."""
    import sentencepiece

    from h3t_training.data.tokenizer import LegacySentencePieceTokenizer, SentencePieceTokenizer

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
    # which one a run builds: megatron.core.tokenizers' unless --legacy-tokenizer; 0.16's pretraining sizes the model's
    # vocabulary with the legacy one even then (legacy_vocabulary: its global tokenizer)
    built, old, sized = (build_tokenizer("SentencePieceTokenizer", tokenizer_model=model, **kw)
                         for kw in ({}, {"legacy": True}, {"legacy_vocabulary": True}))
    assert (type(built), type(old), type(sized)) == (SentencePieceTokenizer, LegacySentencePieceTokenizer,
                                                     SentencePieceTokenizer)
    assert {t.unique_identifiers["class"] for t in (built, old, sized)} == {"SentencePieceTokenizer"}
    assert sized.tokenize(text) == built.tokenize(text) and sized.eod == built.eod == sp.eos_id()
    assert (built.vocab_size, sized.vocab_size) == (SP_VOCAB, SP_VOCAB + 5)


def test_tiktokenizer_on_the_corpus(files):
    """The corpus's tiktoken vocabulary: subwords, Megatron's layout (1000 special tokens, documents ending with
    </s>, id 2), and the pattern the installed megatron-core's Megatron-LM asks for: 0.16 stops in one line
    without --tiktoken-pattern, 0.17+ take v2."""
    from h3t_training.megatron_release import CORE_TOKENIZERS_FROM, installed_megatron_core

    tok = _build("TikTokenizer", files)
    text = "Return the number of items in a container."
    ids = tok.tokenize(text)
    assert tok.vocab_size == TIKTOKEN_VOCAB and tok.eod == 2 and min(ids) >= 1000
    assert 0 < len(ids) < len(text) / 1.5 and tok.detokenize(ids + [tok.eod]) == text
    proc = subprocess.run([PYTHON, str(REPO / "pretrain_llama.py"), *TINY_MODEL, "--global-batch-size", "4",
                           "--train-iters", "1", "--mock-data", "--tokenizer-type", "TikTokenizer",
                           "--tokenizer-model", str(files / "tiktoken.json"), "--vocab-size", str(TIKTOKEN_VOCAB)],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    if installed_megatron_core() < CORE_TOKENIZERS_FROM:
        assert proc.returncode == 2 and proc.stderr.strip() == (
            "pretrain_llama.py: error: --tokenizer-type TikTokenizer needs --tiktoken-pattern {v1,v2} (Megatron-LM "
            "0.16's legacy tokenizer requires it; its pretraining builds that one for the vocabulary)")
    else:
        assert proc.returncode == 0, proc.stderr


def test_the_tokenizer_system_follows_the_installed_release(files, tmp_path, capsys):
    """Megatron-LM 0.16 tokenizes with megatron.core.tokenizers unless --legacy-tokenizer, and its pretraining sizes
    the model's vocabulary with the legacy tokenizer either way (SentencePieceTokenizer: the model's pieces and the 5
    it adds); 0.17 removed the legacy tokenizers, and the flag with them (one line)."""
    from h3t_training.config.sections import parse_args
    from h3t_training.megatron_release import CORE_TOKENIZERS_FROM, installed_megatron_core

    base = [*TINY_MODEL, "--global-batch-size", "4", "--train-iters", "1", "--mock-data",
            "--max-position-embeddings", "64", *_flags("SentencePieceTokenizer", files)]
    if installed_megatron_core() >= CORE_TOKENIZERS_FROM:
        assert parse_args(base, prog="pretrain_gpt.py", defaults={}).tokenizer_vocab_size == SP_VOCAB
        with pytest.raises(SystemExit) as exc:
            parse_args([*base, "--legacy-tokenizer"], prog="pretrain_gpt.py", defaults={})
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.count("\n") == 1
        assert "--legacy-tokenizer: Megatron-LM 0.17 removed the legacy tokenizers" in err
        return
    for extra in ([], ["--legacy-tokenizer"]):
        args = parse_args([*base, *extra], prog="pretrain_gpt.py", defaults={})
        assert args.tokenizer_vocab_size == SP_VOCAB + 5, extra
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    first = json.loads((files / "corpus.jsonl").read_text().splitlines()[0])["text"]
    plain = build_tokenizer("Llama2Tokenizer", tokenizer_model=str(files / "sp.model"))
    for i, extra in enumerate(([], ["--legacy-tokenizer"])):
        prefix = tmp_path / f"d{i}"
        subprocess.run([PYTHON, str(REPO / "tools/preprocess_data.py"), "--input", str(files / "corpus.jsonl"),
                        "--output-prefix", str(prefix), "--append-eod", *_flags("Llama2Tokenizer", files), *extra],
                       check=True, cwd=REPO, env=_env(), capture_output=True, timeout=300)
        ds = IndexedDataset(f"{prefix}_text_document")
        expected = [plain.bos] * bool(extra) + plain.tokenize(first) + [plain.eod]  # the legacy one starts with BOS
        numpy.testing.assert_array_equal(ds[0], numpy.asarray(expected))


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_tiktokenizer_ids_are_megatron_cores(files, pattern):
    """The same ids, end of document, padding id and vocabulary as megatron-core's own tiktoken tokenizer
    (megatron.core.tokenizers, what Megatron-LM 0.17+, and 0.16 without --legacy-tokenizer, tokenize with) on the
    corpus, special tokens written in the text included."""
    from megatron.core.tokenizers import MegatronTokenizer

    path = str(files / "tiktoken.json")
    theirs = MegatronTokenizer.from_pretrained(tokenizer_path=path, metadata_path={"library": "tiktoken"},
                                               vocab_size=TIKTOKEN_VOCAB, num_special_tokens=1000, pattern=pattern)
    ours = build_tokenizer("TikTokenizer", TIKTOKEN_VOCAB, tokenizer_model=path, tiktoken_pattern=pattern)
    texts = [json.loads(line)["text"] for line in (files / "corpus.jsonl").read_text().splitlines()[:40]]
    text = "\n".join(texts) + " <s>x</s> <pad> <SPECIAL_9> \u00e9\u4e2d 12345 HelloWorld\r\n"
    assert ours.tokenize(text) == theirs.tokenize(text) and len(ours.tokenize(text)) > 1000
    assert (ours.eod, ours.pad, ours.vocab_size) == (theirs.eod, theirs.pad, theirs.vocab_size) == (2, 4, TIKTOKEN_VOCAB)
