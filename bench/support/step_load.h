// A fixed synthetic compute load standing for a training step's forward and backward, for the
// checkpoint benchmarks' async-save figure: an async save hides its staging copy behind the
// next step's forward and backward, and only a measured step shows how much of it stays
// visible (the copy, and the background writing after it, compete with the step for cores and
// memory bandwidth).
//
// The load is `gemms` BF16 matrix products of kSide x kSide operands (at::mm_out into one
// preallocated result, so it allocates nothing), on the process's intra-op threads, as a
// mixed-precision step's GEMMs run. Its length is fixed by the count, not by a clock, so the
// same work runs with and without a save in flight and the difference of the two walls is the
// time the save added. gemms_for(seconds) sizes it from a timing of the products on this
// machine now.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <vector>

namespace mixprec::bench {

class StepLoad {
 public:
  static constexpr int64_t kSide = 512;

  explicit StepLoad(int64_t gemms)
      : gemms_(gemms),
        a_(at::randn({kSide, kSide}).to(at::kBFloat16)),
        b_(at::randn({kSide, kSide}).to(at::kBFloat16)),
        c_(at::empty({kSide, kSide}, at::kBFloat16)) {}

  int64_t gemms() const { return gemms_; }

  void run() const {
    for (int64_t i = 0; i < gemms_; ++i) at::mm_out(c_, a_, b_);
  }

  // Seconds one product takes here now: the median of the products run in 0.3 s, after ten
  // untimed ones (oneDNN builds its kernel on the first). The median, not the mean or the
  // fastest: on this shared 2-core machine single products ranged over ten times, and a step
  // sized by either extreme came out several times too short or too long.
  static double seconds_per_gemm() {
    StepLoad one(1);
    for (int i = 0; i < 10; ++i) one.run();
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    std::vector<double> seconds;
    while (std::chrono::duration<double>(Clock::now() - start).count() < 0.3) {
      const auto t0 = Clock::now();
      one.run();
      seconds.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    std::sort(seconds.begin(), seconds.end());
    return seconds[seconds.size() / 2];
  }

  // The number of products that lasts about `seconds` at `per_gemm` seconds each (at least 1).
  static int64_t gemms_for(double seconds, double per_gemm) {
    return std::max<int64_t>(1, std::llround(seconds / per_gemm));
  }

 private:
  int64_t gemms_;
  at::Tensor a_, b_;
  mutable at::Tensor c_;
};

}  // namespace mixprec::bench
