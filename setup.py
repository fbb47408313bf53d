"""Build and install megatron_lsgd.

The C++ extension `megatron_lsgd._C` (pybind11) is compiled from every file in csrc/.
torch is declared as `torch>=2.4` so an existing (GPU) install is kept; on a CPU-only
machine install `torch==2.13.0` first (see README) to avoid pulling a CUDA build.
"""

import glob
import os

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

here = os.path.dirname(os.path.abspath(__file__))
sources = sorted(os.path.relpath(p, here) for p in glob.glob(os.path.join(here, "csrc", "*.cpp")))

ext_modules = [
    Pybind11Extension(
        "megatron_lsgd._C",
        sources,
        include_dirs=[os.path.join(here, "csrc")],
        cxx_std=17,
        extra_compile_args=["-O3", "-pthread"],
        extra_link_args=["-pthread"],
    )
]

setup(
    name="megatron_lsgd",
    version="0.1.0",
    description="Megatron-style 3D-parallel LLM pre-training across sites joined by slow links",
    packages=find_packages(include=["megatron_lsgd", "megatron_lsgd.*"]),
    py_modules=["pretrain_gpt"],
    ext_modules=ext_modules,
    cmdclass={"build_ext": build_ext},
    python_requires=">=3.9",
    install_requires=[
        "torch>=2.4",
        "numpy",
        "tensorboard",
        "sentencepiece",
        "safetensors",
    ],
    extras_require={
        "test": ["pytest>=7", "matplotlib", "tokenizers", "transformers"],
        "hf": ["transformers", "tokenizers"],
        "gpu": ["apex", "transformer-engine"],
        # --lsgd-fault-tolerance torchft: elastic sites (docs/fault_tolerance.md)
        "ft": ["torchft==0.2.0"],
    },
)
