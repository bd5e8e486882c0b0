"""Build zero_lifetime with its prebuilt C++ extension ``zero_lifetime._C``.

    pip install --no-build-isolation .        # or: pip install --no-build-isolation -e .

--no-build-isolation builds against the torch already installed (the extension is tied
to that torch's ABI). ZERO_LIFETIME_BUILD_EXT=0 skips the extension; it is then
JIT-compiled on first use (see zero_lifetime/_native.py, the single source of truth for
sources and flags).
"""

import importlib.util
import os
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def _load_native():
    # Load _native.py by path: importing the package would run its __init__ (and its
    # dependencies) inside the build.
    spec = importlib.util.spec_from_file_location(
        "_zero_lifetime_native_for_setup", ROOT / "zero_lifetime" / "_native.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


native = _load_native()

ext_modules = []
cmdclass = {}
if os.environ.get("ZERO_LIFETIME_BUILD_EXT", "1") != "0":
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    # With a CUDA torch and toolkit the .cu kernels join the same module (CUDAExtension
    # adds nvcc and cudart); otherwise the module has CPU and Meta kernels only.
    if native.cuda_arch_missing():
        # A module built here is meant for GPUs: leaving their kernels out would be silent.
        raise SystemExit(f"zero_lifetime: {native.CUDA_ARCH_UNKNOWN}. Set TORCH_CUDA_ARCH_LIST to the "
                         "GPUs the build is for (e.g. TORCH_CUDA_ARCH_LIST=9.0), or "
                         "ZERO_LIFETIME_BUILD_CUDA=0 to build the CPU kernels only.")
    with_cuda = native.cuda_build_enabled()
    sources = native.SOURCES + (native.CUDA_SOURCES if with_cuda else [])
    compile_args = {"cxx": native.extra_cflags + [native.build_hash_define()]}
    if with_cuda:
        compile_args["nvcc"] = native.extra_cuda_cflags + [native.build_hash_define()]
    ext_modules.append(
        (CUDAExtension if with_cuda else CppExtension)(
            name="zero_lifetime._C",
            sources=[f"csrc/{source}" for source in sources],
            include_dirs=native.include_dirs(),
            extra_compile_args=compile_args,
            extra_link_args=native.extra_ldflags,
        ))
    cmdclass["build_ext"] = BuildExtension

# The top-level csrc/ ships inside the package as zero_lifetime/csrc, so an installed
# package can still JIT-build (and hash-check the prebuilt module against) its sources.
csrc_patterns = [f"{prefix}*{suffix}" for prefix in ("", "**/") for suffix in native.SOURCE_SUFFIXES]

setup(
    name="zero_lifetime",
    version="0.1.0",
    description="Lifetime tracking of DeepSpeed ZeRO-3 parameters saved for backward",
    python_requires=">=3.9",
    packages=["zero_lifetime"] + find_packages(include=["zero_lifetime.*"]) + ["zero_lifetime.csrc"],
    package_dir={"zero_lifetime.csrc": "csrc"},
    package_data={"zero_lifetime.csrc": csrc_patterns},
    install_requires=["torch"],
    extras_require={"deepspeed": ["deepspeed"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
