// main() for a fuzz harness built without libFuzzer (any config but --config=fuzz): runs
// LLVMFuzzerTestOneInput once on each file named on the command line, or on each file in a named
// directory, so that a crashing input can be replayed under gcc, asan or tsan builds too. Flags
// (arguments starting with '-') are ignored. It does no fuzzing, and says so.
#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

bool IsDirectory(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::vector<std::string> Inputs(const std::string& path) {
  if (!IsDirectory(path)) return {path};
  std::vector<std::string> files;
  if (DIR* dir = opendir(path.c_str())) {
    while (const dirent* entry = readdir(dir)) {
      const std::string name = entry->d_name;
      if (name != "." && name != ".." && !IsDirectory(path + "/" + name)) {
        files.push_back(path + "/" + name);
      }
    }
    closedir(dir);
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

int main(int argc, char** argv) {
  std::fprintf(stderr,
               "%s: built without libFuzzer (use --config=fuzz to fuzz); replaying inputs only\n",
               argv[0]);
  int replayed = 0;
  for (int i = 1; i < argc; ++i) {
    if (argv[i][0] == '-') continue;
    for (const std::string& file : Inputs(argv[i])) {
      std::ifstream in(file, std::ios::binary);
      if (!in) {
        std::fprintf(stderr, "cannot read %s\n", file.c_str());
        return 1;
      }
      const std::string bytes((std::istreambuf_iterator<char>(in)),
                              std::istreambuf_iterator<char>());
      LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
      ++replayed;
    }
  }
  std::fprintf(stderr, "replayed %d input(s) without a crash\n", replayed);
  return 0;
}
