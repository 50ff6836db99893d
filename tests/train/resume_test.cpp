// Resuming is bitwise: N steps straight equal k steps, a stop, --resume, N − k steps — the
// same losses, and a final checkpoint with the same bytes (every chunk checksum of the
// manifest), in BF16 and in FP16 with dynamic loss scaling. SIGTERM mid-run saves, exits 0,
// and --resume continues from there.
#include "checkpointing.h"
#include "train/train_program.h"

#include <gtest/gtest.h>

#include <cmath>
#include <csignal>

namespace train {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using namespace train::testing;

class BitwiseResume : public ::testing::TestWithParam<std::string> {};

TEST_P(BitwiseResume, StopAndResumeEqualsStraight) {
  Scratch dir;
  write_corpus(dir / "corpus.txt");
  // Gradient accumulation and a validation pass inside the run make the data position and
  // the evaluation's effect on state part of what must survive.
  auto common =
      tiny_model() + std::vector<std::string>{"--data",       (dir / "corpus.txt").string(),
                                              "--precision",  GetParam(),
                                              "--steps",      "8",
                                              "--grad-accum", "2",
                                              "--eval-every", "3",
                                              "--ckpt-every", "100",
                                              "--lr",         "1e-2",
                                              "--warmup",     "2"};
  // FP16 starts from a loss scale that overflows: skipped steps and the scaler's back-off are
  // then part of the state a resume must carry.
  if (GetParam() == "fp16") common = common + std::vector<std::string>{"--loss-scale", "1e6"};
  const ProgramRun straight =
      run_program(dir.path(), common + std::vector<std::string>{"--out", "straight"});
  ASSERT_EQ(straight.status, 0) << straight.err;

  const ProgramRun first = run_program(
      dir.path(), common + std::vector<std::string>{"--out", "split", "--stop-at", "5"});
  ASSERT_EQ(first.status, 0) << first.err;
  EXPECT_EQ(read_text(dir / "split/checkpoints/latest"), "step-000005\n");
  EXPECT_NE(first.out.find("stopped     by --stop-at after step 5 of 8"), std::string::npos)
      << first.out;
  // Only what belongs to this process is given again: the run's settings (steps, schedule,
  // cadence, model, data) come from the checkpoint.
  const ProgramRun second = run_program(
      dir.path(), {"--out", "split", "--resume", "--progress", "lines", "--threads", "1"});
  ASSERT_EQ(second.status, 0) << second.err;
  EXPECT_NE(second.out.find("resumed      from"), std::string::npos);

  const auto a = read_metrics(dir / "straight/metrics.jsonl");
  const auto b = read_metrics(dir / "split/metrics.jsonl");
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 8u) << "the resumed run appends to the metrics of the first part";
  for (size_t i = 0; i < 8; ++i) {
    SCOPED_TRACE("step " + std::to_string(i + 1));
    EXPECT_EQ(b[i].step, a[i].step);
    EXPECT_EQ(b[i].loss, a[i].loss);  // bitwise: exact equality on purpose
    EXPECT_EQ(b[i].aux_loss, a[i].aux_loss);
    // Skipped steps have no finite norm (written as null): NaN on both sides is a match.
    EXPECT_TRUE(b[i].grad_norm == a[i].grad_norm ||
                (std::isnan(b[i].grad_norm) && std::isnan(a[i].grad_norm)))
        << b[i].grad_norm << " vs " << a[i].grad_norm;
    EXPECT_EQ(b[i].loss_scale, a[i].loss_scale);
    EXPECT_EQ(b[i].lr, a[i].lr);
    EXPECT_EQ(b[i].val_loss, a[i].val_loss);
    EXPECT_EQ(b[i].skipped_total, a[i].skipped_total);
  }
  if (GetParam() == "fp16") {
    EXPECT_GT(a.back().skipped_total, 0) << "the FP16 run must exercise skipped steps";
    EXPECT_LT(a.back().loss_scale, 1e6) << "and the scaler's back-off";
  }
  const auto final_a = chunk_checksums(dir / "straight/checkpoints/step-000008");
  const auto final_b = chunk_checksums(dir / "split/checkpoints/step-000008");
  ASSERT_FALSE(final_a.empty());
  EXPECT_EQ(final_a, final_b);
  EXPECT_TRUE(final_a.count("blocks.0.moe.expert_bias")) << "the expert bias is checkpointed";
  EXPECT_TRUE(final_a.count("optimizer.state.fp32_param.tok_emb.weight"));
  EXPECT_FALSE(final_a.count("optimizer.state.fp32_param.blocks.0.moe.router.weight"))
      << "FP32 parameters have no master copy";
}

