// Loading a model's state in two steps (sharded_state_dict.h): check, then apply once, into the
// tensors that were checked.
#include "mixprec/sharded_state_dict.h"

#include "support/error_message.h"

#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include <type_traits>

namespace mixprec {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using testing::error_of;

// Two parameters; replace() swaps one for a new tensor under the same name, as code that
// re-registers a parameter does (LibTorch's register_parameter refuses an existing name).
struct TwoTensors : torch::nn::Module {
  TwoTensors() {
    a = register_parameter("a", at::zeros({2, 3}));
    b = register_parameter("b", at::zeros({4}));
  }
  void replace_b() {
    b = at::zeros({4}).requires_grad_();
    parameters_["b"] = b;
  }
  at::Tensor a, b;
};

ShardedStateDict filled_state() {
  TwoTensors source;
  at::NoGradGuard no_grad;
  source.a.fill_(1);
  source.b.fill_(2);
  return model_sharded_state_dict(source);
}

static_assert(!std::is_copy_constructible_v<CheckedModelState>,
              "a copy could be applied after the original");

TEST(ModelState, ACheckedStateIsAppliedOnce) {
  TwoTensors model;
  CheckedModelState checked = check_model_sharded_state_dict(model, filled_state());
  CheckedModelState moved = std::move(checked);
  EXPECT_NE(error_of([&] { apply_model_state(model, std::move(checked)); }).find("applied already"),
            std::string::npos)
      << "the moved-from state";
  apply_model_state(model, std::move(moved));
  EXPECT_TRUE(at::equal(model.a, at::ones({2, 3})));
  EXPECT_NE(error_of([&] { apply_model_state(model, std::move(moved)); }).find("applied already"),
            std::string::npos);
}

// The check held the old tensor: applying would fill a tensor the model no longer has and leave
// the new one as it is. Refused, naming the tensor; nothing is written (not `a` either).
TEST(ModelState, AParameterReplacedSinceTheCheckIsNamedAndNothingIsWritten) {
  TwoTensors model;
  CheckedModelState checked = check_model_sharded_state_dict(model, filled_state());
  model.replace_b();
  const std::string message = error_of([&] { apply_model_state(model, std::move(checked)); });
  EXPECT_NE(message.find("'b'"), std::string::npos) << message;
  EXPECT_NE(message.find("no longer the tensor the state was checked against"), std::string::npos)
      << message;
  EXPECT_TRUE(at::equal(model.a, at::zeros({2, 3})));
  EXPECT_TRUE(at::equal(model.b, at::zeros({4})));
}

TEST(ModelState, ATensorThatChangedShapeSinceTheCheckIsNamed) {
  TwoTensors model;
  CheckedModelState checked = check_model_sharded_state_dict(model, filled_state());
  model.b.set_data(at::zeros({5}));
  const std::string message = error_of([&] { apply_model_state(model, std::move(checked)); });
  EXPECT_NE(message.find("'b'"), std::string::npos) << message;
  EXPECT_NE(message.find("changed shape to [5]"), std::string::npos) << message;
  EXPECT_TRUE(at::equal(model.a, at::zeros({2, 3})));
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec
