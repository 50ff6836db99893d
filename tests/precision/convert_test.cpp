#include "mixprec/precision/convert.h"

#include "mixprec/precision/keep_fp32.h"
#include "mixprec/precision/module_clone.h"
#include "mixprec/sharded_state_dict.h"
#include "support/toy_net.h"

#include <gtest/gtest.h>

#include <map>

namespace mixprec {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using testing::ToyNet;

std::map<std::string, at::Tensor> snapshot(const torch::nn::Module& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value().clone();
  for (const auto& b : m.named_buffers()) out[b.key()] = b.value().clone();
  return out;
}

void expect_unchanged(const torch::nn::Module& m, const std::map<std::string, at::Tensor>& before) {
  auto now = snapshot(m);
  ASSERT_EQ(now.size(), before.size());
  for (const auto& [name, t] : before) {
    EXPECT_EQ(now[name].scalar_type(), t.scalar_type()) << name;
    EXPECT_TRUE(torch::equal(now[name], t)) << name;
  }
}

const ConversionEntry& entry(const ConversionReport& r, const std::string& name) {
  for (const auto& e : r.entries) {
    if (e.name == name) return e;
  }
  throw std::runtime_error("no report entry " + name);
}

class ConvertTest : public ::testing::TestWithParam<c10::ScalarType> {};

TEST_P(ConvertTest, CastsAllButKeptAndNonFloating) {
  const c10::ScalarType half = GetParam();
  ToyNet net;
  auto before = snapshot(*net);
  auto report = convert_module_to_dtype_except_fp32_marked(
      *net, half, PrecisionPlan().keep_fp32_pattern("*norm*"));

  EXPECT_EQ(net->fc->weight.scalar_type(), half);
  EXPECT_EQ(net->fc->bias.scalar_type(), half);
  EXPECT_EQ(net->running_scale.scalar_type(), half);
  EXPECT_EQ(net->router_weight.scalar_type(), at::kFloat);
  EXPECT_EQ(net->expert_bias.scalar_type(), at::kFloat);
  EXPECT_EQ(net->norm->weight.scalar_type(), at::kFloat);
  EXPECT_EQ(net->tokens_per_expert.scalar_type(), at::kLong);
  EXPECT_EQ(net->expert_mask.scalar_type(), at::kBool);
  // Cast values are the round-to-nearest-even images of the originals.
  EXPECT_TRUE(torch::equal(net->fc->weight, before["fc.weight"].to(half)));
  EXPECT_TRUE(torch::equal(net->router_weight, before["router_weight"]));

  EXPECT_EQ(entry(report, "fc.weight").action, ConversionAction::kCast);
  EXPECT_EQ(entry(report, "fc.weight").before, at::kFloat);
  EXPECT_EQ(entry(report, "fc.weight").after, half);
  EXPECT_EQ(entry(report, "router_weight").action, ConversionAction::kKeptFp32);
  EXPECT_EQ(entry(report, "router_weight").why, "keep_in_fp32 mark");
  EXPECT_EQ(entry(report, "expert_bias").kind, TensorKind::kBuffer);
  EXPECT_EQ(entry(report, "norm.weight").why, "pattern '*norm*'");
  EXPECT_EQ(entry(report, "tokens_per_expert").action, ConversionAction::kLeftAlone);
  EXPECT_EQ(entry(report, "tokens_per_expert").why, "Long buffer");
  EXPECT_EQ(entry(report, "expert_mask").action, ConversionAction::kLeftAlone);

  int64_t bytes_before = 0, bytes_after = 0;
  for (const auto& [name, t] : before) bytes_before += t.nbytes();
  for (const auto& [name, t] : snapshot(*net)) bytes_after += t.nbytes();
  EXPECT_EQ(report.bytes_before, bytes_before);
  EXPECT_EQ(report.bytes_after, bytes_after);
  EXPECT_LT(report.bytes_after, report.bytes_before);

  const std::string table = report.to_string();
  EXPECT_NE(table.find("fc.weight"), std::string::npos);
  EXPECT_NE(table.find("Float -> " + std::string(c10::toString(half))), std::string::npos);
  EXPECT_NE(table.find("pattern '*norm*'"), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(HalfTypes, ConvertTest, ::testing::Values(at::kHalf, at::kBFloat16),
                         [](const auto& info) { return std::string(c10::toString(info.param)); });

// References held elsewhere (an optimizer's param list) see the converted tensors.
TEST(Convert, KeepsTensorIdentity) {
  ToyNet net;
  std::vector<at::Tensor> held = net->parameters();
  std::vector<const c10::TensorImpl*> impls;
  for (const auto& t : held) impls.push_back(t.unsafeGetTensorImpl());
  convert_module_to_dtype_except_fp32_marked(*net, at::kBFloat16);
  auto now = net->parameters();
  ASSERT_EQ(now.size(), held.size());
  for (size_t i = 0; i < held.size(); ++i) {
    EXPECT_EQ(now[i].unsafeGetTensorImpl(), impls[i]);
    EXPECT_EQ(held[i].scalar_type(), now[i].scalar_type());
  }
  EXPECT_TRUE(net->fc->weight.requires_grad());
}

// Module::to(kBFloat16) casts everything, marked tensors and integer buffers included; a
// conversion afterwards brings marked tensors back to FP32 and says so.
TEST(Convert, MarkedTensorThatIsNotFp32EndsFp32) {
  ToyNet net;
  net->to(at::kBFloat16);
  EXPECT_EQ(net->router_weight.scalar_type(), at::kBFloat16);
  auto report = convert_module_to_dtype_except_fp32_marked(*net, at::kBFloat16);
  EXPECT_EQ(net->router_weight.scalar_type(), at::kFloat);
  EXPECT_EQ(net->expert_bias.scalar_type(), at::kFloat);
  EXPECT_EQ(entry(report, "router_weight").action, ConversionAction::kUpcastFp32);
  EXPECT_EQ(entry(report, "router_weight").before, at::kBFloat16);
  EXPECT_EQ(entry(report, "fc.weight").action, ConversionAction::kLeftAlone);
  EXPECT_EQ(report.count(ConversionAction::kUpcastFp32), 2);
}

TEST(Convert, CastsGradientsWithTheirParameters) {
  ToyNet net;
  net->forward(torch::randn({2, 8})).sum().backward();
  net->fc->bias.set_requires_grad(false);  // frozen after the backward: its gradient stays
  convert_module_to_dtype_except_fp32_marked(*net, at::kHalf);
  EXPECT_EQ(net->fc->weight.grad().scalar_type(), at::kHalf);
  EXPECT_EQ(net->fc->bias.grad().scalar_type(), at::kHalf);
  EXPECT_EQ(net->router_weight.grad().scalar_type(), at::kFloat);
}

struct TiedImpl : torch::nn::Module {
  TiedImpl() {
    auto w = register_parameter("embed", torch::randn({4, 4}));
    register_parameter("head", w);
  }
};

TEST(Convert, TiedTensorsConvertOnceAndReportBoth) {
  auto tied = std::make_shared<TiedImpl>();
  auto report = convert_module_to_dtype_except_fp32_marked(*tied, at::kBFloat16);
  ASSERT_EQ(report.entries.size(), 2u);
  EXPECT_EQ(report.entries[1].name, "head");
  EXPECT_TRUE(report.entries[1].shared);
  EXPECT_EQ(report.entries[1].action, ConversionAction::kCast);
  EXPECT_EQ(report.entries[1].before, at::kFloat);
  EXPECT_EQ(report.bytes_before, 16 * 4);
  EXPECT_EQ(report.bytes_after, 16 * 2);
}

TEST(Convert, KeepingOneNameOfATiedTensorKeepsBoth) {
  auto tied = std::make_shared<TiedImpl>();
  auto report = convert_module_to_dtype_except_fp32_marked(*tied, at::kBFloat16,
                                                           PrecisionPlan().keep_fp32_name("head"));
  EXPECT_EQ(tied->named_parameters()["embed"].scalar_type(), at::kFloat);
  EXPECT_EQ(report.entries[0].action, ConversionAction::kKeptFp32);
}

// Each name of a tied tensor is reported with the strongest reason any of its names has
// (mark > name > pattern, docs/precision-plan.md), and a rule that matched another name says
// which. Before, "embed"'s own weaker pattern was reported for both names.
TEST(Convert, TiedTensorsReportTheStrongestReasonAndTheNameItMatched) {
  auto tied = std::make_shared<TiedImpl>();
  const at::Tensor w = tied->named_parameters()["embed"];
  auto report = convert_module_to_dtype_except_fp32_marked(
      *tied, at::kBFloat16, PrecisionPlan().keep_fp32_name("head").keep_fp32_pattern("emb*"));
  ASSERT_EQ(report.entries.size(), 2u);
  EXPECT_EQ(report.entries[0].reason, KeepReason::kName);
  EXPECT_EQ(report.entries[0].why, "name 'head' via tied 'head'");
  EXPECT_EQ(report.entries[1].reason, KeepReason::kName);
  EXPECT_EQ(report.entries[1].why, "name 'head'");
  EXPECT_NE(report.to_string().find("name 'head' (tied)"), std::string::npos) << report.to_string();
  EXPECT_EQ(kept_fp32_reason(w).reason, KeepReason::kName);
  EXPECT_EQ(kept_fp32_reason(w).rule, "head");

  // Only the second name is kept: the first says through which name.
  report = convert_module_to_dtype_except_fp32_marked(*tied, at::kBFloat16,
                                                      PrecisionPlan().keep_fp32_pattern("he*"));
  EXPECT_EQ(report.entries[0].why, "pattern 'he*' via tied 'head'");
  EXPECT_EQ(report.entries[1].why, "pattern 'he*'");
  // Kept at the same strength by a rule of its own, each name gives its own.
  report = convert_module_to_dtype_except_fp32_marked(
      *tied, at::kBFloat16, PrecisionPlan().keep_fp32_pattern("emb*").keep_fp32_pattern("he*"));
  EXPECT_EQ(report.entries[0].why, "pattern 'emb*'");
  EXPECT_EQ(report.entries[1].why, "pattern 'he*'");
  EXPECT_EQ(kept_fp32_reason(w).rule, "emb*");
}

TEST(Convert, NonHalfTargetIsAnErrorAndChangesNothing) {
  ToyNet net;
  auto before = snapshot(*net);
  for (auto dtype : {at::kFloat, at::kDouble, at::kFloat8_e4m3fn, at::kInt}) {
    try {
      convert_module_to_dtype_except_fp32_marked(*net, dtype);
      FAIL() << "expected an error for " << dtype;
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      EXPECT_NE(msg.find("target dtype must be Half or BFloat16, got " +
                         std::string(c10::toString(dtype))),
                std::string::npos)
          << msg;
    }
  }
  expect_unchanged(*net, before);
}

TEST(Convert, BadPlanIsAnErrorAndChangesNothing) {
  ToyNet net;
  auto before = snapshot(*net);
  EXPECT_THROW(convert_module_to_dtype_except_fp32_marked(
                   *net, at::kBFloat16, PrecisionPlan().keep_fp32_name("no.such.param")),
               c10::Error);
  EXPECT_THROW(convert_module_to_dtype_except_fp32_marked(
                   *net, at::kBFloat16, PrecisionPlan().keep_fp32_pattern("*nothing*")),
               c10::Error);
  expect_unchanged(*net, before);
}

TEST(Convert, NonStrictPlanReportsUnmatchedPatterns) {
  ToyNet net;
  auto report = convert_module_to_dtype_except_fp32_marked(
      *net, at::kBFloat16, PrecisionPlan().keep_fp32_pattern("*A_log*").strict(false));
  ASSERT_EQ(report.unmatched_patterns.size(), 1u);
  EXPECT_NE(report.to_string().find("pattern '*A_log*' matched nothing"), std::string::npos);
}

// Each kept tensor remembers which rule kept it; the record follows the tensor object (as a
// mark does) and the next conversion replaces it.
TEST(Convert, RecordsWhichRuleKeptEachTensor) {
  ToyNet net;
  EXPECT_EQ(kept_fp32_reason(net->router_weight).reason, KeepReason::kNone);  // not converted
  convert_module_to_dtype_except_fp32_marked(
      *net, at::kBFloat16,
      PrecisionPlan().keep_fp32_name("running_scale").keep_fp32_pattern("norm.*"));
  auto expect = [](const at::Tensor& t, KeepReason reason, const std::string& rule) {
    const KeptFp32 kept = kept_fp32_reason(t);
    EXPECT_EQ(kept.reason, reason) << to_string(kept.reason);
    EXPECT_EQ(kept.rule, rule);
  };
  expect(net->router_weight, KeepReason::kTensorMark, "");
  expect(net->expert_bias, KeepReason::kTensorMark, "");
  expect(net->running_scale, KeepReason::kName, "running_scale");
  expect(net->norm->weight, KeepReason::kPattern, "norm.*");
  expect(net->fc->weight, KeepReason::kNone, "");
  expect(net->tokens_per_expert, KeepReason::kNone, "");

  // Survives Module::to(device) and clone_module, like the mark.
  net->to(at::kCPU);
  expect(net->running_scale, KeepReason::kName, "running_scale");
  auto copy = std::dynamic_pointer_cast<testing::ToyNetImpl>(clone_module(*net));
  ASSERT_TRUE(copy);
  expect(copy->norm->weight, KeepReason::kPattern, "norm.*");
  expect(copy->running_scale, KeepReason::kName, "running_scale");

  // A conversion with another plan casts the norm and forgets why it was kept.
  convert_module_to_dtype_except_fp32_marked(*net, at::kBFloat16);
  expect(net->norm->weight, KeepReason::kNone, "");
  expect(net->running_scale, KeepReason::kNone, "");
  expect(net->router_weight, KeepReason::kTensorMark, "");
  expect(copy->norm->weight, KeepReason::kPattern, "norm.*");  // the clone is its own
}

// The model's state dict carries the reasons (common "precision"), as the checkpoint stores
// them: only tensors a conversion kept and that are still FP32.
TEST(Convert, ModelStateDictSavesWhyTensorsAreFp32) {
  ToyNet net;
  EXPECT_FALSE(model_sharded_state_dict(*net).common.contains("precision"));
  convert_module_to_dtype_except_fp32_marked(
      *net, at::kHalf, PrecisionPlan().keep_fp32_name("running_scale").keep_fp32_pattern("norm.*"));
  const nlohmann::json expected = {{"router_weight", "mark"},
                                   {"expert_bias", "mark"},
                                   {"running_scale", "name running_scale"},
                                   {"norm.weight", "pattern norm.*"},
                                   {"norm.bias", "pattern norm.*"}};
  EXPECT_EQ(model_sharded_state_dict(*net).common.at("precision"), expected);
  // Cast to half behind the plan's back: no longer FP32, so no longer listed.
  net->norm->to(at::kHalf);
  nlohmann::json without_norm = expected;
  without_norm.erase("norm.weight");
  without_norm.erase("norm.bias");
  EXPECT_EQ(model_sharded_state_dict(*net).common.at("precision"), without_norm);
}

// count() counts a tied tensor once, as the byte totals do: its second name is not a second
// cast or a second kept tensor.
TEST(Convert, CountCountsATiedTensorOnce) {
  auto tied = std::make_shared<TiedImpl>();
  auto report = convert_module_to_dtype_except_fp32_marked(*tied, at::kBFloat16);
  ASSERT_EQ(report.entries.size(), 2u);
  EXPECT_EQ(report.count(ConversionAction::kCast), 1);
  auto kept = std::make_shared<TiedImpl>();
  report = convert_module_to_dtype_except_fp32_marked(*kept, at::kBFloat16,
                                                      PrecisionPlan().keep_fp32_name("head"));
  EXPECT_EQ(report.count(ConversionAction::kKeptFp32), 1);
}

// A kept FP64 tensor ends FP32, as every kept tensor does (convert.h: "made fp32"), and an
// unkept one is cast to the target.
TEST(Convert, KeptFp64TensorEndsFp32) {
  torch::nn::Module m;
  const at::Tensor kept = m.register_parameter("kept", torch::randn({4}, torch::kDouble));
  const at::Tensor other = m.register_parameter("other", torch::randn({4}, torch::kDouble));
  auto report = convert_module_to_dtype_except_fp32_marked(m, at::kBFloat16,
                                                           PrecisionPlan().keep_fp32_name("kept"));
  EXPECT_EQ(kept.scalar_type(), at::kFloat);
  EXPECT_EQ(other.scalar_type(), at::kBFloat16);
  EXPECT_EQ(entry(report, "kept").action, ConversionAction::kUpcastFp32);
  EXPECT_EQ(entry(report, "kept").before, at::kDouble);
  EXPECT_EQ(entry(report, "kept").after, at::kFloat);
  EXPECT_EQ(report.bytes_before, 2 * 4 * 8);
  EXPECT_EQ(report.bytes_after, 4 * 4 + 4 * 2);
}

// A module without tensors reports its bytes unchanged: 100%, not 0%.
TEST(Convert, ReportOfAModuleWithoutTensorsSaysNothingShrank) {
  torch::nn::Module m;
  auto report = convert_module_to_dtype_except_fp32_marked(m, at::kHalf);
  EXPECT_TRUE(report.entries.empty());
  EXPECT_NE(report.to_string().find("bytes: 0 -> 0 (100.0%)"), std::string::npos)
      << report.to_string();
}

// A tensor the conversion brought back to FP32 (made fp32) records why, as one it left FP32
// does.
TEST(Convert, TensorsMadeFp32RecordWhy) {
  ToyNet net;
  net->to(at::kBFloat16);
  auto report = convert_module_to_dtype_except_fp32_marked(
      *net, at::kBFloat16, PrecisionPlan().keep_fp32_name("running_scale"));
  ASSERT_EQ(entry(report, "running_scale").action, ConversionAction::kUpcastFp32);
  ASSERT_EQ(entry(report, "router_weight").action, ConversionAction::kUpcastFp32);
  EXPECT_EQ(kept_fp32_reason(net->running_scale).reason, KeepReason::kName);
  EXPECT_EQ(kept_fp32_reason(net->running_scale).rule, "running_scale");
  EXPECT_EQ(kept_fp32_reason(net->router_weight).reason, KeepReason::kTensorMark);
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec
