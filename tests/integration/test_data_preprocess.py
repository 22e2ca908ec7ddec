"""Tokenizer and the text -> megatron-core indexed data path (tools/)."""
from __future__ import annotations

import json
import subprocess

import numpy
import torch

from driver_harness import PYTHON, REPO, _env
from h3t_training.data.datasets import MicrobatchIterator
from h3t_training.data.tokenizer import ByteTokenizer, NullTokenizer, padded_vocab_size


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "Déjà vu — naïve façade"
    ids = tok.tokenize(text)
    assert max(ids) < 256 and tok.eod not in ids and tok.pad not in ids
    assert tok.detokenize(ids + [tok.eod]) == text


def test_null_tokenizer_and_padding():
    tok = NullTokenizer(100, eod_in_vocab=False)
    assert tok.tokenize("3 4 99") == [3, 4, 99] and tok.eod == 100 and tok.vocab_size == 101
    assert padded_vocab_size(258, 128, 1) == 384 and padded_vocab_size(258, 128, 2) == 512


def test_preprocess_writes_what_the_indexed_reader_reads(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    docs = ["first document\nwith two lines", "second", "ünïcode"]
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    subprocess.run([PYTHON, str(REPO / "tools/preprocess_data.py"), "--input", str(src), "--output-prefix",
                    str(tmp_path / "out"), "--append-eod"], check=True, cwd=REPO, env=_env(), capture_output=True, timeout=120)
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    tok = ByteTokenizer()
    assert len(ds) == len(docs)
    for i, d in enumerate(docs):
        numpy.testing.assert_array_equal(ds[i], numpy.array(tok.tokenize(d) + [tok.eod]))


def test_bad_jsonl_line_is_one_line_error(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "ok"}\n{"body": "no text key"}\n')
    proc = subprocess.run([PYTHON, str(REPO / "tools/preprocess_data.py"), "--input", str(src), "--output-prefix",
                           str(tmp_path / "o")], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert f"{src}:2: not a json object with key(s) 'text'" in proc.stderr


def test_stdlib_corpus_is_big_enough_and_real_text(tmp_path):
    out = tmp_path / "corpus.jsonl"
    subprocess.run([PYTHON, str(REPO / "tools/make_stdlib_corpus.py"), "--output", str(out), "--min-bytes",
                    "300000"], check=True, cwd=REPO, env=_env(), capture_output=True, timeout=120)
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert len(rows) > 50
    text = " ".join(r["text"] for r in rows)
    assert text.count(" the ") > 1000


def test_plain_text_is_split_into_paragraph_documents(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    src = tmp_path / "book.txt"
    src.write_text("Chapter one.\nIt begins.\n\n  \nChapter two.\n")
    subprocess.run([PYTHON, str(REPO / "tools/preprocess_data.py"), "--input", str(src), "--output-prefix",
                    str(tmp_path / "b")], check=True, cwd=REPO, env=_env(), capture_output=True, timeout=120)
    ds = IndexedDataset(str(tmp_path / "b_text_document"))
    assert len(ds) == 2 and ByteTokenizer().detokenize(ds[1]) == "Chapter two.\n"


def test_microbatches_follow_megatrons_sample_order():
    B, mbs, dp = 8, 2, 2
    data = [{k: numpy.array([i]) for k in ("tokens", "labels", "loss_mask", "position_ids")} for i in range(3 * B)]
    seen = {}
    for r in range(dp):
        it = MicrobatchIterator(data, start_iteration=1, global_batch_size=B, micro_batch_size=mbs,
                                data_parallel_rank=r, data_parallel_size=dp, device=torch.device("cpu"))
        seen[r] = [next(it)["tokens"].ravel().tolist() for _ in range(2 * B // (mbs * dp))]
    assert seen[0][:2] == [[8, 9], [12, 13]] and seen[1][:2] == [[10, 11], [14, 15]]
    first_iteration = sorted(x for r in range(dp) for mb in seen[r][:2] for x in mb)
    assert first_iteration == list(range(B, 2 * B))  # iteration 1 reads samples [B, 2B), each once
    assert seen[0][2] == [16, 17]  # then iteration 2 begins
