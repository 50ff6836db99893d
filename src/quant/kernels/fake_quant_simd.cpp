// FP8 fake quantization, compiled once per Highway target and selected at run time.
//
// Each element goes through exactly the steps of the ATen composition in fake_quant.cpp
// (widen to FP32, divide by the scale, clamp, round to FP8, decode, multiply by the scale,
// narrow), but in registers: one read and one write of the tensor instead of seven passes and
// six temporaries. The FP8 rounding reproduces c10's Float8_e4m3fn / Float8_e5m2 conversion
// without leaving FP32, with one trick for every magnitude v: (v + c) - c, where the FPU
// rounds v + c to nearest-even at c's ulp, and c is the power of two 2^(e + 20) (e4m3) /
// 2^(e + 21) (e5m2) for v in [2^e, 2^(e+1)), so that c's ulp is v's FP8 spacing: 3 / 2
// mantissa bits (the sum stays in c's binade, since v < 2^(e+1) is far below c). Below the
// smallest normal FP8 value (2^-6 / 2^-14) c stays at 2^14 / 2^7, whose ulp is the FP8
// subnormal spacing (2^-9 / 2^-16): that is c10's own subnormal rounding, and for normal
// values the result equals c10's integer rounding (add 0x7FFFF / 0xFFFFF plus the lowest kept
// bit, truncate), ties going to the even FP8 mantissa in both. The subtraction is exact. The
// sign is set afterwards (v - v would give +0 for -0). A NaN is encoded by c10 as 0x7F | sign,
// which decodes to FP32 0x7FF00000 / 0x7FE00000 with the sign kept.
// The clamp to ±fp8_max comes first, so the FP8 overflow rules (NaN for e4m3fn, Inf for
// e5m2) are never reached.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "quant/kernels/fake_quant_simd.cpp"
#include <hwy/foreach_target.h>  // must precede highway.h
#include <hwy/highway.h>

#include <algorithm>
#include <limits>
#include <type_traits>

#include "quant/kernels/fake_quant_args.h"

HWY_BEFORE_NAMESPACE();
namespace mixprec::quant::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Largest lane count of any float vector on this target: size of the zero-padded tail buffers.
inline constexpr size_t kMaxFloatLanes = HWY_LANES(float);

template <ElementFormat E>
using Element = std::conditional_t<E == ElementFormat::kF32, float, uint16_t>;

// fn(std::integral_constant<ElementFormat, E>{}) for the E equal to `format`.
template <class Fn>
decltype(auto) dispatch_element_format(ElementFormat format, Fn&& fn) {
  switch (format) {
    case ElementFormat::kBF16:
      return fn(std::integral_constant<ElementFormat, ElementFormat::kBF16>{});
    case ElementFormat::kF16:
      return fn(std::integral_constant<ElementFormat, ElementFormat::kF16>{});
    case ElementFormat::kF32:
      break;
  }
  return fn(std::integral_constant<ElementFormat, ElementFormat::kF32>{});
}

// Widening and narrowing in integer arithmetic, exact on every target (Highway 1.0.3's
// PromoteTo/DemoteTo for BF16 truncate, and for FP16 without F16C mishandle Inf/NaN and
// subnormals). Non-NaN results equal at::Tensor::to's bit for bit; a NaN becomes the NaN
// ATen's vectorized conversions write: 0xFFFF in BF16, and in FP16 the FP32 NaN's sign and top
// mantissa bits (what vcvtps2ph keeps).

