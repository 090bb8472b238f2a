"""rubato_fuzzer: a libFuzzer harness with its bounded test and its long run (see fuzz/BUILD)."""

def rubato_fuzzer(name, srcs, deps, test_runs, long_runs = 1000000):
    """Defines <name>, <name>_test and <name>_long, all tagged manual.

    <name> links libFuzzer's main under --config=fuzz, and fuzz/replay_main.cc (which only replays
    files) otherwise. <name>_test runs it for `test_runs` executions over a fresh copy of
    fuzz/corpus/<name>/ with the dictionary <name>.dict; <name>_long (bazel run) for `long_runs`,
    printing libFuzzer's statistics.

    Args:
      name: the harness, also the name of its corpus folder.
      srcs: its sources (one defines LLVMFuzzerTestOneInput).
      deps: its dependencies.
      test_runs: executions of the bounded test.
      long_runs: executions of the long run (override with -- -runs=N or -max_total_time=S).
    """
    native.cc_binary(
        name = name,
        srcs = srcs + select({
            "//fuzz:libfuzzer": [],
            "//conditions:default": ["replay_main.cc"],
        }),
        linkopts = select({
            "//fuzz:libfuzzer": ["-fsanitize=fuzzer"],
            "//conditions:default": [],
        }),
        deps = deps,
        tags = ["manual"],
    )
    native.filegroup(
        name = name + "_corpus",
        srcs = native.glob(["corpus/%s/*" % name]),
    )
    dictionary = "-dict=$(rootpath %s.dict)" % name
    runner_args = ["$(rootpath :%s)" % name, "fuzz/corpus/" + name]
    runner_data = [":" + name, ":%s_corpus" % name, name + ".dict"]
    native.sh_test(
        name = name + "_test",
        size = "medium",
        srcs = ["run_fuzzer_test.sh"],
        args = runner_args + [str(test_runs), dictionary],
        data = runner_data,
        tags = ["manual"],
    )
    native.sh_binary(
        name = name + "_long",
        srcs = ["run_fuzzer_long.sh"],
        args = runner_args + [str(long_runs), dictionary],
        data = runner_data,
        tags = ["manual"],
    )
