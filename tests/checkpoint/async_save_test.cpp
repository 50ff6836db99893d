// Asynchronous saves: errors and results reported once, consistent snapshots (a step between
// building the state dict and staging it is refused), staging memory allocated once within its
// budget.
#include "mixprec/checkpoint/async_save.h"

#include "checkpoint/support_training.h"
#include "mixprec/checkpoint/format/verify.h"
#include "mixprec/checkpoint/load.h"
#include "mixprec/checkpoint/training_state.h"

#include "checkpoint/format/format_test_util.h"

#include "support/counting_allocator.h"

#include <c10/util/StringUtil.h>
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <future>
#include <map>

namespace mixprec::checkpoint {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

namespace fs = std::filesystem;
using mixprec::testing::TrainingSetup;

struct TempRoot {
  testing::TempDir dir;
  const fs::path& path = dir.path();
};

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an error";
  return {};
}

TEST(AsyncSave, StagingFailureIsReportedOnceAndTheNextSaveWrites) {
  TempRoot root;
  TrainingSetup a(at::kBFloat16);
  AsyncCheckpointSaver saver;
  // A meta tensor has no bytes: staging it fails after the writer has started.
  ShardedStateDict bad = training_state_dict(*a.model, *a.optimizer);
  bad.tensors.emplace("no_data", ShardedTensor::whole(at::empty({4}, at::device(at::kMeta))));
  (void)saver.save(root.path, "bad", bad);
  const std::string msg = error_of([&] { saver.wait_until_staged(); });
  EXPECT_NE(msg.find("meta"), std::string::npos) << msg;
  EXPECT_FALSE(saver.in_flight());
  EXPECT_FALSE(saver.wait().has_value()) << "the error was already reported";
  EXPECT_FALSE(fs::exists(root.path / "bad"));

  (void)saver.save(root.path, "good", training_state_dict(*a.model, *a.optimizer));
  const std::optional<SaveResult> result = saver.wait();
  ASSERT_TRUE(result.has_value());
  EXPECT_EQ(result->dir, root.path / "good");
  verify_checkpoint(root.path / "good");
}

// A root whose `latest` is unusable: the next save replaces it and says so in its warnings.
void spoil_latest(const fs::path& root) { testing::write_file(root / "latest", "../../etc\n"); }

void expect_latest_warning(const std::optional<SaveResult>& result, const fs::path& dir) {
  ASSERT_TRUE(result.has_value()) << dir;
  EXPECT_EQ(result->dir, dir);
  ASSERT_EQ(result->warnings.size(), 1u) << c10::Join("\n", result->warnings);
  EXPECT_NE(result->warnings[0].find("'latest' is unusable and will be replaced"),
            std::string::npos)
      << result->warnings[0];
}

// A caller who never calls wait() between saves still gets every save's result, warnings
// included: the save() that waits for one returns it. Before, it dropped it.
TEST(AsyncSave, TheNextSaveReturnsTheResultItWaitedFor) {
  TempRoot root;
  TrainingSetup a(at::kBFloat16);
  AsyncCheckpointSaver saver;
  spoil_latest(root.path);
  EXPECT_FALSE(saver.save(root.path, "s1", training_state_dict(*a.model, *a.optimizer)));
  const std::optional<SaveResult> first =
      saver.save(root.path, "s2", training_state_dict(*a.model, *a.optimizer));
  expect_latest_warning(first, root.path / "s1");
  const std::optional<SaveResult> second = saver.wait();
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->dir, root.path / "s2");
  EXPECT_TRUE(second->warnings.empty()) << c10::Join("\n", second->warnings);
  EXPECT_FALSE(saver.wait().has_value()) << "a result is returned once";

  // One that reserve() waited for is the next save()'s to return.
  spoil_latest(root.path);
  (void)saver.save(root.path, "s3", training_state_dict(*a.model, *a.optimizer));
  saver.reserve(saver.staging_bytes());
  expect_latest_warning(saver.save(root.path, "s4", training_state_dict(*a.model, *a.optimizer)),
                        root.path / "s3");
  ASSERT_TRUE(saver.wait().has_value());
}

