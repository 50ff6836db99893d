// The fused FP8 fake-quantization kernel against the ATen composition it replaces,
// dequantize_fp8(quantize_fp8(x, f), x's dtype), over every BF16 and FP16 input at scales
// spanning the whole exponent range, and a dense FP32 sweep (ties, subnormals, overflow of the
// scale, NaN/Inf, negative zero). Equality is bitwise for every non-NaN output; NaNs must sit at
// the same positions (their payloads differ between ATen's own vector and scalar code).
#include "mixprec/quant/fake_quant.h"

#include "../../src/optim/kernels/kernel_args.h"
#include "../../src/quant/kernels/fake_quant_fused.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/types.h>

#include <bit>
#include <cstdint>
#include <limits>
#include <sstream>
#include <vector>

namespace mixprec::quant {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

constexpr c10::ScalarType kFp8s[] = {at::kFloat8_e4m3fn, at::kFloat8_e5m2};

at::Tensor reference(const at::Tensor& x, c10::ScalarType fp8) {
  return dequantize_fp8(quantize_fp8(x, fp8), x.scalar_type());
}

// The bit patterns, as a same-sized integer tensor (a view for contiguous tensors).
at::Tensor bits_of(const at::Tensor& t) {
  return t.contiguous().view(t.element_size() == 2 ? at::kShort : at::kInt);
}

// Bitwise equal where the expected value is a number; NaN exactly where it is NaN.
::testing::AssertionResult same_values(const at::Tensor& x, const at::Tensor& actual,
                                       const at::Tensor& expected) {
  if (actual.scalar_type() != expected.scalar_type() || actual.sizes() != expected.sizes()) {
    return ::testing::AssertionFailure()
           << "got " << actual.scalar_type() << actual.sizes() << ", expected "
           << expected.scalar_type() << expected.sizes();
  }
  const at::Tensor a = actual.reshape(-1), e = expected.reshape(-1);
  const at::Tensor nan = e.isnan();
  const at::Tensor wrong = (nan != a.isnan()) | (~nan & (bits_of(a) != bits_of(e)));
  const int64_t count = wrong.sum().item<int64_t>();
  if (count == 0) return ::testing::AssertionSuccess();
  auto failure = ::testing::AssertionFailure();
  failure << count << " of " << a.numel() << " values differ, e.g.";
  const at::Tensor where = wrong.nonzero().reshape(-1).narrow(0, 0, std::min<int64_t>(count, 5));
  const at::Tensor in = bits_of(x.reshape(-1)), ab = bits_of(a), eb = bits_of(e);
  const int64_t mask = a.element_size() == 2 ? 0xFFFF : 0xFFFFFFFF;
  auto hex = [&](const at::Tensor& bits, int64_t i) {
    std::ostringstream s;
    s << "0x" << std::hex << (bits[i].item<int64_t>() & mask);
    return s.str();
  };
  for (int64_t k = 0; k < where.numel(); ++k) {
    const int64_t i = where[k].item<int64_t>();
    failure << "\n  [" << i << "] input " << hex(in, i) << " (" << x.reshape(-1)[i].item<double>()
            << ") expected " << hex(eb, i) << " got " << hex(ab, i);
  }
  return failure;
}

::testing::AssertionResult fused_matches(const at::Tensor& x, c10::ScalarType fp8) {
  return same_values(x, detail::fused_fake_quantize_fp8(x, fp8), reference(x, fp8));
}

// Every finite pattern of a 16-bit float format up to magnitude `amax_bits`, both signs (so
// the tensor's amax is that pattern's value), as a tensor of `dtype`.
at::Tensor patterns_up_to(int64_t amax_bits, c10::ScalarType dtype) {
  const at::Tensor magnitudes = at::arange(amax_bits + 1, at::kInt);
  return at::cat({magnitudes, magnitudes | 0x8000}).to(at::kShort).view(dtype);
}

// Amax patterns across the whole range of a 16-bit format: every exponent (subnormals too),
// each with the smallest, a middle and the largest mantissa and the one above the smallest.
std::vector<int64_t> amax_sweep(int mantissa_bits, int64_t largest_finite) {
  std::vector<int64_t> amaxes;
  const int64_t top = (int64_t{1} << mantissa_bits) - 1;
  for (int64_t exponent = 0; (exponent << mantissa_bits) <= largest_finite; ++exponent) {
    for (const int64_t m : {int64_t{0}, int64_t{1}, top / 3, top}) {
      const int64_t bits = (exponent << mantissa_bits) | m;
      if (bits > 0 && bits <= largest_finite) amaxes.push_back(bits);
    }
  }
  return amaxes;
}

void check_all_16bit_values(c10::ScalarType dtype, int mantissa_bits, int64_t inf_bits,
                            const std::vector<int64_t>& amaxes) {
  // Every pattern, NaNs included: amax is NaN, so the scale falls back to 1.
  const at::Tensor all = at::arange(65536, at::kInt).to(at::kShort).view(dtype);
  // Every non-NaN pattern: amax is Inf, the scale Inf, and every output NaN.
  const at::Tensor no_nan = patterns_up_to(inf_bits, dtype);
  for (const auto fp8 : kFp8s) {
    SCOPED_TRACE(c10::toString(fp8));
    EXPECT_TRUE(fused_matches(all, fp8));
    EXPECT_TRUE(fused_matches(no_nan, fp8));
    EXPECT_TRUE(detail::fused_fake_quantize_fp8(no_nan, fp8).isnan().all().item<bool>());
    for (const int64_t amax : amaxes) {
      const auto result = fused_matches(patterns_up_to(amax, dtype), fp8);
      EXPECT_TRUE(result) << "amax pattern 0x" << std::hex << amax;
      if (!result) break;
    }
  }
}

TEST(FusedFakeQuant, AllBFloat16ValuesAtScalesOverTheWholeRange) {
  const std::vector<int64_t> amaxes = amax_sweep(7, 0x7F7F);
  ASSERT_GT(amaxes.size(), 1000u);
  check_all_16bit_values(at::kBFloat16, 7, 0x7F80, amaxes);
}

TEST(FusedFakeQuant, AllFloat16ValuesAtScalesOverTheWholeRange) {
  const std::vector<int64_t> amaxes = amax_sweep(10, 0x7BFF);
  ASSERT_GT(amaxes.size(), 120u);
  check_all_16bit_values(at::kHalf, 10, 0x7C00, amaxes);
}

// The exact midpoints between neighbouring FP8 values (ties: round to the even code) and the
// floats just beside them, at power-of-two scales where x / scale is exact, with the
// format's largest value in the tensor to pin the scale.
at::Tensor fp8_ties(c10::ScalarType fp8, float scale) {
  const at::Tensor codes = at::arange(0, 0x7F, at::kInt).to(at::kByte).view(fp8);
  at::Tensor grid = codes.to(at::kFloat);
  grid = grid.masked_select(grid.isfinite());
  const at::Tensor lo = grid.narrow(0, 0, grid.numel() - 1),
                   hi = grid.narrow(0, 1, grid.numel() - 1);
  const at::Tensor mid = (lo + hi) / 2;  // exact: neighbours differ by one ulp of an FP8 value
  const float inf = std::numeric_limits<float>::infinity();
  const at::Tensor below = at::nextafter(mid, at::full_like(mid, -inf));
  const at::Tensor above = at::nextafter(mid, at::full_like(mid, inf));
  const at::Tensor pos = at::cat({mid, below, above, grid, at::full({1}, fp8_max(fp8))});
  return at::cat({pos, -pos}) * scale;
}

TEST(FusedFakeQuant, DenseFloat32Sweep) {
  // Every 4099th FP32 pattern up to +Inf (~520K magnitudes, each exponent ~128 times), both
  // signs, under amaxes from FP32's largest down to one that makes the scale underflow to 0.
  const at::Tensor magnitudes = at::arange(0, 0x7F800001, 4099, at::kLong).to(at::kInt);
  const at::Tensor sweep =
      at::cat({magnitudes, magnitudes | std::bit_cast<int32_t>(0x80000000u)}).view(at::kFloat);
  const at::Tensor finite = sweep.masked_select(sweep.isfinite());
  for (const auto fp8 : kFp8s) {
    SCOPED_TRACE(c10::toString(fp8));
    EXPECT_TRUE(fused_matches(sweep, fp8));  // holds ±Inf: all NaN
    for (const float amax :
         {std::numeric_limits<float>::max(), 1e30f, 57344.0f, 448.0f, 1.0f, 0.3f, 1e-20f, 1e-38f,
          1e-41f, 1e-44f, std::numeric_limits<float>::denorm_min()}) {
      const at::Tensor x = at::cat(
          {finite.masked_select(finite.abs() <= amax), at::full({1}, amax), at::full({1}, -0.0f)});
      EXPECT_TRUE(fused_matches(x, fp8)) << "amax " << amax;
    }
    for (const float scale : {1.0f, 0x1p-20f, 0x1p+40f, 0x1p-120f}) {
      EXPECT_TRUE(fused_matches(fp8_ties(fp8, scale), fp8)) << "ties at scale " << scale;
    }
    at::manual_seed(7);
    for (const double magnitude : {1e-30, 1e-3, 1.0, 1e5, 1e30}) {
      const at::Tensor x = at::randn({100003}) * magnitude;
      EXPECT_TRUE(fused_matches(x, fp8)) << "randn * " << magnitude;
      EXPECT_TRUE(fused_matches(x.to(at::kBFloat16), fp8)) << "randn * " << magnitude;
      EXPECT_TRUE(fused_matches(x.to(at::kHalf), fp8)) << "randn * " << magnitude;
    }
  }
}

// The semantics the sweeps cover, spelled out on small tensors.
TEST(FusedFakeQuant, SpecialValues) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (const auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    auto t = [&](std::vector<float> v) { return torch::tensor(v).to(dtype); };
    // amax 896: scale 2; 3.3 / 2 = 1.65 rounds to 1.625 (e4m3), -0 stays -0.
    at::Tensor y = detail::fused_fake_quantize_fp8(t({896, 3.3f, -0.0f, 0}), at::kFloat8_e4m3fn);
    EXPECT_TRUE(at::equal(y.to(at::kFloat), torch::tensor({896.0f, 3.25f, 0.0f, 0.0f})));
    EXPECT_TRUE(std::signbit(y[2].item<float>()));
    EXPECT_FALSE(std::signbit(y[3].item<float>()));
    // A NaN makes amax and the scale NaN: every value is NaN, as with an Inf below.
    y = detail::fused_fake_quantize_fp8(t({nan, 1000, 3.3f, -500}), at::kFloat8_e4m3fn);
    EXPECT_TRUE(y.isnan().all().item<bool>());
    // An Inf makes the scale Inf: 0 * Inf and Inf / Inf are NaN everywhere.
    y = detail::fused_fake_quantize_fp8(t({inf, 1, 0}), at::kFloat8_e5m2);
    EXPECT_TRUE(y.isnan().all().item<bool>());
    // All zeros: scale 1, zeros out (signs kept).
    y = detail::fused_fake_quantize_fp8(t({0, -0.0f}), at::kFloat8_e5m2);
    EXPECT_EQ(bits_of(y)[1].item<int64_t>(), dtype == at::kFloat ? INT32_MIN : INT16_MIN);
    for (const auto& x :
         {t({nan, 1000, 3.3f, -500}), t({inf, 1, 0}), t({0, -0.0f}), t({896, 3.3f, -0.0f, 0})}) {
      for (const auto fp8 : kFp8s) EXPECT_TRUE(fused_matches(x, fp8));
    }
  }
}

