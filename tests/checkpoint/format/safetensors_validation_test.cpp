// Every way a safetensors header can be wrong must be rejected with a message that says where.
#include "mixprec/checkpoint/format/safetensors_reader.h"
#include "mixprec/checkpoint/format/safetensors_writer.h"

#include "format_test_util.h"

#include <gtest/gtest.h>

namespace mixprec::checkpoint {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using testing::TempDir;

// A file image: length prefix, `json` (unpadded unless the caller pads), `data_size` zero bytes.
std::string image(const std::string& json, std::size_t data_size) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i)
    out[i] = static_cast<char>(static_cast<std::uint64_t>(json.size()) >> (8 * i));
  return out + json + std::string(data_size, '\0');
}

SafetensorsHeader parse(const std::string& file) {
  return parse_safetensors_buffer(testing::as_bytes(file), "mem.safetensors");
}

const std::string kGood = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                          R"("b":{"dtype":"U8","shape":[3],"data_offsets":[8,11]}})";

TEST(SafetensorsValidation, GoodImageParses) {
  SafetensorsHeader h = parse(image(kGood, 11));
  ASSERT_EQ(h.tensors.size(), 2u);
  EXPECT_EQ(h.find("b")->begin, 8u);
  EXPECT_EQ(h.find("zzz"), nullptr);
}

TEST(SafetensorsValidation, LengthPrefixProblems) {
  EXPECT_FORMAT_ERROR(parse("abc"), "mem.safetensors", "too short");
  std::string huge = image(kGood, 11);
  huge[7] = '\x7f';  // header length ≈ 2^63
  EXPECT_FORMAT_ERROR(parse(huge), "mem.safetensors", "header length", "exceeds the limit");
  std::string just_over = image(kGood, 11);
  const std::uint64_t n = kMaxSafetensorsHeaderSize + 1;
  for (int i = 0; i < 8; ++i) just_over[i] = static_cast<char>(n >> (8 * i));
  EXPECT_FORMAT_ERROR(parse(just_over), "exceeds the limit");
  std::string past_end = image(kGood, 0);
  past_end[0] = static_cast<char>(past_end[0] + 8);
  EXPECT_FORMAT_ERROR(parse(past_end), "runs past the end");
  std::string shorter = image(kGood, 11);
  shorter[0] = static_cast<char>(shorter[0] - 1);  // header now misses its closing brace
  EXPECT_FORMAT_ERROR(parse(shorter), "invalid JSON");
}

TEST(SafetensorsValidation, DataSectionSizeMustMatch) {
  EXPECT_FORMAT_ERROR(parse(image(kGood, 10)), "mem.safetensors", "file truncated");
  EXPECT_FORMAT_ERROR(parse(image(kGood, 12)), "trailing bytes");
}

TEST(SafetensorsValidation, OffsetsMustTileTheDataSection) {
  EXPECT_FORMAT_ERROR(parse(image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                  R"("b":{"dtype":"U8","shape":[3],"data_offsets":[6,9]}})",
                                  9)),
                      "tensor 'b'", "overlap tensor 'a'");
  EXPECT_FORMAT_ERROR(parse(image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                  R"("b":{"dtype":"U8","shape":[3],"data_offsets":[9,12]}})",
                                  12)),
                      "tensor 'b'", "gap");
  EXPECT_FORMAT_ERROR(
      parse(image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12)), "tensor 'a'",
      "data starts");
  EXPECT_FORMAT_ERROR(parse(image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8)),
                      "tensor 'a'", "end before they begin");
}

TEST(SafetensorsValidation, EntryFieldProblemsNameTheTensorAndField) {
  auto one = [](const std::string& entry, std::size_t data) {
    return parse(image(R"({"t":)" + entry + "}", data));
  };
  EXPECT_FORMAT_ERROR(one(R"({"dtype":"F31","shape":[2],"data_offsets":[0,8]})", 8), "tensor 't'",
                      "unknown dtype 'F31'");
  EXPECT_FORMAT_ERROR(one(R"({"dtype":"F32","shape":[3],"data_offsets":[0,8]})", 8), "tensor 't'",
                      "hold 8 bytes", "needs 12");
  EXPECT_FORMAT_ERROR(one(R"({"dtype":"F32","shape":[-2],"data_offsets":[0,8]})", 8), "tensor 't'",
                      "field 'shape'[0]", "negative");
  EXPECT_FORMAT_ERROR(one(R"({"dtype":"F32","shape":[2.0],"data_offsets":[0,8]})", 8),
                      "field 'shape'[0]", "non-integer");
  EXPECT_FORMAT_ERROR(
      one(R"({"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]})", 8),
      "tensor 't'", "overflows");
  EXPECT_FORMAT_ERROR(one(R"({"dtype":"F32","shape":[2]})", 8), "tensor 't'",
                      "missing field 'data_offsets'");
  EXPECT_FORMAT_ERROR(one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1})", 8),
                      "tensor 't'", "unknown field 'x'");
  EXPECT_FORMAT_ERROR(one(R"({"dtype":"F32","shape":[2],"data_offsets":[0]})", 8),
                      "field 'data_offsets'");
  EXPECT_FORMAT_ERROR(one(R"({"dtype":7,"shape":[2],"data_offsets":[0,8]})", 8), "field 'dtype'",
                      "expected a string");
  EXPECT_FORMAT_ERROR(one(R"([1,2])", 0), "tensor 't'", "expected a JSON object");
}

