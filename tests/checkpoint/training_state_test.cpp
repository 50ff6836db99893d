// Saving and resuming whole training states: bitwise resume in a fresh process, in-process
// round trips, corrupted checkpoints that must leave everything untouched, async saves.
#include "mixprec/checkpoint/training_state.h"

#include "checkpoint/support_training.h"
#include "checkpoint/support_unchanged.h"
#include "mixprec/checkpoint/async_save.h"
#include "mixprec/checkpoint/format/error.h"
#include "mixprec/checkpoint/format/state_keys.h"

#include "checkpoint/format/format_test_util.h"
#include "support/error_message.h"
#include "support/test_env.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>

namespace mixprec::checkpoint {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

namespace fs = std::filesystem;
using mixprec::testing::expect_unchanged;
using mixprec::testing::snapshot;
using mixprec::testing::TrainingSetup;

// A scratch checkpoint root, removed at scope exit.
struct TempRoot {
  testing::TempDir dir;
  const fs::path& path = dir.path();
};

void run_worker(const std::string& args) {
  const std::string command = mixprec::test::required_env("MIXPREC_RESUME_WORKER") + " " + args;
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
}

void expect_same_checkpoint(const fs::path& a, const fs::path& b) {
  const ShardedStateDict sa = read_checkpoint(a), sb = read_checkpoint(b);
  ASSERT_EQ(sa.tensors.size(), sb.tensors.size());
  for (const auto& [key, t] : sa.tensors) {
    ASSERT_TRUE(sb.contains(key)) << key;
    EXPECT_TRUE(t.local.scalar_type() == sb.at(key).local.scalar_type() &&
                at::equal(t.local, sb.at(key).local))
        << key;
  }
  EXPECT_EQ(sa.common, sb.common);
}

class ResumeTest : public ::testing::TestWithParam<std::string> {};

// N steps straight == k steps, save, load in a fresh process, N - k steps: params, masters,
// moments, step, scaler and the RNG (data order) all bitwise identical.
TEST_P(ResumeTest, FreshProcessResumeIsBitwise) {
  const std::string dtype = GetParam();
  TempRoot straight, split;
  run_worker("straight " + straight.path.string() + " " + dtype + " 12");
  run_worker("first " + split.path.string() + " " + dtype + " 5");
  run_worker("resume " + split.path.string() + " " + dtype + " 12");
  expect_same_checkpoint(straight.path / "final", split.path / "final");
  const ShardedStateDict final_state = read_checkpoint(split.path / "final");
  EXPECT_EQ(final_state.common["user"]["steps_done"], 12);
  if (dtype == "fp16") {
    // The scaler started at 1e30: early steps overflowed and were skipped.
    EXPECT_LT(final_state.common["optimizer"]["scaler"]["scale"].get<double>(), 1e30);
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, ResumeTest, ::testing::Values("bf16", "fp16"));

TEST(TrainingState, InProcessRoundTrip) {
  TempRoot root;
  TrainingSetup a(at::kBFloat16);
  for (int i = 0; i < 3; ++i) a.step();
  const SaveResult saved =
      save_training_state(root.path, "s3", *a.model, *a.optimizer, {{"epoch", 1}});
  EXPECT_EQ(saved.files, 1u);
  TrainingSetup b(at::kBFloat16);
  const ResumeResult resumed = load_training_state(root.path, *b.model, *b.optimizer);
  EXPECT_EQ(resumed.dir, root.path / "s3");
  EXPECT_EQ(resumed.user["epoch"], 1);
  EXPECT_TRUE(resumed.optimizer.clean());
  if (!at::hasCUDA()) EXPECT_TRUE(resumed.rng.notes.empty()) << resumed.rng.to_string();
  expect_unchanged(b, snapshot(a));
}

// A GPU run's checkpoint (with "rng.cuda.0") resumes on a machine without CUDA: the CUDA state
// is ignored with a note, everything else loads.
TEST(TrainingState, CudaRngStateIsIgnoredWithANoteWithoutCuda) {
  if (at::hasCUDA()) GTEST_SKIP() << "this process has CUDA";
  TempRoot root;
  TrainingSetup a(at::kBFloat16);
  a.step();
  ShardedStateDict state = training_state_dict(*a.model, *a.optimizer);
  EXPECT_FALSE(state.contains("rng.cuda.0")) << "no CUDA here: no CUDA state saved";
  state.tensors.emplace("rng.cuda.0", ShardedTensor::whole(at::zeros({16}, at::kByte)));
  save_checkpoint(root.path, "gpu-run", state);
  TrainingSetup b(at::kBFloat16);
  const ResumeResult resumed = load_training_state(root.path, *b.model, *b.optimizer);
  ASSERT_EQ(resumed.rng.notes.size(), 1u);
  EXPECT_EQ(resumed.rng.notes[0], "rng.cuda.0: ignored, CUDA is not available here");
  expect_unchanged(b, snapshot(a));
}

TEST(TrainingState, BadRngStateNamesTheKeyAndTheCheckpointAndChangesNothing) {
  for (const auto& [key, value] : std::vector<std::pair<std::string, at::Tensor>>{
           {"rng.cpu", at::zeros({7}, at::kByte)}, {"rng.cuda.x", at::zeros({16}, at::kByte)}}) {
    SCOPED_TRACE(key);
    TempRoot root;
    TrainingSetup a(at::kBFloat16);
    a.step();
    ShardedStateDict state = training_state_dict(*a.model, *a.optimizer);
    state.tensors[key] = ShardedTensor::whole(value);
    const SaveResult saved = save_checkpoint(root.path, "bad-rng", state);
    TrainingSetup b(at::kBFloat16);
    b.step();
    const ShardedStateDict before = snapshot(b);
    const at::Tensor rng_before = at::detail::getDefaultCPUGenerator().get_state();
    const std::string msg =
        mixprec::testing::error_of([&] { load_training_state(root.path, *b.model, *b.optimizer); });
    EXPECT_NE(msg.find("'" + key + "'"), std::string::npos) << msg;
    EXPECT_NE(msg.find(saved.dir.string()), std::string::npos) << msg;
    expect_unchanged(b, before);
    EXPECT_TRUE(at::equal(at::detail::getDefaultCPUGenerator().get_state(), rng_before));
  }
}

// training_state splits the keys; the model layer knows nothing of optimizer or RNG names.
TEST(TrainingState, SplitGivesEachLayerItsOwnKeysAndAModelOnlyLoadSurvivesTheNextStep) {
  TempRoot root;
  TrainingSetup a(at::kBFloat16);
  for (int i = 0; i < 2; ++i) a.step();
  const SaveResult saved = save_training_state(root.path, "s", *a.model, *a.optimizer, {{"k", 1}});
  const ShardedStateDict full = read_checkpoint(saved.dir);
  const TrainingStateParts parts = split_training_state(full);
  for (const auto& [key, t] : parts.model.tensors) {
    EXPECT_FALSE(keys::is_optimizer_key(key) || keys::is_rng_key(key)) << key;
  }
  for (const auto& [key, t] : parts.optimizer.tensors) EXPECT_TRUE(keys::is_optimizer_key(key));
  EXPECT_EQ(parts.rng.count("rng.cpu"), 1u);
  EXPECT_EQ(parts.user, nlohmann::json({{"k", 1}}));
  EXPECT_TRUE(parts.optimizer.common.contains("optimizer"));
  EXPECT_EQ(parts.model.tensors.size() + parts.optimizer.tensors.size() + parts.rng.size(),
            full.tensors.size());

  TrainingSetup b(at::kBFloat16);
  const std::string msg =
      mixprec::testing::error_of([&] { load_model_sharded_state_dict(*b.model, full); });
  EXPECT_NE(msg.find("unexpected key 'optimizer.state."), std::string::npos) << msg;
  // Fine-tuning from a training checkpoint's weights: a model-only load after the optimizer
  // exists is not undone by the next step (lr 0: the weights must stay the loaded ones).
  load_model_sharded_state_dict(*b.model, parts.model);
  b.optimizer->param_groups()[0].options().set_lr(0.0);
  b.step();
  for (const auto& [key, t] : parts.model.tensors) {
    EXPECT_TRUE(at::equal(b.model->named_parameters()[key], t.local)) << key;
  }
}

// --- corruption: a clear error naming file and key; model and optimizer untouched ----------

struct Corruption {
  std::string name;
  std::function<void(const fs::path& dir)> apply;
  std::string expected;  // substring of the error
};

void flip_byte(const fs::path& file, std::streamoff offset_from_end) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(-offset_from_end, std::ios::end);
  char c;
  f.read(&c, 1);
  c ^= 0x5a;
  f.seekp(-offset_from_end, std::ios::end);
  f.write(&c, 1);
}

std::vector<Corruption> corruptions() {
  const std::string data = "data-00000.safetensors";
  return {
      {"flipped data byte", [=](const fs::path& d) { flip_byte(d / data, 3); }, data},
      {"flipped manifest byte",
       [](const fs::path& d) {
         std::string text;
         {
           std::ifstream in(d / "manifest.json");
           text.assign(std::istreambuf_iterator<char>(in), {});
         }
         text[text.find("\"xxh3\": \"", text.find("\"keys\"")) + 9] ^= 0x01;  // a chunk checksum
         std::ofstream(d / "manifest.json", std::ios::trunc) << text;
       },
       "data-00000.safetensors"},
      {"truncated data file",
       [=](const fs::path& d) { fs::resize_file(d / data, fs::file_size(d / data) - 100); }, data},
      {"missing data file", [=](const fs::path& d) { fs::remove(d / data); }, data},
      {"missing common file", [](const fs::path& d) { fs::remove(d / "common.json"); },
       "common.json"},
      {"wrong format version",
       [](const fs::path& d) {
         std::string text;
         {
           std::ifstream in(d / "manifest.json");
           text.assign(std::istreambuf_iterator<char>(in), {});
         }
         const auto at = text.find("\"version\": ");
         ASSERT_NE(at, std::string::npos);
         text.replace(at + 11, 1, "7");  // the single-digit version number
         std::ofstream(d / "manifest.json", std::ios::trunc) << text;
       },
       "version"},
  };
}

TEST(TrainingState, CorruptedCheckpointsFailCleanlyAndChangeNothing) {
  for (const Corruption& corruption : corruptions()) {
    TempRoot root;
    TrainingSetup a(at::kBFloat16);
    for (int i = 0; i < 2; ++i) a.step();
    const SaveResult saved = save_training_state(root.path, "c", *a.model, *a.optimizer);
    corruption.apply(saved.dir);

    TrainingSetup b(at::kBFloat16);
    b.step();
    const ShardedStateDict before = snapshot(b);
    const at::Tensor rng_before = at::detail::getDefaultCPUGenerator().get_state();
    std::string message;
    try {
      load_training_state(root.path, *b.model, *b.optimizer);
    } catch (const std::exception& e) {
      message = e.what();
    }
    EXPECT_FALSE(message.empty()) << corruption.name << ": the load did not fail";
    EXPECT_NE(message.find(corruption.expected), std::string::npos)
        << corruption.name << ": " << message;
    expect_unchanged(b, before);
    EXPECT_TRUE(at::equal(at::detail::getDefaultCPUGenerator().get_state(), rng_before))
        << corruption.name;
  }
}

TEST(TrainingState, ChecksumErrorNamesFileAndKey) {
  TempRoot root;
  TrainingSetup a(at::kBFloat16);
  a.step();
  const SaveResult saved = save_training_state(root.path, "c", *a.model, *a.optimizer);
  flip_byte(saved.dir / "data-00000.safetensors", 3);  // inside the last tensor (sorted keys)
  try {
    read_checkpoint(saved.dir);
    FAIL() << "expected a checksum error";
  } catch (const ChecksumError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("data-00000.safetensors"), std::string::npos) << msg;
    EXPECT_NE(msg.find("up.weight"), std::string::npos) << msg;  // the last key in the file
  }
}

