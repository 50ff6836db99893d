#include "mixprec/checkpoint/format/box.h"

#include "mixprec/checkpoint/format/error.h"

#include <algorithm>
#include <iterator>
#include <map>
#include <set>
#include <tuple>
#include <utility>

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

namespace {

// Elements [begin, end) of the sub-tensor shape[dim:] at index `prefix` (dims < dim):
// a partial leading row (recursively), the whole rows, a partial trailing row (recursively).
void split_flat(const std::vector<std::int64_t>& shape, std::size_t dim,
                std::vector<std::int64_t>& prefix, std::int64_t begin, std::int64_t end,
                std::vector<Box>& out) {
  if (begin >= end) return;
  auto box_at = [&](std::int64_t first, std::int64_t count) {
    Box box{prefix, std::vector<std::int64_t>(prefix.size(), 1)};
    box.offset.push_back(first);
    box.shape.push_back(count);
    for (std::size_t d = dim + 1; d < shape.size(); ++d) {
      box.offset.push_back(0);
      box.shape.push_back(shape[d]);
    }
    out.push_back(std::move(box));
  };
  std::int64_t row = 1;  // elements per index of `dim`
  for (std::size_t d = dim + 1; d < shape.size(); ++d) row *= shape[d];
  if (dim + 1 == shape.size() || row == 0) {
    box_at(begin / std::max<std::int64_t>(row, 1), (end - begin) / std::max<std::int64_t>(row, 1));
    return;
  }
  if (begin % row != 0) {
    const std::int64_t r = begin / row, stop = std::min(end, (r + 1) * row);
    prefix.push_back(r);
    split_flat(shape, dim + 1, prefix, begin - r * row, stop - r * row, out);
    prefix.pop_back();
    begin = stop;
  }
  if (end / row > begin / row && begin < end) {
    box_at(begin / row, end / row - begin / row);
    begin = end / row * row;
  }
  if (begin < end) {
    const std::int64_t r = begin / row;
    prefix.push_back(r);
    split_flat(shape, dim + 1, prefix, 0, end - r * row, out);
    prefix.pop_back();
  }
}

}  // namespace

std::vector<Box> flat_range_boxes(const std::vector<std::int64_t>& global_shape, std::int64_t begin,
                                  std::int64_t end) {
  std::uint64_t numel = 1;
  for (std::int64_t d : global_shape) {
    if (d < 0)
      throw FormatError("[mixprec::checkpoint] flat range of shape " +
                        dims_to_string(global_shape) + ": negative dimension");
    numel *= static_cast<std::uint64_t>(d);
  }
  if (begin < 0 || begin > end || static_cast<std::uint64_t>(end) > numel) {
    throw FormatError("[mixprec::checkpoint] flat range [" + std::to_string(begin) + ", " +
                      std::to_string(end) + ") does not lie in a tensor of shape " +
                      dims_to_string(global_shape) + " (" + std::to_string(numel) + " elements)");
  }
  std::vector<Box> out;
  if (begin == end) return out;
  if (global_shape.empty()) return {Box{}};
  std::vector<std::int64_t> prefix;
  split_flat(global_shape, 0, prefix, begin, end, out);
  return out;
}

