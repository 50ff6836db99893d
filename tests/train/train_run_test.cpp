// mixprec-train end to end on a tiny model: the loss falls, every metrics line has the
// documented fields, checkpoints land where the summary says, the default corpus is found.
#include "train/train_program.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <regex>

namespace train {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using namespace train::testing;

TEST(TrainRun, LossFallsAndMetricsHaveTheDocumentedFields) {
  Scratch dir;
  write_corpus(dir / "corpus.txt");
  const ProgramRun run = run_program(
      dir.path(),
      tiny_model() + std::vector<std::string>{"--data", (dir / "corpus.txt").string(), "--steps",
                                              "40", "--lr", "1e-2", "--warmup", "5", "--eval-every",
                                              "20", "--ckpt-every", "20", "--sample-tokens", "24",
                                              "--out", "run"});
  ASSERT_EQ(run.status, 0) << run.err << run.out;
  EXPECT_EQ(run.err, "");

  // Every line parses with every documented field and the right types (from_json throws
  // otherwise); steps are 1..40 in order.
  const fs::path metrics = dir / "run/metrics.jsonl";
  std::ifstream in(metrics);
  int64_t expected_step = 0;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    for (const char* field :
         {"step",         "loss",        "aux_loss",     "val_loss",      "lr",
          "grad_norm",    "loss_scale",  "skipped",      "skipped_total", "tokens",
          "tokens_per_s", "step_s",      "elapsed_s",    "forward_s",     "backward_s",
          "reduce_s",     "optimizer_s", "checkpoint_s", "other_s",       "page_faults"}) {
      EXPECT_TRUE(j.contains(field)) << field << " missing in " << line;
    }
    EXPECT_EQ(j.size(), 20u) << "undocumented fields in " << line;
    const StepRecord r = StepRecord::from_json(j);
    // The phases are parts of the step: none negative, together no more than the step.
    const StepPhases& p = r.phases;
    for (double part :
         {p.forward_s, p.backward_s, p.reduce_s, p.optimizer_s, p.checkpoint_s, p.other_s}) {
      EXPECT_GE(part, 0.0) << line;
    }
    EXPECT_GT(p.forward_s, 0.0) << line;
    EXPECT_GT(p.backward_s, 0.0) << line;
    EXPECT_GT(p.optimizer_s, 0.0) << line;
    EXPECT_LT(p.reduce_s, 1e-3) << "one process reduces nothing: " << line;
    EXPECT_LE(p.forward_s + p.backward_s + p.reduce_s + p.optimizer_s + p.checkpoint_s + p.other_s,
              r.step_s * 1.0001)
        << line;
    EXPECT_GE(r.page_faults, 0) << line;
    EXPECT_EQ(r.step, ++expected_step);
    EXPECT_EQ(r.tokens, r.step * 8 * 32);
    EXPECT_EQ(r.loss_scale, 1.0) << "BF16 needs no loss scaling";
    EXPECT_FALSE(r.skipped);
    EXPECT_TRUE(std::isfinite(r.grad_norm) && r.grad_norm > 0);
    EXPECT_EQ(r.val_loss.has_value(), r.step % 20 == 0) << "val loss every --eval-every steps";
  }
  ASSERT_EQ(expected_step, 40);

  const std::vector<StepRecord> records = read_metrics(metrics);
  auto mean_loss = [&](size_t begin, size_t end) {
    double sum = 0;
    for (size_t i = begin; i < end; ++i) sum += records[i].loss;
    return sum / static_cast<double>(end - begin);
  };
  EXPECT_NEAR(records.front().loss, std::log(256.0), 0.3) << "an untrained byte model is uniform";
  EXPECT_LT(mean_loss(35, 40), mean_loss(0, 5) - 1.0) << "the loss must clearly fall";
  EXPECT_LT(*records.back().val_loss, *records[19].val_loss);

