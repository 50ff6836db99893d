// Saving into a root as its one writer (save.h): a stale `latest` is found by loads and
// repaired by saves, reserved names and concurrent writers are refused clearly, failures after
// a durable commit are warnings, and error messages print shapes as [16, 16].
#include "mixprec/checkpoint/save.h"

#include "mixprec/checkpoint/format/error.h"
#include "mixprec/checkpoint/format/latest.h"
#include "mixprec/checkpoint/format/manifest.h"
#include "mixprec/checkpoint/format/root_writer.h"
#include "mixprec/checkpoint/format/verify.h"
#include "mixprec/checkpoint/training_state.h"

#include "checkpoint/format/format_test_util.h"
#include "checkpoint/support_training.h"
#include "checkpoint/support_unchanged.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

namespace mixprec::checkpoint {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

namespace fs = std::filesystem;
using mixprec::testing::TrainingSetup;

// A save killed between its commit and the `latest` update leaves step-2 complete but not
// named. The earlier code resumed from step-1 (losing step-2's progress) and every later save
// of step-2 failed with "already exists".
TEST(Save, ACommittedCheckpointLatestDoesNotNameIsLoadedAndRepaired) {
  checkpoint::testing::TempDir root;
  TrainingSetup a(at::kBFloat16);
  a.step();
  save_training_state(root.path(), "step-1", *a.model, *a.optimizer);
  a.step();
  SaveOptions no_latest;
  no_latest.update_latest(false);
  save_training_state(root.path(), "step-2", *a.model, *a.optimizer, {{"at", 2}}, no_latest);
  ASSERT_EQ(read_latest(root.path()), "step-1");

  TrainingSetup b(at::kBFloat16);
  const ResumeResult resumed = load_training_state(root.path(), *b.model, *b.optimizer);
  EXPECT_EQ(resumed.dir, root.path() / "step-2");
  EXPECT_EQ(resumed.user["at"], 2);
  EXPECT_NE(resumed.note.find("'latest' names 'step-1', but 'step-2' is newer"), std::string::npos)
      << resumed.note;
  mixprec::testing::expect_unchanged(b, mixprec::testing::snapshot(a));
  EXPECT_EQ(read_latest(root.path()), "step-1") << "a load never writes";

  // The resumed job saves step-2 again: refused, saying it is committed and now `latest`.
  try {
    save_training_state(root.path(), "step-2", *b.model, *b.optimizer);
    ADD_FAILURE() << "a committed checkpoint must not be overwritten";
  } catch (const FormatError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("already exists and is committed"), std::string::npos) << message;
    EXPECT_NE(message.find("now does"), std::string::npos) << message;
  }
  EXPECT_EQ(read_latest(root.path()), "step-2");

  b.step();
  const SaveResult saved = save_training_state(root.path(), "step-3", *b.model, *b.optimizer);
  EXPECT_EQ(saved.repaired_latest, std::nullopt);  // already repaired by the refused save
  EXPECT_TRUE(saved.warnings.empty());
  EXPECT_EQ(read_latest(root.path()), "step-3");
}

TEST(Save, ReportsTheRepairOfLatest) {
  checkpoint::testing::TempDir root;
  TrainingSetup a(at::kBFloat16);
  save_training_state(root.path(), "step-1", *a.model, *a.optimizer);
  SaveOptions no_latest;
  no_latest.update_latest(false);
  save_training_state(root.path(), "step-2", *a.model, *a.optimizer, {}, no_latest);
  const SaveResult saved = save_training_state(root.path(), "step-3", *a.model, *a.optimizer);
  EXPECT_EQ(saved.repaired_latest, "step-2");
  EXPECT_TRUE(saved.warnings.empty());
}

TEST(Save, ReservedNamesAreRefused) {
  checkpoint::testing::TempDir root;
  TrainingSetup a(at::kBFloat16);
  for (const std::string name : {"latest", "latest.tmp", "lock"}) {
    try {
      save_training_state(root.path(), name, *a.model, *a.optimizer);
      ADD_FAILURE() << name;
    } catch (const FormatError& e) {
      EXPECT_NE(std::string(e.what()).find("'" + name + "' is a reserved name"), std::string::npos)
          << e.what();
    }
  }
  EXPECT_FALSE(fs::exists(root.path() / "latest"));
}

