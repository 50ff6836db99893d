#include "mixprec/optim/master_remainder.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "optim/kernels/aten_fallback.h"
#include "optim/kernels/kernel_args.h"
#include "optim/kernels/parallel_chunks.h"
#include "optim/kernels/step_args.h"

namespace mixprec::optim {
namespace {

using detail::for_each_chunk;

// The held master's two streams: a BF16 param and its int16 remainder, companions of each other.
void check_held_master(const char* op, const at::Tensor& param, const at::Tensor& remainder) {
  TORCH_CHECK(param.defined(), "[mixprec::", op, "] param is undefined");
  detail::check_typed(op, "param", param, at::kBFloat16, param);
  detail::check_typed(op, "remainder", remainder, at::kShort, param);
}

uint16_t* param_bits(const at::Tensor& param) { return static_cast<uint16_t*>(param.data_ptr()); }
int16_t* remainder_data(const at::Tensor& remainder) { return remainder.data_ptr<int16_t>(); }

detail::ParamStreams held_master_streams(const at::Tensor& param, const at::Tensor& remainder) {
  detail::ParamStreams s;
  s.model_param = param_bits(param);
  s.remainder = remainder_data(remainder);
  s.model_format = detail::ModelFormat::kBF16Remainder;
  return s;
}

}  // namespace

MasterSplit split_master(const at::Tensor& master) {
  TORCH_CHECK(master.defined(), "[mixprec::split_master] master is undefined");
  TORCH_CHECK(master.scalar_type() == at::kFloat,
              "[mixprec::split_master] master must be float32, got ", master.scalar_type());
  const at::Tensor dense = master.contiguous();
  MasterSplit out{at::empty(master.sizes(), master.options().dtype(at::kBFloat16)),
                  at::empty(master.sizes(), master.options().dtype(at::kShort))};
  split_master_out(dense, out.param, out.remainder);
  return out;
}

void split_master_out(const at::Tensor& master, const at::Tensor& param,
                      const at::Tensor& remainder) {
  constexpr const char* op = "split_master";
  TORCH_CHECK(master.defined(), "[mixprec::split_master] master is undefined");
  detail::check_typed(op, "master", master, at::kFloat, master);
  detail::check_typed(op, "param", param, at::kBFloat16, master);
  detail::check_typed(op, "remainder", remainder, at::kShort, master);
  detail::check_disjoint(op, {{"master", &master}, {"param", &param}, {"remainder", &remainder}});
  if (!master.is_cpu()) {
    detail::split_master_aten(master, param, remainder);
    return;
  }
  detail::mark_written({&param, &remainder});
  const float* src = master.const_data_ptr<float>();
  uint16_t* high = param_bits(param);
  int16_t* low = remainder_data(remainder);
  for_each_chunk(master.numel(), [&](int64_t begin, int64_t end) {
    detail::split_master_chunk(src, high, low, begin, end);
  });
}

at::Tensor join_master(const at::Tensor& param, const at::Tensor& remainder) {
  constexpr const char* op = "join_master";
  TORCH_CHECK(param.defined(), "[mixprec::join_master] param is undefined");
  TORCH_CHECK(remainder.defined(), "[mixprec::join_master] remainder is undefined");
  TORCH_CHECK(param.sizes() == remainder.sizes(), "[mixprec::join_master] remainder has shape ",
              remainder.sizes(), " but param has shape ", param.sizes());
  const at::Tensor p = param.contiguous(), r = remainder.contiguous();
  check_held_master(op, p, r);
  at::Tensor master = at::empty(param.sizes(), param.options().dtype(at::kFloat));
  join_master_out(p, r, master);
  return master;
}

void join_master_out(const at::Tensor& param, const at::Tensor& remainder,
                     const at::Tensor& master) {
  constexpr const char* op = "join_master";
  check_held_master(op, param, remainder);
  detail::check_typed(op, "master", master, at::kFloat, param);
  detail::check_disjoint(op, {{"param", &param}, {"remainder", &remainder}, {"master", &master}});
  if (!param.is_cpu()) {
    detail::join_master_aten(param, remainder, master);
    return;
  }
  detail::mark_written({&master});
  const uint16_t* high = param_bits(param);
  const int16_t* low = remainder_data(remainder);
  float* dst = master.data_ptr<float>();
  for_each_chunk(param.numel(), [&](int64_t begin, int64_t end) {
    detail::join_master_chunk(high, low, dst, begin, end);
  });
}

void fused_adam_step_remainder(const at::Tensor& param, const at::Tensor& remainder,
                               const at::Tensor& grad, const at::Tensor& exp_avg,
                               const at::Tensor& exp_avg_sq, const at::Tensor& max_exp_avg_sq,
                               int64_t step, const AdamHyperParams& hp, double grad_scale_inv) {
  constexpr const char* op = "fused_adam_step_remainder";
  check_held_master(op, param, remainder);
  detail::check_adam_state(op, param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, hp,
                           grad_scale_inv);
  detail::check_disjoint(op, {{"param", &param},
                              {"remainder", &remainder},
                              {"grad", &grad},
                              {"exp_avg", &exp_avg},
                              {"exp_avg_sq", &exp_avg_sq},
                              {"max_exp_avg_sq", &max_exp_avg_sq}});
  if (!param.is_cpu()) {
    // Three passes through a temporary FP32 master: same results, more traffic.
    at::Tensor master = at::empty(param.sizes(), param.options().dtype(at::kFloat));
    detail::join_master_aten(param, remainder, master);
    detail::adam_step_aten(master, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, {}, step, hp,
                           grad_scale_inv);
    detail::split_master_aten(master, param, remainder);
    return;
  }
  detail::mark_written({&param, &remainder, &exp_avg, &exp_avg_sq, &max_exp_avg_sq});
  const detail::AdamConstants c = detail::adam_constants(hp, step, grad_scale_inv);
  detail::AdamBuffers b;
  b.param = held_master_streams(param, remainder);
  b.grad = grad.const_data_ptr();
  b.grad_format = detail::grad_format(grad);
  b.exp_avg = exp_avg.data_ptr<float>();
  b.exp_avg_sq = exp_avg_sq.data_ptr<float>();
  b.max_exp_avg_sq = hp.amsgrad ? max_exp_avg_sq.data_ptr<float>() : nullptr;
  for_each_chunk(param.numel(),
                 [&](int64_t begin, int64_t end) { detail::adam_chunk(b, c, begin, end); });
}

void fused_sgd_step_remainder(const at::Tensor& param, const at::Tensor& remainder,
                              const at::Tensor& grad, const at::Tensor& momentum_buffer,
                              bool first_step, const SgdHyperParams& hp, double grad_scale_inv) {
  constexpr const char* op = "fused_sgd_step_remainder";
  check_held_master(op, param, remainder);
  detail::check_sgd_state(op, param, grad, momentum_buffer, hp, grad_scale_inv);
  detail::check_disjoint(op, {{"param", &param},
                              {"remainder", &remainder},
                              {"grad", &grad},
                              {"momentum_buffer", &momentum_buffer}});
  if (!param.is_cpu()) {
    at::Tensor master = at::empty(param.sizes(), param.options().dtype(at::kFloat));
    detail::join_master_aten(param, remainder, master);
    detail::sgd_step_aten(master, grad, momentum_buffer, {}, first_step, hp, grad_scale_inv);
    detail::split_master_aten(master, param, remainder);
    return;
  }
  detail::mark_written({&param, &remainder, &momentum_buffer});
  const detail::SgdConstants c = detail::sgd_constants(hp, first_step, grad_scale_inv);
  detail::SgdBuffers b;
  b.param = held_master_streams(param, remainder);
  b.grad = grad.const_data_ptr();
  b.grad_format = detail::grad_format(grad);
  b.momentum_buffer = c.has_momentum ? momentum_buffer.data_ptr<float>() : nullptr;
  for_each_chunk(param.numel(),
                 [&](int64_t begin, int64_t end) { detail::sgd_chunk(b, c, begin, end); });
}

}  // namespace mixprec::optim
