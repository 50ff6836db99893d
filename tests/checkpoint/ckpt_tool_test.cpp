// The mixprec-ckpt command-line tool, run as a separate process on checkpoints written by the
// library: inspect's roles and totals, verify's exit status on good and corrupt data, diff on
// identical, stepped and structurally different checkpoints, and the one-line error contract
// (stderr "mixprec-ckpt: …", exit 2) for bad arguments and unreadable paths.
#include "mixprec/checkpoint/training_state.h"

#include "checkpoint/format/format_test_util.h"
#include "optim/support_optim.h"
#include "support/test_env.h"

#include <gtest/gtest.h>

#include <torch/optim/adamw.h>

#include <sys/wait.h>
#include <cstdio>
#include <regex>

namespace mixprec::checkpoint {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

namespace fs = std::filesystem;
using testing::TempDir;

// The tool binary: <build>/tools/mixprec-ckpt (ctest names <build> in MIXPREC_BINARY_DIR).
fs::path tool_path() { return fs::path(mixprec::test::binary_dir()) / "tools" / "mixprec-ckpt"; }

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

struct ToolRun {
  int status = -1;  // exit status; -1 if the tool died from a signal (a crash is a failure)
  std::string out, err;
  std::vector<std::string> out_lines() const {
    std::vector<std::string> lines;
    std::stringstream s(out);
    for (std::string line; std::getline(s, line);) lines.push_back(line);
    return lines;
  }
  bool has_line(const std::string& pattern) const {
    const std::regex re(pattern);
    for (const auto& line : out_lines()) {
      if (std::regex_search(line, re)) return true;
    }
    return false;
  }
};

// Runs the tool with `args` (in `cwd` if given), capturing stdout and stderr in files next to
// `scratch`.
ToolRun run_tool(const fs::path& scratch, const std::vector<std::string>& args,
                 const fs::path& cwd = {}) {
  std::string command = cwd.empty() ? "" : "cd " + shell_quote(cwd.string()) + " && ";
  command += shell_quote(tool_path().string());
  for (const auto& a : args) command.append(" ").append(shell_quote(a));
  const fs::path out = scratch / "tool.out", err = scratch / "tool.err";
  command.append(" >").append(shell_quote(out.string()));
  command.append(" 2>").append(shell_quote(err.string())).append(" </dev/null");
  const int raw = std::system(command.c_str());
  ToolRun run;
  run.status = (raw != -1 && WIFEXITED(raw)) ? WEXITSTATUS(raw) : -1;
  run.out = testing::read_file(out);
  run.err = testing::read_file(err);
  return run;
}

// The error contract: exactly one line on stderr, starting "mixprec-ckpt: ", nothing on stdout.
void expect_one_line_error(const ToolRun& run, int status, const std::string& fragment) {
  EXPECT_EQ(run.status, status) << run.err;
  EXPECT_EQ(run.err.rfind("mixprec-ckpt: ", 0), 0u) << run.err;
  EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << run.err;
  EXPECT_NE(run.err.find(fragment), std::string::npos)
      << "stderr lacks '" << fragment << "': " << run.err;
  EXPECT_TRUE(run.out.empty()) << run.out;
}

void flip_last_byte(const fs::path& file) {
  std::string bytes = testing::read_file(file);
  ASSERT_FALSE(bytes.empty());
  bytes.back() = static_cast<char>(bytes.back() ^ 0x01);
  testing::write_file(file, bytes);
}

// The Interleaved model (pre.weight, post.weight: BF16 with masters; gate: FP32 kept; frozen),
// AdamW, two steps taken.
class CkptTool : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(fs::exists(tool_path())) << tool_path() << " is missing: build target mixprec-ckpt";
    at::manual_seed(11);
    model_ = mixprec::testing::Interleaved();
    optimizer_ = mixprec::testing::make_optimizer(
        model_, torch::optim::AdamWOptions(1e-2).betas({0.9, 0.95}).weight_decay(0.1));
    step();
    step();
  }
  void step() {
    mixprec::testing::set_grads(*model_, ++steps_);
    ASSERT_TRUE(optimizer_->update().success);
  }
  fs::path save(const std::string& name) {
    return save_training_state(dir_.path() / "root", name, *model_, *optimizer_, {{"epoch", 1}})
        .dir;
  }
  // A hand-made state, saved as the checkpoint <name>/<name> of the scratch directory.
  fs::path save_state(const std::string& name, const ShardedStateDict& state) {
    return save_checkpoint(dir_.path() / name, name, state).dir;
  }
  ToolRun tool(const std::vector<std::string>& args, const fs::path& cwd = {}) {
    return run_tool(dir_.path(), args, cwd);
  }

  TempDir dir_;
  mixprec::testing::Interleaved model_{nullptr};
  std::unique_ptr<optim::Float16Optimizer> optimizer_;
  int64_t steps_ = 0;
};