// FP16 -> FP32: rebias normal exponents, map the all-ones exponent (Inf/NaN) to FP32's, and
// build subnormals as (2^-14 * 1.m) - 2^-14, an exact subtraction.
template <class DF>
HWY_INLINE hn::VFromD<DF> WidenF16(DF df, const uint16_t* p) {
  const hn::Rebind<uint16_t, DF> d16;
  const hn::RebindToUnsigned<DF> du;
  const auto h = hn::PromoteTo(du, hn::LoadU(d16, p));
  const auto sign = hn::ShiftLeft<16>(hn::And(h, hn::Set(du, 0x8000u)));
  const auto shifted = hn::ShiftLeft<13>(hn::And(h, hn::Set(du, 0x7FFFu)));
  const auto exponent = hn::And(shifted, hn::Set(du, 0x0F800000u));
  const auto normal = hn::Add(shifted, hn::Set(du, 112u << 23));
  const auto inf_nan = hn::Add(shifted, hn::Set(du, 224u << 23));
  const auto two_pow_m14 = hn::Set(df, 6.103515625e-05f);
  const auto subnormal = hn::BitCast(
      du, hn::Sub(hn::BitCast(df, hn::Add(shifted, hn::Set(du, 113u << 23))), two_pow_m14));
  auto magnitude = hn::IfThenElse(exponent == hn::Set(du, 0x0F800000u), inf_nan, normal);
  magnitude = hn::IfThenElse(exponent == hn::Zero(du), subnormal, magnitude);
  return hn::BitCast(df, hn::Or(magnitude, sign));
}

template <ElementFormat E, class DF>
HWY_INLINE hn::VFromD<DF> LoadAsFloat(DF df, const Element<E>* p) {
  if constexpr (E == ElementFormat::kF32) {
    return hn::LoadU(df, p);
  } else if constexpr (E == ElementFormat::kBF16) {
    const hn::Rebind<uint16_t, DF> d16;  // BF16 is the upper half of an FP32
    return hn::BitCast(
        df, hn::ShiftLeft<16>(hn::PromoteTo(hn::RebindToUnsigned<DF>(), hn::LoadU(d16, p))));
  } else {
    return WidenF16(df, p);
  }
}

// FP32 -> BF16 round-to-nearest-even: add 0x7FFF plus the lowest kept bit, drop 16 bits.
template <bool kMayBeNaN, class DF>
HWY_INLINE hn::VFromD<hn::RebindToUnsigned<DF>> NarrowBF16Bits(DF df, hn::VFromD<DF> v) {
  const hn::RebindToUnsigned<DF> du;
  const auto bits = hn::BitCast(du, v);
  const auto kept_lsb = hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 1u));
  const auto rounded = hn::ShiftRight<16>(hn::Add(hn::Add(bits, hn::Set(du, 0x7FFFu)), kept_lsb));
  if constexpr (!kMayBeNaN) return rounded;
  return hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(v)), hn::Set(du, 0xFFFFu), rounded);
}

// FP32 -> FP16 round-to-nearest-even, IEEE semantics: |x| >= 65520 -> Inf; normal range:
// integer rounding of the 13 dropped bits, exponent rebiased; |x| < 2^-14: adding 0.5f makes
// the FPU round |x| to a multiple of 2^-24 (0.5f's ulp), the FP16 subnormal grid.
template <class DF>
HWY_INLINE hn::VFromD<hn::RebindToUnsigned<DF>> NarrowF16Bits(DF df, hn::VFromD<DF> v) {
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const auto bits = hn::BitCast(du, v);
  const auto magnitude = hn::And(bits, hn::Set(du, 0x7FFFFFFFu));
  const auto sign = hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 0x8000u));
  const auto kept_lsb = hn::And(hn::ShiftRight<13>(magnitude), hn::Set(du, 1u));
  const auto normal =
      hn::Sub(hn::ShiftRight<13>(hn::Add(hn::Add(magnitude, hn::Set(du, 0x0FFFu)), kept_lsb)),
              hn::Set(du, 112u << 10));
  const auto subnormal =
      hn::Sub(hn::BitCast(du, hn::Add(hn::BitCast(df, magnitude), hn::Set(df, 0.5f))),
              hn::Set(du, 0x3F000000u));
  const auto nan = hn::Or(hn::Set(du, 0x7C00u),
                          hn::ShiftRight<13>(hn::And(magnitude, hn::Set(du, 0x007FFFFFu))));
  const auto m = hn::BitCast(di, magnitude);  // < 2^31: signed compares order it
  auto result = hn::IfThenElse(hn::RebindMask(du, m < hn::Set(di, 0x38800000)), subnormal, normal);
  result =
      hn::IfThenElse(hn::RebindMask(du, m > hn::Set(di, 0x477FEFFF)), hn::Set(du, 0x7C00u), result);
  result = hn::IfThenElse(hn::RebindMask(du, m > hn::Set(di, 0x7F800000)), nan, result);
  return hn::Or(result, sign);
}

