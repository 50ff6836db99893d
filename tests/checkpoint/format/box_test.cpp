#include "mixprec/checkpoint/format/box.h"

#include <gtest/gtest.h>

namespace mixprec::checkpoint {
namespace {

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

}  // namespace
}  // namespace mixprec::checkpoint
