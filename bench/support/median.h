// The median of a benchmark's per-round figures (the mean of the middle two for an even count;
// 0 for none): what the checkpoint benchmarks report over their interleaved rounds.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace mixprec::bench {

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t mid = v.size() / 2;
  return v.size() % 2 == 1 ? v[mid] : (v[mid - 1] + v[mid]) / 2;
}

}  // namespace mixprec::bench
