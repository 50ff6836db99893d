#include "mixprec/precision/precision_plan.h"

#include "mixprec/quant/quant_linear.h"
#include "mixprec/quant/quant_state.h"
#include "support/toy_net.h"

#include "support/error_message.h"

#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

namespace mixprec {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using testing::ToyNet;

const PlannedTensor& find(const PrecisionPlan::Resolved& r, const std::string& name) {
  for (const auto& p : r.tensors) {
    if (p.name == name) return p;
  }
  throw std::runtime_error("no planned tensor " + name);
}

using mixprec::testing::error_of;

TEST(PrecisionPlan, ResolvesMarksNamesAndPatterns) {
  ToyNet net;
  auto r = PrecisionPlan().keep_fp32_name("fc.bias").keep_fp32_pattern("*norm*").resolve(*net);
  EXPECT_EQ(find(r, "router_weight").reason, KeepReason::kTensorMark);
  EXPECT_EQ(find(r, "expert_bias").reason, KeepReason::kTensorMark);
  EXPECT_EQ(find(r, "fc.bias").reason, KeepReason::kName);
  EXPECT_EQ(find(r, "fc.bias").rule, "fc.bias");
  EXPECT_EQ(find(r, "norm.weight").reason, KeepReason::kPattern);
  EXPECT_EQ(find(r, "norm.bias").rule, "*norm*");
  EXPECT_EQ(find(r, "fc.weight").reason, KeepReason::kNone);
  EXPECT_EQ(find(r, "fc.weight").kind, TensorKind::kParameter);
  EXPECT_EQ(find(r, "running_scale").kind, TensorKind::kBuffer);
  EXPECT_TRUE(find(r, "fc.weight").tensor.is_same(net->fc->weight));
}

TEST(PrecisionPlan, SubmoduleNameCoversItsTensors) {
  ToyNet net;
  auto r = PrecisionPlan().keep_fp32_name("norm").resolve(*net);
  EXPECT_EQ(find(r, "norm.weight").reason, KeepReason::kName);
  EXPECT_EQ(find(r, "norm.bias").reason, KeepReason::kName);
  EXPECT_EQ(find(r, "fc.weight").reason, KeepReason::kNone);
}

// A tied tensor's names all get the strongest reason any of them has (a name beats a
// pattern), with the name that rule matched.
TEST(PrecisionPlan, TiedNamesShareTheStrongestReason) {
  torch::nn::Module tied;
  const at::Tensor w = tied.register_parameter("emb", torch::randn({4, 4}));
  tied.register_parameter("head", w);
  auto r = PrecisionPlan().keep_fp32_name("head").keep_fp32_pattern("em*").resolve(tied);
  for (const char* name : {"emb", "head"}) {
    EXPECT_EQ(find(r, name).reason, KeepReason::kName) << name;
    EXPECT_EQ(find(r, name).rule, "head") << name;
    EXPECT_EQ(find(r, name).matched, "head") << name;
  }
  EXPECT_TRUE(find(r, "head").shared);
}

TEST(PrecisionPlan, PatternsSkipIntegerAndBoolBuffers) {
  ToyNet net;
  auto r = PrecisionPlan().keep_fp32_pattern("*expert*").resolve(*net);
  EXPECT_EQ(find(r, "tokens_per_expert").reason, KeepReason::kNone);
  EXPECT_EQ(find(r, "expert_mask").reason, KeepReason::kNone);
}

TEST(PrecisionPlan, UnknownNameListsCloseMatches) {
  ToyNet net;
  const std::string msg =
      error_of([&] { PrecisionPlan().keep_fp32_name("router_weights").resolve(*net); });
  EXPECT_NE(msg.find("name 'router_weights' matches no parameter"), std::string::npos) << msg;
  EXPECT_NE(msg.find("close matches: router_weight"), std::string::npos) << msg;
}

// A submodule that holds no tensor (an activation) is named as what it is.
TEST(PrecisionPlan, NameOfASubmoduleWithoutTensorsSaysSo) {
  torch::nn::Sequential net(torch::nn::Linear(4, 4), torch::nn::ReLU());
  const std::string msg = error_of([&] { PrecisionPlan().keep_fp32_name("1").resolve(*net); });
  EXPECT_NE(msg.find("name '1' is a submodule without parameters or buffers"), std::string::npos)
      << msg;
}

TEST(PrecisionPlan, NameOfIntegerBufferIsAnError) {
  ToyNet net;
  const std::string msg =
      error_of([&] { PrecisionPlan().keep_fp32_name("tokens_per_expert").resolve(*net); });
  EXPECT_NE(msg.find("'tokens_per_expert' is a Long buffer"), std::string::npos) << msg;
}

TEST(PrecisionPlan, StrictPatternMatchingNothingIsAnError) {
  ToyNet net;
  const std::string msg =
      error_of([&] { PrecisionPlan().keep_fp32_pattern("*.router.weight").resolve(*net); });
  EXPECT_NE(msg.find("pattern '*.router.weight' matches no floating"), std::string::npos) << msg;
  auto r = PrecisionPlan().keep_fp32_pattern("*.router.weight").strict(false).resolve(*net);
  ASSERT_EQ(r.unmatched_patterns.size(), 1u);
  EXPECT_EQ(r.unmatched_patterns[0], "*.router.weight");
}

// A pattern that matches only an FP8 primary weight does match: it says the tensor cannot be
// kept FP32, as a name does, not that it matches nothing.
TEST(PrecisionPlan, StrictPatternMatchingOnlyFp8TensorsSaysSo) {
  quant::QuantLinear proj(nullptr);
  {
    quant::QuantModelInitGuard init(
        quant::QuantConfig().fp8(quant::Fp8Recipe::kE4M3).fp8_param(true));
    proj = quant::QuantLinear(4, 4);
  }
  torch::nn::Sequential net(proj);
  const std::string msg =
      error_of([&] { PrecisionPlan().keep_fp32_pattern("0.weight").resolve(*net); });
  EXPECT_NE(msg.find("pattern '0.weight' matches only FP8 (quantized) tensors: parameter "
                     "'0.weight' (Float8_e4m3fn); only floating, non-FP8 tensors can be kept "
                     "in FP32"),
            std::string::npos)
      << msg;
  auto r = PrecisionPlan().keep_fp32_pattern("0.weight").strict(false).resolve(*net);
  ASSERT_EQ(r.unmatched_patterns.size(), 1u);
  // An FP8 weight beside a floating tensor the pattern keeps is no error: a broad pattern
  // simply does not cover it.
  EXPECT_NO_THROW(PrecisionPlan().keep_fp32_pattern("0.*").resolve(*net));
}

TEST(PrecisionPlan, ReportsEveryProblemAtOnce) {
  ToyNet net;
  const std::string msg = error_of([&] {
    PrecisionPlan()
        .keep_fp32_name("fc.wieght")
        .keep_fp32_name("expert_mask")
        .keep_fp32_pattern("*ssm*")
        .resolve(*net);
  });
  EXPECT_NE(msg.find("'fc.wieght'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("fc.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'expert_mask' is a Bool buffer"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'*ssm*'"), std::string::npos) << msg;
}

TEST(PrecisionPlan, EmptyNameOrPatternRejected) {
  EXPECT_THROW(PrecisionPlan().keep_fp32_name(""), c10::Error);
  EXPECT_THROW(PrecisionPlan().keep_fp32_pattern(""), c10::Error);
}

// a name covers its own submodule's tensors, not a sibling whose name it prefixes.
TEST(PrecisionPlan, NameDoesNotCoverASiblingItPrefixes) {
  torch::nn::Sequential net;
  net->push_back("fc", torch::nn::Linear(4, 4));
  net->push_back("fc2", torch::nn::Linear(4, 4));
  auto r = PrecisionPlan().keep_fp32_name("fc").resolve(*net);
  EXPECT_EQ(find(r, "fc.weight").reason, KeepReason::kName);
  EXPECT_EQ(find(r, "fc2.weight").reason, KeepReason::kNone);
  EXPECT_EQ(find(r, "fc2.bias").reason, KeepReason::kNone);
}

// Each tensor is kept for its first reason in precedence order: its mark, then the first name
// that covers it, then the first pattern. A later, weaker rule does not replace it.
TEST(PrecisionPlan, TheFirstReasonInPrecedenceOrderWins) {
  ToyNet net;
  auto r = PrecisionPlan()
               .keep_fp32_name("router_weight")
               .keep_fp32_name("norm")
               .keep_fp32_name("norm.weight")
               .keep_fp32_pattern("fc.*")
               .keep_fp32_pattern("*")
               .resolve(*net);
  EXPECT_EQ(find(r, "router_weight").reason, KeepReason::kTensorMark);
  EXPECT_EQ(find(r, "router_weight").rule, "");
  EXPECT_EQ(find(r, "norm.weight").reason, KeepReason::kName);
  EXPECT_EQ(find(r, "norm.weight").rule, "norm");
  EXPECT_EQ(find(r, "fc.weight").reason, KeepReason::kPattern);
  EXPECT_EQ(find(r, "fc.weight").rule, "fc.*");
  EXPECT_EQ(find(r, "running_scale").rule, "*");
}

// A submodule's name keeps its floating tensors and skips its integer ones (a BatchNorm's
// num_batches_tracked): only a name that is itself a non-floating tensor is an error.
TEST(PrecisionPlan, SubmoduleNameSkipsItsIntegerBuffers) {
  torch::nn::Sequential net;
  net->push_back("bn", torch::nn::BatchNorm1d(4));
  PrecisionPlan::Resolved r;
  ASSERT_NO_THROW(r = PrecisionPlan().keep_fp32_name("bn").resolve(*net));
  EXPECT_EQ(find(r, "bn.weight").reason, KeepReason::kName);
  EXPECT_EQ(find(r, "bn.running_mean").reason, KeepReason::kName);
  EXPECT_EQ(find(r, "bn.num_batches_tracked").reason, KeepReason::kNone);
}

// A marked tensor whose data has since become something that cannot be kept FP32 (an FP8
// set_data) is an error naming it, not a mark silently dropped.
TEST(PrecisionPlan, AMarkedTensorThatIsNowFp8IsAnError) {
  ToyNet net;
  net->router_weight.set_data(net->router_weight.detach().to(at::kFloat8_e4m3fn));
  ASSERT_TRUE(is_kept_in_fp32(net->router_weight));
  const std::string msg = error_of([&] { PrecisionPlan().resolve(*net); });
  EXPECT_NE(msg.find("parameter 'router_weight' is marked keep_in_fp32 but is now Float8_e4m3fn"),
            std::string::npos)
      << msg;
}

// A strict pattern that matches FP8 tensors and integer ones, but no tensor it could keep,
// names both kinds it met.
TEST(PrecisionPlan, StrictPatternMatchingFp8AndIntegerTensorsSaysBoth) {
  torch::nn::Module net;
  net.register_parameter("w", torch::ones({2}).to(at::kFloat8_e4m3fn), /*requires_grad=*/false);
  net.register_buffer("count", torch::zeros({2}, torch::kLong));
  const std::string msg = error_of([&] { PrecisionPlan().keep_fp32_pattern("*").resolve(net); });
  EXPECT_NE(msg.find("pattern '*' matches only FP8 (quantized) and non-floating tensors: "
                     "parameter 'w' (Float8_e4m3fn)"),
            std::string::npos)
      << msg;
}

// `matched` is the name a name or pattern rule matched; it is empty for a mark (no rule
// matched a name) and for a tensor the plan does not keep.
TEST(PrecisionPlan, MatchedIsEmptyForAMarkAndForTensorsNotKept) {
  ToyNet net;
  auto r = PrecisionPlan().keep_fp32_name("fc.bias").resolve(*net);
  EXPECT_EQ(find(r, "router_weight").reason, KeepReason::kTensorMark);
  EXPECT_EQ(find(r, "router_weight").matched, "");
  EXPECT_EQ(find(r, "expert_bias").matched, "");
  EXPECT_EQ(find(r, "fc.weight").matched, "");
  EXPECT_EQ(find(r, "fc.bias").matched, "fc.bias");
}

// A name registered without a tensor (a bias-less layer's "bias"), in a submodule or the
// module itself, is named as such. Before, LibTorch's named_parameters() hid it and the plan
// said the name "matches no parameter, buffer or submodule (the module has none like it)".
TEST(PrecisionPlan, NameOfAnUndefinedParameterSaysItIsUndefined) {
  torch::nn::Sequential net(quant::QuantLinear(quant::QuantLinearOptions(4, 4).bias(false)));
  std::string msg = error_of([&] { PrecisionPlan().keep_fp32_name("0.bias").resolve(*net); });
  EXPECT_NE(msg.find("name '0.bias' is registered but undefined"), std::string::npos) << msg;
  torch::nn::Module top;
  top.register_parameter("weight", torch::ones({2}));
  top.register_parameter("bias", at::Tensor(), /*requires_grad=*/false);
  msg = error_of([&] { PrecisionPlan().keep_fp32_name("bias").resolve(top); });
  EXPECT_NE(msg.find("name 'bias' is registered but undefined"), std::string::npos) << msg;
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec
