// Replays kept inputs through a fuzz target without libFuzzer: the regression tests of
// //tests:fuzz_regression_<target>_test (tests/BUILD), built with the ordinary compiler
// and its sanitizers. A target aborts on a bug (fuzz_util.h), so a regression that comes
// back fails the test; the test also fails when it finds no input to replay.
//
//   replay DIR...   runs every file in each DIR through LLVMFuzzerTestOneInput
#include <dirent.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  int replayed = 0;
  for (int i = 1; i < argc; ++i) {
    DIR* dir = opendir(argv[i]);
    if (dir == nullptr) {
      std::fprintf(stderr, "replay: cannot open %s\n", argv[i]);
      return 1;
    }
    while (const dirent* e = readdir(dir)) {
      if (e->d_name[0] == '.') continue;
      const std::string path = std::string(argv[i]) + "/" + e->d_name;
      std::ifstream f(path, std::ios::binary);
      const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)),
                                       std::istreambuf_iterator<char>());
      std::fprintf(stderr, "replay: %s (%zu bytes)\n", path.c_str(), bytes.size());
      LLVMFuzzerTestOneInput(bytes.data(), bytes.size());
      ++replayed;
    }
    closedir(dir);
  }
  std::fprintf(stderr, "replay: %d input(s), none crashed\n", replayed);
  return replayed > 0 ? 0 : 1;
}
