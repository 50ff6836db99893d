// Saving into a root as its one writer (save.h): a stale `latest` is found by loads and
// repaired by saves, reserved names and concurrent writers are refused clearly, failures after
// a durable commit are warnings, and error messages print shapes as [16, 16].
#include "mixprec/checkpoint/save.h"

#include "mixprec/checkpoint/format/error.h"
#include "mixprec/checkpoint/format/latest.h"
#include "mixprec/checkpoint/format/manifest.h"
#include "mixprec/checkpoint/format/retention.h"
#include "mixprec/checkpoint/format/root_writer.h"
#include "mixprec/checkpoint/format/verify.h"
#include "mixprec/checkpoint/training_state.h"

#include "checkpoint/format/format_test_util.h"
#include "checkpoint/support_training.h"
#include "checkpoint/support_unchanged.h"
#include "support/counting_allocator.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <poll.h>
#include <sys/inotify.h>
#include <unistd.h>

#include <limits>
#include <optional>
#include <thread>

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
  EXPECT_THROW(
      {
        try {
          save_training_state(root.path(), "step-1", *a.model, *a.optimizer, {}, wait);
        } catch (const FormatError& e) {
          EXPECT_NE(std::string(e.what()).find("waited 30 ms"), std::string::npos) << e.what();
          throw;
        }
      },
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

// Retention runs after the commit: it deletes what lies beyond the newest keep_last, never a
// checkpoint named in in_use, and the result lists what it deleted.
TEST(Save, RetentionSparesInUseCheckpointsAndReportsWhatItDeleted) {
  checkpoint::testing::TempDir root;
  ShardedStateDict state;
  state.tensors["w"] = ShardedTensor::whole(at::arange(4, at::kFloat));
  SaveOptions keep;
  keep.keep_last(1).in_use({"s0"});
  EXPECT_TRUE(save_checkpoint(root.path(), "s0", state, keep).deleted.empty());
  EXPECT_TRUE(save_checkpoint(root.path(), "s1", state, keep).deleted.empty()) << "s0 is in use";
  const SaveResult third = save_checkpoint(root.path(), "s2", state, keep);
  EXPECT_EQ(third.deleted, std::vector<std::string>{"s1"});
  EXPECT_TRUE(fs::exists(root.path() / "s0"));
  EXPECT_FALSE(fs::exists(root.path() / "s1"));
  EXPECT_EQ(read_latest(root.path()), "s2");
}

// Staging left by a killed save of another host is removed once it is older than the save's
// stale_staging_timeout (not before), and the result names what was removed.
TEST(Save, ReportsTheStaleStagingItRemovedOnceOlderThanTheTimeoutItWasGiven) {
  checkpoint::testing::TempDir root;
  ShardedStateDict state;
  state.tensors["w"] = ShardedTensor::whole(at::arange(4, at::kFloat));
  save_checkpoint(root.path(), "s0", state);
  const std::string leftover = ".tmp-s1@other-host@0123456789abcdef-4242-0123456789abcdef";
  fs::create_directories(root.path() / leftover);
  checkpoint::testing::write_file(root.path() / leftover / "data-00000.safetensors", "x");
  const auto two_minutes_ago = fs::file_time_type::clock::now() - std::chrono::minutes(2);
  fs::last_write_time(root.path() / leftover / "data-00000.safetensors", two_minutes_ago);
  fs::last_write_time(root.path() / leftover, two_minutes_ago);

  EXPECT_TRUE(save_checkpoint(root.path(), "s1", state).cleaned_staging.empty())
      << "younger than the default hour";
  EXPECT_TRUE(fs::exists(root.path() / leftover));
  SaveOptions minute;
  minute.stale_staging_timeout(std::chrono::seconds(60));
  const SaveResult saved = save_checkpoint(root.path(), "s2", state, minute);
  EXPECT_EQ(saved.cleaned_staging, std::vector<std::string>{leftover});
  EXPECT_FALSE(fs::exists(root.path() / leftover));
}

// The common state saved is rank 0's; a rank that holds only duplicates (replica_id > 0)
// writes no data file and is not counted among the files written.
TEST(Save, RankZerosCommonStateIsSavedAndARankStoringNothingWritesNoFile) {
  checkpoint::testing::TempDir root;
  const at::Tensor w = at::arange(6, at::kFloat);
  ShardedStateDict r0, r1;
  r0.tensors["w"] = ShardedTensor::whole(w);
  ShardedTensor duplicate = ShardedTensor::whole(w);
  duplicate.replica_id = 1;
  r1.tensors["w"] = duplicate;
  r0.common["rank"] = 0;
  r1.common["rank"] = 1;
  const SaveResult saved = save_checkpoint(root.path(), "c", {&r0, &r1});
  EXPECT_EQ(saved.files, 1u);
  EXPECT_EQ(saved.tensor_bytes, w.nbytes());
  EXPECT_TRUE(fs::exists(saved.dir / "data-00000.safetensors"));
  EXPECT_FALSE(fs::exists(saved.dir / "data-00001.safetensors"));
  EXPECT_EQ(verify_checkpoint(saved.dir).files, 2u);  // the data file and common.json
  const ShardedStateDict back = read_checkpoint(saved.dir);
  EXPECT_EQ(back.common["rank"], 0);
  EXPECT_TRUE(at::equal(back.at("w").local, w));
}

// A tensor changed while a synchronous save writes it (another thread of the training loop
// stepping) is refused once the data is written, and nothing is committed. The save is held
// where it waits for the root's lock, after it checked the state: it opens the lock file then.
TEST(Save, ATensorChangedWhileItIsWrittenIsRefusedAndNothingIsCommitted) {
  checkpoint::testing::TempDir root;
  at::Tensor w = at::arange(1000, at::kFloat);
  ShardedStateDict state;
  state.tensors["w"] = ShardedTensor::whole(w);
  std::optional<RootWriter> holder(std::in_place, root.path());
  const int watch = ::inotify_init1(IN_CLOEXEC);
  ASSERT_GE(watch, 0);
  ASSERT_GE(::inotify_add_watch(watch, (root.path() / "lock").c_str(), IN_OPEN), 0);
  std::string error = "no error";
  std::thread saving([&] {
    try {
      SaveOptions wait;
      wait.lock_timeout(std::chrono::minutes(2));
      save_checkpoint(root.path(), "c", state, wait);
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  pollfd opened{watch, POLLIN, 0};
  const int ready = ::poll(&opened, 1, /*timeout ms=*/60000);  // a bound, not a timing
  w.add_(1);  // a step while the save waits for the lock
  holder.reset();
  saving.join();
  ::close(watch);
  ASSERT_EQ(ready, 1) << "the save never opened the lock file";
  EXPECT_NE(error.find("1 tensor(s) changed while it was being written (w)"), std::string::npos)
      << error;
  EXPECT_FALSE(fs::exists(root.path() / "c"));
  EXPECT_TRUE(list_checkpoints(root.path()).empty());
}

// A strided tensor larger than one write piece (64 MiB) is copied to the host piece by piece,
// each copy only as large as its piece: every element lands where it belongs, the second piece
// starting one element into a row and going on over whole rows.
TEST(Save, AStridedTensorLargerThanAPieceIsSavedExactly) {
  checkpoint::testing::TempDir root;
  // [4100, 4097] int32, transposed: 67 194 800 bytes.
  const at::Tensor strided = at::arange(4097 * 4100, at::kInt).view({4097, 4100}).t();
  ASSERT_FALSE(strided.is_contiguous());
  ShardedTensor shard;
  shard.local = strided;
  shard.global_shape = strided.sizes().vec();
  shard.global_offset = {0, 0};
  ShardedStateDict state;
  state.tensors.emplace("w", std::move(shard));
  std::optional<mixprec::testing::CountingAllocatorGuard> counting(std::in_place);
  const SaveResult saved = save_checkpoint(root.path(), "strided", state);
  EXPECT_LE(counting->bytes(), static_cast<int64_t>(strided.nbytes()))
      << "the pieces' copies, not the whole tensor per piece";
  counting.reset();
  EXPECT_EQ(saved.tensor_bytes, strided.nbytes());
  EXPECT_TRUE(at::equal(read_checkpoint(saved.dir).at("w").local, strided));
}

// --- bad input: refused before anything is written, naming what is at fault ------------------

std::string save_error(const fs::path& root, const std::vector<const ShardedStateDict*>& ranks) {
  try {
    save_checkpoint(root, "bad", ranks);
  } catch (const std::exception& e) {
    EXPECT_FALSE(fs::exists(root / "bad"));
    return e.what();
  }
  ADD_FAILURE() << "expected an error";
  return {};
}

TEST(Save, NoStateANullRankAndAnUndefinedTensorAreRefused) {
  checkpoint::testing::TempDir root;
  ShardedStateDict good;
  good.tensors["w"] = ShardedTensor::whole(at::zeros({4}));
  EXPECT_NE(save_error(root.path(), {}).find("no state to save"), std::string::npos);
  EXPECT_NE(save_error(root.path(), {&good, nullptr}).find("rank 1 state is null"),
            std::string::npos);
  ShardedStateDict undefined;
  undefined.tensors["u"] = ShardedTensor{};
  EXPECT_NE(save_error(root.path(), {&undefined}).find("key 'u' (rank 0): undefined tensor"),
            std::string::npos);
}

TEST(Save, ShardsThatDoNotFitTheirGlobalShapeAreRefusedNamingKeyAndRank) {
  checkpoint::testing::TempDir root;
  // An offset with more dimensions than the tensor.
  ShardedStateDict offset;
  offset.tensors["w"] = {at::zeros({4}), {4}, {0, 0}, 0};
  EXPECT_NE(save_error(root.path(), {&offset})
                .find("key 'w' (rank 0): local rank 1, global shape [4], offset [0, 0]"),
            std::string::npos);
  // A box that reaches past the tensor's end.
  ShardedStateDict outside;
  outside.tensors["w"] = {at::zeros({2}), {4}, {3}, 0};
  EXPECT_NE(save_error(root.path(), {&outside}).find("key 'w': shard [3]+[2] lies outside [4]"),
            std::string::npos);
  // A flat slice must be 1-D and give no offset.
  ShardedStateDict two_d, with_offset;
  ShardedTensor flat = ShardedTensor::flat(at::zeros({6}), {2, 3}, 0);
  flat.local = at::zeros({2, 3});
  two_d.tensors["v"] = flat;
  EXPECT_NE(save_error(root.path(), {&two_d})
                .find("key 'v' (rank 0): flat range [0, 6) with a local tensor of shape [2, 3]"),
            std::string::npos);
  flat = ShardedTensor::flat(at::zeros({6}), {2, 3}, 0);
  flat.global_offset = {0, 0};
  with_offset.tensors["v"] = flat;
  EXPECT_NE(save_error(root.path(), {&with_offset}).find("key 'v' (rank 0): flat range [0, 6)"),
            std::string::npos);
  // Ranks that disagree on a key's dtype alone.
  ShardedStateDict r0, r1;
  r0.tensors["w"] = {at::zeros({2, 8}), {4, 8}, {0, 0}, 0};
  r1.tensors["w"] = {at::zeros({2, 8}, at::kDouble), {4, 8}, {2, 0}, 0};
  EXPECT_NE(save_error(root.path(), {&r0, &r1})
                .find("key 'w' (rank 1): dtype/global shape F64 [4, 8] disagrees with another "
                      "rank's F32 [4, 8]"),
            std::string::npos);
  EXPECT_TRUE(list_checkpoints(root.path()).empty());
}

// The common state is checked as a reader will parse it: nesting up to kMaxJsonDepth levels
// (the common state itself counting as one) saves and loads back, one more is refused; keys
// that are not UTF-8 and infinities are refused, naming where they are.
TEST(Save, CommonStateIsCheckedAsReadersParseIt) {
  checkpoint::testing::TempDir root;
  ShardedStateDict state;
  state.tensors["w"] = ShardedTensor::whole(at::zeros({4}));
  nlohmann::json nested = 1;
  for (int i = 0; i < kMaxJsonDepth - 1; ++i) nested = nlohmann::json::array({nested});
  state.common["deep"] = nested;  // kMaxJsonDepth levels with the common state's own
  const SaveResult saved = save_checkpoint(root.path(), "deepest", state);
  EXPECT_EQ(read_checkpoint(saved.dir).common["deep"], nested);

  state.common["deep"] = nlohmann::json::array({nested});
  EXPECT_NE(save_error(root.path(), {&state})
                .find("'/deep/0/0/0/0/0/0/0/0/0/0/0/0/0/0/0/0/0/0/0/0/0/0/0/0/0/0/0/0/0/0"),
            std::string::npos);
  EXPECT_NE(save_error(root.path(), {&state}).find("nested deeper than 256 levels"),
            std::string::npos);
  state.common.erase("deep");
  state.common["caf\xe9"] = 1;
  EXPECT_NE(
      save_error(root.path(), {&state}).find("the common state: a key that is not valid UTF-8"),
      std::string::npos);
  state.common.erase("caf\xe9");
  state.common["loss"] = {{"scale", std::numeric_limits<double>::infinity()},
                          {"value", std::numeric_limits<double>::quiet_NaN()}};
  const std::string both = save_error(root.path(), {&state});  // every problem, not the first
  EXPECT_NE(both.find("'/loss/scale': inf, which JSON cannot hold"), std::string::npos) << both;
  EXPECT_NE(both.find("'/loss/value': nan, which JSON cannot hold"), std::string::npos) << both;
  EXPECT_EQ(list_checkpoints(root.path()).size(), 1u);
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::checkpoint