  // Checkpoints at 20 and 40, `latest` at 40; the summary names them and what stayed FP32.
  EXPECT_TRUE(fs::exists(dir / "run/checkpoints/step-000020/manifest.json"));
  EXPECT_TRUE(fs::exists(dir / "run/checkpoints/step-000040/manifest.json"));
  EXPECT_EQ(read_text(dir / "run/checkpoints/latest"), "step-000040\n");
  for (const char* expected :
       {"== sample (temperature 0.8) ==", "== summary ==", "blocks.0.moe.router.weight",
        "keep_in_fp32 mark", "blocks.0.moe.expert_bias", "name 'blocks.0.moe.expert_bias'",
        "pattern '*norm*'", "bytes per parameter", "tokens/s", "run/checkpoints/step-000040",
        "run/metrics.jsonl"}) {
    EXPECT_NE(run.out.find(expected), std::string::npos) << expected << "\n" << run.out;
  }
  EXPECT_TRUE(std::regex_search(
      run.out, std::regex("loss +5\\.[0-9]+ → [0-9.]+ over steps 1–40 +[▁▂▃▄▅▆▇█]+")))
      << run.out;
  // The test environment asks for passive waits (ctest runs tests side by side); no flag.
  EXPECT_NE(run.out.find("OpenMP waits PASSIVE (--omp-wait auto)"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("malloc       freed memory kept for the next step (--malloc keep)"),
            std::string::npos)
      << run.out;
  // Memory: the tensors that live between steps and what a step adds, counted.
  EXPECT_TRUE(std::regex_search(
      run.out, std::regex("memory +peak RSS [0-9.]+ MiB; tensors between steps: parameters "
                          "[0-9.]+ KiB · gradients [0-9.]+ KiB · optimizer state [0-9.]+ KiB\n"
                          " +a step's peak over parameters and optimizer state [0-9.]+ [KM]iB: "
                          "activations kept for backward [0-9.]+ [KM]iB \\+ gradients, "
                          "temporaries and workspaces [0-9.]+ [KM]iB")))
      << run.out;
  {
    // The split is of one step's peak: its two parts add up to it (to the printed rounding).
    std::smatch m;
    ASSERT_TRUE(std::regex_search(
        run.out, m,
        std::regex("optimizer state ([0-9.]+) ([KM])iB: activations kept for backward ([0-9.]+) "
                   "([KM])iB \\+ gradients, temporaries and workspaces ([0-9.]+) ([KM])iB")));
    const auto kib = [&](int value, int unit) {
      return std::stod(m[value].str()) * (m[unit].str() == "M" ? 1024.0 : 1.0);
    };
    const double peak = kib(1, 2), activations = kib(3, 4), rest = kib(5, 6);
    EXPECT_GT(activations, 0) << run.out;
    EXPECT_NEAR(activations + rest, peak, 0.01 * peak + 1.0) << run.out;
  }
  EXPECT_TRUE(std::regex_search(
      run.out, std::regex("\n +page faults per step [0-9]+ \\(median\\), [0-9.]+ \\(mean, "
                          "with the steps in which the heap grew\\): pages the allocator got "
                          "from the system \\(--malloc\\)\n")))
      << run.out;
  // The step's breakdown and its model FLOPs utilisation.
  EXPECT_TRUE(
      std::regex_search(run.out, std::regex("step +[0-9.]+ ms: forward [0-9.]+ \\([0-9]+%\\) · "
                                            "backward [0-9.]+ \\([0-9]+%\\)")))
      << run.out;
  EXPECT_TRUE(std::regex_search(run.out, std::regex("MFU [0-9.]+% of the BF16 GEMM peak")))
      << run.out;
  // The steady speed leaves out this process's first 4 of 40 steps.
  EXPECT_TRUE(std::regex_search(
      run.out, std::regex("speed +[0-9.]+k? tokens/s over steps 5–40 \\(after 4 warm-up steps")))
      << run.out;
}

// --profile-steps A:B writes a Chrome-trace JSON of those steps with LibTorch's profiler: ATen
// operators and mixprec's own named ranges, once per traced step.
TEST(TrainRun, ProfileStepsWritesATraceOfThoseSteps) {
  Scratch dir;
  write_corpus(dir / "corpus.txt");
  const auto train = [&](const std::string& steps) {
    return run_program(dir.path(), tiny_model() + std::vector<std::string>{
                                                      "--data", (dir / "corpus.txt").string(),
                                                      "--steps", "5", "--ckpt-every", "5", "--out",
                                                      "run", "--profile-steps", steps});
  };
  const ProgramRun run = train("2:3");
  ASSERT_EQ(run.status, 0) << run.err << run.out;
  // Under the profiler a step is not the run's speed, nor is writing the trace part of a step.
  EXPECT_NE(run.out.find("(after 0 warm-up steps; traced steps 2–3 left out;"), std::string::npos)
      << run.out;
  const auto records = read_metrics(dir / "run/metrics.jsonl");
  ASSERT_EQ(records.size(), 5u);
  const StepRecord& last_traced = records[2];
  EXPECT_NEAR(last_traced.step_s, last_traced.phases.timed_s() + last_traced.phases.other_s,
              1e-3 + 0.05 * last_traced.step_s)
      << "the trace is written after the step's clock stopped";
  const fs::path trace = dir / "run/trace-rank0.json";
  EXPECT_NE(run.out.find("trace       run/trace-rank0.json"), std::string::npos) << run.out;
  const nlohmann::json json = nlohmann::json::parse(read_text(trace));
  std::map<std::string, int> ranges;
  size_t aten = 0;
  for (const auto& event : json.at("traceEvents")) {
    const std::string name = event.value("name", "");
    if (name.rfind("mixprec::", 0) == 0) ++ranges[name];
    if (name.rfind("aten::", 0) == 0) ++aten;
  }
  EXPECT_GT(aten, 100u);
  for (const char* phase : {"mixprec::forward", "mixprec::backward", "mixprec::optimizer",
                            "mixprec::optimizer_update"}) {
    EXPECT_EQ(ranges[phase], 2) << phase << ": one per traced step";
  }
  EXPECT_GT(ranges["mixprec::fake_quant"], 0);

  const ProgramRun bad = train("3:2");
  EXPECT_EQ(bad.status, 2);
  EXPECT_NE(bad.err.find("--profile-steps '3:2': expected A:B, steps 1 <= A <= B"),
            std::string::npos)
      << bad.err;
  const ProgramRun late = train("2:9");
  EXPECT_EQ(late.status, 2);
  EXPECT_NE(late.err.find("--profile-steps 2:9 ends after --steps 5"), std::string::npos)
      << late.err;
}

TEST(TrainRun, WithoutDataItTrainsOnThePythonDocs) {
  Scratch dir;
  const ProgramRun run =
      run_program(dir.path(), tiny_model() + std::vector<std::string>{"--steps", "2"});
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_NE(run.out.find("pydoc_data/topics.py"), std::string::npos) << run.out;
  // Two steps are the ones the step-peak figure leaves out: not a peak of 0 bytes.
  EXPECT_NE(run.out.find("a step's peak: not measured"), std::string::npos) << run.out;
  EXPECT_EQ(run.out.find("activations kept for backward 0 B"), std::string::npos) << run.out;
  // The plot hint works from where the run was started (here, a scratch directory outside the
  // source tree): the script it names exists as written.
  std::smatch plot;
  ASSERT_TRUE(std::regex_search(run.out, plot, std::regex(R"(\(plot: \S+ (\S+plot_metrics\.py) )")))
      << run.out;
  EXPECT_TRUE(fs::exists(dir / plot[1].str())) << plot[1].str();
  // No --out: a new run directory under runs/ in the working directory.
  std::vector<fs::path> runs;
  for (const auto& e : fs::directory_iterator(dir / "runs")) runs.push_back(e.path());
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_TRUE(std::regex_match(runs[0].filename().string(), std::regex("[0-9]{8}-[0-9]{6}")));
  EXPECT_EQ(count_lines(runs[0] / "metrics.jsonl"), 2u);
  EXPECT_TRUE(fs::exists(runs[0] / "checkpoints/step-000002/manifest.json"));

  // --resume with no directory continues the newest run under runs/, its shape taken from the
  // checkpoint (no model flags repeated), its metrics appended to.
  const ProgramRun resumed = run_program(
      dir.path(), {"--resume", "--steps", "4", "--threads", "1", "--sample-tokens", "0"});
  ASSERT_EQ(resumed.status, 0) << resumed.err;
  EXPECT_NE(resumed.out.find("1 layer, d_model 32"), std::string::npos) << resumed.out;
  EXPECT_EQ(count_lines(runs[0] / "metrics.jsonl"), 4u);
  EXPECT_TRUE(fs::exists(runs[0] / "checkpoints/step-000004/manifest.json"));
}

TEST(TrainRun, GradientAccumulationAndAsyncSaveTrainTheSameSteps) {
  // Accumulating 4 micro-batches of 2 sequences is the same batch of 8 as one pass, cut in
  // rows: the losses agree to rounding (BF16 sums in another order), and the async save
  // writes the same checkpoints.
  Scratch dir;
  write_corpus(dir / "corpus.txt");
  const auto common =
      tiny_model() + std::vector<std::string>{"--data",       (dir / "corpus.txt").string(),
                                              "--steps",      "6",
                                              "--ckpt-every", "3",
                                              "--fp8",        "off"};
  ASSERT_EQ(run_program(dir.path(), common + std::vector<std::string>{"--out", "one"}).status, 0);
  // Checkpoints under a path of 350 characters: the summary's line names it whole.
  const fs::path ckpt_dir = dir / (std::string(120, 'a') + "/" + std::string(120, 'b') + "/" +
                                   std::string(100, 'c') + "/ck");
  const ProgramRun accum =
      run_program(dir.path(), common + std::vector<std::string>{"--out", "acc", "--grad-accum", "4",
                                                                "--async-save", "--ckpt-dir",
                                                                ckpt_dir.string()});
  ASSERT_EQ(accum.status, 0) << accum.err;
  EXPECT_NE(accum.out.find("async: written in the background"), std::string::npos);
  EXPECT_NE(accum.out.find("the run's end waited"), std::string::npos)
      << "the end-of-run wait for the last background save is reported apart from training's";
  const std::regex checkpoint_line(
      R"re(\ncheckpoint  ([^\n]*?): [^\n]* for the last\)\nmetrics )re");
  std::smatch line;
  ASSERT_TRUE(std::regex_search(accum.out, line, checkpoint_line)) << accum.out;
  EXPECT_EQ(line[1].str(), (ckpt_dir / "step-000006").string());
  // Whether a save found the one before still writing depends on the machine; the note on
  // stderr and the summary's count must agree either way.
  EXPECT_EQ(accum.err.find("checkpoint waited") != std::string::npos,
            accum.out.find("for the one before") != std::string::npos)
      << accum.err << accum.out;
  const auto one = read_metrics(dir / "one/metrics.jsonl");
  const auto acc = read_metrics(dir / "acc/metrics.jsonl");
  ASSERT_EQ(one.size(), 6u);
  ASSERT_EQ(acc.size(), 6u);
  EXPECT_NEAR(one[0].loss, acc[0].loss, 1e-3) << "same weights, same rows: only rounding differs";
  for (size_t i = 0; i < 6; ++i) EXPECT_NEAR(one[i].loss, acc[i].loss, 0.05) << "step " << i + 1;
  EXPECT_TRUE(fs::exists(ckpt_dir / "step-000003/manifest.json"));
  EXPECT_TRUE(fs::exists(ckpt_dir / "step-000006/manifest.json"));
}

// --recompute runs each block again in backward: the same steps bit for bit (losses, gradient
// norms, validation), and fewer activations kept for backward, as the summary counts them.
TEST(TrainRun, RecomputeTrainsTheSameStepsWithFewerActivationsKept) {
  Scratch dir;
  write_corpus(dir / "corpus.txt");
  const auto common =
      tiny_model() + std::vector<std::string>{"--data",       (dir / "corpus.txt").string(),
                                              "--layers",     "2",
                                              "--steps",      "5",
                                              "--eval-every", "5",
                                              "--ckpt-every", "5"};
  const ProgramRun plain =
      run_program(dir.path(), common + std::vector<std::string>{"--out", "plain"}, "plain");
  ASSERT_EQ(plain.status, 0) << plain.err;
  const ProgramRun recomputed = run_program(
      dir.path(), common + std::vector<std::string>{"--out", "again", "--recompute"}, "again");
  ASSERT_EQ(recomputed.status, 0) << recomputed.err;
  const auto a = read_metrics(dir / "plain/metrics.jsonl");
  const auto b = read_metrics(dir / "again/metrics.jsonl");
  ASSERT_EQ(a.size(), 5u);
  ASSERT_EQ(b.size(), 5u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].loss, b[i].loss) << "step " << i + 1;
    EXPECT_EQ(a[i].aux_loss, b[i].aux_loss) << "step " << i + 1;
    EXPECT_EQ(a[i].grad_norm, b[i].grad_norm) << "step " << i + 1;
    EXPECT_EQ(a[i].val_loss, b[i].val_loss) << "step " << i + 1;
  }
  // "activations kept for backward 1.23 MiB" (or KiB) in each summary.
  const auto activations = [](const std::string& out) {
    std::smatch m;
    const std::regex line(R"(activations kept for backward ([0-9.]+) (KiB|MiB))");
    if (!std::regex_search(out, m, line)) return -1.0;
    return std::stod(m[1]) * (m[2] == "MiB" ? 1024.0 : 1.0);
  };
  const double kept = activations(plain.out), kept_recomputed = activations(recomputed.out);
  ASSERT_GT(kept, 0) << plain.out;
  ASSERT_GT(kept_recomputed, 0) << recomputed.out;
  EXPECT_LT(kept_recomputed, kept) << plain.out << recomputed.out;
  EXPECT_NE(recomputed.out.find(", recompute"), std::string::npos) << recomputed.out;
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace train
