// Private interface between the ATen-facing cross-entropy (precision/cross_entropy.cpp, which
// checks tensors and splits rows over threads) and its per-target SIMD kernels
// (cross_entropy_simd.cpp, compiled once per Highway target and chosen at run time, as
// src/optim/kernels are). Free of ATen types: the SIMD translation unit includes only Highway.
#pragma once

#include <cstdint>

#include "optim/kernels/kernel_args.h"

namespace mixprec::detail {

// Element format of the logits (and of their gradient): the optimizer kernels' gradient formats,
// whose exact widening and narrowing the kernel shares (optim/kernels/simd_convert-inl.h).
using LogitFormat = optim::detail::GradFormat;

// For each row r in [begin, end) of logits [rows, classes] (contiguous): lse[r] =
// logsumexp(logits[r]) and loss[r] = lse[r] - logits[r][targets[r]], in FP32. Targets are in
// range (the caller checked).
void cross_entropy_forward_rows(const void* logits, LogitFormat format, int64_t classes,
                                const int64_t* targets, float* loss, float* lse, int64_t begin,
                                int64_t end);

// For each row r in [begin, end): grad[r][c] = (exp(logits[r][c] - lse[r]) - [c ==
// targets[r]]) * scale, rounded once (to nearest even) into the logits' format.
void cross_entropy_backward_rows(const void* logits, LogitFormat format, int64_t classes,
                                 const int64_t* targets, const float* lse, float scale, void* grad,
                                 int64_t begin, int64_t end);

}  // namespace mixprec::detail
