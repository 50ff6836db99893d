#include "mixprec/checkpoint/format/manifest.h"

#include "format_test_util.h"

#include <gtest/gtest.h>

namespace mixprec::checkpoint {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using nlohmann::json;

Manifest sample() {
  Manifest m;
  m.sequence = 4;
  m.common = json{{"step", 100}, {"scaler", {{"scale", 65536.0}}}, {"rng", "AAEC"}};
  m.keys["optimizer.state.exp_avg.w"] = {
      Dtype::F32,
      {4, 6},
      {{"data-0.safetensors", "w#0", {{0, 0}, {2, 6}}, 48, 0x1111},
       {"data-1.safetensors", "w#1", {{2, 0}, {2, 6}}, 48, 0x2222}}};
  m.keys["optimizer.state.step"] = {Dtype::I64, {}, {{"data-0.safetensors", "step", {}, 8, 3}}};
  m.keys["empty"] = {Dtype::BF16, {0, 3}, {}};
  return m;
}

// The sample's JSON with one edit applied, parsed.
template <class Edit>
Manifest parse_edited(Edit edit) {
  json j = json::parse(manifest_to_json(sample()));
  edit(j);
  return parse_manifest(j.dump(), "ckpt/manifest.json");
}

json& w_chunk(json& j, int i) { return j["keys"]["optimizer.state.exp_avg.w"]["chunks"][i]; }

TEST(Manifest, RoundTripIsExactAndDeterministic) {
  const std::string text = manifest_to_json(sample());
  Manifest back = parse_manifest(text, "m.json");
  EXPECT_EQ(manifest_to_json(back), text);
  EXPECT_EQ(back.sequence, 4u);
  EXPECT_EQ((*back.common)["scaler"]["scale"], 65536.0);
  const KeyEntry& w = back.keys.at("optimizer.state.exp_avg.w");
  EXPECT_EQ(w.dtype, Dtype::F32);
  ASSERT_EQ(w.chunks.size(), 2u);
  EXPECT_EQ(w.chunks[1].box.offset, (std::vector<std::int64_t>{2, 0}));
  EXPECT_EQ(w.chunks[1].checksum, 0x2222u);
  json j = json::parse(text);
  EXPECT_EQ(j["format"], "mixprec-checkpoint");
  EXPECT_EQ(j["version"], 1);
  EXPECT_EQ(w_chunk(j, 0)["xxh3"], "0000000000001111");
}

TEST(Manifest, CommonFileReferenceRoundTrips) {
  Manifest m = sample();
  m.common.reset();
  m.common_file = CommonFileRef{"common.json", 12, 0xabc};
  Manifest back = parse_manifest(manifest_to_json(m), "m.json");
  ASSERT_TRUE(back.common_file.has_value());
  EXPECT_EQ(back.common_file->file, "common.json");
  EXPECT_EQ(back.common_file->checksum, 0xabcu);
}

TEST(Manifest, VersionAndFormatErrorsAreClear) {
  EXPECT_FORMAT_ERROR(parse_edited([](json& j) { j["version"] = 3; }), "ckpt/manifest.json",
                      "version 3 is newer", "upgrade");
  EXPECT_FORMAT_ERROR(parse_edited([](json& j) { j["version"] = 0; }), "version 0",
                      "not supported");
  EXPECT_FORMAT_ERROR(parse_edited([](json& j) { j["version"] = "1"; }), "field 'version'",
                      "expected an unsigned integer");
  EXPECT_FORMAT_ERROR(parse_edited([](json& j) { j["format"] = "torch"; }), "field 'format'",
                      "'torch'");
  EXPECT_FORMAT_ERROR(parse_edited([](json& j) { j.erase("format"); }), "missing field 'format'");
  // A newer version is reported as such even when the rest no longer parses.
  EXPECT_FORMAT_ERROR(parse_edited([](json& j) {
                        j["version"] = 7;
                        j["keys"] = "changed";
                      }),
                      "version 7 is newer");
}

TEST(Manifest, MissingAndUnknownFieldsNameKeyChunkAndField) {
  for (const char* f : {"file", "tensor", "offset", "shape", "bytes", "xxh3"}) {
    EXPECT_FORMAT_ERROR(parse_edited([&](json& j) { w_chunk(j, 1).erase(f); }),
                        "key 'optimizer.state.exp_avg.w'", "chunk 1",
                        std::string("missing field '") + f + "'");
  }
  for (const char* f : {"dtype", "shape", "chunks"}) {
    EXPECT_FORMAT_ERROR(parse_edited([&](json& j) { j["keys"]["optimizer.state.step"].erase(f); }),
                        "key 'optimizer.state.step'", std::string("missing field '") + f + "'");
  }
  for (const char* f : {"sequence", "keys"}) {
    EXPECT_FORMAT_ERROR(parse_edited([&](json& j) { j.erase(f); }),
                        std::string("missing field '") + f + "'");
  }
  EXPECT_FORMAT_ERROR(parse_edited([](json& j) { w_chunk(j, 0)["replica"] = 0; }), "chunk 0",
                      "unknown field 'replica'");
  EXPECT_FORMAT_ERROR(parse_edited([](json& j) { j["extra"] = 0; }), "unknown field 'extra'");
}

TEST(Manifest, FieldTypeAndValueErrors) {
  EXPECT_FORMAT_ERROR(parse_edited([](json& j) { w_chunk(j, 0)["xxh3"] = "XYZ"; }), "chunk 0",
                      "field 'xxh3'", "16 lowercase hex");
  EXPECT_FORMAT_ERROR(parse_edited([](json& j) { w_chunk(j, 0)["bytes"] = 40; }), "chunk 0",
                      "field 'bytes' is 40", "needs 48");
  EXPECT_FORMAT_ERROR(parse_edited([](json& j) { w_chunk(j, 0)["offset"] = {0}; }), "chunk 0",
                      "rank 2");
  EXPECT_FORMAT_ERROR(parse_edited([](json& j) {
                        w_chunk(j, 0)["offset"] = {0, -1};
                      }),
                      "chunk 0", "field 'offset'[1]");
  EXPECT_FORMAT_ERROR(parse_edited([](json& j) { w_chunk(j, 0)["file"] = "../x.safetensors"; }),
                      "chunk 0", "not a plain file name");
  EXPECT_FORMAT_ERROR(parse_edited([](json& j) { w_chunk(j, 0)["file"] = "/etc/passwd"; }),
                      "not a plain file name");
  EXPECT_FORMAT_ERROR(
      parse_edited([](json& j) { j["keys"]["optimizer.state.step"]["dtype"] = "Q4"; }),
      "key 'optimizer.state.step'", "unknown dtype 'Q4'");
  EXPECT_FORMAT_ERROR(parse_edited([](json& j) {
                        w_chunk(j, 1)["file"] = "data-0.safetensors";
                        w_chunk(j, 1)["tensor"] = "w#0";
                      }),
                      "chunk 1", "already used");
  EXPECT_FORMAT_ERROR(parse_edited([](json& j) { j["sequence"] = 0; }), "'sequence'");
  EXPECT_FORMAT_ERROR(parse_edited([](json& j) { j["common"] = 3; }), "'common'", "object");
  EXPECT_FORMAT_ERROR(parse_edited([](json& j) { j.erase("common"); }), "exactly one");
  EXPECT_FORMAT_ERROR(
      parse_edited([](json& j) {
        j["common_file"] = {{"file", "c.json"}, {"bytes", 1}, {"xxh3", "0000000000000000"}};
      }),
      "exactly one");
  EXPECT_FORMAT_ERROR(parse_manifest("[]", "m.json"), "m.json", "not a JSON object");
  EXPECT_FORMAT_ERROR(parse_manifest("{\"format\": ", "m.json"), "m.json", "invalid JSON");
  EXPECT_FORMAT_ERROR(parse_manifest("888888.8876e383", "m.json"), "invalid JSON");  // fuzz find
  EXPECT_FORMAT_ERROR(
      parse_manifest(R"({"format":"mixprec-checkpoint","version":1,"version":1})", "m.json"),
      "duplicate member 'version'");
}

TEST(Manifest, ChunksMustTileTheGlobalShape) {
  EXPECT_FORMAT_ERROR(parse_edited([](json& j) {
                        w_chunk(j, 1)["offset"] = {1, 0};
                      }),
                      "key 'optimizer.state.exp_avg.w'", "chunks 0 [0, 0]+[2, 6] and 1", "overlap");
  EXPECT_FORMAT_ERROR(parse_edited([](json& j) {
                        w_chunk(j, 1)["shape"] = {1, 6};
                        w_chunk(j, 1)["bytes"] = 24;
                      }),
                      "key 'optimizer.state.exp_avg.w'", "cover 18 of 24", "gap");
  EXPECT_FORMAT_ERROR(parse_edited([](json& j) {
                        w_chunk(j, 1)["offset"] = {3, 0};
                      }),
                      "chunk 1", "outside the global shape [4, 6]");
  EXPECT_FORMAT_ERROR(
      parse_edited([](json& j) { j["keys"]["optimizer.state.exp_avg.w"]["chunks"].erase(1); }),
      "cover 12 of 24");
  EXPECT_FORMAT_ERROR(
      parse_edited([](json& j) { j["keys"]["optimizer.state.step"]["chunks"] = json::array(); }),
      "key 'optimizer.state.step'", "cover 0 of 1");
}

TEST(Manifest, ValidateIsAppliedBeforeSerializing) {
  Manifest m = sample();
  m.keys["optimizer.state.exp_avg.w"].chunks.pop_back();
  EXPECT_FORMAT_ERROR(manifest_to_json(m), "key 'optimizer.state.exp_avg.w'", "gap");
  m = sample();
  m.keys[""] = {Dtype::F32, {}, {}};
  EXPECT_FORMAT_ERROR(manifest_to_json(m), "empty name");
}

TEST(Manifest, FileNames) {
  for (std::string_view ok : {"a", "data-00000.safetensors", "step_10.v2", "A-b_c.9"}) {
    EXPECT_TRUE(is_valid_file_name(ok)) << ok;
  }
  for (std::string_view bad : std::vector<std::string_view>{
           "", ".", "..", ".hidden", "a/b", "a b", "é", "a\n", std::string_view("a\0b", 3)}) {
    EXPECT_FALSE(is_valid_file_name(bad)) << bad;
  }
  EXPECT_TRUE(is_valid_file_name(std::string(200, 'a')));  // the documented limit, inclusive
  EXPECT_FALSE(is_valid_file_name(std::string(201, 'a')));
}

TEST(Manifest, ReadCommonChecksTheCommonFile) {
  testing::TempDir dir;
  const std::string common = R"({"step": 5, "user": {"run": "x"}})";
  testing::write_file(dir.path() / "common.json", common);
  Manifest m = sample();
  m.common.reset();
  m.common_file = CommonFileRef{"common.json", common.size(), xxh3_64(testing::as_bytes(common))};
  EXPECT_EQ(read_common(dir.path(), m)["user"]["run"], "x");
  testing::write_file(dir.path() / "common.json", R"({"step": 6, "user": {"run": "x"}})");
  EXPECT_THROW(read_common(dir.path(), m), ChecksumError);
  testing::write_file(dir.path() / "common.json", "{}");
  EXPECT_FORMAT_ERROR(read_common(dir.path(), m), "common.json", "2 bytes");
  EXPECT_EQ(read_common(dir.path(), sample())["step"], 100);
}

// A common file whose size and checksum match but whose JSON is not an object is refused
// (an inline 'common' must be an object too): the common state is read by field.
TEST(Manifest, ReadCommonRefusesACommonFileThatIsNotAnObject) {
  testing::TempDir dir;
  for (const std::string text : {"[]", "3", "null", "\"step\""}) {
    testing::write_file(dir.path() / "common.json", text);
    Manifest m = sample();
    m.common.reset();
    m.common_file = CommonFileRef{"common.json", text.size(), xxh3_64(testing::as_bytes(text))};
    EXPECT_FORMAT_ERROR(read_common(dir.path(), m), "common.json",
                        "common state is not a JSON object");
  }
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::checkpoint
