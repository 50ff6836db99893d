#include "mixprec/optim/fused_kernels.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <utility>
#include <vector>

#include "optim/kernels/aten_fallback.h"
#include "optim/kernels/kernel_args.h"

namespace mixprec::optim {
namespace {

// Elements per unit of work: 32K elements stream ~1 MB over all buffers, enough to amortize
// claiming a chunk while leaving every thread work on mid-sized parameters.
constexpr int64_t kGrainSize = 32 * 1024;

// Calls fn(begin, end) on consecutive kGrainSize chunks of [0, n), on all threads. Chunks are
// claimed from a shared counter rather than split into equal static shares, so that a thread
// whose core is busy with other work (a shared machine, a straggler) does fewer chunks
// instead of making the whole step wait for it. Results do not depend on the split: every
// kernel here is elementwise.
template <class Fn>
void for_each_chunk(int64_t n, const Fn& fn) {
  const int64_t chunks = (n + kGrainSize - 1) / kGrainSize;
  if (chunks <= 1) {
    if (n > 0) fn(int64_t{0}, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(chunks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t k = next++; k < chunks; k = next++) {
      fn(k * kGrainSize, std::min(n, (k + 1) * kGrainSize));
    }
  });
}

using NamedTensor = std::pair<const char*, const at::Tensor*>;

// Every defined tensor must be a dense, contiguous companion of `param`: same device, same
// number of elements. Checked for all tensors before anything is written.
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

void check_fp32(const char* op, const char* name, const at::Tensor& t, const at::Tensor& param) {
  TORCH_CHECK(t.defined(), "[mixprec::", op, "] ", name, " is undefined");
  TORCH_CHECK(t.scalar_type() == at::kFloat, "[mixprec::", op, "] ", name, " must be float32, got ",
              t.scalar_type());
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

// One pass reads and writes all buffers element by element: any sharing of memory between
// them (e.g. exp_avg passed twice) would silently corrupt the update.
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

detail::GradFormat grad_format(const at::Tensor& grad) {
  switch (grad.scalar_type()) {
    case at::kBFloat16:
      return detail::GradFormat::kBF16;
    case at::kHalf:
      return detail::GradFormat::kF16;
    default:
      return detail::GradFormat::kF32;
  }
}

detail::ModelFormat model_format(const at::Tensor& model) {
  if (!model.defined()) return detail::ModelFormat::kNone;
  return model.scalar_type() == at::kBFloat16 ? detail::ModelFormat::kBF16
                                              : detail::ModelFormat::kF16;
}

uint16_t* model_data(const at::Tensor& model) {
  return model.defined() ? static_cast<uint16_t*>(model.data_ptr()) : nullptr;
}

void validate_adam(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq, const at::Tensor& max_exp_avg_sq,
                   const at::Tensor& model_param, int64_t step, const AdamHyperParams& hp,
                   double grad_scale_inv) {
  constexpr const char* op = "fused_adam_step";
  TORCH_CHECK(param.defined(), "[mixprec::fused_adam_step] param is undefined");
  check_fp32(op, "param", param, param);
  check_grad(op, grad, param);
  check_fp32(op, "exp_avg", exp_avg, param);
  check_fp32(op, "exp_avg_sq", exp_avg_sq, param);
  TORCH_CHECK(hp.amsgrad == max_exp_avg_sq.defined(),
              "[mixprec::fused_adam_step] max_exp_avg_sq must be defined exactly when "
              "hp.amsgrad is true (hp.amsgrad = ",
              hp.amsgrad, ")");
  if (hp.amsgrad) check_fp32(op, "max_exp_avg_sq", max_exp_avg_sq, param);
  check_model_param(op, "model_param", model_param, param);
  check_disjoint(op, {{"param", &param},
                      {"grad", &grad},
                      {"exp_avg", &exp_avg},
                      {"exp_avg_sq", &exp_avg_sq},
                      {"max_exp_avg_sq", &max_exp_avg_sq},
                      {"model_param", &model_param}});
  TORCH_CHECK(step >= 1,
              "[mixprec::fused_adam_step] step counts this update and must be >= 1, "
              "got ",
              step);
  check_hyper_params(hp);
  check_scale(op, grad_scale_inv);
}

void validate_sgd(const at::Tensor& param, const at::Tensor& grad,
                  const at::Tensor& momentum_buffer, const at::Tensor& model_param,
                  const SgdHyperParams& hp, double grad_scale_inv) {
  constexpr const char* op = "fused_sgd_step";
  TORCH_CHECK(param.defined(), "[mixprec::fused_sgd_step] param is undefined");
  check_fp32(op, "param", param, param);
  check_grad(op, grad, param);
  TORCH_CHECK((hp.momentum != 0.0) == momentum_buffer.defined(),
              "[mixprec::fused_sgd_step] momentum_buffer must be defined exactly when "
              "hp.momentum != 0 (hp.momentum = ",
              hp.momentum, ")");
  if (momentum_buffer.defined()) check_fp32(op, "momentum_buffer", momentum_buffer, param);
  check_model_param(op, "model_param", model_param, param);
  check_disjoint(op, {{"param", &param},
                      {"grad", &grad},
                      {"momentum_buffer", &momentum_buffer},
                      {"model_param", &model_param}});
  check_hyper_params(hp);
  check_scale(op, grad_scale_inv);
}

// The CPU kernels write through raw pointers, which LibTorch does not see. Each written
// tensor's version counter is bumped as an in-place ATen op would, and before the write, so
// whoever recorded a version sees the change even while the write is in progress: autograd
// (a tensor saved for backward), a checkpoint's state dict (checkpoint/async_save.h).
void mark_written(std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    if (t->defined() && !t->is_inference()) t->unsafeGetTensorImpl()->bump_version();
  }
}

}  // namespace

// Same ranges torch.optim.Adam(W) and SGD accept.
void check_hyper_params(const AdamHyperParams& hp) {
  TORCH_CHECK(hp.lr >= 0.0, "[mixprec::fused_adam_step] invalid hp.lr: ", hp.lr);
  TORCH_CHECK(hp.eps >= 0.0, "[mixprec::fused_adam_step] invalid hp.eps: ", hp.eps);
  TORCH_CHECK(hp.beta1 >= 0.0 && hp.beta1 < 1.0,
              "[mixprec::fused_adam_step] invalid hp.beta1: ", hp.beta1);
  TORCH_CHECK(hp.beta2 >= 0.0 && hp.beta2 < 1.0,
              "[mixprec::fused_adam_step] invalid hp.beta2: ", hp.beta2);
  TORCH_CHECK(hp.weight_decay >= 0.0,
              "[mixprec::fused_adam_step] invalid hp.weight_decay: ", hp.weight_decay);
}

void check_hyper_params(const SgdHyperParams& hp) {
  TORCH_CHECK(hp.lr >= 0.0, "[mixprec::fused_sgd_step] invalid hp.lr: ", hp.lr);
  TORCH_CHECK(hp.momentum >= 0.0, "[mixprec::fused_sgd_step] invalid hp.momentum: ", hp.momentum);
  TORCH_CHECK(hp.weight_decay >= 0.0,
              "[mixprec::fused_sgd_step] invalid hp.weight_decay: ", hp.weight_decay);
  TORCH_CHECK(!hp.nesterov || (hp.momentum > 0.0 && hp.dampening == 0.0),
              "[mixprec::fused_sgd_step] hp.nesterov requires hp.momentum > 0 and "
              "hp.dampening == 0");
}

void fused_adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                     const at::Tensor& exp_avg_sq, const at::Tensor& max_exp_avg_sq,
                     const at::Tensor& model_param, int64_t step, const AdamHyperParams& hp,
                     double grad_scale_inv) {
  validate_adam(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, model_param, step, hp,
                grad_scale_inv);
  if (!param.is_cpu()) {
    detail::adam_step_aten(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, model_param, step, hp,
                           grad_scale_inv);
    return;
  }
  const int64_t n = param.numel();
  if (n == 0) return;
  mark_written({&param, &exp_avg, &exp_avg_sq, &max_exp_avg_sq, &model_param});

  // Constants are derived in double and rounded to float once, as at::_fused_adam_ does.
  const double bias_correction1 = 1.0 - std::pow(hp.beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(hp.beta2, static_cast<double>(step));
  detail::AdamConstants c;
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

  detail::AdamBuffers b;
  b.param = param.data_ptr<float>();
  b.grad = grad.const_data_ptr();
  b.exp_avg = exp_avg.data_ptr<float>();
  b.exp_avg_sq = exp_avg_sq.data_ptr<float>();
  b.max_exp_avg_sq = hp.amsgrad ? max_exp_avg_sq.data_ptr<float>() : nullptr;
  b.model_param = model_data(model_param);
  b.grad_format = grad_format(grad);
  b.model_format = model_format(model_param);
  for_each_chunk(n, [&](int64_t begin, int64_t end) { detail::adam_chunk(b, c, begin, end); });
}

void fused_sgd_step(const at::Tensor& param, const at::Tensor& grad,
                    const at::Tensor& momentum_buffer, const at::Tensor& model_param,
                    bool first_step, const SgdHyperParams& hp, double grad_scale_inv) {
  validate_sgd(param, grad, momentum_buffer, model_param, hp, grad_scale_inv);
  if (!param.is_cpu()) {
    detail::sgd_step_aten(param, grad, momentum_buffer, model_param, first_step, hp,
                          grad_scale_inv);
    return;
  }
  const int64_t n = param.numel();
  if (n == 0) return;
  mark_written({&param, &momentum_buffer, &model_param});

  detail::SgdConstants c;
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

  detail::SgdBuffers b;
  b.param = param.data_ptr<float>();
  b.grad = grad.const_data_ptr();
  b.momentum_buffer = c.has_momentum ? momentum_buffer.data_ptr<float>() : nullptr;
  b.model_param = model_data(model_param);
  b.grad_format = grad_format(grad);
  b.model_format = model_format(model_param);
  for_each_chunk(n, [&](int64_t begin, int64_t end) { detail::sgd_chunk(b, c, begin, end); });
}

GradStats grad_stats(const at::Tensor& grad, double grad_scale_inv) {
  TORCH_CHECK(grad.defined(), "[mixprec::grad_stats] grad is undefined");
  const auto dtype = grad.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "[mixprec::grad_stats] grad must be float32, bfloat16 or float16, got ", dtype);
  check_companion("grad_stats", "grad", grad, grad);
  check_scale("grad_stats", grad_scale_inv);
  if (!grad.is_cpu()) return detail::grad_stats_aten(grad, grad_scale_inv);

  // Fixed chunk boundaries and an in-order final sum: the result does not depend on the
  // number of threads.
  const int64_t n = grad.numel();
  const int64_t chunks = (n + kGrainSize - 1) / kGrainSize;
  std::vector<double> partial(static_cast<size_t>(chunks), 0.0);
  const void* data = grad.const_data_ptr();
  const auto format = grad_format(grad);
  for_each_chunk(n, [&](int64_t begin, int64_t end) {
    partial[begin / kGrainSize] = detail::sum_of_squares_chunk(data, format, begin, end);
  });
  double raw = 0.0;
  for (double s : partial) raw += s;
  // Σ(g·s)² = s²·Σg²: scaling once at the end keeps the pass free of multiplies and cannot
  // overflow a float intermediate for large s.
  GradStats stats;
  stats.sum_of_squares = raw * grad_scale_inv * grad_scale_inv;
  stats.all_finite = std::isfinite(raw);
  return stats;
}

void copy_master_to_model(const at::Tensor& master, const at::Tensor& model_param) {
  constexpr const char* op = "copy_master_to_model";
  TORCH_CHECK(master.defined(), "[mixprec::copy_master_to_model] master is undefined");
  check_fp32(op, "master", master, master);
  TORCH_CHECK(model_param.defined(), "[mixprec::copy_master_to_model] model_param is undefined");
  check_model_param(op, "model_param", model_param, master);
  check_disjoint(op, {{"master", &master}, {"model_param", &model_param}});
  if (!master.is_cpu()) {
    detail::copy_master_to_model_aten(master, model_param);
    return;
  }
  mark_written({&model_param});
  const float* src = master.const_data_ptr<float>();
  uint16_t* dst = model_data(model_param);
  const auto format = model_format(model_param);
  for_each_chunk(master.numel(), [&](int64_t begin, int64_t end) {
    detail::master_to_model_chunk(src, dst, format, begin, end);
  });
}

}  // namespace mixprec::optim
