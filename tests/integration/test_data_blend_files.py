"""Megatron-LM's blends as its scripts give them: ``--data-args-path`` and ``--per-split-data-args-path`` files stand
for the blend flags they hold (the same samples), a blend without weights weighs each dataset by its size as
megatron-core does, and every misuse Megatron-LM stops on is one line here too."""
from __future__ import annotations

import json

import numpy
import pytest
import torch

from parse_harness import error_body

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters",
         "8", "--lr", "1e-3", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--seed", "5",
         "--eval-iters", "1", "--eval-interval", "4"]


def _dataset(prefix: str, documents: int, first_id: int) -> str:
    """``documents`` documents of 20-40 ids in [first_id, first_id + 100), each ended by NullTokenizer's end of
    document (254): the ids tell which dataset a sample came from."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = numpy.random.default_rng(first_id)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    for _ in range(documents):
        doc = [*rng.integers(first_id, first_id + 100, size=int(rng.integers(20, 41))), 254]
        builder.add_document(torch.tensor(doc), [len(doc)])
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory) -> tuple[str, str]:
    d = tmp_path_factory.mktemp("blend")
    return _dataset(str(d / "a"), 300, 0), _dataset(str(d / "b"), 100, 120)


def _config(argv):
    from h3t_training.config.arguments import MEGATRON_GPT_DEFAULTS
    from h3t_training.config.sections import parse_args

    return parse_args([*FLAGS, *argv], prog="pretrain_gpt.py", defaults=MEGATRON_GPT_DEFAULTS, world_size=1)


def _samples(argv) -> list:
    """Every training, validation and test sample's tokens (None for a split that is not built)."""
    from h3t_training.data.datasets import build_datasets
    from h3t_training.data.tokenizer import tokenizer_from_args

    args = _config(argv)
    return [None if ds is None else [ds[i]["tokens"].tolist() for i in range(len(ds))]
            for ds in build_datasets(args, tokenizer_from_args(args))]


def test_a_data_args_file_is_the_data_path_it_holds(two_datasets, tmp_path):
    a, b = two_datasets
    f = tmp_path / "blend.txt"
    f.write_text(f"0.25 {a}\n0.75 {b}\n")
    from_file = _config(["--data-args-path", str(f), "--split", "90,10,0"])
    assert from_file.data_path == ["0.25", a, "0.75", b] and from_file.split == "90,10,0"
    expected = _samples(["--data-path", "0.25", a, "0.75", b, "--split", "90,10,0"])
    assert _samples(["--data-args-path", str(f), "--split", "90,10,0"]) == expected
    assert expected[1] and expected[2] is None


def test_a_per_split_file_is_the_split_paths_it_holds(two_datasets, tmp_path):
    a, b = two_datasets
    f = tmp_path / "splits.json"
    f.write_text(json.dumps({"train": f"0.5 {a} 0.5 {b}", "valid": [b], "test": None}))
    config = _config(["--per-split-data-args-path", str(f)])
    assert (config.train_data_path, config.valid_data_path, config.test_data_path) == (["0.5", a, "0.5", b], [b], None)
    expected = _samples(["--train-data-path", "0.5", a, "0.5", b, "--valid-data-path", b])
    assert _samples(["--per-split-data-args-path", str(f)]) == expected
    assert expected[1] and expected[2] is None


