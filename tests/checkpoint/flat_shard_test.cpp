// Flat slices (ZeRO-1's shards: elements [begin, end) of a tensor's row-major flattening):
// saved by simulated ranks as the boxes their ranges decompose into, read back whole, as box
// slices, and as other flat ranges, reading only what each range needs.
#include "mixprec/checkpoint/format/error.h"
#include "mixprec/checkpoint/format/manifest.h"
#include "mixprec/checkpoint/format/safetensors_reader.h"
#include "mixprec/checkpoint/format/verify.h"
#include "mixprec/checkpoint/load.h"
#include "mixprec/checkpoint/reshard.h"
#include "mixprec/checkpoint/save.h"

#include "checkpoint/format/format_test_util.h"
#include "support/error_message.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace mixprec::checkpoint {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

namespace fs = std::filesystem;
using mixprec::testing::error_of;

// Elements [n·r/N, n·(r+1)/N) of each tensor for rank r of N: boundaries fall inside rows.
std::vector<ShardedStateDict> flat_ranks(const std::map<std::string, at::Tensor>& whole, int n) {
  std::vector<ShardedStateDict> ranks(n);
  for (int r = 0; r < n; ++r) {
    for (const auto& [key, t] : whole) {
      const int64_t numel = t.numel(), begin = numel * r / n, end = numel * (r + 1) / n;
      ranks[r].tensors.emplace(
          key, ShardedTensor::flat(t.reshape({-1}).narrow(0, begin, end - begin), t.sizes().vec(),
                                   begin));
    }
    ranks[r].common["step"] = 3;
  }
  return ranks;
}

std::map<std::string, at::Tensor> tensors() {
  at::manual_seed(11);
  return {{"w", at::randn({7, 5, 3})},
          {"b", at::randn({13}).to(at::kBFloat16)},
          {"m", at::randn({6, 9})},
          {"s", at::scalar_tensor(2.5)}};
}

SaveResult save_ranks(const fs::path& root, const std::vector<ShardedStateDict>& ranks,
                      SaveOptions options = {}) {
  std::vector<const ShardedStateDict*> pointers;
  for (const auto& r : ranks) pointers.push_back(&r);
  return save_checkpoint(root, "ckpt", pointers, options);
}

TEST(FlatShard, FlatAndElementsViews) {
  const at::Tensor t = at::arange(12, at::kFloat).view({3, 4});
  const ShardedTensor piece = ShardedTensor::flat(t.view({-1}).narrow(0, 5, 4), {3, 4}, 5);
  ASSERT_TRUE(piece.flat_range.has_value());
  EXPECT_EQ(*piece.flat_range, (FlatRange{5, 9}));
  EXPECT_FALSE(piece.is_whole());
  EXPECT_TRUE(at::equal(piece.flat_elements(6, 8), at::tensor({6.f, 7.f})));
  EXPECT_NE(error_of([&] { piece.flat_elements(4, 8); }).find("holds elements [5, 9)"),
            std::string::npos);
  const ShardedTensor whole = ShardedTensor::whole(t);
  EXPECT_TRUE(at::equal(whole.flat_elements(2, 5), at::tensor({2.f, 3.f, 4.f})));
  EXPECT_THROW(ShardedTensor::flat(t.view({-1}), {3, 3}, 0), c10::Error);  // 12 > 9 elements
  // A flat slice of a 1-D tensor covering it is the whole tensor.
  EXPECT_TRUE(ShardedTensor::flat(at::ones({4}), {4}, 0).is_whole());
}

TEST(FlatShard, SavedByRanksReadsBackWholeAndAsSlicesBitwise) {
  const auto whole = tensors();
  for (int n : {1, 2, 3, 4}) {
    SCOPED_TRACE("ranks " + std::to_string(n));
    testing::TempDir root;
    const SaveResult saved = save_ranks(root.path(), flat_ranks(whole, n));
    verify_checkpoint(saved.dir);  // every chunk, every byte
    const ShardedStateDict back = read_checkpoint(saved.dir);
    for (const auto& [key, t] : whole) {
      EXPECT_TRUE(at::equal(back.at(key).local, t)) << key;
      EXPECT_EQ(back.at(key).local.scalar_type(), t.scalar_type()) << key;
    }
    // The manifest: boxes tile each key; a rank's piece of "w" is at most 2·2 + 1 boxes,
    // named "<key>/<i>" when it is several.
    const Manifest manifest = read_manifest(saved.dir);
    std::map<std::string, int> per_file;
    for (const Chunk& c : manifest.keys.at("w").chunks) {
      ++per_file[c.file];
      if (c.tensor != "w") EXPECT_EQ(c.tensor.rfind("w/", 0), 0u) << c.tensor;
    }
    for (const auto& [file, count] : per_file) EXPECT_LE(count, 5) << file;
    // M ranks read their dp_slice (boxes) of the flat-saved state.
    for (int m : {1, 2, 3}) {
      for (int r = 0; r < m; ++r) {
        const ShardedStateDict part = read_checkpoint(saved.dir, read_options_for_rank(r, m));
        const Box box = dp_slice({7, 5, 3}, r, m);
        EXPECT_TRUE(
            at::equal(part.at("w").local, whole.at("w").narrow(0, box.offset[0], box.shape[0])));
      }
    }
  }
}