TEST_F(CkptTool, InspectListsRolesDtypesAndTotals) {
  save("step-2");
  const ToolRun run = tool({"inspect", (dir_.path() / "root").string()});  // via `latest`
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_TRUE(run.err.empty()) << run.err;
  EXPECT_TRUE(run.has_line("^format +mixprec-checkpoint, version 2$")) << run.out;
  EXPECT_TRUE(run.has_line("^sequence +1$")) << run.out;
  EXPECT_TRUE(run.has_line("^optimizer +adamw, step 2$")) << run.out;
  EXPECT_TRUE(run.has_line("^scaler +dynamic=false .*scale=1(\\.0)?( |$)")) << run.out;
  EXPECT_TRUE(run.has_line("^user +\\{\"epoch\":1\\}$")) << run.out;
  EXPECT_TRUE(run.has_line("^group 0 +.*lr=0\\.01 .*weight_decay=0\\.1$")) << run.out;
  EXPECT_TRUE(
      run.has_line("^files +common\\.json \\([0-9.]+ (B|KiB)\\), data-00000\\.safetensors \\("))
      << run.out;
  // Key table: dtype, shape, bytes, chunks.
  EXPECT_TRUE(run.has_line("^tensors: 13 keys, [1-9][0-9]* bytes \\(")) << run.out;
  EXPECT_TRUE(
      run.has_line("^  optimizer\\.state\\.fp32_param\\.pre\\.weight +F32 +\\[8, 8\\] +256 +1$"))
      << run.out;
  EXPECT_TRUE(run.has_line("^  rng\\.cpu +U8 ")) << run.out;
  // Parameter table: role, then model dtype.
  EXPECT_TRUE(run.has_line(
      "^  pre\\.weight +fp32 master +BF16 +\\[8, 8\\] +0 +2 +fp32_param exp_avg exp_avg_sq$"))
      << run.out;
  EXPECT_TRUE(run.has_line("^  post\\.weight +fp32 master +BF16 ")) << run.out;
  EXPECT_TRUE(run.has_line("^  gate +native fp32 +F32 +\\[24\\] +0 +2 +exp_avg exp_avg_sq$"))
      << run.out;
  EXPECT_TRUE(run.has_line("^  frozen\\.weight +frozen +BF16 +\\[8, 8\\] +0 +- +-$")) << run.out;
  // Totals: params, elements, model bytes, optimizer bytes (masters and moments: 3 × 4 B).
  EXPECT_TRUE(run.has_line("^  fp32 master +2 +128 +256 +1536$")) << run.out;
  EXPECT_TRUE(run.has_line("^  native fp32 +1 +24 +96 +192$")) << run.out;
  EXPECT_TRUE(run.has_line("^  frozen +1 +64 +128 +0$")) << run.out;
  EXPECT_TRUE(run.has_line("^  total +4 +216 +480 +1728$")) << run.out;
  // Why gate is FP32: the model's conversion kept it for its keep_in_fp32 mark.
  EXPECT_TRUE(run.has_line("^kept fp32 by the precision plan: 1 tensor$")) << run.out;
  EXPECT_TRUE(run.has_line("^  gate +F32 +mark$")) << run.out;
  EXPECT_FALSE(run.has_line("^warning:")) << run.out;
}

