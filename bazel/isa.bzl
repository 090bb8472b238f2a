"""A binary built a second time for AVX2 and FMA (x86-64-v3), beside the baseline one.

The whole build targets baseline x86-64 (SSE2), so that its binaries run on any x86-64 machine.
`isa_binaries(name, binary)` builds `binary` and every library under it again with
`-mavx2 -mfma` (a transition on --copt: Eigen's GEMMs then use 256-bit FMA kernels, and the
compiler vectorizes loops for them), and puts the two side by side as `name` and `name`_avx2. The baseline binary picks it
at run time when the processor has both (common/isa_dispatch.h). Two whole binaries, not two
versions of some functions in one: Eigen is header-only, and two copies of its inline templates
compiled for different processors in one program would be merged by the linker, one copy
serving both.
"""

def _avx2_transition_impl(settings, _attr):
    return {
        "//command_line_option:copt": settings["//command_line_option:copt"] + [
            "-mavx2",
            "-mfma",
        ],
        # Static: a test linked against its libraries' shared objects would load, once copied out
        # of its configuration's directory, the baseline ones beside it.
        "//command_line_option:dynamic_mode": "off",
    }

_avx2_transition = transition(
    implementation = _avx2_transition_impl,
    inputs = ["//command_line_option:copt"],
    outputs = ["//command_line_option:copt", "//command_line_option:dynamic_mode"],
)

def _copy(ctx, src, out):
    ctx.actions.run_shell(
        inputs = [src],
        outputs = [out],
        command = "cp -f \"$1\" \"$2\" && chmod 0555 \"$2\"",
        arguments = [src.path, out.path],
        mnemonic = "CopyIsaBinary",
        progress_message = "Copying %s" % out.short_path,
    )

def _isa_binaries_impl(ctx):
    baseline = ctx.attr.binary[DefaultInfo].files_to_run.executable
    avx2 = ctx.attr.avx2_binary[0][DefaultInfo].files_to_run.executable
    out = ctx.actions.declare_file(ctx.label.name)
    out_avx2 = ctx.actions.declare_file(ctx.label.name + "_avx2")
    _copy(ctx, baseline, out)
    _copy(ctx, avx2, out_avx2)
    return [DefaultInfo(
        executable = out,
        files = depset([out]),
        runfiles = ctx.runfiles(files = [out_avx2]),
    )]

_isa_binaries = rule(
    implementation = _isa_binaries_impl,
    executable = True,
    attrs = {
        "binary": attr.label(executable = True, mandatory = True, cfg = "target"),
        "avx2_binary": attr.label(cfg = _avx2_transition, executable = True, mandatory = True),
        "_allowlist_function_transition": attr.label(
            default = "@bazel_tools//tools/allowlists/function_transition_allowlist",
        ),
    },
)

def isa_binaries(name, binary, **kwargs):
    """`name`: a copy of `binary` (baseline x86-64), with `name`_avx2 beside it (the same binary
    built with -mavx2 -mfma) in its runfiles and its output directory, so that the two are always
    built together from the same sources."""
    _isa_binaries(name = name, binary = binary, avx2_binary = binary, **kwargs)

def _avx2_test_impl(ctx):
    binary = ctx.attr.test[0][DefaultInfo].files_to_run.executable
    copy = ctx.actions.declare_file(ctx.label.name + ".bin")
    _copy(ctx, binary, copy)
    script = ctx.actions.declare_file(ctx.label.name + ".sh")
    ctx.actions.write(
        output = script,
        is_executable = True,
        content = """#!/bin/sh
# {label} built for AVX2 and FMA (bazel/isa.bzl): run where the processor has both.
if grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo; then
  exec "$(dirname "$0")/{binary}" "$@"
fi
echo "SKIPPED: this processor lacks AVX2 or FMA, so the AVX2 build of {label} cannot run here"
""".format(binary = copy.basename, label = ctx.attr.test[0].label),
    )
    return [DefaultInfo(executable = script, runfiles = ctx.runfiles(files = [copy]))]

avx2_test = rule(
    implementation = _avx2_test_impl,
    test = True,
    doc = "`test` (a cc_test) built for AVX2 and FMA, run where the processor has both.",
    attrs = {
        "test": attr.label(cfg = _avx2_transition, executable = True, mandatory = True),
        "_allowlist_function_transition": attr.label(
            default = "@bazel_tools//tools/allowlists/function_transition_allowlist",
        ),
    },
)