TEST(TrainingState, PlanMismatchOnLoadChangesNothing) {
  TempRoot root;
  TrainingSetup a(at::kBFloat16);
  a.step();
  ShardedStateDict state = training_state_dict(*a.model, *a.optimizer);
  state.tensors["optimizer.state.exp_avg.router"] = ShardedTensor::whole(at::zeros({5, 32}));
  save_checkpoint(root.path, "bad", state);
  TrainingSetup b(at::kBFloat16);
  b.step();
  const ShardedStateDict before = snapshot(b);
  const std::string message =
      mixprec::testing::error_of([&] { load_training_state(root.path, *b.model, *b.optimizer); });
  EXPECT_NE(message.find("'router' exp_avg: shape [5, 32]"), std::string::npos) << message;
  // Which checkpoint: a root's lookup may take another than `latest` names.
  EXPECT_NE(message.find((root.path / "bad").string() + ": "), std::string::npos) << message;
  expect_unchanged(b, before);
}

// What JSON cannot hold, or no reader accepts, is refused before anything is written, naming
// where it is: bytes that are not UTF-8, NaN, nesting beyond the readers' limit.
TEST(TrainingState, UserMetadataJsonCannotHoldIsRefusedByPathBeforeWriting) {
  TempRoot root;
  TrainingSetup a(at::kBFloat16);
  a.step();
  save_training_state(root.path, "good", *a.model, *a.optimizer, {{"epoch", 1}});
  nlohmann::json deep = 1;
  for (int i = 0; i < 300; ++i) deep = nlohmann::json::array({deep});
  for (const auto& [user, where] : std::vector<std::pair<nlohmann::json, std::string>>{
           {{{"data_path", "/data/caf\xe9.bin"}},
            "'/user/data_path': a string that is not valid UTF-8"},
           {{{"loss", std::nan("")}}, "'/user/loss': nan, which JSON cannot hold"},
           {{{"deep", deep}}, "nested deeper than 256 levels"}}) {
    const std::string message = mixprec::testing::error_of(
        [&] { save_training_state(root.path, "bad", *a.model, *a.optimizer, user); });
    EXPECT_NE(message.find(where), std::string::npos) << "saved? " << message;
    EXPECT_FALSE(fs::exists(root.path / "bad")) << where;
    EXPECT_EQ(resolve_checkpoint(root.path), root.path / "good");
  }
  nlohmann::json nested = 1;  // deep, but within what readers accept
  for (int i = 0; i < 200; ++i) nested = nlohmann::json::array({nested});
  save_training_state(root.path, "nested", *a.model, *a.optimizer, {{"deep", nested}});
  TrainingSetup b(at::kBFloat16);
  EXPECT_EQ(load_training_state(root.path, *b.model, *b.optimizer).user.at("deep"), nested);
}

