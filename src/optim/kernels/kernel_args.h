// Private interface between the public fused-kernel entry points (fused_kernels.cpp, which
// validates tensors and splits the work over threads) and the per-target SIMD kernels
// (*_simd.cpp, compiled once per Highway target and chosen at run time).
//
// Deliberately free of ATen types: the SIMD translation units include only Highway, so they
// compile without LibTorch's headers and with their own floating-point flags
// (-ffp-contract=off, see optim.cmake).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mixprec::optim::detail {

// Element formats of the 16/32-bit streams the kernels read or write.
enum class GradFormat : int { kF32, kBF16, kF16 };
// How the parameter is held:
//   kNone           an FP32 param (a native FP32 parameter, or a main copy nobody mirrors)
//   kBF16, kF16     an FP32 main copy, mirrored to a BF16/FP16 model param (RNE) after a step
//   kBF16Remainder  no FP32 copy: the master is the BF16 model param plus an int16 remainder
//                   (mixprec/optim/master_remainder.h), read and written in place
enum class ModelFormat : int { kNone, kBF16, kF16, kBF16Remainder };

// Where a parameter lives; which pointers are set depends on the ModelFormat.
struct ParamStreams {
  float* param = nullptr;           // FP32; all formats but kBF16Remainder
  uint16_t* model_param = nullptr;  // BF16/FP16 bits; all formats but kNone
  int16_t* remainder = nullptr;     // kBF16Remainder only
  ModelFormat model_format = ModelFormat::kNone;
};

// Per-step Adam constants, each rounded to float exactly once (from double, as
// at::_fused_adam_ does), so every lane and every thread uses identical values.
struct AdamConstants {
  float grad_scale_inv = 1.f;  // multiplied into the gradient unless scale_grad is false
  bool scale_grad = false;
  bool maximize = false;
  bool decoupled = true;  // AdamW: param *= param_decay; Adam: grad += weight_decay * param
  bool has_weight_decay = false;
  bool amsgrad = false;
  float weight_decay = 0.f;  // L2 coefficient (Adam)
  float param_decay = 1.f;   // 1 - lr * weight_decay (AdamW)
  float lerp_weight = 0.1f;  // 1 - beta1: exp_avg.lerp_(grad, 1 - beta1)
  float beta2 = 0.999f;
  float one_minus_beta2 = 0.001f;
  float bias_correction2_sqrt = 1.f;
  float eps = 1e-8f;
  float neg_step_size = -1e-3f;  // -lr / bias_correction1
};

// Raw pointers for one parameter; elements [begin, end) of every stream are processed.
struct AdamBuffers {
  ParamStreams param;
  const void* grad = nullptr;  // GradFormat
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  float* max_exp_avg_sq = nullptr;  // only when amsgrad
  GradFormat grad_format = GradFormat::kF32;
};

struct SgdConstants {
  float grad_scale_inv = 1.f;
  bool scale_grad = false;
  bool maximize = false;
  bool has_weight_decay = false;
  bool has_momentum = false;
  bool first_step = false;
  bool nesterov = false;
  float weight_decay = 0.f;
  float momentum = 0.f;
  float one_minus_dampening = 1.f;
  float neg_lr = -1e-3f;
};

struct SgdBuffers {
  ParamStreams param;
  const void* grad = nullptr;
  float* momentum_buffer = nullptr;  // only when has_momentum
  GradFormat grad_format = GradFormat::kF32;
};

// One chunk of work each; called from at::parallel_for bodies, so chunks must not overlap.
void adam_chunk(const AdamBuffers& buffers, const AdamConstants& constants, int64_t begin,
                int64_t end);
void sgd_chunk(const SgdBuffers& buffers, const SgdConstants& constants, int64_t begin,
               int64_t end);
// model[i] = RNE(master[i]) for i in [begin, end).
void master_to_model_chunk(const float* master, uint16_t* model, ModelFormat format, int64_t begin,
                           int64_t end);
// Master remainders (mixprec/optim/master_remainder.h) for i in [begin, end):
// (param[i], remainder[i]) = split(master[i]), and master[i] = join(param[i], remainder[i]).
void split_master_chunk(const float* master, uint16_t* param, int16_t* remainder, int64_t begin,
                        int64_t end);
void join_master_chunk(const uint16_t* param, const int16_t* remainder, float* master,
                       int64_t begin, int64_t end);
// Σ grad[i]² over [begin, end), accumulated in double; Inf/NaN inputs make it non-finite.
double sum_of_squares_chunk(const void* grad, GradFormat format, int64_t begin, int64_t end);

// Test hooks (simd_targets.cpp). Names of the compiled Highway targets this CPU supports,
// best first, and a switch that makes every kernel above run one of them ("" restores the
// automatic choice). Not thread-safe: for tests and benchmarks only.
std::vector<std::string> supported_simd_targets();
void force_simd_target(const std::string& name);
std::string active_simd_target();

}  // namespace mixprec::optim::detail
