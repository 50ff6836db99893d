// Asynchronous saves: errors reported once, consistent snapshots (a step between building the
// state dict and staging it is refused), bounded staging of large and non-contiguous states.
#include "mixprec/checkpoint/async_save.h"

#include "checkpoint/support_training.h"
#include "mixprec/checkpoint/format/verify.h"
#include "mixprec/checkpoint/training_state.h"

#include "checkpoint/format/format_test_util.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>

#include <atomic>

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
  const std::string msg = error_of([&] { saver.save(root.path, "bad", bad); });
  EXPECT_NE(msg.find("meta"), std::string::npos) << msg;
  EXPECT_FALSE(saver.in_flight());
  EXPECT_FALSE(saver.wait().has_value()) << "the error was already reported by save()";
  EXPECT_FALSE(fs::exists(root.path / "bad"));

  saver.save(root.path, "good", training_state_dict(*a.model, *a.optimizer));
  const std::optional<SaveResult> result = saver.wait();
  ASSERT_TRUE(result.has_value());
  EXPECT_EQ(result->dir, root.path / "good");
  verify_checkpoint(root.path / "good");
}

TEST(AsyncSave, StepBetweenBuildingTheDictAndSavingIsRefused) {
  TempRoot root;
  TrainingSetup a(at::kBFloat16);
  a.step();
  ShardedStateDict state = training_state_dict(*a.model, *a.optimizer);  // step count 1
  a.step();  // moments, masters and params move to step 2
  AsyncCheckpointSaver saver;
  const std::string msg = error_of([&] { saver.save(root.path, "mixed", state); });
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
  options.piece_bytes(4096);  // the state spans many pieces
  options.staging_budget_bytes(4 * 4096);
  int staged = 0;
  bool step_now = true;
  options.on_piece_staged([&](const std::string&) {
    // Stands in for another thread of the training loop stepping while save() stages.
    if (++staged == 2 && step_now) a.step();
  });
  AsyncCheckpointSaver saver(options);
  const std::string msg =
      error_of([&] { saver.save(root.path, "torn", training_state_dict(*a.model, *a.optimizer)); });
  EXPECT_NE(msg.find("changed while it was being staged"), std::string::npos) << msg;
  EXPECT_FALSE(saver.in_flight());
  EXPECT_FALSE(saver.wait().has_value());
  EXPECT_FALSE(fs::exists(root.path / "torn"));

  // Without the step the same save goes through and holds exactly the state at save().
  step_now = false;
  const ShardedStateDict expected = training_state_dict(*a.model, *a.optimizer).clone();
  saver.save(root.path, "whole", training_state_dict(*a.model, *a.optimizer));
  a.step();  // after save() returned: allowed, and not in the checkpoint
  ASSERT_TRUE(saver.wait().has_value());
  const ShardedStateDict back = read_checkpoint(root.path / "whole");
  for (const auto& [key, t] : expected.tensors) {
    EXPECT_TRUE(at::equal(back.at(key).local, t.local)) << key;
  }
  EXPECT_EQ(back.common["optimizer"]["step"], expected.common["optimizer"]["step"]);
}

// Counts CPU allocations made through c10's CPU allocator while it is installed.
class CountingAllocator final : public c10::Allocator {
 public:
  CountingAllocator() : inner_(c10::GetCPUAllocator()) { c10::SetCPUAllocator(this, kPriority); }
  ~CountingAllocator() override { c10::SetCPUAllocator(inner_, kPriority); }
  c10::DataPtr allocate(size_t n) override {
    largest_ = std::max<size_t>(largest_, n);
    total_ += n;
    return inner_->allocate(n);
  }
  c10::DeleterFnPtr raw_deleter() const override { return inner_->raw_deleter(); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  size_t largest() const { return largest_; }
  size_t total() const { return total_; }

 private:
  static constexpr uint8_t kPriority = 200;
  c10::Allocator* inner_;
  std::atomic<size_t> largest_{0}, total_{0};
};

TEST(AsyncSave, NonContiguousStateFarAboveTheBudgetIsStagedPieceByPiece) {
  TempRoot root;
  ShardedStateDict state;
  at::manual_seed(5);
  std::vector<at::Tensor> originals;
  for (int i = 0; i < 6; ++i) {
    // 2 MiB each, transposed (strides [1, 512]): every piece is a strided gather.
    at::Tensor t = at::randn({512, 1024}).t();
    originals.push_back(t.contiguous());
    ShardedTensor shard;
    shard.local = t;
    shard.global_shape = t.sizes().vec();
    shard.global_offset = {0, 0};
    state.tensors.emplace("t" + std::to_string(i), std::move(shard));
  }
  state.tensors.emplace("scalar", ShardedTensor::whole(at::scalar_tensor(2.5)));
  AsyncSaveOptions options;
  options.piece_bytes(16 << 10);
  options.staging_budget_bytes(64 << 10);  // 12 MiB of state through 64 KiB
  AsyncCheckpointSaver saver(options);
  {
    CountingAllocator counting;
    saver.save(root.path, "strided", state);
    saver.wait();
    // Only piece-sized staging buffers: no tensor is ever flattened (copied) whole, so the
    // work is linear in the state's size.
    EXPECT_LE(counting.largest(), options.piece_bytes());
    EXPECT_LE(counting.total(), options.staging_budget_bytes());
  }
  EXPECT_LE(saver.peak_staged_bytes(), options.staging_budget_bytes());
  EXPECT_GT(saver.peak_staged_bytes(), 0u);
  const ShardedStateDict back = read_checkpoint(root.path / "strided");
  for (int i = 0; i < 6; ++i) {
    EXPECT_TRUE(at::equal(back.at("t" + std::to_string(i)).local, originals[i])) << i;
  }
  EXPECT_EQ(back.at("scalar").local.item<double>(), 2.5);
}

TEST(AsyncSave, PieceAndBudgetOptionsAreValidated) {
  AsyncSaveOptions small_piece;
  small_piece.piece_bytes(100);
  EXPECT_THROW(AsyncCheckpointSaver{small_piece}, c10::Error);
  AsyncSaveOptions small_budget;
  small_budget.piece_bytes(1 << 20);
  small_budget.staging_budget_bytes(1 << 19);
  EXPECT_THROW(AsyncCheckpointSaver{small_budget}, c10::Error);
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::checkpoint