TEST(FusedFakeQuant, ShapesStridesAndTheDispatch) {
  at::manual_seed(11);
  const at::Tensor x = at::randn({67, 45}, at::kBFloat16);
  for (const auto fp8 : kFp8s) {
    // Non-contiguous, 0-dim, empty, lengths around the vector width and the thread grain.
    for (const at::Tensor& v : {x.t(), x.narrow(1, 3, 17), x[5][7], x.narrow(0, 0, 0),
                                at::randn({32 * 1024 + 5}), at::randn({13}, at::kHalf)}) {
      const at::Tensor y = detail::fused_fake_quantize_fp8(v, fp8);
      EXPECT_TRUE(same_values(v, y, reference(v, fp8)));
      EXPECT_TRUE(same_values(v, fake_quantize_fp8(v, fp8), reference(v, fp8)));
    }
    // Outside the fused kernel's dtypes fake_quantize_fp8 still computes the ATen composition.
    const at::Tensor d = at::randn({100}, at::kDouble);
    EXPECT_FALSE(detail::fused_fake_quant_supports(d));
    EXPECT_TRUE(at::equal(fake_quantize_fp8(d, fp8), reference(d, fp8)));
  }
  // The result is a fresh tensor outside autograd.
  const at::Tensor w = at::randn({8}).requires_grad_(true);
  EXPECT_FALSE(fake_quantize_fp8(w, at::kFloat8_e4m3fn).requires_grad());
  EXPECT_THROW(fake_quantize_fp8(torch::ones({2}, torch::kLong), at::kFloat8_e4m3fn), c10::Error);
  EXPECT_THROW(fake_quantize_fp8(torch::ones({2}), at::kHalf), c10::Error);
}

