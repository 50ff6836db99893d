// Per-target (Highway) helpers shared by the SIMD kernels: widening BF16/FP16 gradients to
// FP32 and narrowing FP32 results to BF16/FP16 with round-to-nearest-even.
//
// Why not hn::DemoteTo/PromoteTo: in Highway 1.0.3 DemoteTo(bf16) truncates, and on targets
// without F16C (SSSE3, SSE4, EMU128) the FP16 conversions truncate, skip Inf/NaN and round
// overflow to garbage. The integer formulations below are exact on every target, so results
// do not depend on which target the CPU selects. Non-NaN outputs equal at::Tensor::to(kHalf /
// kBFloat16) bit for bit; NaN becomes a quiet NaN of the same sign (c10's scalar convention
// for FP16; ATen's vectorized BF16 path uses 0xFFFF, so callers compare NaN by class only).
//
// Re-included once per target by foreach_target.h; the guard below toggles accordingly.
#if defined(MIXPREC_OPTIM_KERNELS_SIMD_CONVERT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MIXPREC_OPTIM_KERNELS_SIMD_CONVERT_INL_H_
#undef MIXPREC_OPTIM_KERNELS_SIMD_CONVERT_INL_H_
#else
#define MIXPREC_OPTIM_KERNELS_SIMD_CONVERT_INL_H_
#endif

#include <hwy/highway.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "optim/kernels/kernel_args.h"

HWY_BEFORE_NAMESPACE();
namespace mixprec::optim::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Largest lane count of any float vector on this target: size of the zero-padded tail buffers.
inline constexpr size_t kMaxFloatLanes = HWY_LANES(float);

template <GradFormat G>
using GradElement = std::conditional_t<G == GradFormat::kF32, float, uint16_t>;

// BF16 is the upper half of an FP32: widening is a shift.
template <class DF>
HWY_INLINE hn::VFromD<DF> WidenBF16(DF df, const uint16_t* HWY_RESTRICT p) {
  const hn::Rebind<uint16_t, DF> d16;
  const hn::RebindToUnsigned<DF> du;
  return hn::BitCast(df, hn::ShiftLeft<16>(hn::PromoteTo(du, hn::LoadU(d16, p))));
}

// FP16 -> FP32, exact for every input: rebias normal exponents, map the all-ones exponent
// (Inf/NaN) to FP32's, and build subnormals as (2^-14 * 1.m) - 2^-14, an exact subtraction.
template <class DF>
HWY_INLINE hn::VFromD<DF> WidenF16(DF df, const uint16_t* HWY_RESTRICT p) {
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

template <GradFormat G, class DF>
HWY_INLINE hn::VFromD<DF> LoadGrad(DF df, const GradElement<G>* HWY_RESTRICT grad, size_t i) {
  if constexpr (G == GradFormat::kF32) {
    return hn::LoadU(df, grad + i);
  } else if constexpr (G == GradFormat::kBF16) {
    return WidenBF16(df, grad + i);
  } else {
    return WidenF16(df, grad + i);
  }
}

// FP32 -> BF16 round-to-nearest-even: add 0x7FFF plus the lowest kept bit, then drop 16 bits.
// A carry out of the mantissa correctly bumps the exponent (up to Inf).
template <class DF>
HWY_INLINE void NarrowBF16(DF df, hn::VFromD<DF> v, uint16_t* HWY_RESTRICT out) {
  const hn::Rebind<uint16_t, DF> d16;
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const auto bits = hn::BitCast(du, v);
  const auto kept_lsb = hn::And(hn::ShiftRight<16>(bits), hn::Set(du, 1u));
  const auto rounded = hn::ShiftRight<16>(hn::Add(hn::Add(bits, hn::Set(du, 0x7FFFu)), kept_lsb));
  const auto quiet_nan = hn::Or(hn::ShiftRight<16>(bits), hn::Set(du, 0x0040u));
  const auto result = hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(v)), quiet_nan, rounded);
  // Every lane is <= 0xFFFF, so the saturating narrowing is a plain truncation.
  hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, result)), d16, out);
}

