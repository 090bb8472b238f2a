"""cuda_library and if_cuda: nvcc through a genrule, with a clean CPU-only fallback.

CUDA 13 supports sm_75 and newer; sm_90 SASS covers Hopper (H100/H200) and the PTX lets newer
chips JIT-compile.
"""

load("@local_cuda//:defs.bzl", "CUDA_FOUND", "CUDA_PATH")

CUDA_ARCH_FLAGS = [
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
]

def if_cuda(if_true, if_false = []):
    """Selects if_true when the toolkit was found and --config=nocuda is not set."""
    if not CUDA_FOUND:
        return if_false
    return select({
        "//bazel:cuda_off": if_false,
        "//conditions:default": if_true,
    })

def cuda_library(name, srcs, hdrs = [], deps = [], nvcc_flags = [], **kwargs):
    """A cc_library whose .cu sources are compiled by nvcc into a static archive."""
    lib = "lib%s_nvcc.a" % name
    incompatible = if_cuda([], ["//bazel:incompatible"])
    native.genrule(
        name = name + "_nvcc",
        srcs = srcs + hdrs,
        outs = [lib],
        target_compatible_with = incompatible,
        cmd = " ".join([
            CUDA_PATH + "/bin/nvcc",
            "-lib",
            "-O2",
            "-std=c++17",
            "-Xcompiler=-fPIC",
            "-I.",
            "-I$(GENDIR)",
        ] + CUDA_ARCH_FLAGS + nvcc_flags + ["$(location %s)" % s for s in srcs] + ["-o $@"]),
    )
    native.cc_library(
        name = name,
        srcs = [":" + lib],
        hdrs = hdrs,
        target_compatible_with = incompatible,
        # Only the runtime: code that calls cuBLAS adds "@local_cuda//:cublas" to deps, so that
        # binaries that do not use it do not load its 100+ MB at start-up.
        deps = deps + ["@local_cuda//:cudart"],
        **kwargs
    )