// Each reader of a flat range reads only the blocks its range touches, and gets exactly it.
TEST(FlatShard, FlatRangeReadsReadOnlyTheirBytes) {
  const auto whole = tensors();
  testing::TempDir root;
  const uint64_t block = 64;
  const SaveResult saved =
      save_ranks(root.path(), flat_ranks(whole, 3), SaveOptions().checksum_block_bytes(block));
  const Manifest manifest = read_manifest(saved.dir);
  for (int m : {1, 2, 4}) {
    for (int r = 0; r < m; ++r) {
      ReadOptions options;
      options.keys = {"w", "m"};
      options.flat_range = [&](const std::string&, const std::vector<int64_t>& shape) {
        int64_t numel = 1;
        for (int64_t d : shape) numel *= d;
        return std::optional<FlatRange>(FlatRange{numel * r / m, numel * (r + 1) / m});
      };
      ReadStats stats;
      options.stats = &stats;
      const ShardedStateDict part = read_checkpoint(saved.dir, options);
      uint64_t expected_used = 0, parts = 0;
      for (const std::string key : {"w", "m"}) {
        const at::Tensor& t = whole.at(key);
        const int64_t begin = t.numel() * r / m, end = t.numel() * (r + 1) / m;
        const ShardedTensor& got = part.at(key);
        ASSERT_TRUE(got.flat_range.has_value());
        EXPECT_EQ(*got.flat_range, (FlatRange{begin, end}));
        EXPECT_TRUE(at::equal(got.local, t.reshape({-1}).narrow(0, begin, end - begin))) << key;
        expected_used += static_cast<uint64_t>(end - begin) * 4;
        // An upper bound on the chunk parts read: every (wanted box, chunk) pair that meets.
        for (const Box& want : flat_range_boxes(t.sizes().vec(), begin, end)) {
          for (const Chunk& c : manifest.keys.at(key).chunks)
            parts += intersect(c.box, want) ? 1 : 0;
        }
      }
      EXPECT_EQ(stats.bytes_used, expected_used);
      EXPECT_GE(stats.bytes_read, stats.bytes_used);
      // At most one block more than needed at each end of each part.
      EXPECT_LE(stats.bytes_read, stats.bytes_used + 2 * block * parts)
          << m << " ranks, rank " << r;
    }
  }
}

