"""Build script for h3t-ext.

The native copy kernels under ``csrc/`` are an optional extension: they are plain
pybind11 over pointers and sizes (no torch headers), so building them never pulls a
CUDA torch into a build environment. When they cannot be built the package still
installs and falls back to torch copies (``h3t_ext.kernels.active_backend()`` says which).

Install with pybind11 present first: ``pip install pybind11 && pip install --no-build-isolation -e .``

Extensions:
- ``h3t_ext.kernels._copy_cpu``: always attempted when pybind11 and a C++ compiler exist.
- ``h3t_ext.kernels._copy_torch``: the tensor front end of the CPU kernels (reads tensor
  metadata through torch's C++ API). Built only when torch is importable at build time,
  i.e. with ``--no-build-isolation`` next to an installed torch: an isolated build skips it
  and pulls no torch in. ``H3T_BUILD_TORCH_FRONTEND=0`` disables it.
- ``h3t_ext.kernels._copy_cuda``: needs ``nvcc`` (on PATH, or ``$CUDA_HOME/bin``) and either
  ``H3T_BUILD_CUDA=1`` or, when that variable is unset, ``torch.cuda.is_available()`` at build
  time. ``H3T_BUILD_CUDA=0`` disables it. ``H3T_CUDA_ARCH`` sets ``-arch`` (default: nvcc's).
"""
import os
import shutil
import subprocess
import sys
import sysconfig
import warnings

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

CPU_SOURCES = ["csrc/bindings_cpu.cpp", "csrc/copy_cpu.cpp", "csrc/copy_plan.cpp", "csrc/host_alloc.cpp"]
CUDA_SOURCES = ["csrc/bindings_cuda.cpp", "csrc/copy_plan.cpp", "csrc/host_alloc.cpp"]
TORCH_SOURCES = ["csrc/bindings_torch.cpp"]  # copies through _copy_cpu's executor
CUDA_KERNEL = "csrc/copy_cuda.cu"
CXX_FLAGS = ["-O3", "-std=c++17", "-pthread", "-fvisibility=hidden"]


def _warn(msg):
    warnings.warn(f"h3t-ext: {msg}; falling back to torch copies", stacklevel=1)
    print(f"WARNING: h3t-ext: {msg}; falling back to torch copies", file=sys.stderr)


def _find_nvcc():
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        return os.path.join(cuda_home, "bin", "nvcc")
    return shutil.which("nvcc")


def _cuda_root(nvcc):
    """CUDA toolkit root holding include/cuda_runtime.h (follows nvcc wrapper scripts)."""
    candidates = [os.environ.get("CUDA_HOME"), os.path.dirname(os.path.dirname(os.path.realpath(nvcc))),
                  "/usr/local/cuda"]
    candidates += sorted((os.path.join("/usr/local", d) for d in os.listdir("/usr/local")
                          if d.startswith("cuda-")), reverse=True)
    for root in candidates:
        if root and os.path.exists(os.path.join(root, "include", "cuda_runtime.h")):
            return root
    return None


def _want_cuda():
    flag = os.environ.get("H3T_BUILD_CUDA")
    if flag == "0":
        return False
    if flag is None:
        try:
            import torch  # noqa: PLC0415  (only asked, never required)
        except ImportError:
            return False
        if not torch.cuda.is_available():
            return False
    if _find_nvcc() is None:
        _warn("CUDA copy kernels requested but nvcc was not found")
        return False
    return True


class OptionalBuildExt(build_ext):
    """Builds each extension if it can; warns and skips it otherwise."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001  (any build failure must not break install)
            _warn(f"native kernels not built ({exc})")

    def build_extension(self, ext):
        try:
            if any(src.endswith(".cu") for src in ext.sources):
                self._compile_cuda_objects(ext)
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            _warn(f"extension {ext.name} not built ({exc})")

    def _compile_cuda_objects(self, ext):
        nvcc = _find_nvcc()
        cu = [s for s in ext.sources if s.endswith(".cu")]
        ext.sources = [s for s in ext.sources if not s.endswith(".cu")]
        os.makedirs(self.build_temp, exist_ok=True)
        arch = os.environ.get("H3T_CUDA_ARCH")
        for src in cu:
            obj = os.path.join(self.build_temp, os.path.basename(src) + ".o")
            cmd = [nvcc, "-c", src, "-o", obj, "-O3", "-std=c++17", "-Xcompiler", "-fPIC"]
            if arch:
                cmd += [f"-arch={arch}"]
            subprocess.run(cmd, check=True)
            ext.extra_objects.append(obj)


def _torch_frontend(include):
    """The _copy_torch extension when torch is importable here (no build isolation), else None."""
    if os.environ.get("H3T_BUILD_TORCH_FRONTEND") == "0":
        return None
    try:
        import torch  # noqa: PLC0415  (only asked, never required: an isolated build has none)
        from torch.utils import cpp_extension  # noqa: PLC0415
    except ImportError:
        return None
    from setuptools import Extension  # noqa: PLC0415

    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    flags = [f for f in CXX_FLAGS if not f.startswith("-std=")] + ["-std=c++20", abi]
    return Extension("h3t_ext.kernels._copy_torch", TORCH_SOURCES, include_dirs=include + cpp_extension.include_paths(),
                     library_dirs=[lib], runtime_library_dirs=[lib], libraries=["c10", "torch", "torch_cpu", "torch_python"],
                     extra_compile_args=flags, extra_link_args=["-pthread"], language="c++")


def _extensions():
    try:
        import pybind11  # noqa: PLC0415
    except ImportError:
        _warn("pybind11 is not importable at build time (pip install pybind11, then --no-build-isolation)")
        return []
    from setuptools import Extension  # noqa: PLC0415

    include = [pybind11.get_include(), "csrc", sysconfig.get_paths()["include"]]
    exts = [Extension("h3t_ext.kernels._copy_cpu", CPU_SOURCES, include_dirs=include,
                      extra_compile_args=CXX_FLAGS, extra_link_args=["-pthread"], language="c++")]
    frontend = _torch_frontend(include)
    if frontend is not None:
        exts.append(frontend)
    if _want_cuda():
        root = _cuda_root(_find_nvcc())
        if root is None:
            _warn("nvcc found but no CUDA toolkit headers (cuda_runtime.h)")
            return exts
        lib = os.path.join(root, "lib64")
        exts.append(Extension("h3t_ext.kernels._copy_cuda", CUDA_SOURCES + [CUDA_KERNEL],
                              include_dirs=include + [os.path.join(root, "include")],
                              library_dirs=[lib], runtime_library_dirs=[lib], libraries=["cudart"],
                              extra_compile_args=CXX_FLAGS, extra_link_args=["-pthread"], language="c++"))
    return exts


setup(
    name="h3t-ext",
    version="0.1.0",
    description="Megatron-LM extension: ckpt=ours, fractional activation offload, cost model and planner",
    python_requires=">=3.11",
    # The driver is h3t_training, a path no megatron-core release ships (0.17+ ship megatron.training).
    packages=find_packages(include=["h3t_ext", "h3t_ext.*", "h3t_training", "h3t_training.*"]),
    py_modules=["pretrain_gpt", "pretrain_llama"],
    package_data={"h3t_ext": ["data/*.json", "data/**/*.json"]},
    install_requires=["rich>=13"],
    extras_require={
        "train": ["torch==2.13.0", "megatron-core>=0.16.1", "numpy"],
        "test": ["pytest>=8"],
    },
    entry_points={"console_scripts": ["h3t-plan = h3t_ext.planner.cli:main"]},
    ext_modules=_extensions(),
    cmdclass={"build_ext": OptionalBuildExt},
)
