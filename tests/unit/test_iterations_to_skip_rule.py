"""--iterations-to-skip: which iterations a value names in each Megatron-LM release (0.16: the iterations done
before it; 0.17+: the logged number, commit b4e4d9618e), the range a value must be in, and the data iterator's
read past one iteration's microbatches (the driver's run: tests/integration/test_iterations_to_skip.py)."""
from __future__ import annotations

import pytest
import torch

from h3t_training import megatron_release
from h3t_training.config.sections import parse_args
from h3t_training.data.batch_schedule import BatchSchedule
from h3t_training.data.datasets import MicrobatchIterator

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--global-batch-size", "4", "--train-iters", "8", "--lr", "1e-3", "--mock-data"]


@pytest.mark.parametrize("release,skipped", [((0, 16), {4, 6}), ((0, 17), {3, 5}), ((0, 19), {3, 5})])
def test_a_value_names_the_iteration_its_release_names(release, skipped, monkeypatch):
    monkeypatch.setattr(megatron_release, "installed_megatron_core", lambda: release)
    assert parse_args([*BASE, "--iterations-to-skip", "3", "5"]).skipped_iterations == skipped
    assert parse_args(BASE).skipped_iterations == frozenset()


@pytest.mark.parametrize("release,value,low", [((0, 16), "-1", 0), ((0, 19), "0", 1)])
def test_a_value_no_iteration_has_is_one_line(release, value, low, monkeypatch, capsys):
    monkeypatch.setattr(megatron_release, "installed_megatron_core", lambda: release)
    with pytest.raises(SystemExit) as e:
        parse_args([*BASE, "--iterations-to-skip", "4", value])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().endswith(
        f"--iterations-to-skip {value} is outside [{low}, inf) (Megatron-LM {release[0]}.{release[1]} counts "
        f"iterations from {low})")


class _Samples:
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        return {"tokens": [i], "labels": [i], "loss_mask": [1.0], "position_ids": [0]}


def test_the_iterator_reads_past_one_iteration():
    """Megatron-LM reads the skipped iteration's batches; the next microbatch is the following iteration's first,
    under a batch schedule whose size changes too."""
    def make():
        return MicrobatchIterator(_Samples(), start_iteration=0, global_batch_size=BatchSchedule.constant(4),
                                  micro_batch_size=1, data_parallel_rank=1, data_parallel_size=2,
                                  device=torch.device("cpu"))

    plain, skipping = make(), make()
    taken = [int(next(plain)["tokens"][0, 0]) for _ in range(6)]  # iterations 0, 1, 2: rank 1's samples 1 3 | 5 7 | ...
    assert taken == [1, 3, 5, 7, 9, 11]
    first = [int(next(skipping)["tokens"][0, 0]) for _ in range(2)]
    skipping.skip_iteration()
    assert first + [int(next(skipping)["tokens"][0, 0]) for _ in range(2)] == [1, 3, 9, 11]
