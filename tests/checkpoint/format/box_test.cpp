#include "mixprec/checkpoint/format/box.h"

#include "mixprec/checkpoint/format/error.h"

#include <gtest/gtest.h>

#include <random>

namespace mixprec::checkpoint {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using Kind = TilingProblem::Kind;

TEST(Box, VolumeIntersectAndPrinting) {
  Box a{{0, 2}, {4, 3}};
  EXPECT_EQ(a.volume(), 12u);
  EXPECT_EQ(a.to_string(), "[0, 2]+[4, 3]");
  auto i = intersect(a, Box{{3, 0}, {5, 4}});
  ASSERT_TRUE(i.has_value());
  EXPECT_EQ(i->offset, (std::vector<std::int64_t>{3, 2}));
  EXPECT_EQ(i->shape, (std::vector<std::int64_t>{1, 2}));
  EXPECT_FALSE(intersect(a, Box{{4, 0}, {1, 9}}).has_value());  // touching is not sharing
  EXPECT_FALSE(intersect(a, Box{{1, 2}, {0, 1}}).has_value());  // empty shares nothing
  EXPECT_FALSE(intersect(a, Box{{0}, {1}}).has_value());        // rank mismatch
  EXPECT_EQ(Box{}.volume(), 1u);                                // a scalar's single element
}

TEST(Box, FitsInRejectsRankMismatchNegativesAndOverflow) {
  EXPECT_TRUE(fits_in(Box{{2, 0}, {2, 5}}, {4, 5}));
  EXPECT_FALSE(fits_in(Box{{3, 0}, {2, 5}}, {4, 5}));
  EXPECT_FALSE(fits_in(Box{{0}, {4}}, {4, 5}));
  EXPECT_FALSE(fits_in(Box{{-1, 0}, {1, 5}}, {4, 5}));
  EXPECT_FALSE(fits_in(Box{{1, 0}, {INT64_MAX, 5}}, {4, 5}));
  EXPECT_TRUE(fits_in(Box{{}, {}}, {}));
}

TEST(Tiling, AcceptsRowColumnAndGridSplits) {
  EXPECT_FALSE(check_tiling({{{0, 0}, {2, 6}}, {{2, 0}, {2, 6}}}, {4, 6}));
  EXPECT_FALSE(check_tiling({{{0, 3}, {4, 3}}, {{0, 0}, {4, 3}}}, {4, 6}));
  std::vector<Box> grid;
  for (std::int64_t r = 0; r < 4; r += 2)
    for (std::int64_t c = 0; c < 6; c += 3) grid.push_back({{r, c}, {2, 3}});
  EXPECT_FALSE(check_tiling(grid, {4, 6}));
  EXPECT_FALSE(check_tiling({{{}, {}}}, {}));                 // scalar
  EXPECT_FALSE(check_tiling({}, {0, 5}));                     // empty tensor, no chunks
  EXPECT_FALSE(check_tiling({{{0, 0}, {0, 5}}}, {0, 5}));     // empty tensor, empty chunk
  EXPECT_FALSE(check_tiling({{{0}, {4}}, {{4}, {0}}}, {4}));  // an empty chunk at the end
}

TEST(Tiling, ReportsGapOverlapAndOutOfBounds) {
  auto gap = check_tiling({{{0, 0}, {2, 6}}, {{3, 0}, {1, 6}}}, {4, 6});
  ASSERT_TRUE(gap);
  EXPECT_EQ(gap->kind, Kind::kGap);
  EXPECT_EQ(gap->covered, 18u);
  EXPECT_EQ(gap->total, 24u);

  // Same total volume as the shape, but two boxes overlap and leave a hole elsewhere.
  auto overlap = check_tiling({{{0, 0}, {2, 6}}, {{1, 0}, {2, 6}}}, {4, 6});
  ASSERT_TRUE(overlap);
  EXPECT_EQ(overlap->kind, Kind::kOverlap);
  EXPECT_EQ(overlap->first, 0u);
  EXPECT_EQ(overlap->second, 1u);

  auto dup_scalar = check_tiling({{{}, {}}, {{}, {}}}, {});
  ASSERT_TRUE(dup_scalar);
  EXPECT_EQ(dup_scalar->kind, Kind::kOverlap);

  auto out = check_tiling({{{0, 0}, {2, 6}}, {{2, 0}, {3, 6}}}, {4, 6});
  ASSERT_TRUE(out);
  EXPECT_EQ(out->kind, Kind::kOutOfBounds);
  EXPECT_EQ(out->first, 1u);
}

TEST(Tiling, OverlapFoundWhenSweepDimensionDoesNotSeparate) {
  // Column split (sweep picks dim 1) with one box overlapping across the sweep boundary.
  std::vector<Box> boxes;
  for (std::int64_t c = 0; c < 8; ++c) boxes.push_back({{0, c}, {4, 1}});
  boxes[3] = {{0, 3}, {4, 2}};  // covers column 4 too...
  boxes[7] = {{0, 7}, {4, 0}};  // ...and column 7 is left empty: total volume is still 32
  auto problem = check_tiling(boxes, {4, 8});
  ASSERT_TRUE(problem);
  EXPECT_EQ(problem->kind, Kind::kOverlap);
  EXPECT_EQ(problem->first, 3u);
  EXPECT_EQ(problem->second, 4u);
}

// A rows × cols grid of 2 × 3 boxes over [2 rows, 3 cols]: the layout of tensor- and
// data-parallel shards together. The old check compared each box with every box of its row
// (quadratic in the row length); now a sweep keeps rows' column extents in an ordered map.
std::vector<Box> grid_boxes(std::int64_t rows, std::int64_t cols) {
  std::vector<Box> grid;
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) grid.push_back({{2 * r, 3 * c}, {2, 3}});
  }
  return grid;
}

