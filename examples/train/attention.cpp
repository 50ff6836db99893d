#include "attention.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

namespace train {
namespace {

struct CausalAttentionInFp32 : torch::autograd::Function<CausalAttentionInFp32> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v) {
    auto [out, logsumexp] = at::_scaled_dot_product_flash_attention_for_cpu(
        q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), /*dropout_p=*/0.0,
        /*is_causal=*/true);
    ctx->save_for_backward({q, k, v, out, logsumexp});
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2];
    auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        grads[0].contiguous(), q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), saved[3],
        saved[4], /*dropout_p=*/0.0, /*is_causal=*/true);
    return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type())};
  }
};

}  // namespace

at::Tensor causal_attention_in_fp32(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 4 && q.sizes() == k.sizes() && q.sizes() == v.sizes() &&
                  q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf ||
                   q.scalar_type() == at::kFloat) &&
                  q.device().is_cpu(),
              "[mixprec-train::causal_attention_in_fp32] q, k, v must be CPU tensors of one shape "
              "[B, heads, T, head_dim] and one dtype, BF16, FP16 or FP32 (cast to FP32 exactly); "
              "got ",
              q.sizes(), " ", q.scalar_type(), ", ", k.sizes(), " ", k.scalar_type(), ", ",
              v.sizes(), " ", v.scalar_type());
  return CausalAttentionInFp32::apply(q, k, v);
}

}  // namespace train
