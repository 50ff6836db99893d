// A checkpoint written by the C++ library, read by Python (tests/checkpoint/python_client.py
// over the reader python/mixprec_reader.py: the `safetensors` package and torch.optim.AdamW
// only), must let PyTorch take the same next step
// as Float16Optimizer: same FP32 masters, native FP32 parameters and moments; BF16 model
// parameters equal to the rounded masters. Skipped when MIXPREC_PYTHON cannot import torch
// and safetensors.
#include "mixprec/checkpoint/format/safetensors_reader.h"
#include "mixprec/checkpoint/format/safetensors_writer.h"
#include "mixprec/checkpoint/tensor_dtype.h"
#include "mixprec/checkpoint/training_state.h"

#include "checkpoint/format/format_test_util.h"
#include "optim/support_optim.h"
#include "support/test_env.h"

#include <gtest/gtest.h>

#include <torch/optim/adamw.h>

#include <sys/wait.h>
#include <cstdio>

namespace mixprec::checkpoint {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

namespace fs = std::filesystem;
using optim::ParamRole;
using testing::TempDir;

fs::path client_script() {
  return fs::path(mixprec::test::source_dir()) / "tests" / "checkpoint" / "python_client.py";
}

std::string quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Runs `command` under coreutils `timeout` (a hung interpreter fails the test instead of
// hanging it); returns the exit status (-1 on a signal) and the combined output.
std::pair<int, std::string> run(const std::string& command, int seconds = 300) {
  const std::string full = "timeout " + std::to_string(seconds) + " " + command + " 2>&1";
  FILE* pipe = ::popen(full.c_str(), "r");
  if (pipe == nullptr) return {-1, "popen failed"};
  std::string out;
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, pipe)) > 0;) out.append(buf, n);
  const int raw = ::pclose(pipe);
  return {(raw != -1 && WIFEXITED(raw)) ? WEXITSTATUS(raw) : -1, out};
}

void write_tensors(const fs::path& path, const std::map<std::string, at::Tensor>& tensors) {
  std::vector<TensorSpec> specs;
  for (const auto& [name, t] : tensors) {
    specs.push_back({name, to_checkpoint_dtype(t.scalar_type()), t.sizes().vec()});
  }
  SafetensorsWriter writer(path, specs);
  for (const auto& [name, t] : tensors) {
    const at::Tensor c = t.contiguous();
    writer.write(name, {static_cast<const std::byte*>(c.const_data_ptr()), c.nbytes()});
  }
  writer.close();
}

at::Tensor read_tensor(const SafetensorsReader& reader, const std::string& name) {
  const TensorEntry& entry = reader.tensor(name);
  at::Tensor t = at::empty(entry.shape, at::TensorOptions().dtype(to_scalar_type(entry.dtype)));
  reader.read(name, {static_cast<std::byte*>(t.data_ptr()), t.nbytes()});
  return t;
}

struct Case {
  std::string impl;  // torch.optim.AdamW implementation: "fused" or "single_tensor"
  bool amsgrad;
};
// Readable test parameters in gtest and ctest output.
void PrintTo(const Case& c, std::ostream* os) { *os << c.impl << (c.amsgrad ? " amsgrad" : ""); }

class PythonClient : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    python_ = mixprec::test::python();
    if (python_.empty()) GTEST_SKIP() << "no Python with torch and safetensors (MIXPREC_PYTHON)";
  }
  std::string python_;
};