// Every plan rule reaches the checkpoint and inspect names it.
TEST_F(CkptTool, InspectShowsWhichPlanRuleKeptEachTensor) {
  convert_module_to_dtype_except_fp32_marked(
      *model_, at::kBFloat16,
      PrecisionPlan().keep_fp32_name("post.weight").keep_fp32_pattern("pre.*"));
  optimizer_ = mixprec::testing::make_optimizer(model_, torch::optim::AdamWOptions(1e-2));
  const ToolRun run = tool({"inspect", save("plan").string()});
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_TRUE(run.has_line("^kept fp32 by the precision plan: 3 tensors$")) << run.out;
  EXPECT_TRUE(run.has_line("^  gate +F32 +mark$")) << run.out;
  EXPECT_TRUE(run.has_line("^  post\\.weight +F32 +name post\\.weight$")) << run.out;
  EXPECT_TRUE(run.has_line("^  pre\\.weight +F32 +pattern pre\\.\\*$")) << run.out;
  EXPECT_FALSE(run.has_line("^warning:")) << run.out;
}

// A hand-written optimizer state: a parameter's own step, a parameter without state, a second
// group; and what does not add up is warned about: a parameter without a model tensor, state of
// a parameter in no group, a tensor kept FP32 that the checkpoint lacks.
TEST_F(CkptTool, InspectShowsHandWrittenOptimizerStateAndWarnsWhatDoesNotAddUp) {
  const auto fqns = [](std::initializer_list<const char*> names) {
    return nlohmann::json::array_t(names.begin(), names.end());
  };
  ShardedStateDict state;
  state.tensors["a"] = ShardedTensor::whole(at::zeros({2}));
  state.tensors["b"] = ShardedTensor::whole(at::zeros({2}, at::kBFloat16));
  state.tensors["optimizer.state.exp_avg.a"] = ShardedTensor::whole(at::zeros({2}));
  state.tensors["optimizer.state.exp_avg.gone"] = ShardedTensor::whole(at::zeros({2}));
  nlohmann::json groups = nlohmann::json::array();
  groups.push_back({{"lr", 0.1}, {"params", fqns({"a"})}});
  groups.push_back({{"lr", 0.2}, {"params", fqns({"b", "c"})}});
  state.common["optimizer"] = {{"algorithm", "adamw"},
                               {"step", 5},
                               {"steps", {{"a", 3}}},
                               {"without_state", fqns({"b"})},
                               {"param_groups", groups}};
  state.common["precision"] = {{"a", "mark"}, {"missing", "name missing"}};
  const ToolRun run = tool({"inspect", save_state("hand", state).string()});
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_TRUE(run.has_line("^group 1 +lr=0\\.2$")) << run.out;
  EXPECT_TRUE(run.has_line("^  a +native fp32 +F32 +\\[2\\] +0 +3 +exp_avg$")) << run.out;
  EXPECT_TRUE(run.has_line("^  b +native fp32 +BF16 +\\[2\\] +1 +- +-$")) << run.out;
  EXPECT_TRUE(run.has_line("^  c +native fp32 +- +- +1 +5 +-$")) << run.out;
  EXPECT_TRUE(run.has_line("^warning: c: no model tensor under this key$")) << run.out;
  EXPECT_TRUE(
      run.has_line("^warning: optimizer\\.state\\.exp_avg\\.gone: optimizer state for a "
                   "parameter in no param group$"))
      << run.out;
  EXPECT_TRUE(run.has_line("^  missing +- +name missing$")) << run.out;
  EXPECT_TRUE(run.has_line("^warning: missing: kept fp32 but not in the checkpoint$")) << run.out;
}

// A malformed optimizer or precision field is a one-line error naming the file and the field.
TEST_F(CkptTool, InspectNamesTheMalformedFieldOfTheCommonState) {
  const auto with_groups = [](int64_t step, nlohmann::json params) {
    nlohmann::json groups = nlohmann::json::array();
    groups.push_back({{"params", std::move(params)}});
    return nlohmann::json{{"optimizer", {{"step", step}, {"param_groups", groups}}}};
  };
  const std::pair<nlohmann::json, std::string> cases[] = {
      {with_groups(-1, nlohmann::json::array()),
       "optimizer.step: missing or not a non-negative integer"},
      {with_groups(1, nlohmann::json::array({"w", "w"})),
       "optimizer.param_groups[0].params: 'w' listed twice"},
      {with_groups(1, nlohmann::json::array({3})),
       "optimizer.param_groups[0].params[0]: expected a string"},
      {nlohmann::json{{"precision", {{"w", 3}}}}, "precision.w: expected a string"}};
  for (size_t i = 0; i < std::size(cases); ++i) {
    SCOPED_TRACE(cases[i].second);
    ShardedStateDict state;
    state.tensors["w"] = ShardedTensor::whole(at::zeros({2}));
    state.common = cases[i].first;
    const fs::path ckpt = save_state("bad-" + std::to_string(i), state);
    expect_one_line_error(tool({"inspect", ckpt.string()}), 2,
                          (ckpt / "common.json").string() + ": " + cases[i].second);
  }
}

