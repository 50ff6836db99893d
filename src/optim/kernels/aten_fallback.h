// The fused kernels' semantics written as ATen tensor ops: the path for tensors that are not
// on the CPU (the dispatcher runs whatever device kernels ATen has). Same operation order as
// the SIMD kernels, so only ATen's own rounding choices (e.g. a scalar division done as a
// reciprocal multiply) separate the two; tests run it on CPU tensors against the SIMD path.
//
// Arguments are validated by the public entry points (fused_kernels.cpp) before these run.
#pragma once

#include "mixprec/optim/fused_kernels.h"

namespace mixprec::optim::detail {

void adam_step_aten(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, const at::Tensor& max_exp_avg_sq,
                    const at::Tensor& model_param, int64_t step, const AdamHyperParams& hp,
                    double grad_scale_inv);

void sgd_step_aten(const at::Tensor& param, const at::Tensor& grad,
                   const at::Tensor& momentum_buffer, const at::Tensor& model_param,
                   bool first_step, const SgdHyperParams& hp, double grad_scale_inv);

GradStats grad_stats_aten(const at::Tensor& grad, double grad_scale_inv);

void copy_master_to_model_aten(const at::Tensor& master, const at::Tensor& model_param);

}  // namespace mixprec::optim::detail
