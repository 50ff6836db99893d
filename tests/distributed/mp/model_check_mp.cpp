// A rank whose model differs is an error on every rank, naming the first differing parameter,
// before any gradient collective: never a hang, never a silent mismatch.
#include "distributed/mp/mp_support.h"
#include "mixprec/distributed/grad_reducer.h"
#include "mixprec/distributed/model_check.h"
#include "support/error_message.h"

#include <gtest/gtest.h>

namespace mixprec::testing {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

// "a" [3, 4] BF16, "b" [5] FP32, "c" [2] BF16; the last rank may change one thing.
struct SmallImpl : torch::nn::Module {
  SmallImpl(const std::string& what, bool deviant) {
    a = register_parameter(deviant && what == "name" ? "a2" : "a",
                           at::zeros({3, 4}, at::kBFloat16));
    b = register_parameter("b", at::zeros({deviant && what == "shape" ? 6 : 5},
                                          deviant && what == "dtype" ? at::kHalf : at::kFloat));
    c = register_parameter("c", at::zeros({2}, at::kBFloat16));
    if (deviant && what == "frozen") c.set_requires_grad(false);
    if (deviant && what == "extra") register_parameter("d", at::zeros({1}));
  }
  at::Tensor a, b, c;
};
TORCH_MODULE(Small);

TEST(ModelCheck, DifferingRankIsAnErrorOnEveryRankNamingTheParameter) {
  const int n = world().size();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  const bool deviant = world().rank() == n - 1;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"name", "first difference at parameter 'a'"},
      {"shape",
       "first difference at parameter 'b' (position 1): rank 0 has 'b Float [5] "
       "trainable', rank " +
           std::to_string(n - 1) + " has 'b Float [6] trainable'"},
      {"dtype", "first difference at parameter 'b'"},
      {"frozen", "first difference at parameter 'c'"},
      {"extra", "first difference at parameter 'd' (position 3): rank 0 has nothing"},
  };
  for (const auto& [what, expected] : cases) {
    Small model(what, deviant);
    const std::string message =
        error_of([&] { distributed::GradReducer reducer(world_ptr(), *model); });
    EXPECT_NE(message.find(expected), std::string::npos) << what << ": " << message;
    world().barrier();  // every rank is still in step
  }
}

TEST(ModelCheck, SameModelPasses) {
  Small model("none", false);
  distributed::check_same_model(world(), *model);
  EXPECT_EQ(distributed::model_description(*model),
            "a BFloat16 [3, 4] trainable\nb Float [5] trainable\nc BFloat16 [2] trainable\n");
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::testing
