"""The launcher's variables read once by the entry points (h3t_training.launch.launch_env): torch's env:// names,
Open MPI's under a bare mpirun (as Megatron-Kwai's ATC '24 scripts launch), or one rank."""
from __future__ import annotations

import pytest

from h3t_training.errors import ArgumentError
from h3t_training.launch.launch_env import LaunchEnv, adopt, from_environ, torch_variables

OMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "6002"}


def test_open_mpi_ranks_become_torch_variables():
    env = from_environ(OMPI)
    assert env == LaunchEnv(3, 4, 1, 2, "openmpi", "node0", 6002)
    environ = dict(OMPI)
    assert adopt(environ) == env
    assert {k: environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")} == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert adopt(environ) == LaunchEnv(3, 4, 1, 2, "torch", "node0", 6002)  # a second read sees torch's names


def test_torch_variables_win_over_open_mpi_and_a_bare_process_is_one_rank():
    both = {**OMPI, "RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8"}
    assert from_environ(both).world_size == 8 and from_environ(both).launcher == "torch"
    alone = from_environ({})
    assert alone == LaunchEnv() and torch_variables(alone) == {}
    environ: dict = {}
    adopt(environ)
    assert environ == {}  # a plain run picks its own free port later


@pytest.mark.parametrize("environ, expected", [
    ({k: v for k, v in OMPI.items() if k != "MASTER_PORT"}, "mpirun started 4 ranks without the rendezvous address"),
    ({**OMPI, "OMPI_COMM_WORLD_RANK": "4"}, "OMPI_COMM_WORLD_RANK=4 from the launcher is outside its world of 4"),
    ({**OMPI, "OMPI_COMM_WORLD_SIZE": "four"}, "OMPI_COMM_WORLD_SIZE='four' from the launcher is not an integer"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK=-1 from the launcher is below 0"),
])
def test_a_bad_launch_is_one_line(environ, expected):
    with pytest.raises(ArgumentError) as e:
        from_environ(environ)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_one_open_mpi_rank_needs_no_rendezvous_address():
    env = from_environ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"})
    assert env.world_size == 1 and "MASTER_ADDR" not in torch_variables(env)


def test_an_entry_point_reports_a_bad_launch_in_one_line(capsys):
    from h3t_training.launch.launch_env import adopt_or_report

    assert adopt_or_report({**OMPI, "OMPI_COMM_WORLD_SIZE": "four"}, "pretrain_gpt.py") is None
    assert capsys.readouterr().err == ("pretrain_gpt.py: error: OMPI_COMM_WORLD_SIZE='four' from the launcher is not "
                                       "an integer\n")
    assert adopt_or_report(dict(OMPI), "pretrain_gpt.py").rank == 3 and capsys.readouterr().err == ""


class _Stdout:
    def __init__(self, tty: bool):
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_a_progress_bar_is_drawn_on_a_watched_terminal_only():
    """mpirun gives each rank a pty that scripts tee into logs: no bar there; torchrun's or a bare process's tty
    gets one, a pipe or file none."""
    assert from_environ({}).watched_terminal(_Stdout(True))
    assert from_environ({"RANK": "0", "WORLD_SIZE": "2"}).watched_terminal(_Stdout(True))
    assert not from_environ(OMPI).watched_terminal(_Stdout(True))
    assert not from_environ({}).watched_terminal(_Stdout(False))


@pytest.mark.parametrize("env, ranks", [
    (LaunchEnv(3, 4, 1, 2, "openmpi"), 2),
    (LaunchEnv(5, 8, 5, 1, "torch"), 6),  # a launcher that sets a local rank and no local world size
    (LaunchEnv(), 1),
])
def test_ranks_per_node_is_the_local_world_or_beyond_it_the_local_rank(env, ranks):
    assert env.ranks_per_node == ranks
