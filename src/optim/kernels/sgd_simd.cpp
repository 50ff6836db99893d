// SGD inner loop, compiled once per Highway target and selected at run time.
//
// Mirrors at::_fused_sgd_'s vectorized CPU kernel including the FMAs its AVX2/AVX-512 build
// executes (weight decay, momentum, Nesterov and the parameter update are each one fused
// multiply-add there); -ffp-contract=off keeps the compiler from fusing anything else.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "optim/kernels/sgd_simd.cpp"
#include <hwy/foreach_target.h>  // must precede highway.h
#include <hwy/highway.h>

#include <algorithm>

#include "optim/kernels/kernel_args.h"
#include "optim/kernels/simd_convert-inl.h"

HWY_BEFORE_NAMESPACE();
namespace mixprec::optim::detail::HWY_NAMESPACE {
namespace {

template <GradFormat G, ModelFormat M, class D>
HWY_INLINE void SgdVector(D d, const SgdConstants& c, float* HWY_RESTRICT param,
                          const GradElement<G>* HWY_RESTRICT grad, float* HWY_RESTRICT buffer,
                          uint16_t* HWY_RESTRICT model, size_t i) {
  auto g = LoadGrad<G>(d, grad, i);
  if (c.scale_grad) g = hn::Mul(g, hn::Set(d, c.grad_scale_inv));
  if (c.maximize) g = hn::Neg(g);
  auto p = hn::LoadU(d, param + i);
  if (c.has_weight_decay) g = hn::MulAdd(p, hn::Set(d, c.weight_decay), g);
  if (c.has_momentum) {
    // torch creates the buffer as a clone of the (decayed) gradient on the first step.
    auto buf = g;
    if (!c.first_step) {
      const auto decayed = hn::Mul(hn::LoadU(d, buffer + i), hn::Set(d, c.momentum));
      buf = hn::MulAdd(g, hn::Set(d, c.one_minus_dampening), decayed);
    }
    hn::StoreU(buf, d, buffer + i);
    g = c.nesterov ? hn::MulAdd(buf, hn::Set(d, c.momentum), g) : buf;
  }
  p = hn::MulAdd(g, hn::Set(d, c.neg_lr), p);
  hn::StoreU(p, d, param + i);
  StoreModel<M>(d, p, model, i);
}

template <GradFormat G, ModelFormat M>
void SgdRange(const SgdBuffers& b, const SgdConstants& c, size_t begin, size_t end) {
  const hn::ScalableTag<float> d;
  const size_t lanes = hn::Lanes(d);
  const auto* grad = static_cast<const GradElement<G>*>(b.grad);
  size_t i = begin;
  for (; i + lanes <= end; i += lanes) {
    SgdVector<G, M>(d, c, b.param, grad, b.momentum_buffer, b.model_param, i);
  }
  if (i == end) return;
  // Partial last vector: same code on zero-padded copies (see adam_simd.cpp).
  const size_t n = end - i;
  HWY_ALIGN float p[kMaxFloatLanes] = {}, buf[kMaxFloatLanes] = {};
  HWY_ALIGN GradElement<G> g[kMaxFloatLanes] = {};
  HWY_ALIGN uint16_t model[kMaxFloatLanes] = {};
  std::copy_n(b.param + i, n, p);
  std::copy_n(grad + i, n, g);
  if (c.has_momentum) std::copy_n(b.momentum_buffer + i, n, buf);
  SgdVector<G, M>(d, c, p, g, buf, model, 0);
  std::copy_n(p, n, b.param + i);
  if (c.has_momentum) std::copy_n(buf, n, b.momentum_buffer + i);
  if constexpr (M != ModelFormat::kNone) std::copy_n(model, n, b.model_param + i);
}

template <GradFormat G>
void SgdRangeForGrad(const SgdBuffers& b, const SgdConstants& c, size_t begin, size_t end) {
  switch (b.model_format) {
    case ModelFormat::kNone:
      return SgdRange<G, ModelFormat::kNone>(b, c, begin, end);
    case ModelFormat::kBF16:
      return SgdRange<G, ModelFormat::kBF16>(b, c, begin, end);
    case ModelFormat::kF16:
      return SgdRange<G, ModelFormat::kF16>(b, c, begin, end);
  }
}

}  // namespace

void SgdChunk(const SgdBuffers& b, const SgdConstants& c, int64_t begin, int64_t end) {
  const auto first = static_cast<size_t>(begin), last = static_cast<size_t>(end);
  switch (b.grad_format) {
    case GradFormat::kF32:
      return SgdRangeForGrad<GradFormat::kF32>(b, c, first, last);
    case GradFormat::kBF16:
      return SgdRangeForGrad<GradFormat::kBF16>(b, c, first, last);
    case GradFormat::kF16:
      return SgdRangeForGrad<GradFormat::kF16>(b, c, first, last);
  }
}

}  // namespace mixprec::optim::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mixprec::optim::detail {

HWY_EXPORT(SgdChunk);

void sgd_chunk(const SgdBuffers& buffers, const SgdConstants& constants, int64_t begin,
               int64_t end) {
  HWY_DYNAMIC_DISPATCH(SgdChunk)(buffers, constants, begin, end);
}

}  // namespace mixprec::optim::detail
#endif  // HWY_ONCE