template <ElementFormat E, bool kMayBeNaN, class DF>
HWY_INLINE void StoreFromFloat(DF df, hn::VFromD<DF> v, Element<E>* p) {
  if constexpr (E == ElementFormat::kF32) {
    hn::StoreU(v, df, p);
  } else {
    const hn::Rebind<uint16_t, DF> d16;
    const hn::RebindToSigned<DF> di;
    const auto bits =
        E == ElementFormat::kBF16 ? NarrowBF16Bits<kMayBeNaN>(df, v) : NarrowF16Bits(df, v);
    // Every lane is <= 0xFFFF, so the saturating narrowing is a plain truncation.
    hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, bits)), d16, p);
  }
}

namespace {

struct Fp8Grid {
  float max;                 // largest finite value
  uint32_t ulp_exponent;     // c's exponent above v's: 23 - the format's mantissa bits
  int32_t min_rounder_bits;  // FP32 bits of c at and below the smallest normal value
  uint32_t nan_bits;         // FP32 bits of the decoded NaN (0x7F), sign cleared
};

template <Fp8Format F>
constexpr Fp8Grid kGrid = F == Fp8Format::kE4M3 ? Fp8Grid{448.0f, 20, 141 << 23, 0x7FF00000u}
                                                : Fp8Grid{57344.0f, 21, 134 << 23, 0x7FE00000u};

// kMayBeNaN = false: the caller guarantees no lane becomes NaN (see fake_quant_args.h), and
// the NaN handling (a sixth of the kernel's operations) is left out.
template <Fp8Format F, bool kMayBeNaN, class DF>
HWY_INLINE hn::VFromD<DF> FakeQuantLanes(DF df, hn::VFromD<DF> x, hn::VFromD<DF> scale_inv) {
  constexpr Fp8Grid g = kGrid<F>;
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const auto scaled = hn::Div(x, scale_inv);
  // at::clamp propagates NaN; x86 min/max would replace it with the bound.
  const auto bounded = hn::Min(hn::Max(scaled, hn::Set(df, -g.max)), hn::Set(df, g.max));
  const auto clamped = kMayBeNaN ? hn::IfThenElse(hn::IsNaN(scaled), scaled, bounded) : bounded;

  const auto bits = hn::BitCast(du, clamped);
  const auto magnitude = hn::And(bits, hn::Set(du, 0x7FFFFFFFu));
  // c = 2^(e + ulp_exponent), at least the subnormal rounder. Finite magnitudes keep the sum
  // below 2^31, so the signed max orders it (a NaN's c is garbage, replaced below).
  const auto exponent = hn::And(bits, hn::Set(du, 0x7F800000u));
  const auto rounder =
      hn::BitCast(df, hn::Max(hn::BitCast(di, hn::Add(exponent, hn::Set(du, g.ulp_exponent << 23))),
                              hn::Set(di, g.min_rounder_bits)));
  auto rounded = hn::BitCast(du, hn::Sub(hn::Add(hn::BitCast(df, magnitude), rounder), rounder));
  if constexpr (kMayBeNaN) {
    rounded =
        hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(clamped)), hn::Set(du, g.nan_bits), rounded);
  }
  const auto sign = hn::And(bits, hn::Set(du, 0x80000000u));
  return hn::Mul(hn::BitCast(df, hn::Or(rounded, sign)), scale_inv);
}

template <ElementFormat E, Fp8Format F, bool kMayBeNaN>
void FakeQuantRange(const Element<E>* x, Element<E>* y, float scale_inv, size_t begin, size_t end) {
  const hn::ScalableTag<float> df;
  const size_t lanes = hn::Lanes(df);
  const auto s = hn::Set(df, scale_inv);
  size_t i = begin;
  for (; i + lanes <= end; i += lanes) {
    StoreFromFloat<E, kMayBeNaN>(df, FakeQuantLanes<F, kMayBeNaN>(df, LoadAsFloat<E>(df, x + i), s),
                                 y + i);
  }
  if (i == end) return;
  // The last, partial vector runs through the same code on a zero-padded copy.
  HWY_ALIGN Element<E> in[kMaxFloatLanes] = {};
  HWY_ALIGN Element<E> out[kMaxFloatLanes] = {};
  std::copy_n(x + i, end - i, in);
  StoreFromFloat<E, kMayBeNaN>(df, FakeQuantLanes<F, kMayBeNaN>(df, LoadAsFloat<E>(df, in), s),
                               out);
  std::copy_n(out, end - i, y + i);
}

