#include "optim/kernels/aten_fallback.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cmath>

namespace mixprec::optim::detail {
namespace {

// The gradient the update sees: FP32, unscaled, sign-flipped for maximize. A fresh tensor
// whenever it differs from `grad`, which stays read-only.
at::Tensor effective_grad(const at::Tensor& grad, double grad_scale_inv, bool maximize) {
  at::Tensor g = grad.to(at::kFloat);
  // Scalar ops round the scale to float first, as the SIMD kernels do.
  if (grad_scale_inv != 1.0) g = g * static_cast<double>(static_cast<float>(grad_scale_inv));
  if (maximize) g = -g;
  return g;
}

// mask ? a : b for int64 tensors, in arithmetic (at::where has no kernel for some devices,
// e.g. meta).
at::Tensor select(const at::Tensor& mask, const at::Tensor& a, const at::Tensor& b) {
  return b + mask.to(at::kLong) * (a - b);
}

// An int64 tensor of unsigned `width`-bit patterns as the signed integers with the same bits,
// so the narrowing conversion is exact.
at::Tensor as_signed(const at::Tensor& bits, int width) {
  const int64_t half = int64_t{1} << (width - 1);
  return bits - (bits >= half).to(at::kLong) * (2 * half);
}

}  // namespace

void adam_step_aten(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, const at::Tensor& max_exp_avg_sq,
                    const at::Tensor& model_param, int64_t step, const AdamHyperParams& hp,
                    double grad_scale_inv) {
  // In-place updates of leaves that may require grad (native FP32 parameters).
  at::NoGradGuard no_grad;
  at::Tensor g = effective_grad(grad, grad_scale_inv, hp.maximize);
  if (hp.weight_decay != 0.0) {
    if (hp.decoupled_weight_decay) {
      param.mul_(1.0 - hp.lr * hp.weight_decay);
    } else {
      g = g.add(param, hp.weight_decay);
    }
  }
  const double bias_correction1 = 1.0 - std::pow(hp.beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(hp.beta2, static_cast<double>(step));
  exp_avg.lerp_(g, 1.0 - hp.beta1);
  exp_avg_sq.mul_(hp.beta2).addcmul_(g, g, 1.0 - hp.beta2);
  const at::Tensor& second_moment = hp.amsgrad ? max_exp_avg_sq : exp_avg_sq;
  if (hp.amsgrad) {
    at::Tensor running_max = max_exp_avg_sq;  // a handle to the same storage, for the _out API
    at::maximum_out(running_max, max_exp_avg_sq, exp_avg_sq);
  }
  at::Tensor denom = (second_moment.sqrt() / std::sqrt(bias_correction2)).add_(hp.eps);
  param.addcdiv_(exp_avg, denom, -(hp.lr / bias_correction1));
  if (model_param.defined()) model_param.copy_(param);
}

void sgd_step_aten(const at::Tensor& param, const at::Tensor& grad,
                   const at::Tensor& momentum_buffer, const at::Tensor& model_param,
                   bool first_step, const SgdHyperParams& hp, double grad_scale_inv) {
  at::NoGradGuard no_grad;
  at::Tensor g = effective_grad(grad, grad_scale_inv, hp.maximize);
  if (hp.weight_decay != 0.0) g = g.add(param, hp.weight_decay);
  if (hp.momentum != 0.0) {
    if (first_step) {
      momentum_buffer.copy_(g);
    } else {
      momentum_buffer.mul_(hp.momentum).add_(g, 1.0 - hp.dampening);
    }
    g = hp.nesterov ? g.add(momentum_buffer, hp.momentum) : momentum_buffer;
  }
  param.add_(g, -hp.lr);
  if (model_param.defined()) model_param.copy_(param);
}

double sum_of_squares_aten(const at::Tensor& grad) {
  return at::sum(at::square(grad.to(at::kDouble))).item<double>();
}

void copy_master_to_model_aten(const at::Tensor& master, const at::Tensor& model_param) {
  at::NoGradGuard no_grad;
  model_param.copy_(master);
}

// The bits are handled as int64 (exact for every 16- and 32-bit pattern).
void split_master_aten(const at::Tensor& master, const at::Tensor& param,
                       const at::Tensor& remainder) {
  at::NoGradGuard no_grad;
  const at::Tensor bits = master.view(at::kInt).to(at::kLong).bitwise_and(0xFFFFFFFFLL);
  const at::Tensor rounded = (bits + 0x8000).bitwise_right_shift(16).bitwise_and(0xFFFF);
  const at::Tensor quiet_nan = bits.bitwise_right_shift(16).bitwise_or(0x0040);
  const at::Tensor nan = bits.bitwise_and(0x7FFFFFFF) > 0x7F800000;
  const at::Tensor high = select(nan, quiet_nan, rounded);
  param.view(at::kShort).copy_(as_signed(high, 16).to(at::kShort));
  remainder.copy_(as_signed(bits.bitwise_and(0xFFFF), 16).to(at::kShort));
}

void join_master_aten(const at::Tensor& param, const at::Tensor& remainder,
                      const at::Tensor& master) {
  at::NoGradGuard no_grad;
  const at::Tensor param_bits = param.view(at::kShort).to(at::kLong).bitwise_and(0xFFFF);
  const at::Tensor nan = param_bits.bitwise_and(0x7FFF) > 0x7F80;
  const at::Tensor high = param_bits * 65536;
  const at::Tensor offset = high + remainder.to(at::kLong);  // sign-extended remainder
  const at::Tensor raw = high + remainder.to(at::kLong).bitwise_and(0xFFFF);
  const at::Tensor bits = select(nan, raw, offset).bitwise_and(0xFFFFFFFFLL);
  master.view(at::kInt).copy_(as_signed(bits, 32).to(at::kInt));
}

}  // namespace mixprec::optim::detail