// reserve() waits for the save in flight too, and so does a save() that is then refused: the
// result they waited for is the next wait()'s or save()'s, not lost.
TEST(AsyncSave, AResultWaitedForByReserveOrARefusedSaveIsReturnedNext) {
  TempRoot root;
  TrainingSetup a(at::kBFloat16);
  const std::size_t need = staging_bytes_for(training_state_dict(*a.model, *a.optimizer));
  AsyncCheckpointSaver saver(AsyncSaveOptions().staging_budget_bytes(need));
  spoil_latest(root.path);
  (void)saver.save(root.path, "s1", training_state_dict(*a.model, *a.optimizer));
  saver.reserve(need);
  EXPECT_FALSE(saver.in_flight());
  expect_latest_warning(saver.wait(), root.path / "s1");
  EXPECT_FALSE(saver.wait().has_value()) << "a result is returned once";

  // A state over the budget is refused after save() waited for the one before.
  spoil_latest(root.path);
  (void)saver.save(root.path, "s2", training_state_dict(*a.model, *a.optimizer));
  ShardedStateDict too_big = training_state_dict(*a.model, *a.optimizer);
  too_big.tensors.emplace("extra", ShardedTensor::whole(at::zeros({64})));
  EXPECT_NE(error_of([&] { (void)saver.save(root.path, "s3", too_big); }).find("the budget is"),
            std::string::npos);
  EXPECT_FALSE(saver.in_flight());
  expect_latest_warning(saver.wait(), root.path / "s2");
  EXPECT_FALSE(fs::exists(root.path / "s3"));
}

// A saver destroyed with a result nobody collected prints its warnings, as it prints an error
// nobody collected: the checkpoint is committed, but the user must hear what went wrong.
TEST(AsyncSave, TheDestructorPrintsTheWarningsOfAResultNobodyCollected) {
  TempRoot root;
  TrainingSetup a(at::kBFloat16);
  spoil_latest(root.path);
  ::testing::internal::CaptureStderr();
  {
    AsyncCheckpointSaver saver;
    (void)saver.save(root.path, "s1", training_state_dict(*a.model, *a.optimizer));
  }
  const std::string printed = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(printed.find("warning nobody collected, saving " + (root.path / "s1").string() +
                         ": 'latest' is unusable and will be replaced"),
            std::string::npos)
      << printed;
  verify_checkpoint(root.path / "s1");
}

// A name already taken is refused by save() itself, not by the writer in the background,
// whose error would surface only at the next save() and cost that save too.
TEST(AsyncSave, AnExistingNameIsRefusedAtOnce) {
  TempRoot root;
  TrainingSetup a(at::kBFloat16);
  a.step();
  save_training_state(root.path, "s1", *a.model, *a.optimizer);
  AsyncCheckpointSaver saver;
  const std::string message = error_of(
      [&] { (void)saver.save(root.path, "s1", training_state_dict(*a.model, *a.optimizer)); });
  EXPECT_NE(message.find("s1: already exists"), std::string::npos) << message;
  EXPECT_FALSE(saver.in_flight());
  (void)saver.save(root.path, "s2", training_state_dict(*a.model, *a.optimizer));
  ASSERT_TRUE(saver.wait().has_value());
  EXPECT_EQ(resolve_checkpoint(root.path), root.path / "s2");
}

