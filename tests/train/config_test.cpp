// mixprec-train's flags: parsing, the one-line errors bad flags get, and how a resumed run
// takes its shape from the checkpoint.
#include "config.h"

#include <gtest/gtest.h>

namespace train {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

ParsedArgs parse(std::vector<std::string> args) {
  std::vector<const char*> argv = {"mixprec-train"};
  for (const auto& a : args) argv.push_back(a.c_str());
  return parse_args(static_cast<int>(argv.size()), argv.data());
}

std::string usage_error(std::vector<std::string> args) {
  try {
    parse(std::move(args));
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

TEST(TrainConfig, ParsesBothFlagFormsAndRecordsWhichWereGiven) {
  const TrainConfig c =
      parse({"--layers", "3", "--d-model=64", "--fp8", "off", "--async-save", "--lr", "1e-3"})
          .config;
  EXPECT_EQ(c.layers, 3);
  EXPECT_EQ(c.d_model, 64);
  EXPECT_EQ(c.fp8, "off");
  EXPECT_TRUE(c.async_save);
  EXPECT_DOUBLE_EQ(c.lr, 1e-3);
  EXPECT_TRUE(c.is_given("d_model"));
  EXPECT_TRUE(c.is_given("async_save"));
  EXPECT_FALSE(c.is_given("heads"));
  EXPECT_EQ(c.heads, TrainConfig().heads);
}

TEST(TrainConfig, UnknownFlagSuggestsTheClosestOne) {
  const std::string message = usage_error({"--layer", "2"});
  EXPECT_NE(message.find("unknown flag '--layer'"), std::string::npos) << message;
  EXPECT_NE(message.find("did you mean --layers?"), std::string::npos) << message;
  EXPECT_EQ(usage_error({"--zzzzzzzzzz"}).find("did you mean"), std::string::npos);
  // Three edits away is still a suggestion; four is none.
  EXPECT_NE(usage_error({"--outdir", "x"}).find("(did you mean --out?)"), std::string::npos);
  EXPECT_EQ(usage_error({"--max-steps", "9"}).find("did you mean"), std::string::npos);
}

TEST(TrainConfig, BadValuesNameTheFlag) {
  EXPECT_NE(usage_error({"--steps", "ten"}).find("--steps expects an integer, got 'ten'"),
            std::string::npos);
  EXPECT_NE(usage_error({"--lr", "fast"}).find("--lr expects a number"), std::string::npos);
  EXPECT_NE(usage_error({"--steps"}).find("--steps needs a value"), std::string::npos);
  EXPECT_NE(usage_error({"--resume=yes"}).find("--resume takes no value"), std::string::npos);
  EXPECT_NE(usage_error({"--precision", "fp8"}).find("--precision must be bf16 or fp16"),
            std::string::npos);
  EXPECT_NE(usage_error({"--heads", "3"}).find("--heads 3 does not divide --d-model 128"),
            std::string::npos);
  EXPECT_NE(usage_error({"--top-k", "5"}).find("--top-k 5 exceeds --experts 4"), std::string::npos);
  EXPECT_NE(usage_error({"--batch", "6", "--grad-accum", "4"})
                .find("--grad-accum 4 does not divide --batch 6"),
            std::string::npos);
  EXPECT_NE(usage_error({"--layers", "0"}).find("--layers must be at least 1"), std::string::npos);
  EXPECT_NE(usage_error({"--malloc", "fast"}).find("--malloc must be keep or system, not 'fast'"),
            std::string::npos);
}

TEST(TrainConfig, ABatchTheRanksDoNotSplitSaysRanksTimesGradAccumMustDivideIt) {
  TrainConfig config = parse({"--batch", "16"}).config;
  config.world_size = 3;  // a 2-rank run's checkpoint resumed on 3 ranks: --batch is fixed
  std::string message;
  try {
    validate_combinations(config);
  } catch (const UsageError& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("--batch 16 does not split into 3 ranks"), std::string::npos) << message;
  EXPECT_NE(message.find("ranks that, times --grad-accum, divides --batch"), std::string::npos)
      << message;
  config.world_size = 4;
  EXPECT_NO_THROW(validate_combinations(config));

  // The ranks divide --batch, but not into --grad-accum micro-batches each: the same hint.
  config = parse({"--batch", "4", "--grad-accum", "4"}).config;
  config.world_size = 2;
  message.clear();
  try {
    validate_combinations(config);
  } catch (const UsageError& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("--batch 4 does not split into 2 ranks x --grad-accum 4"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("ranks that, times --grad-accum, divides --batch"), std::string::npos)
      << message;
}

TEST(TrainConfig, HelpListsEveryFlagWithItsDefault) {
  EXPECT_TRUE(parse({"--help"}).help);
  EXPECT_TRUE(parse({"--layers", "0", "--help"}).help) << "--help answers whatever else is given";
  const std::string text = usage();
  for (const char* flag :
       {"--layers", "--d-model", "--heads", "--steps", "--batch", "--seq-len", "--experts",
        "--top-k", "--precision", "--fp8", "--ckpt-dir", "--ckpt-every", "--metrics", "--seed",
        "--data", "--resume", "--async-save", "--grad-accum", "--lr"}) {
    EXPECT_NE(text.find(flag), std::string::npos) << flag;
  }
  EXPECT_NE(text.find("--steps N"), std::string::npos);
  EXPECT_NE(text.find("[600]"), std::string::npos) << "defaults are shown";
  // Whole numbers held as doubles print as whole numbers; fractions as they are.
  EXPECT_NE(text.find("[65536]"), std::string::npos) << "--loss-scale's default";
  EXPECT_EQ(text.find("65536.0"), std::string::npos);
  EXPECT_NE(text.find("[0.006]"), std::string::npos) << "--lr's default";
  // Each section's heading once: its flags sit together.
  for (const char* heading : {"\nmodel:\n", "\nprecision:\n", "\ndata:\n", "\ntraining:\n",
                              "\nevaluation and output:\n", "\ncheckpoints:\n", "\nsample:\n"}) {
    const std::size_t first = text.find(heading);
    EXPECT_NE(first, std::string::npos) << heading;
    EXPECT_EQ(text.find(heading, first + 1), std::string::npos) << heading << " appears twice";
  }
}

TEST(TrainConfig, ResumeAdoptsTheSavedShapeAndRefusesAGivenDifferentOne) {
  TrainConfig saved = parse({"--layers", "3", "--precision", "fp16", "--seed", "7"}).config;
  const nlohmann::json shape = run_shape(saved);

  TrainConfig resumed = parse({"--resume", "--steps", "900"}).config;
  adopt_run_shape(resumed, shape, "checkpoint X");
  EXPECT_EQ(resumed.layers, 3);
  EXPECT_EQ(resumed.precision, "fp16");
  EXPECT_EQ(resumed.seed, 7);
  EXPECT_EQ(resumed.steps, 900);

  TrainConfig other = parse({"--resume", "--layers", "2"}).config;
  const TrainConfig before = other;
  try {
    adopt_run_shape(other, shape, "checkpoint X");
    FAIL() << "a different --layers must be refused";
  } catch (const UsageError& e) {
    EXPECT_STREQ(e.what(),
                 "checkpoint X was trained with --layers 3; this run asks for --layers 2");
  }
  EXPECT_EQ(other.precision, before.precision) << "a refused resume changes nothing";

  nlohmann::json incomplete = shape;
  incomplete.erase("experts");
  TrainConfig fresh = parse({"--resume"}).config;
  try {
    adopt_run_shape(fresh, incomplete, "checkpoint X");
    FAIL();
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("no value for --experts"), std::string::npos) << e.what();
  }
}

// A resumed run is the run it continues: its course (steps, schedule, cadence, sample) comes
// from the checkpoint unless given again; what belongs to this process alone does not.
TEST(TrainConfig, ResumeCarriesTheRunsSettingsAndReportsWhatIsGivenAnew) {
  const TrainConfig saved =
      parse({"--steps",        "12",   "--warmup",     "2", "--lr",         "0.01",
             "--weight-decay", "0.5",  "--eval-every", "3", "--ckpt-every", "4",
             "--prompt",       "Once", "--threads",    "1", "--progress",   "none",
             "--stop-at",      "6",    "--recompute"})
          .config;
  const nlohmann::json shape = run_shape(saved);
  for (const char* mine : {"threads", "progress", "stop_at", "recompute", "out", "resume"}) {
    EXPECT_FALSE(shape.contains(mine)) << mine << " is this process's own";
  }

  TrainConfig resumed = parse({"--resume"}).config;
  EXPECT_TRUE(adopt_run_shape(resumed, shape, "checkpoint X").empty());
  EXPECT_EQ(resumed.steps, 12);
  EXPECT_EQ(resumed.warmup, 2);
  EXPECT_EQ(resumed.lr, 0.01);
  EXPECT_EQ(resumed.weight_decay, 0.5);
  EXPECT_EQ(resumed.eval_every, 3);
  EXPECT_EQ(resumed.ckpt_every, 4);
  EXPECT_EQ(resumed.prompt, "Once");
  const TrainConfig defaults;
  EXPECT_EQ(resumed.threads, defaults.threads);
  EXPECT_EQ(resumed.stop_at, 0) << "--stop-at 6 would stop the resumed run at once";
  EXPECT_FALSE(resumed.recompute);

  TrainConfig changed = parse({"--resume", "--steps", "20", "--weight-decay", "0.5"}).config;
  const std::vector<ResumeChange> changes = adopt_run_shape(changed, shape, "checkpoint X");
  ASSERT_EQ(changes.size(), 1u) << "--weight-decay is given with its saved value";
  EXPECT_EQ(changes[0].flag, "steps");
  EXPECT_EQ(changes[0].saved, "--steps 12");
  EXPECT_EQ(changes[0].now, "--steps 20");
  EXPECT_EQ(changed.steps, 20);
  EXPECT_EQ(changed.warmup, 2);

  // A checkpoint from before the run's course was saved holds the fixed flags only: the
  // defaults stand for the rest, as they did then.
  nlohmann::json fixed_only = shape;
  for (const char* key : {"steps", "lr", "warmup", "weight_decay", "prompt", "loss_scale"})
    fixed_only.erase(key);
  TrainConfig old = parse({"--resume"}).config;
  adopt_run_shape(old, fixed_only, "checkpoint X");
  EXPECT_EQ(old.steps, defaults.steps);
  EXPECT_EQ(old.weight_decay, defaults.weight_decay);

  nlohmann::json wrong_type = shape;
  wrong_type["steps"] = "twelve";
  TrainConfig refused = parse({"--resume"}).config;
  try {
    adopt_run_shape(refused, wrong_type, "checkpoint X");
    FAIL() << "a malformed saved value must be refused";
  } catch (const UsageError& e) {
    EXPECT_STREQ(e.what(), "checkpoint X: malformed value for --steps");
  }
}

// every setting of the run's course, set to a non-default value, comes back on
// `--resume` alone (the existing test covers steps, warmup, lr, weight decay, cadences, prompt).
TEST(TrainConfig, ResumeAloneCarriesEveryCourseSetting) {
  const TrainConfig saved =
      parse({"--clip-grad", "0.25", "--min-lr-ratio", "0.3", "--aux-loss-coef", "0.02",
             "--bias-update-rate", "0.004", "--keep-last", "5", "--eval-batches", "3",
             "--ckpt-timeout", "600"})
          .config;
  TrainConfig resumed = parse({"--resume"}).config;
  EXPECT_TRUE(adopt_run_shape(resumed, run_shape(saved), "checkpoint X").empty());
  EXPECT_EQ(resumed.clip_grad, 0.25);
  EXPECT_EQ(resumed.min_lr_ratio, 0.3);
  EXPECT_EQ(resumed.aux_loss_coef, 0.02);
  EXPECT_EQ(resumed.bias_update_rate, 0.004);
  EXPECT_EQ(resumed.keep_last, 5);
  EXPECT_EQ(resumed.eval_batches, 3);
  EXPECT_EQ(resumed.ckpt_timeout, 600);
}

// Every count is at least 1: 0 is refused, in one message naming the flag and the value.
TEST(TrainConfig, EveryCountRefusesZeroNamingTheFlag) {
  for (const char* flag : {"layers", "d-model", "heads", "experts", "top-k", "seq-len", "steps",
                           "batch", "grad-accum", "eval-every", "eval-batches", "log-every",
                           "ckpt-every", "keep-last", "staging-budget-mb"}) {
    const std::string name = std::string("--") + flag;
    EXPECT_EQ(usage_error({name, "0"}), name + " must be at least 1, got 0");
  }
}

// Each range takes its bounds and refuses a value just beyond either, naming the flag ("" is
// an accepted command line).
TEST(TrainConfig, RangesTakeTheirBoundsAndRefuseJustBeyond) {
  EXPECT_EQ(usage_error({"--threads", "0"}), "");
  EXPECT_EQ(usage_error({"--threads", "1024"}), "");
  EXPECT_EQ(usage_error({"--threads", "1025"}), "--threads must lie in [0, 1024], got 1025");
  EXPECT_EQ(usage_error({"--threads", "-1"}), "--threads must lie in [0, 1024], got -1");
  EXPECT_EQ(usage_error({"--wait-for-ckpt-dir", "0"}), "");
  EXPECT_EQ(usage_error({"--wait-for-ckpt-dir", "31536000"}), "") << "a year";
  EXPECT_EQ(usage_error({"--wait-for-ckpt-dir", "31536001"}),
            "--wait-for-ckpt-dir must lie in [0, 31536000] seconds, got 31536001");
  EXPECT_EQ(usage_error({"--wait-for-ckpt-dir", "-1"}),
            "--wait-for-ckpt-dir must lie in [0, 31536000] seconds, got -1");
  EXPECT_EQ(usage_error({"--ckpt-timeout", "1"}), "");
  EXPECT_EQ(usage_error({"--ckpt-timeout", "31536000"}), "");
  EXPECT_EQ(usage_error({"--ckpt-timeout", "31536001"}),
            "--ckpt-timeout must lie in [1, 31536000] seconds, got 31536001");
  EXPECT_EQ(usage_error({"--loss-scale", "1"}), "");
  EXPECT_EQ(usage_error({"--loss-scale", "0.5"}), "--loss-scale must be at least 1");
  EXPECT_EQ(usage_error({"--min-lr-ratio", "0"}), "");
  EXPECT_EQ(usage_error({"--min-lr-ratio", "1"}), "");
  EXPECT_EQ(usage_error({"--min-lr-ratio", "1.5"}), "--min-lr-ratio must lie in [0, 1]");
  EXPECT_EQ(usage_error({"--min-lr-ratio", "-0.1"}), "--min-lr-ratio must lie in [0, 1]");
  EXPECT_EQ(usage_error({"--val-fraction", "0.5"}), "");
  EXPECT_EQ(usage_error({"--val-fraction", "1"}), "--val-fraction must lie in (0, 1)");
  EXPECT_EQ(usage_error({"--val-fraction", "0"}), "--val-fraction must lie in (0, 1)");
  EXPECT_EQ(usage_error({"--lr", "0"}), "--lr must be positive");
  EXPECT_EQ(usage_error({"--seed", "0"}), "");
  EXPECT_EQ(usage_error({"--seed", "-1"}), "--seed must not be negative");
  EXPECT_EQ(usage_error({"--stop-at", "-1"}), "--stop-at must not be negative");
  EXPECT_EQ(usage_error({"--temperature", "0"}), "") << "0 samples greedily";
  EXPECT_EQ(usage_error({"--temperature", "-0.5"}), "--temperature must not be negative");
  EXPECT_EQ(usage_error({"--sample-tokens", "0"}), "");
  EXPECT_EQ(usage_error({"--sample-tokens", "-1"}), "--sample-tokens must not be negative");
  EXPECT_EQ(usage_error({"--clip-grad", "0"}), "") << "0 turns clipping off";
  for (const char* flag :
       {"warmup", "weight-decay", "clip-grad", "aux-loss-coef", "bias-update-rate"}) {
    const std::string message = usage_error({std::string("--") + flag, "-1"});
    EXPECT_EQ(message.rfind(std::string("--") + flag + " must not be negative", 0), 0u) << message;
  }
}

// Each flag with a set of values takes every one of them and refuses any other, naming it.
TEST(TrainConfig, EveryChoiceIsTakenAndAnyOtherRefused) {
  for (const char* v : {"bf16", "fp16"}) EXPECT_EQ(usage_error({"--precision", v}), "") << v;
  for (const char* v : {"off", "e4m3", "hybrid"}) EXPECT_EQ(usage_error({"--fp8", v}), "") << v;
  for (const char* v : {"auto", "bar", "lines", "none"})
    EXPECT_EQ(usage_error({"--progress", v}), "") << v;
  for (const char* v : {"auto", "active", "passive"})
    EXPECT_EQ(usage_error({"--omp-wait", v}), "") << v;
  for (const char* v : {"keep", "system"}) EXPECT_EQ(usage_error({"--malloc", v}), "") << v;
  EXPECT_EQ(usage_error({"--fp8", "e5m2"}), "--fp8 must be off, e4m3 or hybrid, got 'e5m2'");
  EXPECT_EQ(usage_error({"--progress", "fancy"}),
            "--progress must be auto, bar, lines or none, got 'fancy'");
  EXPECT_EQ(usage_error({"--omp-wait", "spin"}),
            "--omp-wait must be auto, active or passive, not 'spin'");
}

// A number must be all of the value: trailing characters, infinities and NaN are refused.
TEST(TrainConfig, ANumberIsTheWholeValueAndFinite) {
  EXPECT_EQ(usage_error({"--steps", "12x"}), "--steps expects an integer, got '12x'");
  EXPECT_EQ(usage_error({"--steps", ""}), "--steps expects an integer, got ''");
  EXPECT_EQ(usage_error({"--lr", "1e-3x"}), "--lr expects a number, got '1e-3x'");
  EXPECT_EQ(usage_error({"--clip-grad", "inf"}), "--clip-grad expects a number, got 'inf'");
  EXPECT_EQ(usage_error({"--lr", "nan"}), "--lr expects a number, got 'nan'");
}

// Combinations at their limits: every expert per token, a trace ending at the last step. A
// trace from step 0, or one ending before it starts, is refused; so is --init-from with
// --resume.
TEST(TrainConfig, CombinationsTakeTheirLimits) {
  EXPECT_EQ(usage_error({"--top-k", "4", "--experts", "4"}), "");
  EXPECT_EQ(usage_error({"--steps", "10", "--profile-steps", "10:10"}), "");
  EXPECT_EQ(usage_error({"--steps", "10", "--profile-steps", "9:11"}),
            "--profile-steps 9:11 ends after --steps 10");
  EXPECT_EQ(parse_profile_steps("1:1").first, 1);
  EXPECT_EQ(parse_profile_steps("1:1").last, 1);
  for (const std::string bad : {"0:1", "3:2", "2", "2:x", ":3"}) {
    EXPECT_EQ(usage_error({"--profile-steps", bad}),
              "--profile-steps '" + bad + "': expected A:B, steps 1 <= A <= B");
  }
  EXPECT_EQ(usage_error({"--init-from", "export", "--resume"}),
            "--init-from starts a new run from exported weights; --resume continues a run from its "
            "checkpoint: give one of them");
}

// Every flag fixed on resume, given again with another value, is refused naming it and both
// values, and --help says it is fixed.
TEST(TrainConfig, ResumeRefusesEveryFixedFlagGivenAnotherValue) {
  const nlohmann::json shape = run_shape(TrainConfig());
  const std::string help = usage();
  const std::vector<std::pair<std::string, std::string>> fixed = {
      {"layers", "3"},     {"d-model", "64"},       {"heads", "8"},        {"experts", "8"},
      {"top-k", "1"},      {"seq-len", "64"},       {"precision", "fp16"}, {"fp8", "off"},
      {"loss-scale", "2"}, {"val-fraction", "0.2"}, {"batch", "32"},       {"grad-accum", "2"},
      {"seed", "7"}};
  for (const auto& [flag, value] : fixed) {
    SCOPED_TRACE("--" + flag);
    TrainConfig resumed = parse({"--resume", "--" + flag, value}).config;
    try {
      adopt_run_shape(resumed, shape, "checkpoint X");
      ADD_FAILURE() << "another value is refused";
    } catch (const UsageError& e) {
      const std::string message = e.what();
      EXPECT_EQ(message.rfind("checkpoint X was trained with --" + flag + " ", 0), 0u) << message;
      EXPECT_NE(message.find("; this run asks for --" + flag + " " + value), std::string::npos)
          << message;
    }
    const size_t at = help.find("  --" + flag + " ");
    ASSERT_NE(at, std::string::npos);
    const std::string line = help.substr(at, help.find('\n', at) - at);
    EXPECT_NE(line.find("(fixed on resume)"), std::string::npos) << line;
  }
  for (const char* carried : {"steps", "lr", "data", "ckpt-every", "keep-last"}) {
    const size_t at = help.find(std::string("  --") + carried + " ");
    ASSERT_NE(at, std::string::npos) << carried;
    const std::string line = help.substr(at, help.find('\n', at) - at);
    EXPECT_EQ(line.find("(fixed on resume)"), std::string::npos) << line;
  }
}

// Once adopted, the run's settings are checked together: a trace past the saved --steps, or
// ranks that do not split the saved --batch, is refused, and the config stays as it was.
TEST(TrainConfig, ResumeChecksTheAdoptedSettingsTogether) {
  const nlohmann::json shape = run_shape(parse({"--steps", "8", "--batch", "16"}).config);
  TrainConfig traced = parse({"--resume", "--profile-steps", "9:10"}).config;
  try {
    adopt_run_shape(traced, shape, "checkpoint X");
    ADD_FAILURE() << "a trace after the run's last step is refused";
  } catch (const UsageError& e) {
    EXPECT_STREQ(e.what(), "--profile-steps 9:10 ends after --steps 8");
  }
  EXPECT_EQ(traced.steps, TrainConfig().steps) << "a refused resume changes nothing";

  TrainConfig three_ranks = parse({"--resume"}).config;
  three_ranks.world_size = 3;
  try {
    adopt_run_shape(three_ranks, shape, "checkpoint X");
    ADD_FAILURE() << "3 ranks do not split --batch 16";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("--batch 16 does not split into 3 ranks"),
              std::string::npos)
        << e.what();
  }
}

// A setting given anew on resume whose saved value was the default empty one (the built-in
// corpus) is reported as "(default)", not as a flag without a value.
TEST(TrainConfig, ResumeReportsAnEmptySavedValueAsTheDefault) {
  TrainConfig resumed = parse({"--resume", "--data", "corpus.txt"}).config;
  const std::vector<ResumeChange> changes =
      adopt_run_shape(resumed, run_shape(TrainConfig()), "checkpoint X");
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_EQ(changes[0].saved, "--data (default)");
  EXPECT_EQ(changes[0].now, "--data corpus.txt");
}

// A saved configuration that is not a JSON object is refused naming its source.
TEST(TrainConfig, ResumeRefusesASavedConfigurationThatIsNoObject) {
  for (const nlohmann::json& shape : {nlohmann::json::array({1, 2}), nlohmann::json("layers")}) {
    TrainConfig resumed = parse({"--resume"}).config;
    try {
      adopt_run_shape(resumed, shape, "checkpoint X");
      ADD_FAILURE() << shape.dump();
    } catch (const UsageError& e) {
      EXPECT_STREQ(e.what(), "checkpoint X holds no mixprec-train configuration");
    }
  }
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace train
