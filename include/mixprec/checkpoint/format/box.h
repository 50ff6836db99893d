// Boxes in a tensor's index space: how a chunk of a sharded tensor sits in the global tensor.
//
// A box is a global offset and a local shape, one entry per dimension ("offset [0, 128],
// shape [64, 128]" is rows 0..63, columns 128..255). A rank-0 box (both empty) is the single
// element of a scalar. The manifest stores one box per chunk; the resharding loader
// intersects the boxes it needs with the boxes on disk.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace mixprec::checkpoint {

struct Box {
  std::vector<std::int64_t> offset;  // first global index per dim, ≥ 0
  std::vector<std::int64_t> shape;   // extent per dim, ≥ 0; same length as offset

  std::size_t rank() const { return shape.size(); }
  // product(shape); 1 for rank 0. Requires a valid box (fits_in succeeded).
  std::uint64_t volume() const;
  // "[0, 128]+[64, 128]" — for error messages.
  std::string to_string() const;
};

// "[64, 128]" — for error messages.
std::string dims_to_string(const std::vector<std::int64_t>& dims);

// True if `box` has `global_shape`'s rank, non-negative offsets and extents, and lies inside
// it (offset + shape ≤ global per dim, computed without overflow).
bool fits_in(const Box& box, const std::vector<std::int64_t>& global_shape);

// The common part of two boxes, or nullopt if they share no element (boxes with a zero
// extent share nothing) or differ in rank. Requires offset + shape to fit in int64 per dim.
std::optional<Box> intersect(const Box& a, const Box& b);

// The boxes that elements [begin, end) of a tensor of `global_shape`, flattened in row-major
// order, decompose into: in increasing flat order, each box one contiguous run of that order,
// together exactly the range. At most 2·(rank − 1) + 1 boxes (a partial row at each level on
// the way in, one block of whole rows, a partial row at each level on the way out); one box
// for the whole tensor; none for an empty range. A rank-0 tensor has one element: [0, 1) is
// its rank-0 box. This is how a ZeRO-1 rank's piece of a parameter ([begin, end) of its flat
// elements, sharded_state_dict.h: FlatRange) is stored as manifest chunks.
// Throws FormatError unless 0 <= begin <= end <= the number of elements.
std::vector<Box> flat_range_boxes(const std::vector<std::int64_t>& global_shape, std::int64_t begin,
                                  std::int64_t end);

// How a set of boxes fails to tile a global shape exactly.
struct TilingProblem {
  enum class Kind { kOutOfBounds, kOverlap, kGap } kind;
  std::size_t first = 0;      // index of the offending box (kOutOfBounds, kOverlap)
  std::size_t second = 0;     // the other box of an overlap
  std::uint64_t covered = 0;  // elements covered (kGap)
  std::uint64_t total = 0;    // elements in the global shape (kGap)
};

// Checks that `boxes` tile `global_shape` exactly: each fits in it, no two share an element,
// and together they cover every element. Returns the first problem found, or nullopt.
// Zero-volume boxes are allowed (they cover nothing) but must still fit. Overlap and gap
// detection are exact. Cost: O(n log n) when the boxes are split along at most two
// dimensions (row, column and grid layouts: a sort, then a sweep along one split dimension
// keeping the cut boxes' extents along the other in an ordered map); along three or more, the
// sweep compares each box with every box the sweep line cuts. Never throws.
std::optional<TilingProblem> check_tiling(const std::vector<Box>& boxes,
                                          const std::vector<std::int64_t>& global_shape);

}  // namespace mixprec::checkpoint