// An invalid or reserved name is refused by save() with save_checkpoint's message, not by the
// writer, whose error would cost the next save. `lock` and `latest` are refused before the
// existence check, which would blame a file the root itself owns.
TEST(AsyncSave, AnInvalidOrReservedNameIsRefusedAtOnceAsSaveCheckpointRefusesIt) {
  TempRoot root;
  TrainingSetup a(at::kBFloat16);
  a.step();
  save_training_state(root.path, "s1", *a.model, *a.optimizer);  // `latest` and `lock` exist
  AsyncCheckpointSaver saver;
  for (const std::string name : {"a/b", "latest", "latest.x", "lock", ".hidden", ""}) {
    const std::string sync = error_of(
        [&] { save_checkpoint(root.path, name, training_state_dict(*a.model, *a.optimizer)); });
    const std::string async = error_of(
        [&] { (void)saver.save(root.path, name, training_state_dict(*a.model, *a.optimizer)); });
    EXPECT_NE(sync.find("name"), std::string::npos) << name << ": " << sync;
    EXPECT_EQ(async, sync) << name;
    EXPECT_FALSE(saver.in_flight()) << name;
  }
  (void)saver.save(root.path, "s2", training_state_dict(*a.model, *a.optimizer));
  ASSERT_TRUE(saver.wait().has_value()) << "no error of a refused name is left over";
  EXPECT_EQ(resolve_checkpoint(root.path), root.path / "s2");
}

// Tensors without elements need no staging memory: a state of only such tensors saves on a
// saver whose arena was never allocated (it stays so) and loads back with their dtypes and shapes.
TEST(AsyncSave, AStateOfEmptyTensorsSavesAndLoads) {
  TempRoot root;
  ShardedStateDict state;
  state.tensors.emplace("rows", ShardedTensor::whole(at::zeros({0, 3})));
  state.tensors.emplace("cols", ShardedTensor::whole(at::zeros({2, 0}, at::kHalf)));
  state.common["step"] = 1;
  AsyncCheckpointSaver saver;
  (void)saver.save(root.path, "empty", state);
  const std::optional<SaveResult> result = saver.wait();
  ASSERT_TRUE(result.has_value());
  EXPECT_EQ(saver.staging_bytes(), 0u);
  verify_checkpoint(root.path / "empty");
  const ShardedStateDict loaded = read_checkpoint(root.path / "empty");
  ASSERT_EQ(loaded.tensors.size(), 2u);
  EXPECT_EQ(loaded.tensors.at("rows").local.sizes(), at::IntArrayRef({0, 3}));
  EXPECT_EQ(loaded.tensors.at("rows").local.scalar_type(), at::kFloat);
  EXPECT_EQ(loaded.tensors.at("cols").local.sizes(), at::IntArrayRef({2, 0}));
  EXPECT_EQ(loaded.tensors.at("cols").local.scalar_type(), at::kHalf);
  EXPECT_EQ(loaded.common["step"], 1);

  // Beside tensors with elements, in an arena that exists, they still take no slot.
  state.tensors.emplace("w", ShardedTensor::whole(at::arange(5, at::kFloat)));
  (void)saver.save(root.path, "mixed", state);
  ASSERT_TRUE(saver.wait().has_value());
  EXPECT_EQ(saver.staging_bytes(), staging_bytes_for(state));
  EXPECT_TRUE(at::equal(read_checkpoint(root.path / "mixed").tensors.at("w").local,
                        at::arange(5, at::kFloat)));
}

