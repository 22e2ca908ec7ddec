"""Launchers: --dry-run prints the resolved command; mpirun and torchrun really start 2 CPU ranks (mpirun when
installed), and torchrun's ranks train what the tests' forked worlds (driver_harness.run_pretrain) train."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess

import pytest

from driver_harness import PYTHON, REPO, TINY_MODEL, _env, check_ok, free_port, losses, run_pretrain


def _dry(script: str, *args: str, **env: str) -> list[str]:
    proc = subprocess.run(["bash", str(REPO / script), "--dry-run", *args], cwd=REPO, env={**_env(), **env},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return shlex.split(proc.stdout)


def test_torchrun_dry_run_resolves_env_and_passes_args_through():
    cmd = _dry("scripts/launch_torchrun.sh", "--lr", "1e-3", "--data-path", "a b", NPROC_PER_NODE="4",
               MASTER_PORT="1234")
    assert cmd[1:3] == ["-m", "h3t_training.launch.torchrun"]  # torchrun, ending quietly on Ctrl-C
    assert cmd[cmd.index("--nproc-per-node") + 1] == "4" and cmd[cmd.index("--master-port") + 1] == "1234"
    assert cmd[-5:] == [str(REPO / "pretrain_llama.py"), "--lr", "1e-3", "--data-path", "a b"]


def test_mpirun_dry_run_maps_ranks_through_the_wrapper():
    cmd = _dry("scripts/launch_mpirun.sh", "--train-iters", "3", NP="8", MASTER_ADDR="node0")
    assert cmd[0] == "mpirun" and cmd[cmd.index("-np") + 1] == "8"
    assert "MASTER_ADDR=node0" in cmd and "H3T_MPI_RANK_WRAPPER=1" in cmd
    assert ("--allow-run-as-root" in cmd) == (os.getuid() == 0)
    assert cmd[-3:] == [str(REPO / "scripts/launch_mpirun.sh"), "--train-iters", "3"]


def test_mpirun_passes_the_cuda_setting_megatron_lm_asserts_to_every_rank(monkeypatch):
    """CUDA_DEVICE_MAX_CONNECTIONS, which the driver checks on each rank as Megatron-LM asserts it, reaches the ranks
    on other hosts when set (mpirun forwards only what -x names); the 256-GPU example sets it to 1 (tensor
    parallelism on Hopper) unless given, and an empty value leaves it out (a Megatron FSDP plan needs it unset)."""
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in _dry("scripts/launch_mpirun.sh", CUDA_DEVICE_MAX_CONNECTIONS="1")
    assert not any(a.startswith("CUDA_DEVICE_MAX_CONNECTIONS") for a in _dry("scripts/launch_mpirun.sh"))
    example = _dry("examples/llama_256gpu.sh", LAUNCHER="mpirun")
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in example and "--tensor-model-parallel-size" in example
    assert "CUDA_DEVICE_MAX_CONNECTIONS=8" in _dry("examples/llama_256gpu.sh", LAUNCHER="mpirun",
                                                   CUDA_DEVICE_MAX_CONNECTIONS="8")
    assert not any(a.startswith("CUDA_DEVICE_MAX_CONNECTIONS") for a in _dry(
        "examples/llama_256gpu.sh", LAUNCHER="mpirun", CUDA_DEVICE_MAX_CONNECTIONS=""))


def test_slurm_dry_run_uses_srun_with_slurm_rank_variables():
    cmd = _dry("scripts/launch_slurm.sbatch", "--seed", "5", GPUS_PER_NODE="4", SLURM_JOB_NUM_NODES="3")
    assert cmd[0] == "srun" and cmd[cmd.index("--nodes") + 1] == "3" and cmd[cmd.index("--ntasks-per-node") + 1] == "4"
    task = cmd[cmd.index("-c") + 1]
    assert "RANK=$SLURM_PROCID" in task and "WORLD_SIZE=$SLURM_NTASKS" in task and "LOCAL_RANK=$SLURM_LOCALID" in task
    assert "LOCAL_WORLD_SIZE=$SLURM_NTASKS_PER_NODE" in task  # the ranks per node the driver's GPU check reads
    assert cmd[-2:] == ["--seed", "5"]


@pytest.mark.parametrize("script", ["scripts/launch_torchrun.sh", "scripts/launch_mpirun.sh",
                                    "scripts/launch_slurm.sbatch"])
def test_every_launcher_starts_megatron_lms_entry_name_when_asked(script):
    cmd = _dry(script, "--seed", "5", ENTRY="pretrain_gpt.py")
    started = cmd[cmd.index("-x") + 1:] if script.endswith("mpirun.sh") else cmd
    assert (str(REPO / "pretrain_gpt.py") in cmd) or ("ENTRY=pretrain_gpt.py" in started), cmd
    assert str(REPO / "pretrain_llama.py") not in cmd
    proc = subprocess.run(["bash", str(REPO / script), "--dry-run"], cwd=REPO, env={**_env(), "ENTRY": "train.py"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr == (f"{os.path.basename(script)}: error: ENTRY=train.py is not one "
                                                    "of pretrain_llama.py, pretrain_gpt.py\n")


def test_the_preflight_check_applies_the_entrys_defaults_and_is_silent_when_the_flags_are_good():
    flags = [*TINY_MODEL, "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1", "--mock-data",
             "--max-position-embeddings", "64"]  # pretrain_gpt.py requires it, as Megatron-LM does

    def preflight(*entry):
        return subprocess.run([PYTHON, "-m", "h3t_training.launch.preflight",
                               "--world-size", "2", *entry, "--", *flags], cwd=REPO, env=_env(),
                              capture_output=True, text=True, timeout=120)

    llama = preflight()
    assert llama.returncode == 0 and llama.stdout == llama.stderr == ""  # no optional-accelerator warnings either
    gpt = preflight("--entry", "pretrain_gpt.py")  # Megatron-LM's default tokenizer, GPT2BPETokenizer
    assert gpt.returncode == 2 and gpt.stderr == ("pretrain_gpt.py: error: --tokenizer-type GPT2BPETokenizer needs "
                                                  "--vocab-file PATH\n"), gpt.stderr


@pytest.mark.parametrize("script, env", [
    ("examples/tiny_cpu.sh", {}),
    ("examples/llama7b_4gpu.sh", {"MODE": "baseline"}),
    ("examples/llama7b_4gpu.sh", {"MODE": "ours"}),
    ("examples/llama7b_4gpu.sh", {"MODE": "nockpt"}),
    ("examples/llama65b_256gpu.sh", {}),
    ("examples/llama2_70b_256gpu.sh", {"LAUNCHER": "mpirun"}),
    ("examples/llama175b_256gpu.sh", {}),
])
def test_example_scripts_dry_run(script, env):
    cmd = _dry(script, **env)
    assert str(REPO / "pretrain_llama.py") in cmd or str(REPO / "scripts/launch_mpirun.sh") in cmd


def test_torchrun_ranks_train_what_the_tests_forked_ranks_train(corpus_prefix, tmp_path):
    """The driver tests start their multi-rank runs as forks of a preloaded server (h3t_ext.testing.run_entry_world);
    users start them with torchrun. The same 2-rank run (t=2 with sequence parallelism and ckpt=ours, the data read
    from files) through scripts/launch_torchrun.sh gives the forked world's losses and gradient norms bit for bit,
    and the same rank-0 report."""
    argv = [*TINY_MODEL, "--global-batch-size", "4", "--train-iters", "3", "--data-path", corpus_prefix,
            "--tensor-model-parallel-size", "2", "--sequence-parallel", "--ckpt", "ours"]
    launched, forked = tmp_path / "torchrun.json", tmp_path / "forked.json"
    proc = subprocess.run(["bash", str(REPO / "scripts/launch_torchrun.sh"), *argv, "--metrics-json", str(launched)],
                          cwd=REPO, env={**_env(), "NPROC_PER_NODE": "2", "MASTER_PORT": str(free_port())},
                          capture_output=True, text=True, timeout=300)
    check_ok(proc)
    world = run_pretrain([*argv, "--metrics-json", str(forked)], nproc=2)
    check_ok(world)
    a, b = json.loads(launched.read_text()), json.loads(forked.read_text())
    assert [(r["loss"], r["grad_norm"]) for r in a["iterations"]] == [(r["loss"], r["grad_norm"])
                                                                       for r in b["iterations"]]
    assert len(a["iterations"]) == 3 and "world size 2" in proc.stdout and "world size 2" in world.stdout


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="OpenMPI's mpirun is not installed")
def test_mpirun_launcher_runs_two_cpu_ranks(tmp_path):
    path = tmp_path / "metrics.json"
    env = {**_env(), "NP": "2", "MASTER_PORT": str(free_port()), "MPI_EXTRA_ARGS": "--oversubscribe"}
    proc = subprocess.run(["bash", str(REPO / "scripts/launch_mpirun.sh"), *TINY_MODEL, "--global-batch-size", "4",
                           "--train-iters", "2", "--mock-data", "--pipeline-model-parallel-size", "2",
                           "--metrics-json", str(path)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    check_ok(proc)
    assert "world size 2" in proc.stdout
    assert len(losses(path)) == 2


def test_every_python_module_a_launcher_runs_exists():
    """``python -m MODULE`` in the launch scripts names a module of this repo or its environment (a renamed
    module must not leave a launcher that fails on the cluster only)."""
    import re

    scripts = sorted((REPO / "scripts").glob("*.sh")) + sorted((REPO / "scripts").glob("*.sbatch"))
    found = {m for s in scripts for m in re.findall(r'"?\$\{?PYTHON\}?"? -m ([A-Za-z_][\w.]*)', s.read_text())}
    assert "h3t_training.launch.preflight" in found  # the check below does look at the launchers
    # looked up in a child interpreter: finding 'pip' here would turn off setuptools' distutils shim in this process
    # (its _distutils_hack takes a pip lookup for pip running), and a later first import of megatron.core fails
    probe = ("import importlib.util, sys\n"
             "def missing(m):\n"
             "    try:\n"
             "        return importlib.util.find_spec(m) is None\n"
             "    except ModuleNotFoundError:\n"  # a parent package is missing
             "        return True\n"
             "print(' '.join(m for m in sys.argv[1:] if missing(m)))\n")
    proc = subprocess.run([PYTHON, "-c", probe, *sorted(found)], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == [], (proc.stdout, proc.stderr)


def test_the_megatron_compat_probe_prints_its_command_and_names_a_missing_wheel(tmp_path):
    """scripts/megatron_compat_probe.sh (newer megatron-core wheels on this Python): --dry-run prints the pytest
    command with its stand-ins' paths and the arguments passed through; without a wheel it refuses in one line."""
    script = str(REPO / "scripts/megatron_compat_probe.sh")
    env = {**_env(), "WORK": str(tmp_path / "probe")}
    proc = subprocess.run(["bash", script, "--dry-run", "tests/unit/test_kv_channels.py", "-x"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    cmd = proc.stdout.strip().splitlines()[-1]
    assert f"PYTHONPATH={tmp_path}/probe/shim:{tmp_path}/probe/site:{tmp_path}/probe/triton" in cmd
    assert cmd.endswith("-m pytest -q -p no:cacheprovider tests/unit/test_kv_channels.py -x")
    bad = subprocess.run(["bash", script], cwd=REPO, env={**env, "WHEEL": str(tmp_path / "none.whl")},
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip() == (
        f"megatron_compat_probe.sh: error: WHEEL={tmp_path}/none.whl is not a megatron-core wheel file")
    assert not (tmp_path / "probe").exists()  # nothing unpacked or downloaded