TEST_P(PythonClient, PyTorchAdamWContinuesFromOurCheckpoint) {
  const Case c = GetParam();
  TempDir dir;
  at::manual_seed(5);
  mixprec::testing::Interleaved model;
  auto optimizer = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(1e-2)
                                                               .betas({0.9, 0.95})
                                                               .eps(1e-8)
                                                               .weight_decay(0.1)
                                                               .amsgrad(c.amsgrad));
  for (int64_t step = 1; step <= 3; ++step) {
    mixprec::testing::set_grads(*model, step);
    ASSERT_TRUE(optimizer->update().success);
  }
  save_training_state(dir.path() / "root", "step-3", *model, *optimizer);

  // The next step's gradients, as the model holds them (BF16 for BF16 params), go to Python.
  mixprec::testing::set_grads(*model, 4);
  std::map<std::string, at::Tensor> grads;
  for (const auto& item : model->named_parameters()) {
    if (item.value().requires_grad()) grads[item.key()] = item.value().grad();
  }
  write_tensors(dir.path() / "grads.safetensors", grads);
  const fs::path out = dir.path() / "after.safetensors";
  const auto [status, output] =
      run(quote(python_) + " " + quote(client_script().string()) + " adamw-step " +
          quote((dir.path() / "root").string()) + " --grads " +
          quote((dir.path() / "grads.safetensors").string()) + " --out " + quote(out.string()) +
          " --impl " + c.impl);
  ASSERT_EQ(status, 0) << output;

  ASSERT_TRUE(optimizer->update().success);  // the same step, in C++
  const SafetensorsReader theirs(out);
  const ShardedStateDict ours = optimizer->sharded_state_dict();
  const auto params = model->named_parameters();
  // fused: torch's fused CPU AdamW performs the operations our kernel mirrors, in the same
  // order — bitwise equal. single_tensor: the same formulas in another order (lerp for
  // exp_avg, a separate sqrt and divide), so results differ by FP32 rounding of one step's
  // update: a few ulps of values of magnitude ~0.1–1, far inside rtol 1e-6 + atol 1e-9
  // (mixed_reference_test.cpp uses the same bound over five steps).
  auto expect_close = [&](const at::Tensor& mine, const at::Tensor& python,
                          const std::string& what) {
    ASSERT_EQ(mine.scalar_type(), at::kFloat) << what;
    ASSERT_EQ(python.scalar_type(), at::kFloat) << what;
    if (c.impl == "fused") {
      EXPECT_TRUE(at::equal(mine, python))
          << what << " max diff " << (mine - python).abs().max().item<double>();
    } else {
      EXPECT_TRUE(at::allclose(mine, python, 1e-6, 1e-9))
          << what << " max diff " << (mine - python).abs().max().item<double>();
    }
  };
  int checked = 0;
  for (const optim::ParamInfo& info : optimizer->params_info()) {
    const at::Tensor param = params[info.fqn].detach();
    if (info.role == ParamRole::kFrozen) {
      EXPECT_EQ(theirs.header().find(info.fqn), nullptr)
          << info.fqn << ": frozen, must not be stepped";
      continue;
    }
    const at::Tensor python_param = read_tensor(theirs, info.fqn);
    if (info.role == ParamRole::kMaster) {
      expect_close(optimizer->main_param(info.fqn), python_param, info.fqn + " (master)");
      // The model parameter is exactly the master rounded to nearest even.
      EXPECT_TRUE(at::equal(param, optimizer->main_param(info.fqn).to(at::kBFloat16))) << info.fqn;
      // And so the rounding of Python's master (no master of these inputs sits on a BF16
      // rounding boundary, where a last-ulp difference could flip it).
      EXPECT_TRUE(at::equal(param, python_param.to(at::kBFloat16))) << info.fqn;
    } else {
      expect_close(param, python_param, info.fqn + " (native fp32)");
    }
    std::vector<std::string> moments = {"exp_avg", "exp_avg_sq"};
    if (c.amsgrad) moments.push_back("max_exp_avg_sq");
    for (const std::string& name : moments) {
      const std::string key = "optimizer.state." + name + "." + info.fqn;
      expect_close(ours.at(key).local, read_tensor(theirs, key), key);
    }
    EXPECT_EQ(read_tensor(theirs, "optimizer.state.step." + info.fqn).item<float>(), 4.0f)
        << info.fqn;
    ++checked;
  }
  EXPECT_EQ(checked, 3);  // pre.weight, gate, post.weight
}

// Damaged copies of a good checkpoint (a FIFO or a link for a data file, the manifest or the
// common state; truncated files; a manifest claiming a huge shape) end in the reader's
// CheckpointError naming the file: no hang (the timeout would fail the test), no foreign
// exception, no allocation of the claimed size. Copies changed in ways mixprec's own reader
// accepts (a leading UTF-8 BOM, ...) are read without one.
TEST(PythonReader, DamagedFilesAreErrorsNamingTheFile) {
  const std::string python = mixprec::test::python();
  if (python.empty()) GTEST_SKIP() << "no Python with torch and safetensors (MIXPREC_PYTHON)";
  TempDir dir;
  at::manual_seed(6);
  mixprec::testing::Interleaved model;
  auto optimizer = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(1e-2));
  mixprec::testing::set_grads(*model, 1);
  ASSERT_TRUE(optimizer->update().success);
  save_training_state(dir.path() / "root", "step-1", *model, *optimizer);
  fs::create_directories(dir.path() / "scratch");
  const fs::path script =
      fs::path(mixprec::test::source_dir()) / "tests" / "checkpoint" / "python_reader_damaged.py";
  const auto [status, output] = run(quote(python) + " " + quote(script.string()) + " " +
                                        quote((dir.path() / "root" / "step-1").string()) + " " +
                                        quote((dir.path() / "scratch").string()),
                                    /*seconds=*/120);
  EXPECT_EQ(status, 0) << output;
  EXPECT_NE(output.find("ok "), std::string::npos) << output;
}

INSTANTIATE_TEST_SUITE_P(Implementations, PythonClient,
                         ::testing::Values(Case{"fused", false}, Case{"fused", true},
                                           Case{"single_tensor", false},
                                           Case{"single_tensor", true}),
                         [](const auto& info) {
                           return info.param.impl + (info.param.amsgrad ? "_amsgrad" : "");
                         });

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::checkpoint
