// Every collective mixprec uses × every dtype it sends × odd sizes, against results computed
// locally. Values depend on both the element index and the rank, so a chunk landing in the
// wrong place, a wrong element size or a wrong reduction fails the comparison.
#include "distributed/mp/mp_support.h"
#include "mixprec/distributed/init.h"
#include "support/counting_allocator.h"
#include "support/error_message.h"

#include <gtest/gtest.h>

namespace mixprec::testing {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kBFloat16, at::kHalf,
                                             at::kLong,  at::kDouble,   at::kByte};
const std::vector<int64_t> kSizes = {1, 7, 1001};

// Small integers (exact in every dtype, sums too); unsigned for Byte.
at::Tensor contribution(int64_t numel, int rank, at::ScalarType dtype) {
  at::Tensor i = at::arange(numel, at::kLong);
  at::Tensor v = dtype == at::kByte ? (i * 3 + rank * 5) % 11 : (i * 7 + rank * 13) % 23 - 11;
  return v.to(dtype);
}

at::Tensor sum_over_ranks(int64_t numel, at::ScalarType dtype) {
  at::Tensor sum = at::zeros({numel}, at::kLong);
  for (int r = 0; r < world().size(); ++r) sum += contribution(numel, r, dtype).to(at::kLong);
  return sum.to(dtype);
}

std::string where(at::ScalarType dtype, int64_t numel) {
  return std::string(c10::toString(dtype)) + " x " + std::to_string(numel);
}

TEST(Collectives, AllReduceSumEveryDtypeAndSize) {
  for (at::ScalarType dtype : kDtypes) {
    for (int64_t numel : kSizes) {
      at::Tensor t = contribution(numel, world().rank(), dtype);
      world().all_reduce_sum(t).wait();
      EXPECT_TRUE(at::equal(t, sum_over_ranks(numel, dtype))) << where(dtype, numel);
    }
  }
}

TEST(Collectives, AllReduceMaxAndMin) {
  for (at::ScalarType dtype : {at::kDouble, at::kFloat, at::kLong}) {
    at::Tensor hi = contribution(7, world().rank(), dtype);
    at::Tensor lo = hi.clone();
    world().all_reduce_max(hi).wait();
    world().all_reduce_min(lo).wait();
    at::Tensor all = at::stack([&] {
      std::vector<at::Tensor> v;
      for (int r = 0; r < world().size(); ++r) v.push_back(contribution(7, r, dtype));
      return v;
    }());
    EXPECT_TRUE(at::equal(hi, std::get<0>(all.max(0)))) << c10::toString(dtype);
    EXPECT_TRUE(at::equal(lo, std::get<0>(all.min(0)))) << c10::toString(dtype);
  }
}

// numel not divisible by N: padded with zeros to a multiple of N, as the grad buckets are.
TEST(Collectives, ReduceScatterEveryDtypeAndSizeWithPadding) {
  const int n = world().size(), rank = world().rank();
  for (at::ScalarType dtype : kDtypes) {
    for (int64_t numel : kSizes) {
      for (bool in_place : {false, true}) {
        const int64_t chunk = (numel + n - 1) / n;
        at::Tensor input = at::zeros({chunk * n}, dtype);
        input.narrow(0, 0, numel).copy_(contribution(numel, rank, dtype));
        at::Tensor output =
            in_place ? input.narrow(0, rank * chunk, chunk) : at::full({chunk}, 99, dtype);
        world().reduce_scatter_sum(input, output).wait();
        at::Tensor expected = at::zeros({chunk * n}, dtype);
        expected.narrow(0, 0, numel).copy_(sum_over_ranks(numel, dtype));
        EXPECT_TRUE(at::equal(output, expected.narrow(0, rank * chunk, chunk)))
            << where(dtype, numel) << (in_place ? " in place" : "");
      }
    }
  }
}

// Gloo's own all-reduce, past the communicator's two-rank exchanges: their reference.
at::Tensor gloo_sum(distributed::Communicator& comm, const at::Tensor& t) {
  std::vector<at::Tensor> tensors{t.clone()};
  comm.backend()->allreduce(tensors)->wait();
  return tensors[0];
}