def test_a_blend_without_weights_weighs_each_dataset_by_its_size(two_datasets):
    """megatron-core's reading of ``--data-path a b``: one epoch of each dataset's training split, blended in
    proportion to their sizes (a holds three times b's documents, so about three times its samples)."""
    from h3t_training.data.datasets import build_datasets
    from h3t_training.data.tokenizer import tokenizer_from_args

    a, b = two_datasets
    args = _config(["--data-path", a, b, "--split", "100,0,0"])
    train, _, _ = build_datasets(args, tokenizer_from_args(args))
    epoch = [(numpy.memmap(p + ".bin", dtype=numpy.int32, mode="r").size - 1) // 32 for p in (a, b)]
    assert [len(d) for d in train.datasets] == epoch  # one epoch of each, no weights given
    from_b = sum(1 for i in range(len(train)) if min(t for t in train[i]["tokens"].tolist() if t != 254) >= 120)
    assert len(train) == 32  # the 8 iterations' samples: both datasets together hold more
    assert from_b / len(train) == pytest.approx(epoch[1] / sum(epoch), abs=0.04)
    assert 0.2 < from_b / len(train) < 0.3


def test_an_unweighted_blend_too_small_for_the_run_says_so(two_datasets):
    from h3t_training.data.datasets import build_datasets
    from h3t_training.data.tokenizer import tokenizer_from_args

    a, b = two_datasets
    args = _config(["--data-path", a, b, "--split", "100,0,0", "--train-iters", "2000"])
    with pytest.raises(RuntimeError, match="needed .a blend without weights holds one epoch of each dataset's split"):
        build_datasets(args, tokenizer_from_args(args))


def _bad(tmp_path, name: str, content: str) -> str:
    path = tmp_path / name
    path.write_text(content)
    return str(path)


def test_blend_file_misuse_is_one_line(two_datasets, tmp_path, capsys):
    a, b = two_datasets
    args_file = _bad(tmp_path, "blend.txt", f"{a}\n")
    split_file = _bad(tmp_path, "splits.json", json.dumps({"train": a, "valid": None, "test": None}))
    cases = [
        (["--data-args-path", args_file], "needs --split (e.g. 969,30,1): Megatron-LM's legacy default applies to "
                                          "--data-path alone"),
        (["--data-args-path", args_file, "--data-path", a, "--split", "1"],
         "--data-path and --data-args-path each give the training data; give one of"),
        (["--per-split-data-args-path", split_file, "--valid-data-path", b],
         "--valid-data-path and --per-split-data-args-path each give the training data"),
        (["--per-split-data-args-path", split_file, "--mock-data"], "--per-split-data-args-path and --mock-data each"),
        (["--per-split-data-args-path", split_file, "--split", "1"],
         "--split 1 does not apply with --per-split-data-args-path: each split has its own blend"),
        (["--train-data-path", a, "--split", "1"], "--split 1 does not apply with --train/valid/test-data-path"),
        (["--per-split-data-args-path", _bad(tmp_path, "v.json", json.dumps({"train": None, "valid": a, "test": None}))],
         "'train' is null; training needs data (or give --skip-train)"),
        (["--skip-train", "--per-split-data-args-path",
          _bad(tmp_path, "n.json", json.dumps({"train": None, "valid": None, "test": None}))],
         "names no data for any split"),
        (["--per-split-data-args-path", _bad(tmp_path, "k.json", '{"train": "x"}')], "lacks the key(s) valid, test"),
        (["--data-args-path", _bad(tmp_path, "m.txt", f"0.5 {a} 0.5 {tmp_path}/nothing"), "--split", "1"],
         f"--data-args-path {tmp_path}/m.txt {tmp_path}/nothing: {tmp_path}/nothing.idx does not exist"),
        (["--per-split-data-args-path", _bad(tmp_path, "w.json", json.dumps({"train": f"-2 {a}", "valid": None,
                                                                              "test": None}))],
         f"--per-split-data-args-path {tmp_path}/w.json ('train') weight -2 of {a} is outside (0, inf)"),
    ]
    from h3t_training.config.arguments import MEGATRON_GPT_DEFAULTS
    from h3t_training.config.sections import parse_args

    for argv, expected in cases:
        with pytest.raises(SystemExit) as exc:
            parse_args([*FLAGS, *argv], prog="pretrain_gpt.py", defaults=MEGATRON_GPT_DEFAULTS, world_size=1)
        assert exc.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], (argv, lines)
