"""A searched plan's printed flags are its launch: given to ``h3t-plan estimate`` with the same run they price the
same plan, to the token and the byte. Two gaps this found: a MoE plan with ckpt full printed no recompute flag (its
launch recomputed nothing), and ``estimate`` refused the ``--ckpt-format fsdp_dtensor`` of every Megatron FSDP plan.
The CLI runs in-process (``h3t_ext.planner.cli.main``)."""
from __future__ import annotations

import json

import pytest

from h3t_ext.planner.cli import main


def _code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's own refusals (a value outside its choices)
        return e.code


def _json(argv, capsys):
    assert main([*argv, "--json"]) == 0, capsys.readouterr().err
    out = json.loads(capsys.readouterr().out)
    return out[0] if isinstance(out, list) and len(out) == 1 and "megatron_flags" not in out[0] else out


@pytest.mark.parametrize("run, extra, wants", [
    (["--model", "llama-7b", "--gpu", "h100-sxm", "--num-gpus", "8", "--seq-length", "4096", "--global-batch-size",
      "64"], [], "--use-megatron-fsdp"),
    (["--model", "mixtral-8x7b", "--gpu", "gb200", "--num-gpus", "32", "--seq-length", "2048", "--global-batch-size",
      "256"], ["--ckpt", "full"], "--recompute-granularity"),
    (["--model", "llama3-8b", "--gpu", "h100-sxm", "--num-gpus", "8", "--seq-length", "8192", "--global-batch-size",
      "128"], ["--precision", "fp8", "--memory-budget", "40GB"], "--fp8-format"),
])
def test_a_searched_plans_flags_estimate_to_the_same_figures(capsys, run, extra, wants):
    plans = _json(["search", *run, *extra, "--top", "3"], capsys)
    budget = extra[extra.index("--memory-budget"):][:2] if "--memory-budget" in extra else []
    assert any(wants in p["megatron_flags"] for p in plans)
    for p in plans:
        est = _json(["estimate", *run[:8], *budget, *p["megatron_flags"]], capsys)
        est = est[0] if isinstance(est, list) else est
        assert (est["tokens_per_second"], est["peak_memory_bytes"]) == \
            pytest.approx((p["tokens_per_second"], p["peak_memory_bytes"]), rel=1e-12), p["megatron_flags"]


ESTIMATE = ["estimate", "--model", "llama-7b", "--gpu", "h100-sxm", "--num-gpus", "8", "--seq-length", "4096",
            "--global-batch-size", "64"]
FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"]
FSDP2 = ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"]


@pytest.mark.parametrize("extra, fragment", [
    ([*FSDP, "--ckpt-format", "torch_dist"], "--ckpt-format: Megatron FSDP needs --ckpt-format fsdp_dtensor"),
    (["--ckpt-format", "fsdp_dtensor"], "--ckpt-format fsdp_dtensor: needs --use-megatron-fsdp"),
    ([*FSDP2, "--ckpt-format", "torch"], "--use-torch-fsdp2 needs --ckpt-format torch_dist or torch_dcp"),
    (["--ckpt-format", "torch_dcp"], "--ckpt-format torch_dcp: needs --use-torch-fsdp2 at"),
    ([*FSDP2, "--ckpt-format", "torch_dcp", "--tensor-model-parallel-size", "2"],
     "--ckpt-format torch_dcp: needs --use-torch-fsdp2 at --tensor-model-parallel-size 1"),
    (["--ckpt-format", "zarr"], "invalid choice: 'zarr'"),
])
def test_ckpt_format_is_checked_against_the_fsdp_switches_in_one_line(capsys, extra, fragment):
    """Megatron-LM 0.16-0.19 assert these at start-up."""
    assert _code([*ESTIMATE, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and fragment in err, err


def test_search_refuses_the_fsdp2_format_it_cannot_search(capsys):
    assert _code(["search", *ESTIMATE[1:], "--ckpt-format", "torch_dcp"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "which search does not search: price that plan with estimate" in err, err


@pytest.mark.parametrize("extra", [[*FSDP, "--ckpt-format", "fsdp_dtensor"], ["--ckpt-format", "torch_dist"],
                                   ["--ckpt-format", "torch"], [*FSDP2, "--ckpt-format", "torch_dcp"]])
def test_ckpt_format_megatron_runs_with_is_accepted(capsys, extra):
    assert main([*ESTIMATE, *extra]) == 0, capsys.readouterr().err


def test_a_search_given_another_ckpt_format_leaves_out_the_fsdp_shardings(capsys):
    """Megatron FSDP runs only with fsdp_dtensor: a search told the run's format is torch_dist does not offer it (its
    best plan without the format is an FSDP plan)."""
    run = ESTIMATE[1:]
    free = _json(["search", *run, "--top", "5"], capsys)
    told = _json(["search", *run, "--top", "5", "--ckpt-format", "torch_dist"], capsys)
    assert "--use-megatron-fsdp" in free[0]["megatron_flags"]
    assert not any("--use-megatron-fsdp" in p["megatron_flags"] for p in told)
