#include "mixprec/optim/fused_kernels.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <vector>

#include "optim/kernels/aten_fallback.h"
#include "optim/kernels/kernel_args.h"
#include "optim/kernels/parallel_chunks.h"
#include "optim/kernels/step_args.h"

namespace mixprec::optim {

using detail::for_each_chunk;

void check_hyper_params(const AdamHyperParams& hp) {
  detail::check_adam_hyper_params("fused_adam_step", hp);
}

void check_hyper_params(const SgdHyperParams& hp) {
  detail::check_sgd_hyper_params("fused_sgd_step", hp);
}

void fused_adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                     const at::Tensor& exp_avg_sq, const at::Tensor& max_exp_avg_sq,
                     const at::Tensor& model_param, int64_t step, const AdamHyperParams& hp,
                     double grad_scale_inv) {
  constexpr const char* op = "fused_adam_step";
  TORCH_CHECK(param.defined(), "[mixprec::fused_adam_step] param is undefined");
  detail::check_typed(op, "param", param, at::kFloat, param);
  detail::check_adam_state(op, param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, hp,
                           grad_scale_inv);
  detail::check_model_param(op, "model_param", model_param, param);
  detail::check_disjoint(op, {{"param", &param},
                              {"grad", &grad},
                              {"exp_avg", &exp_avg},
                              {"exp_avg_sq", &exp_avg_sq},
                              {"max_exp_avg_sq", &max_exp_avg_sq},
                              {"model_param", &model_param}});
  if (!param.is_cpu()) {
    detail::adam_step_aten(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, model_param, step, hp,
                           grad_scale_inv);
    return;
  }
  detail::mark_written({&param, &exp_avg, &exp_avg_sq, &max_exp_avg_sq, &model_param});
  const detail::AdamConstants c = detail::adam_constants(hp, step, grad_scale_inv);
  detail::AdamBuffers b;
  b.param.param = param.data_ptr<float>();
  b.param.model_param = detail::model_data(model_param);
  b.param.model_format = detail::model_format(model_param);
  b.grad = grad.const_data_ptr();
  b.grad_format = detail::grad_format(grad);
  b.exp_avg = exp_avg.data_ptr<float>();
  b.exp_avg_sq = exp_avg_sq.data_ptr<float>();
  b.max_exp_avg_sq = hp.amsgrad ? max_exp_avg_sq.data_ptr<float>() : nullptr;
  for_each_chunk(param.numel(),
                 [&](int64_t begin, int64_t end) { detail::adam_chunk(b, c, begin, end); });
}

void fused_sgd_step(const at::Tensor& param, const at::Tensor& grad,
                    const at::Tensor& momentum_buffer, const at::Tensor& model_param,
                    bool first_step, const SgdHyperParams& hp, double grad_scale_inv) {
  constexpr const char* op = "fused_sgd_step";
  TORCH_CHECK(param.defined(), "[mixprec::fused_sgd_step] param is undefined");
  detail::check_typed(op, "param", param, at::kFloat, param);
  detail::check_sgd_state(op, param, grad, momentum_buffer, hp, grad_scale_inv);
  detail::check_model_param(op, "model_param", model_param, param);
  detail::check_disjoint(op, {{"param", &param},
                              {"grad", &grad},
                              {"momentum_buffer", &momentum_buffer},
                              {"model_param", &model_param}});
  if (!param.is_cpu()) {
    detail::sgd_step_aten(param, grad, momentum_buffer, model_param, first_step, hp,
                          grad_scale_inv);
    return;
  }
  detail::mark_written({&param, &momentum_buffer, &model_param});
  const detail::SgdConstants c = detail::sgd_constants(hp, first_step, grad_scale_inv);
  detail::SgdBuffers b;
  b.param.param = param.data_ptr<float>();
  b.param.model_param = detail::model_data(model_param);
  b.param.model_format = detail::model_format(model_param);
  b.grad = grad.const_data_ptr();
  b.grad_format = detail::grad_format(grad);
  b.momentum_buffer = c.has_momentum ? momentum_buffer.data_ptr<float>() : nullptr;
  for_each_chunk(param.numel(),
                 [&](int64_t begin, int64_t end) { detail::sgd_chunk(b, c, begin, end); });
}

GradStats grad_stats(const at::Tensor& grad, double grad_scale_inv) {
  TORCH_CHECK(grad.defined(), "[mixprec::grad_stats] grad is undefined");
  detail::check_grad("grad_stats", grad, grad);
  detail::check_scale("grad_stats", grad_scale_inv);
  double raw = 0.0;
  if (!grad.is_cpu()) {
    raw = detail::sum_of_squares_aten(grad);
  } else {
    // Fixed chunk boundaries and an in-order final sum: the result does not depend on the
    // number of threads.
    const int64_t n = grad.numel();
    const int64_t chunks = (n + detail::kGrainSize - 1) / detail::kGrainSize;
    std::vector<double> partial(static_cast<size_t>(chunks), 0.0);
    const void* data = grad.const_data_ptr();
    const auto format = detail::grad_format(grad);
    for_each_chunk(n, [&](int64_t begin, int64_t end) {
      partial[begin / detail::kGrainSize] = detail::sum_of_squares_chunk(data, format, begin, end);
    });
    for (double s : partial) raw += s;
  }
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
  detail::check_typed(op, "master", master, at::kFloat, master);
  TORCH_CHECK(model_param.defined(), "[mixprec::copy_master_to_model] model_param is undefined");
  detail::check_model_param(op, "model_param", model_param, master);
  detail::check_disjoint(op, {{"master", &master}, {"model_param", &model_param}});
  if (!master.is_cpu()) {
    detail::copy_master_to_model_aten(master, model_param);
    return;
  }
  detail::mark_written({&model_param});
  const float* src = master.const_data_ptr<float>();
  uint16_t* dst = detail::model_data(model_param);
  const auto format = detail::model_format(model_param);
  for_each_chunk(master.numel(), [&](int64_t begin, int64_t end) {
    detail::master_to_model_chunk(src, dst, format, begin, end);
  });
}

}  // namespace mixprec::optim
