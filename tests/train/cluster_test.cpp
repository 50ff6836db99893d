// mixprec-train as a cluster runs it: a job requeued while its last incarnation still exits,
// two jobs pointed at one directory, a save cut off between its commit and `latest`, the
// scheduler's SIGTERM arriving twice, a staging budget that cannot hold the state, and a save
// that commits but warns.
#include "checkpointing.h"
#include "train/train_program.h"

#include <gtest/gtest.h>

#include <ctime>
#include <regex>
#include <set>

#include <sys/stat.h>
#include <unistd.h>

namespace train {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using namespace train::testing;

class Cluster : public ::testing::Test {
 protected:
  void SetUp() override { write_corpus(dir_ / "corpus.txt"); }

  std::vector<std::string> args(const std::vector<std::string>& extra) const {
    return tiny_model() +
           std::vector<std::string>{
               "--data", (dir_ / "corpus.txt").string(), "--out", "run", "--eval-every", "1000"} +
           extra;
  }

  // Starts a run that trains until stopped, and returns once the metrics hold `steps` steps.
  pid_t start_long_run(const std::vector<std::string>& extra, const std::string& tag,
                       size_t steps) {
    const pid_t pid = start_program(
        dir_.path(), args({"--steps", "100000", "--ckpt-every", "1000"}) + extra, tag);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (count_lines(dir_ / "run/metrics.jsonl") < steps &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return pid;
  }

  Scratch dir_;
};

size_t lines_in(const std::string& text) { return std::count(text.begin(), text.end(), '\n'); }

// Waits until `file` holds `text` (or two minutes pass).
void wait_for_text(const fs::path& file, const std::string& text) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (read_text(file).find(text) == std::string::npos &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// `run` succeeded having resumed from `checkpoint` (as its start-up line names it) at `step`,
// and `metrics` holds `steps` steps.
void expect_resumed(const ProgramRun& run, const std::string& checkpoint, int step,
                    const fs::path& metrics, size_t steps) {
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_NE(run.out.find("resumed      from " + checkpoint + " at step " + std::to_string(step)),
            std::string::npos)
      << run.out;
  EXPECT_EQ(count_lines(metrics), steps);
}

// `run` succeeded having resumed from step 2, past a step-000004 that does not verify, which it
// set aside.
void expect_resumed_past_damaged_step_4(const ProgramRun& run) {
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_NE(run.out.find("resumed      from run/checkpoints/step-000002 at step 2"),
            std::string::npos)
      << run.out;
  EXPECT_NE(run.out.find("set aside    step-000004 -> .unverified-step-000004-"), std::string::npos)
      << run.out;
}

// A second run on a directory in use, even one that has not saved yet, is refused in one line
// naming the directory and its holder (even once the holder has saved: the holder, not its
// checkpoints, is the reason); with --wait-for-ckpt-dir a requeued --resume waits for the
// holder to stop and continues from the checkpoint it left, even if there was none when it
// started waiting.
TEST_F(Cluster, OneRunPerCheckpointDirectoryAndARequeuedResumeWaits) {
  const pid_t first = start_long_run({}, "first", 2);
  ASSERT_FALSE(fs::exists(dir_ / "run/checkpoints/latest")) << "no save yet";
  const ProgramRun fresh = run_program(dir_.path(), args({"--steps", "3"}), "fresh");
  EXPECT_EQ(fresh.status, 2) << fresh.err;
  EXPECT_EQ(lines_in(fresh.err), 1u) << fresh.err;
  EXPECT_NE(fresh.err.find("checkpoint directory run/checkpoints is in use"), std::string::npos)
      << fresh.err;
  EXPECT_NE(fresh.err.find("pid " + std::to_string(first)), std::string::npos) << fresh.err;
  EXPECT_NE(fresh.err.find("--wait-for-ckpt-dir"), std::string::npos) << fresh.err;
  // Requeued before the first run saved anything: it waits for the checkpoint to come.
  const pid_t second = start_program(
      dir_.path(), args({"--resume", "--wait-for-ckpt-dir", "120", "--steps", "100000"}), "second");
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ASSERT_EQ(::kill(first, SIGTERM), 0);
  ASSERT_EQ(wait_program(dir_.path(), first, "first").status, 0);
  wait_for_text(dir_ / "second.out", "resumed      from");
  const ProgramRun fresh_again = run_program(dir_.path(), args({"--steps", "3"}), "fresh_again");
  EXPECT_EQ(fresh_again.status, 2) << fresh_again.err;
  EXPECT_NE(fresh_again.err.find("pid " + std::to_string(second)), std::string::npos)
      << fresh_again.err;

  // The job runs again; it is requeued while still running (a node's health check failed),
  // and the new incarnation starts before the old one has stopped.
  const size_t logged = count_lines(dir_ / "run/metrics.jsonl");
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (count_lines(dir_ / "run/metrics.jsonl") < logged + 2 &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const ProgramRun resume_now =
      run_program(dir_.path(), args({"--resume", "--steps", "100000"}), "resume_now");
  EXPECT_EQ(resume_now.status, 2) << resume_now.err;
  EXPECT_NE(resume_now.err.find("is in use"), std::string::npos) << resume_now.err;
  const pid_t requeued = start_program(
      dir_.path(), args({"--resume", "--wait-for-ckpt-dir", "120", "--steps", "100000"}),
      "requeued");
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ASSERT_EQ(::kill(second, SIGTERM), 0);
  const ProgramRun stopped = wait_program(dir_.path(), second, "second");
  ASSERT_EQ(stopped.status, 0) << stopped.err;
  // The checkpoint its summary names (not metrics.jsonl's last step: the waiting run may have
  // taken over and logged steps of its own by now).
  std::smatch named;
  ASSERT_TRUE(std::regex_search(stopped.out, named,
                                std::regex("checkpoint  run/checkpoints/(step-[0-9]+):")))
      << stopped.out;
  const std::string saved = named[1].str();

  // The waiting run takes over from the checkpoint the stopped one just wrote.
  wait_for_text(dir_ / "requeued.out", "resumed      from");
  ASSERT_EQ(::kill(requeued, SIGTERM), 0);
  const ProgramRun after = wait_program(dir_.path(), requeued, "requeued");
  ASSERT_EQ(after.status, 0) << after.err;
  EXPECT_NE(after.out.find("resumed      from run/checkpoints/" + saved), std::string::npos)
      << after.out;
}

// A save that died between its commit and the `latest` update, and a first save that died
// before `latest` existed: --resume continues from the newest complete checkpoint, says why,
// and neither replays steps nor meets an "already committed" checkpoint.
TEST_F(Cluster, ResumeContinuesFromTheNewestCompleteCheckpoint) {
  ASSERT_EQ(run_program(dir_.path(), args({"--steps", "4", "--ckpt-every", "2"})).status, 0);
  const fs::path root = dir_ / "run/checkpoints";
  ASSERT_EQ(read_text(root / "latest"), "step-000004\n");
  std::ofstream(root / "latest", std::ios::trunc) << "step-000002\n";  // the update never ran

  const ProgramRun resumed =
      run_program(dir_.path(), args({"--resume", "--steps", "6", "--ckpt-every", "2"}), "stale");
  ASSERT_EQ(resumed.status, 0) << resumed.err;
  EXPECT_NE(resumed.out.find("resumed      from run/checkpoints/step-000004 at step 4"),
            std::string::npos)
      << resumed.out;
  EXPECT_NE(resumed.out.find("('latest' names 'step-000002', but 'step-000004' is newer and "
                             "complete"),
            std::string::npos)
      << "says why\n"
      << resumed.out;
  const auto metrics = read_metrics(dir_ / "run/metrics.jsonl");
  ASSERT_EQ(metrics.size(), 6u);
  for (size_t i = 0; i < metrics.size(); ++i) EXPECT_EQ(metrics[i].step, int64_t(i + 1));
  EXPECT_EQ(read_text(root / "latest"), "step-000006\n");

  fs::remove(root / "latest");  // as if the first save of a run had died before writing it
  const ProgramRun without =
      run_program(dir_.path(), args({"--resume", "--steps", "7", "--ckpt-every", "2"}), "none");
  ASSERT_EQ(without.status, 0) << without.err;
  EXPECT_NE(without.out.find("resumed      from run/checkpoints/step-000006 at step 6"),
            std::string::npos)
      << without.out;
  EXPECT_NE(without.out.find("(there is no 'latest'; 'step-000006' is the newest complete "
                             "checkpoint"),
            std::string::npos)
      << without.out;
  EXPECT_EQ(read_text(root / "latest"), "step-000007\n");
}

// SLURM signals a job step's processes from slurmstepd and from torchrun's agent, moments
// apart: the second SIGTERM must not cut the save the first one asked for, nor the summary
// and the exit after it.
TEST_F(Cluster, ASecondSigtermStillEndsInACheckpoint) {
  for (const int gap_ms : {2, 100}) {
    SCOPED_TRACE("second SIGTERM after " + std::to_string(gap_ms) + " ms");
    // The previous round's run out of the way (renamed: the wheel's std::filesystem::remove_all
    // has crashed before, README "What the earlier runs found").
    if (fs::exists(dir_ / "run"))
      fs::rename(dir_ / "run", dir_ / ("run-before-" + std::to_string(gap_ms)));
    const pid_t pid = start_long_run({}, "run", 3);
    ASSERT_EQ(::kill(pid, SIGTERM), 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(gap_ms));
    ASSERT_EQ(::kill(pid, SIGTERM), 0);
    const ProgramRun run = wait_program(dir_.path(), pid, "run");
    ASSERT_EQ(run.status, 0) << "killed by the second SIGTERM? " << run.err;
    EXPECT_NE(run.out.find("stopped     by SIGTERM"), std::string::npos) << run.out;
    EXPECT_NE(run.out.find("checkpoint  run/checkpoints/"), std::string::npos) << run.out;
    const auto metrics = read_metrics(dir_ / "run/metrics.jsonl");
    ASSERT_FALSE(metrics.empty());
    EXPECT_EQ(read_text(dir_ / "run/checkpoints/latest"),
              checkpoint_name(metrics.back().step) + "\n");
  }
}

// A shell starts a background job with SIGINT ignored, so that a Ctrl-C meant for the
// foreground job does not reach it: the run keeps it ignored and trains on; SIGTERM still
// stops it with a checkpoint.
TEST_F(Cluster, ASigintIgnoredAtStartStaysIgnored) {
  struct sigaction ignore {
  }, previous{};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  ASSERT_EQ(::sigaction(SIGINT, &ignore, &previous), 0);  // inherited by the child
  const pid_t pid = start_long_run({}, "run", 2);
  ASSERT_EQ(::sigaction(SIGINT, &previous, nullptr), 0);
  ASSERT_EQ(::kill(pid, SIGINT), 0);
  const size_t steps_then = count_lines(dir_ / "run/metrics.jsonl");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (count_lines(dir_ / "run/metrics.jsonl") < steps_then + 3 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  int raw = 0;
  EXPECT_EQ(::waitpid(pid, &raw, WNOHANG), 0) << "the ignored SIGINT ended the run";
  EXPECT_GE(count_lines(dir_ / "run/metrics.jsonl"), steps_then + 3) << "it trains on";
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  const ProgramRun run = wait_program(dir_.path(), pid, "run");
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_NE(run.out.find("stopped     by SIGTERM"), std::string::npos) << run.out;
}

// A newer checkpoint that does not verify is passed over by --resume, and set aside (kept,
// renamed) so that the run can save that step again instead of dying on "already committed".
TEST_F(Cluster, AResumePastACheckpointThatDoesNotVerifySetsItAside) {
  ASSERT_EQ(run_program(dir_.path(), args({"--steps", "4", "--ckpt-every", "2"})).status, 0);
  const fs::path root = dir_ / "run/checkpoints";
  std::ofstream(root / "latest", std::ios::trunc) << "step-000002\n";  // the update never ran
  const fs::path data = root / "step-000004/data-00000.safetensors";
  std::string bytes = read_text(data);
  bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 0x10);
  std::ofstream(data, std::ios::trunc | std::ios::binary) << bytes;

  const ProgramRun resumed =
      run_program(dir_.path(), args({"--resume", "--steps", "6", "--ckpt-every", "2"}), "past");
  expect_resumed_past_damaged_step_4(resumed);
  EXPECT_EQ(read_text(root / "latest"), "step-000006\n");
  EXPECT_TRUE(fs::exists(root / "step-000004/manifest.json"));  // saved again
  size_t kept = 0;
  for (const auto& entry : fs::directory_iterator(root)) {
    kept += entry.path().filename().string().starts_with(".unverified-step-000004-");
  }
  EXPECT_EQ(kept, 1u);

  // A newer step whose manifest is damaged is no committed checkpoint at all (no lookup lists
  // it), and would stop the run at its step just the same: set aside too.
  std::ofstream(root / "step-000006/manifest.json", std::ios::trunc) << "{\"format\": ";
  std::ofstream(root / "latest", std::ios::trunc) << "step-000004\n";
  const ProgramRun again =
      run_program(dir_.path(), args({"--resume", "--steps", "8", "--ckpt-every", "2"}), "again");
  ASSERT_EQ(again.status, 0) << again.err;
  EXPECT_NE(again.out.find("set aside    step-000006 -> .unverified-step-000006-"),
            std::string::npos)
      << again.out;
  EXPECT_EQ(read_text(root / "latest"), "step-000008\n");
}

// The checkpoint `latest` names is loaded without a separate verification pass: if it is
// damaged — a chunk that fails its checksum, a truncated file — the resume fails in one line
// naming the file and saying to delete `latest`; after that, --resume verifies, sets the damaged
// checkpoint aside and continues from the newest one that verifies.
TEST_F(Cluster, ADamagedLatestCheckpointIsRefusedWithTheWayOut) {
  ASSERT_EQ(run_program(dir_.path(), args({"--steps", "4", "--ckpt-every", "2"})).status, 0);
  const fs::path root = dir_ / "run/checkpoints";
  const fs::path data = root / "step-000004/data-00000.safetensors";
  const std::string intact = read_text(data);
  const std::string advice =
      "; to resume from the newest checkpoint that verifies, delete run/checkpoints/latest";
  std::string flipped = intact;
  flipped[flipped.size() / 2] = static_cast<char>(flipped[flipped.size() / 2] ^ 0x10);
  for (const std::string& damaged : {flipped, intact.substr(0, intact.size() - 100)}) {
    SCOPED_TRACE(damaged.size() == intact.size() ? "a flipped bit" : "a truncated file");
    std::ofstream(data, std::ios::trunc | std::ios::binary) << damaged;
    const ProgramRun refused =
        run_program(dir_.path(), args({"--resume", "--steps", "6"}), "refused");
    EXPECT_EQ(refused.status, 2) << refused.err;
    EXPECT_EQ(lines_in(refused.err), 1u) << refused.err;
    EXPECT_NE(refused.err.find("data-00000.safetensors"), std::string::npos) << refused.err;
    EXPECT_NE(refused.err.find(advice + "\n"), std::string::npos) << refused.err;
  }
  fs::remove(root / "latest");
  const ProgramRun resumed = run_program(dir_.path(), args({"--resume", "--steps", "6"}), "ok");
  expect_resumed_past_damaged_step_4(resumed);
}

// A resumed copy of a run trained to step 6 in its own metrics file, `copy`, and left the
// original's file as it was (`before`).
void expect_copy_trained_apart(const ProgramRun& resumed, const fs::path& original,
                               const std::string& before, const fs::path& copy) {
  ASSERT_EQ(resumed.status, 0) << resumed.err;
  EXPECT_EQ(read_text(original), before);
  const auto metrics = read_metrics(copy);
  ASSERT_EQ(metrics.size(), 6u);
  EXPECT_EQ(metrics.back().step, 6);
}

// A copy of a run resumed in its own directory writes its own metrics: the original's file is
// neither appended to nor cut back to the resume step.
TEST_F(Cluster, AResumedCopyOfARunLeavesTheOriginalsMetricsAlone) {
  ASSERT_EQ(run_program(dir_.path(), args({"--steps", "4", "--ckpt-every", "2"})).status, 0);
  fs::copy(dir_ / "run", dir_ / "copy", fs::copy_options::recursive);
  std::ofstream(dir_ / "copy/checkpoints/latest", std::ios::trunc) << "step-000002\n";
  // Not the newest any more (renamed, not removed: see ASecondSigtermStillEndsInACheckpoint).
  fs::rename(dir_ / "copy/checkpoints/step-000004", dir_ / "step-000004-of-the-copy");
  const std::string original = read_text(dir_ / "run/metrics.jsonl");
  const ProgramRun resumed = run_program(
      dir_.path(),
      tiny_model() + std::vector<std::string>{"--data", (dir_ / "corpus.txt").string(), "--out",
                                              "copy", "--resume", "--steps", "6", "--ckpt-every",
                                              "2", "--eval-every", "1000"},
      "copy");
  expect_copy_trained_apart(resumed, dir_ / "run/metrics.jsonl", original,
                            dir_ / "copy/metrics.jsonl");
}

// A plain --resume (the newest run under runs/) of a run copied to another working directory
// and renamed there writes the copy's metrics, beside its checkpoints: the file the original
// run recorded is neither appended to nor cut back.
TEST_F(Cluster, APlainResumeOfACopiedRunWritesTheCopysMetrics) {
  const std::vector<std::string> run =
      tiny_model() + std::vector<std::string>{"--data",       (dir_ / "corpus.txt").string(),
                                              "--eval-every", "1000",
                                              "--ckpt-every", "2"};
  ASSERT_EQ(run_program(dir_.path(), run + std::vector<std::string>{"--steps", "4"}).status, 0);
  fs::path original;
  for (const auto& entry : fs::directory_iterator(dir_ / "runs")) original = entry.path();
  Scratch elsewhere;
  fs::create_directories(elsewhere / "runs");
  fs::copy(original, elsewhere / "runs/renamed", fs::copy_options::recursive);
  const std::string before = read_text(original / "metrics.jsonl");
  const ProgramRun resumed = run_program(
      elsewhere.path(), {"--resume", "--steps", "6", "--progress", "lines", "--threads", "1"});
  expect_copy_trained_apart(resumed, original / "metrics.jsonl", before,
                            elsewhere / "runs/renamed/metrics.jsonl");
}

// Runs started in the same second from one working directory (an array job, a sweep) name the
// same runs/<date>-<time>: the one that comes second to it takes the next free name instead of
// sharing the directory (and failing on its lock). The other run is simulated: while this one
// reads its data (a FIFO the test writes), every name it can have chosen is taken.
TEST_F(Cluster, ARunDirectoryTakenMeanwhileIsNotShared) {
  const fs::path fifo = dir_ / "corpus.fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const auto stamp = [](std::time_t t) {
    std::tm local{};
    localtime_r(&t, &local);
    char text[32];
    std::strftime(text, sizeof text, "%Y%m%d-%H%M%S", &local);
    return std::string(text);
  };
  std::set<std::string> taken;
  const std::time_t before = std::time(nullptr);
  const pid_t pid =
      start_program(dir_.path(),
                    tiny_model() + std::vector<std::string>{"--data", fifo.string(), "--steps", "2",
                                                            "--eval-every", "1000"},
                    "late");
  {
    // Opening blocks until the program opens its data, after it has named its directory.
    std::ofstream data(fifo);
    const std::time_t after = std::time(nullptr);
    for (std::time_t t = before; t <= after; ++t) {
      fs::create_directories(dir_ / "runs" / stamp(t));
      taken.insert(stamp(t));
    }
    data << read_text(dir_ / "corpus.txt");
  }
  const ProgramRun run = wait_program(dir_.path(), pid, "late");
  ASSERT_EQ(run.status, 0) << run.err;
  size_t used = 0;
  for (const auto& entry : fs::directory_iterator(dir_ / "runs")) {
    if (taken.count(entry.path().filename().string())) {
      EXPECT_TRUE(fs::is_empty(entry.path())) << entry.path() << ": the other run's";
      continue;
    }
    EXPECT_EQ(count_lines(entry.path() / "metrics.jsonl"), 2u) << entry.path();
    ++used;
  }
  EXPECT_EQ(used, 1u);
}

// --auto-resume: one command line for a job's first launch and its requeues. It starts the run
// when the directory holds no checkpoint and continues it when it does; flags for steps the run
// has passed (a --stop-at that ended the first launch, a trace already written) are dropped on
// the requeue, and said so, not refused.
TEST_F(Cluster, AutoResumeStartsTheRunThenContinuesItWithTheSameCommand) {
  const auto job = args({"--steps", "4", "--ckpt-every", "2", "--auto-resume", "--stop-at", "2",
                         "--profile-steps", "1:1"});
  const ProgramRun first = run_program(dir_.path(), job, "first");
  ASSERT_EQ(first.status, 0) << first.err;
  EXPECT_EQ(first.out.find("resumed"), std::string::npos) << first.out;
  EXPECT_NE(first.out.find(" on disk; 1 save, training blocked"), std::string::npos) << first.out;
  EXPECT_EQ(read_text(dir_ / "run/checkpoints/latest"), "step-000002\n");
  const ProgramRun requeued = run_program(dir_.path(), job, "requeued");
  ASSERT_EQ(requeued.status, 0) << requeued.err;
  EXPECT_NE(requeued.out.find("resumed      from"), std::string::npos) << requeued.out;
  EXPECT_NE(requeued.out.find("--stop-at 2 ignored: the run is past that step"), std::string::npos)
      << requeued.out;
  EXPECT_NE(requeued.out.find("--profile-steps 1:1 ignored"), std::string::npos) << requeued.out;
  const auto metrics = read_metrics(dir_ / "run/metrics.jsonl");
  ASSERT_EQ(metrics.size(), 4u);
  EXPECT_EQ(metrics.back().step, 4);
}

// A run that names its own directory (no --out) still writes the metrics where --metrics says.
TEST_F(Cluster, ARunNamingItsDirectoryKeepsItsMetricsFile) {
  const ProgramRun run = run_program(
      dir_.path(),
      tiny_model() + std::vector<std::string>{"--data", (dir_ / "corpus.txt").string(), "--steps",
                                              "2", "--metrics", "mine.jsonl"});
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_EQ(count_lines(dir_ / "mine.jsonl"), 2u);
}

// A metrics file that stops taking writes (a full disk; here /dev/full) is said so, once on
// stderr and in the summary, and the run trains and saves on.
TEST_F(Cluster, AMetricsFileThatCannotBeWrittenIsReportedAndTrainingGoesOn) {
  fs::create_symlink("/dev/full", dir_ / "full.jsonl");
  const ProgramRun run = run_program(
      dir_.path(), args({"--steps", "3", "--ckpt-every", "3", "--metrics", "full.jsonl"}));
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_NE(run.err.find("warning: metrics file cannot write full.jsonl (No space left on device): "
                         "its records end before step 1"),
            std::string::npos)
      << run.err;
  EXPECT_EQ(lines_in(run.err), 1u) << run.err;
  EXPECT_NE(run.out.find("INCOMPLETE: cannot write full.jsonl"), std::string::npos) << run.out;
  EXPECT_EQ(read_text(dir_ / "run/checkpoints/latest"), "step-000003\n");
}

// --ckpt-dir DIR/ names DIR: the metrics go beside it, not into it.
TEST_F(Cluster, ACheckpointDirectoryWithATrailingSlashKeepsTheMetricsBesideIt) {
  const ProgramRun run = run_program(
      dir_.path(),
      tiny_model() + std::vector<std::string>{"--data", (dir_ / "corpus.txt").string(), "--steps",
                                              "2", "--ckpt-dir", "tsl/ckpt/"});
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_EQ(count_lines(dir_ / "tsl/metrics.jsonl"), 2u);
  EXPECT_FALSE(fs::exists(dir_ / "tsl/ckpt/metrics.jsonl"));
}

// A second run with a checkpoint directory of its own but the first one's --out would truncate
// the first one's metrics: refused, naming the file. Another metrics file in the same
// directory is no conflict.
TEST_F(Cluster, AnotherRunCannotShareTheOutputDirectory) {
  const pid_t first = start_long_run({}, "first", 2);
  const ProgramRun other = run_program(
      dir_.path(), args({"--steps", "3", "--ckpt-dir", "elsewhere/checkpoints"}), "other");
  EXPECT_EQ(other.status, 2) << other.err;
  EXPECT_EQ(lines_in(other.err), 1u) << other.err;
  EXPECT_NE(other.err.find("metrics file run/metrics.jsonl"), std::string::npos) << other.err;
  EXPECT_NE(other.err.find("is in use"), std::string::npos) << other.err;
  const ProgramRun beside = run_program(
      dir_.path(),
      args({"--steps", "2", "--ckpt-dir", "elsewhere/checkpoints", "--metrics", "run/other.jsonl"}),
      "beside");
  EXPECT_EQ(beside.status, 0) << beside.err;
  const size_t logged = count_lines(dir_ / "run/metrics.jsonl");
  ASSERT_EQ(::kill(first, SIGTERM), 0);
  ASSERT_EQ(wait_program(dir_.path(), first, "first").status, 0);
  EXPECT_GE(count_lines(dir_ / "run/metrics.jsonl"), logged) << "truncated by the other run";
  for (const StepRecord& record : read_metrics(dir_ / "run/metrics.jsonl")) {
    EXPECT_GT(record.step, 0);
  }
}

// A background save whose copy cannot fit the staging budget is refused before the first step,
// not at the first save thousands of steps later.
TEST_F(Cluster, AStagingBudgetTooSmallIsRefusedBeforeTheFirstStep) {
  // A model whose training state needs well over 1 MiB of staging.
  const ProgramRun run = run_program(
      dir_.path(),
      args({"--d-model", "128", "--steps", "3", "--async-save", "--staging-budget-mb", "1"}));
  EXPECT_EQ(run.status, 2) << run.err;
  EXPECT_EQ(lines_in(run.err), 1u) << run.err;
  EXPECT_NE(run.err.find("--async-save needs "), std::string::npos) << run.err;
  EXPECT_NE(run.err.find("--staging-budget-mb is 1 "), std::string::npos) << run.err;
  EXPECT_EQ(count_lines(dir_ / "run/metrics.jsonl"), 0u) << "no step ran";
}

// A save that commits but meets a problem (here: an older run's checkpoint in the root that
// does not verify) says so on stderr, one line naming the checkpoint, and the summary counts
// it — for a blocking save, and for a background one, whose result arrives at the next save.
TEST_F(Cluster, ASavesWarningsArePrintedAndCounted) {
  for (const std::string out : {"blocking", "async"}) {
    SCOPED_TRACE(out);
    const ProgramRun run = run_program(dir_.path(), run_whose_saves_warn(dir_.path(), out), out);
    ASSERT_EQ(run.status, 0) << run.err;
    const std::string line = "mixprec-train: warning: checkpoint " + out +
                             "/checkpoints/step-000001: a checkpoint newer than 'latest' does "
                             "not verify and is left as it is: damaged: ";
    EXPECT_NE(run.err.find(line), std::string::npos) << run.err;
    EXPECT_EQ(occurrences(run.err, "mixprec-train: warning:"), 1u) << run.err;
    EXPECT_NE(run.out.find("; 2 saves (1 warning, on stderr), training blocked"), std::string::npos)
        << run.out;
  }
}

// A plain --resume continues the newest run under runs/ that holds a checkpoint: an older run is
// left alone, and a newer directory without a checkpoint (a run that ended before its first
// save) is passed over.
TEST_F(Cluster, APlainResumeContinuesTheNewestRunThatHoldsACheckpoint) {
  const auto run_into = [&](const std::string& out) {
    return run_program(
        dir_.path(),
        tiny_model() + std::vector<std::string>{"--data", (dir_ / "corpus.txt").string(),
                                                "--eval-every", "1000", "--steps", "2", "--out",
                                                out},
        out.substr(5));
  };
  ASSERT_EQ(run_into("runs/20240101-000000").status, 0);
  ASSERT_EQ(run_into("runs/20240102-000000").status, 0);
  fs::create_directories(dir_ / "runs/20240103-000000/checkpoints");
  const ProgramRun resumed = run_program(
      dir_.path(), {"--resume", "--steps", "3", "--progress", "lines", "--threads", "1"});
  expect_resumed(resumed, "runs/20240102-000000/checkpoints/step-000002", 2,
                 dir_ / "runs/20240102-000000/metrics.jsonl", 3);
  EXPECT_EQ(count_lines(dir_ / "runs/20240101-000000/metrics.jsonl"), 2u);
}

// A copy of a run whose metrics went elsewhere (--metrics), resumed with --out, writes its
// metrics in its own directory: the original's file is not appended to.
TEST_F(Cluster, AResumedCopyLeavesTheOriginalsMetricsFileElsewhereAlone) {
  ASSERT_EQ(run_program(dir_.path(), args({"--steps", "2", "--metrics", "elsewhere.jsonl"})).status,
            0);
  fs::copy(dir_ / "run", dir_ / "copy", fs::copy_options::recursive);
  const std::string before = read_text(dir_ / "elsewhere.jsonl");
  const ProgramRun resumed =
      run_program(dir_.path(),
                  tiny_model() + std::vector<std::string>{"--data", (dir_ / "corpus.txt").string(),
                                                          "--out", "copy", "--resume", "--steps",
                                                          "3", "--eval-every", "1000"},
                  "copy");
  ASSERT_EQ(resumed.status, 0) << resumed.err;
  EXPECT_EQ(read_text(dir_ / "elsewhere.jsonl"), before);
  const auto metrics = read_metrics(dir_ / "copy/metrics.jsonl");
  ASSERT_FALSE(metrics.empty());
  EXPECT_EQ(metrics.back().step, 3);
}

// A requeued --auto-resume job continues from its checkpoint: the --init-from of its command
// line chose the first launch's weights, and is neither used nor refused (as it is with
// --resume) on the requeue.
TEST_F(Cluster, AnAutoResumeRequeueLeavesInitFromToTheFirstLaunch) {
  ASSERT_EQ(run_program(dir_.path(), args({"--steps", "2"}), "first").status, 0);
  const ProgramRun requeued = run_program(
      dir_.path(),
      args({"--steps", "3", "--auto-resume", "--init-from", (dir_ / "export").string()}),
      "requeued");
  expect_resumed(requeued, "run/checkpoints/step-000002", 2, dir_ / "run/metrics.jsonl", 3);
}

// A `latest` that is unusable (not a checkpoint name) makes the root damaged for a resume: an
// error naming the root, not a guess at which checkpoint to continue.
TEST(NewestCheckpoint, AnUnusableLatestIsAnErrorNamingTheRoot) {
  Scratch dir;
  const fs::path root = dir / "checkpoints";
  mixprec::ShardedStateDict state;
  state.tensors.emplace("x", mixprec::ShardedTensor::whole(at::arange(4, at::kFloat)));
  mixprec::checkpoint::save_checkpoint(root, "step-000001", state);
  ASSERT_EQ(newest_checkpoint(root), root / "step-000001");
  std::ofstream(root / "latest", std::ios::trunc) << "../elsewhere\n";
  try {
    newest_checkpoint(root);
    ADD_FAILURE() << "an unusable latest is refused";
  } catch (const UsageError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("checkpoint root " + root.string() + " is damaged: ", 0),
              0u)
        << e.what();
  }
}

// --keep-last N keeps the N newest checkpoints; older ones are removed as newer ones commit.
TEST_F(Cluster, KeepLastKeepsThatManyNewestCheckpoints) {
  ASSERT_EQ(
      run_program(dir_.path(), args({"--steps", "4", "--ckpt-every", "1", "--keep-last", "2"}))
          .status,
      0);
  std::set<std::string> kept;
  for (const auto& entry : fs::directory_iterator(dir_ / "run/checkpoints")) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with("step-")) kept.insert(name);
  }
  EXPECT_EQ(kept, (std::set<std::string>{"step-000003", "step-000004"}));
}

