#include "mixprec/precision/float16_module.h"
#include "mixprec/sharded_state_dict.h"

#include "support/error_message.h"
#include "support/toy_net.h"

#include <gtest/gtest.h>
#include <torch/serialize.h>

#include <sstream>

namespace mixprec {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using testing::ToyNet;

// Records the dtypes its forward saw; returns its input scaled, in the half dtype.
struct ProbeImpl : torch::nn::Module {
  ProbeImpl() { weight = register_parameter("weight", torch::ones({4})); }
  at::Tensor forward(const at::Tensor& x) {
    seen.push_back(x.scalar_type());
    return x.to(weight.scalar_type()) * weight;
  }
  at::Tensor weight;
  std::vector<c10::ScalarType> seen;
};

using Pair = std::tuple<at::Tensor, std::vector<at::Tensor>>;

struct NestedImpl : torch::nn::Module {
  NestedImpl() { scale = register_parameter("scale", torch::ones({2})); }
  // (tensor, [tensors]) and integer ids -> (tensor, [tensors])
  Pair forward(Pair in, at::Tensor ids) {
    seen.push_back(std::get<0>(in).scalar_type());
    for (auto& t : std::get<1>(in)) seen.push_back(t.scalar_type());
    seen.push_back(ids.scalar_type());
    std::vector<at::Tensor> outs;
    for (auto& t : std::get<1>(in)) outs.push_back(t * scale);
    return {std::get<0>(in) * scale, outs};
  }
  at::Tensor scale;
  std::vector<c10::ScalarType> seen;
};

TEST(Float16Module, ConvertsWithPlanAndCastsInputsAndOutputs) {
  ToyNet net;
  Float16Module wrapped(net,
                        Float16ModuleOptions().plan(PrecisionPlan().keep_fp32_pattern("*norm*")));
  EXPECT_EQ(net->fc->weight.scalar_type(), at::kBFloat16);
  EXPECT_EQ(net->norm->weight.scalar_type(), at::kFloat);
  EXPECT_EQ(net->router_weight.scalar_type(), at::kFloat);
  EXPECT_EQ(wrapped->conversion_report().count(ConversionAction::kKeptFp32), 4);
  at::Tensor out = wrapped->forward(torch::randn({3, 8}));
  EXPECT_EQ(out.scalar_type(), at::kFloat);
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{3, 4}));
}

TEST(Float16Module, FirstStageCastsFp32InputsLastStageUpcastsOutputs) {
  auto probe = std::make_shared<ProbeImpl>();
  Float16Module wrapped(probe, Float16ModuleOptions().dtype(at::kHalf));
  at::Tensor out = wrapped->forward(torch::randn({4}));
  EXPECT_EQ(probe->seen.back(), at::kHalf);
  EXPECT_EQ(out.scalar_type(), at::kFloat);
  // Float64 inputs are not FP32: left as they are (as Megatron does).
  wrapped->forward(torch::randn({4}, torch::kDouble));
  EXPECT_EQ(probe->seen.back(), at::kDouble);
}

TEST(Float16Module, Fp32OutputFalseKeepsHalfOutputs) {
  auto probe = std::make_shared<ProbeImpl>();
  Float16Module wrapped(probe, Float16ModuleOptions().fp32_output(false));
  EXPECT_EQ(wrapped->forward(torch::randn({4})).scalar_type(), at::kBFloat16);
}

TEST(Float16Module, MiddleStageTouchesNeitherInputsNorOutputs) {
  auto probe = std::make_shared<ProbeImpl>();
  Float16Module wrapped(probe, Float16ModuleOptions().is_first_stage(false).is_last_stage(false));
  at::Tensor out = wrapped->forward(torch::randn({4}));
  EXPECT_EQ(probe->seen.back(), at::kFloat);
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);
}

TEST(Float16Module, NestedContainersAndNonFloatingInputs) {
  auto nested = std::make_shared<NestedImpl>();
  Float16Module wrapped(nested);
  Pair in{torch::randn({2}), {torch::randn({2}), torch::randn({2})}};
  at::Tensor ids = torch::arange(2);
  Pair out = wrapped->forward<Pair>(in, ids);
  EXPECT_EQ(nested->seen,
            (std::vector<c10::ScalarType>{at::kBFloat16, at::kBFloat16, at::kBFloat16, at::kLong}));
  EXPECT_EQ(std::get<0>(out).scalar_type(), at::kFloat);
  ASSERT_EQ(std::get<1>(out).size(), 2u);
  EXPECT_EQ(std::get<1>(out)[1].scalar_type(), at::kFloat);
  EXPECT_EQ(ids.scalar_type(), at::kLong);
}

TEST(Float16Module, StateHasNoWrapperPrefix) {
  ToyNet net;
  auto names_before = net->named_parameters().keys();
  auto buffers_before = net->named_buffers().keys();
  Float16Module wrapped(net);
  EXPECT_EQ(wrapped->named_parameters().keys(), names_before);
  EXPECT_EQ(wrapped->named_buffers().keys(), buffers_before);
  EXPECT_TRUE(wrapped->named_parameters()["fc.weight"].is_same(net->fc->weight));

  // An archive of the wrapper loads into a bare module of the same precision plan.
  std::stringstream archive;
  torch::save(wrapped, archive);
  ToyNet bare;
  convert_module_to_dtype_except_fp32_marked(*bare, at::kBFloat16);
  torch::load(bare, archive);
  EXPECT_TRUE(torch::equal(bare->fc->weight, net->fc->weight));
  EXPECT_TRUE(torch::equal(bare->router_weight, net->router_weight));
}

