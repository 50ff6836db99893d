// Per-block checksums (manifest version 2): written while the bytes go out, listed in the
// manifest, and used by partial reads so that every byte a read uses is verified.
#include "mixprec/checkpoint/format/checksum.h"
#include "mixprec/checkpoint/format/manifest.h"
#include "mixprec/checkpoint/format/safetensors_reader.h"
#include "mixprec/checkpoint/format/safetensors_writer.h"
#include "mixprec/checkpoint/format/verify.h"

#include "format_test_util.h"

#include <gtest/gtest.h>

namespace mixprec::checkpoint {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using nlohmann::json;
using testing::pattern_bytes;
using testing::TempDir;

constexpr std::uint64_t kBlock = 64;

// XXH3-64 of each `block` bytes of `bytes`, computed the obvious way.
std::vector<std::uint64_t> expected_blocks(std::span<const std::byte> bytes, std::uint64_t block) {
  std::vector<std::uint64_t> out;
  for (std::size_t at = 0; at < bytes.size(); at += block) {
    out.push_back(xxh3_64(bytes.subspan(at, std::min<std::size_t>(block, bytes.size() - at))));
  }
  return out;
}

TEST(BlockHasher, OneDigestPerBlockForAnySplit) {
  for (std::size_t n : {0u, 1u, 63u, 64u, 65u, 640u, 1000u}) {
    const auto bytes = pattern_bytes(n, 3);
    for (std::size_t piece : {1u, 7u, 64u, 500u}) {
      BlockHasher hasher(kBlock);
      for (std::size_t at = 0; at < n; at += piece) {
        hasher.update(std::span(bytes).subspan(at, std::min(piece, n - at)));
      }
      const auto got = hasher.finish();
      EXPECT_EQ(got, expected_blocks(bytes, kBlock)) << "n=" << n << " piece=" << piece;
      EXPECT_EQ(got.size(), block_count(n, kBlock));
      EXPECT_TRUE(hasher.finish().empty()) << "finish() starts over";
    }
  }
  EXPECT_THROW(BlockHasher(0), std::invalid_argument);
}

// One tensor "t" of n bytes written with block checksums; returns what the writer reported.
WrittenTensor write_one(const std::filesystem::path& path, std::size_t n, std::uint32_t seed) {
  SafetensorsWriter writer(
      path, {{"empty", Dtype::U8, {0}}, {"t", Dtype::U8, {static_cast<std::int64_t>(n)}}});
  writer.checksum_blocks(kBlock);
  const auto bytes = pattern_bytes(n, seed);
  for (std::size_t at = 0; at < n; at += 100) {
    writer.write("t", std::span(bytes).subspan(at, std::min<std::size_t>(100, n - at)));
  }
  EXPECT_FORMAT_ERROR(writer.checksum_blocks(kBlock), "after the first write");
  auto written = writer.close();
  EXPECT_TRUE(written[0].block_checksums.empty());
  return written[1];
}

TEST(BlockChecksums, WriterComputesThemWhileWriting) {
  TempDir dir;
  const WrittenTensor t = write_one(dir.path() / "a.safetensors", 1000, 5);
  const auto bytes = pattern_bytes(1000, 5);
  EXPECT_EQ(t.checksum, xxh3_64(bytes));
  EXPECT_EQ(t.block_checksums, expected_blocks(bytes, kBlock));
  const TensorDigests d = SafetensorsReader(dir.path() / "a.safetensors").digests("t", kBlock);
  EXPECT_EQ(d.whole, t.checksum);
  EXPECT_EQ(d.blocks, t.block_checksums);
}

// A file whose tensor "t" (1000 bytes, blocks of 64) has one byte flipped at `flip`.
struct Corrupted {
  TempDir dir;
  std::filesystem::path path;
  WrittenTensor written;
  std::vector<std::byte> good;