TEST(SafetensorsValidation, StructuralProblems) {
  EXPECT_FORMAT_ERROR(parse(image(R"([])", 0)), "does not start with '{'");
  EXPECT_FORMAT_ERROR(parse(image(R"(   {})", 0)), "does not start with '{'");
  EXPECT_FORMAT_ERROR(parse(image(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                                  R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                                  2)),
                      "duplicate member 'a'");
  EXPECT_FORMAT_ERROR(parse(image(R"({"__metadata__":{"k":1}})", 0)), "'__metadata__'", "'k'",
                      "must be a string");
  EXPECT_FORMAT_ERROR(parse(image(R"({"__metadata__":{"k":"1","k":"2"}})", 0)),
                      "duplicate member 'k'", "/__metadata__");
  EXPECT_FORMAT_ERROR(parse(image(R"({"":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1)),
                      "empty name");
  EXPECT_FORMAT_ERROR(parse(image(R"({"a":[[[[[[[[[[1]]]]]]]]]]})", 0)), "nested deeper");
  EXPECT_FORMAT_ERROR(parse(image("{\"a\":\"\xff\"}", 0)), "invalid JSON");
  // A number beyond double's range is nlohmann's out_of_range, not a parse_error (found by
  // fuzz_safetensors_header); it must still come out as FormatError.
  EXPECT_FORMAT_ERROR(parse(image(R"({"__metadata__":{},"x":1e400})", 0)), "invalid JSON");
  // Padding is spaces only; a NUL-padded header is not valid JSON.
  EXPECT_FORMAT_ERROR(parse(image(std::string("{}") + '\0', 0)), "invalid JSON");
  EXPECT_EQ(parse(image("{}      ", 0)).tensors.size(), 0u);
}

TEST(SafetensorsValidation, EveryFlippedHeaderByteIsRejectedOrHarmless) {
  // Flip each header byte in turn. A flip may land in a name and leave a valid file; it must
  // never crash, throw anything but FormatError, or produce a header describing other bytes.
  const std::string good = image(kGood, 11);
  std::size_t rejected = 0;
  for (std::size_t i = 0; i < good.size() - 11; ++i) {
    for (unsigned char mask : {0x01, 0x20, 0x80}) {
      std::string bad = good;
      bad[i] = static_cast<char>(bad[i] ^ mask);
      try {
        SafetensorsHeader h = parse(bad);
        std::uint64_t total = 0;
        for (const auto& t : h.tensors) total += t.byte_size();
        EXPECT_EQ(total, 11u) << "byte " << i;
      } catch (const FormatError&) {
        ++rejected;
      }
    }
  }
  EXPECT_GT(rejected, (good.size() - 11) * 2) << "most flips must be caught";
}

TEST(SafetensorsValidation, TruncatedAndAlteredFilesOnDisk) {
  TempDir dir;
  const auto path = dir.path() / "t.safetensors";
  {
    SafetensorsWriter w(path, {{"x", Dtype::F32, {4}}});
    w.write("x", testing::pattern_bytes(16, 1));
    w.close();
  }
  const std::string good = testing::read_file(path);
  testing::write_file(path, good.substr(0, good.size() - 1));
  EXPECT_FORMAT_ERROR(SafetensorsReader{path}, path.string(), "file truncated");
  testing::write_file(path, good.substr(0, 20));
  EXPECT_FORMAT_ERROR(SafetensorsReader{path}, path.string(), "runs past the end");
  testing::write_file(path, good + "junk");
  EXPECT_FORMAT_ERROR(SafetensorsReader{path}, "trailing bytes");
  std::string wrong_len = good;
  wrong_len[0] = static_cast<char>(wrong_len[0] - 8);  // header 8 bytes shorter than written
  testing::write_file(path, wrong_len);
  EXPECT_FORMAT_ERROR(SafetensorsReader{path}, path.string());
  EXPECT_FORMAT_ERROR(SafetensorsReader{dir.path() / "missing"}, "missing", "open", "No such file");
  EXPECT_FORMAT_ERROR(SafetensorsReader{dir.path()}, "not a regular file");
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::checkpoint
