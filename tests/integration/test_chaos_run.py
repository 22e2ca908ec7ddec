"""scripts/chaos_run.py: a 2-rank run under torchrun --max-restarts, killed twice (once while a checkpoint is
being written), resumes on its own and ends with the weights of an uninterrupted run, bit for bit."""
from __future__ import annotations

import json
import subprocess

import pytest

from driver_harness import PYTHON, REPO, _env

SCRIPT = str(REPO / "scripts" / "chaos_run.py")


def _chaos(*argv, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, SCRIPT, *argv], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow  # about 50 s: restarts under torchrun; test_faults and test_checkpoint_resume cover resume bit for bit
def test_a_run_killed_twice_once_during_a_save_resumes_by_itself_to_bit_equal_weights(tmp_path):
    proc = _chaos("--train-iters", "20", "--kills", "2", "--save-interval", "3", "--json", "--workdir",
                  str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    chaos = report["chaos"]
    assert report["problems"] == [] and report["weights_equal"] is True
    assert report["tensors_compared"] >= 20 and report["tensors_different"] == []  # model and Adam states
    assert chaos["returncode"] == 0 and chaos["restarts"] == 2 and len(chaos["kills"]) == 2
    first, second = chaos["kills"]
    # the first kill hit a save in progress; the tracker stayed at the checkpoint before it, which was complete
    # (h3t_training.loop.checkpointing.check_latest ran between the kill and the resume), and the run resumed there
    assert first["save_iteration"] is not None and first["save_iteration"] >= 6 and first["interrupted_save"]
    assert first["latest_after"] < first["save_iteration"] and first["latest_after"] % 3 == 0
    assert second["save_iteration"] is None and second["seen_iteration"] >= 12
    assert chaos["resumed_from"] == [first["latest_after"], second["latest_after"]]
    assert chaos["iterations_run"] > 20  # iterations after the last checkpoint were lost and done again
    assert report["reference"]["iterations_run"] == 20 and report["reference"]["returncode"] == 0
    assert not list(tmp_path.joinpath("chaos").glob("iter_*.tmp"))  # the interrupted save was redone


def test_dry_run_prints_the_commands_and_the_kill_plan():
    proc = _chaos("--dry-run", "--train-iters", "60", "--kills", "5", timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "--max-restarts 0 " in lines[0] and "--max-restarts 7 " in lines[1]
    assert all("h3t_training.launch.torchrun --nproc-per-node 2" in l and "--train-iters 60" in l and "--save-interval 4"
               in l for l in lines[:2])
    kills = [l for l in lines if l.startswith("kill ")]
    assert [l.split("iteration ")[1].split(",")[0] for l in kills] == ["10", "20", "30", "40", "50"]
    assert "while the next checkpoint is being written" in kills[0] and \
        not any("being written" in l for l in kills[1:])


@pytest.mark.parametrize("argv, expected", [
    (["--kills", "6", "--kill-every", "2", "--train-iters", "12"],
     "--kills 6 x --kill-every 2 is outside [0, --train-iters 12): the last kill would come after the end"),
    (["--nproc", "1"], "--nproc 1 is outside [2, inf) (a kill needs a peer to take down)"),
    (["--kills", "3", "--max-restarts", "2"], "--max-restarts 2 is outside [--kills 3, inf)"),
])
def test_bad_flags_are_one_line(argv, expected):
    proc = _chaos(*argv, "--dry-run", timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"chaos_run.py: error: {expected}\n"


def test_a_tracker_naming_an_incomplete_checkpoint_is_caught(tmp_path):
    from h3t_training.loop.checkpointing import CheckpointError, check_latest

    assert check_latest(str(tmp_path)) is None
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("6\n")
    with pytest.raises(CheckpointError, match="names iteration 6, but .*iter_0000006 does not exist"):
        check_latest(str(tmp_path))
    (tmp_path / "iter_0000006").mkdir()
    with pytest.raises(CheckpointError, match="metadata.json cannot be read"):
        check_latest(str(tmp_path))


def test_each_start_of_a_torchrun_worker_group_has_its_own_store_keys(monkeypatch):
    from h3t_training.loop.initialize import attempt_prefix

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert attempt_prefix() == ""  # mpirun, srun, a plain start: rank 0 hosts a fresh store
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = attempt_prefix()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    assert first == "h3t_attempt_0/" and attempt_prefix() == "h3t_attempt_3/"