TEST(Tiling, LargeGridsAreCheckedExactly) {
  const std::int64_t n = 400;  // 160,000 boxes
  const std::vector<std::int64_t> shape{2 * n, 3 * n};
  std::vector<Box> grid = grid_boxes(n, n);
  EXPECT_FALSE(check_tiling(grid, shape));

  // One box of the last row grows a column into its right neighbour's.
  std::vector<Box> overlapping = grid;
  const std::size_t grown = static_cast<std::size_t>(n * n - 2);
  overlapping[grown].shape[1] = 4;
  auto overlap = check_tiling(overlapping, shape);
  ASSERT_TRUE(overlap);
  EXPECT_EQ(overlap->kind, Kind::kOverlap);
  EXPECT_EQ(overlap->first, grown);
  EXPECT_EQ(overlap->second, grown + 1);

  // One box in the middle missing.
  std::vector<Box> holed = grid;
  holed.erase(holed.begin() + n * n / 2 + 7);
  auto gap = check_tiling(holed, shape);
  ASSERT_TRUE(gap);
  EXPECT_EQ(gap->kind, Kind::kGap);
  EXPECT_EQ(gap->covered, static_cast<std::uint64_t>(6 * n * n - 6));
  EXPECT_EQ(gap->total, static_cast<std::uint64_t>(6 * n * n));

  // Rows shifted against each other (a brick wall) still tile; one brick too long does not.
  std::vector<Box> wall;
  for (std::int64_t r = 0; r < 50; ++r) {
    const std::int64_t shift = r % 2;
    if (shift) wall.push_back({{r, 0}, {1, 1}});
    for (std::int64_t c = shift; c + 2 <= 100; c += 2) wall.push_back({{r, c}, {1, 2}});
    if (shift) wall.push_back({{r, 99}, {1, 1}});
  }
  EXPECT_FALSE(check_tiling(wall, {50, 100}));
  wall[60].shape[1] = 3;
  auto brick = check_tiling(wall, {50, 100});
  ASSERT_TRUE(brick);
  EXPECT_EQ(brick->kind, Kind::kOverlap);
  EXPECT_EQ(brick->first, 60u);
  EXPECT_EQ(brick->second, 61u);
}

// The quadratic definition, for cross-checking.
bool any_overlap_brute_force(const std::vector<Box>& boxes) {
  for (std::size_t i = 0; i < boxes.size(); ++i) {
    for (std::size_t j = i + 1; j < boxes.size(); ++j) {
      if (intersect(boxes[i], boxes[j])) return true;
    }
  }
  return false;
}

// Random boxes in 1, 2 and 3 split dimensions (the three code paths): the kind found agrees
// with the brute-force definition, and a reported pair really overlaps.
TEST(Tiling, AgreesWithBruteForceOnRandomLayouts) {
  std::mt19937 rng(7);
  for (std::size_t rank = 1; rank <= 4; ++rank) {
    for (int trial = 0; trial < 400; ++trial) {
      std::vector<std::int64_t> shape(rank);
      for (auto& d : shape) d = 1 + static_cast<std::int64_t>(rng() % 4);
      std::vector<Box> boxes(1 + rng() % 6);
      for (Box& b : boxes) {
        for (std::size_t d = 0; d < rank; ++d) {
          const std::int64_t lo =
              static_cast<std::int64_t>(rng() % static_cast<unsigned>(shape[d]));
          b.offset.push_back(lo);
          b.shape.push_back(
              static_cast<std::int64_t>(rng() % static_cast<unsigned>(shape[d] - lo + 1)));
        }
      }
      std::uint64_t total = 1, covered = 0;
      for (auto d : shape) total *= static_cast<std::uint64_t>(d);
      for (const Box& b : boxes) covered += b.volume();
      const bool overlaps = any_overlap_brute_force(boxes);
      auto problem = check_tiling(boxes, shape);
      if (overlaps) {
        ASSERT_TRUE(problem);
        ASSERT_EQ(problem->kind, Kind::kOverlap);
        EXPECT_LT(problem->first, problem->second);
        EXPECT_TRUE(intersect(boxes[problem->first], boxes[problem->second]));
      } else if (covered != total) {
        ASSERT_TRUE(problem);
        EXPECT_EQ(problem->kind, Kind::kGap);
        EXPECT_EQ(problem->covered, covered);
      } else {
        EXPECT_FALSE(problem);
      }
    }
  }
}

