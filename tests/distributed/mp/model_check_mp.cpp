// A rank whose model differs is an error on every rank, naming the first differing parameter,
// before any gradient collective: never a hang, never a silent mismatch.
#include "distributed/mp/mp_support.h"
#include "mixprec/distributed/grad_reducer.h"
#include "mixprec/distributed/model_check.h"
#include "support/error_message.h"

#include <gtest/gtest.h>

namespace mixprec::testing {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

// "pre_weight" [3, 4] BF16, "b" [5] FP32, "c" [2] BF16, buffer "stat" [2] FP32; the last rank
// may change one thing.
struct SmallImpl : torch::nn::Module {
  SmallImpl(const std::string& what, bool deviant) {
    a = register_parameter(deviant && what == "name" ? "pre_weight2" : "pre_weight",
                           at::zeros({3, 4}, at::kBFloat16));
    b = register_parameter("b", at::zeros({deviant && what == "shape" ? 6 : 5},
                                          deviant && what == "dtype" ? at::kHalf : at::kFloat));
    c = register_parameter("c", at::zeros({2}, at::kBFloat16));
    if (deviant && what == "frozen") c.set_requires_grad(false);
    if (deviant && what == "extra") register_parameter("d", at::zeros({1}));
    // Tying: the last rank registers `c` a second time, the others a tensor of its own.
    register_parameter("c_again", deviant && what == "tying" ? c : at::zeros({2}, at::kBFloat16));
    register_buffer("stat", at::zeros({deviant && what == "buffer" ? 3 : 2}));
    // The same shape and values, laid out transposed: GradReducer refuses it on that rank alone.
    if (deviant && what == "contiguity") a.set_data(at::zeros({4, 3}, at::kBFloat16).t());
  }
  at::Tensor a, b, c;
};
TORCH_MODULE(Small);

TEST(ModelCheck, DifferingRankIsAnErrorOnEveryRankNamingTheParameter) {
  const int n = world().size();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  const bool deviant = world().rank() == n - 1;
  const std::string last = std::to_string(n - 1);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"name", "'pre_weight' only on rank 0; 'pre_weight2' only on rank " + last},
      {"shape", "'b' differs: rank 0 has 'b Float [5] trainable', rank " + last +
                    " has 'b Float [6] trainable'"},
      {"dtype", "'b' differs"},
      {"frozen", "'c' differs"},
      // An extra parameter is named, not the first one by position.
      {"extra", "'d' only on rank " + last},
      {"tying", "'c_again' differs: rank 0 has 'c_again BFloat16 [2] trainable', rank " + last +
                    " has 'c_again BFloat16 [2] trainable tied to 'c''"},
      {"buffer", "'buffer stat' differs"},
      {"contiguity",
       "'pre_weight' differs: rank 0 has 'pre_weight BFloat16 [3, 4] trainable', rank " + last +
           " has 'pre_weight BFloat16 [3, 4] non-contiguous trainable'"},
  };
  for (const auto& [what, expected] : cases) {
    Small model(what, deviant);
    const std::string message =
        error_of([&] { distributed::GradReducer reducer(world_ptr(), *model); });
    EXPECT_NE(message.find("the ranks hold different models: " + expected), std::string::npos)
        << what << ": " << message;
    world().barrier();  // every rank is still in step: an error, never a hang
  }
}

TEST(ModelCheck, SameModelPasses) {
  Small model("none", false);
  distributed::check_same_model(world(), *model);
  EXPECT_EQ(distributed::model_description(*model),
            "pre_weight BFloat16 [3, 4] trainable\nb Float [5] trainable\nc BFloat16 [2] "
            "trainable\nc_again BFloat16 [2] trainable\nbuffer stat Float [2]\n");
}

// The same parameters registered in another order on the last rank: every rank names the
// first position where the order differs.
TEST(ModelCheck, TheSameTensorsInAnotherOrderAreNamedByPosition) {
  const int n = world().size();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  const bool deviant = world().rank() == n - 1;
  torch::nn::Module model;
  for (const char* name : deviant ? std::vector<const char*>{"w", "v", "u"}
                                  : std::vector<const char*>{"w", "u", "v"}) {
    model.register_parameter(name, at::zeros({2}));
  }
  const std::string message = error_of([&] { distributed::check_same_model(world(), model); });
  EXPECT_NE(message.find("the same tensors registered in another order: position 1 is 'u' on "
                         "rank 0, 'v' on rank " +
                         std::to_string(n - 1)),
            std::string::npos)
      << message;
  world().barrier();
}

// Without the broadcast from rank 0, buffers must hold the same values too: one that differs
// on some rank is named, on every rank.
TEST(ModelCheck, ABufferWithOtherValuesIsNamed) {
  const int n = world().size();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  Small model("none", false);
  if (world().rank() == n - 1) model->named_buffers()["stat"].fill_(1);
  distributed::check_same_model(world(), *model);
  const std::string message = error_of([&] { distributed::check_same_values(world(), *model); });
  EXPECT_NE(message.find("'buffer stat' holds other values on rank " + std::to_string(n - 1) +
                         " than on rank 0"),
            std::string::npos)
      << message;
  world().barrier();
}

// Names one rank lacks are listed, the first five by name and the rest counted.
TEST(ModelCheck, ManyMissingNamesAreListedFiveByNameThenCounted) {
  const int n = world().size();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  torch::nn::Module model;
  model.register_parameter("w", at::zeros({2}));
  if (world().rank() == n - 1) {
    for (int i = 0; i < 7; ++i) model.register_parameter("x" + std::to_string(i), at::zeros({1}));
  }
  const std::string message = error_of([&] { distributed::check_same_model(world(), model); });
  EXPECT_NE(
      message.find("'x0', 'x1', 'x2', 'x3', 'x4' and 2 more only on rank " + std::to_string(n - 1)),
      std::string::npos)
      << message;
  world().barrier();
}

// A one-element parameter holding another value on some rank is named as any other.
TEST(ModelCheck, AOneElementParameterWithAnotherValueIsNamed) {
  const int n = world().size();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  torch::nn::Module model;
  model.register_parameter("w", at::zeros({3}));
  model.register_parameter("s", at::full({1}, world().rank() == n - 1 ? 1.0 : 0.0));
  distributed::check_same_model(world(), model);
  const std::string message = error_of([&] { distributed::check_same_values(world(), model); });
  EXPECT_NE(
      message.find("'s' holds other values on rank " + std::to_string(n - 1) + " than on rank 0"),
      std::string::npos)
      << message;
  world().barrier();
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::testing