INSTANTIATE_TEST_SUITE_P(Precisions, BitwiseResume, ::testing::Values("bf16", "fp16"));

// A resume where LibTorch picks other CPU kernels (another CPU model; here, the same one with
// oneDNN capped to AVX-512 without BF16, as on an older CPU) is said to leave the bitwise path; one
// on the same says nothing.
TEST(ResumeSettings, OtherCpuKernelsAreSaidToLeaveTheBitwisePath) {
  Scratch dir;
  write_corpus(dir / "corpus.txt");
  const ProgramRun first = run_program(
      dir.path(), tiny_model() + std::vector<std::string>{"--data", "corpus.txt", "--steps", "4",
                                                          "--ckpt-every", "100", "--out", "a",
                                                          "--stop-at", "2", "--threads", "1"});
  ASSERT_EQ(first.status, 0) << first.err;
  fs::copy(dir / "a", dir / "b", fs::copy_options::recursive);
  const std::vector<std::string> resume = {"--resume", "--threads", "1", "--progress", "lines"};
  const ProgramRun same =
      run_program(dir.path(), resume + std::vector<std::string>{"--out", "a"}, "same");
  ASSERT_EQ(same.status, 0) << same.err;
  EXPECT_EQ(same.out.find("CPU kernels chosen for"), std::string::npos) << same.out;

  ProgramRun capped;
  {
    // Inherited by the program; the test's own value restored after.
    const mixprec::test::ScopedEnvironmentVariable cap("ONEDNN_MAX_CPU_ISA", "AVX512_CORE");
    capped = run_program(dir.path(), resume + std::vector<std::string>{"--out", "b"}, "capped");
  }
  ASSERT_EQ(capped.status, 0) << capped.err;
  EXPECT_NE(capped.out.find(" ONEDNN_MAX_CPU_ISA=AVX512_CORE where the checkpoint's run had "),
            std::string::npos)
      << capped.out;
  EXPECT_NE(capped.out.find("so the run goes on, but not bit for bit"), std::string::npos)
      << capped.out;
}

// A setting given again on --resume changes the run from there, and the run says so; the
// relative --data of the first part names the same file in another spelling; a finished run
// has nothing to resume, and a --steps below its step is refused.
TEST(ResumeSettings, AFlagGivenAgainChangesTheRunAndIsReported) {
  Scratch dir;
  write_corpus(dir / "corpus.txt");
  const auto tiny = tiny_model();
  const ProgramRun first = run_program(
      dir.path(),
      tiny + std::vector<std::string>{"--data", "corpus.txt", "--steps", "8", "--warmup", "2",
                                      "--lr", "1e-2", "--weight-decay", "0.1", "--ckpt-every",
                                      "100", "--out", "a", "--stop-at", "4"});
  ASSERT_EQ(first.status, 0) << first.err;
  fs::copy(dir / "a", dir / "b", fs::copy_options::recursive);

  const std::vector<std::string> mine = {"--progress", "lines", "--threads", "1"};
  const ProgramRun same = run_program(
      dir.path(),
      mine + std::vector<std::string>{"--out", "a", "--resume", "--data", "./corpus.txt"}, "same");
  ASSERT_EQ(same.status, 0) << same.err;
  EXPECT_NE(same.out.find("run          8 steps"), std::string::npos) << same.out;
  EXPECT_NE(same.out.find("changed      --data ./corpus.txt (was --data corpus.txt)"),
            std::string::npos)
      << same.out;
  EXPECT_EQ(same.out.find("intra-op threads per rank where"), std::string::npos) << same.out;

  // Another text under the old name is refused, before anything is written.
  fs::create_directories(dir / "elsewhere");
  write_corpus(dir / "elsewhere/corpus.txt", 300);
  const auto before_other = snapshot(dir / "b");
  const ProgramRun other = run_program(
      dir.path(),
      mine + std::vector<std::string>{"--out", "b", "--resume", "--data", "elsewhere/corpus.txt"},
      "other");
  EXPECT_EQ(other.status, 2);
  EXPECT_NE(other.err.find("elsewhere/corpus.txt is not the text checkpoint "), std::string::npos)
      << other.err;
  EXPECT_EQ(snapshot(dir / "b"), before_other);

  const ProgramRun decayed = run_program(
      dir.path(), mine + std::vector<std::string>{"--out", "b", "--resume", "--weight-decay", "5"},
      "decayed");
  ASSERT_EQ(decayed.status, 0) << decayed.err;
  EXPECT_NE(decayed.out.find("changed      --weight-decay 5 (was --weight-decay 0.1)"),
            std::string::npos)
      << decayed.out;
  EXPECT_EQ(decayed.out.find("the learning rate goes"), std::string::npos) << decayed.out;
  const auto a = read_metrics(dir / "a/metrics.jsonl");
  const auto b = read_metrics(dir / "b/metrics.jsonl");
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 8u);
  EXPECT_EQ(b[4].loss, a[4].loss) << "step 5's forward runs on the weights of step 4";
  EXPECT_EQ(b[4].lr, a[4].lr);
  EXPECT_NE(b[5].loss, a[5].loss) << "step 5's update decayed the weights 50x harder";

  // Another thread count is this process's own, and said to leave the bitwise path.
  const ProgramRun longer = run_program(
      dir.path(),
      {"--progress", "lines", "--threads", "2", "--out", "a", "--resume", "--steps", "12"},
      "longer");
  ASSERT_EQ(longer.status, 0) << longer.err;
  EXPECT_NE(longer.out.find("2 intra-op threads per rank where the checkpoint's run had 1: the "
                            "run goes on, but not bit for bit"),
            std::string::npos)
      << longer.out;
  EXPECT_NE(longer.out.find("changed      --steps 12 (was --steps 8)"), std::string::npos)
      << longer.out;
  EXPECT_NE(longer.out.find("the learning rate goes from 1.00e-03 at step 8 to"), std::string::npos)
      << "the decay reached its floor at step 8 and starts again over 12 steps\n"
      << longer.out;

  const ProgramRun complete =
      run_program(dir.path(), mine + std::vector<std::string>{"--out", "a", "--resume"}, "done");
  EXPECT_EQ(complete.status, 0) << complete.err;
  EXPECT_NE(complete.out.find("is at step 12 of --steps 12: the run is complete"),
            std::string::npos)
      << complete.out;
  const auto before = snapshot(dir / "a");
  const ProgramRun shorter = run_program(
      dir.path(), mine + std::vector<std::string>{"--out", "a", "--resume", "--steps", "6"},
      "shorter");
  EXPECT_EQ(shorter.status, 2);
  EXPECT_NE(shorter.err.find("--steps 6: checkpoint "), std::string::npos) << shorter.err;
  EXPECT_NE(shorter.err.find("is already at step 12; give a larger --steps"), std::string::npos)
      << shorter.err;
  EXPECT_EQ(snapshot(dir / "a"), before) << "a refused resume writes nothing";
}

TEST(SigtermResume, SigtermSavesExitsZeroAndResumeContinues) {
  Scratch dir;
  write_corpus(dir / "corpus.txt");
  const auto common =
      tiny_model() + std::vector<std::string>{"--data",       (dir / "corpus.txt").string(),
                                              "--ckpt-every", "1000",
                                              "--eval-every", "1000",
                                              "--out",        "run"};
  const pid_t pid =
      start_program(dir.path(), common + std::vector<std::string>{"--steps", "100000"}, "first");
  // Wait until a few steps are logged, then ask the run to stop.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (count_lines(dir / "run/metrics.jsonl") < 3 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  const ProgramRun first = wait_program(dir.path(), pid, "first");
  ASSERT_EQ(first.status, 0) << "SIGTERM is a clean stop: " << first.err;
  EXPECT_NE(first.out.find("stopped     by SIGTERM"), std::string::npos) << first.out;

  const auto before = read_metrics(dir / "run/metrics.jsonl");
  ASSERT_GE(before.size(), 3u);
  const int64_t stopped_at = before.back().step;
  EXPECT_LT(stopped_at, 100000);
  EXPECT_EQ(read_text(dir / "run/checkpoints/latest"), checkpoint_name(stopped_at) + "\n")
      << "the step in progress was finished and saved";

  const std::string target = std::to_string(stopped_at + 3);
  const ProgramRun second = run_program(
      dir.path(), common + std::vector<std::string>{"--resume", "--steps", target}, "second");
  ASSERT_EQ(second.status, 0) << second.err;
  const auto after = read_metrics(dir / "run/metrics.jsonl");
  ASSERT_EQ(after.size(), before.size() + 3);
  for (size_t i = 0; i < after.size(); ++i) EXPECT_EQ(after[i].step, static_cast<int64_t>(i + 1));
  EXPECT_TRUE(
      fs::exists(dir / "run/checkpoints" / checkpoint_name(stopped_at + 3) / "manifest.json"));
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace train