TEST(FlatShard, EmptyRangesAreKeysWithoutBytesAndBadPiecesAreRefused) {
  testing::TempDir root;
  // Rank 1 holds all of "v", rank 0 an empty piece of it: the key still has one chunk.
  std::vector<ShardedStateDict> ranks(2);
  const at::Tensor v = at::arange(6, at::kFloat).view({2, 3});
  ranks[0].tensors.emplace("v", ShardedTensor::flat(at::empty({0}), {2, 3}, 0));
  ranks[1].tensors.emplace("v", ShardedTensor::flat(v.view({-1}), {2, 3}, 0));
  const SaveResult saved = save_ranks(root.path(), ranks);
  EXPECT_EQ(read_manifest(saved.dir).keys.at("v").chunks.size(), 1u);
  ReadOptions nothing;
  nothing.flat_range = [](const std::string&, const std::vector<int64_t>&) {
    return std::optional<FlatRange>(FlatRange{});
  };
  ReadStats stats;
  nothing.stats = &stats;
  const ShardedStateDict empty = read_checkpoint(saved.dir, nothing);
  EXPECT_EQ(empty.at("v").local.numel(), 0);
  EXPECT_EQ(empty.at("v").global_shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(stats.bytes_read, 0u);
  ReadOptions outside;
  outside.flat_range = [](const std::string&, const std::vector<int64_t>&) {
    return std::optional<FlatRange>(FlatRange{4, 7});
  };
  EXPECT_NE(error_of([&] { read_checkpoint(saved.dir, outside); }).find("outside its 6 elements"),
            std::string::npos);

  // A reversed range is the caller's error (c10::Error), not a damaged checkpoint's.
  ReadOptions reversed;
  reversed.flat_range = [](const std::string&, const std::vector<int64_t>&) {
    return std::optional<FlatRange>(FlatRange{4, 2});
  };
  EXPECT_NE(
      error_of([&] { read_checkpoint(saved.dir, reversed); }).find("requested flat range [4, 2)"),
      std::string::npos);
  // Pieces that overlap, leave a gap, or do not match their local tensor are refused by name.
  std::vector<ShardedStateDict> overlap(2), gap(2), mismatched(1);
  overlap[0].tensors.emplace("v", ShardedTensor::flat(v.view({-1}).narrow(0, 0, 4), {2, 3}, 0));
  overlap[1].tensors.emplace("v", ShardedTensor::flat(v.view({-1}).narrow(0, 3, 3), {2, 3}, 3));
  EXPECT_NE(
      error_of([&] { save_ranks(root.path(), overlap); }).find("shards of ranks 0 and 1 overlap"),
      std::string::npos);
  gap[0].tensors.emplace("v", ShardedTensor::flat(v.view({-1}).narrow(0, 0, 2), {2, 3}, 0));
  gap[1].tensors.emplace("v", ShardedTensor::flat(v.view({-1}).narrow(0, 3, 3), {2, 3}, 3));
  EXPECT_NE(error_of([&] { save_ranks(root.path(), gap); }).find("cover 5 of 6 elements"),
            std::string::npos);
  ShardedTensor bad = ShardedTensor::flat(v.view({-1}), {2, 3}, 0);
  bad.flat_range = FlatRange{1, 7};
  mismatched[0].tensors.emplace("v", bad);
  EXPECT_NE(error_of([&] {
              save_ranks(root.path(), mismatched);
            }).find("key 'v' (rank 0): flat range [1, 7)"),
            std::string::npos);
}

TEST(FlatShard, AKeyNamedLikeAnotherKeysPieceIsRefusedNamingBoth) {
  testing::TempDir root;
  // Rank 0's elements [2, 9) of a 3 x 4 tensor are stored as three boxes, 'a/0' … 'a/2', in its
  // data file: a key spelled 'a/1' would be stored under the same tensor name.
  const at::Tensor a = at::arange(12, at::kFloat).view({3, 4});
  const auto piece = [&](int64_t begin, int64_t end) {
    return ShardedTensor::flat(a.view({-1}).narrow(0, begin, end - begin), {3, 4}, begin);
  };
  std::vector<ShardedStateDict> ranks(3);
  ranks[0].tensors.emplace("a", piece(2, 9));
  ranks[0].tensors.emplace("a/1", ShardedTensor::whole(at::ones({2})));
  ranks[1].tensors.emplace("a", piece(0, 2));  // the other elements: only the name is wrong
  ranks[2].tensors.emplace("a", piece(9, 12));
  const std::string message = error_of([&] { save_ranks(root.path(), ranks); });
  EXPECT_NE(message.find("keys 'a' and 'a/1' (rank 0) would both be stored as tensor 'a/1'"),
            std::string::npos)
      << message;
  EXPECT_TRUE(fs::is_empty(root.path())) << "refused before anything is written";
}

// A corrupt byte in a piece of a flat-saved key (stored as "<key>/<i>") is reported with the
// key it belongs to, not only the piece's own tensor name.
TEST(FlatShard, ACorruptPieceNamesItsKey) {
  testing::TempDir root;
  const SaveResult saved = save_ranks(root.path(), flat_ranks(tensors(), 2));
  const Manifest manifest = read_manifest(saved.dir);
  std::optional<Chunk> piece;
  for (const Chunk& c : manifest.keys.at("w").chunks) {
    if (c.tensor != "w") piece = c;
  }
  ASSERT_TRUE(piece.has_value());
  const fs::path file = saved.dir / piece->file;
  const SafetensorsHeader h = SafetensorsReader(file).header();
  std::string bytes = testing::read_file(file);
  bytes[h.data_offset() + h.find(piece->tensor)->begin] ^= 0x40;
  testing::write_file(file, bytes);
  try {
    read_checkpoint(saved.dir);
    FAIL() << "expected a ChecksumError";
  } catch (const ChecksumError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(piece->file), std::string::npos) << msg;
    EXPECT_NE(msg.find("(key 'w')"), std::string::npos) << msg;
  }
}

// A flat piece that is one box is stored under its key, as a box shard is (a plain safetensors
// reader finds it by name); only a piece of several boxes is stored as "<key>/<i>".
TEST(FlatShard, APieceOfOneBoxIsStoredUnderItsKey) {
  testing::TempDir root;
  const at::Tensor m = at::arange(12, at::kFloat).view({4, 3});
  const auto piece = [&](int64_t begin, int64_t end) {
    return ShardedTensor::flat(m.view({-1}).narrow(0, begin, end - begin), {4, 3}, begin);
  };
  std::vector<ShardedStateDict> ranks(3);
  ranks[0].tensors.emplace("m", piece(0, 3));   // row 0
  ranks[1].tensors.emplace("m", piece(3, 5));   // part of row 1
  ranks[2].tensors.emplace("m", piece(5, 12));  // the rest of row 1, rows 2 and 3
  const SaveResult saved = save_ranks(root.path(), ranks);
  std::map<std::string, std::vector<std::string>> names;
  const Manifest manifest = read_manifest(saved.dir);
  for (const Chunk& c : manifest.keys.at("m").chunks) {
    names[c.file].push_back(c.tensor);
  }
  using Names = std::vector<std::string>;
  EXPECT_EQ(names["data-00000.safetensors"], Names{"m"});
  EXPECT_EQ(names["data-00001.safetensors"], Names{"m"});
  EXPECT_EQ(names["data-00002.safetensors"], (Names{std::string("m/0"), std::string("m/1")}));
  EXPECT_NE(SafetensorsReader(saved.dir / "data-00000.safetensors").header().find("m"), nullptr);
  EXPECT_TRUE(at::equal(read_checkpoint(saved.dir).at("m").local, m));
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::checkpoint