TEST(AsyncSave, StepBetweenBuildingTheDictAndSavingIsRefused) {
  TempRoot root;
  TrainingSetup a(at::kBFloat16);
  a.step();
  ShardedStateDict state = training_state_dict(*a.model, *a.optimizer);  // step count 1
  a.step();  // moments, masters and params move to step 2
  AsyncCheckpointSaver saver;
  const std::string msg = error_of([&] { (void)saver.save(root.path, "mixed", state); });
  EXPECT_NE(msg.find("not a consistent snapshot"), std::string::npos) << msg;
  EXPECT_NE(msg.find("optimizer.state.exp_avg.up.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("since the state dict was built"), std::string::npos) << msg;
  EXPECT_FALSE(saver.in_flight());
  EXPECT_FALSE(fs::exists(root.path / "mixed"));
  // The synchronous save refuses it too.
  EXPECT_THROW(save_checkpoint(root.path, "mixed", state), c10::Error);
  EXPECT_FALSE(fs::exists(root.path / "mixed"));
}

TEST(AsyncSave, StepDuringStagingIsRefusedAndNothingIsCommitted) {
  TempRoot root;
  TrainingSetup a(at::kBFloat16);
  a.step();
  AsyncSaveOptions options;
  int staged = 0;
  bool step_now = true;
  options.on_tensor_staged([&](const std::string&) {
    // Stands in for another thread of the training loop stepping while save() stages.
    if (++staged == 2 && step_now) a.step();
  });
  AsyncCheckpointSaver saver(options);
  (void)saver.save(root.path, "torn", training_state_dict(*a.model, *a.optimizer));
  const std::string msg = error_of([&] { saver.wait_until_staged(); });
  EXPECT_NE(msg.find("changed while it was being staged"), std::string::npos) << msg;
  EXPECT_FALSE(saver.in_flight());
  EXPECT_FALSE(saver.wait().has_value());
  EXPECT_FALSE(fs::exists(root.path / "torn"));

  // Without the step the same save goes through and holds exactly the state at save().
  step_now = false;
  const ShardedStateDict expected = training_state_dict(*a.model, *a.optimizer).clone();
  (void)saver.save(root.path, "whole", training_state_dict(*a.model, *a.optimizer));
  saver.wait_until_staged();
  a.step();  // once staged: allowed, and not in the checkpoint
  ASSERT_TRUE(saver.wait().has_value());
  const ShardedStateDict back = read_checkpoint(root.path / "whole");
  for (const auto& [key, t] : expected.tensors) {
    EXPECT_TRUE(at::equal(back.at(key).local, t.local)) << key;
  }
  EXPECT_EQ(back.common["optimizer"]["step"], expected.common["optimizer"]["step"]);
}

// The staging memory is allocated once, when it is reserved, and every save copies into it
// without allocating; a strided state is staged exactly.
TEST(AsyncSave, StagingIsAllocatedOnceAndReused) {
  TempRoot root;
  ShardedStateDict state;
  at::manual_seed(5);
  std::vector<at::Tensor> originals;
  for (int i = 0; i < 6; ++i) {
    // 2 MiB each; the odd ones transposed (strides [1, 512]), copied element by element.
    at::Tensor t = at::randn({512, 1024});
    if (i % 2 == 1) t = t.t();
    originals.push_back(t.contiguous());
    ShardedTensor shard;
    shard.local = t;
    shard.global_shape = t.sizes().vec();
    shard.global_offset = {0, 0};
    state.tensors.emplace("t" + std::to_string(i), std::move(shard));
  }
  state.tensors.emplace("scalar", ShardedTensor::whole(at::scalar_tensor(2.5)));
  AsyncCheckpointSaver saver;
  saver.reserve(staging_bytes_for(state));
  EXPECT_EQ(saver.staging_bytes(), 6u * (2u << 20) + 64);
  for (const char* name : {"first", "second"}) {
    mixprec::testing::CountingAllocatorGuard counting;
    (void)saver.save(root.path, name, state);
    saver.wait_until_staged();
    // ATen's transposing copy takes one scratch buffer per strided tensor; nothing else, and
    // no new arena.
    EXPECT_LE(counting.allocations(), 3) << name << ": staging allocated";
    EXPECT_LE(counting.bytes(), 3 * (2 << 20)) << name << ": staging allocated";
    ASSERT_TRUE(saver.wait().has_value());
    const ShardedStateDict back = read_checkpoint(root.path / name);
    for (int i = 0; i < 6; ++i) {
      EXPECT_TRUE(at::equal(back.at("t" + std::to_string(i)).local, originals[i])) << i;
    }
    EXPECT_EQ(back.at("scalar").local.item<double>(), 2.5);
  }
  EXPECT_GT(saver.last_background_seconds(), 0);
}

// A state larger than the budget is refused up front, naming both sizes, with nothing written.
TEST(AsyncSave, StateLargerThanTheBudgetIsRefusedBeforeAnythingIsWritten) {
  TempRoot root;
  TrainingSetup a(at::kBFloat16);
  a.step();
  const ShardedStateDict state = training_state_dict(*a.model, *a.optimizer);
  const std::size_t need = staging_bytes_for(state);
  AsyncCheckpointSaver saver(AsyncSaveOptions().staging_budget_bytes(need - 1));
  const std::string expected = "the checkpoint needs " + std::to_string(need) +
                               " bytes of host staging memory, the budget is " +
                               std::to_string(need - 1) + " bytes";
  EXPECT_NE(error_of([&] { saver.reserve(need); }).find(expected), std::string::npos);
  EXPECT_NE(error_of([&] { (void)saver.save(root.path, "big", state); }).find(expected),
            std::string::npos);
  EXPECT_FALSE(fs::exists(root.path / "big"));
  EXPECT_EQ(saver.staging_bytes(), 0u);
  EXPECT_THROW(AsyncCheckpointSaver(AsyncSaveOptions().staging_budget_bytes(0)), c10::Error);
}

// A rank's duplicates (replica_id > 0: what another rank writes) are not staged, and take no
// staging memory: a budget of the replica-0 shards' bytes suffices. Counted, the arena would
// grow by every replicated tensor on every rank but one, and a save that fits its budget would
// be refused.
TEST(AsyncSave, DuplicatesTakeNoStagingMemory) {
  ShardedStateDict state;
  const at::Tensor mine = at::arange(100, at::kFloat);
  state.tensors.emplace("mine", ShardedTensor::whole(mine));
  ShardedTensor duplicate = ShardedTensor::whole(at::ones({1000}, at::kFloat));
  duplicate.replica_id = 1;
  state.tensors.emplace("duplicate", std::move(duplicate));
  const std::size_t need = staging_bytes_for(mine.nbytes());
  EXPECT_EQ(staging_bytes_for(state), need);
  AsyncCheckpointSaver saver(AsyncSaveOptions().staging_budget_bytes(need));
  bool wrote = false;
  (void)saver.save(state, [&](const ShardedStateDict& staged, const std::exception_ptr& failed) {
    if (failed) std::rethrow_exception(failed);
    wrote = at::equal(staged.tensors.at("mine").local, mine);
    return SaveResult{};
  });
  EXPECT_NO_THROW(saver.wait_until_staged());
  EXPECT_NO_THROW(saver.wait());
  EXPECT_TRUE(wrote);
  EXPECT_EQ(saver.staging_bytes(), need);
}

// Large tensors are copied in 1 MiB pieces over several threads, with a strided one (copy_)
// and tensors smaller than a piece among them: every byte lands in its own slot.
TEST(AsyncSave, PiecesOfLargeTensorsLandWhereTheyBelong) {
  TempRoot root;
  ShardedStateDict state;
  const at::Tensor big = at::randn({(7 << 20) / 8 + 3, 2});  // 3.5 MiB + 24 bytes: a partial piece
  const at::Tensor small = at::arange(5, at::kInt);
  const at::Tensor strided = at::randn({64, 64}).t();
  state.tensors.emplace("big", ShardedTensor::whole(big));
  state.tensors.emplace("small", ShardedTensor::whole(small));
  state.tensors.emplace("strided", ShardedTensor::whole(strided));
  AsyncCheckpointSaver saver;
  (void)saver.save(root.path, "pieces", state);
  saver.wait_until_staged();
  ASSERT_TRUE(saver.wait().has_value());
  const ShardedStateDict back = read_checkpoint(root.path / "pieces");
  EXPECT_TRUE(at::equal(back.at("big").local, big));
  EXPECT_TRUE(at::equal(back.at("small").local, small));
  EXPECT_TRUE(at::equal(back.at("strided").local, strided));
}

// The background half runs at a lower CPU priority than the caller (by background_niceness,
// capped at Linux's lowest, 19), so that a save takes only the cores training leaves idle; 0
// keeps the caller's.
TEST(AsyncSave, TheBackgroundSaveYieldsTheCoresToTraining) {
  const auto niceness_of_this_thread = [] {
    errno = 0;
    const int value = ::getpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()));
    EXPECT_EQ(errno, 0);
    return value;
  };
  const int caller = niceness_of_this_thread();
  for (const int increment : {19, 5, 0}) {
    SCOPED_TRACE("background_niceness " + std::to_string(increment));
    TempRoot root;
    TrainingSetup a(at::kBFloat16);
    a.step();
    int background = -100;
    AsyncCheckpointSaver saver(AsyncSaveOptions().background_niceness(increment).on_tensor_staged(
        [&](const std::string&) { background = niceness_of_this_thread(); }));
    (void)saver.save(root.path, "step-1", training_state_dict(*a.model, *a.optimizer));
    saver.wait_until_staged();
    ASSERT_TRUE(saver.wait().has_value());
    EXPECT_EQ(background, std::min(caller + increment, 19));
    EXPECT_EQ(niceness_of_this_thread(), caller) << "the caller's own priority is unchanged";
  }
  EXPECT_THROW(AsyncCheckpointSaver(AsyncSaveOptions().background_niceness(20)), c10::Error);
  EXPECT_THROW(AsyncCheckpointSaver(AsyncSaveOptions().background_niceness(-1)), c10::Error);
}

