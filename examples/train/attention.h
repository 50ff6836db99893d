// Causal self-attention computed in FP32 from half-precision q, k, v, keeping the half tensors
// for backward instead of their FP32 copies.
//
// LibTorch's CPU attention kernel is faster in FP32 than in BF16 at these sizes (gpt.cpp), so
// the block casts q, k and v up before it. Through autograd, that cast's outputs are what the
// kernel saves for backward: three FP32 copies of tensors that are BF16 to begin with, 3 MiB
// per block of the default model. This function calls the same kernel and its backward
// directly and keeps q, k and v as they came (the BF16 → FP32 cast is exact, so backward
// recasts them to the same values): the same outputs and gradients bit for bit, 1.5 MiB per
// block less kept (tests/train/model_test.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace train {

// softmax(q kᵀ / √head_dim + causal mask) v for q, k, v [B, heads, T, head_dim] of one dtype,
// BF16, FP16 or FP32; returns the FP32 result. Backward returns gradients in q's dtype.
at::Tensor causal_attention_in_fp32(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

}  // namespace train
