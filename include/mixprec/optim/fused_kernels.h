// Fused optimizer kernels: one pass over a parameter's memory per step.
//
// These are the inner algorithms of the mixed-precision optimizer (optim/float16_optimizer.h),
// with torch.optim's exact semantics and hyper-parameter names. One call reads the gradient
// (FP32, BF16 or FP16, multiplied by `grad_scale_inv` on the fly: loss-scale unscaling and
// gradient clipping folded in), the FP32 parameter (an FP32 main copy, or a native FP32
// parameter updated in place) and the FP32 moments; it writes the moments, the parameter and,
// when `model_param` is defined, the BF16/FP16 model parameter rounded to nearest-even from the
// new FP32 value. CPU tensors take a vectorized (SIMD chosen at run time), multithreaded path;
// other devices fall back to ATen ops with the same semantics.
//
// Numerics (CPU): per element, the same FP32 operations in the same order as LibTorch's fused
// CPU kernels (at::_fused_adam_, at::_fused_adamw_, at::_fused_sgd_: what torch.optim's
// Adam/AdamW/SGD run with fused=True), FMAs included. On CPUs with FMA the results are
// bit-identical to theirs except in the last numel % 8 elements of each tensor: there
// LibTorch's kernel leaves its vector loop for a scalar loop that its compiler contracts the
// other way (exp_avg_sq's update, SGD's momentum), one rounding apart per step, so its result
// for an element depends on the tensor's length. These kernels run those elements through the
// same vector code as all others (zero-padded), so an element's result never depends on where
// it sits. tests/optim/fused_kernels_test.cpp checks the rest bit for bit and bounds the last
// numel % 8 on random values (2 ulps per step). Without FMA hardware each FMA rounds twice: the
// same one-rounding difference, on every element. One rounding is 2^-24 of the multiply-add's
// terms, not of its result: where the terms nearly cancel (a gradient equal to minus the L2
// weight-decay term) it is all that is left of the result, and Adam's normalisation then makes
// it a difference of up to about lr — thousands of ulps — between the two ways of rounding
// (each of them some LibTorch build's). grad * grad_scale_inv is one FP32 multiply (grad_scale_inv
// rounded to FP32). BF16/FP16 outputs equal at::Tensor::to() bit for bit, except that NaN is
// written as a quiet NaN of the same sign. Every tensor a CPU kernel writes has its version counter
// bumped (before the write), as an in-place ATen op's would be.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "mixprec/optim/hyper_params.h"

namespace mixprec::optim {

// One Adam/AdamW update of one parameter, in place.
//   param          FP32, updated (the main copy, or the native FP32 parameter itself)
//   grad           FP32/BF16/FP16, read only; the update uses grad * grad_scale_inv
//   exp_avg, exp_avg_sq   FP32, updated
//   max_exp_avg_sq FP32, updated; must be defined iff hp.amsgrad
//   model_param    BF16/FP16 written with RNE(param) after the update, or undefined
//   step           the step count including this update (1 on the first call)
// All defined tensors: same device, same numel, contiguous. Throws c10::Error naming the
// offending argument otherwise, before writing anything.
void fused_adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                     const at::Tensor& exp_avg_sq, const at::Tensor& max_exp_avg_sq,
                     const at::Tensor& model_param, int64_t step, const AdamHyperParams& hp,
                     double grad_scale_inv = 1.0);

// One SGD update of one parameter, in place. `momentum_buffer` must be defined iff
// hp.momentum != 0; on `first_step` it is overwritten with the (decayed) gradient, as torch
// does when it creates the buffer. Other arguments as in fused_adam_step.
void fused_sgd_step(const at::Tensor& param, const at::Tensor& grad,
                    const at::Tensor& momentum_buffer, const at::Tensor& model_param,
                    bool first_step, const SgdHyperParams& hp, double grad_scale_inv = 1.0);

struct GradStats {
  double sum_of_squares = 0.0;  // Σ (g * grad_scale_inv)², accumulated in double per chunk
  bool all_finite = true;       // false if any element is Inf or NaN
};

// One read-only pass over a gradient (FP32/BF16/FP16) for clipping and overflow checks.
// all_finite is about the gradient's elements; when it is false, sum_of_squares is Inf or NaN
// (it may also be Inf with finite elements, if grad_scale_inv makes their squares overflow a
// double). The result does not depend on the number of threads. Contiguous tensors only; throws
// c10::Error otherwise.
GradStats grad_stats(const at::Tensor& grad, double grad_scale_inv = 1.0);

// model_param (BF16/FP16) = RNE(master (FP32)), elementwise. Same numel, device, contiguous;
// throws c10::Error naming the argument otherwise, before writing anything.
void copy_master_to_model(const at::Tensor& master, const at::Tensor& model_param);

}  // namespace mixprec::optim
