#include "mixprec/checkpoint/format/box.h"

#include <algorithm>
#include <numeric>
#include <set>

namespace mixprec::checkpoint {

std::uint64_t Box::volume() const {
  std::uint64_t v = 1;
  for (std::int64_t d : shape) v *= static_cast<std::uint64_t>(d);
  return v;
}

std::string dims_to_string(const std::vector<std::int64_t>& dims) {
  std::string out = "[";
  for (std::size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + "]";
}

std::string Box::to_string() const { return dims_to_string(offset) + "+" + dims_to_string(shape); }

bool fits_in(const Box& box, const std::vector<std::int64_t>& global_shape) {
  if (box.offset.size() != global_shape.size() || box.shape.size() != global_shape.size()) {
    return false;
  }
  for (std::size_t d = 0; d < global_shape.size(); ++d) {
    if (box.offset[d] < 0 || box.shape[d] < 0 || global_shape[d] < 0) return false;
    // offset + shape ≤ global, rearranged so nothing overflows.
    if (box.offset[d] > global_shape[d] || box.shape[d] > global_shape[d] - box.offset[d]) {
      return false;
    }
  }
  return true;
}

std::optional<Box> intersect(const Box& a, const Box& b) {
  if (a.rank() != b.rank() || a.offset.size() != a.rank() || b.offset.size() != b.rank()) {
    return std::nullopt;
  }
  Box out;
  for (std::size_t d = 0; d < a.rank(); ++d) {
    const std::int64_t lo = std::max(a.offset[d], b.offset[d]);
    const std::int64_t hi = std::min(a.offset[d] + a.shape[d], b.offset[d] + b.shape[d]);
    if (hi <= lo) return std::nullopt;
    out.offset.push_back(lo);
    out.shape.push_back(hi - lo);
  }
  return out;
}

std::optional<TilingProblem> check_tiling(const std::vector<Box>& boxes,
                                          const std::vector<std::int64_t>& global_shape) {
  const std::size_t rank = global_shape.size();
  std::uint64_t total = 1;
  for (std::int64_t d : global_shape) {
    if (d < 0 || __builtin_mul_overflow(total, static_cast<std::uint64_t>(d), &total)) {
      return TilingProblem{TilingProblem::Kind::kOutOfBounds, 0, 0, 0, 0};
    }
  }
  std::vector<std::size_t> nonempty;
  for (std::size_t i = 0; i < boxes.size(); ++i) {
    if (!fits_in(boxes[i], global_shape)) {
      return TilingProblem{TilingProblem::Kind::kOutOfBounds, i, 0, 0, total};
    }
    if (boxes[i].volume() > 0) nonempty.push_back(i);
  }

  // Sweep along the dimension whose offsets vary most: for row-split shards that is dim 0,
  // for column-split ones dim 1, and either way each box meets only its few neighbours.
  std::size_t sweep = 0;
  std::size_t most_distinct = 0;
  for (std::size_t d = 0; d < rank; ++d) {
    std::set<std::int64_t> offsets;
    for (std::size_t i : nonempty) offsets.insert(boxes[i].offset[d]);
    if (offsets.size() > most_distinct) most_distinct = offsets.size(), sweep = d;
  }
  std::sort(nonempty.begin(), nonempty.end(), [&](std::size_t a, std::size_t b) {
    if (rank == 0) return a < b;
    return boxes[a].offset[sweep] != boxes[b].offset[sweep]
               ? boxes[a].offset[sweep] < boxes[b].offset[sweep]
               : a < b;
  });
  std::uint64_t covered = 0;
  for (std::size_t k = 0; k < nonempty.size(); ++k) {
    const Box& a = boxes[nonempty[k]];
    // Every pair among boxes 0..k was checked before box k is counted, so the counted boxes
    // are disjoint and `covered` never exceeds `total` (no overflow).
    covered += a.volume();
    for (std::size_t j = k + 1; j < nonempty.size(); ++j) {
      const Box& b = boxes[nonempty[j]];
      if (rank > 0 && b.offset[sweep] >= a.offset[sweep] + a.shape[sweep]) break;
      if (intersect(a, b)) {
        return TilingProblem{TilingProblem::Kind::kOverlap, std::min(nonempty[k], nonempty[j]),
                             std::max(nonempty[k], nonempty[j]), 0, total};
      }
    }
  }
  if (covered != total) return TilingProblem{TilingProblem::Kind::kGap, 0, 0, covered, total};
  return std::nullopt;
}

}  // namespace mixprec::checkpoint