// The kernel reads raw memory, so views whose values are not their memory's must not reach it
// as they are: a negative view (its neg bit) is resolved first, a ZeroTensor (no memory at all)
// takes the ATen composition and comes back as zeros.
TEST(FusedFakeQuant, NegativeViewsAndZeroTensors) {
  at::manual_seed(12);
  for (const auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    const at::Tensor x = (at::randn({37, 41}) * 5).to(dtype);
    for (const at::Tensor& negative : {at::_neg_view(x), at::_neg_view(x.t())}) {
      ASSERT_TRUE(negative.is_neg());
      const at::Tensor values = negative.resolve_neg();  // same_values reads the bits
      const at::Tensor expected = reference(values, at::kFloat8_e4m3fn);
      EXPECT_TRUE(same_values(values, fake_quantize_fp8(negative, at::kFloat8_e4m3fn), expected));
      EXPECT_TRUE(same_values(values, detail::fused_fake_quantize_fp8(negative, at::kFloat8_e4m3fn),
                              expected));
    }
    const at::Tensor zeros = at::_efficientzerotensor({40000}, at::TensorOptions().dtype(dtype));
    ASSERT_TRUE(zeros._is_zerotensor());
    EXPECT_FALSE(detail::fused_fake_quant_supports(zeros));
    for (const auto fp8 : kFp8s) {
      const at::Tensor y = fake_quantize_fp8(zeros, fp8);
      EXPECT_EQ(y.scalar_type(), dtype);
      EXPECT_EQ(y.sizes(), zeros.sizes());
      EXPECT_TRUE(y.eq(0).all().item<bool>());
    }
  }
}

