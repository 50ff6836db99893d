#include "mixprec/precision/keep_fp32.h"

#include "mixprec/precision/convert.h"
#include "mixprec/precision/module_clone.h"
#include "support/toy_net.h"

#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/serialize.h>

#include <sstream>
#include <thread>

namespace mixprec {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using testing::ToyNet;

TEST(KeepFp32, MarksParameterAndReturnsSameTensor) {
  at::Tensor t = torch::randn({3});
  at::Tensor same = keep_in_fp32(t);
  EXPECT_TRUE(same.is_same(t));
  EXPECT_TRUE(is_kept_in_fp32(t));
  EXPECT_FALSE(is_kept_in_fp32(torch::randn({3})));
  EXPECT_FALSE(is_kept_in_fp32(at::Tensor()));
}

TEST(KeepFp32, ComposesWithRegisterParameterAndBuffer) {
  ToyNet net;
  EXPECT_TRUE(is_kept_in_fp32(net->router_weight));
  EXPECT_TRUE(is_kept_in_fp32(net->named_parameters()["router_weight"]));
  EXPECT_TRUE(is_kept_in_fp32(net->named_buffers()["expert_bias"]));
  EXPECT_FALSE(is_kept_in_fp32(net->running_scale));
  EXPECT_FALSE(is_kept_in_fp32(net->fc->weight));
}

TEST(KeepFp32, ClearRemovesMark) {
  at::Tensor t = keep_in_fp32(torch::randn({2}));
  clear_keep_in_fp32(t);
  EXPECT_FALSE(is_kept_in_fp32(t));
  clear_keep_in_fp32(t);  // clearing twice is harmless
}

TEST(KeepFp32, RejectsNonFloatingTensorsNamingDtypeAndShape) {
  try {
    keep_in_fp32(torch::zeros({2, 5}, torch::kLong));
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("[mixprec::keep_in_fp32]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("Long"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[2, 5]"), std::string::npos) << msg;
  }
  EXPECT_THROW(keep_in_fp32(torch::ones({1}, torch::kBool)), c10::Error);
  EXPECT_THROW(keep_in_fp32(at::Tensor()), c10::Error);
}

// Module::to(dtype) allocates new storage and swaps it in with set_data; the TensorImpl, and
// with it the mark, stays. Parameters and buffers alike (the upstream review's point 1).
TEST(KeepFp32, SurvivesModuleToDtypeWithNewStorage) {
  ToyNet net;
  const void* param_storage = net->router_weight.data_ptr();
  const void* buffer_storage = net->expert_bias.data_ptr();
  net->to(torch::kDouble);
  EXPECT_NE(net->router_weight.data_ptr(), param_storage);
  EXPECT_NE(net->expert_bias.data_ptr(), buffer_storage);
  EXPECT_EQ(net->router_weight.scalar_type(), torch::kDouble);
  EXPECT_TRUE(is_kept_in_fp32(net->named_parameters()["router_weight"]));
  EXPECT_TRUE(is_kept_in_fp32(net->named_buffers()["expert_bias"]));
  EXPECT_FALSE(is_kept_in_fp32(net->named_buffers()["running_scale"]));
}

TEST(KeepFp32, SurvivesModuleToDevice) {
  ToyNet net;
  net->to(torch::Device(torch::kCPU));
  net->to(torch::Device(torch::kCPU), torch::kBFloat16);
  EXPECT_TRUE(is_kept_in_fp32(net->named_parameters()["router_weight"]));
  EXPECT_TRUE(is_kept_in_fp32(net->named_buffers()["expert_bias"]));
}

TEST(KeepFp32, SurvivesRealCudaMove) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device on this machine";
  ToyNet net;
  net->to(torch::Device(torch::kCUDA));
  EXPECT_TRUE(net->router_weight.is_cuda());
  EXPECT_TRUE(net->expert_bias.is_cuda());
  EXPECT_TRUE(is_kept_in_fp32(net->named_parameters()["router_weight"]));
  EXPECT_TRUE(is_kept_in_fp32(net->named_buffers()["expert_bias"]));
  auto report = convert_module_to_dtype_except_fp32_marked(*net, torch::kBFloat16);
  EXPECT_EQ(net->router_weight.scalar_type(), torch::kFloat);
  EXPECT_EQ(net->expert_bias.scalar_type(), torch::kFloat);
  EXPECT_EQ(net->running_scale.scalar_type(), torch::kBFloat16);
}

