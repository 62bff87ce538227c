// The strings shmgrad parses from its command line, its environment and the
// torch.distributed store: the engine name (ipc::checkEngineName), --loss and the loss
// reduction (ipc::parseLoss, parseLossReduction), --numerics (ipc::parseNumerics, and
// numericsText back), --dataset (engine::parseDatasetSpec) and the group name a backend
// rank reads from the store (backend::detail::parseGroupName). Input: u8 which parser,
// then the string.
#include <string>

#include "backend/shm_comm.h"
#include "engine/dataset.h"
#include "ipc/segment.h"
#include "tests/fuzz/fuzz_util.h"

using namespace shmgrad;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 6) {
    case 0:
      if (fuzz::accepts([&] { ipc::checkEngineName(text); })) {
        // The name ends a file name in /dev/shm ("shmgrad-<uid>-<name>"): no separator, so
        // the file is in /dev/shm whatever the name.
        FUZZ_EXPECT(text.find('/') == std::string::npos && text.find('\0') == std::string::npos);
        FUZZ_EXPECT(ipc::segmentPath(text).rfind("/dev/shm/shmgrad-", 0) == 0);
      }
      break;
    case 1: {
      ipc::LossKind k{};
      if (fuzz::accepts([&] { k = ipc::parseLoss(text); })) {
        FUZZ_EXPECT(ipc::lossKindValid(static_cast<uint32_t>(k)));
      }
      break;
    }
    case 2: {
      ipc::LossReduction r{};
      if (fuzz::accepts([&] { r = ipc::parseLossReduction(text); })) {
        FUZZ_EXPECT(ipc::lossReductionName(static_cast<uint32_t>(r)) == text);
      }
      break;
    }
    case 3: {
      ipc::Numerics n;
      if (fuzz::accepts([&] { n = ipc::parseNumerics(text); })) {
        FUZZ_EXPECT(ipc::numericsValid(n));
        // What the coordinator stores reads back the same through its text.
        const ipc::Numerics again = ipc::parseNumerics(ipc::numericsText(n));
        FUZZ_EXPECT(again.flags == n.flags && again.matmul_precision == n.matmul_precision);
      }
      break;
    }
    case 4: {
      engine::DatasetSpec s;
      if (fuzz::accepts([&] { s = engine::parseDatasetSpec(text); })) {
        FUZZ_EXPECT(s.npy ? "npy:" + s.inputs_path + "," + s.targets_path == text
                          : s.split == "train" || s.split == "test");
      }
      break;
    }
    case 5: {
      unsigned pid = 0, fd = 0;
      if (backend::detail::parseGroupName(text, &pid, &fd)) {
        // Only the name create() makes is opened: "/proc/<pid>/fd/<fd>", nothing else.
        FUZZ_EXPECT(text == "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd));
      }
      break;
    }
  }
  return 0;
}