TEST_F(CkptTool, VerifyPassesAndCatchesAFlippedByte) {
  const fs::path ckpt = save("step-2");
  const ToolRun good = tool({"verify", ckpt.string()});
  EXPECT_EQ(good.status, 0) << good.err;
  EXPECT_EQ(good.out.rfind("OK " + ckpt.string() + ": ", 0), 0u) << good.out;
  // 13 keys of one chunk each, in data-00000.safetensors and common.json.
  EXPECT_TRUE(good.has_line(": 13 keys, 13 chunks, 2 files, [1-9][0-9]* bytes \\(.*\\) verified$"))
      << good.out;

  flip_last_byte(ckpt / "data-00000.safetensors");
  expect_one_line_error(tool({"verify", ckpt.string()}), 1, "data-00000.safetensors");
  // Metadata is intact, so inspect still works; diff reads the data and refuses.
  EXPECT_EQ(tool({"inspect", ckpt.string()}).status, 0);
  expect_one_line_error(tool({"diff", ckpt.string(), ckpt.string()}), 2, "checksum mismatch");
}

TEST_F(CkptTool, DiffOfIdenticalStatesIsZero) {
  const fs::path a = save("a");
  const fs::path b = save("b");  // same state, later sequence: still identical
  const ToolRun run = tool({"diff", a.string(), b.string()});
  EXPECT_EQ(run.status, 0) << run.out << run.err;
  EXPECT_TRUE(run.has_line("^result: identical$")) << run.out;
  EXPECT_TRUE(run.has_line("^  pre\\.weight +BF16 +\\[8, 8\\] +0 +0/64$")) << run.out;
  EXPECT_TRUE(run.has_line("^common state: 0 differences$")) << run.out;
  EXPECT_EQ(tool({"diff", (dir_.path() / "root").string(), b.string()}).status, 0);  // root = b
}

TEST_F(CkptTool, DiffAfterOneMoreStepShowsTheChange) {
  const fs::path a = save("a");
  const at::Tensor gate_before = model_->gate.detach().clone();
  step();
  const fs::path b = save("b");
  const ToolRun run = tool({"diff", a.string(), b.string()});
  EXPECT_EQ(run.status, 1) << run.out << run.err;
  EXPECT_TRUE(run.has_line("^result: different$")) << run.out;
  // The exact largest change of the native FP32 parameter, as the tool formats it.
  char expected[32];
  std::snprintf(expected, sizeof expected, "%.6g",
                (model_->gate.detach().to(at::kDouble) - gate_before.to(at::kDouble))
                    .abs()
                    .max()
                    .item<double>());
  EXPECT_TRUE(run.has_line("^  gate +F32 +\\[24\\] +" +
                           std::regex_replace(expected, std::regex("\\."), "\\.") + " +24/24$"))
      << expected << "\n"
      << run.out;
  EXPECT_TRUE(
      run.has_line("^  optimizer\\.state\\.fp32_param\\.post\\.weight +F32 +\\[8, 8\\] +[0-9.e-]+ "
                   "+[1-9][0-9]*/64$"))
      << run.out;
  EXPECT_TRUE(run.has_line("^  frozen\\.weight +BF16 +\\[8, 8\\] +0 +0/64$")) << run.out;
  EXPECT_TRUE(run.has_line("^  /optimizer/step: 2 -> 3$")) << run.out;
}

