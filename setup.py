"""Build script for h3t-ext.

The native copy kernels under ``csrc/`` are an optional extension: they are plain
pybind11 over pointers and sizes (no torch headers), so building them never pulls a
CUDA torch into a build environment. When they cannot be built the package still
installs and falls back to torch copies.
"""
from setuptools import find_packages, setup

setup(
    name="h3t-ext",
    version="0.1.0",
    description="Megatron-LM extension: ckpt=ours, fractional activation offload, cost model and planner",
    python_requires=">=3.11",
    packages=find_packages(include=["h3t_ext", "h3t_ext.*"]),
    package_data={"h3t_ext": ["data/*.json", "data/**/*.json"]},
    install_requires=["rich>=13"],
    extras_require={
        "train": ["torch==2.13.0", "megatron-core==0.16.1", "numpy"],
        "test": ["pytest>=8"],
    },
    entry_points={"console_scripts": ["h3t-plan = h3t_ext.planner.cli:main"]},
)
