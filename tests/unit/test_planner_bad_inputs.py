"""Bad input to ``h3t-plan`` found by the bad-input sweep: each is exit 2 and one line on stderr naming the flag
(or file field) and the valid range, never a traceback. The CLI runs in-process (h3t_ext.planner.cli.main)."""
from __future__ import annotations

import pytest

from h3t_ext.costmodel import get_model
from h3t_ext.planner.cli import main
from h3t_ext.planner.space import R_GPUS, SearchConstraints, enumerate_layouts

RUN = ["--model", "llama-7b", "--seq-length", "4096", "--num-gpus", "8", "--global-batch-size", "64"]
SEARCH = ["search", *RUN]
ESTIMATE = ["estimate", *RUN]


def _error(argv, capsys) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("h3t-plan: error: "), err
    return err


@pytest.mark.parametrize("flag", ["--tensor-model-parallel-size", "--context-parallel-size",
                                  "--pipeline-model-parallel-size"])
def test_search_fixed_size_that_does_not_divide_the_gpus(capsys, flag):
    """A fixed parallel size that does not divide --num-gpus was an UnboundLocalError (the walrus never ran)."""
    err = _error(SEARCH + [flag, "3"], capsys)
    assert "no valid plan for these sizes" in err and "--num-gpus not divisible by the parallel sizes" in err, err


def test_enumeration_counts_a_fixed_size_that_does_not_divide_the_gpus():
    """Each rejection is counted under its own reason (a stale reason of an earlier c was reused before)."""
    model = get_model("llama-7b")
    layouts, rejected = enumerate_layouts(model, num_gpus=8, seq_length=4096, global_batch_size=64, gpus_per_node=8,
                                          constraints=SearchConstraints(tensor_model_parallel_size=3))
    assert layouts == [] and rejected == {R_GPUS: 1}
    layouts, rejected = enumerate_layouts(model, num_gpus=8, seq_length=6, global_batch_size=64, gpus_per_node=8,
                                          constraints=SearchConstraints(tensor_model_parallel_size=1,
                                                                        context_parallel_size=3))
    assert layouts == [] and rejected == {R_GPUS: 1}


@pytest.mark.parametrize("flag, value, expected", [
    ("--num-query-groups", "5", "model: --num-attention-heads (32) must be divisible by --num-query-groups (5); "
                                "valid --num-query-groups: 1, 2, 4, 8, 16, 32"),
    ("--hidden-size", "4097", "model: --hidden-size (4097) must be divisible by --num-attention-heads (32); "
                              "valid --hidden-size: multiples of 32"),
])
def test_model_shape_error_names_the_flags_and_the_valid_values(capsys, flag, value, expected):
    """The model's own rules were printed with its field names and no valid values."""
    assert expected in _error(ESTIMATE + [flag, value], capsys)


def test_optimizer_offload_refusal_names_the_flags(capsys):
    err = _error(ESTIMATE + ["--optimizer-cpu-offload", "--no-use-distributed-optimizer"], capsys)
    assert "--optimizer-cpu-offload needs --use-distributed-optimizer" in err, err


@pytest.mark.parametrize("extra, expected", [
    (["--tensor-model-parallel-size", "1", "--tp-comm-overlap"],
     "--tp-comm-overlap needs --sequence-parallel with --tensor-model-parallel-size > 1 (Megatron-LM asserts it)"),
    (["--tensor-model-parallel-size", "2", "--no-sequence-parallel", "--tp-comm-overlap"],
     "--tp-comm-overlap needs --sequence-parallel"),
    (["--overlap-param-gather"], "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce"),
    (["--overlap-grad-reduce", "--overlap-param-gather", "--no-use-distributed-optimizer"],
     "--overlap-param-gather needs --use-distributed-optimizer"),
])
def test_estimate_refuses_what_megatron_asserts(capsys, extra, expected):
    """Megatron-LM's validate_args asserts these; a plan printed with them would not start."""
    assert expected in _error(ESTIMATE + extra, capsys)


def test_search_prints_tp_comm_overlap_only_where_it_applies(capsys):
    """search --tp-comm-overlap means 'where t > 1': a t = 1 plan's flags leave it out (Megatron-LM would refuse
    them), a t > 1 plan's keep it."""
    assert main(SEARCH + ["--gpu", "h100-sxm", "--tp-comm-overlap", "--top", "40"]) == 0
    flag_lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("#")
                  and "--tensor-model-parallel-size" in line]
    t1 = [line for line in flag_lines if "--tensor-model-parallel-size 1 " in line]
    t2 = [line for line in flag_lines if "--tensor-model-parallel-size 1 " not in line]
    assert t1 and t2, flag_lines
    assert not any("--tp-comm-overlap" in line for line in t1), t1
    assert all("--tp-comm-overlap" in line for line in t2), t2


@pytest.mark.parametrize("extra, expected", [
    (["--data-parallel-sharding-strategy", "optim_grads", "--no-use-distributed-optimizer"],
     "h3t-plan: error: --data-parallel-sharding-strategy shards the optimizer states too: it needs "
     "--use-distributed-optimizer"),
    (["--precision", "fp8", "--transformer-impl", "local"],
     "h3t-plan: error: --fp8-format needs --transformer-impl transformer_engine (FP8 runs in TransformerEngine)"),
    (["--overlap-param-gather"], "h3t-plan: error: --overlap-param-gather needs --use-distributed-optimizer and "
                                 "--overlap-grad-reduce (Megatron-LM asserts it)"),
])
def test_search_refuses_contradicting_switches_up_front(capsys, extra, expected):
    """Switches that no plan can have are refused with their own reason, as estimate refuses them (before: a
    memory verdict for the sharding case, every layout rule listed for the FP8 one)."""
    assert _error(SEARCH + ["--gpu", "h100-sxm", *extra], capsys) == expected
