// Adam/AdamW inner loop, compiled once per Highway target (foreach_target.h re-includes this
// file) and selected at run time by HWY_DYNAMIC_DISPATCH.
//
// Per element it mirrors at::_fused_adam_/_fused_adamw_'s vectorized CPU kernel operation by
// operation, including the FMAs that kernel executes in the AVX2/AVX-512 builds of LibTorch
// (the lerp it writes as vec::fmadd, and the two its compiler contracts: the L2 term and the
// second-moment update). This file is compiled with -ffp-contract=off so that the compiler
// adds no others: every rounding below is one the reference performs too. On targets without
// FMA hardware (SSSE3, SSE4, EMU128) hn::MulAdd rounds twice, like LibTorch's non-FMA kernel.
// The master comes from LoadMaster and goes back through StoreMaster: an FP32 stream, or the
// BF16 param + remainder pair rebuilt exactly in registers, so both run the same update.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "optim/kernels/adam_simd.cpp"
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
HWY_INLINE void AdamVector(D d, const AdamConstants& c, float* HWY_RESTRICT param,
                           uint16_t* HWY_RESTRICT model, int16_t* HWY_RESTRICT remainder,
                           const GradElement<G>* HWY_RESTRICT grad, float* HWY_RESTRICT exp_avg,
                           float* HWY_RESTRICT exp_avg_sq, float* HWY_RESTRICT max_exp_avg_sq,
                           size_t i) {
  auto g = LoadGrad<G>(d, grad, i);
  if (c.scale_grad) g = hn::Mul(g, hn::Set(d, c.grad_scale_inv));
  if (c.maximize) g = hn::Neg(g);
  auto p = LoadMaster<M>(d, param, model, remainder, i);
  if (c.has_weight_decay) {
    if (c.decoupled) {
      p = hn::Mul(p, hn::Set(d, c.param_decay));
    } else {
      g = hn::MulAdd(p, hn::Set(d, c.weight_decay), g);
    }
  }
  // exp_avg.lerp_(grad, 1 - beta1) in at::lerp's two-sided form: the base is whichever end
  // keeps the weight below 0.5, which bounds the rounding error.
  auto m = hn::LoadU(d, exp_avg + i);
  const auto diff = hn::Sub(g, m);
  if (c.lerp_weight < 0.5f && c.lerp_weight > -0.5f) {
    m = hn::MulAdd(hn::Set(d, c.lerp_weight), diff, m);
  } else {
    m = hn::MulAdd(hn::Set(d, c.lerp_weight - 1.0f), diff, g);
  }
  // exp_avg_sq * beta2 + ((1 - beta2) * grad) * grad, the last product fused.
  const auto v_decayed = hn::Mul(hn::LoadU(d, exp_avg_sq + i), hn::Set(d, c.beta2));
  const auto v = hn::MulAdd(hn::Mul(hn::Set(d, c.one_minus_beta2), g), g, v_decayed);
  hn::StoreU(m, d, exp_avg + i);
  hn::StoreU(v, d, exp_avg_sq + i);
  auto second_moment = v;
  if (c.amsgrad) {
    second_moment = NanPropagatingMax(hn::LoadU(d, max_exp_avg_sq + i), v);
    hn::StoreU(second_moment, d, max_exp_avg_sq + i);
  }
  const auto denom = hn::Add(hn::Div(hn::Sqrt(second_moment), hn::Set(d, c.bias_correction2_sqrt)),
                             hn::Set(d, c.eps));
  p = hn::Add(p, hn::Div(hn::Mul(hn::Set(d, c.neg_step_size), m), denom));
  StoreMaster<M>(d, p, param, model, remainder, i);
}

template <GradFormat G, ModelFormat M>
void AdamRange(const AdamBuffers& b, const AdamConstants& c, size_t begin, size_t end) {
  const hn::ScalableTag<float> d;
  const size_t lanes = hn::Lanes(d);
  const auto* grad = static_cast<const GradElement<G>*>(b.grad);
  float* param = b.param.param;
  uint16_t* model = b.param.model_param;
  int16_t* remainder = b.param.remainder;
  size_t i = begin;
  for (; i + lanes <= end; i += lanes) {
    AdamVector<G, M>(d, c, param, model, remainder, grad, b.exp_avg, b.exp_avg_sq, b.max_exp_avg_sq,
                     i);
  }
  if (i == end) return;
  // The last partial vector: the same vector code on zero-padded copies.
  const size_t n = end - i;
  TailCopies<G, M> t;
  HWY_ALIGN float m[kMaxFloatLanes] = {}, v[kMaxFloatLanes] = {}, mx[kMaxFloatLanes] = {};
  t.load(param, model, remainder, grad, i, n);
  std::copy_n(b.exp_avg + i, n, m);
  std::copy_n(b.exp_avg_sq + i, n, v);
  if (c.amsgrad) std::copy_n(b.max_exp_avg_sq + i, n, mx);
  AdamVector<G, M>(d, c, t.param, t.model, t.remainder, t.grad, m, v, mx, 0);
  t.store(param, model, remainder, i, n);
  std::copy_n(m, n, b.exp_avg + i);
  std::copy_n(v, n, b.exp_avg_sq + i);
  if (c.amsgrad) std::copy_n(mx, n, b.max_exp_avg_sq + i);
}

}  // namespace

void AdamChunk(const AdamBuffers& b, const AdamConstants& c, int64_t begin, int64_t end) {
  dispatch_formats(b.grad_format, b.param.model_format, [&](auto g, auto m) {
    AdamRange<g, m>(b, c, static_cast<size_t>(begin), static_cast<size_t>(end));
  });
}

}  // namespace mixprec::optim::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mixprec::optim::detail {

HWY_EXPORT(AdamChunk);

void adam_chunk(const AdamBuffers& buffers, const AdamConstants& constants, int64_t begin,
                int64_t end) {
  HWY_DYNAMIC_DISPATCH(AdamChunk)(buffers, constants, begin, end);
}

}  // namespace mixprec::optim::detail
#endif  // HWY_ONCE
