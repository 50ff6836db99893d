// A checkpoint is read only from plain files inside its own directory (SPEC §4): a symbolic
// link (even to a valid copy outside the root), a FIFO or a device node in place of a data
// file, the manifest, common.json, the checkpoint directory or `latest` is refused with a
// FormatError naming the path. Nothing outside the root is read or written, nothing blocks.
#include "mixprec/checkpoint/format/directory.h"
#include "mixprec/checkpoint/format/latest.h"
#include "mixprec/checkpoint/format/retention.h"
#include "mixprec/checkpoint/format/safetensors_reader.h"
#include "mixprec/checkpoint/format/verify.h"

#include "format_test_util.h"

#include <gtest/gtest.h>

namespace mixprec::checkpoint {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

namespace fs = std::filesystem;
using testing::TempDir;

// <tmp>/root/ckpt: a sample checkpoint (common state in common.json) named by `latest`;
// <tmp>/outside/: a valid copy of it and a `latest` naming it, every file's times aged so
// that a read or a write of any of them shows (testing::age_and_stamp).
class HostileRoot : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::write_sample_checkpoint(root_, "ckpt", 1, 1, {}, /*common_in_file=*/true);
    fs::create_directories(outside_);
    fs::copy(dir_, outside_ / "ckpt", fs::copy_options::recursive);
    testing::write_file(outside_ / "latest", "ckpt\n");
    testing::write_file(outside_ / "victim", "precious bytes\n");
    outside_stamps_ = testing::age_and_stamp_tree(outside_);
  }
  void TearDown() override {
    EXPECT_EQ(testing::current_stamps(outside_stamps_), outside_stamps_)
        << "a file outside the checkpoint root was read or written";
  }

  TempDir tmp_;
  const fs::path root_ = tmp_.path() / "root";
  const fs::path outside_ = tmp_.path() / "outside";
  fs::path dir_;
  std::map<fs::path, testing::FileStamp> outside_stamps_;
};

TEST_F(HostileRoot, LinkedDataFileIsRefused) {
  const fs::path file = dir_ / "data-0.safetensors";
  testing::replace_with_symlink(file, outside_ / "ckpt" / "data-0.safetensors");
  EXPECT_FORMAT_ERROR(verify_checkpoint(dir_), file.string(), "symbolic link");
  EXPECT_FORMAT_ERROR(SafetensorsReader{file}, file.string(), "symbolic link");
}

TEST_F(HostileRoot, LinkedManifestIsRefusedAndNotListed) {
  const fs::path file = dir_ / "manifest.json";
  testing::replace_with_symlink(file, outside_ / "ckpt" / "manifest.json");
  EXPECT_FORMAT_ERROR(read_manifest(dir_), file.string(), "symbolic link");
  EXPECT_FORMAT_ERROR(verify_checkpoint(dir_), file.string(), "symbolic link");
  EXPECT_TRUE(list_checkpoints(root_).empty());
}

TEST_F(HostileRoot, LinkedCommonFileIsRefused) {
  const Manifest manifest = read_manifest(dir_);
  const fs::path file = dir_ / "common.json";
  testing::replace_with_symlink(file, outside_ / "ckpt" / "common.json");
  EXPECT_FORMAT_ERROR(read_common(dir_, manifest), file.string(), "symbolic link");
  EXPECT_FORMAT_ERROR(verify_checkpoint(dir_), file.string(), "symbolic link");
}

TEST_F(HostileRoot, LinkedCheckpointDirectoryIsRefusedAndNeverDeleted) {
  testing::replace_with_symlink(dir_, outside_ / "ckpt");
  EXPECT_FORMAT_ERROR(read_latest(root_), dir_.string(), "symbolic link");
  EXPECT_FORMAT_ERROR(verify_checkpoint(dir_), dir_.string(), "symbolic link");
  EXPECT_FORMAT_ERROR(read_manifest(dir_), dir_.string(), "symbolic link");
  EXPECT_TRUE(list_checkpoints(root_).empty());
  testing::write_sample_checkpoint(root_, "other", 2, 2);
  EXPECT_TRUE(apply_retention(root_, RetentionOptions(1)).empty());
  EXPECT_TRUE(fs::is_symlink(dir_));
}

