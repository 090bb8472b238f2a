// Which build of a binary runs on this processor. The build targets baseline x86-64 (SSE2);
// bazel/isa.bzl builds the worker a second time for AVX2 and FMA, as NAME_avx2 beside NAME.
// ExecIsaVariant, first thing in main(), replaces the baseline process by that build where it
// can run:
//   - this is the baseline build (the AVX2 build returns at once),
//   - the processor has AVX2 and FMA (__builtin_cpu_supports),
//   - RUBATO_CPU_ISA is unset or "auto" ("baseline" keeps the baseline build),
//   - NAME_avx2 is an executable file in argv[0]'s directory (or, for a name found on PATH,
//     /proc/self/exe's): then execv with the same arguments and environment.
// Otherwise the process goes on as it is; IsaNote says which build runs and why, for the log.
// The AVX2 build names its process (comm) after argv[0], so that ps and pgrep see the program
// that was run.
#ifndef RUBATO_COMMON_ISA_DISPATCH_H_
#define RUBATO_COMMON_ISA_DISPATCH_H_

#include <string>

namespace rubato {

// Returns only when this process goes on (see above). An exec that fails is noted, not fatal.
void ExecIsaVariant(char** argv);

// "avx2+fma" in the AVX2 build, else "x86-64".
const char* CompiledIsa();

// Whether this processor has AVX2 and FMA.
bool CpuHasAvx2Fma();

// Which build runs, and why: "AVX2+FMA build", "baseline build: RUBATO_CPU_ISA=baseline", ...
std::string IsaNote();

// The path of the AVX2 build that `argv0` would exec: argv0's directory (or /proc/self/exe's,
// for a bare name) joined with argv0's base name and "_avx2"; "" when neither says where (never
// a path relative to the working directory for a bare name). Exposed for tests.
std::string Avx2Sibling(const std::string& argv0, const std::string& self_exe);

}  // namespace rubato

#endif  // RUBATO_COMMON_ISA_DISPATCH_H_