TEST_F(CkptTool, DiffReportsMissingKeysAndMismatches) {
  const float nan = std::nanf("");
  ShardedStateDict a, b;
  a.tensors["same_nan"] = ShardedTensor::whole(at::tensor({1.0f, nan, 3.0f}));
  b.tensors["same_nan"] = ShardedTensor::whole(at::tensor({1.0f, nan, 3.0f}));
  a.tensors["changed"] = ShardedTensor::whole(at::tensor({1.0f, 2.0f, 3.0f, 4.0f}));
  b.tensors["changed"] = ShardedTensor::whole(at::tensor({1.0f, 2.5f, 3.0f, 3.0f}));
  a.tensors["dtype"] = ShardedTensor::whole(at::zeros({2, 2}));
  b.tensors["dtype"] = ShardedTensor::whole(at::zeros({2, 2}, at::kBFloat16));
  a.tensors["shape"] = ShardedTensor::whole(at::zeros({4}, at::kLong));
  b.tensors["shape"] = ShardedTensor::whole(at::zeros({2, 2}, at::kLong));
  // 2^60 and 2^60 + 1 are one double apart only in int64 arithmetic.
  a.tensors["big"] = ShardedTensor::whole(at::full({2}, int64_t{1} << 60, at::kLong));
  b.tensors["big"] = ShardedTensor::whole(at::full({2}, (int64_t{1} << 60) + 1, at::kLong));
  a.tensors["gone"] = ShardedTensor::whole(at::ones({3}, at::kInt));
  b.tensors["new"] = ShardedTensor::whole(at::ones({1}, at::kBool));
  a.common = {{"step", 1}, {"list", {1}}};
  b.common = {{"step", 1}, {"note", "x"}, {"list", {1, 2}}};
  const fs::path pa = save_state("a", a);
  const fs::path pb = save_state("b", b);
  const ToolRun run = tool({"diff", pa.string(), pb.string()});
  EXPECT_EQ(run.status, 1) << run.err;
  EXPECT_TRUE(
      run.has_line("^tensors in both: 3 compared, 2 differ, 2 dtype/shape mismatches; 1 "
                   "only in A, 1 only in B$"))
      << run.out;
  EXPECT_TRUE(run.has_line("^  same_nan +F32 +\\[3\\] +0 +0/3$")) << run.out;
  EXPECT_TRUE(run.has_line("^  changed +F32 +\\[4\\] +1 +2/4$")) << run.out;
  EXPECT_TRUE(run.has_line("^  big +I64 +\\[2\\] +1 +2/2$")) << run.out;
  EXPECT_TRUE(run.has_line("^mismatch: dtype: A F32 \\[2, 2\\], B BF16 \\[2, 2\\]$")) << run.out;
  EXPECT_TRUE(run.has_line("^mismatch: shape: A I64 \\[4\\], B I64 \\[2, 2\\]$")) << run.out;
  EXPECT_TRUE(run.has_line("^only in A: gone \\(I32 \\[3\\]\\)$")) << run.out;
  EXPECT_TRUE(run.has_line("^only in B: new \\(BOOL \\[1\\]\\)$")) << run.out;
  EXPECT_TRUE(run.has_line("^  /note: \\(absent\\) -> \"x\"$")) << run.out;
  // Added at an array's end: the pointer names no element, the value is still shown.
  EXPECT_TRUE(run.has_line("^  /list/-: \\(absent\\) -> 2$")) << run.out;
  // No optimizer in the common state: inspect still describes the tensors.
  const ToolRun inspect = tool({"inspect", pa.string()});
  EXPECT_EQ(inspect.status, 0) << inspect.err;
  EXPECT_TRUE(inspect.has_line("^optimizer +none")) << inspect.out;
}

