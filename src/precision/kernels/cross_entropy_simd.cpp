// Cross-entropy rows, compiled once per Highway target and selected at run time.
//
// Each row is widened to FP32 in registers (the optimizer kernels' exact conversions,
// optim/kernels/simd_convert-inl.h), reduced to its maximum, then to its sum of exp(x - max):
// two reads of a row that stays in cache, against LibTorch's cast and log-softmax, which write
// two FP32 copies of the whole batch. Backward reads the row once and writes the gradient.
// exp is Highway's (1 ulp); an argument of -Inf (a logit of -Inf, or padding) is passed as
// -FLT_MAX, inside its valid range, and gives 0. A row with a NaN or +Inf is NaN throughout,
// found by its own check (Highway's Exp does not promise to propagate NaN).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "precision/kernels/cross_entropy_simd.cpp"
#include <hwy/foreach_target.h>  // must precede highway.h
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "optim/kernels/format_dispatch.h"
#include "optim/kernels/simd_convert-inl.h"
#include "precision/kernels/cross_entropy_args.h"

// After the project's per-target headers: included before them, foreach_target.h compiled
// the AVX3 pass twice (Highway 1.0.3).
#include <hwy/contrib/math/math-inl.h>

HWY_BEFORE_NAMESPACE();
namespace mixprec::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
namespace convert = mixprec::optim::detail::HWY_NAMESPACE;
using optim::detail::GradFormat;

template <GradFormat G>
using Element = convert::GradElement<G>;

using DF = hn::ScalableTag<float>;

// Elements [0, n) of p (n < lanes) as FP32, the other lanes `fill`.
template <GradFormat G>
HWY_INLINE hn::VFromD<DF> LoadPart(DF df, const Element<G>* p, size_t n, float fill) {
  HWY_ALIGN Element<G> part[convert::kMaxFloatLanes] = {};
  std::copy_n(p, n, part);
  return hn::IfThenElse(hn::FirstN(df, n), convert::LoadGrad<G>(df, part, 0), hn::Set(df, fill));
}

// exp(v) for v <= 0: -Inf goes in as -FLT_MAX (Highway's Exp is defined from there up). Not for
// NaN, which Highway's Exp turns into 0: NaN rows never get here (ForwardRow, BackwardRow).
HWY_INLINE hn::VFromD<DF> ExpOfNonPositive(DF df, hn::VFromD<DF> v) {
  const auto lowest = hn::Set(df, std::numeric_limits<float>::lowest());
  return hn::Exp(df, hn::IfThenElse(hn::Lt(v, lowest), lowest, v));
}

template <GradFormat G>
HWY_INLINE float ToFloat(Element<G> x) {
  const DF df;
  HWY_ALIGN Element<G> one[convert::kMaxFloatLanes] = {x};
  return hn::GetLane(convert::LoadGrad<G>(df, one, 0));
}

// Folds a row's vectors into two accumulators, alternately (two chains in flight): op(acc, v)
// for each whole vector, then for the partial one at the end with its missing lanes `fill`.
template <GradFormat G, class Op>
HWY_INLINE void FoldRow(DF df, const Element<G>* x, size_t classes, float fill,
                        hn::VFromD<DF>& acc0, hn::VFromD<DF>& acc1, const Op& op) {
  const size_t lanes = hn::Lanes(df);
  const size_t full = classes / lanes * lanes;
  size_t i = 0;
  for (; i + 2 * lanes <= full; i += 2 * lanes) {
    op(acc0, convert::LoadGrad<G>(df, x, i));
    op(acc1, convert::LoadGrad<G>(df, x, i + lanes));
  }
  if (i < full) op(acc0, convert::LoadGrad<G>(df, x, i));
  if (full < classes) op(acc1, LoadPart<G>(df, x + full, classes - full, fill));
}

