"""Schema checks of every file the planner reads or writes (costmodel/schema.py): a bad field is exit 2 and
one line naming the file and the field, never a traceback. The CLI runs in-process (h3t_ext.planner.cli.main)."""
import json
import math

import pytest

from h3t_ext.costmodel.schema import SYSTEM_FIELDS
from h3t_ext.costmodel.specs import system_file_dict
from h3t_ext.planner.cli import main

ESTIMATE = ["estimate", "--model", "llama-7b", "--num-gpus", "8", "--seq-length", "4096", "--global-batch-size", "8",
            "--tensor-model-parallel-size", "8"]
BAD = {"text": "fast", "null": None, "zero": 0, "negative": -1, "nan": math.nan, "inf": math.inf, "list": [1]}
CSV_HEAD = "num_gpus,seq_length,global_batch_size,tensor_model_parallel_size,tokens_per_second_per_gpu\n"


def _run(argv, capsys):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    return code, err


def _cases():
    for f in SYSTEM_FIELDS:
        for label, value in BAD.items():
            if label == "zero" and (f.zero_ok or (f.minimum_inclusive and f.minimum <= 0)):
                continue  # 0 is valid where the range includes it
            if label == "null" and not f.required:
                continue  # an optional field left null is absent
            yield pytest.param(f.name, value, id=f"{f.name}-{label}")
        if f.required:
            yield pytest.param(f.name, "<missing>", id=f"{f.name}-missing")


