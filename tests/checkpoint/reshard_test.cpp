// Resharding: a checkpoint written by N simulated data-parallel ranks loads onto M ranks.
#include "mixprec/checkpoint/reshard.h"

#include "mixprec/checkpoint/format/manifest.h"
#include "mixprec/checkpoint/save.h"

#include <ATen/ATen.h>
#include "checkpoint/format/format_test_util.h"

#include <gtest/gtest.h>

#include <filesystem>

namespace mixprec::checkpoint {
namespace {

namespace fs = std::filesystem;

// A scratch checkpoint root, removed at scope exit.
struct TempRoot {
  testing::TempDir dir;
  const fs::path& path = dir.path();
};

// A state with uneven first dimensions, several dtypes, a 2-D and a 3-D tensor, and a scalar.
ShardedStateDict whole_state() {
  ShardedStateDict s;
  auto add = [&](const std::string& key, at::Tensor t) { s.tensors.emplace(key, ShardedTensor::whole(t)); };
  at::manual_seed(7);
  add("w", at::randn({7, 5}));
  add("optimizer.state.exp_avg.w", at::randn({7, 5}));
  add("emb", at::randn({11, 3, 4}).to(at::kBFloat16));
  add("bias", at::randn({13}).to(at::kHalf));
  add("ids", at::arange(10, at::kLong));
  add("tiny", at::randn({2}));  // fewer rows than ranks
  add("scale", at::scalar_tensor(3.5));
  s.common["step"] = 4;
  return s;
}

TEST(DpSlice, EvenAndUnevenSplits) {
  EXPECT_EQ(dp_slice({10, 2}, 0, 3).shape, (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(dp_slice({10, 2}, 1, 3).offset, (std::vector<int64_t>{4, 0}));
  EXPECT_EQ(dp_slice({10, 2}, 2, 3).shape, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(dp_slice({2}, 2, 3).shape, (std::vector<int64_t>{0}));
  EXPECT_TRUE(dp_slice({}, 1, 2).shape.empty());
  EXPECT_THROW(dp_slice({4}, 3, 3), c10::Error);
}

class ReshardTest : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(ReshardTest, SavedOnNLoadsOnM) {
  const auto [n, m] = GetParam();
  TempRoot root;
  const ShardedStateDict whole = whole_state();
  std::vector<ShardedStateDict> ranks;
  for (int r = 0; r < n; ++r) ranks.push_back(shard_for_rank(whole, r, n));
  std::vector<const ShardedStateDict*> pointers;
  for (const auto& r : ranks) pointers.push_back(&r);
  const SaveResult saved = save_checkpoint(root.path, "ckpt", pointers);

  // Every byte was written exactly once: replicas of the scalar were deduplicated.
  uint64_t expected_bytes = 0;
  for (const auto& [key, t] : whole.tensors) expected_bytes += t.local.nbytes();
  EXPECT_EQ(saved.tensor_bytes, expected_bytes);
  const Manifest manifest = read_manifest(saved.dir);
  EXPECT_EQ(manifest.keys.at("scale").chunks.size(), 1u);
  EXPECT_EQ(manifest.keys.at("w").chunks.size(), static_cast<size_t>(n));

  for (const auto& [key, t] : whole.tensors) {
    std::vector<at::Tensor> parts;
    for (int r = 0; r < m; ++r) {
      ReadOptions options = read_options_for_rank(r, m);
      options.keys = {key};
      const ShardedStateDict local = read_checkpoint(saved.dir, options);
      const ShardedTensor& part = local.at(key);
      const Box want = dp_slice(t.global_shape, r, m);
      EXPECT_EQ(part.local.sizes().vec(), want.shape) << key << " rank " << r;
      EXPECT_EQ(part.global_offset, want.offset) << key << " rank " << r;
      EXPECT_EQ(local.common["step"], 4);
      if (t.global_shape.empty()) {
        EXPECT_TRUE(at::equal(part.local, t.local)) << key;
      } else {
        parts.push_back(part.local);
      }
    }
    if (!parts.empty()) {
      EXPECT_TRUE(at::equal(at::cat(parts, 0), t.local)) << key << " N=" << n << " M=" << m;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Pairs, ReshardTest,
                         ::testing::Values(std::pair{1, 1}, std::pair{1, 3}, std::pair{2, 3},
                                           std::pair{3, 2}, std::pair{4, 1}, std::pair{3, 5},
                                           std::pair{5, 4}),
                         [](const auto& info) {
                           return "N" + std::to_string(info.param.first) + "toM" +
                                  std::to_string(info.param.second);
                         });

// A slice crossing chunk boundaries in a middle dimension reads strided runs correctly.
TEST(Reshard, ArbitraryBoxesAcrossChunks) {
  TempRoot root;
  const ShardedStateDict whole = whole_state();
  std::vector<ShardedStateDict> ranks = {shard_for_rank(whole, 0, 3), shard_for_rank(whole, 1, 3),
                                         shard_for_rank(whole, 2, 3)};
  const SaveResult saved = save_checkpoint(root.path, "c", {&ranks[0], &ranks[1], &ranks[2]});
  ReadOptions options;
  options.keys = {"emb"};
  options.slice = [](const std::string&, const std::vector<int64_t>&) {
    return std::optional<Box>(Box{{2, 1, 1}, {6, 2, 3}});
  };
  const at::Tensor got = read_checkpoint(saved.dir, options).at("emb").local;
  const at::Tensor want = whole.at("emb").local.narrow(0, 2, 6).narrow(1, 1, 2).narrow(2, 1, 3);
  EXPECT_TRUE(at::equal(got, want));
  options.slice = [](const std::string&, const std::vector<int64_t>&) {
    return std::optional<Box>(Box{{0, 0, 0}, {12, 3, 4}});
  };
  EXPECT_THROW(read_checkpoint(saved.dir, options), c10::Error);
}

TEST(Reshard, ShardsWrittenTwiceAreRefused) {
  TempRoot root;
  const ShardedStateDict whole = whole_state();
  ShardedStateDict a = shard_for_rank(whole, 0, 2), b = shard_for_rank(whole, 0, 2);
  try {
    save_checkpoint(root.path, "dup", {&a, &b});
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("shards of ranks 0 and 1 overlap"), std::string::npos) << msg;
  }
  EXPECT_FALSE(fs::exists(root.path / "dup"));
  ShardedStateDict only_first = shard_for_rank(whole, 0, 2);
  try {
    save_checkpoint(root.path, "gap", {&only_first});
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("replica-0 shards cover"), std::string::npos);
  }
}

}  // namespace
}  // namespace mixprec::checkpoint