  explicit Corrupted(std::optional<std::size_t> flip) {
    path = dir.path() / "c.safetensors";
    written = write_one(path, 1000, 9);
    good = pattern_bytes(1000, 9);
    if (flip) {
      const SafetensorsHeader h = SafetensorsReader(path).header();
      std::string bytes = testing::read_file(path);
      bytes[h.data_offset() + h.find("t")->begin + *flip] ^= 0x20;
      testing::write_file(path, bytes);
    }
  }
  TensorChecksums by_block() const { return {written.checksum, kBlock, written.block_checksums}; }
  TensorChecksums whole() const { return {written.checksum, 0, {}}; }
};

TEST(ReadVerified, PartialReadReadsOnlyTheBlocksItTouches) {
  Corrupted file(std::nullopt);
  SafetensorsReader reader(file.path);
  std::vector<std::byte> a(30), b(5), c(100);
  // [70, 100) and [120, 125) lie in block 1; [600, 700) spans blocks 9 and 10.
  const std::vector<ByteRun> runs = {{70, a}, {120, b}, {600, c}};
  EXPECT_EQ(reader.read_verified("t", runs, file.by_block()), 3 * kBlock);
  EXPECT_TRUE(std::equal(a.begin(), a.end(), file.good.begin() + 70));
  EXPECT_TRUE(std::equal(b.begin(), b.end(), file.good.begin() + 120));
  EXPECT_TRUE(std::equal(c.begin(), c.end(), file.good.begin() + 600));
  // The last block is short: 1000 = 15 × 64 + 40.
  std::vector<std::byte> tail(10);
  EXPECT_EQ(reader.read_verified("t", std::vector<ByteRun>{{990, tail}}, file.by_block()), 40u);
  EXPECT_TRUE(std::equal(tail.begin(), tail.end(), file.good.begin() + 990));
  // Without block checksums the whole tensor is read and checked.
  EXPECT_EQ(reader.read_verified("t", runs, file.whole()), 1000u);
  EXPECT_TRUE(std::equal(c.begin(), c.end(), file.good.begin() + 600));
}

TEST(ReadVerified, ManyTinyRunsArePulledOneAtATime) {
  Corrupted file(std::nullopt);
  SafetensorsReader reader(file.path);
  // Every third byte: 334 one-byte runs, produced lazily.
  std::vector<std::byte> out(334);
  std::size_t i = 0;
  auto next = [&](ByteRun& run) {
    if (i == out.size()) return false;
    run = {3 * i, std::span(out).subspan(i, 1)};
    ++i;
    return true;
  };
  EXPECT_EQ(reader.read_verified("t", next, file.by_block()), 1000u);
  for (std::size_t k = 0; k < out.size(); ++k) ASSERT_EQ(out[k], file.good[3 * k]) << k;
}

TEST(ReadVerified, CorruptByteInAReadBlockIsCaught) {
  Corrupted file(650);  // block 10: bytes [640, 704)
  SafetensorsReader reader(file.path);
  std::vector<std::byte> out(4);
  const std::vector<ByteRun> runs = {{700, out}};  // needs only bytes 700..703 of block 10
  try {
    reader.read_verified("t", runs, file.by_block());
    FAIL() << "expected ChecksumError";
  } catch (const ChecksumError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(file.path.string()), std::string::npos) << msg;
    EXPECT_NE(msg.find("tensor 't'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("block 10 (bytes [640, 704) of 1000)"), std::string::npos) << msg;
  }
  // A byte the read does not touch (another block) is not read, so not noticed; a read
  // without block checksums reads everything and notices it.
  std::vector<std::byte> far(10);
  EXPECT_NO_THROW(reader.read_verified("t", std::vector<ByteRun>{{0, far}}, file.by_block()));
  EXPECT_THROW(reader.read_verified("t", std::vector<ByteRun>{{0, far}}, file.whole()),
               ChecksumError);
}

TEST(ReadVerified, RefusesBadRunsAndMissingBlockChecksums) {
  Corrupted file(std::nullopt);
  SafetensorsReader reader(file.path);
  std::vector<std::byte> a(10), b(10);
  EXPECT_FORMAT_ERROR(
      reader.read_verified("t", std::vector<ByteRun>{{100, a}, {95, b}}, file.by_block()),
      "tensor 't'", "range 1 [95, +10)", "overlaps");
  EXPECT_FORMAT_ERROR(reader.read_verified("t", std::vector<ByteRun>{{995, a}}, file.by_block()),
                      "outside its 1000 bytes");
  const std::vector<std::uint64_t> short_list(3, 0);
  EXPECT_FORMAT_ERROR(
      reader.read_verified("t", std::vector<ByteRun>{{0, a}},
                           TensorChecksums{file.written.checksum, kBlock, short_list}),
      "3 block checksums for 1000 bytes in blocks of 64");
  EXPECT_EQ(reader.read_verified("t", std::vector<ByteRun>{}, file.by_block()), 0u);
}

// Reads of several 4 MiB slices hash each slice on a second thread while the next is read
// (hash_lane.h): the same bytes, digests and errors as the one-thread path above.
TEST(ReadVerified, LargeReadsGiveTheSameBytesDigestsAndErrors) {
  constexpr std::uint64_t kBig = std::uint64_t{4} << 20;
  const std::size_t n = (std::size_t{13} << 20) + 123;  // four slices, the last one short
  TempDir dir;
  const auto path = dir.path() / "big.safetensors";
  const auto good = pattern_bytes(n, 17);
  WrittenTensor written;
  {
    SafetensorsWriter writer(path, {{"t", Dtype::U8, {static_cast<std::int64_t>(n)}}});
    writer.checksum_blocks(kBig);
    writer.write("t", good);
    written = writer.close().at(0);
  }
  const TensorChecksums whole{written.checksum, 0, {}};
  const TensorChecksums by_block{written.checksum, kBig, written.block_checksums};
  {
    SafetensorsReader reader(path);
    const TensorDigests d = reader.digests("t", kBig);
    EXPECT_EQ(d.whole, xxh3_64(good));
    EXPECT_EQ(d.blocks, expected_blocks(good, kBig));

    std::vector<std::byte> all(n);
    EXPECT_EQ(reader.read_verified("t", std::vector<ByteRun>{{0, all}}, whole), n);
    EXPECT_EQ(all, good);
    // Runs that start and end inside slices go through the two scratch buffers.
    std::vector<std::byte> a(kBig + 7), b(kBig), c(n - 2 * kBig - 40);
    const std::vector<ByteRun> runs = {{1, a}, {kBig + 9, b}, {2 * kBig + 39, c}};
    for (const TensorChecksums& sums : {whole, by_block}) {
      EXPECT_EQ(reader.read_verified("t", runs, sums), n);
      EXPECT_TRUE(std::equal(a.begin(), a.end(), good.begin() + 1));
      EXPECT_TRUE(std::equal(b.begin(), b.end(), good.begin() + kBig + 9));
      EXPECT_TRUE(std::equal(c.begin(), c.end(), good.begin() + 2 * kBig + 39));
    }
  }
  // One byte flipped in block 2 (bytes [8, 12) MiB).
  std::string bytes = testing::read_file(path);
  const SafetensorsHeader h = SafetensorsReader(path).header();
  bytes[h.data_offset() + h.find("t")->begin + 2 * kBig + 5] ^= 0x40;
  testing::write_file(path, bytes);
  SafetensorsReader reader(path);
  std::vector<std::byte> all(n);
  try {
    reader.read_verified("t", std::vector<ByteRun>{{0, all}}, whole);
    FAIL() << "expected ChecksumError";
  } catch (const ChecksumError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("tensor 't'"), std::string::npos) << msg;
    EXPECT_NE(msg.find(checksum_to_hex(written.checksum)), std::string::npos) << msg;
  }
  std::vector<std::byte> tail(n - kBig);
  try {
    reader.read_verified("t", std::vector<ByteRun>{{kBig, tail}}, by_block);
    FAIL() << "expected ChecksumError";
  } catch (const ChecksumError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("in block 2 (bytes [8388608, 12582912)"), std::string::npos) << msg;
  }
  std::vector<std::byte> head(2 * kBig);  // blocks 0 and 1 are intact
  EXPECT_NO_THROW(reader.read_verified("t", std::vector<ByteRun>{{0, head}}, by_block));
  EXPECT_NE(reader.digests("t", kBig).blocks.at(2), written.block_checksums.at(2));
  // The file cut short after the corrupt block (a read of block 3 fails): the corrupt block,
  // found first, is what the read reports.
  std::filesystem::resize_file(path, h.data_offset() + h.find("t")->begin + 3 * kBig + 100);
  try {
    reader.read_verified("t", std::vector<ByteRun>{{kBig, tail}}, by_block);
    FAIL() << "expected ChecksumError";
  } catch (const ChecksumError& e) {
    EXPECT_NE(std::string(e.what()).find("in block 2"), std::string::npos) << e.what();
  }
}