// A parameter trained when saved and frozen in the model it is loaded into: the strict load's
// error says so instead of only listing its state as unexpected.
TEST(TrainingState, StateOfAParameterFrozenSinceIsExplained) {
  TempRoot root;
  TrainingSetup a(at::kBFloat16);
  a.step();
  save_training_state(root.path, "trained", *a.model, *a.optimizer);
  TrainingSetup b(at::kBFloat16);
  const std::string name = b.model->named_parameters().begin()->key();
  b.model->named_parameters()[name].set_requires_grad(false);
  b.optimizer = std::make_unique<optim::Float16Optimizer>(
      *b.model, torch::optim::AdamWOptions(3e-3).weight_decay(0.01));
  const ShardedStateDict before = snapshot(b);
  const std::string message =
      mixprec::testing::error_of([&] { load_training_state(root.path, *b.model, *b.optimizer); });
  EXPECT_NE(message.find("note: '" + name + "' is frozen in this model but was trained when saved"),
            std::string::npos)
      << message;
  expect_unchanged(b, before);
  // Non-strict, the same keys are reported as keys (callers look them up), the why as a note.
  LoadOptions lenient;
  lenient.strict(false);
  const ResumeResult loaded = load_training_state(root.path, *b.model, *b.optimizer, lenient);
  ASSERT_FALSE(loaded.optimizer.unexpected_keys.empty());
  for (const auto& key : loaded.optimizer.unexpected_keys) {
    EXPECT_EQ(key.find(' '), std::string::npos) << key;
  }
}

