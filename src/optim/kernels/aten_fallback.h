// The fused kernels' semantics written as ATen tensor ops: the path for tensors that are not
// on the CPU (the dispatcher runs whatever device kernels ATen has). Same operation order as
// the SIMD kernels, so only ATen's own rounding choices (e.g. a scalar division done as a
// reciprocal multiply) separate the two; tests run it on CPU tensors against the SIMD path.
//
// Arguments are validated by the public entry points (fused_kernels.cpp) before these run.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "mixprec/optim/hyper_params.h"

namespace mixprec::optim::detail {

void adam_step_aten(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, const at::Tensor& max_exp_avg_sq,
                    const at::Tensor& model_param, int64_t step, const AdamHyperParams& hp,
                    double grad_scale_inv);

void sgd_step_aten(const at::Tensor& param, const at::Tensor& grad,
                   const at::Tensor& momentum_buffer, const at::Tensor& model_param,
                   bool first_step, const SgdHyperParams& hp, double grad_scale_inv);

// Σ grad² in double, unscaled (the caller applies grad_scale_inv², as on the SIMD path).
double sum_of_squares_aten(const at::Tensor& grad);

void copy_master_to_model_aten(const at::Tensor& master, const at::Tensor& model_param);

// Master remainders (mixprec/optim/master_remainder.h) in integer tensor ops.
void split_master_aten(const at::Tensor& master, const at::Tensor& param,
                       const at::Tensor& remainder);
void join_master_aten(const at::Tensor& param, const at::Tensor& remainder,
                      const at::Tensor& master);

}  // namespace mixprec::optim::detail
