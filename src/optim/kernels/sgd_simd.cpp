// SGD inner loop, compiled once per Highway target and selected at run time.
//
// Mirrors at::_fused_sgd_'s vectorized CPU kernel including the FMAs its AVX2/AVX-512 build
// executes (weight decay, momentum, Nesterov and the parameter update are each one fused
// multiply-add there); -ffp-contract=off keeps the compiler from fusing anything else. The
// master is read and written as in adam_simd.cpp (LoadMaster/StoreMaster).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "optim/kernels/sgd_simd.cpp"
#include <hwy/foreach_target.h>  // must precede highway.h
#include <hwy/highway.h>

#include <algorithm>

#include "optim/kernels/format_dispatch.h"
#include "optim/kernels/kernel_args.h"
#include "optim/kernels/simd_convert-inl.h"

HWY_BEFORE_NAMESPACE();
namespace mixprec::optim::detail::HWY_NAMESPACE {
namespace {

template <GradFormat G, ModelFormat M, class D>
HWY_INLINE void SgdVector(D d, const SgdConstants& c, float* HWY_RESTRICT param,
                          uint16_t* HWY_RESTRICT model, int16_t* HWY_RESTRICT remainder,
                          const GradElement<G>* HWY_RESTRICT grad, float* HWY_RESTRICT buffer,
                          size_t i) {
  auto g = LoadGrad<G>(d, grad, i);
  if (c.scale_grad) g = hn::Mul(g, hn::Set(d, c.grad_scale_inv));
  if (c.maximize) g = hn::Neg(g);
  auto p = LoadMaster<M>(d, param, model, remainder, i);
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
  StoreMaster<M>(d, p, param, model, remainder, i);
}

template <GradFormat G, ModelFormat M>
void SgdRange(const SgdBuffers& b, const SgdConstants& c, size_t begin, size_t end) {
  const hn::ScalableTag<float> d;
  const size_t lanes = hn::Lanes(d);
  const auto* grad = static_cast<const GradElement<G>*>(b.grad);
  float* param = b.param.param;
  uint16_t* model = b.param.model_param;
  int16_t* remainder = b.param.remainder;
  size_t i = begin;
  for (; i + lanes <= end; i += lanes) {
    SgdVector<G, M>(d, c, param, model, remainder, grad, b.momentum_buffer, i);
  }
  if (i == end) return;
  // Partial last vector: same code on zero-padded copies (see TailCopies).
  const size_t n = end - i;
  TailCopies<G, M> t;
  HWY_ALIGN float buf[kMaxFloatLanes] = {};
  t.load(param, model, remainder, grad, i, n);
  if (c.has_momentum) std::copy_n(b.momentum_buffer + i, n, buf);
  SgdVector<G, M>(d, c, t.param, t.model, t.remainder, t.grad, buf, 0);
  t.store(param, model, remainder, i, n);
  if (c.has_momentum) std::copy_n(buf, n, b.momentum_buffer + i);
}

}  // namespace

void SgdChunk(const SgdBuffers& b, const SgdConstants& c, int64_t begin, int64_t end) {
  dispatch_formats(b.grad_format, b.param.model_format, [&](auto g, auto m) {
    SgdRange<g, m>(b, c, static_cast<size_t>(begin), static_cast<size_t>(end));
  });
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