// Directory::remove_tree removes links, never what they point to; a name that is not one
// plain entry is refused naming it, before anything is removed; a missing entry is no error.
TEST_F(HostileRoot, RemoveTreeRemovesLinksNotTheirTargetsAndRefusesPaths) {
  fs::create_directories(dir_ / "nested" / "deeper");
  testing::write_file(dir_ / "nested" / "deeper" / "file", "x");
  fs::create_directory_symlink(outside_ / "ckpt", dir_ / "nested" / "to-outside-dir");
  fs::create_symlink(outside_ / "victim", dir_ / "to-outside-file");
  const Directory root = Directory::open(root_);
  EXPECT_FORMAT_ERROR(root.remove_tree("ckpt/nested"), "ckpt/nested");
  EXPECT_FORMAT_ERROR(root.remove_tree(".."), "..");
  EXPECT_TRUE(fs::exists(dir_ / "nested" / "deeper" / "file"));
  root.remove_tree("ckpt");
  EXPECT_EQ(fs::symlink_status(dir_).type(), fs::file_type::not_found);
  root.remove_tree("ckpt");  // already gone
  EXPECT_TRUE(fs::exists(outside_ / "ckpt" / "manifest.json"));
  // TearDown: nothing outside the root was read or written.
}

TEST_F(HostileRoot, LinkedLatestIsRefused) {
  const fs::path latest = root_ / "latest";
  testing::replace_with_symlink(latest, outside_ / "latest");
  EXPECT_FORMAT_ERROR(read_latest(root_), latest.string(), "symbolic link");
}

// A FIFO blocks a plain open(O_RDONLY) until a writer appears: the guard turns a regression
// into a failure (SIGALRM) instead of a hung suite.
TEST_F(HostileRoot, FifoInPlaceOfAnyFileFailsFast) {
  testing::AlarmGuard guard(60);
  const fs::path data = dir_ / "data-1.safetensors";
  testing::replace_with_fifo(data);
  EXPECT_FORMAT_ERROR(verify_checkpoint(dir_), data.string(), "FIFO");
  EXPECT_FORMAT_ERROR(SafetensorsReader{data}, data.string(), "FIFO");

  const Manifest manifest = read_manifest(dir_);
  const fs::path common = dir_ / "common.json";
  testing::replace_with_fifo(common);
  EXPECT_FORMAT_ERROR(read_common(dir_, manifest), common.string(), "FIFO");

  const fs::path manifest_file = dir_ / "manifest.json";
  testing::replace_with_fifo(manifest_file);
  EXPECT_FORMAT_ERROR(read_manifest(dir_), manifest_file.string(), "FIFO");
  EXPECT_TRUE(list_checkpoints(root_).empty());

  const fs::path latest = root_ / "latest";
  testing::replace_with_fifo(latest);
  EXPECT_FORMAT_ERROR(read_latest(root_), latest.string(), "FIFO");
}

TEST_F(HostileRoot, DeviceNodeInPlaceOfDataFileIsRefused) {
  const fs::path data = dir_ / "data-0.safetensors";
  if (!testing::replace_with_char_device(data)) GTEST_SKIP() << "cannot create device nodes here";
  EXPECT_FORMAT_ERROR(verify_checkpoint(dir_), data.string(), "character device");
  EXPECT_FORMAT_ERROR(SafetensorsReader{data}, data.string(), "character device");
}

// The old `latest` update opened the fixed name latest.tmp with O_TRUNC, following links: a
// planted link made it truncate and overwrite a file anywhere the writer could write.
TEST_F(HostileRoot, PlantedLatestTmpLinkIsNeverWrittenThrough) {
  fs::create_symlink(outside_ / "victim", root_ / "latest.tmp");
  testing::write_sample_checkpoint(root_, "next", 2, 2, {.update_latest = false});
  try {
    write_latest(root_, "next");
  } catch (const FormatError& e) {
    ADD_FAILURE() << "write_latest should not depend on latest.tmp: " << e.what();
  }
  EXPECT_EQ(read_latest(root_), "next");
  EXPECT_TRUE(fs::is_symlink(root_ / "latest.tmp")) << "not ours to remove";
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::checkpoint
