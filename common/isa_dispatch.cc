#include "common/isa_dispatch.h"

#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>

namespace rubato {
namespace {

std::string& Note() {
  static std::string* note = new std::string;
  return *note;
}

}  // namespace

const char* CompiledIsa() {
#if defined(__AVX2__) && defined(__FMA__)
  return "avx2+fma";
#else
  return "x86-64";
#endif
}

bool CpuHasAvx2Fma() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

std::string Avx2Sibling(const std::string& argv0, const std::string& self_exe) {
  if (argv0.empty() || (argv0.find('/') == std::string::npos && self_exe.empty())) return "";
  const std::filesystem::path invoked(argv0);
  const std::filesystem::path dir = argv0.find('/') != std::string::npos
                                        ? invoked.parent_path()
                                        : std::filesystem::path(self_exe).parent_path();
  return (dir / (invoked.filename().string() + "_avx2")).string();
}

std::string IsaNote() { return Note(); }

void ExecIsaVariant(char** argv) {
#if defined(__AVX2__) && defined(__FMA__)
  // Named as the program it was run as (ps, top, pgrep -x: "rubato_worker"), not as this file.
  if (argv[0] != nullptr) {
    const std::string name = std::filesystem::path(argv[0]).filename().string();
    ::prctl(PR_SET_NAME, name.substr(0, 15).c_str(), 0, 0, 0);
  }
  Note() = "AVX2+FMA build";
#else
  const char* choice = std::getenv("RUBATO_CPU_ISA");
  if (choice != nullptr && *choice != '\0' && std::strcmp(choice, "auto") != 0) {
    Note() = std::strcmp(choice, "baseline") == 0
                 ? "baseline x86-64 build: RUBATO_CPU_ISA=baseline"
                 : std::string("baseline x86-64 build: RUBATO_CPU_ISA=") + choice +
                       " is neither auto nor baseline";
    return;
  }
  if (!CpuHasAvx2Fma()) {
    Note() = "baseline x86-64 build: the processor lacks AVX2 or FMA";
    return;
  }
  std::error_code error;
  const std::string self = std::filesystem::read_symlink("/proc/self/exe", error).string();
  const std::string variant = Avx2Sibling(argv[0] != nullptr ? argv[0] : "", self);
  if (variant.empty()) {
    Note() = "baseline x86-64 build: cannot tell where it was run from (/proc/self/exe)";
    return;
  }
  if (::access(variant.c_str(), X_OK) != 0) {
    Note() = "baseline x86-64 build: no AVX2 build at " + variant;
    return;
  }
  ::execv(variant.c_str(), argv);
  Note() = "baseline x86-64 build: cannot run " + variant + ": " + std::strerror(errno);
#endif
}

}  // namespace rubato