// Flat ranges: every [begin, end) of every small shape decomposes into boxes that are, in
// order, consecutive runs of the row-major order covering exactly the range, at most
// 2·(rank − 1) + 1 of them.
std::int64_t flat_index(const std::vector<std::int64_t>& shape,
                        const std::vector<std::int64_t>& index) {
  std::int64_t flat = 0;
  for (std::size_t d = 0; d < shape.size(); ++d) flat = flat * shape[d] + index[d];
  return flat;
}

// The flat indices of a box's elements in its own row-major order.
std::vector<std::int64_t> box_elements(const std::vector<std::int64_t>& shape, const Box& box) {
  std::vector<std::int64_t> out;
  std::vector<std::int64_t> index(box.rank(), 0);
  for (std::uint64_t n = 0; n < box.volume(); ++n) {
    std::vector<std::int64_t> global(box.rank());
    for (std::size_t d = 0; d < box.rank(); ++d) global[d] = box.offset[d] + index[d];
    out.push_back(flat_index(shape, global));
    for (std::size_t d = box.rank(); d-- > 0;) {
      if (++index[d] < box.shape[d]) break;
      index[d] = 0;
    }
  }
  return out;
}

TEST(FlatRange, DecomposesEveryRangeOfSmallShapesIntoFewConsecutiveBoxes) {
  const std::vector<std::vector<std::int64_t>> shapes = {
      {7}, {3, 5}, {4, 1, 3}, {2, 3, 4}, {3, 2, 2, 3}, {1, 1, 5}, {5, 1}};
  for (const auto& shape : shapes) {
    std::int64_t numel = 1;
    for (std::int64_t d : shape) numel *= d;
    const std::size_t bound = 2 * (shape.size() - 1) + 1;
    for (std::int64_t begin = 0; begin <= numel; ++begin) {
      for (std::int64_t end = begin; end <= numel; ++end) {
        SCOPED_TRACE(dims_to_string(shape) + " [" + std::to_string(begin) + ", " +
                     std::to_string(end) + ")");
        const std::vector<Box> boxes = flat_range_boxes(shape, begin, end);
        EXPECT_LE(boxes.size(), bound);
        std::int64_t next = begin;
        for (const Box& box : boxes) {
          ASSERT_TRUE(fits_in(box, shape)) << box.to_string();
          EXPECT_GT(box.volume(), 0u);
          for (std::int64_t flat : box_elements(shape, box)) EXPECT_EQ(flat, next++);
        }
        EXPECT_EQ(next, end);
      }
    }
    EXPECT_EQ(flat_range_boxes(shape, 0, numel).size(), 1u) << "the whole tensor is one box";
  }
}

TEST(FlatRange, ScalarsEmptyRangesAndBadRanges) {
  const std::vector<Box> scalar = flat_range_boxes({}, 0, 1);
  ASSERT_EQ(scalar.size(), 1u);
  EXPECT_EQ(scalar[0].rank(), 0u);
  EXPECT_TRUE(flat_range_boxes({}, 1, 1).empty());
  EXPECT_TRUE(flat_range_boxes({0, 4}, 0, 0).empty());
  EXPECT_TRUE(flat_range_boxes({3, 4}, 5, 5).empty());
  EXPECT_THROW(flat_range_boxes({3, 4}, 5, 13), FormatError);
  EXPECT_THROW(flat_range_boxes({3, 4}, 6, 5), FormatError);
  EXPECT_THROW(flat_range_boxes({3, 4}, -1, 5), FormatError);
  // The worst case of a rank-4 tensor: 3 partial levels in, one block, 3 partial levels out.
  EXPECT_EQ(flat_range_boxes({4, 3, 3, 3}, 1 + 3 + 9, 3 * 27 + 2 * 9 + 2 * 3 + 2).size(), 7u);
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::checkpoint
