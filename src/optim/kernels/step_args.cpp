#include "optim/kernels/step_args.h"

#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <cmath>

namespace mixprec::optim::detail {

void check_companion(const char* op, const char* name, const at::Tensor& t,
                     const at::Tensor& param) {
  TORCH_CHECK(t.layout() == at::kStrided, "[mixprec::", op, "] ", name,
              " must be a dense (strided) tensor, got layout ", t.layout());
  TORCH_CHECK(t.device() == param.device(), "[mixprec::", op, "] ", name, " is on ", t.device(),
              " but the parameter is on ", param.device());
  TORCH_CHECK(t.numel() == param.numel(), "[mixprec::", op, "] ", name, " has ", t.numel(),
              " elements but the parameter has ", param.numel());
  TORCH_CHECK(t.is_contiguous(), "[mixprec::", op, "] ", name, " must be contiguous");
}

namespace {

// torch.dtype spelling, as users write it.
const char* dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return "float32";
    case at::kBFloat16:
      return "bfloat16";
    case at::kHalf:
      return "float16";
    case at::kShort:
      return "int16";
    default:
      return c10::toString(dtype);
  }
}

}  // namespace

void check_typed(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype,
                 const at::Tensor& param) {
  TORCH_CHECK(t.defined(), "[mixprec::", op, "] ", name, " is undefined");
  TORCH_CHECK(t.scalar_type() == dtype, "[mixprec::", op, "] ", name, " must be ",
              dtype_name(dtype), ", got ", t.scalar_type());
  check_companion(op, name, t, param);
}

void check_grad(const char* op, const at::Tensor& grad, const at::Tensor& param) {
  TORCH_CHECK(grad.defined(), "[mixprec::", op, "] grad is undefined");
  const auto dtype = grad.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "[mixprec::", op,
              "] grad must be float32, bfloat16 or float16, got ", dtype);
  check_companion(op, "grad", grad, param);
}

void check_model_param(const char* op, const char* name, const at::Tensor& model,
                       const at::Tensor& param) {
  if (!model.defined()) return;
  const auto dtype = model.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "[mixprec::", op, "] ", name,
              " must be bfloat16 or float16, got ", dtype);
  check_companion(op, name, model, param);
}

void check_disjoint(const char* op, const std::vector<NamedTensor>& tensors) {
  for (size_t a = 0; a < tensors.size(); ++a) {
    for (size_t b = a + 1; b < tensors.size(); ++b) {
      const at::Tensor& x = *tensors[a].second;
      const at::Tensor& y = *tensors[b].second;
      if (!x.defined() || !y.defined()) continue;
      const auto status = at::get_overlap_status(x, y);
      TORCH_CHECK(status != at::MemOverlapStatus::Full && status != at::MemOverlapStatus::Partial,
                  "[mixprec::", op, "] ", tensors[a].first, " and ", tensors[b].first,
                  " share memory");
    }
  }
}

void check_scale(const char* op, double grad_scale_inv) {
  TORCH_CHECK(std::isfinite(grad_scale_inv), "[mixprec::", op,
              "] grad_scale_inv must be finite, got ", grad_scale_inv);
}

// Same ranges torch.optim.Adam(W) and SGD accept.
void check_adam_hyper_params(const char* op, const AdamHyperParams& hp) {
  TORCH_CHECK(hp.lr >= 0.0, "[mixprec::", op, "] invalid hp.lr: ", hp.lr);
  TORCH_CHECK(hp.eps >= 0.0, "[mixprec::", op, "] invalid hp.eps: ", hp.eps);
  TORCH_CHECK(hp.beta1 >= 0.0 && hp.beta1 < 1.0, "[mixprec::", op,
              "] invalid hp.beta1: ", hp.beta1);
  TORCH_CHECK(hp.beta2 >= 0.0 && hp.beta2 < 1.0, "[mixprec::", op,
              "] invalid hp.beta2: ", hp.beta2);
  TORCH_CHECK(hp.weight_decay >= 0.0, "[mixprec::", op,
              "] invalid hp.weight_decay: ", hp.weight_decay);
}

void check_sgd_hyper_params(const char* op, const SgdHyperParams& hp) {
  TORCH_CHECK(hp.lr >= 0.0, "[mixprec::", op, "] invalid hp.lr: ", hp.lr);
  TORCH_CHECK(hp.momentum >= 0.0, "[mixprec::", op, "] invalid hp.momentum: ", hp.momentum);
  TORCH_CHECK(hp.weight_decay >= 0.0, "[mixprec::", op,
              "] invalid hp.weight_decay: ", hp.weight_decay);
  TORCH_CHECK(!hp.nesterov || (hp.momentum > 0.0 && hp.dampening == 0.0), "[mixprec::", op,
              "] hp.nesterov requires hp.momentum > 0 and hp.dampening == 0");
}

