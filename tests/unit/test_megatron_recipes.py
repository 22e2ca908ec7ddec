"""Megatron-LM CI recipes as command lines (tests/megatron_recipes.py): the launcher's rules and the shrink."""
from __future__ import annotations

from megatron_recipes import Paths, command_line, data_parallel_size, load, shrink, world_size

ENV = {"DATA_PATH": "/d", "CHECKPOINT_SAVE_PATH": "/s", "CHECKPOINT_LOAD_PATH": "/l"}
PATHS = Paths("/corpus", "/v.json", "/m.txt", "/sp.model", "/save", "/load", "/tb", "/cache")


def test_command_line_follows_megatrons_launcher():
    pairs = [["--bf16", "true"], ["--data-path", "${DATA_PATH}/text/x"], ["--sizes", "[2 2]"],
             ["--schedule", "0:384 200B:768"], ["--cfg", "(a|b)"], ["--split", "949,50,1"], ["--empty", ""],
             ["--blend", "$DATA_BLEND"], ["--save", "$CHECKPOINT_SAVE_PATH"], ["--lr-warmup-fraction", ".01"]]
    assert command_line(pairs, ENV) == [
        "--bf16", "--data-path", "/d/text/x", "--sizes", "2", "2", "--schedule", "0:384 200B:768", "--cfg", "(a|b)",
        "--split", "949,50,1", "--blend", "--save", "/s", "--lr-warmup-fraction", ".01"]


def test_values_are_kept_as_published():
    recipe = {r["name"]: r for r in load()["recipes"]}["gpt3_mcore_te_tp1_pp4_vp1_uneven_pipeline"]
    args = dict(recipe["model_args"])
    assert args["--lr-warmup-fraction"] == ".01" and args["--weight-decay"] == "1e-2" and args["--bf16"] == "true"
    assert args["--decoder-first-pipeline-num-layers"] == "2" and args["--distributed-backend"] == "nccl"


def test_merge_keys_are_expanded():
    recipe = {r["name"]: r for r in load()["recipes"]}["gpt3_mcore_reruns_resume_check_grads"]
    args = dict(recipe["model_args"])
    assert "<<" not in args and args["--rotary-base"] == "500" and args["--micro-batch-size"] == "2"
    assert dict(recipe["more_model_args"]["MODEL_ARGS_3"])["--tensor-model-parallel-size"] == "2"


def test_shrink_changes_only_size_length_batch_and_paths():
    recipe = {r["name"]: r for r in load()["recipes"]}["gpt3_mcore_te_tp1_pp4_vp1_uneven_pipeline"]
    before = dict(recipe["model_args"])
    after = dict(shrink(recipe["model_args"], PATHS, iters=4, save_interval=2))
    changed = {k for k in after if after[k] != before.get(k)}
    assert changed == {"--hidden-size", "--seq-length", "--max-position-embeddings",
                       "--micro-batch-size", "--global-batch-size", "--train-iters", "--eval-iters", "--save-interval",
                       "--exit-interval", "--save", "--load", "--tensorboard-dir", "--data-path", "--vocab-file",
                       "--merge-file", "--data-cache-path"}
    assert after["--num-layers"] == "12" and after["--pipeline-model-parallel-size"] == "4"
    assert after["--global-batch-size"] == "4" and after["--exit-interval"] == "4" and after["--train-iters"] == "4"
    assert list(after)[:len(before)] == list(before)  # the recipe's order, new flags after it
    assert world_size(recipe["model_args"]) == 4


def test_shrink_keeps_the_virtual_layout_of_deep_recipes():
    pairs = [["--num-layers", "32"], ["--pipeline-model-parallel-size", "2"],
             ["--num-layers-per-virtual-pipeline-stage", "8"], ["--train-samples", "1000"],
             ["--lr-decay-samples", "900"], ["--lr-warmup-samples", "100"], ["--global-batch-size", "64"]]
    after = dict(shrink(pairs, PATHS, iters=2))
    assert after["--num-layers"] == "8" and after["--num-layers-per-virtual-pipeline-stage"] == "2"
    assert after["--train-samples"] == "4" and after["--lr-decay-samples"] == "4" and after["--lr-warmup-samples"] == "2"
    one_per_stage = dict(shrink([["--num-layers", "32"], ["--pipeline-model-parallel-size", "4"],
                                 ["--num-layers-per-virtual-pipeline-stage", "1"]], PATHS, iters=2))
    assert one_per_stage["--num-layers"] == "32"


def test_data_parallel_size():
    assert data_parallel_size([["--tensor-model-parallel-size", "1"]]) == 2
    assert data_parallel_size([["--tensor-model-parallel-size", "2"]]) == 1
    assert data_parallel_size([["--tensor-model-parallel-size", "2"], ["--num-distributed-optimizer-instances", "2"]]) == 2
    assert world_size([["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"],
                       ["--context-parallel-size", "2"]]) == 8