// Any one difference alone makes two checkpoints different (status 1), and is shown: one element
// (+0 against -0 too: the bits differ, max |A-B| 0; a NaN against a number: max nan), a dtype, a
// shape, a key only in A or only in B, a field of the common state.
TEST_F(CkptTool, DiffCallsAnyOneDifferenceDifferent) {
  const at::Tensor w = at::tensor({0.0f, 1.0f, 2.0f});
  const auto state = [](const at::Tensor& w, int64_t step = 1) {
    ShardedStateDict s;
    s.tensors["w"] = ShardedTensor::whole(w);
    s.tensors["n"] = ShardedTensor::whole(at::arange(3, at::kInt));
    s.common = {{"step", step}};
    return s;
  };
  const fs::path base = save_state("base", state(w));
  EXPECT_EQ(tool({"diff", base.string(), base.string()}).status, 0);
  ShardedStateDict without_n = state(w), with_x = state(w);
  without_n.tensors.erase("n");
  with_x.tensors["x"] = ShardedTensor::whole(at::ones({1}));
  const std::pair<ShardedStateDict, std::string> cases[] = {
      {state(at::tensor({0.0f, 1.0f, 3.0f})), "^  w +F32 +\\[3\\] +1 +1/3$"},
      {state(at::tensor({-0.0f, 1.0f, 2.0f})), "^  w +F32 +\\[3\\] +0 +1/3$"},
      {state(at::tensor({std::nanf(""), 1.0f, 2.0f})), "^  w +F32 +\\[3\\] +nan +1/3$"},
      {state(w.to(at::kBFloat16)), "^mismatch: w: A F32 \\[3\\], B BF16 \\[3\\]$"},
      {state(w.reshape({3, 1})), "^mismatch: w: A F32 \\[3\\], B F32 \\[3, 1\\]$"},
      {without_n, "^only in A: n \\(I32 \\[3\\]\\)$"},
      {with_x, "^only in B: x \\(F32 \\[1\\]\\)$"},
      {state(w, 2), "^  /step: 1 -> 2$"}};
  for (size_t i = 0; i < std::size(cases); ++i) {
    SCOPED_TRACE(cases[i].second);
    const fs::path other = save_state("case-" + std::to_string(i), cases[i].first);
    const ToolRun run = tool({"diff", base.string(), other.string()});
    EXPECT_EQ(run.status, 1) << run.out << run.err;
    EXPECT_TRUE(run.has_line("^result: different$")) << run.out;
    EXPECT_TRUE(run.has_line(cases[i].second)) << run.out;
  }
}

// A report that cannot be written is a failure, not a silent success; a checkpoint of a newer
// format version is not called corrupt (it may be intact: this tool cannot tell).
TEST_F(CkptTool, UnwritableReportsAndNewerVersionsAreStatusTwo) {
  const fs::path ckpt = save("step-2");
  if (fs::exists("/dev/full")) {
    const fs::path err = dir_.path() / "full.err";
    const std::string command = shell_quote(tool_path().string()) + " inspect " +
                                shell_quote(ckpt.string()) + " >/dev/full 2>" +
                                shell_quote(err.string());
    const int raw = std::system(command.c_str());
    ASSERT_TRUE(raw != -1 && WIFEXITED(raw)) << raw;
    EXPECT_EQ(WEXITSTATUS(raw), 2);
    EXPECT_NE(testing::read_file(err).find("mixprec-ckpt: write error on standard output: No "
                                           "space left on device"),
              std::string::npos)
        << testing::read_file(err);
  }
  std::string manifest = testing::read_file(ckpt / "manifest.json");
  const auto field = manifest.find("\"version\"");
  ASSERT_NE(field, std::string::npos) << manifest.substr(0, 200);
  const auto digit = manifest.find('2', field);
  ASSERT_NE(digit, std::string::npos);
  manifest[digit] = '3';
  testing::write_file(ckpt / "manifest.json", manifest);
  expect_one_line_error(tool({"verify", ckpt.string()}), 2,
                        "manifest version 3 is newer than this reader supports");
}

