// Cross-entropy of half-precision logits, computed in FP32 without an FP32 copy of them.
//
// A mixed-precision model's head returns BF16 or FP16 logits, and the loss must be taken in
// FP32 (a softmax over a vocabulary sums thousands of terms). In LibTorch that is
// at::cross_entropy_loss(logits.to(at::kFloat), targets): a cast that writes an FP32 copy of
// the logits, a log-softmax that writes another one (both kept for backward), and in backward
// a zero-filled FP32 gradient, the log-softmax's backward and a cast back — five passes over
// [N, V] FP32 tensors. Here forward reads the logits once per row and keeps one FP32 number per
// row (its log-sum-exp); backward reads them once more and writes the gradient in their own
// dtype. Megatron and Transformer Engine fuse their cross-entropy for the same reason.
//
// Exactness: the same mathematics in FP32 as LibTorch's, not the same bits. Each row's sum of
// exponentials is taken in another order and exp is another polynomial, so the loss and the
// FP32 gradient differ from LibTorch's in the last bits (the loss by 2e-6 relative at most in
// the tests); the gradient, rounded once to the logits' dtype, equals LibTorch's in all but a
// few elements, one unit in the last place apart — more only at a target's element whose
// probability is near 1, where p - 1 cancels and both carry p's rounding (a few FP32 ulps of
// 1/N). Results do not depend on the number of threads.
#pragma once

#include <ATen/core/Tensor.h>

namespace mixprec {

// The mean over rows i of logsumexp(logits[i]) - logits[i][targets[i]], as an FP32 scalar, for
// logits [N, V] of dtype BF16, FP16 or FP32 (any strides) and targets [N] int64 in [0, V):
// at::cross_entropy_loss(logits.to(at::kFloat), targets) with the default options (mean, no
// ignored index, no class weights, no label smoothing). Differentiable in logits: the gradient,
// (softmax(logits[i]) - onehot(targets[i])) * grad / N, comes in logits' dtype; once only (a
// backward with create_graph throws: use the LibTorch composition for second derivatives).
// A row with a NaN, a +Inf or nothing but -Inf has a NaN loss and gradient, as LibTorch's.
// On the CPU a fused kernel computes it (above); on other devices that LibTorch composition.
// Throws c10::Error naming the problem if logits is not 2-D with V >= 1 or of another dtype,
// targets is not int64 [N], the two are on different devices, or (on the CPU; elsewhere
// LibTorch's own check applies) a target lies outside [0, V), naming its row and value.
at::Tensor cross_entropy_in_fp32(const at::Tensor& logits, const at::Tensor& targets);

}  // namespace mixprec