// Two ranks on Gloo reduce-scatter by exchanging halves, and all-reduce small sums by
// exchanging the whole tensor: what they sum must be Gloo's all-reduce's sum bit for bit
// (rounded BF16 and FP16 sums, wrapped bytes), the other half must stay this rank's own, and
// the receive buffers must be reused, so a steady-state step allocates nothing.
TEST(Collectives, TwoRankExchangesSumAsGlooAndReuseTheirBuffers) {
  distributed::Communicator& comm = world();
  if (comm.size() != 2 || comm.backend_name() != "gloo") GTEST_SKIP() << "Gloo, two ranks";
  ASSERT_TRUE(comm.has_native_reduce_scatter());
  const int rank = comm.rank(), peer = 1 - rank;
  at::manual_seed(7 + rank);  // different data on each rank
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf, at::kLong, at::kByte}) {
    const at::Tensor mine = at::isIntegralType(dtype, /*includeBool=*/false)
                                ? at::randint(0, 200, {2 * 513}, dtype)  // byte sums wrap
                                : (at::randn({2 * 513}, at::kFloat) * 100).to(dtype);
    const at::Tensor summed = gloo_sum(comm, mine);
    at::Tensor input = mine.clone();
    comm.reduce_scatter_sum(input, input.narrow(0, rank * 513, 513)).wait();
    EXPECT_TRUE(at::equal(input.narrow(0, rank * 513, 513), summed.narrow(0, rank * 513, 513)))
        << c10::toString(dtype);
    EXPECT_TRUE(at::equal(input.narrow(0, peer * 513, 513), mine.narrow(0, peer * 513, 513)))
        << c10::toString(dtype) << ": the peer's half changed";
    at::Tensor all = mine.clone();
    comm.all_reduce_sum(all).wait();
    EXPECT_TRUE(at::equal(all, summed)) << c10::toString(dtype);
  }
  // Past 64 KiB a sum runs on Gloo's ring: the same sums either way.
  const at::Tensor large = at::randn({(int64_t{1} << 14) + 1}, at::kFloat);
  at::Tensor large_sum = large.clone();
  comm.all_reduce_sum(large_sum).wait();
  EXPECT_TRUE(at::equal(large_sum, gloo_sum(comm, large)));
  at::Tensor small = at::ones({102}, at::kFloat);
  comm.all_reduce_sum(small).wait();  // warm
  {
    const CountingAllocatorGuard counting;
    for (int i = 0; i < 3; ++i) comm.all_reduce_sum(small).wait();
    EXPECT_EQ(counting.allocations(), 0);
  }
  EXPECT_EQ(small[101].item<float>(), 16.0f);  // doubled four times
  at::Tensor input = at::ones({2 * 4096}, at::kFloat);
  comm.reduce_scatter_sum(input, input.narrow(0, rank * 4096, 4096)).wait();  // warm
  const CountingAllocatorGuard counting;
  for (int i = 0; i < 3; ++i) {
    comm.reduce_scatter_sum(input, input.narrow(0, rank * 4096, 4096)).wait();
  }
  EXPECT_EQ(counting.allocations(), 0);
  // An output that overlaps the input other than as this rank's chunk is refused before
  // anything is sent: the next exchange still pairs with the peer's.
  EXPECT_NE(error_of([&] {
              comm.reduce_scatter_sum(input, input.narrow(0, peer * 4096, 4096)).wait();
            }).find("output overlaps input other than as this rank's chunk"),
            std::string::npos);
  comm.reduce_scatter_sum(input, input.narrow(0, rank * 4096, 4096)).wait();
  // Each exchange adds the peer's half, which it never changes: 1 + 1, then + 1 four times.
  EXPECT_EQ(input[rank * 4096].item<float>(), 6.0f);
}

TEST(Collectives, AllGatherEveryDtypeAndSizeWithPadding) {
  const int n = world().size(), rank = world().rank();
  for (at::ScalarType dtype : kDtypes) {
    for (int64_t numel : kSizes) {
      const int64_t chunk = (numel + n - 1) / n;
      at::Tensor global = at::zeros({chunk * n}, dtype);
      global.narrow(0, 0, numel).copy_(contribution(numel, 3, dtype));
      at::Tensor mine = global.narrow(0, rank * chunk, chunk).clone();
      at::Tensor out = at::full({chunk * n}, 99, dtype);
      world().all_gather(mine, out).wait();
      EXPECT_TRUE(at::equal(out, global)) << where(dtype, numel);
    }
  }
}

TEST(Collectives, AllGatherStringsOfDifferentLengths) {
  const int rank = world().rank();
  const std::string mine = rank == 1 ? std::string() : std::string(rank * 3 + 1, 'a' + rank);
  const auto all = world().all_gather_strings(mine);
  ASSERT_EQ(static_cast<int>(all.size()), world().size());
  for (int r = 0; r < world().size(); ++r) {
    EXPECT_EQ(all[r], r == 1 ? std::string() : std::string(r * 3 + 1, 'a' + r));
  }
  world().barrier();
}