// However the user spells a checkpoint — a trailing slash, a link to it, a directory called
// "help", a root whose `latest` lags or is missing — the tool takes the checkpoint a load would.
TEST_F(CkptTool, PathsNameTheCheckpointALoadWould) {
  const fs::path ckpt = save("step-2");
  const ToolRun plain = tool({"inspect", ckpt.string()});
  ASSERT_EQ(plain.status, 0) << plain.err;
  const ToolRun slash = tool({"inspect", ckpt.string() + "/"});
  EXPECT_EQ(slash.status, 0) << slash.err;
  EXPECT_EQ(slash.out, plain.out);

  fs::create_symlink(ckpt, dir_.path() / "link");
  EXPECT_EQ(tool({"verify", (dir_.path() / "link").string()}).status, 0);

  fs::create_directory(dir_.path() / "cwd");
  fs::copy(ckpt, dir_.path() / "cwd" / "help");
  const ToolRun help = tool({"verify", "help"}, dir_.path() / "cwd");
  EXPECT_EQ(help.status, 0) << help.err;
  EXPECT_EQ(help.out.find("usage:"), std::string::npos) << help.out;

  step();
  const fs::path newer = save("step-3");
  const fs::path root = newer.parent_path();
  testing::write_file(root / "latest", "step-2\n");  // as if the save died before the update
  const ToolRun stale = tool({"inspect", root.string()});
  EXPECT_EQ(stale.status, 0) << stale.err;
  EXPECT_NE(stale.out.find("step-3"), std::string::npos) << stale.out;
  EXPECT_NE(stale.err.find("note: 'latest' names 'step-2', but 'step-3' is newer"),
            std::string::npos)
      << stale.err;
  fs::remove(root / "latest");
  const ToolRun missing = tool({"verify", root.string()});
  EXPECT_EQ(missing.status, 0) << missing.err;
  EXPECT_NE(missing.err.find("there is no 'latest'"), std::string::npos) << missing.err;
}

// A root without `latest` whose only checkpoint is damaged holds a checkpoint: verify says it is
// damaged (status 1, as for the checkpoint itself), naming it and why; inspect and export say
// the same with the usage status. Not "no committed checkpoints", status 2.
TEST_F(CkptTool, ARootWhoseCheckpointsAllFailVerificationIsReportedAsDamage) {
  const fs::path ckpt = save("step-2");
  const fs::path root = ckpt.parent_path();
  fs::remove(root / "latest");  // as if the save died between its commit and `latest`
  flip_last_byte(ckpt / "data-00000.safetensors");
  const std::string why =
      root.string() + ": no 'latest', and none of its committed checkpoints verifies: step-2: ";
  const ToolRun verify = tool({"verify", root.string()});
  expect_one_line_error(verify, 1, why);
  EXPECT_NE(verify.err.find("checksum mismatch"), std::string::npos) << verify.err;
  expect_one_line_error(tool({"inspect", root.string()}), 2, why);
  expect_one_line_error(tool({"export", root.string(), (dir_.path() / "out").string()}), 2, why);
  EXPECT_FALSE(fs::exists(dir_.path() / "out"));
}

// A failure is one line even when the root's resolution has a note to give (it is given only
// on success), and export checks OUT before resolving CKPT (which may verify checkpoints).
TEST_F(CkptTool, ANoteNeverPrecedesAFailure) {
  save("step-2");
  step();
  const fs::path root = save("step-3").parent_path();
  testing::write_file(root / "latest", "step-2\n");  // as if the save died before the update
  const std::string note = "mixprec-ckpt: note: 'latest' names 'step-2', but 'step-3' is newer";
  const ToolRun good = tool({"verify", root.string()});
  EXPECT_EQ(good.status, 0) << good.err;
  EXPECT_EQ(good.err.rfind(note, 0), 0u) << good.err;
  EXPECT_EQ(good.out.rfind("OK " + (root / "step-3").string(), 0), 0u) << good.out;

  const std::string missing = (dir_.path() / "no-such-dir").string();
  expect_one_line_error(tool({"diff", root.string(), missing}), 2, missing);
  const fs::path out = dir_.path() / "out";
  fs::create_directories(out);
  expect_one_line_error(tool({"export", root.string(), out.string()}), 2,
                        out.string() + ": already exists");
  const ToolRun exported = tool({"export", root.string(), (dir_.path() / "new").string()});
  EXPECT_EQ(exported.status, 0) << exported.err;
  EXPECT_EQ(exported.err.rfind(note, 0), 0u) << exported.err;

  // OUT first: with a root whose checkpoints are all damaged, a bad OUT is what is reported.
  fs::remove(root / "latest");
  for (const std::string name : {"step-2", "step-3"}) {
    flip_last_byte(root / name / "data-00000.safetensors");
  }
  expect_one_line_error(tool({"export", root.string(), out.string()}), 2,
                        out.string() + ": already exists");
  expect_one_line_error(tool({"export", root.string(), (dir_.path() / "nowhere" / "x").string()}),
                        2, "nowhere: no such directory");
}