TEST(Save, ASecondWriterIsRefusedOrWaits) {
  checkpoint::testing::TempDir root;
  TrainingSetup a(at::kBFloat16);
  RootWriter other(root.path());  // e.g. an async save of another job still running
  EXPECT_THROW(
      {
        try {
          save_training_state(root.path(), "step-1", *a.model, *a.optimizer);
        } catch (const FormatError& e) {
          EXPECT_NE(std::string(e.what()).find("another writer holds"), std::string::npos)
              << e.what();
          throw;
        }
      },
      FormatError);
  SaveOptions wait;
  wait.lock_timeout(std::chrono::milliseconds(30));
  EXPECT_THROW(save_training_state(root.path(), "step-1", *a.model, *a.optimizer, {}, wait),
               FormatError);
  EXPECT_FALSE(fs::exists(root.path() / "step-1"));
}

// `latest` replaced by a directory: its update fails after the commit. The save returns,
// with the failure as a warning, because the checkpoint is committed and durable.
TEST(Save, FailuresAfterTheDurableCommitAreWarnings) {
  checkpoint::testing::TempDir root;
  TrainingSetup a(at::kBFloat16);
  save_training_state(root.path(), "step-1", *a.model, *a.optimizer);
  fs::remove(root.path() / "latest");
  fs::create_directories(root.path() / "latest" / "x");
  SaveOptions keep;
  keep.keep_last(1);
  const SaveResult saved =
      save_training_state(root.path(), "step-2", *a.model, *a.optimizer, {}, keep);
  EXPECT_NO_THROW(verify_checkpoint(saved.dir));
  bool latest_warned = false, retention_warned = false;
  for (const std::string& w : saved.warnings) {
    latest_warned |= w.find("'latest' was not updated") != std::string::npos;
    retention_warned |= w.find("retention stopped") != std::string::npos;
  }
  EXPECT_TRUE(latest_warned && retention_warned) << c10::Join("\n", saved.warnings);
}

// A checkpoint saved by save_training_state keeps its common state in common.json: verify
// reads and checks that file too, and counts it among the files it opened.
TEST(Save, VerifyCountsTheCommonFileAmongTheFilesItOpens) {
  checkpoint::testing::TempDir root;
  TrainingSetup a(at::kBFloat16);
  const SaveResult saved = save_training_state(root.path(), "step-1", *a.model, *a.optimizer);
  ASSERT_TRUE(read_manifest(saved.dir).common_file.has_value());
  EXPECT_EQ(verify_checkpoint(saved.dir).files, saved.files + 1);
}

// c10::str of a std::vector<int64_t> prints "4 8"; messages print shapes as [4, 8].
TEST(Save, ShapesInErrorsPrintAsLists) {
  ShardedStateDict r0, r1;
  r0.tensors["w"] = {at::zeros({2, 8}), {4, 8}, {0, 0}, 0};
  r1.tensors["w"] = {at::zeros({2, 9}), {4, 9}, {2, 0}, 0};
  checkpoint::testing::TempDir root;
  try {
    save_checkpoint(root.path(), "bad", {&r0, &r1});
    ADD_FAILURE() << "expected an error";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("F32 [4, 9] disagrees with another rank's F32 [4, 8]"),
              std::string::npos)
        << message;
  }
  ShardedStateDict whole;
  whole.tensors["w"] = ShardedTensor::whole(at::zeros({4, 8}));
  const SaveResult saved = save_checkpoint(root.path(), "good", whole);
  ReadOptions outside;
  outside.slice = [](const std::string&, const std::vector<int64_t>&) {
    return std::optional<Box>(Box{{3, 0}, {2, 8}});
  };
  try {
    read_checkpoint(saved.dir, outside);
    ADD_FAILURE() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("is outside its shape [4, 8]"),
              std::string::npos)
        << e.what_without_backtrace();
  }
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::checkpoint
