// From the public entry points' arguments (tensors, hyper-parameters) to the kernels' raw
// arguments (kernel_args.h): the argument checks every fused step shares, the stream formats,
// and the per-step constants. Used by fused_kernels.cpp and master_remainder.cpp.
//
// Every check throws c10::Error "[mixprec::<op>] <argument> ..." and writes nothing.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <initializer_list>
#include <utility>
#include <vector>

#include "mixprec/optim/hyper_params.h"
#include "optim/kernels/kernel_args.h"

namespace mixprec::optim::detail {

using NamedTensor = std::pair<const char*, const at::Tensor*>;

// `t` is a dense, contiguous companion of `param`: same device, same number of elements.
void check_companion(const char* op, const char* name, const at::Tensor& t,
                     const at::Tensor& param);
// `t` is defined, of dtype `dtype`, and a companion of `param`.
void check_typed(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype,
                 const at::Tensor& param);
// A gradient (FP32/BF16/FP16) companion of `param`.
void check_grad(const char* op, const at::Tensor& grad, const at::Tensor& param);
// If defined: a BF16/FP16 companion of `param`.
void check_model_param(const char* op, const char* name, const at::Tensor& model,
                       const at::Tensor& param);
// One pass reads and writes all buffers element by element: no two may share memory.
void check_disjoint(const char* op, const std::vector<NamedTensor>& tensors);
void check_scale(const char* op, double grad_scale_inv);
void check_adam_hyper_params(const char* op, const AdamHyperParams& hp);
void check_sgd_hyper_params(const char* op, const SgdHyperParams& hp);

// Everything of an Adam step but the parameter's own streams: gradient, moments (FP32
// companions of `param`), step, hyper-parameters, scale.
void check_adam_state(const char* op, const at::Tensor& param, const at::Tensor& grad,
                      const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                      const at::Tensor& max_exp_avg_sq, int64_t step, const AdamHyperParams& hp,
                      double grad_scale_inv);
// The same for an SGD step.
void check_sgd_state(const char* op, const at::Tensor& param, const at::Tensor& grad,
                     const at::Tensor& momentum_buffer, const SgdHyperParams& hp,
                     double grad_scale_inv);

// The CPU kernels write through raw pointers, which LibTorch does not see. Each written
// tensor's version counter is bumped as an in-place ATen op would, and before the write, so
// whoever recorded a version sees the change even while the write is in progress: autograd
// (a tensor saved for backward), a checkpoint's state dict (checkpoint/async_save.h), the
// optimizer's check for outside writes. Undefined and inference tensors are skipped.
void mark_written(std::initializer_list<const at::Tensor*> tensors);

GradFormat grad_format(const at::Tensor& grad);
// kNone for an undefined tensor, else kBF16 or kF16.
ModelFormat model_format(const at::Tensor& model);
uint16_t* model_data(const at::Tensor& model);

// The constants of one step, each rounded to float once (as LibTorch's fused kernels do).
AdamConstants adam_constants(const AdamHyperParams& hp, int64_t step, double grad_scale_inv);
SgdConstants sgd_constants(const SgdHyperParams& hp, bool first_step, double grad_scale_inv);

}  // namespace mixprec::optim::detail