@pytest.mark.parametrize("field,value", list(_cases()))
def test_system_file_field(tmp_path, capsys, field, value):
    d = system_file_dict("h100-sxm")
    if value == "<missing>":
        del d[field]
    else:
        d[field] = value
    path = tmp_path / "sys.json"
    path.write_text(json.dumps(d))  # json writes NaN / Infinity, which Python's reader accepts
    code, err = _run(ESTIMATE + ["--system-file", str(path)], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert field in err and str(path) in err, err


@pytest.mark.parametrize("value", [0, -0.5, math.nan, math.inf, "x", None])
def test_system_file_efficiency(tmp_path, capsys, value):
    d = system_file_dict("h100-sxm")
    d["efficiencies"]["network_fraction"] = value
    path = tmp_path / "sys.json"
    path.write_text(json.dumps(d))
    code, err = _run(ESTIMATE + ["--system-file", str(path)], capsys)
    assert code == 2 and "efficiencies.network_fraction" in err and len(err.splitlines()) == 1, err


def test_system_file_list_and_budget(tmp_path, capsys):
    path = tmp_path / "sys.json"
    path.write_text("[1, 2]")
    code, err = _run(ESTIMATE + ["--system-file", str(path)], capsys)
    assert code == 2 and "must be a JSON object" in err
    d = system_file_dict("h100-sxm")
    d["hbm_bytes"] = 10**9  # below the CUDA context and NCCL buffers
    path.write_text(json.dumps(d))
    code, err = _run(ESTIMATE + ["--system-file", str(path)], capsys)
    assert code == 2 and "hbm_bytes" in err and len(err.splitlines()) == 1, err


def test_optional_peak_fp8_flops_accepted(tmp_path, capsys):
    d = system_file_dict("h100-sxm")
    d["peak_fp8_flops"] = 1.979e15
    path = tmp_path / "sys.json"
    path.write_text(json.dumps(d))
    assert main(ESTIMATE + ["--system-file", str(path), "--json"]) == 0


def _calibrate(runs, out, capsys):
    return _run(["calibrate", "--model", "llama-7b", "--runs", str(runs), "--output", str(out)], capsys)


@pytest.mark.parametrize("value", ["fast", "", "0", "-5", "nan", "inf"])
def test_csv_throughput(tmp_path, capsys, value):
    runs = tmp_path / "runs.csv"
    runs.write_text(CSV_HEAD + f"8,4096,8,8,{value}\n")
    code, err = _calibrate(runs, tmp_path / "out.json", capsys)
    assert code == 2 and "tokens_per_second_per_gpu" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("value", ["fast", 0, -5, math.nan, math.inf, [1], True])
def test_metrics_json_throughput(tmp_path, capsys, value):
    runs = tmp_path / "m.json"
    runs.write_text(json.dumps({"config": {"num_gpus": 8, "seq_length": 4096, "global_batch_size": 8,
                                           "tensor_model_parallel_size": 8},
                                "iterations": [{"tokens_per_second_per_gpu": value}]}))
    code, err = _calibrate(runs, tmp_path / "out.json", capsys)
    assert code == 2 and "tokens_per_second_per_gpu" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("field", ["num_gpus", "seq_length", "global_batch_size"])
@pytest.mark.parametrize("value", ["x", None, [1]])
def test_metrics_json_config_types(tmp_path, capsys, field, value):
    cfg = {"num_gpus": 8, "seq_length": 4096, "global_batch_size": 8, "tensor_model_parallel_size": 8, field: value}
    runs = tmp_path / "m.json"
    runs.write_text(json.dumps({"config": cfg, "iterations": [{"tokens_per_second_per_gpu": 3000.0}]}))
    code, err = _calibrate(runs, tmp_path / "out.json", capsys)
    assert code == 2 and len(err.splitlines()) == 1, err


def test_output_paths_checked_before_the_fit(tmp_path, capsys):
    runs = tmp_path / "runs.csv"
    runs.write_text(CSV_HEAD + "8,4096,8,8,fast\n")  # a bad run: the output check must come first
    code, err = _calibrate(runs, tmp_path, capsys)
    assert code == 2 and "is a directory" in err
    code, err = _calibrate(runs, tmp_path / "missing" / "out.json", capsys)
    assert code == 2 and "does not exist" in err
    (tmp_path / "ro").mkdir(mode=0o500)
    code, err = _calibrate(runs, tmp_path / "ro" / "out.json", capsys)
    import os
    if os.access(tmp_path / "ro", os.W_OK):  # running as root: permissions are not enforced
        assert "tokens_per_second_per_gpu" in err
    else:
        assert code == 2 and "not writable" in err


def _system_file(tmp_path, text: str) -> str:
    path = tmp_path / "sys.json"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text, expected", [
    ("hello", "not a JSON file (Expecting value: line 1 column 1"),
    ("", "not a JSON file (Expecting value"),
    ('{"source": "x",', "not a JSON file (Expecting property name"),
    ("[" * 100000 + "]" * 100000, "not a JSON file (maximum recursion depth exceeded"),
])
def test_system_file_that_is_not_json_is_named(tmp_path, capsys, text, expected):
    path = _system_file(tmp_path, text)
    code, err = _run(ESTIMATE + ["--system-file", path], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and f"--system-file {path}: {expected}" in err, err


def test_system_file_that_is_a_directory(tmp_path, capsys):
    code, err = _run(ESTIMATE + ["--system-file", str(tmp_path)], capsys)
    assert code == 2 and f"--system-file {tmp_path}: a directory; give the path of a system file" in err, err


def test_system_file_without_efficiencies_or_set(tmp_path, capsys):
    d = system_file_dict("h100-sxm")
    del d["efficiencies"], d["efficiency_set"]  # was a KeyError: 'efficiency_set'
    code, err = _run(ESTIMATE + ["--system-file", _system_file(tmp_path, json.dumps(d))], capsys)
    assert code == 2 and "field efficiency_set must be one of hopper, ampere, blackwell, grace-blackwell, " \
        "grace-blackwell-ultra (or give an efficiencies object), got " \
        "None" in err, err


@pytest.mark.parametrize("edit, expected", [
    (lambda e: e.clear(), "field efficiencies.gemm_peak_fraction is missing; it must be a finite number > 0 and <= 1"),
    (lambda e: e.pop("gemm_tile_overhead_k"), "field efficiencies.gemm_tile_overhead_k is missing; it must be a "
                                              "finite number > 0"),
    (lambda e: e.update(netwrok_fraction=0.9), "field efficiencies.netwrok_fraction is not an efficiency of the cost "
                                               "model; valid: gemm_peak_fraction, "),
    (lambda e: e.update(network_fraction=1.5), "field efficiencies.network_fraction must be a finite number > 0 and "
                                               "<= 1, got 1.5"),
    (lambda e: e.update(tp_comm_overlap_exposed=2), "field efficiencies.tp_comm_overlap_exposed must be a finite "
                                                    "number > 0 and <= 1, got 2"),
])
def test_system_file_inline_efficiencies(tmp_path, capsys, edit, expected):
    """A missing efficiency was a KeyError traceback at pricing time; a typo or a share above 1 priced silently."""
    d = system_file_dict("h100-sxm")
    edit(d["efficiencies"])
    code, err = _run(ESTIMATE + ["--system-file", _system_file(tmp_path, json.dumps(d))], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and expected in err, err


def test_system_file_inline_efficiencies_at_their_bounds_load(tmp_path, capsys):
    d = system_file_dict("h100-sxm")
    d["efficiencies"].update(network_fraction=1.0, gemm_tile_overhead_k=4096, _note="a note is not an efficiency")
    assert main(ESTIMATE + ["--system-file", _system_file(tmp_path, json.dumps(d)), "--json"]) == 0


def test_system_file_gpus_per_node_is_bounded(tmp_path, capsys):
    """A billion GPUs per node hung the node-spread walk of the collectives; 1024 is the bound."""
    d = system_file_dict("h100-sxm")
    d["gpus_per_node"] = 10**9
    code, err = _run(ESTIMATE + ["--system-file", _system_file(tmp_path, json.dumps(d))], capsys)
    assert code == 2 and "field gpus_per_node must be an integer > 0 and <= 1024, got 1000000000" in err, err


@pytest.mark.parametrize("command", [["--optimizer-cpu-offload"], ["--optimizer-cpu-offload", "--json"]])
def test_optimizer_offload_without_host_bandwidth(tmp_path, capsys, command):
    """An optional field left out: the plan that needs it is refused in one line (was a ValueError traceback)."""
    d = system_file_dict("h100-sxm")
    del d["host_memory_bandwidth"]
    code, err = _run(ESTIMATE + ["--system-file", _system_file(tmp_path, json.dumps(d)), *command], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "--optimizer-cpu-offload needs the system's host_memory_bandwidth (a number > 0" in err, err


@pytest.mark.parametrize("text", ["[1, 2]", "null", "[" * 100000 + "]" * 100000])
def test_metrics_json_that_is_not_an_object(tmp_path, capsys, text):
    """A JSON list or null was a TypeError traceback, a deep nesting a RecursionError."""
    runs = tmp_path / "m.json"
    runs.write_text(text)
    code, err = _calibrate(runs, tmp_path / "out.json", capsys)
    assert code == 2 and len(err.splitlines()) == 1 and f"--runs {runs}: not a --metrics-json file" in err, err


@pytest.mark.parametrize("columns, values, expected", [
    ("ckpt", "some", ":2: --ckpt 'some' is not one of {no,full,ours,selective}"),
    ("pipeline_model_parallel_size,virtual_pipeline_model_parallel_size", "1,0",
     ":2: field virtual_pipeline_model_parallel_size must be an integer >= 1, got '0'"),
    ("sequence_parallel", "maybe", ":2: field sequence_parallel must be 0 or 1 (or true/false, yes/no, on/off), got "
                                   "'maybe'"),
])
def test_csv_run_fields(tmp_path, capsys, columns, values, expected):
    """A bad --ckpt was a ValueError traceback, a virtual size 0 a ZeroDivisionError; a switch that is neither on
    nor off was read as off."""
    runs = tmp_path / "runs.csv"
    runs.write_text(CSV_HEAD.strip() + f",{columns}\n8,4096,8,8,3000,{values}\n")
    code, err = _calibrate(runs, tmp_path / "out.json", capsys)
    assert code == 2 and len(err.splitlines()) == 1 and f"{runs}{expected}" in err, err


def test_run_plan_refusal_names_the_file_and_row(tmp_path, capsys):
    """The model's rules (heads divisible by t) are checked as each run is read, so the refusal names its row."""
    runs = tmp_path / "runs.csv"
    runs.write_text(CSV_HEAD + "8,4096,8,8,3000\n24,4096,8,3,3000\n")
    code, err = _calibrate(runs, tmp_path / "out.json", capsys)
    assert code == 2 and f"{runs}:3: --num-attention-heads 32 is not a multiple of --tensor-model-parallel-size 3; " \
        "valid --tensor-model-parallel-size: 1, 2, 4, 8, 16, 32" in err, err


@pytest.mark.parametrize("value", [2.5, True, "two"])
def test_metrics_json_integer_field(tmp_path, capsys, value):
    """A fractional size was truncated (2.5 read as 2)."""
    runs = tmp_path / "m.json"
    runs.write_text(json.dumps({"config": {"num_gpus": 8, "seq_length": 4096, "global_batch_size": 8,
                                           "tensor_model_parallel_size": value},
                                "iterations": [{"tokens_per_second_per_gpu": 3000.0}]}))
    code, err = _calibrate(runs, tmp_path / "out.json", capsys)
    assert code == 2 and f"field tensor_model_parallel_size must be an integer, got {value!r}" in err, err


def test_a_run_file_names_its_bf16_layers(tmp_path):
    """A measured FP8 run with --first-last-layers-bf16 is priced with them (read, not dropped, by calibrate)."""
    from h3t_ext.costmodel import get_model, get_system
    from h3t_ext.planner.calibrate import read_runs
    runs = tmp_path / "runs.csv"
    runs.write_text("num_gpus,seq_length,global_batch_size,tensor_model_parallel_size,fp8,fp8_recipe,"
                    "first_last_layers_bf16,num_layers_at_end_in_bf16,tokens_per_second_per_gpu\n"
                    "8,4096,8,8,hybrid,tensorwise,1,3,3000\n")
    (run,) = read_runs([str(runs)], get_model("llama-7b"), get_system("h100-sxm"))
    assert (run.plan.first_last_layers_bf16, run.plan.num_layers_at_start_in_bf16,
            run.plan.num_layers_at_end_in_bf16) == (True, 1, 3)


def test_a_run_file_names_its_transformer_engine_and_all_to_all_overlap(tmp_path, capsys):
    """A measured run's TransformerEngine version (which cross entropy rule) and Megatron's MoE all-to-all overlap are
    read, not dropped, by calibrate; a malformed version is one line naming the field."""
    from h3t_ext.costmodel import get_model, get_system
    from h3t_ext.planner.calibrate import read_runs
    runs = tmp_path / "runs.csv"
    runs.write_text("num_gpus,seq_length,global_batch_size,cross_entropy_loss_fusion,cross_entropy_fusion_impl,"
                    "transformer_engine_version,tokens_per_second_per_gpu\n8,4096,8,1,te,2.9.0,3000\n")
    (run,) = read_runs([str(runs)], get_model("llama-7b"), get_system("h100-sxm"))
    assert run.plan.transformer_engine_version == "2.9.0"
    moe = tmp_path / "moe.csv"
    moe.write_text("num_gpus,seq_length,global_batch_size,expert_model_parallel_size,moe_token_dispatcher_type,"
                   "moe_grouped_gemm,overlap_moe_expert_parallel_comm,tokens_per_second_per_gpu\n"
                   "16,4096,256,16,alltoall,1,1,3000\n")
    (run,) = read_runs([str(moe)], get_model("qwen3-30b-a3b"), get_system("h100-sxm"))
    assert run.plan.overlap_moe_expert_parallel_comm
    runs.write_text("num_gpus,seq_length,global_batch_size,transformer_engine_version,tokens_per_second_per_gpu\n"
                    "8,4096,8,two,3000\n")
    code, err = _calibrate(runs, tmp_path / "out.json", capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "transformer_engine_version" in err, err