// A staging error is thrown once: a second wait_until_staged() (or wait()) has nothing to throw.
TEST(AsyncSave, AStagingErrorIsThrownOnce) {
  TempRoot root;
  ShardedStateDict bad;
  bad.tensors.emplace("no_data", ShardedTensor::whole(at::empty({4}, at::device(at::kMeta))));
  AsyncCheckpointSaver saver;
  (void)saver.save(root.path, "bad", bad);
  EXPECT_NE(error_of([&] { saver.wait_until_staged(); }).find("meta"), std::string::npos);
  EXPECT_NO_THROW(saver.wait_until_staged());
  EXPECT_FALSE(saver.wait().has_value());
  EXPECT_FALSE(fs::exists(root.path / "bad"));
}

// What save_checkpoint would refuse — shards that do not tile their tensor, a common state JSON
// cannot hold, a name taken by a dangling link — save() refuses itself, before anything is
// in flight: found by the writer, the error would surface only at the next save().
TEST(AsyncSave, AStateOrNameSaveCheckpointRefusesIsRefusedBySaveItself) {
  TempRoot root;
  AsyncCheckpointSaver saver;
  ShardedStateDict gap;
  gap.tensors["w"] = {at::zeros({2, 4}), {4, 4}, {0, 0}, 0};
  EXPECT_NE(error_of([&] {
              (void)saver.save(root.path, "gap", gap);
            }).find("key 'w': replica-0 shards cover 8 of 16 elements"),
            std::string::npos);
  EXPECT_FALSE(saver.in_flight());
  ShardedStateDict nan;
  nan.tensors["w"] = ShardedTensor::whole(at::zeros({4}));
  nan.common["loss"] = std::nan("");
  EXPECT_NE(error_of([&] {
              (void)saver.save(root.path, "nan", nan);
            }).find("'/loss': nan, which JSON cannot hold"),
            std::string::npos);
  EXPECT_FALSE(saver.in_flight());
  ShardedStateDict good;
  good.tensors["w"] = ShardedTensor::whole(at::zeros({4}));
  fs::create_symlink(root.path / "nowhere", root.path / "dangling");
  EXPECT_NE(error_of([&] {
              (void)saver.save(root.path, "dangling", good);
            }).find("dangling: already exists"),
            std::string::npos);
  EXPECT_FALSE(saver.in_flight());
  EXPECT_FALSE(saver.wait().has_value());
  EXPECT_FALSE(fs::exists(root.path / "gap"));
  EXPECT_FALSE(fs::exists(root.path / "nan"));
}