// FP32 -> FP16 round-to-nearest-even, IEEE semantics (what F16C's vcvtps2ph does):
//   |x| >= 65520 (incl. Inf) -> Inf; normal range: integer rounding of the 13 dropped bits with
//   the exponent rebiased; |x| < 2^-14: adding 0.5f makes the FPU round |x| to a multiple of
//   2^-24 (0.5f's ulp), which is exactly the FP16 subnormal grid, so the sum's low mantissa
//   bits are the FP16 subnormal (1024 = smallest normal if it rounds up). Immune to DAZ/FTZ.
template <class DF>
HWY_INLINE void NarrowF16(DF df, hn::VFromD<DF> v, uint16_t* HWY_RESTRICT out) {
  const hn::Rebind<uint16_t, DF> d16;
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
  // Magnitudes are < 2^31, so signed compares order them correctly on every target.
  const auto m = hn::BitCast(di, magnitude);
  auto result = hn::IfThenElse(hn::RebindMask(du, m < hn::Set(di, 0x38800000)), subnormal, normal);
  result =
      hn::IfThenElse(hn::RebindMask(du, m > hn::Set(di, 0x477FEFFF)), hn::Set(du, 0x7C00u), result);
  result =
      hn::IfThenElse(hn::RebindMask(du, m > hn::Set(di, 0x7F800000)), hn::Set(du, 0x7E00u), result);
  hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, hn::Or(result, sign))), d16, out);
}

template <ModelFormat M, class DF>
HWY_INLINE void StoreModel(DF df, hn::VFromD<DF> v, uint16_t* HWY_RESTRICT model, size_t i) {
  if constexpr (M == ModelFormat::kBF16) {
    NarrowBF16(df, v, model + i);
  } else if constexpr (M == ModelFormat::kF16) {
    NarrowF16(df, v, model + i);
  }
}

// Master remainders (format and proofs: mixprec/optim/master_remainder.h). With b the BF16
// param and r the int16 remainder, w = (b << 16) | (r & 0xFFFF):
//   join:  master = w - ((w & 0x8000) << 1)   i.e. (b << 16) + r: r < 0 undoes a round-up
//          master = w                         when b is NaN (r is the low half as is)
//   split: b = (master + 0x8000) >> 16        round half up in the bits (carries into the
//                                             exponent, up to Inf, as RNE's do)
//          b = (master >> 16) | 0x0040        when master is NaN (quiet, sign kept)
//          r = master & 0xFFFF
template <class DF>
HWY_INLINE hn::VFromD<DF> JoinMaster(DF df, const uint16_t* HWY_RESTRICT param,
                                     const int16_t* HWY_RESTRICT remainder) {
  const hn::Rebind<uint16_t, DF> d16;
  const hn::Rebind<int16_t, DF> di16;
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const auto high = hn::ShiftLeft<16>(hn::PromoteTo(du, hn::LoadU(d16, param)));
  const auto low = hn::PromoteTo(di, hn::LoadU(di16, remainder));  // sign-extended
  const auto offset = hn::Add(hn::BitCast(di, high), low);
  const auto raw = hn::Or(high, hn::And(hn::BitCast(du, low), hn::Set(du, 0xFFFFu)));
  // `high` has a zero low half: it is NaN exactly when the BF16 param is.
  const auto is_nan = hn::RebindMask(du, hn::IsNaN(hn::BitCast(df, high)));
  return hn::BitCast(df, hn::IfThenElse(is_nan, raw, hn::BitCast(du, offset)));
}

