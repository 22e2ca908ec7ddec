"""Faults end cleanly: a diverging run stops with one line and leaves a finite latest checkpoint;
resume with dropout is bit-exact (measurement code draws from no run RNG stream)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from driver_harness import TINY_MODEL, check_ok, losses, run_pretrain  # noqa: F401


def _strict_json(path):
    def refuse(token):
        raise ValueError(f"non-strict JSON constant {token}")
    with open(path) as f:
        return json.load(f, parse_constant=refuse)


def test_divergence_stops_with_one_line_and_a_finite_checkpoint(corpus_prefix, tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = [*TINY_MODEL, "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "20",
            "--data-path", corpus_prefix, "--save", str(ckpt), "--save-interval", "1",
            "--metrics-json", str(tmp_path / "m.json"), "--clip-grad", "0"]
    argv[argv.index("--lr") + 1] = "1e6"
    proc = run_pretrain(argv)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("pretrain_llama.py: error: iteration ")
    assert "is nan" in lines[0] or "is inf" in lines[0]
    stopped_at = int(lines[0].split("iteration ")[1].split(":")[0])
    latest = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert 1 <= latest < stopped_at
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(str(ckpt / f"iter_{latest:07d}"), str(tmp_path / "plain.pt"))  # no process group needed
    tensors = [t for t in torch.load(tmp_path / "plain.pt", weights_only=False).values() if torch.is_tensor(t)]
    assert len(tensors) > 10 and all(torch.isfinite(t).all() for t in tensors)


def test_metrics_json_is_strict_on_every_layout(corpus_prefix, tmp_path):
    out = tmp_path / "m.json"
    check_ok(run_pretrain([*TINY_MODEL, "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "2",
                           "--data-path", corpus_prefix, "--pipeline-model-parallel-size", "2",
                           "--metrics-json", str(out)], nproc=2))
    data = _strict_json(out)
    assert all(math.isfinite(r["loss"]) for r in data["iterations"])


def test_resume_with_dropout_is_bit_exact(corpus_prefix, tmp_path):
    argv = [*TINY_MODEL, "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "4",
            "--data-path", corpus_prefix, "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    full = tmp_path / "full.json"
    check_ok(run_pretrain([*argv, "--metrics-json", str(full)]))
    ckpt = tmp_path / "ckpt"
    check_ok(run_pretrain([*argv, "--save", str(ckpt), "--exit-interval", "2"]))
    resumed = tmp_path / "resumed.json"
    check_ok(run_pretrain([*argv, "--load", str(ckpt), "--metrics-json", str(resumed)]))
    ref = losses(full)
    assert losses(resumed) == ref[2:]


MOCK = [*TINY_MODEL, "--micro-batch-size", "1", "--global-batch-size", "2", "--mock-data"]


def _one_line_exit_2(proc) -> str:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


DAC_CAPABILITIES = ("dac_override", "dac_read_search", "fowner")
"""What lets root write where the mode bits say no (capabilities(7)); dropped to make 0555 bind for root."""


def _unwritable_to_the_driver(directory) -> list[str]:
    """Make ``directory`` read-only to a driver started with the returned command prefix, as this same user
    (who owns the checkout, however private it is: no other uid needs to read it). For an ordinary user the mode
    bits bind; root passes them through its DAC capabilities, so the driver runs as root without them (setpriv
    drops them from the bounding set: gone after exec, for the process and its children)."""
    import os
    import shutil

    directory.chmod(0o555)
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:  # util-linux; present on every Debian image this project runs on
        raise AssertionError("setpriv is needed to drop root's DAC capabilities")
    return ["setpriv", "--bounding-set=" + ",".join("-" + c for c in DAC_CAPABILITIES), "--inh-caps=-all"]


def test_unwritable_save_is_refused_before_the_first_iteration(tmp_path):
    import subprocess

    from driver_harness import PYTHON, REPO, _env
    ro = tmp_path / "ro"
    ro.mkdir()
    prefix = _unwritable_to_the_driver(ro)
    try:
        cmd = [*prefix, PYTHON, str(REPO / "pretrain_llama.py"), *MOCK, "--train-iters", "2", "--save",
               str(ro / "ckpt")]
        proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    finally:
        ro.chmod(0o755)  # so that pytest can remove it
    line = _one_line_exit_2(proc)
    assert f"--save {ro / 'ckpt'} is not writable (Permission denied)" in line and "iteration" not in proc.stdout
    assert not (ro / "ckpt").exists()


def test_a_save_that_runs_out_of_space_is_one_line_and_leaves_the_previous_checkpoint(tmp_path):
    import resource
    import signal
    import subprocess

    from driver_harness import PYTHON, REPO, _env
    ckpt = tmp_path / "ckpt"
    check_ok(run_pretrain([*MOCK, "--train-iters", "2", "--exit-interval", "1", "--save", str(ckpt)]))

    def small_disk():  # files may not grow past 64 KiB: the next checkpoint does not fit
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    proc = subprocess.run([PYTHON, str(REPO / "pretrain_llama.py"), *MOCK, "--train-iters", "2", "--load", str(ckpt),
                           "--save", str(ckpt)], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=180,
                          preexec_fn=small_disk)
    line = _one_line_exit_2(proc)
    assert "iteration 2: the checkpoint could not be written" in line and "(rank 0: " in line
    assert "its temporary files are removed and the latest checkpoint is unchanged" in line
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iter_")) == ["iter_0000001"]


def test_resume_with_another_learning_rate_schedule_needs_a_choice(tmp_path):
    ckpt = tmp_path / "ckpt"
    check_ok(run_pretrain([*MOCK, "--train-iters", "2", "--exit-interval", "1", "--save", str(ckpt)]))
    other = [*MOCK, "--train-iters", "2", "--load", str(ckpt)]
    other[other.index("--lr") + 1] = "2e-3"
    line = _one_line_exit_2(run_pretrain(other))
    assert "was trained with --lr 0.001, this run has 0.002" in line and "--override-opt_param-scheduler" in line
    check_ok(run_pretrain([*other, "--override-opt_param-scheduler"]))
    check_ok(run_pretrain([*other, "--use-checkpoint-opt_param-scheduler"]))


def test_a_second_run_on_the_same_save_directory_is_refused(tmp_path):
    from h3t_training.launch.run_guard import RunLock
    lock = RunLock(str(tmp_path / "ckpt")).acquire()  # a run in progress (this process)
    try:
        line = _one_line_exit_2(run_pretrain([*MOCK, "--train-iters", "1", "--save", str(tmp_path / "ckpt")]))
    finally:
        lock.release()
    assert "is in use by another run (run " in line and f"pid {__import__('os').getpid()}" in line


def test_killing_the_launcher_leaves_no_worker(tmp_path):
    import os
    import signal
    import subprocess
    import time

    from driver_harness import PYTHON, REPO, _env
    from h3t_ext.testing import free_port
    marker = str(tmp_path / "marker-ckpt")
    cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(REPO / "pretrain_llama.py"), *MOCK, "--train-iters", "100000",
           "--save", marker, "--save-interval", "1000000"]
    launcher = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True)

    def workers() -> list[int]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline and int(pid) != launcher.pid and "torch.distributed.run" not in cmdline:
                found.append(int(pid))
        return found

    try:
        for line in launcher.stdout:  # training has started on every rank once iteration lines appear
            if " iteration " in line:
                break
        assert len(workers()) == 2
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 10
        while workers() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert workers() == []
    finally:
        for pid in workers():
            os.kill(pid, signal.SIGKILL)


def _workers_of(marker: str, launcher_pid: int) -> dict[int, int]:
    """{rank: pid} of the driver processes whose command line holds ``marker``."""
    import os
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
            env = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if marker in cmdline and int(pid) != launcher_pid and "torch.distributed.run" not in cmdline:
            rank = next((int(e[5:]) for e in env if e.startswith("RANK=")), None)
            if rank is not None:
                found[rank] = int(pid)
    return found


def test_a_frozen_rank_ends_the_run_within_90s_naming_it(tmp_path):
    import os
    import signal
    import subprocess
    import time

    from driver_harness import PYTHON, REPO, _env
    from h3t_ext.testing import free_port
    marker = str(tmp_path / "frozen-marker")
    cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(REPO / "pretrain_llama.py"), *MOCK, "--train-iters", "100000",
           "--pipeline-model-parallel-size", "2", "--distributed-timeout-minutes", "1", "--metrics-json",
           marker + ".json"]
    launcher = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    try:
        for line in launcher.stdout:
            if " iteration " in line:
                break
        workers = _workers_of(marker, launcher.pid)
        assert sorted(workers) == [0, 1]
        os.kill(workers[1], signal.SIGSTOP)
        frozen_at = time.monotonic()
        _, err = launcher.communicate(timeout=120)
        while _workers_of(marker, launcher.pid) and time.monotonic() - frozen_at < 120:
            time.sleep(0.5)
        took = time.monotonic() - frozen_at
        assert not _workers_of(marker, launcher.pid) and took <= 90, took
        ours = [l for l in err.splitlines() if l.startswith("pretrain_llama.py: error: ")]
        assert len(ours) == 1 and "rank 0: rank 1 stopped responding" in ours[0], err[-3000:]
    finally:
        for pid in _workers_of(marker, launcher.pid).values():
            os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()


@pytest.fixture(scope="module")
def saved_pp2(tmp_path_factory):
    """A 2-rank, 2-stage checkpoint at iteration 1 (its shard files are swapped by the tests, on a copy)."""
    ckpt = tmp_path_factory.mktemp("pp2") / "ckpt"
    check_ok(run_pretrain([*PP2, "--save", str(ckpt), "--exit-interval", "1"], nproc=2))
    return ckpt


PP2 = [*MOCK, "--train-iters", "2", "--pipeline-model-parallel-size", "2"]


def _swapped(saved, tmp_path, *, fix_checksums: bool):
    import hashlib
    import shutil
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    d = ckpt / "iter_0000001"
    a, b = d / "__0_0.distcp", d / "__1_0.distcp"
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    if fix_checksums:  # the manifest agrees with the files: only their places are wrong
        manifest = json.loads((d / "h3t_checksums.json").read_text())
        for name in manifest:
            data = (d / name).read_bytes()
            manifest[name] = [len(data), hashlib.sha256(data).hexdigest()]
        (d / "h3t_checksums.json").write_text(json.dumps(manifest))
    return ckpt


def _ours(proc) -> list[str]:
    assert proc.returncode != 0 and "[rank" not in proc.stderr, proc.stderr[-5000:]  # no worker traceback (plain
    # torchrun, which run_pretrain starts, adds its own report of the failed workers)
    return [l for l in proc.stderr.splitlines() if l.startswith("pretrain_llama.py: error: ")]


@pytest.mark.parametrize("fix_checksums", [False, True])
def test_swapped_checkpoint_files_are_one_line(saved_pp2, tmp_path, fix_checksums):
    ckpt = _swapped(saved_pp2, tmp_path, fix_checksums=fix_checksums)
    ours = _ours(run_pretrain([*PP2, "--load", str(ckpt)], nproc=2))
    reason = "is corrupt or misplaced: " if fix_checksums else "is corrupt ("
    assert ours and all(("__0_0.distcp " + reason) in l or ("__1_0.distcp " + reason) in l for l in ours), ours


def test_out_of_memory_is_one_line_naming_the_stage_its_largest_terms_and_the_flags():
    proc = run_pretrain(["cpu-oom-stage-1", "--", *PP2], nproc=2, entry="tests/fault_injection.py")
    ours = _ours(proc)
    oom = [l for l in ours if "out of CPU memory" in l]
    assert len(oom) == 1, ours
    assert oom[0].startswith("pretrain_llama.py: error: rank 1 (pipeline stage 1 of 2): out of CPU memory "
                             "(RuntimeError: [enforce fail at alloc_cpu.cpp:118] data. DefaultCPUAllocator: can't "
                             "allocate memory"), oom[0]
    assert "the cost model's largest terms for this stage: " in oom[0] and "--offload-alpha" in oom[0] and \
        "--ckpt ours" in oom[0] and "--pipeline-model-parallel-size" in oom[0]
    assert all("a distributed operation failed" in l for l in ours if l not in oom)  # its peer, cut off


def test_a_save_on_a_full_disk_says_so_naming_the_file(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = run_pretrain(["full-disk", "--", *MOCK, "--train-iters", "1", "--save", str(ckpt)],
                        entry="tests/fault_injection.py")
    line = _one_line_exit_2(proc)
    assert (f"iteration 1: the checkpoint could not be written to {ckpt} (rank 0: OSError: [Errno 28] No space "
            f"left on device: '{ckpt / 'iter_0000001.tmp' / '__0_0.distcp'}')") in line, line
    assert "enforce fail" not in line and not list(ckpt.glob("iter_*"))


def _interrupted(tmp_path, *extra):
    """A 2-rank run through the launcher, in its own process group, sent SIGINT once iteration 2 is logged."""
    import os
    import re
    import signal
    import subprocess

    from driver_harness import REPO, _env
    from h3t_ext.testing import free_port
    tiny = [*MOCK]
    for flag, value in (("--num-layers", "2"), ("--hidden-size", "32"), ("--ffn-hidden-size", "64")):
        tiny[tiny.index(flag) + 1] = value
    launcher = subprocess.Popen(["bash", str(REPO / "scripts/launch_torchrun.sh"), *tiny, "--train-iters", "100000",
                                 *extra], cwd=REPO, env=dict(_env(), NPROC_PER_NODE="2", MASTER_PORT=str(free_port())),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = []
    try:
        for line in launcher.stdout:
            out.append(line)
            m = re.search(r" iteration +(\d+)/", line)
            if m and int(m.group(1)) >= 2:
                break
        os.killpg(launcher.pid, signal.SIGINT)
        rest, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    text = "".join(out) + rest
    assert launcher.returncode == 130 and "Traceback" not in text, text[-5000:]
    said = [l for l in text.splitlines() if "interrupted at iteration" in l]
    assert len(said) == 1, text[-5000:]
    return said[0], text


def test_ctrl_c_is_one_line_and_status_130(tmp_path):
    line, _ = _interrupted(tmp_path)
    n = int(line.split("interrupted at iteration ")[1].split(";")[0])
    assert n >= 2 and line == f"pretrain_llama.py: interrupted at iteration {n}; last complete checkpoint: none"


def test_ctrl_c_with_the_exit_signal_handler_saves_first(tmp_path):
    ckpt = tmp_path / "ckpt"
    line, text = _interrupted(tmp_path, "--exit-signal-handler", "--save", str(ckpt))
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert saved >= 2 and f"saved checkpoint at iteration {saved}" in text
    assert line == f"pretrain_llama.py: interrupted at iteration {saved}; last complete checkpoint: iteration {saved}"


def test_a_weight_that_flips_on_one_replica_stops_the_run_before_it_is_saved(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = run_pretrain(["weight-flip-rank-1-iter-3", "--", *MOCK, "--train-iters", "6", "--save", str(ckpt),
                         "--save-interval", "1", "--check-weight-hash-across-dp-replicas-interval", "1"], nproc=2,
                        entry="tests/fault_injection.py")
    ours = _ours(proc)
    assert ours == ["pretrain_llama.py: error: iteration 3: the weights differ across data-parallel replicas "
                    "(--check-weight-hash-across-dp-replicas-interval 1): pipeline stage 0, tensor rank 0: rank 1 "
                    "holds other weights than rank 0; stopped before saving (silent data corruption: check the "
                    "hardware of the ranks named)"], proc.stderr[-5000:]
    assert proc.returncode == 5, proc.stderr[-3000:]  # the failing rank's status (torchrun: 1, naming it)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"  # iterations 1, 2 passed