namespace {

using Overlap = std::pair<std::size_t, std::size_t>;

std::int64_t end_of(const Box& b, std::size_t d) { return b.offset[d] + b.shape[d]; }

// One split dimension: sorted by start, a box overlaps an earlier one exactly when it starts
// before the furthest end seen so far.
std::optional<Overlap> overlap_1d(const std::vector<Box>& boxes, std::vector<std::size_t> ids,
                                  std::size_t d) {
  std::sort(ids.begin(), ids.end(), [&](std::size_t a, std::size_t b) {
    return std::pair(boxes[a].offset[d], a) < std::pair(boxes[b].offset[d], b);
  });
  std::int64_t furthest = 0;
  std::size_t holder = 0;
  for (std::size_t k = 0; k < ids.size(); ++k) {
    const std::size_t i = ids[k];
    if (k > 0 && boxes[i].offset[d] < furthest) return Overlap{holder, i};
    if (k == 0 || end_of(boxes[i], d) > furthest) furthest = end_of(boxes[i], d), holder = i;
  }
  return std::nullopt;
}

// A sweep along dimension `d0`: at each position the boxes the sweep line cuts are pairwise
// disjoint (or an overlap was already reported), so their extents along `d1` are disjoint
// intervals, kept ordered by start; a new box can only meet its two neighbours there.
// With `d1` == npos (three or more split dimensions) the cut boxes are kept in a list and a
// new box is compared with each: still exact, but linear in how many boxes a line cuts.
std::optional<Overlap> overlap_sweep(const std::vector<Box>& boxes,
                                     const std::vector<std::size_t>& ids, std::size_t d0,
                                     std::size_t d1) {
  struct Event {
    std::int64_t at;
    bool enter;  // leaving sorts first: boxes are half-open, touching is not sharing
    std::size_t id;
    bool operator<(const Event& o) const {
      return std::tuple(at, enter, id) < std::tuple(o.at, o.enter, o.id);
    }
  };
  std::vector<Event> events;
  events.reserve(2 * ids.size());
  for (std::size_t i : ids) {
    events.push_back({boxes[i].offset[d0], true, i});
    events.push_back({end_of(boxes[i], d0), false, i});
  }
  std::sort(events.begin(), events.end());
  std::map<std::int64_t, std::size_t> by_start;  // d1 start → box (two split dimensions)
  std::set<std::size_t> cut;                     // boxes the line cuts (three or more)
  constexpr std::size_t npos = static_cast<std::size_t>(-1);
  for (const Event& e : events) {
    const Box& b = boxes[e.id];
    if (!e.enter) {
      if (d1 != npos) {
        by_start.erase(b.offset[d1]);
      } else {
        cut.erase(e.id);
      }
      continue;
    }
    if (d1 != npos) {
      auto next = by_start.lower_bound(b.offset[d1]);
      if (next != by_start.end() && next->first < end_of(b, d1)) return Overlap{next->second, e.id};
      if (next != by_start.begin()) {
        auto prev = std::prev(next);
        if (end_of(boxes[prev->second], d1) > b.offset[d1]) return Overlap{prev->second, e.id};
      }
      by_start.emplace(b.offset[d1], e.id);
    } else {
      for (std::size_t other : cut) {
        if (intersect(boxes[other], b)) return Overlap{other, e.id};
      }
      cut.insert(e.id);
    }
  }
  return std::nullopt;
}

}  // namespace

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

  // Only dimensions along which some box does not span the whole extent can separate boxes;
  // along the others every two non-empty boxes share indices.
  std::vector<std::size_t> split;
  for (std::size_t d = 0; d < rank; ++d) {
    for (std::size_t i : nonempty) {
      if (boxes[i].offset[d] != 0 || boxes[i].shape[d] != global_shape[d]) {
        split.push_back(d);
        break;
      }
    }
  }
  std::optional<Overlap> overlap;
  if (split.empty()) {
    if (nonempty.size() >= 2) overlap = Overlap{nonempty[0], nonempty[1]};
  } else if (split.size() == 1) {
    overlap = overlap_1d(boxes, nonempty, split[0]);
  } else {
    overlap = overlap_sweep(boxes, nonempty, split[0],
                            split.size() == 2 ? split[1] : static_cast<std::size_t>(-1));
  }
  if (overlap) {
    return TilingProblem{TilingProblem::Kind::kOverlap, std::min(overlap->first, overlap->second),
                         std::max(overlap->first, overlap->second), 0, total};
  }
  // Disjoint boxes inside the shape: their volumes add up to at most `total` (no overflow).
  std::uint64_t covered = 0;
  for (std::size_t i : nonempty) covered += boxes[i].volume();
  if (covered != total) return TilingProblem{TilingProblem::Kind::kGap, 0, 0, covered, total};
  return std::nullopt;
}

}  // namespace mixprec::checkpoint