std::string message_of(const std::exception_ptr& error) {
  try {
    if (error) std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

// With a Writer of the caller's (a collective save), an error of this process's part is not
// thrown by save(): it is handed to the writer, which tells the other ranks, and thrown by
// wait_until_staged() without waiting for the writer; the writer's own (agreed) error follows
// at wait().
TEST(AsyncSave, AWritersStagingErrorIsHandedToItAndThrownWithoutWaitingForIt) {
  at::Tensor changed = at::zeros({4});
  ShardedStateDict stale;
  stale.tensors["changed"] = ShardedTensor::whole(changed);
  changed.add_(1);  // a step since the state dict was built
  ShardedStateDict undefined;
  undefined.tensors["w"] = ShardedTensor::whole(at::zeros({4}));
  undefined.tensors["u"] = ShardedTensor{};
  for (const auto& [state, expected] : std::vector<std::pair<ShardedStateDict, std::string>>{
           {stale, "changed since the state dict was built (changed)"},
           {undefined, "key 'u': undefined tensor"}}) {
    SCOPED_TRACE(expected);
    AsyncCheckpointSaver saver;
    std::promise<void> told;
    std::shared_future<void> released = told.get_future().share();
    std::string handed = "nothing";
    EXPECT_FALSE(saver.save(
        state,
        [&, released](const ShardedStateDict&, const std::exception_ptr& failed) -> SaveResult {
          handed = message_of(failed);
          // A bound, not a timing: released at once unless wait_until_staged() waits for this.
          if (released.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
            throw std::runtime_error("the writer was waited for");
          }
          throw std::runtime_error("agreed: rank 3 failed");
        }));
    EXPECT_NE(error_of([&] { saver.wait_until_staged(); }).find(expected), std::string::npos);
    EXPECT_TRUE(saver.in_flight()) << "the writer is still telling the other ranks";
    told.set_value();
    EXPECT_NE(error_of([&] { (void)saver.wait(); }).find("agreed: rank 3 failed"),
              std::string::npos);
    EXPECT_NE(handed.find(expected), std::string::npos) << handed;
    EXPECT_FALSE(saver.wait().has_value());
  }
}

// A Writer handed a failure must write nothing and throw: one that returns a result anyway
// is refused at wait(), which never returns a result for a save that staged nothing.
TEST(AsyncSave, AWriterThatSucceedsAfterAFailedStagingIsAnError) {
  ShardedStateDict undefined;
  undefined.tensors["u"] = ShardedTensor{};
  AsyncCheckpointSaver saver;
  (void)saver.save(undefined,
                   [](const ShardedStateDict&, const std::exception_ptr&) { return SaveResult{}; });
  EXPECT_NE(error_of([&] { saver.wait_until_staged(); }).find("undefined tensor"),
            std::string::npos);
  EXPECT_NE(
      error_of([&] { (void)saver.wait(); }).find("the writer succeeded after a failed staging"),
      std::string::npos);
  EXPECT_FALSE(saver.wait().has_value());
}

// Every staged tensor starts 64-byte aligned in the arena, whatever the dtypes before it.
TEST(AsyncSave, StagedTensorsAreAlignedAndExact) {
  ShardedStateDict state;
  const std::map<std::string, at::Tensor> tensors{{"a_bool", at::ones({3}, at::kBool)},
                                                  {"b_float", at::arange(5, at::kFloat)},
                                                  {"c_half", at::arange(3, at::kHalf)},
                                                  {"d_double", at::arange(7, at::kDouble)},
                                                  {"e_byte", at::arange(1, at::kByte)}};
  for (const auto& [key, t] : tensors) state.tensors.emplace(key, ShardedTensor::whole(t));
  AsyncCheckpointSaver saver;
  std::vector<std::string> checked;
  (void)saver.save(state, [&](const ShardedStateDict& staged, const std::exception_ptr& failed) {
    if (failed) std::rethrow_exception(failed);
    for (const auto& [key, t] : tensors) {
      const at::Tensor& copy = staged.tensors.at(key).local;
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(copy.const_data_ptr()) % 64, 0u) << key;
      EXPECT_TRUE(at::equal(copy, t)) << key;
      checked.push_back(key);
    }
    return SaveResult{};
  });
  ASSERT_TRUE(saver.wait().has_value());
  EXPECT_EQ(checked.size(), tensors.size());
  EXPECT_EQ(saver.staging_bytes(), 5u * 64);
}

// The arena only grows: a save of a smaller state, after a larger reservation, reuses it.
TEST(AsyncSave, ASmallerStateReusesTheLargerArena) {
  TempRoot root;
  ShardedStateDict state;
  state.tensors.emplace("w", ShardedTensor::whole(at::arange(16, at::kFloat)));
  AsyncCheckpointSaver saver;
  saver.reserve(std::size_t{1} << 20);
  (void)saver.save(root.path, "small", state);
  ASSERT_TRUE(saver.wait().has_value());
  EXPECT_EQ(saver.staging_bytes(), std::size_t{1} << 20);
  saver.reserve(64);
  EXPECT_EQ(saver.staging_bytes(), std::size_t{1} << 20);
  EXPECT_TRUE(
      at::equal(read_checkpoint(root.path / "small").at("w").local, at::arange(16, at::kFloat)));
}

// A tensor given a new shape meanwhile (set_data moves no version counter) is refused before
// it is copied, whatever its layout: a strided one would be broadcast into its slot.
TEST(AsyncSave, ATensorReshapedBeforeItIsStagedIsRefused) {
  TempRoot root;
  at::Tensor strided = at::arange(16, at::kFloat).view({4, 4}).t();
  ShardedTensor shard;
  shard.local = strided;
  shard.global_shape = {4, 4};
  shard.global_offset = {0, 0};
  ShardedStateDict state;
  state.tensors.emplace("a", ShardedTensor::whole(at::zeros({2})));
  state.tensors.emplace("b", std::move(shard));
  AsyncCheckpointSaver saver(AsyncSaveOptions().on_tensor_staged([&](const std::string& key) {
    // Four elements, strided: broadcastable to [4, 4].
    if (key == "a") strided.set_data(at::arange(8, at::kFloat).slice(0, 0, 8, 2));
  }));
  (void)saver.save(root.path, "reshaped", state);
  EXPECT_NE(error_of([&] {
              saver.wait_until_staged();
            }).find("'b' changed from Float [4, 4] to Float [4] while it was being staged"),
            std::string::npos);
  EXPECT_FALSE(saver.wait().has_value());
  EXPECT_FALSE(fs::exists(root.path / "reshaped"));
}

// on_tensor_staged(key) is called once the key's bytes are in the arena: a change made then
// (here one that no version counter sees) is not in the checkpoint.
TEST(AsyncSave, OnTensorStagedIsCalledAfterTheTensorIsCopied) {
  TempRoot root;
  const at::Tensor a = at::arange(4, at::kFloat);
  ShardedStateDict state;
  state.tensors.emplace("a", ShardedTensor::whole(a));
  std::vector<std::string> keys;
  AsyncCheckpointSaver saver(AsyncSaveOptions().on_tensor_staged([&](const std::string& key) {
    keys.push_back(key);
    a.data_ptr<float>()[0] = 42;
  }));
  (void)saver.save(root.path, "copied", state);
  saver.wait_until_staged();
  ASSERT_TRUE(saver.wait().has_value());
  EXPECT_EQ(keys, std::vector<std::string>{"a"});
  EXPECT_TRUE(
      at::equal(read_checkpoint(root.path / "copied").at("a").local, at::arange(4, at::kFloat)));
}

// A saver destroyed with a failed save nobody collected prints its error: a destructor does not
// throw, and the user must still hear that the checkpoint was not written.
TEST(AsyncSave, TheDestructorPrintsAnErrorNobodyCollected) {
  TempRoot root;
  const fs::path not_a_root = root.path / "file";  // only the writer, in the background, finds out
  testing::write_file(not_a_root, "x");
  ShardedStateDict state;
  state.tensors.emplace("w", ShardedTensor::whole(at::zeros({4})));
  ::testing::internal::CaptureStderr();
  {
    AsyncCheckpointSaver saver;
    (void)saver.save(not_a_root, "s", state);
  }
  const std::string printed = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(printed.find("a background checkpoint save failed and nobody asked: "),
            std::string::npos)
      << printed;
  EXPECT_NE(printed.find(not_a_root.string()), std::string::npos) << printed;
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::checkpoint
