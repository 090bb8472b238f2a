"""Repository rule that detects the CUDA toolkit at $CUDA_PATH (default /usr/local/cuda).

It writes defs.bzl with CUDA_FOUND and CUDA_PATH. When nvcc exists, the repository exposes
:cuda_headers, :cudart and :cublas over the toolkit; otherwise the same names are empty libraries,
so that labels stay valid and CUDA targets are skipped as incompatible.
"""

_FOUND_BUILD = """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "cuda_headers",
    hdrs = glob(["include/*.h", "include/*.hpp", "include/crt/**", "include/nv/**", "include/cuda/**"]),
    includes = ["include"],
)

# The CUDA runtime linked statically: it loads the driver (libcuda.so.1) itself when first used,
# so a binary that links it starts on a host without CUDA and learns there that no device is
# usable, instead of failing to start for want of libcudart.so.
cc_library(
    name = "cudart",
    linkopts = ["-L{p}/lib64", "-l:libcudart_static.a", "-ldl", "-lrt", "-lpthread"],
    deps = [":cuda_headers"],
)

cc_library(
    name = "cublas",
    linkopts = ["-L{p}/lib64", "-lcublas"],
    deps = [":cudart"],
)
"""

_MISSING_BUILD = """
package(default_visibility = ["//visibility:public"])

cc_library(name = "cuda_headers")

cc_library(name = "cudart")

cc_library(name = "cublas")
"""

def _cuda_configure_impl(rctx):
    cuda_path = rctx.os.environ.get("CUDA_PATH", "/usr/local/cuda")
    found = rctx.path(cuda_path + "/bin/nvcc").exists
    if found:
        rctx.symlink(cuda_path + "/include", "include")
        rctx.file("BUILD", _FOUND_BUILD.replace("{p}", cuda_path))
    else:
        rctx.file("BUILD", _MISSING_BUILD)
    rctx.file("defs.bzl", "CUDA_FOUND = %s\nCUDA_PATH = %r\n" % (found, cuda_path))

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["CUDA_PATH"],
    local = True,
    configure = True,
)