// --resume with --ckpt-dir (no --out) continues that root, not the newest run under runs/.
TEST_F(Cluster, AResumeWithCkptDirContinuesThatRoot) {
  const auto flags = [&](const std::string& steps) {
    return tiny_model() + std::vector<std::string>{"--data",     (dir_ / "corpus.txt").string(),
                                                   "--ckpt-dir", "mine/ckpt",
                                                   "--steps",    steps};
  };
  ASSERT_EQ(run_program(dir_.path(), flags("2"), "first").status, 0);
  const ProgramRun resumed =
      run_program(dir_.path(), flags("3") + std::vector<std::string>{"--resume"}, "resumed");
  expect_resumed(resumed, "mine/ckpt/step-000002", 2, dir_ / "mine/metrics.jsonl", 3);
}

// A run's directory holds its checkpoints and metrics and nothing else in sight: the metrics
// file's run lock is a hidden file.
TEST_F(Cluster, TheMetricsLockIsHiddenBesideTheMetrics) {
  ASSERT_EQ(run_program(dir_.path(), args({"--steps", "1"})).status, 0);
  std::set<std::string> visible;
  for (const auto& entry : fs::directory_iterator(dir_ / "run")) {
    const std::string name = entry.path().filename().string();
    if (!name.starts_with(".")) visible.insert(name);
  }
  EXPECT_EQ(visible, (std::set<std::string>{"checkpoints", "metrics.jsonl"}));
  EXPECT_TRUE(fs::exists(dir_ / "run/.metrics.jsonl.run-lock"));
}

// The steps a resume would meet again are directories only: a file or a link named like a
// step is not set aside; a directory without a committed manifest is, and one at or before the
// resume step is not.
TEST(UncommittedSteps, OnlyDirectoriesAfterTheResumeStep) {
  Scratch dir;
  const fs::path root = dir / "checkpoints";
  mixprec::ShardedStateDict state;
  state.tensors.emplace("x", mixprec::ShardedTensor::whole(at::arange(4, at::kFloat)));
  mixprec::checkpoint::save_checkpoint(root, "step-000002", state);
  fs::create_directories(root / "step-000001");
  fs::create_directories(root / "step-000007");
  std::ofstream(root / "step-000005") << "a file";
  fs::create_directory_symlink(root / "step-000007", root / "step-000006");
  EXPECT_EQ(uncommitted_steps_after(root, "step-000002"), std::vector<std::string>{"step-000007"});
  EXPECT_TRUE(uncommitted_steps_after(root, "latest").empty());
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace train