TEST(TrainingState, KeepLastKRetention) {
  TempRoot root;
  TrainingSetup a(at::kBFloat16);
  SaveOptions options;
  options.keep_last(2);
  for (int i = 0; i < 4; ++i) {
    a.step();
    save_training_state(root.path, "step-" + std::to_string(i), *a.model, *a.optimizer, {},
                        options);
  }
  EXPECT_FALSE(fs::exists(root.path / "step-0"));
  EXPECT_FALSE(fs::exists(root.path / "step-1"));
  EXPECT_TRUE(fs::exists(root.path / "step-2"));
  EXPECT_EQ(resolve_checkpoint(root.path), root.path / "step-3");
  EXPECT_THROW(save_training_state(root.path, "step-3", *a.model, *a.optimizer), std::exception)
      << "a committed checkpoint is never overwritten";
}

TEST(AsyncSave, SameBytesAsSyncAndIndependentOfLaterSteps) {
  TempRoot root;
  TrainingSetup a(at::kBFloat16);
  a.step();
  save_training_state(root.path, "sync", *a.model, *a.optimizer);
  AsyncCheckpointSaver saver(AsyncSaveOptions().staging_budget_bytes(64u << 20));
  (void)saver.save(root.path, "async", training_state_dict(*a.model, *a.optimizer));
  saver.wait_until_staged();
  for (int i = 0; i < 3; ++i) a.step();  // training goes on while the writer works
  const auto result = saver.wait();
  ASSERT_TRUE(result.has_value());
  EXPECT_LE(saver.staging_bytes(), 64u << 20);
  expect_same_checkpoint(root.path / "sync", root.path / "async");
  EXPECT_EQ(resolve_checkpoint(root.path), root.path / "async");
}

