#include "mixprec/precision/cross_entropy.h"

#include "optim/kernels/parallel_chunks.h"
#include "optim/kernels/step_args.h"
#include "precision/kernels/cross_entropy_args.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace mixprec {
namespace {

constexpr const char* kWho = "[mixprec::cross_entropy_in_fp32]";

// Rows in chunks of about kGrainSize logits, as the optimizer kernels split elements. Each row
// is computed the same way on any thread, so the results do not depend on the split.
template <class Fn>
void for_each_row_chunk(int64_t rows, int64_t classes, const Fn& fn) {
  optim::detail::for_each_chunk(rows, std::max<int64_t>(1, optim::detail::kGrainSize / classes),
                                fn);
}

struct CrossEntropyInFp32 : torch::autograd::Function<CrossEntropyInFp32> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& targets) {
    at::NoGradGuard no_grad;
    const at::Tensor x = logits.contiguous();
    const at::Tensor t = targets.contiguous();
    const int64_t rows = x.size(0), classes = x.size(1);
    at::Tensor loss = at::empty({rows}, x.options().dtype(at::kFloat));
    at::Tensor lse = at::empty({rows}, x.options().dtype(at::kFloat));
    const detail::LogitFormat format = optim::detail::grad_format(x);
    for_each_row_chunk(rows, classes, [&](int64_t begin, int64_t end) {
      detail::cross_entropy_forward_rows(
          x.const_data_ptr(), format, classes, t.const_data_ptr<int64_t>(),
          loss.mutable_data_ptr<float>(), lse.mutable_data_ptr<float>(), begin, end);
    });
    ctx->save_for_backward({x, t, lse});
    // The mean in a fixed order, in double: the same on any number of threads.
    double total = 0.0;
    const float* row_loss = loss.const_data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) total += row_loss[r];
    return at::scalar_tensor(static_cast<float>(total / static_cast<double>(rows)),
                             x.options().dtype(at::kFloat));
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};
    // The gradient is written by the kernel, outside autograd: it has no derivative of its own.
    TORCH_CHECK(!at::GradMode::is_enabled(), kWho,
                " has no second derivative: backward with create_graph is not supported (the "
                "LibTorch composition, at::cross_entropy_loss(logits.to(at::kFloat), targets), "
                "has one)");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &t = saved[1], &lse = saved[2];
    const int64_t rows = x.size(0), classes = x.size(1);
    const float scale = grads[0].item<float>() / static_cast<float>(rows);
    at::Tensor grad = at::empty_like(x);
    const detail::LogitFormat format = optim::detail::grad_format(x);
    for_each_row_chunk(rows, classes, [&](int64_t begin, int64_t end) {
      detail::cross_entropy_backward_rows(x.const_data_ptr(), format, classes,
                                          t.const_data_ptr<int64_t>(), lse.const_data_ptr<float>(),
                                          scale, grad.mutable_data_ptr(), begin, end);
    });
    return {grad, at::Tensor()};
  }
};

}  // namespace

at::Tensor cross_entropy_in_fp32(const at::Tensor& logits, const at::Tensor& targets) {
  TORCH_CHECK(logits.defined() && targets.defined(), kWho, " logits and targets must be defined");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) >= 1, kWho,
              " logits must be [N, V] with V >= 1, got shape ", logits.sizes());
  const auto dtype = logits.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat, kWho,
              " logits must be BF16, FP16 or FP32, got ", dtype);
  TORCH_CHECK(
      targets.scalar_type() == at::kLong && targets.dim() == 1 && targets.size(0) == logits.size(0),
      kWho, " targets must be int64 [N] for logits ", logits.sizes(), ", got ",
      targets.scalar_type(), " ", targets.sizes());
  TORCH_CHECK(targets.device() == logits.device(), kWho, " logits are on ", logits.device(),
              ", targets on ", targets.device());
  // Elsewhere, and for what the kernel does not read (no rows: LibTorch's NaN mean), the
  // composition it replaces.
  if (!logits.device().is_cpu() || logits.layout() != at::kStrided || logits.is_conj() ||
      logits.is_neg() || logits._is_zerotensor() || logits.size(0) == 0) {
    return at::cross_entropy_loss(logits.to(at::kFloat), targets);
  }
  // The kernel numbers a row's columns in int32 lanes (up to 16 past the last).
  TORCH_CHECK(logits.size(1) <= std::numeric_limits<int32_t>::max() - 64, kWho, " ", logits.size(1),
              " classes: at most 2^31 - 65");
  {
    const at::Tensor t = targets.contiguous();
    const int64_t* target = t.const_data_ptr<int64_t>();
    for (int64_t r = 0; r < t.numel(); ++r) {
      TORCH_CHECK(target[r] >= 0 && target[r] < logits.size(1), kWho, " target ", target[r],
                  " of row ", r, " lies outside [0, ", logits.size(1), ")");
    }
  }
  return CrossEntropyInFp32::apply(logits, targets);
}

}  // namespace mixprec
