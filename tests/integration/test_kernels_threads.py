"""The CPU copy threads (csrc/copy_cpu.cpp: run_tasks) under ThreadSanitizer.

tests/native/run_tasks_stress.cpp copies random batches of contiguous and row-strided tasks
with up to three threads in odd-sized chunks; it is compiled with ``-fsanitize=thread``
(plain, when the compiler lacks TSan) and must report no race, equal bytes and untouched
gaps. Skipped without a C++ compiler.
"""
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CXX = shutil.which("g++") or shutil.which("c++")

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler")


def _build(out: pathlib.Path, sanitize: bool) -> bool:
    flags = ["-fsanitize=thread", "-O1", "-g"] if sanitize else ["-O2"]
    cmd = [CXX, "-std=c++17", "-pthread", *flags, f"-I{ROOT / 'csrc'}", str(ROOT / "tests/native/run_tasks_stress.cpp"),
           str(ROOT / "csrc/copy_cpu.cpp"), str(ROOT / "csrc/copy_plan.cpp"), "-o", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300).returncode == 0


def test_copy_threads_are_race_free_and_exact(tmp_path):
    exe = tmp_path / "run_tasks_stress"
    sanitized = _build(exe, sanitize=True)
    if not sanitized:
        assert _build(exe, sanitize=False), "run_tasks_stress.cpp does not compile"
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300,
                         env={"TSAN_OPTIONS": "halt_on_error=1 exitcode=66"})
    assert "ThreadSanitizer" not in run.stderr, run.stderr[-4000:]
    assert run.returncode == 0 and run.stdout.strip() == "ok", (run.stdout + run.stderr)[-4000:]
