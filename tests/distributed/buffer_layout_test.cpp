#include "mixprec/distributed/buffer_layout.h"

#include "support/error_message.h"

#include <gtest/gtest.h>

#include <map>

namespace mixprec::distributed {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using testing::error_of;

// The upstream interleaved model's trainable parameters, in model order.
std::vector<LayoutParam> interleaved() {
  return {{"pre.weight", {8, 8}, at::kBFloat16},
          {"gate", {24}, at::kFloat},
          {"post.weight", {8, 8}, at::kBFloat16}};
}

TEST(BufferLayout, OneBufferPerDtypeInReverseModelOrder) {
  const GradLayout layout = make_grad_layout(interleaved(), 1, {1 << 20, 1});
  ASSERT_EQ(layout.buffers.size(), 2u);
  EXPECT_EQ(layout.buffers[0].dtype, at::kBFloat16);  // post.weight comes first in reverse
  EXPECT_EQ(layout.buffers[1].dtype, at::kFloat);
  const auto& bf16 = layout.buffers[0];
  ASSERT_EQ(bf16.spans.size(), 2u);
  EXPECT_EQ(layout.params[bf16.spans[0].param].fqn, "post.weight");
  EXPECT_EQ(bf16.spans[0].begin, 0);
  EXPECT_EQ(bf16.spans[0].end, 64);
  EXPECT_EQ(layout.params[bf16.spans[1].param].fqn, "pre.weight");
  EXPECT_EQ(bf16.spans[1].begin, 64);
  EXPECT_EQ(bf16.numel, 128);
  EXPECT_EQ(layout.buffers[1].numel, 24);
}

TEST(BufferLayout, BucketsCloseAtParameterBoundariesAndPadToWorldTimesAlignment) {
  std::vector<LayoutParam> params = {{"a", {5}, at::kFloat},
                                     {"b", {7}, at::kFloat},
                                     {"c", {100}, at::kFloat},
                                     {"d", {3}, at::kFloat}};
  // Reverse order d(3) c(100) | b(7) a(5): the first bucket closes after c reaches >= 10.
  const GradLayout layout = make_grad_layout(params, 3, {10, 4});
  const auto& buf = layout.buffers.at(0);
  ASSERT_EQ(buf.buckets.size(), 2u);
  EXPECT_EQ(buf.buckets[0].begin, 0);
  EXPECT_EQ(buf.buckets[0].end, 108);  // 103 rounded up to a multiple of 3 * 4
  EXPECT_EQ(buf.buckets[1].begin, 108);
  EXPECT_EQ(buf.buckets[1].end, 120);  // 12 elements: exactly 3 * 4
  EXPECT_EQ(buf.numel, 120);
  for (const auto& bucket : buf.buckets) {
    EXPECT_EQ(bucket.numel() % 12, 0);
    EXPECT_LT(bucket.numel() - (buf.spans[bucket.spans.back()].end - bucket.begin), 12);
  }
  EXPECT_EQ(layout.shard_range(0, 0, 1), (std::pair<int64_t, int64_t>{36, 72}));
  EXPECT_EQ(layout.shard_range(0, 1, 2), (std::pair<int64_t, int64_t>{116, 120}));
}

// Over all ranks the shards cover every element of every parameter exactly once, each piece
// is where the buffer says it is, and no piece crosses its rank's shard.
void expect_partition(const GradLayout& layout) {
  std::map<std::string, std::vector<int>> owners;
  for (const auto& p : layout.params) owners[p.fqn].assign(p.numel(), 0);
  for (int r = 0; r < layout.world_size; ++r) {
    for (const ParamShard& s : layout.param_shards(r)) {
      ASSERT_LT(s.begin, s.end);
      const auto [lo, hi] = layout.shard_range(s.buffer, s.bucket, r);
      EXPECT_GE(s.buffer_begin, lo);
      EXPECT_LE(s.buffer_begin + s.numel(), hi);
      const auto& span = [&]() -> const ParamSpan& {
        for (const auto& sp : layout.buffers[s.buffer].spans) {
          if (sp.param == s.param) return sp;
        }
        throw std::runtime_error("no span");
      }();
      EXPECT_EQ(span.begin + s.begin, s.buffer_begin);
      EXPECT_EQ(s.global_shape, layout.params[s.param].shape);
      for (int64_t e = s.begin; e < s.end; ++e) ++owners[s.fqn][e];
    }
  }
  for (const auto& [fqn, counts] : owners) {
    for (size_t e = 0; e < counts.size(); ++e) {
      ASSERT_EQ(counts[e], 1) << fqn << " element " << e;
    }
  }
}

TEST(BufferLayout, ShardsPartitionEveryParameterForEveryWorldSize) {
  for (int world = 1; world <= 5; ++world) {
    for (int64_t bucket : {1, 10, 50, 1 << 20}) {
      for (int64_t align : {1, 4, 16}) {
        SCOPED_TRACE("world " + std::to_string(world) + " bucket " + std::to_string(bucket) +
                     " align " + std::to_string(align));
        std::vector<LayoutParam> params = interleaved();
        params.push_back({"empty", {0, 3}, at::kBFloat16});
        params.push_back({"big", {7, 13}, at::kHalf});
        expect_partition(make_grad_layout(params, world, {bucket, align}));
      }
    }
  }
}

TEST(BufferLayout, InterleavedOnThreeRanksSplitsParametersByFlatRange) {
  const GradLayout layout = make_grad_layout(interleaved(), 3, {1 << 20, 1});
  // BF16 buffer: post.weight [0, 64), pre.weight [64, 128); 128 elements pad to 129, 43 each.
  const auto r1 = layout.param_shards(1);
  ASSERT_EQ(r1.size(), 3u);
  EXPECT_EQ(r1[0].fqn, "post.weight");
  EXPECT_EQ(r1[0].begin, 43);
  EXPECT_EQ(r1[0].end, 64);
  EXPECT_EQ(r1[0].global_shape, (std::vector<int64_t>{8, 8}));
  EXPECT_EQ(r1[1].fqn, "pre.weight");
  EXPECT_EQ(r1[1].begin, 0);
  EXPECT_EQ(r1[1].end, 22);
  EXPECT_EQ(r1[1].buffer_begin, 64);
  EXPECT_EQ(r1[2].fqn, "gate");  // FP32 buffer: 24 elements, 8 per rank
  EXPECT_EQ(r1[2].begin, 8);
  EXPECT_EQ(r1[2].end, 16);
  const std::string table = layout.describe();
  EXPECT_NE(table.find("rank 1 [43, 86): post.weight[43:64] pre.weight[0:22]"), std::string::npos)
      << table;
  EXPECT_NE(table.find("rank 2 [86, 129): pre.weight[22:64]"), std::string::npos) << table;
}

TEST(BufferLayout, LaunchOrderFollowsReverseModelOrderAcrossBuffers) {
  std::vector<LayoutParam> params = {{"a", {4}, at::kBFloat16},
                                     {"b", {4}, at::kFloat},
                                     {"c", {4}, at::kBFloat16},
                                     {"d", {4}, at::kFloat}};
  const GradLayout layout = make_grad_layout(params, 2, {4, 1});
  // Reverse: d (fp32 bucket 0), c (bf16 bucket 0), b (fp32 bucket 1), a (bf16 bucket 1).
  using P = std::pair<size_t, size_t>;
  ASSERT_EQ(layout.bucket_order.size(), 4u);
  EXPECT_EQ(layout.buffers[0].dtype, at::kFloat);
  EXPECT_EQ(layout.bucket_order, (std::vector<P>{{0, 0}, {1, 0}, {0, 1}, {1, 1}}));
}

TEST(BufferLayout, BadInputNamesTheParameter) {
  EXPECT_NE(error_of([] {
              make_grad_layout({{"ids", {3}, at::kLong}}, 1);
            }).find("'ids'"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              make_grad_layout({{"w", {3}, at::kFloat}, {"w", {2}, at::kFloat}}, 1);
            }).find("'w' appears twice"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              make_grad_layout({{"w", {-1}, at::kFloat}}, 1);
            }).find("'w'"),
            std::string::npos);
  EXPECT_NE(error_of([] { make_grad_layout({}, 0); }).find("world_size"), std::string::npos);
  EXPECT_NE(error_of([] {
              make_grad_layout({}, 2, {0, 1});
            }).find("bucket_numel"),
            std::string::npos);
}