template <GradFormat G>
void ForwardRow(const Element<G>* x, size_t classes, int64_t target, float* loss, float* lse) {
  const DF df;
  const hn::RebindToUnsigned<DF> du;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  auto m0 = hn::Set(df, kNegInf), m1 = m0;
  auto nan = hn::Zero(du);  // all ones in a lane that saw a NaN
  FoldRow<G>(df, x, classes, kNegInf, m0, m1, [&](hn::VFromD<DF>& m, hn::VFromD<DF> v) {
    m = hn::Max(m, v);
    nan = hn::Or(nan, hn::BitCast(du, hn::VecFromMask(df, hn::IsNaN(v))));
  });
  const float row_max = hn::GetLane(hn::MaxOfLanes(df, hn::Max(m0, m1)));
  // A NaN, +Inf (whose x - max is Inf - Inf) or a row all -Inf (-Inf - -Inf) makes the row's
  // log-softmax NaN in LibTorch.
  if (!hn::AllFalse(du, hn::Ne(nan, hn::Zero(du))) || std::isinf(row_max)) {
    *lse = *loss = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const auto shift = hn::Set(df, row_max);
  auto s0 = hn::Zero(df), s1 = hn::Zero(df);
  FoldRow<G>(df, x, classes, kNegInf, s0, s1, [&](hn::VFromD<DF>& s, hn::VFromD<DF> v) {
    s = hn::Add(s, ExpOfNonPositive(df, hn::Sub(v, shift)));
  });
  const float sum = hn::GetLane(hn::SumOfLanes(df, hn::Add(s0, s1)));
  *lse = row_max + std::log(sum);
  *loss = *lse - ToFloat<G>(x[target]);
}

template <GradFormat G>
HWY_INLINE void StoreFloat(DF df, hn::VFromD<DF> v, Element<G>* out) {
  if constexpr (G == GradFormat::kF32) {
    hn::StoreU(v, df, out);
  } else if constexpr (G == GradFormat::kBF16) {
    convert::NarrowBF16(df, v, out);
  } else {
    convert::NarrowF16(df, v, out);
  }
}

// grad = exp(x - lse) * scale, minus scale at the target: LibTorch's log-softmax backward with
// the NLL's gradient (-scale at the target) has the same two roundings there.
template <GradFormat G>
void BackwardRow(const Element<G>* x, size_t classes, int64_t target, float lse, float scale,
                 Element<G>* grad) {
  const DF df;
  const hn::RebindToSigned<DF> di;
  const size_t lanes = hn::Lanes(df);
  if (std::isnan(lse)) {  // a NaN row (ForwardRow): its gradient is NaN, as LibTorch's is
    const auto nan = hn::Set(df, std::numeric_limits<float>::quiet_NaN());
    HWY_ALIGN Element<G> part[convert::kMaxFloatLanes] = {};
    StoreFloat<G>(df, nan, part);
    for (size_t c = 0; c < classes; ++c) grad[c] = part[0];
    return;
  }
  const auto shift = hn::Set(df, lse);
  const auto s = hn::Set(df, scale);
  // Column indices as int32 (the caller caps classes well below 2^31 - lanes, so they never wrap).
  const auto column = hn::Iota(di, 0);
  const auto target_column = hn::Set(di, static_cast<int32_t>(target));
  const auto lanes_at = [&](hn::VFromD<DF> v, size_t i) {
    const auto p = hn::Mul(ExpOfNonPositive(df, hn::Sub(v, shift)), s);
    const auto is_target = hn::RebindMask(
        df, hn::Eq(hn::Add(column, hn::Set(di, static_cast<int32_t>(i))), target_column));
    return hn::IfThenElse(is_target, hn::Sub(p, s), p);
  };
  size_t i = 0;
  for (; i + lanes <= classes; i += lanes) {
    StoreFloat<G>(df, lanes_at(convert::LoadGrad<G>(df, x, i), i), grad + i);
  }
  if (i < classes) {
    HWY_ALIGN Element<G> part[convert::kMaxFloatLanes] = {};
    StoreFloat<G>(df, lanes_at(LoadPart<G>(df, x + i, classes - i, 0.0f), i), part);
    std::copy_n(part, classes - i, grad + i);
  }
}

void CrossEntropyForwardRows(const void* logits, LogitFormat format, int64_t classes,
                             const int64_t* targets, float* loss, float* lse, int64_t begin,
                             int64_t end) {
  optim::detail::dispatch_grad_format(format, [&](auto g) {
    const auto* x = static_cast<const Element<g>*>(logits);
    for (int64_t r = begin; r < end; ++r) {
      ForwardRow<g>(x + r * classes, static_cast<size_t>(classes), targets[r], loss + r, lse + r);
    }
  });
}

void CrossEntropyBackwardRows(const void* logits, LogitFormat format, int64_t classes,
                              const int64_t* targets, const float* lse, float scale, void* grad,
                              int64_t begin, int64_t end) {
  optim::detail::dispatch_grad_format(format, [&](auto g) {
    const auto* x = static_cast<const Element<g>*>(logits);
    auto* out = static_cast<Element<g>*>(grad);
    for (int64_t r = begin; r < end; ++r) {
      BackwardRow<g>(x + r * classes, static_cast<size_t>(classes), targets[r], lse[r], scale,
                     out + r * classes);
    }
  });
}

}  // namespace mixprec::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mixprec::detail {

HWY_EXPORT(CrossEntropyForwardRows);
HWY_EXPORT(CrossEntropyBackwardRows);

void cross_entropy_forward_rows(const void* logits, LogitFormat format, int64_t classes,
                                const int64_t* targets, float* loss, float* lse, int64_t begin,
                                int64_t end) {
  HWY_DYNAMIC_DISPATCH(CrossEntropyForwardRows)
  (logits, format, classes, targets, loss, lse, begin, end);
}

void cross_entropy_backward_rows(const void* logits, LogitFormat format, int64_t classes,
                                 const int64_t* targets, const float* lse, float scale, void* grad,
                                 int64_t begin, int64_t end) {
  HWY_DYNAMIC_DISPATCH(CrossEntropyBackwardRows)
  (logits, format, classes, targets, lse, scale, grad, begin, end);
}

}  // namespace mixprec::detail
#endif  // HWY_ONCE
