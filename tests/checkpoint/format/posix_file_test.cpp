// The POSIX helpers under the format layer: durable directory creation, opening entries of a
// directory without following links or blocking, removal that never leaves the tree.
#include "posix_file.h"

#include "format_test_util.h"

#include <fcntl.h>

#include <gtest/gtest.h>

namespace mixprec::checkpoint {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

namespace fs = std::filesystem;
using testing::TempDir;

// The root's own entry must be fsynced in its parent. The earlier code fsynced
// absolute(root).parent_path(), which for "…/ckpts/" is "…/ckpts" itself: the new root's
// entry in its parent was never synced when the root was given with a trailing slash.
TEST(PosixFile, NewDirectoriesAreSyncedInTheirParentsEvenWithATrailingSlash) {
  TempDir tmp;
  const fs::path root = tmp.path() / "a" / "ckpts";
  EXPECT_EQ(detail::create_directories_durably(root.string() + "/"),
            (std::vector<fs::path>{tmp.path(), tmp.path() / "a"}));
  EXPECT_TRUE(fs::is_directory(root));
  EXPECT_TRUE(detail::create_directories_durably(root.string() + "//").empty());
  EXPECT_EQ(detail::create_directories_durably(tmp.path() / "b/"),
            (std::vector<fs::path>{tmp.path()}));
  testing::write_file(tmp.path() / "file", "x");
  EXPECT_FORMAT_ERROR(detail::create_directories_durably(tmp.path() / "file" / "sub"),
                      "a regular file, not a directory");
  EXPECT_EQ(detail::parent_directory("x/y/"), fs::path("x"));
  EXPECT_EQ(detail::parent_directory("y"), fs::path("."));
}

TEST(PosixFile, OpenRegularAtRefusesEverythingButRegularFiles) {
  TempDir tmp;
  testing::write_file(tmp.path() / "outside", "secret");
  const testing::FileStamp before = testing::age_and_stamp(tmp.path() / "outside");
  const fs::path dir = tmp.path() / "dir";
  fs::create_directory(dir);
  detail::UniqueFd dfd = detail::open_directory(dir, false);
  testing::write_file(dir / "plain", "ok");
  fs::create_symlink(tmp.path() / "outside", dir / "link");
  fs::create_symlink(tmp.path() / "nowhere", dir / "dangling");
  ::mkfifo((dir / "fifo").c_str(), 0644);
  fs::create_directory(dir / "sub");
  testing::AlarmGuard guard(60);

  EXPECT_EQ(detail::read_whole_file_at(dfd.get(), "plain", 100, dir / "plain"), "ok");
  EXPECT_FORMAT_ERROR(detail::open_regular_at(dfd.get(), "link", O_RDONLY, dir / "link"),
                      (dir / "link").string(), "is a symbolic link, not a regular file");
  EXPECT_FORMAT_ERROR(detail::open_regular_at(dfd.get(), "fifo", O_RDONLY, dir / "fifo"),
                      "is a FIFO");
  EXPECT_FORMAT_ERROR(detail::open_regular_at(dfd.get(), "fifo", O_WRONLY | O_CREAT, dir / "fifo"),
                      "is a FIFO");
  EXPECT_FORMAT_ERROR(detail::open_regular_at(dfd.get(), "sub", O_RDONLY, dir / "sub"),
                      "is a directory");
  EXPECT_FORMAT_ERROR(detail::open_regular_at(dfd.get(), "../outside", O_RDONLY, dir),
                      "not a single directory entry name");
  // Creating never writes through a link, dangling or not.
  EXPECT_FORMAT_ERROR(detail::open_regular_at(dfd.get(), "link", O_WRONLY | O_CREAT, dir / "link"),
                      "symbolic link");
  EXPECT_FORMAT_ERROR(
      detail::open_regular_at(dfd.get(), "dangling", O_WRONLY | O_CREAT | O_EXCL, dir / "dangling"),
      "File exists");
  EXPECT_FALSE(fs::exists(tmp.path() / "nowhere"));
  EXPECT_FORMAT_ERROR(detail::open_directory_at(dfd.get(), "link", dir / "link"),
                      "is a symbolic link, not a directory");
  fs::create_directory_symlink(dir / "sub", tmp.path() / "sublink");
  EXPECT_FORMAT_ERROR(detail::open_directory(tmp.path() / "sublink/", false), "symbolic link");
  EXPECT_NO_THROW(detail::open_directory(tmp.path() / "sublink/", true));
  EXPECT_EQ(testing::current_stamp(tmp.path() / "outside"), before);
}

TEST(PosixFile, RemoveTreeNeverFollowsLinks) {
  TempDir tmp;
  const fs::path outside = tmp.path() / "outside";
  fs::create_directories(outside / "keep");
  testing::write_file(outside / "keep" / "file", "x");
  const fs::path victim = tmp.path() / "victim";
  fs::create_directories(victim / "a" / "b");
  testing::write_file(victim / "a" / "b" / "f", "y");
  fs::create_directory_symlink(outside / "keep", victim / "a" / "link");
  detail::UniqueFd root = detail::open_directory(tmp.path(), false);
  detail::remove_tree_at(root.get(), "victim", victim);
  EXPECT_FALSE(fs::exists(victim));
  EXPECT_TRUE(fs::exists(outside / "keep" / "file"));
  EXPECT_NO_THROW(detail::remove_tree_at(root.get(), "victim", victim));  // already gone
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::checkpoint
