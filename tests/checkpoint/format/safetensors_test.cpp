// Writer → reader round trips, partial reads, checksums, and the writer's own refusals.
#include "mixprec/checkpoint/format/safetensors_reader.h"
#include "mixprec/checkpoint/format/safetensors_writer.h"

#include "format_test_util.h"

#include <gtest/gtest.h>

namespace mixprec::checkpoint {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using testing::pattern_bytes;
using testing::TempDir;

const std::vector<TensorSpec> kSpecs = {{"layer.weight", Dtype::BF16, {3, 5}},
                                        {"layer.bias", Dtype::F32, {5}},
                                        {"step", Dtype::I64, {}},
                                        {"empty", Dtype::F16, {0, 7}},
                                        {"mask", Dtype::BOOL, {9}},
                                        {"fp8", Dtype::F8_E4M3, {2, 2}}};

// Writes kSpecs with pattern bytes in pieces of `piece` bytes; returns the written checksums.
std::vector<WrittenTensor> write_specs(const std::filesystem::path& path, std::size_t piece) {
  SafetensorsWriter writer(path, kSpecs, {{"framework", "mixprec"}, {"note", "héllo"}});
  for (std::size_t i = 0; i < kSpecs.size(); ++i) {
    if (kSpecs[i].byte_size() == 0) continue;  // complete from the start
    EXPECT_EQ(writer.current_tensor(), i);
    auto bytes = pattern_bytes(kSpecs[i].byte_size(), static_cast<std::uint32_t>(i));
    for (std::size_t at = 0; at < bytes.size(); at += piece) {
      writer.write(kSpecs[i].name,
                   std::span(bytes).subspan(at, std::min(piece, bytes.size() - at)));
    }
  }
  EXPECT_EQ(writer.current_tensor(), kSpecs.size());
  return writer.close();
}

TEST(Safetensors, RoundTripEveryTensorAndMetadata) {
  TempDir dir;
  const auto path = dir.path() / "a.safetensors";
  const auto written = write_specs(path, 3);
  ASSERT_EQ(written.size(), kSpecs.size());

  SafetensorsReader reader(path);
  const SafetensorsHeader& h = reader.header();
  EXPECT_EQ(h.data_offset() % 8, 0u) << "header must be padded to 8-byte alignment";
  EXPECT_EQ(h.metadata.at("framework"), "mixprec");
  EXPECT_EQ(h.metadata.at("note"), "héllo");
  ASSERT_EQ(h.tensors.size(), kSpecs.size());
  for (std::size_t i = 0; i < kSpecs.size(); ++i) {
    const TensorEntry& t = reader.tensor(kSpecs[i].name);
    EXPECT_EQ(t.dtype, kSpecs[i].dtype);
    EXPECT_EQ(t.shape, kSpecs[i].shape);
    EXPECT_EQ(written[i].name, kSpecs[i].name);
    EXPECT_EQ(written[i].byte_size, kSpecs[i].byte_size());
    const auto expected = pattern_bytes(kSpecs[i].byte_size(), static_cast<std::uint32_t>(i));
    EXPECT_EQ(written[i].checksum, xxh3_64(expected)) << kSpecs[i].name;
    std::vector<std::byte> got(t.byte_size());
    reader.read(t.name, got, written[i].checksum);
    EXPECT_EQ(got, expected) << t.name;
    EXPECT_EQ(reader.checksum(t.name), written[i].checksum);
  }
}

TEST(Safetensors, PieceSizeDoesNotChangeTheFile) {
  TempDir dir;
  write_specs(dir.path() / "a", 1);
  write_specs(dir.path() / "b", 1 << 21);  // larger than the writer's buffer
  EXPECT_EQ(testing::read_file(dir.path() / "a"), testing::read_file(dir.path() / "b"));
}

TEST(Safetensors, LargeTensorsStreamAndChecksumInBoundedPieces) {
  TempDir dir;
  const auto path = dir.path() / "big.safetensors";
  const std::vector<TensorSpec> specs = {{"small", Dtype::U8, {3}}, {"big", Dtype::F32, {3 << 20}}};
  const auto big = pattern_bytes(specs[1].byte_size(), 5);
  SafetensorsWriter writer(path, specs);
  writer.write("small", pattern_bytes(3, 4));
  writer.write("big", std::span(big).first(1000));
  writer.write("big", std::span(big).subspan(1000));
  const auto written = writer.close();
  SafetensorsReader reader(path);
  EXPECT_EQ(reader.checksum("big"), xxh3_64(big));
  EXPECT_EQ(written[1].checksum, xxh3_64(big));
}

TEST(Safetensors, ReadRangeFetchesOnlyTheRequestedBytes) {
  TempDir dir;
  const auto path = dir.path() / "a.safetensors";
  write_specs(path, 4);
  SafetensorsReader reader(path);
  const auto full = pattern_bytes(kSpecs[0].byte_size(), 0);
  std::vector<std::byte> part(7);
  reader.read_range("layer.weight", 11, part);
  EXPECT_TRUE(std::equal(part.begin(), part.end(), full.begin() + 11));
  std::vector<std::byte> none;
  reader.read_range("layer.weight", full.size(), none);  // empty range at the end is fine
  EXPECT_FORMAT_ERROR(reader.read_range("layer.weight", 25, part), "a.safetensors",
                      "'layer.weight'", "outside");
  EXPECT_FORMAT_ERROR(reader.read_range("nope", 0, part), "no tensor 'nope'");
  std::vector<std::byte> wrong(3);
  EXPECT_FORMAT_ERROR(reader.read("layer.weight", wrong), "'layer.weight'", "holds 30 bytes");
}

TEST(Safetensors, ChecksumMismatchNamesFileAndTensor) {
  TempDir dir;
  const auto path = dir.path() / "corrupt.safetensors";
  const auto written = write_specs(path, 64);
  const SafetensorsHeader h = SafetensorsReader(path).header();
  // Flip one data byte inside "layer.bias".
  std::string bytes = testing::read_file(path);
  bytes[h.data_offset() + h.find("layer.bias")->begin + 2] ^= 0x10;
  testing::write_file(path, bytes);

  SafetensorsReader reader(path);
  std::vector<std::byte> out(20);
  try {
    reader.read("layer.bias", out, written[1].checksum);
    FAIL() << "expected ChecksumError";
  } catch (const ChecksumError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path.string()), std::string::npos) << msg;
    EXPECT_NE(msg.find("tensor 'layer.bias'"), std::string::npos) << msg;
    EXPECT_NE(msg.find(checksum_to_hex(written[1].checksum)), std::string::npos) << msg;
  }
  // The untouched neighbour still verifies.
  std::vector<std::byte> weight(30);
  reader.read("layer.weight", weight, written[0].checksum);
}