// Highway picks the kernel for the running CPU; every compiled target this CPU supports must
// give the same bits (a target that emulates an operation differently would show here).
TEST(FusedFakeQuant, EverySimdTargetAgrees) {
  const std::vector<std::string> targets = optim::detail::supported_simd_targets();
  ASSERT_FALSE(targets.empty());
  struct RestoreAutomaticTarget {
    ~RestoreAutomaticTarget() { optim::detail::force_simd_target(""); }
  } restore;
  at::manual_seed(5);
  const at::Tensor f32 = at::cat({at::randn({4099}) * 100, fp8_ties(at::kFloat8_e4m3fn, 0x1p-9f)});
  for (const auto& name : targets) {
    SCOPED_TRACE(name);
    optim::detail::force_simd_target(name);
    for (const auto fp8 : kFp8s) {
      EXPECT_TRUE(
          fused_matches(at::arange(65536, at::kInt).to(at::kShort).view(at::kBFloat16), fp8));
      EXPECT_TRUE(fused_matches(patterns_up_to(0x3C00, at::kHalf), fp8));  // amax 1.0
      EXPECT_TRUE(fused_matches(patterns_up_to(0x0200, at::kHalf), fp8));  // subnormal amax
      EXPECT_TRUE(fused_matches(patterns_up_to(0x3F80, at::kBFloat16), fp8));
      EXPECT_TRUE(fused_matches(f32, fp8));
    }
  }
}

// The kernel reads strided memory: a sparse tensor is not for it.
TEST(FusedFakeQuant, SparseTensorsAreNotSupported) {
  const at::Tensor dense = at::randn({4, 4});
  EXPECT_TRUE(detail::fused_fake_quant_supports(dense));
  EXPECT_FALSE(detail::fused_fake_quant_supports(dense.to_sparse()));
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::quant
