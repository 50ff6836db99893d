// Resharding: a checkpoint written by N simulated data-parallel ranks loads onto M ranks.
#include "mixprec/checkpoint/reshard.h"

#include "mixprec/checkpoint/format/error.h"
#include "mixprec/checkpoint/format/manifest.h"
#include "mixprec/checkpoint/format/safetensors_reader.h"
#include "mixprec/checkpoint/format/verify.h"
#include "mixprec/checkpoint/save.h"

#include <ATen/ATen.h>
#include "checkpoint/format/format_test_util.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <iostream>

namespace mixprec::checkpoint {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

namespace fs = std::filesystem;

// A scratch checkpoint root, removed at scope exit.
struct TempRoot {
  testing::TempDir dir;
  const fs::path& path = dir.path();
};

// A state with uneven first dimensions, several dtypes, a 2-D and a 3-D tensor, and a scalar.
ShardedStateDict whole_state() {
  ShardedStateDict s;
  auto add = [&](const std::string& key, at::Tensor t) {
    s.tensors.emplace(key, ShardedTensor::whole(t));
  };
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

// A rank outside [0, world) is refused when the options are made, not later by the read (or
// never, by a read whose keys are all scalars and so never consult the slice).
TEST(DpSlice, ReadOptionsForRankValidatesRankAndWorldAtOnce) {
  for (const auto& [rank, world] :
       std::vector<std::pair<int64_t, int64_t>>{{2, 2}, {-1, 2}, {0, 0}}) {
    EXPECT_THROW(read_options_for_rank(rank, world), c10::Error) << rank << " of " << world;
  }
  EXPECT_NO_THROW(read_options_for_rank(1, 2));
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

// Shards split along a trailing dimension (tensor-parallel columns): each chunk's rows are not
// contiguous in the result, so a chunk's rows must not be copied as one run.
TEST(Reshard, ColumnShardsReadBackWholeAndAsRowSlices) {
  TempRoot root;
  at::manual_seed(3);
  const at::Tensor t = at::randn({4, 6});
  std::vector<ShardedStateDict> ranks(2);
  for (int r = 0; r < 2; ++r) {
    ShardedTensor shard;
    shard.local = t.narrow(1, 3 * r, 3).contiguous();
    shard.global_shape = {4, 6};
    shard.global_offset = {0, 3 * r};
    ranks[r].tensors.emplace("w", std::move(shard));
  }
  const SaveResult saved = save_checkpoint(root.path, "c", {&ranks[0], &ranks[1]});
  EXPECT_EQ(read_manifest(saved.dir).keys.at("w").chunks.size(), 2u);
  EXPECT_TRUE(at::equal(read_checkpoint(saved.dir).at("w").local, t));
  for (int r = 0; r < 2; ++r) {
    const at::Tensor rows = read_checkpoint(saved.dir, read_options_for_rank(r, 2)).at("w").local;
    EXPECT_TRUE(at::equal(rows, t.narrow(0, 2 * r, 2))) << "rank " << r;
  }
}

// A rank's slice is a view of the whole tensor and carries its version: a step that changes
// the tensor after the state dict was built is caught when the slices are saved.
TEST(Reshard, ASliceOfATensorChangedSinceIsRefusedBySave) {
  TempRoot root;
  at::Tensor w = at::randn({4, 3});
  ShardedStateDict whole;
  whole.tensors.emplace("w", ShardedTensor::whole(w));
  const ShardedStateDict rank0 = shard_for_rank(whole, 0, 2);
  w.add_(1);  // e.g. an optimizer step between building the dict and saving it
  try {
    save_checkpoint(root.path, "c", rank0);
    FAIL() << "expected the changed tensor to be refused";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("changed"), std::string::npos) << e.what();
  }
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
    EXPECT_NE(std::string(e.what_without_backtrace()).find("replica-0 shards cover"),
              std::string::npos);
  }
}

// --- every byte a resharded load uses is verified ---------------------------------------------

// "w" F32 [3000, 64] saved by 3 ranks: three chunks of 1000 rows (256,000 bytes each), one per
// data file, with checksum blocks of `block_bytes` (0: whole chunks only, manifest version 1).
// A 2-rank load then needs chunk 1 only in part: rank 0 its first 500 rows (bytes
// [0, 128000)), rank 1 its last 500 (bytes [128000, 256000)).
struct ThreeRankSave {
  TempRoot root;
  at::Tensor w = at::randn({3000, 64});
  fs::path dir;

