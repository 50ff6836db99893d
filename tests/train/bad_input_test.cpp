// Bad input gets one line on stderr naming the problem, a non-zero exit status, and changes
// nothing on disk: an unknown flag, a missing or empty data file, --resume with nothing to
// resume, a checkpoint of another model configuration, a checkpoint directory that cannot be
// written, and a fresh run pointed at an existing run's checkpoints.
#include "train/train_program.h"

#include <gtest/gtest.h>

namespace train {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using namespace train::testing;

class BadInput : public ::testing::Test {
 protected:
  void SetUp() override { write_corpus(dir_ / "corpus.txt"); }

  std::vector<std::string> args(std::vector<std::string> extra) const {
    return tiny_model() +
           std::vector<std::string>{"--data", (dir_ / "corpus.txt").string(), "--steps", "2"} +
           extra;
  }

  // The contract: status 2, exactly one line "mixprec-train: …" holding `fragment`, and
  // nothing written under the scratch directory.
  void expect_refused(const std::vector<std::string>& argv, const std::string& fragment) {
    const auto before = snapshot(dir_.path());
    const ProgramRun run = run_program(dir_.path(), argv, "bad");
    EXPECT_EQ(run.status, 2) << run.err;
    EXPECT_EQ(run.err.rfind("mixprec-train: ", 0), 0u) << run.err;
    EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << run.err;
    EXPECT_NE(run.err.find(fragment), std::string::npos)
        << "stderr lacks '" << fragment << "': " << run.err;
    EXPECT_EQ(run.out, "");
    auto after = snapshot(dir_.path());
    after.erase("bad.out");
    after.erase("bad.err");
    auto expected = before;
    expected.erase("bad.out");
    expected.erase("bad.err");
    EXPECT_EQ(after, expected) << "a refused run must not write anything";
    EXPECT_FALSE(fs::exists(dir_ / "runs")) << "no run directory for a refused run";
  }

  Scratch dir_;
};

TEST_F(BadInput, UnknownFlag) {
  expect_refused(args({"--layerz", "2"}), "unknown flag '--layerz' (did you mean --layers?)");
}

TEST_F(BadInput, MissingDataFile) {
  const std::string missing = (dir_ / "nope.txt").string();
  expect_refused(tiny_model() + std::vector<std::string>{"--data", missing},
                 "data file " + missing + " does not exist");
}

TEST_F(BadInput, EmptyDataFile) {
  std::ofstream(dir_ / "empty.txt").flush();
  const std::string empty = (dir_ / "empty.txt").string();
  expect_refused(tiny_model() + std::vector<std::string>{"--data", empty},
                 "data file " + empty + " is empty");
}

TEST_F(BadInput, ResumeWithNoCheckpoint) {
  fs::create_directories(dir_ / "empty-run");
  expect_refused(args({"--resume", "--out", "empty-run"}),
                 "--resume: no checkpoint in empty-run/checkpoints");
  expect_refused(args({"--resume"}), "--resume: no checkpoint found under runs/");
}

TEST_F(BadInput, CheckpointOfAnotherModelConfiguration) {
  ASSERT_EQ(run_program(dir_.path(), args({"--out", "run", "--d-model", "32"})).status, 0);
  expect_refused(args({"--out", "run", "--resume", "--d-model", "64", "--steps", "4"}),
                 "was trained with --d-model 32; this run asks for --d-model 64");
  expect_refused(args({"--out", "run", "--resume", "--precision", "fp16", "--steps", "4"}),
                 "was trained with --precision bf16; this run asks for --precision fp16");
}

TEST_F(BadInput, CheckpointDirectoryNotWritable) {
  // A path below a regular file can never be created, whoever runs the test (root included).
  std::ofstream(dir_ / "a-file") << "x";
  expect_refused(args({"--ckpt-dir", (dir_ / "a-file/ckpt").string(), "--metrics",
                       (dir_ / "m.jsonl").string()}),
                 "cannot create checkpoint directory " + (dir_ / "a-file/ckpt").string());
  if (::geteuid() != 0) {  // permissions bind everyone but root
    fs::create_directories(dir_ / "read-only");
    fs::permissions(dir_ / "read-only", fs::perms::owner_read | fs::perms::owner_exec);
    expect_refused(args({"--ckpt-dir", (dir_ / "read-only").string(), "--metrics",
                         (dir_ / "m.jsonl").string()}),
                   "checkpoint directory " + (dir_ / "read-only").string() + " is not writable");
    fs::permissions(dir_ / "read-only", fs::perms::owner_all);
  }
}

// On --resume, flags are checked together with the run's own settings, read from its
// checkpoint, not with the defaults (which would refuse a trace within the run's --steps 700 as
// past "--steps 600"); a step the run has already taken cannot be stopped at or traced.
TEST_F(BadInput, ResumeChecksFlagsAgainstTheRunsOwnSettings) {
  const std::vector<std::string> run =
      tiny_model() +
      std::vector<std::string>{"--data", (dir_ / "corpus.txt").string(), "--out", "run"};
  ASSERT_EQ(
      run_program(dir_.path(), run + std::vector<std::string>{"--steps", "700", "--stop-at", "2"})
          .status,
      0);
  const auto resume = [&](const std::vector<std::string>& extra) {
    return std::vector<std::string>{"--out", "run", "--resume", "--threads", "1"} + extra;
  };
  expect_refused(resume({"--stop-at", "2"}), "--stop-at 2: checkpoint ");
  expect_refused(resume({"--profile-steps", "2:3"}), "--profile-steps 2:3: checkpoint ");
  const ProgramRun later =
      run_program(dir_.path(), resume({"--profile-steps", "650:651", "--stop-at", "3"}));
  EXPECT_EQ(later.status, 0) << later.err;
}

TEST_F(BadInput, AutoResumeWithoutADirectory) {
  expect_refused(args({"--auto-resume"}), "--auto-resume needs --out or --ckpt-dir");
  expect_refused(args({"--auto-resume", "--resume", "--out", "run"}),
                 "--auto-resume resumes when there is a checkpoint, --resume always");
}

TEST_F(BadInput, ValuesBeyondWhatTheProgramCanHold) {
  expect_refused(args({"--threads", "99999999999"}),
                 "--threads must lie in [0, 1024], got 99999999999");
  expect_refused(args({"--wait-for-ckpt-dir", "99999999999"}),
                 "--wait-for-ckpt-dir must lie in [0, 31536000] seconds, got 99999999999");
  expect_refused(args({"--ckpt-timeout", "0"}), "--ckpt-timeout must lie in [1, 31536000]");
}

TEST_F(BadInput, FreshRunIntoAnExistingRunsCheckpoints) {
  ASSERT_EQ(run_program(dir_.path(), args({"--out", "run"})).status, 0);
  expect_refused(args({"--out", "run"}),
                 "already holds a run (newest checkpoint: step-000002); --resume continues it");
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace train