void check_adam_state(const char* op, const at::Tensor& param, const at::Tensor& grad,
                      const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                      const at::Tensor& max_exp_avg_sq, int64_t step, const AdamHyperParams& hp,
                      double grad_scale_inv) {
  check_grad(op, grad, param);
  check_typed(op, "exp_avg", exp_avg, at::kFloat, param);
  check_typed(op, "exp_avg_sq", exp_avg_sq, at::kFloat, param);
  TORCH_CHECK(hp.amsgrad == max_exp_avg_sq.defined(), "[mixprec::", op,
              "] max_exp_avg_sq must be defined exactly when hp.amsgrad is true (hp.amsgrad = ",
              hp.amsgrad, ")");
  if (hp.amsgrad) check_typed(op, "max_exp_avg_sq", max_exp_avg_sq, at::kFloat, param);
  TORCH_CHECK(step >= 1, "[mixprec::", op, "] step counts this update and must be >= 1, got ",
              step);
  check_adam_hyper_params(op, hp);
  check_scale(op, grad_scale_inv);
}

void check_sgd_state(const char* op, const at::Tensor& param, const at::Tensor& grad,
                     const at::Tensor& momentum_buffer, const SgdHyperParams& hp,
                     double grad_scale_inv) {
  check_grad(op, grad, param);
  TORCH_CHECK((hp.momentum != 0.0) == momentum_buffer.defined(), "[mixprec::", op,
              "] momentum_buffer must be defined exactly when hp.momentum != 0 (hp.momentum = ",
              hp.momentum, ")");
  if (momentum_buffer.defined()) {
    check_typed(op, "momentum_buffer", momentum_buffer, at::kFloat, param);
  }
  check_sgd_hyper_params(op, hp);
  check_scale(op, grad_scale_inv);
}

void mark_written(std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    if (t->defined() && !t->is_inference()) t->unsafeGetTensorImpl()->bump_version();
  }
}

GradFormat grad_format(const at::Tensor& grad) {
  switch (grad.scalar_type()) {
    case at::kBFloat16:
      return GradFormat::kBF16;
    case at::kHalf:
      return GradFormat::kF16;
    default:
      return GradFormat::kF32;
  }
}

ModelFormat model_format(const at::Tensor& model) {
  if (!model.defined()) return ModelFormat::kNone;
  return model.scalar_type() == at::kBFloat16 ? ModelFormat::kBF16 : ModelFormat::kF16;
}

uint16_t* model_data(const at::Tensor& model) {
  return model.defined() ? static_cast<uint16_t*>(model.data_ptr()) : nullptr;
}

AdamConstants adam_constants(const AdamHyperParams& hp, int64_t step, double grad_scale_inv) {
  // Derived in double and rounded to float once, as at::_fused_adam_ does.
  const double bias_correction1 = 1.0 - std::pow(hp.beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(hp.beta2, static_cast<double>(step));
  AdamConstants c;
  c.grad_scale_inv = static_cast<float>(grad_scale_inv);
  c.scale_grad = grad_scale_inv != 1.0;
  c.maximize = hp.maximize;
  c.decoupled = hp.decoupled_weight_decay;
  c.has_weight_decay = hp.weight_decay != 0.0;
  c.amsgrad = hp.amsgrad;
  c.weight_decay = static_cast<float>(hp.weight_decay);
  c.param_decay = static_cast<float>(1.0 - hp.lr * hp.weight_decay);
  c.lerp_weight = static_cast<float>(1.0 - hp.beta1);
  c.beta2 = static_cast<float>(hp.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - hp.beta2);
  c.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  c.eps = static_cast<float>(hp.eps);
  c.neg_step_size = static_cast<float>(-(hp.lr / bias_correction1));
  return c;
}

SgdConstants sgd_constants(const SgdHyperParams& hp, bool first_step, double grad_scale_inv) {
  SgdConstants c;
  c.grad_scale_inv = static_cast<float>(grad_scale_inv);
  c.scale_grad = grad_scale_inv != 1.0;
  c.maximize = hp.maximize;
  c.has_weight_decay = hp.weight_decay != 0.0;
  c.has_momentum = hp.momentum != 0.0;
  c.first_step = first_step;
  c.nesterov = hp.nesterov;
  c.weight_decay = static_cast<float>(hp.weight_decay);
  c.momentum = static_cast<float>(hp.momentum);
  c.one_minus_dampening = static_cast<float>(1.0 - hp.dampening);
  c.neg_lr = static_cast<float>(-hp.lr);
  return c;
}

}  // namespace mixprec::optim::detail
