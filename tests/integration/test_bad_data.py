"""Bad data files and data flags end in one line naming the file or flag (exit 2), before any rank starts."""
from __future__ import annotations

import shutil
import struct
import subprocess

import pytest

from driver_harness import PYTHON, REPO, TINY_MODEL, _env, run_pretrain  # noqa: F401
from h3t_training.data.data_checks import DataFileError, check_indexed_dataset, parse_split


def _run(argv):
    """The driver on one rank (a fork of the test server, as the launchers' first rank would run it)."""
    return run_pretrain([*TINY_MODEL, "--global-batch-size", "2", "--train-iters", "1", *argv])


def _one_line(proc) -> str:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.fixture()
def copy(corpus_prefix, tmp_path):
    dst = tmp_path / "d"
    for ext in (".bin", ".idx"):
        shutil.copy(corpus_prefix + ext, str(dst) + ext)
    return str(dst)


def _damage(prefix: str, how: str) -> None:
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    if how == "empty idx":
        open(idx, "wb").close()
    elif how == "garbage idx":
        open(idx, "wb").write(b"garbage" * 100)
    elif how == "truncated idx":
        data = open(idx, "rb").read()
        open(idx, "wb").write(data[:len(data) // 2])
    elif how == "truncated bin":
        data = open(bin_, "rb").read()
        open(bin_, "wb").write(data[:-10])
    elif how == "bad version":
        data = bytearray(open(idx, "rb").read())
        data[9:17] = struct.pack("<Q", 7)
        open(idx, "wb").write(bytes(data))
    elif how == "empty bin":
        open(bin_, "wb").close()


@pytest.mark.parametrize("how, expected", [
    ("empty idx", "is not a megatron-core index file"),
    ("garbage idx", "is not a megatron-core index file"),
    ("truncated idx", "is truncated"),
    ("truncated bin", "(truncated or not its pair)"),
    ("empty bin", "has 0 bytes"),
    ("bad version", "has index version 7"),
])
def test_damaged_dataset_is_one_line(copy, how, expected):
    _damage(copy, how)
    with pytest.raises(DataFileError, match=r"\.(idx|bin)"):
        check_indexed_dataset(copy)
    line = _one_line(_run(["--data-path", copy]))
    assert expected in line and (copy + ".idx" in line or copy + ".bin" in line)


@pytest.mark.parametrize("argv, expected", [
    (["--split", "abc"], "--split 'abc' is not comma-separated numbers"),
    (["--split", "0,100,0"], "--split 0,100,0 leaves no training data"),
    (["--split", "1,-1,0"], "takes up to three finite non-negative shares"),
])
def test_bad_split_is_one_line(corpus_prefix, argv, expected):
    assert expected in _one_line(_run(["--data-path", corpus_prefix, *argv]))


def test_odd_blends_are_one_line(corpus_prefix):
    # an odd count is prefixes alone, as megatron-core reads it: '0.5' is a dataset that does not exist
    assert "--data-path 0.5: 0.5.idx does not exist" in _one_line(_run(["--data-path", "0.5", corpus_prefix,
                                                                        corpus_prefix]))
    assert "stands where a weight belongs" in _one_line(_run(["--data-path", "0.5", corpus_prefix, corpus_prefix,
                                                              corpus_prefix]))
    assert "weight -1 of" in _one_line(_run(["--data-path", "-1", corpus_prefix]))


def test_token_ids_beyond_the_vocabulary_are_named(corpus_prefix):
    from h3t_training.data.tokenizer import NullTokenizer

    # --vocab-size 100 is 100 ids from Megatron-LM 0.18 on (the end of document the last), 101 before (one appended)
    size = NullTokenizer(100).vocab_size
    assert size in (100, 101)
    line = _one_line(_run(["--data-path", corpus_prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]))
    assert f"outside the tokenizer's vocabulary of {size} " in line


def test_a_good_dataset_passes(corpus_prefix):
    assert check_indexed_dataset(corpus_prefix) > 10
    assert parse_split("969,30,1") == (969.0, 30.0, 1.0) and parse_split("98/2") == (98.0, 2.0, 0.0)


# --------------------------------------------------------------------------- h3t-plan's --system-file
SYSTEM_RUN = ["estimate", "--model", "llama-7b", "--seq-length", "4096", "--num-gpus", "8", "--global-batch-size",
              "64"]


def _system_file(tmp_path, **fields) -> str:
    """The shipped h800 system file with ``fields`` replaced (a value of ``...`` removes the field)."""
    import json
    d = json.loads((REPO / "h3t_ext/data/systems/h800.json").read_text())
    for k, v in fields.items():
        d.pop(k, None) if v is ... else d.__setitem__(k, v)
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(d))
    return str(path)


def _plan(argv):
    return subprocess.run([PYTHON, "-m", "h3t_ext.planner", *argv], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=30)


def _plan_error(argv) -> str:
    line = _one_line(_plan(argv))
    assert line.startswith("h3t-plan: error: argument --system-file: "), line
    return line.removeprefix("h3t-plan: error: argument --system-file: ")


@pytest.mark.parametrize("fields, expected", [
    # a typo of an optional field left the host memory unchecked (the file loaded and priced)
    ({"host_memory_byte": 2 * 10**12}, "field host_memory_byte is not a system file field (a typo would be ignored); "
                                       "valid: allocator_fragmentation_fraction, calibration, compute_capability, "),
    ({"name": ""}, "field name must be a non-empty string, got ''"),
    ({"name": 5}, "field name must be a non-empty string, got 5"),
    # a positive rate far below one per second priced an iteration at NaN seconds, exit 0
    ({"hbm_bandwidth": 1e-300}, "field hbm_bandwidth must be a finite number >= 1, got 1e-300"),
    ({"peak_bf16_flops": 1e-300}, "field peak_bf16_flops must be a finite number >= 1, got 1e-300"),
    ({"nvlink_bandwidth": 0.5}, "field nvlink_bandwidth must be a finite number >= 1, got 0.5"),
    ({"host_memory_bandwidth": 1e-300}, "field host_memory_bandwidth must be 0 or a finite number >= 1, got 1e-300"),
    ({"peak_fp8_flops": 1e-9}, "field peak_fp8_flops must be 0 or a finite number >= 1, got 1e-09"),
    # counts and bytes past any GPU priced iterations of 1e27 s and budgets of 300 digits
    ({"num_sms": 10**30}, f"field num_sms must be an integer > 0 and <= 1048576, got {10**30}"),
    ({"gemm_tile_m": 10**9}, "field gemm_tile_m must be an integer > 0 and <= 1048576, got 1000000000"),
    ({"hbm_bytes": 10**300}, "field hbm_bytes must be an integer > 0 and <= 1152921504606846976, got 1000"),
    ({"hbm_bytes": 10**400}, "field hbm_bytes must be an integer > 0 and <= 1152921504606846976, got 1000"),
])
def test_bad_system_file_field_is_one_line(tmp_path, fields, expected):
    path = _system_file(tmp_path, **fields)
    assert _plan_error([*SYSTEM_RUN, "--system-file", path]).startswith(f"--system-file {path}: {expected}")


def test_system_file_budget_error_names_the_file(tmp_path):
    path = _system_file(tmp_path, hbm_bytes=1000)  # said 'system file: ...', not which
    assert _plan_error([*SYSTEM_RUN, "--system-file", path]) == (
        f"--system-file {path}: field hbm_bytes (1000) must exceed cuda_context_bytes + 5 x "
        "nccl_bytes_per_communicator (5624220160)")


def test_optional_rates_of_zero_and_notes_load(tmp_path):
    path = _system_file(tmp_path, peak_fp8_flops=0, host_memory_bandwidth=0, source_mine="measured", _note="x",
                        name="my-h800")
    proc = _plan([*SYSTEM_RUN, "--system-file", path, "--json"])
    assert proc.returncode == 0 and not proc.stderr, proc.stderr


@pytest.mark.parametrize("backward_fraction, message", [
    (1e-300, "system slow: peak_bf16_flops x attention_peak_fraction x attention_backward_rate_fraction is 0 per "
             "second, too small to price"),  # the product underflows: kernels.kernel_rates
    (0.85, "system slow: its rates and efficiencies price an iteration at nan s (a peak FLOP/s or a bandwidth times "
           "its efficiency is too small to price)"),  # every rate > 0, the times overflow: estimate's guard
])
def test_rates_too_small_with_their_efficiencies_are_a_typed_reason(tmp_path, backward_fraction, message):
    """Rates of 1/s times efficiencies of 1e-300 priced an iteration at NaN seconds, exit 0."""
    import json
    from h3t_ext.costmodel.specs import system_file_dict
    d = system_file_dict("h800")
    d.update({k: 1.0 for k in ("peak_bf16_flops", "hbm_bandwidth", "nvlink_bandwidth", "network_bandwidth",
                                "pcie_bandwidth")})
    d["efficiencies"] = {k: 1e-300 for k in d["efficiencies"]}
    d["efficiencies"]["attention_backward_rate_fraction"] = backward_fraction
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(d))
    assert _one_line(_plan([*SYSTEM_RUN, "--system-file", str(path)])) == (
        f"h3t-plan: error: {message}; valid: rates of at least one per second and efficiencies that keep them so")