TEST(KeepFp32, SurvivesConversion) {
  ToyNet net;
  convert_module_to_dtype_except_fp32_marked(*net, torch::kHalf);
  EXPECT_TRUE(is_kept_in_fp32(net->named_parameters()["router_weight"]));
  EXPECT_TRUE(is_kept_in_fp32(net->named_buffers()["expert_bias"]));
  // Converting twice (e.g. re-wrapping) keeps them FP32.
  convert_module_to_dtype_except_fp32_marked(*net, torch::kBFloat16);
  EXPECT_EQ(net->router_weight.scalar_type(), torch::kFloat);
  EXPECT_EQ(net->expert_bias.scalar_type(), torch::kFloat);
}

// clone() rebuilds tensors through reset(), where ToyNet marks them.
TEST(KeepFp32, MarksMadeInResetSurviveClone) {
  ToyNet net;
  auto copy = std::dynamic_pointer_cast<testing::ToyNetImpl>(net->clone());
  ASSERT_TRUE(copy);
  EXPECT_FALSE(copy->router_weight.is_same(net->router_weight));
  EXPECT_TRUE(torch::equal(copy->router_weight, net->router_weight));
  EXPECT_TRUE(is_kept_in_fp32(copy->named_parameters()["router_weight"]));
  EXPECT_TRUE(is_kept_in_fp32(copy->named_buffers()["expert_bias"]));
  EXPECT_FALSE(is_kept_in_fp32(copy->named_parameters()["fc.weight"]));
}

// Marks made after construction are carried by clone_module (and are lost by a bare clone,
// which is why clone_module exists).
TEST(KeepFp32, CloneModuleCarriesMarksMadeAnywhere) {
  ToyNet net;
  keep_in_fp32(net->fc->bias);
  keep_in_fp32(net->running_scale);
  auto bare = net->clone();
  EXPECT_FALSE(is_kept_in_fp32(bare->named_parameters()["fc.bias"]));
  auto copy = clone_module(*net);
  EXPECT_TRUE(is_kept_in_fp32(copy->named_parameters()["fc.bias"]));
  EXPECT_TRUE(is_kept_in_fp32(copy->named_buffers()["running_scale"]));
  EXPECT_TRUE(is_kept_in_fp32(copy->named_parameters()["router_weight"]));
  EXPECT_FALSE(is_kept_in_fp32(copy->named_parameters()["fc.weight"]));
}

// torch::load writes into the module's existing tensors, so marks stay; values come back.
TEST(KeepFp32, SurvivesTorchLoadOfModuleState) {
  ToyNet source;
  std::stringstream archive;
  torch::save(source, archive);

  ToyNet target;
  keep_in_fp32(target->fc->weight);
  torch::load(target, archive);
  EXPECT_TRUE(torch::equal(target->router_weight, source->router_weight));
  EXPECT_TRUE(torch::equal(target->fc->weight, source->fc->weight));
  EXPECT_TRUE(is_kept_in_fp32(target->named_parameters()["router_weight"]));
  EXPECT_TRUE(is_kept_in_fp32(target->named_buffers()["expert_bias"]));
  EXPECT_TRUE(is_kept_in_fp32(target->named_parameters()["fc.weight"]));
}

// A mark never outlives its tensor: new tensors (which may reuse freed memory) are unmarked.
TEST(KeepFp32, MarkDiesWithTensor) {
  for (int i = 0; i < 1000; ++i) keep_in_fp32(torch::randn({4}));
  for (int i = 0; i < 1000; ++i) EXPECT_FALSE(is_kept_in_fp32(torch::randn({4})));
}

TEST(KeepFp32, ConcurrentMarking) {
  std::vector<at::Tensor> tensors(8 * 200);
  for (auto& t : tensors) t = torch::randn({2});
  std::vector<std::thread> threads;
  for (int w = 0; w < 8; ++w) {
    threads.emplace_back([&, w] {
      for (int i = 0; i < 200; ++i) keep_in_fp32(tensors[w * 200 + i]);
    });
  }
  for (auto& th : threads) th.join();
  for (const auto& t : tensors) EXPECT_TRUE(is_kept_in_fp32(t));
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec
