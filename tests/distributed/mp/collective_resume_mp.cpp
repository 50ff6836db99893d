// Checkpoints that cross launches: saved by N ranks, resumed by M (tests/distributed/resume.sh),
// and a save (blocking or in the background) during which a rank is SIGKILLed
// (tests/distributed/crash_save.sh). These cases run
// only from those scripts, which set MIXPREC_TEST_ROOT (skipped otherwise).
//
// "Continues as it would from the same checkpoint in one process": every rank feeds the same
// batch, batch(step), so every rank's gradients are identical and the averaged gradient is
// the single-process gradient (exactly: see Continue). The reference is a Float16Optimizer in this
// process that loads the same checkpoint with the single-process loader and takes the same steps.
#include "distributed/mp/zero_support.h"
#include "mixprec/checkpoint/format/crash_point.h"
#include "mixprec/checkpoint/format/root_writer.h"
#include "mixprec/checkpoint/training_state.h"
#include "mixprec/distributed/collective_checkpoint.h"
#include "mixprec/distributed/init.h"
#include "support/remove_tree.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>

namespace mixprec::testing {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

namespace fs = std::filesystem;

constexpr int64_t kSavedAt = 3, kMore = 3;

fs::path test_root() { return env_or_empty("MIXPREC_TEST_ROOT"); }

// N ranks train kSavedAt steps and save "step-3".
TEST(CollectiveResume, Save) {
  if (test_root().empty()) GTEST_SKIP() << "run by tests/distributed/resume.sh";
  ZeroRun run;
  for (int64_t step = 0; step < kSavedAt; ++step) EXPECT_TRUE(run.step(step).success);
  distributed::save_training_state(test_root(), "step-3", *run.model, *run.optimizer,
                                   {{"step", kSavedAt}});
}

// M ranks load it and continue, bitwise as the same checkpoint continued in one process, for
// every M up to 4, not only powers of two. Why exact: every rank's gradient g is the same,
// and the reducer averages sum/M. For BF16 gradients (summed in FP32) every partial sum kg
// is exact. For FP32 ones the partial sums of identical values are 2g and 4g (exact) and 3g,
// rounded by at most half an ulp of 3g, i.e. at most one ulp of g; then 3g'/3 = g + e/3 with
// |e/3| <= ulp(g)/3 < ulp(g)/2, which rounds to g. So the averaged gradient is g for M <= 4,
// and ZeRO-1 steps exactly what one process steps. ZeRO-1 is also checked against plain
// data parallelism on the same M ranks (a Float16Optimizer per rank, loaded with the
// single-process loader), which holds for any data.
TEST(CollectiveResume, Continue) {
  if (test_root().empty()) GTEST_SKIP() << "run by tests/distributed/resume.sh";
  ZeroRun zero;
  const distributed::ResumeResult loaded =
      distributed::load_training_state(test_root(), *zero.model, *zero.optimizer);
  EXPECT_EQ(loaded.dir.filename(), "step-3");
  EXPECT_EQ(loaded.user.at("step"), kSavedAt);
  EXPECT_TRUE(loaded.model.clean() && loaded.optimizer.clean()) << loaded.optimizer.to_string();

  // The uninterrupted run: one process, the same batches, never saved nor loaded.
  Fp16Run straight(/*data_parallel=*/false);
  for (int64_t step = 0; step < kSavedAt; ++step) straight.step(step);
  Fp16Run single(/*data_parallel=*/false), dp(/*data_parallel=*/true);
  const checkpoint::ResumeResult one =
      checkpoint::load_training_state(test_root(), *single.model, *single.optimizer);
  EXPECT_TRUE(one.optimizer.clean()) << one.optimizer.to_string();
  ASSERT_FALSE(one.rng.notes.empty());
  EXPECT_NE(one.rng.notes[0].find("per-rank RNG states (rng.rank.*)"), std::string::npos);
  checkpoint::load_training_state(test_root(), *dp.model, *dp.optimizer);
  // Loading is exact whatever N and M: the pieces are the saved values.
  expect_zero_state_equals(*zero.optimizer, single.optimizer->sharded_state_dict(), "loaded");
  expect_params_equal(*zero.model, *single.model, "loaded");
  // ... and they are the state the N ranks saved (N ranks of ZeRO-1 on identical gradients
  // step exactly as one process, see above), gathered over the M ranks.
  expect_zero_state_equals(*zero.optimizer, straight.optimizer->sharded_state_dict(),
                           "loaded vs saved");
  expect_params_equal(*zero.model, *straight.model, "loaded vs saved");

  for (int64_t step = kSavedAt; step < kSavedAt + kMore; ++step) {
    EXPECT_TRUE(zero.step(step).success);
    single.step(step);
    dp.step(step);
    straight.step(step);
  }
  expect_params_equal(*zero.model, *straight.model, "ZeRO-1 vs the uninterrupted run");
  expect_zero_state_equals(*zero.optimizer, straight.optimizer->sharded_state_dict(),
                           "vs the uninterrupted run");
  expect_params_equal(*zero.model, *dp.model, "ZeRO-1 vs plain DP");
  expect_zero_state_equals(*zero.optimizer, dp.optimizer->sharded_state_dict(), "vs plain DP");
  expect_params_equal(*zero.model, *single.model, "ZeRO-1 vs one process");
  expect_zero_state_equals(*zero.optimizer, single.optimizer->sharded_state_dict(),
                           "vs one process");
}

// ---- a rank killed during a collective save (tests/distributed/crash_save.sh)
// ---------------------

// Crash points (format/crash_point.h) a save passes on this rank before its data file's
// first tensor piece: rank 0 opens the root and stages first (measured on a scratch root, as
// the real save will find its root: no repair needed); every rank then creates its file and
// writes the header (3 points: before create, before header write, after header write).
uint64_t points_before_first_piece(int rank) {
  uint64_t opening = 0;
  if (rank == 0) {
    const fs::path scratch = test_root() / "scratch";
    checkpoint::detail::reset_crash_points();
    {
      checkpoint::RootWriter writer(scratch);
      auto staging = writer.stage("probe");
    }
    opening = checkpoint::detail::crash_points_reached();
    remove_tree(scratch);
  }
  return opening + 3;
}

// N ranks train, save "a" (if the root has none yet), take a step, and start saving "b";
// rank MIXPREC_TEST_DIE_RANK raises SIGKILL halfway through writing its data file. This test
// never finishes on that rank: the script expects the launch to fail.
TEST(CollectiveCrash, SaveThenDie) {
  if (test_root().empty()) GTEST_SKIP() << "run by tests/distributed/crash_save.sh";
  const int rank = world().rank();
  const int die = std::atoi(env_or_empty("MIXPREC_TEST_DIE_RANK").c_str());
  ZeroRun run;
  for (int64_t step = 0; step < kSavedAt; ++step) run.step(step);
  if (!fs::exists(test_root() / "a")) {
    distributed::save_training_state(test_root(), "a", *run.model, *run.optimizer,
                                     {{"step", kSavedAt}});
  }
  run.step(kSavedAt);
  const ShardedStateDict state = distributed::training_state_dict(*run.model, *run.optimizer);
  if (rank == die) {
    size_t pieces = 0;
    for (const auto& [key, t] : state.tensors) pieces += t.local.numel() > 0 ? 1 : 0;
    ASSERT_GE(pieces, 4u) << "the dying rank must have several tensors to write";
    const uint64_t kill_at = points_before_first_piece(rank) + pieces / 2;
    ::setenv("MIXPREC_CRASH_POINT", std::to_string(kill_at).c_str(), 1);
    checkpoint::detail::reset_crash_points();
  }
  if (env_or_empty("MIXPREC_TEST_ASYNC").empty()) {
    distributed::save_checkpoint(world(), test_root(), "b", state);
  } else {
    // In the background, on a group of its own, while training goes on (mixprec-train
    // --async-save): the rank dies on the save's thread.
    distributed::InitOptions group;
    group.group_name = "checkpoint";
    group.timeout = std::chrono::seconds(60);
    checkpoint::AsyncCheckpointSaver saver;
    (void)distributed::save_checkpoint_async(saver, distributed::init_from_env(group), test_root(),
                                             "b", state);
    saver.wait_until_staged();
    run.step(kSavedAt + 1);
    (void)saver.wait();
  }
  ADD_FAILURE() << "rank " << rank << ": the save of 'b' should not have succeeded";
}

// After the crash: `latest` still names "a", which loads on this M exactly (its pieces are
// the values a single process loads). With MIXPREC_TEST_SAVE_AFTER, the next save removes
// every stale staging directory (MIXPREC_TEST_EXPECT_STALE: there must have been one).
TEST(CollectiveCrash, PreviousCheckpointStillLoads) {
  if (test_root().empty()) GTEST_SKIP() << "run by tests/distributed/crash_save.sh";
  std::ifstream latest(test_root() / "latest");
  std::string name;
  std::getline(latest, name);
  EXPECT_EQ(name, "a");
  EXPECT_FALSE(fs::exists(test_root() / "b"));
  std::vector<std::string> stale;
  for (const auto& entry : fs::directory_iterator(test_root())) {
    const std::string n = entry.path().filename().string();
    if (n.starts_with(".tmp-")) stale.push_back(n);
  }
  world().barrier();  // every rank has looked before anyone saves

  ZeroRun zero;
  distributed::load_training_state(test_root(), *zero.model, *zero.optimizer);
  Fp16Run single(/*data_parallel=*/false);
  checkpoint::load_training_state(test_root() / "a", *single.model, *single.optimizer);
  expect_zero_state_equals(*zero.optimizer, single.optimizer->sharded_state_dict(), "'a'");
  expect_params_equal(*zero.model, *single.model, "'a'");

  if (!env_or_empty("MIXPREC_TEST_EXPECT_STALE").empty()) {
    EXPECT_FALSE(stale.empty()) << "a killed rank 0 leaves its staging directory";
  }
  if (env_or_empty("MIXPREC_TEST_SAVE_AFTER").empty()) return;
  zero.step(kSavedAt);
  const checkpoint::SaveResult saved =
      distributed::save_training_state(test_root(), "c", *zero.model, *zero.optimizer);
  for (const std::string& s : stale) {
    EXPECT_NE(std::find(saved.cleaned_staging.begin(), saved.cleaned_staging.end(), s),
              saved.cleaned_staging.end())
        << s << " was not cleaned";
  }
  for (const auto& entry : fs::directory_iterator(test_root())) {
    EXPECT_FALSE(entry.path().filename().string().starts_with(".tmp-")) << entry.path();
  }
  std::ifstream now(test_root() / "latest");
  std::getline(now, name);
  EXPECT_EQ(name, "c");
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::testing