// --- manifest version 2 --------------------------------------------------------------------

Manifest v2_sample() {
  Manifest m;
  m.sequence = 2;
  m.block_bytes = 32;
  m.common = json::object();
  m.keys["w"] = {Dtype::F32,
                 {4, 6},
                 {{"d.safetensors", "w0", {{0, 0}, {2, 6}}, 48, 0x11, {0xa, 0xb}},
                  {"d.safetensors", "w1", {{2, 0}, {2, 6}}, 48, 0x22, {0xc, 0xd}}}};
  m.keys["empty"] = {Dtype::BF16, {0}, {{"d.safetensors", "e", {{0}, {0}}, 0, 0x33, {}}}};
  return m;
}

TEST(ManifestV2, RoundTripsBlockChecksums) {
  const std::string text = manifest_to_json(v2_sample());
  const json j = json::parse(text);
  EXPECT_EQ(j["version"], 2);
  EXPECT_EQ(j["block_bytes"], 32);
  EXPECT_EQ(j["keys"]["w"]["chunks"][1]["block_xxh3"],
            (json{"000000000000000c", "000000000000000d"}));
  const Manifest back = parse_manifest(text, "m.json");
  EXPECT_EQ(back.block_bytes, 32u);
  EXPECT_EQ(back.keys.at("w").chunks[0].block_checksums, (std::vector<std::uint64_t>{0xa, 0xb}));
  EXPECT_EQ(manifest_to_json(back), text);
  EXPECT_EQ(manifest_version(back), 2);
}