TEST(SafetensorsWriter, RefusesOutOfOrderOverlongAndIncompleteWrites) {
  TempDir dir;
  const auto path = dir.path() / "w.safetensors";
  SafetensorsWriter writer(path, {{"a", Dtype::F32, {2}}, {"b", Dtype::U8, {1}}});
  EXPECT_FORMAT_ERROR(writer.write("b", pattern_bytes(1, 0)), "'b'", "tensor 'a'",
                      "declared order");
  EXPECT_FORMAT_ERROR(writer.write("a", pattern_bytes(9, 0)), "'a'", "past its declared size");
  writer.write("a", pattern_bytes(4, 0));
  EXPECT_FORMAT_ERROR(writer.close(), "w.safetensors", "tensor 'a'", "4 of 8 bytes");
  writer.write("a", pattern_bytes(4, 0));
  writer.write("b", pattern_bytes(1, 0));
  EXPECT_FORMAT_ERROR(writer.write("b", pattern_bytes(1, 0)), "every declared tensor");
  writer.close();
  EXPECT_FORMAT_ERROR(writer.close(), "twice");
}

// A writer fed every tensor in declared order, as an export does, may write zero bytes to a
// zero-size tensor: complete from the start, it is a no-op wherever it comes.
TEST(SafetensorsWriter, AnEmptyWriteToAZeroSizeTensorIsANoOp) {
  TempDir dir;
  const auto path = dir.path() / "z.safetensors";
  SafetensorsWriter writer(
      path, {{"a", Dtype::F32, {1}}, {"empty", Dtype::F32, {0, 8}}, {"b", Dtype::U8, {1}}});
  writer.write("a", pattern_bytes(4, 0));
  writer.write("empty", {});
  writer.write("b", pattern_bytes(1, 0));
  writer.write("empty", {});
  EXPECT_FORMAT_ERROR(writer.write("nothing", {}), "'nothing'", "every declared tensor");
  writer.close();
  const SafetensorsReader reader(path);
  ASSERT_NE(reader.header().find("empty"), nullptr);
  EXPECT_EQ(reader.header().find("empty")->shape, (std::vector<int64_t>{0, 8}));
}

TEST(SafetensorsWriter, RejectsBadSpecsAndNeverClobbersAFile) {
  TempDir dir;
  const auto path = dir.path() / "x.safetensors";
  EXPECT_FORMAT_ERROR(SafetensorsWriter(path, {{"a", Dtype::F32, {1}}, {"a", Dtype::F32, {1}}}),
                      "x.safetensors", "'a'", "declared twice");
  EXPECT_FORMAT_ERROR(SafetensorsWriter(path, {{"", Dtype::F32, {1}}}), "empty name");
  EXPECT_FORMAT_ERROR(SafetensorsWriter(path, {{"__metadata__", Dtype::F32, {1}}}),
                      "not a tensor name");
  EXPECT_FORMAT_ERROR(SafetensorsWriter(path, {{"neg", Dtype::F32, {2, -1}}}), "'neg'", "negative");
  EXPECT_FORMAT_ERROR(SafetensorsWriter(path, {{"huge", Dtype::F64, {1ll << 40, 1ll << 30}}}),
                      "'huge'", "overflows");
  EXPECT_FORMAT_ERROR(SafetensorsWriter(path, {{std::string("bad\xff", 4), Dtype::U8, {1}}}),
                      "UTF-8");
  EXPECT_FALSE(std::filesystem::exists(path)) << "a rejected spec must not create the file";

  testing::write_file(path, "precious");
  EXPECT_FORMAT_ERROR(SafetensorsWriter(path, {{"a", Dtype::U8, {1}}}), "x.safetensors", "open",
                      "File exists");
  EXPECT_EQ(testing::read_file(path), "precious");
}

TEST(SafetensorsWriter, AbandonedWriterRemovesItsPartialFile) {
  TempDir dir;
  const auto path = dir.path() / "partial.safetensors";
  {
    SafetensorsWriter writer(path, {{"a", Dtype::F32, {4}}});
    writer.write("a", pattern_bytes(8, 0));
    EXPECT_TRUE(std::filesystem::exists(path));
  }
  EXPECT_FALSE(std::filesystem::exists(path));
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::checkpoint