template <class DF>
HWY_INLINE void SplitMaster(DF df, hn::VFromD<DF> master, uint16_t* HWY_RESTRICT param,
                            int16_t* HWY_RESTRICT remainder) {
  const hn::Rebind<uint16_t, DF> d16;
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const auto bits = hn::BitCast(du, master);
  const auto rounded = hn::ShiftRight<16>(hn::Add(bits, hn::Set(du, 0x8000u)));
  const auto quiet_nan = hn::Or(hn::ShiftRight<16>(bits), hn::Set(du, 0x0040u));
  const auto high = hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(master)), quiet_nan, rounded);
  const auto low = hn::And(bits, hn::Set(du, 0xFFFFu));
  // Every lane is <= 0xFFFF, so the saturating narrowing is a plain truncation. The remainder
  // is stored through its unsigned alias: the same 16 bits.
  hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, high)), d16, param);
  hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, low)), d16, reinterpret_cast<uint16_t*>(remainder));
}

// The FP32 master of elements [i, i + Lanes(df)) of a parameter held as ParamStreams in
// format M, and its write-back (master, and the model param derived from it).
template <ModelFormat M, class DF>
HWY_INLINE hn::VFromD<DF> LoadMaster(DF df, const float* HWY_RESTRICT param,
                                     const uint16_t* HWY_RESTRICT model,
                                     const int16_t* HWY_RESTRICT remainder, size_t i) {
  if constexpr (M == ModelFormat::kBF16Remainder) {
    return JoinMaster(df, model + i, remainder + i);
  } else {
    return hn::LoadU(df, param + i);
  }
}

template <ModelFormat M, class DF>
HWY_INLINE void StoreMaster(DF df, hn::VFromD<DF> master, float* HWY_RESTRICT param,
                            uint16_t* HWY_RESTRICT model, int16_t* HWY_RESTRICT remainder,
                            size_t i) {
  if constexpr (M == ModelFormat::kBF16Remainder) {
    SplitMaster(df, master, model + i, remainder + i);
  } else {
    hn::StoreU(master, df, param + i);
    StoreModel<M>(df, master, model, i);
  }
}

// Zero-padded copies of the parameter's streams (in format M) and the gradient for the last,
// partial vector of a range: the kernels run it through their vector code, so a tail element
// is computed exactly like any other (no separate scalar formula to drift).
template <GradFormat G, ModelFormat M>
struct TailCopies {
  HWY_ALIGN float param[kMaxFloatLanes] = {};
  HWY_ALIGN uint16_t model[kMaxFloatLanes] = {};
  HWY_ALIGN int16_t remainder[kMaxFloatLanes] = {};
  HWY_ALIGN GradElement<G> grad[kMaxFloatLanes] = {};

  // Copies in what the kernel reads: the master's streams and the gradient.
  void load(const float* src_param, const uint16_t* src_model, const int16_t* src_remainder,
            const GradElement<G>* src_grad, size_t i, size_t n) {
    if constexpr (M == ModelFormat::kBF16Remainder) {
      std::copy_n(src_model + i, n, model);
      std::copy_n(src_remainder + i, n, remainder);
    } else {
      std::copy_n(src_param + i, n, param);
    }
    std::copy_n(src_grad + i, n, grad);
  }
  // Copies out what the kernel wrote.
  void store(float* dst_param, uint16_t* dst_model, int16_t* dst_remainder, size_t i,
             size_t n) const {
    if constexpr (M == ModelFormat::kBF16Remainder) {
      std::copy_n(remainder, n, dst_remainder + i);
    } else {
      std::copy_n(param, n, dst_param + i);
    }
    if constexpr (M != ModelFormat::kNone) std::copy_n(model, n, dst_model + i);
  }
};

// at::maximum semantics: NaN in either operand propagates (x86 max would drop one of them).
template <class V>
HWY_INLINE V NanPropagatingMax(V a, V b) {
  return hn::IfThenElse(hn::IsNaN(a), a, hn::IfThenElse(hn::IsNaN(b), b, hn::Max(a, b)));
}

}  // namespace mixprec::optim::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