TEST(ManifestV2, VersionOneIsStillReadAndWrittenWithoutBlocks) {
  Manifest m = v2_sample();
  m.block_bytes = 0;
  for (auto& [key, entry] : m.keys) {
    for (auto& c : entry.chunks) c.block_checksums.clear();
  }
  const std::string text = manifest_to_json(m);
  const json j = json::parse(text);
  EXPECT_EQ(j["version"], 1);
  EXPECT_FALSE(j.contains("block_bytes"));
  EXPECT_FALSE(j["keys"]["w"]["chunks"][0].contains("block_xxh3"));
  EXPECT_EQ(parse_manifest(text, "m.json").block_bytes, 0u);
}

TEST(ManifestV2, BlockFieldsAreStrict) {
  auto parse_edited = [](auto edit) {
    json j = json::parse(manifest_to_json(v2_sample()));
    edit(j);
    return parse_manifest(j.dump(), "v2/manifest.json");
  };
  auto chunk = [](json& j) -> json& { return j["keys"]["w"]["chunks"][0]; };
  EXPECT_FORMAT_ERROR(
      parse_edited([&](json& j) { chunk(j)["block_xxh3"] = json::array({"000000000000000a"}); }),
      "key 'w'", "chunk 0", "'block_xxh3' has 1 checksums", "need 2");
  EXPECT_FORMAT_ERROR(parse_edited([&](json& j) { chunk(j)["block_xxh3"][1] = "zz"; }), "chunk 0",
                      "'block_xxh3': entry 1");
  EXPECT_FORMAT_ERROR(parse_edited([&](json& j) { chunk(j).erase("block_xxh3"); }),
                      "missing field 'block_xxh3'");
  EXPECT_FORMAT_ERROR(parse_edited([](json& j) { j.erase("block_bytes"); }),
                      "missing field 'block_bytes'");
  EXPECT_FORMAT_ERROR(parse_edited([](json& j) { j["block_bytes"] = 0; }), "'block_bytes' must be");
  // Version 1 has no block fields: they are unknown there.
  EXPECT_FORMAT_ERROR(parse_edited([](json& j) { j["version"] = 1; }), "block_bytes");
  EXPECT_FORMAT_ERROR(parse_edited([](json& j) { j["version"] = 3; }), "version 3 is newer");
}

TEST(ManifestV2, VerifyChecksEveryBlockChecksum) {
  TempDir tmp;
  CheckpointStaging staging(tmp.path(), "c");
  SafetensorsWriter writer(staging.file("d.safetensors"), {{"t", Dtype::U8, {200}}});
  writer.checksum_blocks(kBlock);
  writer.write("t", pattern_bytes(200, 1));
  const WrittenTensor t = writer.close()[0];
  Manifest m;
  m.sequence = 1;
  m.block_bytes = kBlock;
  m.common = json::object();
  m.keys["t"] = {
      Dtype::U8, {200}, {{"d.safetensors", "t", {{0}, {200}}, 200, t.checksum, t.block_checksums}}};
  staging.write_file(kManifestFileName, manifest_to_json(m));
  const auto dir = staging.commit({});
  EXPECT_EQ(verify_checkpoint(dir).bytes, 200u);
  // The whole-chunk checksum is right but one block checksum is not: a resharded load would
  // trust it, so verify must not. Block 3 is the short last one (bytes [192, 200)).
  for (const std::size_t block : {std::size_t{2}, std::size_t{3}}) {
    SCOPED_TRACE(block);
    Manifest bad = m;
    bad.keys["t"].chunks[0].block_checksums[block] ^= 1;
    testing::write_file(dir / kManifestFileName, manifest_to_json(bad));
    try {
      verify_checkpoint(dir);
      FAIL() << "expected ChecksumError";
    } catch (const ChecksumError& e) {
      EXPECT_NE(
          std::string(e.what()).find("key 't' chunk 0 (tensor 't'): checksum mismatch in block " +
                                     std::to_string(block)),
          std::string::npos)
          << e.what();
    }
  }
}

// the last block of a tensor is shorter than the others (1000 = 15 * 64 + 40); its
// checksum is checked too.
TEST(ReadVerified, CorruptByteInTheShortLastBlockIsCaught) {
  Corrupted file(990);  // block 15: bytes [960, 1000)
  SafetensorsReader reader(file.path);
  std::vector<std::byte> out(4);
  try {
    reader.read_verified("t", std::vector<ByteRun>{{996, out}}, file.by_block());
    FAIL() << "expected ChecksumError";
  } catch (const ChecksumError& e) {
    EXPECT_NE(std::string(e.what()).find("block 15 (bytes [960, 1000) of 1000)"), std::string::npos)
        << e.what();
  }
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::checkpoint