// Max of the sign-cleared bit patterns, as unsigned integers of the element's own width.
template <ElementFormat E>
uint32_t AmaxBitsRange(const Element<E>* x, size_t begin, size_t end) {
  using Bits = std::conditional_t<E == ElementFormat::kF32, uint32_t, uint16_t>;
  const Bits* p = reinterpret_cast<const Bits*>(x);
  constexpr Bits kMagnitude = std::numeric_limits<Bits>::max() >> 1;  // sign bit cleared
  const hn::ScalableTag<Bits> d;
  const size_t lanes = hn::Lanes(d);
  const auto mask = hn::Set(d, kMagnitude);
  auto m0 = hn::Zero(d), m1 = hn::Zero(d);
  size_t i = begin;
  for (; i + 2 * lanes <= end; i += 2 * lanes) {
    m0 = hn::Max(m0, hn::And(hn::LoadU(d, p + i), mask));
    m1 = hn::Max(m1, hn::And(hn::LoadU(d, p + i + lanes), mask));
  }
  HWY_ALIGN Bits partial[HWY_LANES(Bits)] = {};
  hn::Store(hn::Max(m0, m1), d, partial);
  Bits result = 0;
  for (size_t k = 0; k < lanes; ++k) result = std::max(result, partial[k]);
  for (; i < end; ++i) result = std::max(result, static_cast<Bits>(p[i] & kMagnitude));
  return result;
}

}  // namespace

uint32_t AmaxBitsChunk(const void* x, ElementFormat format, int64_t begin, int64_t end) {
  return dispatch_element_format(format, [&](auto e) {
    return AmaxBitsRange<e>(static_cast<const Element<e>*>(x), static_cast<size_t>(begin),
                            static_cast<size_t>(end));
  });
}

void FakeQuantChunk(const void* x, void* y, ElementFormat format, Fp8Format fp8, float scale_inv,
                    bool nan_free, int64_t begin, int64_t end) {
  dispatch_element_format(format, [&](auto e) {
    const auto* in = static_cast<const Element<e>*>(x);
    auto* out = static_cast<Element<e>*>(y);
    const auto b = static_cast<size_t>(begin), n = static_cast<size_t>(end);
    auto run = [&](auto f, auto may_be_nan) {
      FakeQuantRange<e, decltype(f)::value, decltype(may_be_nan)::value>(in, out, scale_inv, b, n);
    };
    using E4M3 = std::integral_constant<Fp8Format, Fp8Format::kE4M3>;
    using E5M2 = std::integral_constant<Fp8Format, Fp8Format::kE5M2>;
    if (fp8 == Fp8Format::kE4M3) {
      nan_free ? run(E4M3{}, std::false_type{}) : run(E4M3{}, std::true_type{});
    } else {
      nan_free ? run(E5M2{}, std::false_type{}) : run(E5M2{}, std::true_type{});
    }
  });
}

}  // namespace mixprec::quant::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mixprec::quant::detail {

HWY_EXPORT(AmaxBitsChunk);
HWY_EXPORT(FakeQuantChunk);

uint32_t amax_bits_chunk(const void* x, ElementFormat format, int64_t begin, int64_t end) {
  return HWY_DYNAMIC_DISPATCH(AmaxBitsChunk)(x, format, begin, end);
}

void fake_quant_chunk(const void* x, void* y, ElementFormat format, Fp8Format fp8, float scale_inv,
                      bool nan_free, int64_t begin, int64_t end) {
  HWY_DYNAMIC_DISPATCH(FakeQuantChunk)(x, y, format, fp8, scale_inv, nan_free, begin, end);
}

}  // namespace mixprec::quant::detail
#endif  // HWY_ONCE
