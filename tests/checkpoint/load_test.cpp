// read_checkpoint on damaged or hostile checkpoints: what the manifest claims is checked
// before anything is allocated, and BOOL data must be 0 or 1; find_checkpoint on a root whose
// checkpoints are all damaged.
#include "mixprec/checkpoint/load.h"
#include "mixprec/checkpoint/format/verify.h"

#include "mixprec/checkpoint/format/commit.h"
#include "mixprec/checkpoint/format/error.h"
#include "mixprec/checkpoint/format/manifest.h"
#include "mixprec/checkpoint/format/safetensors_reader.h"
#include "mixprec/checkpoint/format/safetensors_writer.h"
#include "mixprec/checkpoint/reshard.h"
#include "mixprec/checkpoint/save.h"

#include "checkpoint/format/format_test_util.h"
#include "support/error_message.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace mixprec::checkpoint {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

namespace fs = std::filesystem;
using testing::TempDir;

std::string format_error(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const FormatError& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected a FormatError, got: " << e.what();
    return {};
  }
  ADD_FAILURE() << "expected a FormatError";
  return {};
}

// Stages d.safetensors holding one F32 tensor "x" of 4 elements, for a hand-written manifest.
WrittenTensor write_four_floats(CheckpointStaging& staging) {
  SafetensorsWriter writer(staging.file("d.safetensors"), {{"x", Dtype::F32, {4}}});
  writer.write("x", testing::pattern_bytes(16, 1));
  return writer.close()[0];
}

// A manifest of sequence 1 with an empty common state and no keys yet.
Manifest empty_manifest() {
  Manifest m;
  m.sequence = 1;
  m.common = nlohmann::json::object();
  return m;
}