// shard_range() refuses what the layout does not have, naming it: a rank outside the world, a
// bucket or buffer that does not exist (param_shards and describe only ask for valid ones).
TEST(BufferLayout, ShardRangeRefusesARankOutsideTheWorldAndAMissingBucket) {
  const GradLayout layout = make_grad_layout(interleaved(), 2, {1 << 20, 1});
  EXPECT_NE(error_of([&] { layout.shard_range(0, 0, 2); }).find("rank 2 is not in [0, 2)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { layout.shard_range(0, 0, -1); }).find("rank -1 is not in [0, 2)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { layout.shard_range(0, 1, 0); }).find("no bucket 1 in buffer 0"),
            std::string::npos);
  EXPECT_NE(error_of([&] { layout.shard_range(2, 0, 0); }).find("no bucket 0 in buffer 2"),
            std::string::npos);
}

// describe() marks a rank whose shard of a bucket holds nothing but padding.
TEST(BufferLayout, DescribeMarksAShardOfPaddingOnly) {
  const GradLayout layout = make_grad_layout({{"w", {1}, at::kFloat}}, 2, {1 << 20, 1});
  const std::string table = layout.describe();
  EXPECT_NE(table.find("rank 0 [0, 1): w[0:1]\n"), std::string::npos) << table;
  EXPECT_NE(table.find("rank 1 [1, 2): (padding only)\n"), std::string::npos) << table;
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::distributed
