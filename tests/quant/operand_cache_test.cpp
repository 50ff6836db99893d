#include "mixprec/quant/operand_cache.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>
#include <torch/types.h>

namespace mixprec::quant {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

const OperandRecipe kRecipe{QuantFormat::kFp8E4M3, at::kFloat};

// A cache whose compute() doubles the source and counts its calls.
struct Doubler {
  OperandCache cache;
  at::Tensor get(const at::Tensor& t, OperandRecipe recipe = kRecipe) {
    return cache.get({t}, recipe, [&] { return t * 2; });
  }
};

TEST(OperandCache, KeepsTheResultUntilTheSourceIsWritten) {
  Doubler d;
  at::Tensor w = torch::arange(6.0);
  const at::Tensor first = d.get(w);
  EXPECT_TRUE(d.get(w).is_same(first));
  EXPECT_EQ(d.cache.computations(), 1);
  // In place, through the tensor, a view of it, or under NoGradGuard: the version moves.
  w.add_(1);
  EXPECT_TRUE(at::equal(d.get(w), w * 2));
  w.narrow(0, 1, 2).zero_();
  EXPECT_TRUE(at::equal(d.get(w), w * 2));
  {
    at::NoGradGuard no_grad;
    w.copy_(torch::full({6}, 7.0));
  }
  EXPECT_TRUE(at::equal(d.get(w), torch::full({6}, 14.0)));
  EXPECT_EQ(d.cache.computations(), 4);
  EXPECT_TRUE(at::equal(d.get(w), torch::full({6}, 14.0)));
  EXPECT_EQ(d.cache.computations(), 4);
}

TEST(OperandCache, SetDataAnotherTensorOrRecipeRecomputes) {
  Doubler d;
  at::Tensor w = torch::arange(4.0);
  d.get(w);
  w.set_data(torch::ones({4}));  // no version bump: the storage changes
  EXPECT_TRUE(at::equal(d.get(w), torch::full({4}, 2.0)));
  w.set_data(torch::ones({2, 2}));  // the same values in another shape
  EXPECT_EQ(d.get(w).sizes(), w.sizes());
  at::Tensor other = w.clone();  // equal contents, another tensor
  d.get(other);
  d.get(other, {QuantFormat::kFp8Hybrid, at::kFloat});
  EXPECT_EQ(d.cache.computations(), 5);
  // A tensor built after the cached one was freed never passes for it.
  {
    at::Tensor gone = torch::arange(4.0);
    d.get(gone);
  }
  const at::Tensor fresh = torch::full({4}, 3.0);
  EXPECT_TRUE(at::equal(d.get(fresh), torch::full({4}, 6.0)));
  EXPECT_EQ(d.cache.computations(), 7);
}

TEST(OperandCache, EverySourceCounts) {
  OperandCache cache;
  at::Tensor a = torch::ones({3}), s = torch::tensor(2.0);
  auto get = [&] { return cache.get({a, s}, kRecipe, [&] { return a * s; }); };
  get();
  s.fill_(5.0);
  EXPECT_TRUE(at::equal(get(), torch::full({3}, 5.0)));
  get();
  EXPECT_EQ(cache.computations(), 2);
}

TEST(OperandCache, AWriteToTheResultIsNotServedAgain) {
  Doubler d;
  at::Tensor w = torch::arange(3.0);
  d.get(w).fill_(-1);  // against the contract, but must not stick
  EXPECT_TRUE(at::equal(d.get(w), w * 2));
  EXPECT_EQ(d.cache.computations(), 2);
}

TEST(OperandCache, InferenceModeAndInferenceTensors) {
  Doubler d;
  at::Tensor w = torch::arange(3.0);
  {
    c10::InferenceMode inference;
    const at::Tensor r = d.get(w);  // computed as a normal tensor, so it can be kept
    EXPECT_FALSE(r.is_inference());
    EXPECT_TRUE(d.get(w).is_same(r));
  }
  EXPECT_EQ(d.cache.computations(), 1);
  at::Tensor frozen;
  {
    c10::InferenceMode inference;
    frozen = torch::arange(3.0);
  }
  d.get(frozen);
  d.get(frozen);  // no version counter to trust: computed every time
  EXPECT_EQ(d.cache.computations(), 3);
}

TEST(OperandCache, ACopyStartsEmptyAndClearForgets) {
  Doubler d;
  at::Tensor w = torch::arange(3.0);
  d.get(w);
  Doubler copy{d.cache};
  copy.get(w);
  EXPECT_EQ(copy.cache.computations(), 1);  // nothing copied: it computed for itself
  d.cache.clear();
  d.get(w);
  EXPECT_EQ(d.cache.computations(), 2);
}

// A compute() that hands back an inference tensor (made before, outside the cache) is returned
// but not kept: it has no version counter to tell a later write to it.
TEST(OperandCache, AnInferenceResultIsReturnedButNotKept) {
  OperandCache cache;
  at::Tensor w = torch::arange(3.0);
  at::Tensor frozen;
  {
    c10::InferenceMode inference;
    frozen = torch::arange(3.0) * 2;
  }
  at::Tensor got;
  ASSERT_NO_THROW(got = cache.get({w}, kRecipe, [&] { return frozen; }));
  EXPECT_TRUE(got.is_same(frozen));
  cache.get({w}, kRecipe, [&] { return frozen; });
  EXPECT_EQ(cache.computations(), 2);
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::quant