TEST(Collectives, TrafficCountsWhatWasSent) {
  distributed::Communicator& comm = world();
  const int n = comm.size();
  comm.reset_traffic();
  at::Tensor t = at::zeros({10 * n}, at::kFloat);
  comm.all_reduce_sum(t).wait();
  at::Tensor out = at::empty({10}, at::kFloat);
  comm.reduce_scatter_sum(t, out).wait();
  at::Tensor gathered = at::empty({10 * n}, at::kFloat);
  comm.all_gather(out, gathered).wait();
  // In place: this rank's chunk of the output is the input.
  comm.all_gather(gathered.narrow(0, 10 * comm.rank(), 10), gathered).wait();
  at::Tensor root_value = at::zeros({10}, at::kFloat);
  for (int root = 0; root < n; ++root) comm.broadcast(root_value, root).wait();
  const int64_t bytes = 40 * n;
  using distributed::Collective;
  EXPECT_EQ(comm.traffic(Collective::kAllReduce).payload_bytes, bytes);
  EXPECT_EQ(comm.traffic(Collective::kAllReduce).bytes_sent, 2 * 40 * (n - 1));
  // Gloo's reduce-scatter is a whole all-reduce, except for two ranks: an exchange of halves.
  EXPECT_EQ(comm.traffic(Collective::kReduceScatter).bytes_sent,
            n == 2 ? 40 * (n - 1) : 2 * 40 * (n - 1));
  EXPECT_EQ(comm.traffic(Collective::kAllGather).payload_bytes, 2 * bytes);
  EXPECT_EQ(comm.traffic(Collective::kAllGather).bytes_sent, 2 * 40 * (n - 1));
  // A binomial tree from each root in turn: N - 1 sends of 40 bytes in all, over every rank.
  at::Tensor sent = at::tensor({comm.traffic(Collective::kBroadcast).bytes_sent}, at::kLong);
  comm.all_reduce_sum(sent).wait();
  EXPECT_EQ(sent.item<int64_t>(), int64_t{40} * n * (n - 1));
}

TEST(Collectives, InPlaceAllGatherKeepsEveryChunk) {
  distributed::Communicator& comm = world();
  const int n = comm.size(), rank = comm.rank();
  at::Tensor all = at::full({5 * n}, -1.0, at::kBFloat16);
  all.narrow(0, 5 * rank, 5).fill_(rank + 1);
  comm.all_gather(all.narrow(0, 5 * rank, 5), all).wait();
  for (int r = 0; r < n; ++r) {
    EXPECT_TRUE(at::equal(all.narrow(0, 5 * r, 5), at::full({5}, r + 1.0, at::kBFloat16))) << r;
  }
  at::Tensor overlapping = at::zeros({5 * n}, at::kFloat);
  if (n > 1) {
    EXPECT_NE(error_of([&] {
                comm.all_gather(overlapping.narrow(0, 1, 5), overlapping).wait();
              }).find("overlaps output"),
              std::string::npos);
  }
}

// A rank that never arrives is an error on the ranks that wait, within the timeout. Two ranks
// show it; each run waits out the timeout, so only that world size pays it.
TEST(Collectives, MissingRankInCollectiveTimesOut) {
  const int n = world().size(), rank = world().rank();
  if (n != 2) GTEST_SKIP() << "runs on two ranks";
  auto group = own_group("timeout", std::chrono::seconds(3));
  if (rank == 0) {
    at::Tensor t = at::ones({5});
    const std::string message = error_of([&] { group->all_reduce_sum(t).wait(); });
    // (Two Gloo ranks sum as an exchange, and the message says so.)
    EXPECT_EQ(message.find("[mixprec::distributed] all_reduce_sum "), 0u) << message;
    EXPECT_NE(message.find("of 5 x Float failed on rank 0 of"), std::string::npos) << message;
  }
  world().barrier();
}

// A group whose rank n never starts: forming it fails on every rank that did. (One and two
// ranks show it; larger worlds would only wait out the same timeout again.)
TEST(Collectives, MissingRankAtRendezvousFailsEveryRank) {
  if (world().size() > 2) GTEST_SKIP() << "runs on one and two ranks";
  distributed::InitOptions options;
  options.timeout = std::chrono::seconds(3);
  const std::string message = error_of([&] {
    distributed::init_with_store(test_store("rendezvous"), world().rank(), world().size() + 1,
                                 options);
  });
  EXPECT_NE(message.find("could not form the group within 3000 ms"), std::string::npos) << message;
  world().barrier();
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::testing
