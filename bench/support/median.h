// The median of a benchmark's per-round figures (the mean of the middle two for an even count;
// 0 for none): what the checkpoint benchmarks report over their interleaved rounds, with the
// rounds' spread beside it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

namespace mixprec::bench {

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t mid = v.size() / 2;
  return v.size() % 2 == 1 ? v[mid] : (v[mid - 1] + v[mid]) / 2;
}

// A figure's median over rounds and the range of the rounds (all 0 for none).
struct Spread {
  double median = 0, min = 0, max = 0;
  // Rounds that differ by more than the median itself: the median is then within the noise of
  // the machine, and a goal it meets may have met it by chance.
  bool wider_than_median() const { return max - min > std::abs(median); }
};

inline Spread spread(const std::vector<double>& v) {
  if (v.empty()) return {};
  const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
  return {median(v), *lo, *hi};
}

}  // namespace mixprec::bench
