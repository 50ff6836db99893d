// Lossless master remainders, the format (optim/master_remainder.h): split_master and
// join_master against the format's definition, on every one of the 2^32 FP32 bit patterns
// (about 5 s of CPU): join(split(u)) == u (signalling NaNs come back quieted), the remainder is
// u's low half, and the BF16 param is u rounded to nearest-even except at exact ties with an
// even lower neighbour, where it is one BF16 ulp further from zero. The fused steps on this
// format are tested in master_remainder_step_test.cpp.
#include "mixprec/optim/master_remainder.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <thread>
#include <utility>
#include <vector>

#include "optim/support_kernels.h"
#include "support/test_env.h"

// White-box: the SIMD kernels themselves and the non-CPU fallback, from the private headers.
#include "../../src/optim/kernels/aten_fallback.h"
#include "../../src/optim/kernels/kernel_args.h"

namespace mixprec::optim {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using mixprec::testing::expect_rejected;
using mixprec::testing::same_bits;

// ---------------------------------------------------------------- every FP32 pattern

// What split must give for the pattern u, from the format's definition (master_remainder.h).
// Round-to-nearest-even is c10's formula (torch/headeronly/util/BFloat16.h); the SIMD kernel's
// own RNE for model params is checked against at::Tensor::to in fused_kernels_test.cpp.
struct Expected {
  uint16_t param;
  uint16_t remainder;
  uint32_t joined;
};

inline Expected expected_split(uint32_t u) {
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  const bool even_tie = (u & 0x1FFFFu) == 0x8000u;
  const uint32_t rne = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  Expected e;
  e.remainder = static_cast<uint16_t>(u & 0xFFFFu);
  e.param = static_cast<uint16_t>(nan ? (u >> 16) | 0x0040u : rne + (even_tie ? 1u : 0u));
  e.joined = nan ? u | 0x00400000u : u;  // signalling NaNs come back quieted
  return e;
}

// Split and join the patterns in [begin, end) with the SIMD kernels (the target this CPU
// selects), 2^16 at a time so the buffers stay in cache, every `stride`-th chunk; returns how
// many came out wrong and the first of them.
std::pair<uint64_t, uint32_t> check_patterns(uint64_t begin, uint64_t end, uint64_t stride) {
  constexpr int64_t kChunk = int64_t{1} << 16;
  std::vector<uint32_t> bits(kChunk), joined(kChunk);
  std::vector<uint16_t> param(kChunk), remainder(kChunk);
  uint64_t wrong = 0;
  uint32_t first_wrong = 0;
  for (uint64_t start = begin; start < end; start += kChunk * stride) {
    std::iota(bits.begin(), bits.end(), static_cast<uint32_t>(start));
    detail::split_master_chunk(reinterpret_cast<const float*>(bits.data()), param.data(),
                               reinterpret_cast<int16_t*>(remainder.data()), 0, kChunk);
    detail::join_master_chunk(param.data(), reinterpret_cast<const int16_t*>(remainder.data()),
                              reinterpret_cast<float*>(joined.data()), 0, kChunk);
    uint64_t chunk_wrong = 0;
    for (int64_t i = 0; i < kChunk; ++i) {
      const Expected e = expected_split(bits[i]);
      chunk_wrong +=
          (param[i] != e.param) | (remainder[i] != e.remainder) | (joined[i] != e.joined);
    }
    for (int64_t i = 0; chunk_wrong != 0 && wrong == 0 && i < kChunk; ++i) {
      const Expected e = expected_split(bits[i]);
      if (param[i] != e.param || remainder[i] != e.remainder || joined[i] != e.joined) {
        first_wrong = bits[i];
        break;
      }
    }
    wrong += chunk_wrong;
  }
  return {wrong, first_wrong};
}

TEST(SplitJoinMaster, EveryFloat32PatternRoundTripsAndRounds) {
  // All 2^32 patterns, one share per hardware thread. The sanitized pass, where the kernels run
  // instrumented and 5x slower, checks every 7th chunk of 2^16 (one high half in seven): what
  // ASan checks is the same in every chunk (same buffers, same length), and an odd stride
  // still meets every sign, exponent and low BF16 bit (odd and even, ties, carries into the
  // exponent and to infinity) with every low half, for UBSan's value-dependent checks.
  const uint64_t stride = mixprec::test::sanitized_pass() ? 7 : 1;
  const uint64_t threads = std::max(1u, std::thread::hardware_concurrency());
  const uint64_t total = uint64_t{1} << 32, share = (total / threads) & ~uint64_t{0xFFFF};
  std::vector<std::pair<uint64_t, uint32_t>> results(threads);
  std::vector<std::thread> pool;
  for (uint64_t t = 0; t < threads; ++t) {
    const uint64_t begin = t * share, end = t + 1 == threads ? total : (t + 1) * share;
    pool.emplace_back(
        [&results, t, begin, end, stride] { results[t] = check_patterns(begin, end, stride); });
  }
  for (auto& thread : pool) thread.join();
  for (const auto& [wrong, first] : results) {
    EXPECT_EQ(wrong, 0u) << "first wrong pattern 0x" << std::hex << first;
  }
}

TEST(SplitJoinMaster, HandPickedPatterns) {
  struct Case {
    uint32_t master;
    uint16_t param;
    int16_t remainder;
  };
  // clang-format off
  const std::vector<Case> cases = {
      {0x3F800000, 0x3F80, 0},        // 1.0: exact
      {0x3F807FFF, 0x3F80, 0x7FFF},   // just below a tie: down
      {0x3F808000, 0x3F81, -0x8000},  // tie, even below: away from zero (RNE: 0x3F80)
      {0x3F818000, 0x3F82, -0x8000},  // tie, odd below: up (as RNE)
      {0x3F808001, 0x3F81, -0x7FFF},  // just above a tie: up
      {0x3FFFFFFF, 0x4000, -1},       // carry into the exponent
      {0xBF808000, 0xBF81, -0x8000},  // negative tie: away from zero
      {0xBFFFFFFF, 0xC000, -1},       // negative carry into the exponent
      {0x807FFFFF, 0x8080, -1},       // largest negative subnormal: carry to a normal
      {0x00000001, 0x0000, 1},        // smallest subnormal rounds to +0
      {0x80000000, 0x8000, 0},        // -0
      {0x7F7FFFFF, 0x7F80, -1},       // FLT_MAX rounds to Inf, still recoverable
      {0x7F800000, 0x7F80, 0},        // Inf
      {0xFF800000, 0xFF80, 0},        // -Inf
      {0x7FC00000, 0x7FC0, 0},        // quiet NaN
      {0x7FFFFFFF, 0x7FFF, -1},       // NaN whose carry would wrap to -0
      {0xFFFFFFFF, 0xFFFF, -1},       // ... and to +0
      {0x7F800001, 0x7FC0, 1},        // signalling NaN: quieted, payload kept
  };
  // clang-format on
  std::vector<uint32_t> bits;
  for (const Case& c : cases) bits.push_back(c.master);
  const int64_t n = static_cast<int64_t>(bits.size());
  const at::Tensor master = at::from_blob(bits.data(), {n}, at::kInt).view(at::kFloat).clone();
  const MasterSplit split = split_master(master);
  const at::Tensor joined = join_master(split.param, split.remainder);
  for (int64_t i = 0; i < n; ++i) {
    SCOPED_TRACE(::testing::Message() << "master 0x" << std::hex << cases[i].master);
    EXPECT_EQ(static_cast<uint16_t>(split.param.view(at::kShort)[i].item<int16_t>()),
              cases[i].param);
    EXPECT_EQ(split.remainder[i].item<int16_t>(), cases[i].remainder);
    const uint32_t back = static_cast<uint32_t>(joined.view(at::kInt)[i].item<int32_t>());
    EXPECT_EQ(back, cases[i].master == 0x7F800001 ? 0x7FC00001u : cases[i].master);
  }
}

TEST(SplitJoinMaster, ShapesAndAtenFallbackAgree) {
  // Random patterns of every class, split and joined by the SIMD path and by the integer ATen
  // ops non-CPU tensors use (run here on CPU tensors): bit for bit the same.
  at::manual_seed(31);
  const at::Tensor master = at::randint(INT32_MIN, INT32_MAX, {3, 1001}, at::kInt).view(at::kFloat);
  const MasterSplit split = split_master(master.t());  // non-contiguous input is fine
  ASSERT_EQ(split.param.sizes(), master.t().sizes());
  at::Tensor param = at::empty({3 * 1001}, at::kBFloat16), rem = at::empty({3 * 1001}, at::kShort);
  const at::Tensor flat = master.t().contiguous().view({-1});
  detail::split_master_aten(flat, param, rem);
  EXPECT_TRUE(same_bits(split.param.reshape({-1}), param));
  EXPECT_TRUE(same_bits(split.remainder.reshape({-1}), rem));
  at::Tensor joined = at::empty({3 * 1001});
  detail::join_master_aten(param, rem, joined);
  EXPECT_TRUE(same_bits(join_master(split.param, split.remainder).reshape({-1}), joined));
}

// join_master takes halves of any strides (split_master's outputs transposed, say) and returns
// their master in the param's shape.
TEST(SplitJoinMaster, JoinTakesNonContiguousHalves) {
  at::manual_seed(32);
  const at::Tensor master = at::randn({3, 5});
  const MasterSplit split = split_master(master);
  const at::Tensor joined = join_master(split.param.t(), split.remainder.t());
  ASSERT_EQ(joined.sizes(), master.t().sizes());
  EXPECT_TRUE(same_bits(joined.contiguous(), master.t().contiguous()));
}

TEST(SplitJoinMaster, EachBadArgumentIsNamedAndNothingIsWritten) {
  const int64_t n = 9;
  const at::Tensor param = at::randn({n}).to(at::kBFloat16), rem = at::zeros({n}, at::kShort);
  const at::Tensor master = at::randn({n});
  expect_rejected([&] { (void)split_master(master.to(at::kDouble)); }, {}, "split_master",
                  "master must be float32");
  expect_rejected([&] { split_master_out(master, param, rem.to(at::kInt)); }, {param},
                  "split_master", "remainder must be int16");
  expect_rejected([&] { split_master_out(master, param, at::zeros({n + 1}, at::kShort)); }, {param},
                  "split_master", "remainder has 10 elements");
  expect_rejected([&] { split_master_out(master, param, param.view(at::kShort)); }, {param},
                  "split_master", "param and remainder share memory");
  expect_rejected(
      [&] {
        (void)join_master(param, rem.view({3, 3}));
      },
      {}, "join_master", "remainder has shape [3, 3] but param has shape [9]");
  at::Tensor out = at::zeros({n});
  expect_rejected([&] { join_master_out(param, rem, out.to(at::kHalf)); }, {}, "join_master",
                  "master must be float32");
  expect_rejected([&] { join_master_out(param.to(at::kFloat), rem, out); }, {out}, "join_master",
                  "param must be bfloat16");
}

TEST(SplitJoinMaster, NonCpuTensorsTakeTheAtenPath) {
  // Meta tensors have no data: this checks dispatch and shapes; the integer ops themselves are
  // checked on CPU tensors above.
  const auto meta = at::TensorOptions(at::kMeta);
  const int64_t n = 5;
  const at::Tensor param = at::empty({n}, meta.dtype(at::kBFloat16));
  const at::Tensor rem = at::empty({n}, meta.dtype(at::kShort));
  EXPECT_NO_THROW(split_master_out(at::empty({n}, meta), param, rem));
  EXPECT_NO_THROW(join_master_out(param, rem, at::empty({n}, meta)));
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::optim
