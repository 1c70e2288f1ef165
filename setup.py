"""Builds zen_ext._C: the CPU kernels always, the CUDA kernels only when torch has CUDA and nvcc exists.

Build against the installed torch with ``pip install --no-build-isolation -e .`` (build isolation
would download the newest torch, with GBs of CUDA packages, into the build environment).
"""

import glob
import os

from setuptools import setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError:  # metadata-only builds (no torch yet): the package falls back to its reference ops
    torch = None

ext_modules, cmdclass = [], {}
if torch is not None and os.environ.get("ZEN_NO_CPP_OP", "0") != "1":
    sources = ["csrc/zen_ext.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    # No -std flag: torch's extension builder picks the standard its headers need (C++20 for 2.13).
    # -g0 overrides the -g of Python's own CFLAGS: debug info for the torch headers' templates was
    # a fifth of the compile time and 95 % of the library's size. The sources include only the ATen
    # headers they use (not <torch/torch.h>, which pulls the whole C++ frontend and pybind11): about 5x
    # less compile time per file. ninja compiles the files in parallel (MAX_JOBS, default: every core).
    cflags = {"cxx": ["-O3", "-g0"]}
    use_cuda = torch.version.cuda is not None and CUDA_HOME is not None and os.environ.get("USE_CUDA", "1") != "0"
    if torch.version.cuda is not None and CUDA_HOME is None:
        # CUDA torch wheels ship no nvcc: say so at build time (zen_ext.ops warns again at run time).
        print(f"zen_ext: WARNING: torch {torch.__version__} has CUDA but no CUDA toolkit (nvcc) was found; "
              "building the CPU kernels only, so CUDA gradients will use the pure-torch reference. Install the "
              f"CUDA {torch.version.cuda} toolkit, set CUDA_HOME and rebuild to get the CUDA kernel.")
    if use_cuda:
        sources += sorted(glob.glob("csrc/cuda/*.cu"))
        cflags["nvcc"] = ["-O3"]
        ext_modules.append(CUDAExtension("zen_ext._C", sources, extra_compile_args=cflags))
    else:
        ext_modules.append(CppExtension("zen_ext._C", sources, extra_compile_args=cflags))
    cmdclass = {"build_ext": BuildExtension.with_options(use_ninja=True)}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
