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