// inspect names the root a checkpoint was taken from, and says "newest" only when it is: a
// newer checkpoint passed over because it does not verify is named.
TEST_F(CkptTool, InspectSaysWhichCheckpointOfTheRootItShows) {
  save("step-2");
  const fs::path root = dir_.path() / "root";
  EXPECT_TRUE(
      tool({"inspect", root.string()})
          .has_line("^checkpoint +" +
                    std::regex_replace((root / "step-2").string(), std::regex("[.]"), "[.]") +
                    " +\\(newest of the root .*root\\)$"));
  step();
  const fs::path newer = save("step-3");
  testing::write_file(root / "latest", "step-2\n");
  flip_last_byte(newer / "data-00000.safetensors");
  const ToolRun run = tool({"inspect", root.string()});
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_TRUE(
      run.has_line("^checkpoint +.*step-2 +\\(newest of the root .*root except step-3, "
                   "which does not verify\\)$"))
      << run.out;
  EXPECT_FALSE(run.has_line("\\(newest of the root [^ ]*\\)$")) << run.out;
  // Named directly, a checkpoint is just itself.
  EXPECT_FALSE(tool({"inspect", (root / "step-2").string()}).has_line("of the root")) << run.out;
}

TEST_F(CkptTool, BadArgumentsAndPathsAreOneLineErrors) {
  const fs::path ckpt = save("step-2");
  expect_one_line_error(tool({}), 2, "no command");
  expect_one_line_error(tool({"frobnicate", ckpt.string()}), 2, "unknown command 'frobnicate'");
  expect_one_line_error(tool({"inspect"}), 2, "expected 1 argument, got 0");
  expect_one_line_error(tool({"diff", ckpt.string()}), 2, "expected 2 arguments, got 1");
  expect_one_line_error(tool({"inspect", ckpt.string(), ckpt.string()}), 2,
                        "expected 1 argument, got 2");
  expect_one_line_error(tool({"verify", "--fast", ckpt.string()}), 2, "unknown option '--fast'");
  const std::string missing = (dir_.path() / "no-such-dir").string();
  expect_one_line_error(tool({"inspect", missing}), 2, missing + ": no such file or directory");
  // A name is shown as it is, runs of spaces too: "dir  x" is not "dir x".
  expect_one_line_error(tool({"inspect", missing + "  x"}), 2,
                        missing + "  x: no such file or directory");
  expect_one_line_error(tool({"verify", missing}), 2, missing);
  expect_one_line_error(tool({"diff", ckpt.string(), missing}), 2, missing);
  expect_one_line_error(tool({"inspect", dir_.path().string()}), 2, "neither a checkpoint");
  expect_one_line_error(tool({"inspect", (ckpt / "common.json").string()}), 2, "not a directory");
  // Control characters are shown escaped, not dropped: "no\rsuch" must not read "nosuch".
  expect_one_line_error(tool({"inspect", missing + "\r\x01\x7f"}), 2,
                        missing + "\\r\\x01\\x7f: no such");
  // A newline in a name does not break the one line either.
  expect_one_line_error(tool({"inspect", missing + "\nx"}), 2, missing);
  testing::write_file(ckpt.parent_path() / "latest", "step-2\r\n");
  expect_one_line_error(tool({"inspect", ckpt.parent_path().string()}), 2,
                        "'step-2\\r' is not a valid checkpoint name");
  testing::write_file(ckpt.parent_path() / "latest", "step-2\n");

  testing::write_file(ckpt / "manifest.json", "{\"format\": \"mixprec-checkpoint\", \"vers");
  expect_one_line_error(tool({"inspect", ckpt.string()}), 2, (ckpt / "manifest.json").string());
  expect_one_line_error(tool({"verify", ckpt.string()}), 1, (ckpt / "manifest.json").string());

  const ToolRun help = tool({"--help"});
  EXPECT_EQ(help.status, 0);
  EXPECT_EQ(help.out.rfind("usage: mixprec-ckpt", 0), 0u) << help.out;
  EXPECT_EQ(tool({"diff", "--help"}).status, 0);
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::checkpoint