// The wrapper adopts the wrapped module's tensors at construction. One registered on the
// wrapped module afterwards would run in forward but be missing from the wrapper's parameters
// and archives (an optimizer or checkpoint of the wrapper would silently leave it out):
// forward, save and load name it instead.
TEST(Float16Module, ARegistrationOnTheWrappedModuleAfterWrappingIsNamed) {
  using mixprec::testing::error_of;
  ToyNet net;
  Float16Module wrapped(net);
  net->register_module("extra", torch::nn::Linear(8, 8));
  std::string msg = error_of([&] { wrapped->forward(torch::randn({3, 8})); });
  EXPECT_NE(msg.find("[mixprec::Float16Module::forward] the wrapped module"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("submodule 'extra' (extra.weight, extra.bias) was registered after "
                     "wrapping"),
            std::string::npos)
      << msg;
  std::stringstream archive;
  msg = error_of([&] { torch::save(wrapped, archive); });
  EXPECT_NE(msg.find("[mixprec::Float16Module::save]"), std::string::npos) << msg;

  ToyNet other;
  Float16Module wrapped_other(other);
  other->register_parameter("late", torch::randn({2}));
  other->register_buffer("late_buffer", torch::randn({2}));
  msg = error_of([&] { wrapped_other->forward(torch::randn({3, 8})); });
  EXPECT_NE(msg.find("parameter 'late' was registered"), std::string::npos) << msg;
  EXPECT_NE(msg.find("buffer 'late_buffer' was registered"), std::string::npos) << msg;
  std::stringstream saved;
  torch::save(Float16Module(ToyNet()), saved);
  msg = error_of([&] { torch::load(wrapped_other, saved); });
  EXPECT_NE(msg.find("[mixprec::Float16Module::load]"), std::string::npos) << msg;

  // A submodule replaced on the wrapped module is named too.
  ToyNet third;
  Float16Module wrapped_third(third);
  third->replace_module("fc", torch::nn::Linear(8, 8));
  msg = error_of([&] { wrapped_third->forward(torch::randn({3, 8})); });
  EXPECT_NE(msg.find("submodule 'fc' was replaced after wrapping"), std::string::npos) << msg;
}

// A module that registers a buffer in its first forward: the wrapper would never hold it.
struct LazyBufferImpl : torch::nn::Module {
  LazyBufferImpl() { fc = register_module("fc", torch::nn::Linear(8, 8)); }
  at::Tensor forward(const at::Tensor& x) {
    if (named_buffers(/*recurse=*/false).is_empty()) register_buffer("cache", x.detach().clone());
    return fc->forward(x);
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(LazyBuffer);

// The checks run where the state is taken too: mixprec's model state dict of the wrapper (or of
// a model holding it), and the first forward that registers a tensor lazily.
TEST(Float16Module, ARegistrationAfterWrappingIsNamedByTheStateDictAndTheSameForward) {
  using mixprec::testing::error_of;
  ToyNet net;
  Float16Module wrapped(net);
  net->register_buffer("late_buffer", torch::randn({2}));
  std::string msg = error_of([&] { model_sharded_state_dict(*wrapped); });
  EXPECT_NE(msg.find("[mixprec::Float16Module::model_sharded_state_dict]"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("buffer 'late_buffer' was registered"), std::string::npos) << msg;
  torch::nn::Module outer;  // a model holding the wrapper, not owned by a shared_ptr
  outer.register_module("wrapped", wrapped);
  msg = error_of([&] { model_sharded_state_dict(outer); });
  EXPECT_NE(msg.find("buffer 'late_buffer' was registered"), std::string::npos) << msg;
  msg = error_of([&] { check_model_sharded_state_dict(*wrapped, ShardedStateDict(), {}); });
  EXPECT_NE(msg.find("buffer 'late_buffer' was registered"), std::string::npos) << msg;

  Float16Module lazy(LazyBuffer{});
  msg = error_of([&] { lazy->forward(torch::randn({3, 8})); });
  EXPECT_NE(msg.find("buffer 'cache' was registered after wrapping"), std::string::npos) << msg;
}

// Registered deeper, on a submodule the wrapper holds too, a tensor is seen by the wrapper.
TEST(Float16Module, ARegistrationOnASubmoduleIsSeen) {
  ToyNet net;
  Float16Module wrapped(net);
  net->fc->register_parameter("late", torch::randn({2}));
  EXPECT_TRUE(wrapped->named_parameters().contains("fc.late"));
  EXPECT_NO_THROW(wrapped->forward(torch::randn({3, 8})));
}

TEST(Float16Module, TrainEvalReachesTheWrappedModule) {
  ToyNet net;
  Float16Module wrapped(net);
  wrapped->eval();
  EXPECT_FALSE(net->is_training());
  EXPECT_FALSE(net->fc->is_training());
  wrapped->train();
  EXPECT_TRUE(net->is_training());
}

TEST(Float16Module, BadDtypeIsAnErrorAndChangesNothing) {
  ToyNet net;
  EXPECT_THROW(Float16Module(net, Float16ModuleOptions().dtype(at::kFloat)), c10::Error);
  EXPECT_EQ(net->fc->weight.scalar_type(), at::kFloat);
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec
