// Durable commit, the `latest` pointer, refusal to overwrite, and full verification.
#include "mixprec/checkpoint/format/commit.h"
#include "mixprec/checkpoint/format/latest.h"
#include "mixprec/checkpoint/format/verify.h"

#include "format_test_util.h"

#include <gtest/gtest.h>

namespace mixprec::checkpoint {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using testing::TempDir;
using testing::write_sample_checkpoint;

std::vector<std::string> entries(const std::filesystem::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    out.push_back(e.path().filename().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST(Commit, PublishesDirectoryAndLatestAndVerifies) {
  TempDir tmp;
  const auto root = tmp.path() / "ckpts";  // created on demand
  const auto dir = write_sample_checkpoint(root, "step-1", 1, 1);
  EXPECT_EQ(dir, root / "step-1");
  EXPECT_EQ(entries(root), (std::vector<std::string>{"latest", "step-1"}));
  EXPECT_EQ(entries(dir), (std::vector<std::string>{"data-0.safetensors", "data-1.safetensors",
                                                    "manifest.json"}));
  EXPECT_EQ(testing::read_file(root / "latest"), "step-1\n");
  EXPECT_EQ(read_latest(root), "step-1");
  VerifyReport report = verify_checkpoint(dir);
  EXPECT_EQ(report.keys, 3u);
  EXPECT_EQ(report.files, 2u);
  EXPECT_EQ(report.chunks, 4u);
  EXPECT_EQ(report.bytes, 48u + 48u + 20u + 8u);
  EXPECT_EQ(read_common(dir, read_manifest(dir))["step"], 1);

  write_sample_checkpoint(root, "step-2", 2, 2);
  EXPECT_EQ(read_latest(root), "step-2");
  write_sample_checkpoint(root, "step-3", 3, 3, CommitOptions{.update_latest = false});
  EXPECT_EQ(read_latest(root), "step-2");
}

TEST(Commit, NeverOverwritesACommittedCheckpoint) {
  TempDir tmp;
  write_sample_checkpoint(tmp.path(), "ckpt", 1, 1);
  const std::string before = testing::read_file(tmp.path() / "ckpt" / "manifest.json");
  EXPECT_FORMAT_ERROR(write_sample_checkpoint(tmp.path(), "ckpt", 2, 2), "ckpt", "already exists",
                      "refusing to overwrite");
  // The same check at commit time, for a directory that appears while staging.
  {
    CheckpointStaging staging(tmp.path(), "racing");
    staging.write_file("manifest.json", std::string_view("{}"));
    write_sample_checkpoint(tmp.path(), "racing", 3, 3);
    EXPECT_FORMAT_ERROR(staging.commit(), "racing", "already exists");
  }
  EXPECT_EQ(testing::read_file(tmp.path() / "ckpt" / "manifest.json"), before);
  EXPECT_EQ(read_latest(tmp.path()), "racing");
  // Failed attempts leave no staging directories behind.
  EXPECT_EQ(entries(tmp.path()), (std::vector<std::string>{"ckpt", "latest", "racing"}));
}

TEST(Commit, UncommittedStagingIsRemovedAndInvalidInputsRefused) {
  TempDir tmp;
  std::filesystem::path staged;
  {
    CheckpointStaging staging(tmp.path(), "abandoned");
    staged = staging.dir();
    EXPECT_TRUE(staged.filename().string().starts_with(".tmp-abandoned@"));
    staging.write_file("x.bin", std::string_view("data"));
    EXPECT_FORMAT_ERROR(staging.write_file("x.bin", std::string_view("again")), "x.bin", "open",
                        "File exists");
    EXPECT_FORMAT_ERROR(staging.file("../escape"), "not a valid file name");
    EXPECT_FORMAT_ERROR(staging.commit(), "no manifest.json");
  }
  EXPECT_FALSE(std::filesystem::exists(staged));
  EXPECT_FORMAT_ERROR(CheckpointStaging(tmp.path(), "../up"), "not a valid checkpoint name");
  EXPECT_FORMAT_ERROR(CheckpointStaging(tmp.path(), ".hidden"), "not a valid checkpoint name");
  EXPECT_FORMAT_ERROR(CheckpointStaging(tmp.path(), "a/b"), "not a valid checkpoint name");
}

TEST(Latest, ReadingValidatesTheName) {
  TempDir tmp;
  const auto& root = tmp.path();
  EXPECT_EQ(read_latest(root), std::nullopt);
  write_sample_checkpoint(root, "good", 1, 1);
  struct Case {
    std::string content;
    std::string fragment;
  };
  for (const Case& c : std::vector<Case>{{"good", "followed by a newline"},
                                         {"", "followed by a newline"},
                                         {"../good\n", "not a valid checkpoint name"},
                                         {"/etc\n", "not a valid checkpoint name"},
                                         {"..\n", "not a valid checkpoint name"},
                                         {"good\n\n", "not a valid checkpoint name"},
                                         {"gone\n", "is not a directory"},
                                         // The name as it is, control characters shown: not
                                         // "'good'", which would look valid.
                                         {"good\r\n", "'good\\r' is not a valid"},
                                         {"good\n\n", "'good\\n' is not a valid"},
                                         {"go\x01od\n", "'go\\x01od' is not a valid"}}) {
    testing::write_file(root / "latest", c.content);
    EXPECT_FORMAT_ERROR(read_latest(root), (root / "latest").string(), c.fragment);
  }
  EXPECT_FORMAT_ERROR(write_latest(root, "gone"), "not a committed checkpoint");
  EXPECT_FORMAT_ERROR(write_latest(root, "../x"), "not a checkpoint name");
  write_latest(root, "good");
  EXPECT_EQ(read_latest(root), "good");
}

TEST(Verify, DetectsCorruptionMissingAndUnreferencedData) {
  TempDir tmp;
  const auto dir = write_sample_checkpoint(tmp.path(), "c", 1, 1);
  const auto data1 = dir / "data-1.safetensors";
  const std::string good = testing::read_file(data1);

  std::string flipped = good;
  flipped[flipped.size() - 3] ^= 0x01;  // inside scalar "s", the last tensor
  testing::write_file(data1, flipped);
  try {
    verify_checkpoint(dir);
    FAIL() << "expected ChecksumError";
  } catch (const ChecksumError& e) {
    EXPECT_NE(std::string(e.what()).find("data-1.safetensors: key 's' chunk 0 (tensor 's')"),
              std::string::npos)
        << e.what();
  }
  testing::write_file(data1, good.substr(0, good.size() - 4));
  EXPECT_FORMAT_ERROR(verify_checkpoint(dir), "data-1.safetensors", "file truncated");
  std::filesystem::remove(data1);
  EXPECT_FORMAT_ERROR(verify_checkpoint(dir), "data-1.safetensors", "No such file");
  {
    // The same tensors with the same bytes (write_sample_checkpoint's seeds), plus one more.
    SafetensorsWriter extra(
        data1, {{"w.1", Dtype::F32, {3, 4}}, {"s", Dtype::I64, {}}, {"stray", Dtype::U8, {1}}});
    extra.write("w.1", testing::pattern_bytes(48, 31));
    extra.write("s", testing::pattern_bytes(8, 32));
    extra.write("stray", testing::pattern_bytes(1, 0));
    extra.close();
  }
  EXPECT_FORMAT_ERROR(verify_checkpoint(dir), "data-1.safetensors",
                      "tensor 'stray' is not referenced");
}

// A data file whose tensor has the manifest's size but another dtype (BF16 bytes the manifest
// calls F16) is refused by verify as read_checkpoint refuses it: the lookup of the newest
// complete checkpoint trusts verify to say that a checkpoint loads.
TEST(Verify, DetectsADtypeOtherThanTheManifests) {
  TempDir tmp;
  const auto dir = write_sample_checkpoint(tmp.path(), "c", 1, 1);
  Manifest m = read_manifest(dir);
  m.keys.at("b").dtype = Dtype::F16;  // "b" is BF16 [10] in data-0: the same 20 bytes
  testing::write_file(dir / kManifestFileName, manifest_to_json(m));
  EXPECT_FORMAT_ERROR(verify_checkpoint(dir), "data-0.safetensors: key 'b' chunk 0 (tensor 'b')",
                      "dtype is BF16, the manifest says F16");
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::checkpoint
