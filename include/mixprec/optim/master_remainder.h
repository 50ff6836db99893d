// Lossless master remainders: the FP32 master of a BF16 parameter held as the BF16 parameter
// itself plus a 16-bit remainder (Transformer Engine's `store_param_remainders`; the same bits
// for every non-NaN master).
// Optimizer state per parameter drops from 12 bytes (master 4 + moments 8) to 10 (remainder 2
// + moments 8), and a fused Adam step moves 26 bytes per parameter instead of 28.
//
// Format. With u the master's 32 bits, b the BF16 param's 16 bits, r the int16 remainder:
//   split:  b = (u + 0x8000) >> 16,  r = int16(u & 0xFFFF)
//   join:   u = (b << 16) + r        (32-bit wrap-around; r < 0 exactly when split rounded up)
// So the master is recovered exactly, and b is u rounded to the nearest BF16 value, ties away
// from zero (carries run into the exponent, up to Inf, as in any BF16 rounding).
//
// Why not ties-to-even: no 16-bit remainder can pair with b = RNE(u) losslessly. RNE maps
// 65537 FP32 patterns onto each even, finite, nonzero b (both neighbouring ties) and 65535
// onto each odd b, but a remainder tells apart only 65536. A lossless split must round every tie
// the same way; rounding ties up in the bits (away from zero) is TE's choice. Consequence: b equals
// RNE(master) -- what fused_adam_step writes to a separate BF16 model param -- except when the
// master lies exactly halfway between two BF16 values with an even lower one (low 16 bits
// 0x8000, bit 16 clear): then b is one BF16 ulp further from zero. Masters and moments are
// bitwise those of the FP32-master path; only such exact ties differ in the BF16 param.
//
// NaN: a NaN master splits into a quiet NaN b of the same sign (b = (u >> 16) | 0x0040, what
// RNE gives) and r = the low half; join returns (b << 16) | (r & 0xFFFF) for a NaN b. So join
// inverts split for every FP32 pattern except signalling NaNs, which come back quieted (bit 22
// set, payload kept), as any FP32 arithmetic would return them; ±Inf, ±0 and subnormals are
// exact. (A carry out of a NaN's mantissa would otherwise wrap b to ±0 or ±Inf.)
//
// All functions: CPU tensors take a vectorized (SIMD chosen at run time), multithreaded path
// whose results do not depend on the number of threads; other devices use ATen ops.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "mixprec/optim/hyper_params.h"

namespace mixprec::optim {

// A master split into its BF16 param and int16 remainder, both shaped like the master.
struct MasterSplit {
  at::Tensor param;      // bfloat16
  at::Tensor remainder;  // int16
};

// Splits `master` (float32, any shape and strides). Throws c10::Error if it is not float32.
MasterSplit split_master(const at::Tensor& master);
// The same into existing tensors: param (bfloat16) and remainder (int16), contiguous, with the
// master's device and numel, not sharing memory with it or each other. Throws c10::Error
// naming the argument otherwise, before writing anything.
void split_master_out(const at::Tensor& master, const at::Tensor& param,
                      const at::Tensor& remainder);

// The master (float32, shaped like `param`) held by param (bfloat16) + remainder (int16, same
// shape and device). Throws c10::Error naming the argument otherwise.
at::Tensor join_master(const at::Tensor& param, const at::Tensor& remainder);
// The same into an existing float32 `master` (contiguous, same device and numel, disjoint).
void join_master_out(const at::Tensor& param, const at::Tensor& remainder,
                     const at::Tensor& master);

// One Adam/AdamW update of a BF16 parameter whose master is held as param + remainder, in
// place: per element it rebuilds the FP32 master in registers, runs exactly fused_adam_step's
// update (optim/fused_kernels.h), and splits the new master back. Results: the master (join of
// the outputs), exp_avg, exp_avg_sq and max_exp_avg_sq are bitwise those of fused_adam_step on
// join_master(param, remainder) with the same arguments; param is split_master's rounding of
// that master (RNE but for exact ties, see above).
//   param          bfloat16, updated (the model's parameter)
//   remainder      int16, updated
//   grad           float32/bfloat16/float16, read only; the update uses grad * grad_scale_inv
//   exp_avg, exp_avg_sq   float32, updated
//   max_exp_avg_sq float32, updated; must be defined iff hp.amsgrad
//   step           the step count including this update (1 on the first call)
// All tensors: same device, same numel, contiguous, no two sharing memory. Throws c10::Error
// naming the offending argument otherwise, before writing anything.
void fused_adam_step_remainder(const at::Tensor& param, const at::Tensor& remainder,
                               const at::Tensor& grad, const at::Tensor& exp_avg,
                               const at::Tensor& exp_avg_sq, const at::Tensor& max_exp_avg_sq,
                               int64_t step, const AdamHyperParams& hp,
                               double grad_scale_inv = 1.0);

// One SGD update of a BF16 parameter held as param + remainder, in place: bitwise
// fused_sgd_step on the joined master, as above. `momentum_buffer` (float32) must be defined
// iff hp.momentum != 0; on `first_step` it is overwritten with the (decayed) gradient.
void fused_sgd_step_remainder(const at::Tensor& param, const at::Tensor& remainder,
                              const at::Tensor& grad, const at::Tensor& momentum_buffer,
                              bool first_step, const SgdHyperParams& hp,
                              double grad_scale_inv = 1.0);

}  // namespace mixprec::optim