  explicit ThreeRankSave(uint64_t block_bytes) {
    ShardedStateDict whole;
    whole.tensors.emplace("w", ShardedTensor::whole(w));
    std::vector<ShardedStateDict> ranks;
    for (int r = 0; r < 3; ++r) ranks.push_back(shard_for_rank(whole, r, 3));
    SaveOptions options;
    options.checksum_block_bytes(block_bytes);
    dir = save_checkpoint(root.path, "c", {&ranks[0], &ranks[1], &ranks[2]}, options).dir;
  }

  // Flips one byte of rank `file_rank`'s chunk of "w", `offset` bytes into the chunk.
  void flip(int file_rank, uint64_t offset) const {
    const fs::path file = dir / ("data-0000" + std::to_string(file_rank) + ".safetensors");
    const SafetensorsHeader h = SafetensorsReader(file).header();
    std::string bytes = testing::read_file(file);
    bytes[h.data_offset() + h.find("w")->begin + offset] ^= 0x40;
    testing::write_file(file, bytes);
  }

  ShardedStateDict load(int rank, ReadStats* stats = nullptr) const {
    ReadOptions options = read_options_for_rank(rank, 2);
    options.stats = stats;
    return read_checkpoint(dir, options);
  }
};

std::string checksum_error(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const ChecksumError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a ChecksumError";
  return {};
}

TEST(ReshardChecksums, CorruptByteInThePartARankReadsIsCaught) {
  for (uint64_t block : {uint64_t{4096}, uint64_t{0}}) {
    ThreeRankSave save(block);
    save.flip(1, 100000);  // row 1390: in rank 0's part of chunk 1 (rows 1000..1499)
    const std::string msg = checksum_error([&] { save.load(0); });
    EXPECT_NE(msg.find("data-00001.safetensors"), std::string::npos) << msg;
    EXPECT_NE(msg.find("tensor 'w'"), std::string::npos) << msg;
    if (block > 0) {
      EXPECT_NE(msg.find("block 24 (bytes [98304, 102400) of 256000)"), std::string::npos) << msg;
    }
  }
}

// A corrupt byte a rank does not read is not read: with block checksums it goes unnoticed by
// that rank (whose result holds only verified bytes) and is caught by the rank that reads it
// and by verify_checkpoint; with whole-chunk checksums every rank touching the chunk reads
// and rejects it.
TEST(ReshardChecksums, CorruptByteOutsideTheReadPartIsLeftToItsReaderAndVerify) {
  {
    ThreeRankSave save(4096);
    save.flip(1, 200000);  // row 1781: rank 1's part of chunk 1, 14 blocks past rank 0's
    const ShardedStateDict rank0 = save.load(0);
    EXPECT_TRUE(at::equal(rank0.at("w").local, save.w.narrow(0, 0, 1500)));
    EXPECT_NE(checksum_error([&] { save.load(1); }).find("data-00001.safetensors"),
              std::string::npos);
    EXPECT_THROW(verify_checkpoint(save.dir), ChecksumError);
  }
  {
    ThreeRankSave save(0);
    save.flip(1, 200000);
    EXPECT_NE(checksum_error([&] { save.load(0); }).find("data-00001.safetensors"),
              std::string::npos);
  }
}

// Bytes read by a 3 → 2 reshard of "w" (768,000 bytes), both ranks together. Printed for the
// record; the assertions pin the exact amount each strategy must read.
TEST(ReshardChecksums, BytesReadBy3To2Reshard) {
  const uint64_t chunk = 256000, used = 3 * chunk;
  for (uint64_t block : {uint64_t{0}, uint64_t{4096}, uint64_t{65536}}) {
    ThreeRankSave save(block);
    uint64_t read = 0;
    for (int r = 0; r < 2; ++r) {
      ReadStats stats;
      const ShardedStateDict local = save.load(r, &stats);
      EXPECT_TRUE(at::equal(local.at("w").local, save.w.narrow(0, 1500 * r, 1500)));
      EXPECT_EQ(stats.bytes_used, used / 2);
      read += stats.bytes_read;
    }
    // Whole chunks: each rank reads two. Blocks: rank 0 reads chunk 1's bytes [0, 128000)
    // rounded up to a block boundary, rank 1 [128000, 256000) rounded down.
    auto round_up = [&](uint64_t x) { return std::min(chunk, (x + block - 1) / block * block); };
    const uint64_t expected =
        block == 0 ? 4 * chunk : 2 * chunk + round_up(128000) + (chunk - 128000 / block * block);
    EXPECT_EQ(read, expected) << "block " << block;
    std::cout << "3->2 reshard, "
              << (block ? std::to_string(block) + "-byte blocks"
                        : std::string("whole-chunk checksums"))
              << ": used " << used << " bytes, read " << read << " (+"
              << 100.0 * static_cast<double>(read - used) / static_cast<double>(used) << "%)\n";
  }
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::checkpoint