TEST(AsyncSave, ErrorsSurfaceOnWaitAndNextSave) {
  TempRoot root;
  TrainingSetup a(at::kBFloat16);
  // A root that is a file: only the writer, in the background, finds out.
  const fs::path not_a_root = root.path / "file";
  testing::write_file(not_a_root, "x");
  AsyncCheckpointSaver saver;
  (void)saver.save(not_a_root, "s", training_state_dict(*a.model, *a.optimizer));
  EXPECT_THROW(saver.wait(), std::exception);
  (void)saver.save(not_a_root, "s", training_state_dict(*a.model, *a.optimizer));
  EXPECT_THROW(saver.save(root.path, "other", training_state_dict(*a.model, *a.optimizer)),
               std::exception);
  EXPECT_FALSE(saver.in_flight());
  (void)saver.save(root.path, "other", training_state_dict(*a.model, *a.optimizer));
  EXPECT_TRUE(saver.wait().has_value());
}

// Staging memory reserved at training start, before any step, from staging_bytes_when_stepped
// holds the save at step 3 (it is exactly what that save stages), while the state's own
// staging_bytes_for at start — no moments yet — sets a budget that save exceeds.
TEST(TrainingState, StagingBytesWhenSteppedAtStartHoldTheSaveAfterSteps) {
  TempRoot root;
  TrainingSetup a(at::kBFloat16);
  const std::size_t when_stepped = staging_bytes_when_stepped(*a.model, *a.optimizer);
  const std::size_t at_start = staging_bytes_for(training_state_dict(*a.model, *a.optimizer));
  EXPECT_EQ(when_stepped,
            staging_bytes_when_stepped(training_state_dict(*a.model, *a.optimizer), *a.optimizer));
  AsyncCheckpointSaver saver(AsyncSaveOptions().staging_budget_bytes(when_stepped));
  saver.reserve(when_stepped);
  AsyncCheckpointSaver undercounted(AsyncSaveOptions().staging_budget_bytes(at_start));
  undercounted.reserve(at_start);

  for (int i = 0; i < 3; ++i) a.step();
  const ShardedStateDict stepped = training_state_dict(*a.model, *a.optimizer);
  EXPECT_LT(at_start, staging_bytes_for(stepped)) << "the moments came at the first step";
  EXPECT_EQ(when_stepped, staging_bytes_for(stepped));
  EXPECT_EQ(staging_bytes_when_stepped(*a.model, *a.optimizer), when_stepped)
      << "nothing more to come once every parameter has been stepped";
  EXPECT_TRUE(a.optimizer->state_tensor_bytes_to_come().empty());

  (void)saver.save(root.path, "step-3", stepped);
  ASSERT_TRUE(saver.wait().has_value());
  EXPECT_EQ(saver.staging_bytes(), when_stepped) << "the arena reserved at start was enough";
  const std::string message = mixprec::testing::error_of([&] {
    (void)undercounted.save(root.path, "undercounted", training_state_dict(*a.model, *a.optimizer));
  });
  EXPECT_NE(message.find("the budget is " + std::to_string(at_start)), std::string::npos)
      << message;
}

TEST(AsyncSave, BudgetBelowTheStateIsRefusedAtReserve) {
  TrainingSetup a(at::kBFloat16);
  a.step();
  AsyncCheckpointSaver saver(AsyncSaveOptions().staging_budget_bytes(1024));
  EXPECT_THROW(saver.reserve(staging_bytes_for(training_state_dict(*a.model, *a.optimizer))),
               c10::Error);
}

// A model tensor under a name the checkpoint keeps for the optimizer's or the RNG's state is
// refused, naming it: saved, it would be read back as theirs.
struct ReservedNameNet : torch::nn::Module {
  explicit ReservedNameNet(const std::string& owner, const std::string& name) {
    auto inner = register_module(owner, std::make_shared<torch::nn::Module>());
    inner->register_parameter(name, torch::zeros({2}));
  }
};

TEST(TrainingState, AModelTensorUnderAReservedNameIsRefused) {
  for (const auto& [owner, name] :
       std::vector<std::pair<std::string, std::string>>{{"optimizer", "w"}, {"rng", "cpu"}}) {
    ReservedNameNet model(owner, name);
    optim::Float16Optimizer optimizer(model, torch::optim::AdamWOptions(1e-3));
    const std::string key = owner + "." + name;
    EXPECT_NE(mixprec::testing::error_of([&] {
                training_state_dict(model, optimizer);
              }).find("the model has a tensor named '" + key + "', a name the checkpoint reserves"),
              std::string::npos)
        << key;
  }
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::checkpoint
