// The torch.distributed backend's core (backend/shm_comm.h): the element reductions
// against a double-precision reference, collectives with ranks as threads (as gloo's
// tests run them), a mismatch refused on every rank, and ranks that leave or die.
#include "backend/shm_comm.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <functional>
#include <thread>
#include <vector>

#include "ipc/futex.h"

namespace shmgrad::backend {
namespace {

uint64_t deadlineIn(double seconds) {
  return ipc::monotonicNs() + static_cast<uint64_t>(seconds * 1e9);
}

// Runs body(comm) on `world` threads, each attached as its own rank.
void runRanks(uint32_t world, uint64_t staging, const std::function<void(ShmComm&)>& body,
              uint64_t arena = 0) {
  auto first = ShmComm::create(world, staging, arena);
  std::vector<std::unique_ptr<ShmComm>> comms;
  comms.push_back(std::move(first));
  for (uint32_t r = 1; r < world; ++r) comms.push_back(ShmComm::attach(comms[0]->name(), world, r));
  comms[0]->release();
  for (auto& c : comms) c->watchPeers();
  std::vector<std::thread> threads;
  std::vector<std::string> failures(world);
  for (uint32_t r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(*comms[r]);
      } catch (const std::exception& e) {
        failures[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (uint32_t r = 0; r < world; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

TEST(Elements, HalfAndBfloat16RoundTripEveryFiniteValue) {
  // A value that is already float16 (bfloat16) comes back with the same bits.
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const uint16_t h = static_cast<uint16_t>(bits);
    if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0) continue;  // NaN payloads
    uint16_t a[1] = {h}, b[1] = {0}, out[1];
    const void* in[2] = {a, b};
    reduceElements(out, in, 2, 1, ElemType::kFloat16, ReduceKind::kSum);
    if (h == 0x8000) {
      EXPECT_EQ(out[0], 0x0000);  // -0 + +0 = +0
      continue;
    }
    EXPECT_EQ(out[0], h) << std::hex << bits;
    reduceElements(out, in, 2, 1, ElemType::kBFloat16, ReduceKind::kSum);
    if ((h & 0x7f80) == 0x7f80 && (h & 0x7f) != 0) continue;
    EXPECT_EQ(out[0], h) << std::hex << bits;
  }
}

TEST(Elements, SumsRoundOnceFromTheExactValue) {
  // float16 sums of three values: the float32 accumulation is exact here, so the result
  // is the exact sum rounded once to nearest-even (checked through double).
  const uint16_t xs[] = {0x3c00, 0x0001, 0x7bff, 0x3555, 0xbc00, 0x1234, 0x03ff};
  for (uint16_t a : xs) {
    for (uint16_t b : xs) {
      uint16_t out[1];
      const uint16_t ia[1] = {a}, ib[1] = {b}, ic[1] = {0x0001};
      const void* in[3] = {ia, ib, ic};
      reduceElements(out, in, 3, 1, ElemType::kFloat16, ReduceKind::kSum);
      auto value = [](uint16_t h) {  // decoded from the bits
        const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
        const double v = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
        return (h & 0x8000) ? -v : v;
      };
      const double exact = value(a) + value(b) + value(0x0001);
      // The result is a float16 whose neighbours are no nearer to the exact sum.
      const double got = value(out[0]);
      const uint16_t up = static_cast<uint16_t>(out[0] + 1),
                     down = static_cast<uint16_t>(out[0] - 1);
      if (std::isfinite(got) && (out[0] & 0x7c00) != 0x7c00) {
        EXPECT_LE(std::fabs(got - exact), std::fabs(value(up) - exact) + 1e-30);
        EXPECT_LE(std::fabs(got - exact), std::fabs(value(down) - exact) + 1e-30);
      }
    }
  }
}

TEST(Elements, IntegersWrapAndBoolsAreLogical) {
  const int8_t a[2] = {100, -128}, b[2] = {100, -1};
  int8_t out[2];
  const void* in[2] = {a, b};
  reduceElements(out, in, 2, 2, ElemType::kInt8, ReduceKind::kSum);
  EXPECT_EQ(out[0], static_cast<int8_t>(200 - 256));
  EXPECT_EQ(out[1], 127);
  const uint8_t t[3] = {1, 0, 1}, f[3] = {0, 0, 1};
  uint8_t o[3];
  const void* bin[2] = {t, f};
  reduceElements(o, bin, 2, 3, ElemType::kBool, ReduceKind::kSum);
  EXPECT_EQ(o[0] + 2 * o[1] + 4 * o[2], 1 + 4);  // any
  reduceElements(o, bin, 2, 3, ElemType::kBool, ReduceKind::kProduct);
  EXPECT_EQ(o[0] + 2 * o[1] + 4 * o[2], 4);  // all
  EXPECT_THROW(checkReduce(ElemType::kBool, ReduceKind::kAvg), Error);
  const int32_t p[2] = {7, -7}, q[2] = {0, 0};
  int32_t avg[2];
  const void* pin[2] = {p, q};
  reduceElements(avg, pin, 2, 2, ElemType::kInt32, ReduceKind::kAvg);
  EXPECT_EQ(avg[0], 3);  // truncated toward zero
  EXPECT_EQ(avg[1], -3);
  EXPECT_THROW(checkReduce(ElemType::kFloat32, ReduceKind::kBxor), Error);
}

class Collectives : public ::testing::TestWithParam<uint32_t> {};

TEST_P(Collectives, AllreduceOfManyRoundsIsTheSumInRankOrder) {
  const uint32_t world = GetParam();
  const uint64_t n = 200'003;  // several rounds of a 256 KiB staging buffer
  runRanks(world, 256 << 10, [&](ShmComm& c) {
    std::vector<float> a(n), b(7);
    for (uint64_t i = 0; i < n; ++i) a[i] = static_cast<float>((i % 97) * (c.rank() + 1)) * 0.1f;
    for (int i = 0; i < 7; ++i) b[i] = static_cast<float>(c.rank());
    std::vector<Span> spans{{reinterpret_cast<uint8_t*>(a.data()), n * 4},
                            {reinterpret_cast<uint8_t*>(b.data()), 28}};
    c.allreduce(spans, ElemType::kFloat32, ReduceKind::kSum, deadlineIn(30));
    for (uint64_t i = 0; i < n; i += 1009) {
      float want = 0;
      for (uint32_t r = 0; r < world; ++r) want += static_cast<float>((i % 97) * (r + 1)) * 0.1f;
      ASSERT_EQ(a[i], want) << i;
    }
    EXPECT_EQ(b[6], static_cast<float>(world * (world - 1) / 2));
  });
}

TEST_P(Collectives, GathersScattersAndAllToAll) {
  const uint32_t world = GetParam();
  runRanks(world, 256 << 10, [&](ShmComm& c) {
    const uint32_t me = c.rank();
    const uint64_t n = 100'000;  // bytes: several rounds of the scatter's regions
    std::vector<uint8_t> mine(n, static_cast<uint8_t>(me + 1));
    std::vector<std::vector<uint8_t>> all(world, std::vector<uint8_t>(n));
    std::vector<Span> outs;
    for (auto& v : all) outs.push_back({v.data(), n});
    c.allgather({mine.data(), n}, outs, deadlineIn(30));
    for (uint32_t r = 0; r < world; ++r) ASSERT_EQ(all[r][n - 1], r + 1);
    std::vector<uint8_t> got(n);
    c.scatter(outs, {got.data(), n}, world - 1, deadlineIn(30));
    EXPECT_EQ(got[0], me + 1);
    EXPECT_EQ(got[n - 1], me + 1);
    // All-to-all: rank i sends i + j + 1 bytes of value 10 i + j to rank j.
    std::vector<std::vector<uint8_t>> send(world), recv(world);
    std::vector<Span> s, r;
    for (uint32_t j = 0; j < world; ++j) {
      send[j].assign(me + j + 1, static_cast<uint8_t>(10 * me + j));
      recv[j].assign(j + me + 1, 0);
      s.push_back({send[j].data(), send[j].size()});
      r.push_back({recv[j].data(), recv[j].size()});
    }
    c.alltoall(s, r, deadlineIn(30));
    for (uint32_t j = 0; j < world; ++j) EXPECT_EQ(recv[j].back(), 10 * j + me);
  });
}

TEST_P(Collectives, MismatchIsRefusedOnEveryRankAndTheGroupGoesOn) {
  const uint32_t world = GetParam();
  if (world == 1) GTEST_SKIP() << "one rank cannot disagree with itself";
  runRanks(world, 256 << 10, [&](ShmComm& c) {
    std::vector<float> x(16 + c.rank(), 1.0f);  // a different size on every rank
    std::vector<Span> spans{{reinterpret_cast<uint8_t*>(x.data()), x.size() * 4}};
    try {
      c.allreduce(spans, ElemType::kFloat32, ReduceKind::kSum, deadlineIn(30));
      ADD_FAILURE() << "rank " << c.rank() << ": a mismatch was not refused";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("must call the same collectives"), std::string::npos);
    }
    std::vector<float> y(8, 1.0f);
    c.allreduce({{reinterpret_cast<uint8_t*>(y.data()), 32}}, ElemType::kFloat32, ReduceKind::kSum,
                deadlineIn(30));
    EXPECT_EQ(y[7], static_cast<float>(world));
  });
}

// Values that are not powers of two, different on every rank.
float valueOf(uint64_t i, uint32_t rank) {
  return static_cast<float>(i % 89 + 1) * 0.37f * (static_cast<float>(rank) + 1.3f);
}

TEST_P(Collectives, AllreduceInTheArenasRunsInPlaceBitForBitAsStaged) {
  const uint32_t world = GetParam();
  const uint64_t n = 100'003;  // not whole cache lines; more than a staging buffer
  runRanks(
      world, 256 << 10,
      [&](ShmComm& c) {
        ASSERT_NE(c.arena(), nullptr);
        uint8_t* block = c.arena()->allocate(n * 4);
        ASSERT_NE(block, nullptr);
        auto* placed = reinterpret_cast<float*>(block);
        std::vector<float> staged(n);
        for (uint64_t i = 0; i < n; ++i) placed[i] = staged[i] = valueOf(i, c.rank());
        const uint64_t before = c.inPlaceAllreduces();
        c.allreduce({{block, n * 4}}, ElemType::kFloat32, ReduceKind::kSum, deadlineIn(30));
        EXPECT_EQ(c.inPlaceAllreduces(), before + 1);  // the in-place path ran
        c.allreduce({{reinterpret_cast<uint8_t*>(staged.data()), n * 4}}, ElemType::kFloat32,
                    ReduceKind::kSum, deadlineIn(30));
        EXPECT_EQ(c.inPlaceAllreduces(), before + 1);  // ordinary memory: staged
        for (uint64_t i = 0; i < n; ++i)
          ASSERT_EQ(std::bit_cast<uint32_t>(placed[i]), std::bit_cast<uint32_t>(staged[i])) << i;
        float want = 0;
        for (uint32_t r = 0; r < world; ++r) want += valueOf(n - 1, r);
        EXPECT_EQ(placed[n - 1], want);
        // AVG of doubles, in place, against the sum divided once.
        auto* d = reinterpret_cast<double*>(block);
        for (uint64_t i = 0; i < 1000; ++i) d[i] = static_cast<double>(valueOf(i, c.rank()));
        c.allreduce({{block, 8000}}, ElemType::kFloat64, ReduceKind::kAvg, deadlineIn(30));
        double sum = 0;
        for (uint32_t r = 0; r < world; ++r) sum += static_cast<double>(valueOf(999, r));
        EXPECT_EQ(d[999], sum / world);
        EXPECT_EQ(c.inPlaceAllreduces(), before + 2);
        c.arena()->release(block);
      },
      64 << 20);
}

TEST_P(Collectives, AllreduceWithSomeRanksOutsideTheirArenaIsStaged) {
  const uint32_t world = GetParam();
  if (world == 1) GTEST_SKIP() << "one rank is all the ranks";
  const uint64_t n = 70'001;
  runRanks(
      world, 256 << 10,
      [&](ShmComm& c) {
        // Rank 0 passes arena memory, the others ordinary memory.
        std::vector<float> own(c.rank() == 0 ? 0 : n);
        uint8_t* block = c.rank() == 0 ? c.arena()->allocate(n * 4) : nullptr;
        auto* x = c.rank() == 0 ? reinterpret_cast<float*>(block) : own.data();
        ASSERT_NE(x, nullptr);
        for (uint64_t i = 0; i < n; ++i) x[i] = valueOf(i, c.rank());
        c.allreduce({{reinterpret_cast<uint8_t*>(x), n * 4}}, ElemType::kFloat32, ReduceKind::kSum,
                    deadlineIn(30));
        EXPECT_EQ(c.inPlaceAllreduces(), 0u);
        for (uint64_t i = 0; i < n; i += 997) {
          float want = 0;
          for (uint32_t r = 0; r < world; ++r) want += valueOf(i, r);
          ASSERT_EQ(x[i], want) << i;
        }
        // The group goes on: the next collective meets as usual.
        c.barrier(deadlineIn(30));
        if (block) c.arena()->release(block);
      },
      64 << 20);
}

INSTANTIATE_TEST_SUITE_P(Ranks, Collectives, ::testing::Values(1u, 2u, 3u));

TEST(Arena, BlocksAreFirstFitWholePagesAndMergeWhenGivenBack) {
  auto comm = ShmComm::create(1, 256 << 10, 1 << 20);
  ArenaPool& pool = *comm->arena();
  EXPECT_EQ(pool.capacity(), 1u << 20);
  uint8_t* a = pool.allocate(300'000);  // 74 pages
  uint8_t* b = pool.allocate(300'000);
  uint8_t* c = pool.allocate(300'000);
  ASSERT_TRUE(a && b && c);
  EXPECT_EQ(b - a, 74 * 4096);
  EXPECT_EQ(pool.inUse(), 3u * 74 * 4096);
  EXPECT_EQ(pool.allocate(300'000), nullptr);  // 34 pages left
  pool.release(b);
  EXPECT_EQ(pool.allocate(200'000), b);  // first fit: b's place
  pool.release(a);
  pool.release(b);
  pool.release(c);
  pool.release(c);  // twice: ignored
  EXPECT_EQ(pool.inUse(), 0u);
  uint8_t* whole = pool.allocate(1 << 20);  // merged back into one free block
  EXPECT_EQ(whole, a);
  uint64_t off = 0;
  EXPECT_TRUE(pool.offsetOf(whole + 8, 16, &off));
  EXPECT_EQ(off, 8u);
  EXPECT_FALSE(pool.offsetOf(whole + (1 << 20) - 8, 16, &off));  // runs past the arena
  pool.release(whole);
  EXPECT_EQ(ShmComm::create(1, 256 << 10, 0)->arena(), nullptr);
}

TEST(Arena, AForkedChildNeitherFreesNorClearsItsParentsBlocks) {
  auto comm = ShmComm::create(1, 256 << 10, 1 << 20);
  ArenaPool& pool = *comm->arena();
  auto* block = reinterpret_cast<float*>(pool.allocate(8192));
  ASSERT_NE(block, nullptr);
  for (int i = 0; i < 2048; ++i) block[i] = static_cast<float>(i) + 0.5f;
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // A DataLoader worker whose copy of the parent's tensors is dropped.
    pool.release(reinterpret_cast<uint8_t*>(block));
    _exit(pool.allocate(4096) == nullptr ? 0 : 1);  // and it allocates nothing there
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  for (int i = 0; i < 2048; i += 97) ASSERT_EQ(block[i], static_cast<float>(i) + 0.5f) << i;
  EXPECT_EQ(pool.inUse(), 8192u);
  pool.release(reinterpret_cast<uint8_t*>(block));
  EXPECT_EQ(pool.inUse(), 0u);
}

TEST(Arena, ABlockOutlivesItsGroup) {
  auto comm = ShmComm::create(1, 256 << 10, 1 << 20);
  std::shared_ptr<ArenaPool> pool = comm->arena();
  auto* block = reinterpret_cast<float*>(pool->allocate(4096));
  block[0] = 1.5f;
  comm.reset();        // the group ends (destroy_process_group) while DDP still holds a bucket
  block[1023] = 2.5f;  // still mapped: a fault here would end the test
  EXPECT_EQ(block[0] + block[1023], 4.0f);
  pool->release(reinterpret_cast<uint8_t*>(block));
}

TEST(Faults, ARankThatLeavesFailsTheOthersAtOnce) {
  runRanks(2, 256 << 10, [&](ShmComm& c) {
    if (c.rank() == 1) {
      c.leave();
      return;
    }
    const uint64_t start = ipc::monotonicNs();
    try {
      c.barrier(deadlineIn(20));
      ADD_FAILURE() << "the barrier passed without rank 1";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kWorkerFailed);
      EXPECT_NE(std::string(e.what()).find("rank 1 left the group"), std::string::npos);
    }
    EXPECT_LT(ipc::monotonicNs() - start, 5'000'000'000ull);
    // Later collectives end with the same error at once.
    EXPECT_THROW(c.barrier(deadlineIn(20)), Error);
  });
}

TEST(Faults, AKilledRankFailsTheOthersNamingIt) {
  auto comm = ShmComm::create(2, 256 << 10);
  const std::string name = comm->name();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto mine = ShmComm::attach(name, 2, 1);
    pause();  // killed here, never arriving
    _exit(0);
  }
  // Wait until the child has attached (it wrote its pid), then let it die.
  for (int i = 0; i < 2000; ++i) {
    comm->watchPeers();
    usleep(1000);
  }
  ASSERT_EQ(kill(child, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);  // the fault happened
  try {
    comm->barrier(deadlineIn(20));
    FAIL() << "the barrier passed without rank 1";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 (pid " + std::to_string(child) + ") died"),
              std::string::npos)
        << e.what();
  }
  EXPECT_NE(comm->brokenReason().find("died"), std::string::npos);
}

TEST(Faults, AttachRefusesWhatIsNotAGroupsMemory) {
  EXPECT_THROW(ShmComm::attach("/dev/shm/anything", 2, 1), Error);
  EXPECT_THROW(ShmComm::attach("/proc/self/fd/0", 2, 1), Error);
  auto comm = ShmComm::create(2, 256 << 10);
  EXPECT_THROW(ShmComm::attach(comm->name(), 3, 1), Error);  // another group size
  comm->release();
  EXPECT_THROW(ShmComm::attach(comm->name(), 2, 1), Error);  // its creator let go
}

TEST(PointToPoint, MessagesArriveInOrderAndSizesAreChecked) {
  runRanks(2, 256 << 10, [&](ShmComm& c) {
    if (c.rank() == 0) {
      for (uint32_t i = 0; i < 5; ++i) {  // buffered: no recv is posted yet
        std::vector<uint32_t> m(1000 * (i + 1), i);
        c.send(1, {reinterpret_cast<uint8_t*>(m.data()), m.size() * 4}, i, deadlineIn(30));
      }
    } else {
      for (uint32_t i = 0; i < 5; ++i) {
        std::vector<uint32_t> m(1000 * (i + 1));
        c.recv(0, {reinterpret_cast<uint8_t*>(m.data()), m.size() * 4}, i, deadlineIn(30));
        EXPECT_EQ(m.back(), i);
      }
    }
  });
}

}  // namespace
}  // namespace shmgrad::backend