// A manifest that claims a 256 TiB key (more than any address space) whose only chunk is a
// 4-element tensor. Reading it must fail on the mismatch, before allocating the slice: an
// allocation first would fail (or, with overcommit, succeed lazily) on a size the file
// never justified.
TEST(ReadCheckpoint, ChunksAreCheckedBeforeTheSliceIsAllocated) {
  TempDir root;
  CheckpointStaging staging(root.path(), "claims");
  const WrittenTensor x = write_four_floats(staging);
  Manifest m = empty_manifest();
  const int64_t huge = int64_t{1} << 46;  // × 4 bytes = 2^48
  m.keys["small"] = {Dtype::F32, {4}, {{"d.safetensors", "x", {{0}, {4}}, 16, x.checksum}}};
  m.keys["huge"] = {
      Dtype::F32, {huge}, {{"d.safetensors", "x#", {{0}, {huge}}, uint64_t{1} << 48, x.checksum}}};
  staging.write_file(kManifestFileName, manifest_to_json(m));
  const fs::path dir = staging.commit({});

  std::string msg = format_error([&] { read_checkpoint(dir); });
  EXPECT_NE(msg.find("d.safetensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find("no tensor 'x#'"), std::string::npos) << msg;

  // The tensor exists but is not what the manifest says.
  m.keys["huge"].chunks[0].tensor = std::string(1, 'x');
  m.keys.erase("small");
  testing::write_file(dir / kManifestFileName, manifest_to_json(m));
  msg = format_error([&] { read_checkpoint(dir); });
  EXPECT_NE(msg.find("tensor 'x' of key 'huge' is F32 [4], the manifest says F32 [70368744177664]"),
            std::string::npos)
      << msg;
}

// A chunk whose stored tensor has the manifest's shape and size but another dtype: the bytes
// would reinterpret cleanly (F32 and I32 are both 4 bytes, and the checksum is of the bytes),
// so only the dtype check stops the load returning integers made of float bits.
TEST(ReadCheckpoint, AStoredDtypeOtherThanTheManifestsIsRefused) {
  TempDir root;
  CheckpointStaging staging(root.path(), "dtype");
  const WrittenTensor x = write_four_floats(staging);
  Manifest m = empty_manifest();
  m.keys["x"] = {Dtype::I32, {4}, {{"d.safetensors", "x", {{0}, {4}}, 16, x.checksum}}};
  staging.write_file(kManifestFileName, manifest_to_json(m));
  const fs::path dir = staging.commit({});

  const std::string msg = format_error([&] { read_checkpoint(dir); });
  EXPECT_NE(msg.find("tensor 'x' of key 'x' is F32 [4], the manifest says I32 [4]"),
            std::string::npos)
      << msg;
}

// Recomputes every checksum of `dir`'s manifest from the data, so that edited data passes
// the checksums and reaches the content checks.
void rechecksum(const fs::path& dir) {
  Manifest m = read_manifest(dir);
  for (auto& [key, entry] : m.keys) {
    for (Chunk& c : entry.chunks) {
      const TensorDigests d = SafetensorsReader(dir / c.file).digests(c.tensor, m.block_bytes);
      c.checksum = d.whole;
      c.block_checksums = d.blocks;
    }
  }
  testing::write_file(dir / kManifestFileName, manifest_to_json(m));
}

TEST(ReadCheckpoint, BoolTensorsMustHoldOnlyZeroAndOne) {
  TempDir root;
  ShardedStateDict state;
  state.tensors.emplace("mask", ShardedTensor::whole(at::rand({3, 5}).gt(0.5)));
  state.tensors.emplace("flag", ShardedTensor::whole(at::scalar_tensor(true)));
  const fs::path dir = save_checkpoint(root.path(), "c", state).dir;
  EXPECT_TRUE(at::equal(read_checkpoint(dir).at("mask").local, state.at("mask").local));

  // Element [1, 2] of "mask" becomes the byte 2, with checksums that match the new bytes.
  const fs::path file = dir / "data-00000.safetensors";
  const SafetensorsHeader h = SafetensorsReader(file).header();
  std::string bytes = testing::read_file(file);
  bytes[h.data_offset() + h.find("mask")->begin + 1 * 5 + 2] = 2;
  testing::write_file(file, bytes);
  rechecksum(dir);

  const std::string msg = format_error([&] { read_checkpoint(dir); });
  EXPECT_NE(msg.find("data-00000.safetensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find("key 'mask'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("BOOL element [1, 2] holds byte 2"), std::string::npos) << msg;
  // verify refuses what a load refuses (a root's lookup trusts verify to say it loads).
  const std::string verified = format_error([&] { verify_checkpoint(dir); });
  EXPECT_NE(verified.find("key 'mask'"), std::string::npos) << verified;
  EXPECT_NE(verified.find("BOOL element 7 (flat) holds byte 2"), std::string::npos) << verified;
  // A slice that does not contain the element reads fine; one that does is refused.
  ReadOptions rows_2 = read_options_for_rank(1, 2);  // row 2 of 3
  rows_2.keys = {"mask"};
  EXPECT_TRUE(at::equal(read_checkpoint(dir, rows_2).at("mask").local,
                        state.at("mask").local.narrow(0, 2, 1)));
  ReadOptions rows_01 = read_options_for_rank(0, 2);
  rows_01.keys = {"mask"};
  EXPECT_NE(format_error([&] { read_checkpoint(dir, rows_01); }).find("BOOL element [1, 2]"),
            std::string::npos);
  // The element is named by its place in the whole tensor, also from a slice that starts
  // past row 0.
  ReadOptions rows_12;
  rows_12.keys = {"mask"};
  rows_12.slice = [](const std::string&, const std::vector<int64_t>&) {
    return std::optional<Box>(Box{{1, 0}, {2, 5}});
  };
  EXPECT_NE(format_error([&] { read_checkpoint(dir, rows_12); }).find("BOOL element [1, 2]"),
            std::string::npos);
}

// Asking for a key the checkpoint does not hold is refused naming it (a c10::Error: the
// request is wrong, not the checkpoint), not answered with a state that silently lacks it.
TEST(ReadCheckpoint, ARequestedKeyTheCheckpointLacksIsRefused) {
  TempDir root;
  ShardedStateDict state;
  state.tensors.emplace("w", ShardedTensor::whole(at::arange(6, at::kFloat)));
  const fs::path dir = save_checkpoint(root.path(), "c", state).dir;
  ReadOptions options;
  options.keys = {"w", "v"};
  EXPECT_NE(mixprec::testing::error_of([&] {
              read_checkpoint(dir, options);
            }).find("no key 'v' in the checkpoint"),
            std::string::npos);
  state.tensors.emplace("blocks.0.attn.weight", ShardedTensor::whole(at::zeros({2})));
  const fs::path two = save_checkpoint(root.path(), "two", state).dir;
  options.keys = {"blocks.0.attn.wieght"};
  const std::string message = mixprec::testing::error_of([&] { read_checkpoint(two, options); });
  EXPECT_NE(message.find("no key 'blocks.0.attn.wieght' in the checkpoint (close matches: "
                         "blocks.0.attn.weight)"),
            std::string::npos)
      << message;
  options.keys = {"w"};
  EXPECT_TRUE(at::equal(read_checkpoint(dir, options).at("w").local, state.at("w").local));
}

// A root where a checkpoint is expected (load_training_state and mixprec-ckpt take either):
// the error says it is a root and how to get its checkpoint, not "manifest.json: No such file".
TEST(ReadCheckpoint, ARootIsRefusedSayingItIsOne) {
  TempDir root;
  ShardedStateDict state;
  state.tensors.emplace("w", ShardedTensor::whole(at::arange(6, at::kFloat)));
  const fs::path dir = save_checkpoint(root.path(), "c", state).dir;
  const std::string message = format_error([&] { read_checkpoint(root.path()); });
  EXPECT_NE(
      message.find(root.path().string() + ": a checkpoint root (it holds 'latest'), not a "
                                          "checkpoint: read the one resolve_checkpoint(root)"),
      std::string::npos)
      << message;
  EXPECT_TRUE(at::equal(read_checkpoint(resolve_checkpoint(root.path())).at("w").local,
                        state.at("w").local));
  EXPECT_EQ(resolve_checkpoint(root.path()), dir);
}

// Tensors of several MiB: the destinations are faulted in on a second thread while the reads
// fill them, and the reads hash behind themselves on a third (load.cpp, safetensors_reader.cpp).
// Every byte arrives; a corrupt tensor early in the file fails the load with its key, and the
// load returns (the faulting thread is stopped and joined) rather than hanging or crashing.
TEST(ReadCheckpoint, LargeTensorsArriveExactlyAndACorruptOneFailsTheLoad) {
  TempDir root;
  ShardedStateDict state;
  at::manual_seed(3);
  state.tensors.emplace("a", ShardedTensor::whole(at::randn({3 << 20}).to(at::kBFloat16)));
  state.tensors.emplace("b", ShardedTensor::whole(at::randn({(9 << 20) / 4 + 5})));
  state.tensors.emplace("c", ShardedTensor::whole(at::randn({1000, 1100})));
  const fs::path dir = save_checkpoint(root.path(), "c", state).dir;
  const ShardedStateDict back = read_checkpoint(dir);
  for (const std::string key : {"a", "b", "c"}) {
    EXPECT_TRUE(at::equal(back.at(key).local, state.at(key).local)) << key;
  }
  // One flipped byte per round: in `b`'s last piece (its read is 9 MiB, hashed on the lane
  // behind the reads), then in the middle of `a`. The error names the tensor either way.
  const Manifest manifest = read_manifest(dir);
  for (const auto& [key, offset] : {std::pair<std::string, int64_t>{"b", (9 << 20) - 3},
                                    std::pair<std::string, int64_t>{"a", 5 << 20}}) {
    const Chunk& chunk = manifest.keys.at(key).chunks.at(0);
    const std::string intact = testing::read_file(dir / chunk.file);
    const SafetensorsHeader header = SafetensorsReader(dir / chunk.file).header();
    std::string bytes = intact;
    bytes[header.data_offset() + header.find(chunk.tensor)->begin + offset] ^= 0x10;
    testing::write_file(dir / chunk.file, bytes);
    try {
      read_checkpoint(dir);
      ADD_FAILURE() << "expected ChecksumError for " << key;
    } catch (const ChecksumError& e) {
      EXPECT_NE(std::string(e.what()).find("tensor '" + chunk.tensor + "'"), std::string::npos)
          << e.what();
    }
    testing::write_file(dir / chunk.file, intact);
  }
}

// A root without `latest` (a crash before its first update) whose committed checkpoints all
// fail verification holds checkpoints: the error says which and why, not that it holds none.
TEST(FindCheckpoint, ARootWhoseCheckpointsAllFailVerificationNamesThem) {
  TempDir tmp;
  const fs::path root = tmp.path() / "root";
  for (const std::string name : {"c1", "c2"}) {
    const fs::path dir = testing::write_sample_checkpoint(root, name, name == "c1" ? 1 : 2, 1);
    std::string data = testing::read_file(dir / "data-1.safetensors");
    data.back() ^= 1;
    testing::write_file(dir / "data-1.safetensors", data);
  }
  fs::remove(root / "latest");
  try {
    find_checkpoint(root);
    FAIL() << "expected NoIntactCheckpointError";
  } catch (const NoIntactCheckpointError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(root.string() + ": no 'latest', and none of its committed "
                                           "checkpoints verifies: c2: "),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("; c1: "), std::string::npos) << message;
    EXPECT_NE(message.find("checksum mismatch"), std::string::npos) << message;
    EXPECT_EQ(message.find("neither a checkpoint"), std::string::npos) << message;
  }
  // An empty root still says that it holds none.
  fs::create_directories(tmp.path() / "empty");
  EXPECT_NE(
      format_error([&] { find_checkpoint(tmp.path() / "empty"); }).find("neither a checkpoint"),
      std::string::npos);
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::checkpoint
