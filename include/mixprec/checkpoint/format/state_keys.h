// The names a training checkpoint reserves: tensor keys and common-state fields.
//
// This header is the one home of these names. The library (optimizer, training state), the
// `mixprec-ckpt` tool and the Python reader (python/mixprec_reader.py, checked against this
// file by tests/checkpoint/format/state_keys_test.cpp) all take them from here.
// It is LibTorch-free, like the rest of checkpoint/format/.
//
// Tensor keys (manifest "keys", data files):
//   <fqn>                                  a model parameter or buffer under its fully
//                                          qualified name ("blocks.0.attn.qkv.weight"); tied
//                                          tensors appear once, under their first name
//   optimizer.state.fp32_param.<fqn>       FP32 main copy ("master") of a BF16/FP16 parameter;
//                                          absent for native-FP32 and frozen parameters
//   optimizer.state.exp_avg.<fqn>          Adam/AdamW first moment (FP32)
//   optimizer.state.exp_avg_sq.<fqn>       Adam/AdamW second moment (FP32)
//   optimizer.state.max_exp_avg_sq.<fqn>   Adam/AdamW with amsgrad (FP32)
//   optimizer.state.momentum_buffer.<fqn>  SGD with momentum (FP32)
//   rng.cpu                                the default CPU generator's state (uint8); in a
//                                          collective (data-parallel) save, rank 0's
//   rng.cuda.<index>                       a CUDA generator's state, where CUDA is present
//   rng.rank.<r>.cpu, rng.rank.<r>.cuda.<index>
//                                          a collective save's per-rank generators: data-
//                                          parallel rank r's (distributed/collective_checkpoint.h);
//                                          a single-process load ignores them
//
// Common state (common.json), top-level fields:
//   optimizer   {algorithm: "adam"|"adamw"|"sgd",
//                step: the largest per-parameter step,
//                steps: {fqn: step} for parameters whose step differs from `step`,
//                param_groups: [{hyper-parameters as torch names them, params: [fqn, ...]}],
//                frozen: [fqn, ...], without_state: [fqn, ...] (trainable, never stepped),
//                scaler: the loss scaler's state}
//   precision   {fqn: why a conversion kept the tensor FP32: "mark" (keep_in_fp32 on the
//                tensor), "name <fqn>" (PrecisionPlan::keep_fp32_name), "pattern <glob>"
//                (PrecisionPlan::keep_fp32_pattern)}; only tensors a conversion kept and
//                still FP32; absent when there are none
//   user        whatever the caller passed to save_training_state
#pragma once

#include <array>
#include <string>
#include <string_view>

namespace mixprec::checkpoint::keys {

// Every optimizer tensor key starts with this; model keys never do.
inline constexpr std::string_view kOptimizerPrefix = "optimizer.";
inline constexpr std::string_view kOptimizerStatePrefix = "optimizer.state.";

// Per-parameter optimizer state kinds: optimizer.state.<kind>.<fqn>.
inline constexpr std::string_view kFp32Param = "fp32_param";
inline constexpr std::string_view kExpAvg = "exp_avg";
inline constexpr std::string_view kExpAvgSq = "exp_avg_sq";
inline constexpr std::string_view kMaxExpAvgSq = "max_exp_avg_sq";
inline constexpr std::string_view kMomentumBuffer = "momentum_buffer";
inline constexpr std::array<std::string_view, 5> kStateKinds = {kFp32Param, kExpAvg, kExpAvgSq,
                                                                kMaxExpAvgSq, kMomentumBuffer};

// RNG tensors.
inline constexpr std::string_view kRngCpu = "rng.cpu";
inline constexpr std::string_view kRngCudaPrefix = "rng.cuda.";
inline constexpr std::string_view kRngRankPrefix = "rng.rank.";

// Top-level common-state fields.
inline constexpr std::string_view kCommonOptimizer = "optimizer";
inline constexpr std::string_view kCommonPrecision = "precision";
inline constexpr std::string_view kCommonUser = "user";

// Values of common["precision"][fqn]: the plan rule that kept the tensor FP32. "mark" alone;
// "name <fqn>" and "pattern <glob>" carry the rule after one space.
inline constexpr std::string_view kKeptByMark = "mark";
inline constexpr std::string_view kKeptByName = "name";
inline constexpr std::string_view kKeptByPattern = "pattern";

// Fields of common["optimizer"].
inline constexpr std::string_view kAlgorithm = "algorithm";
inline constexpr std::string_view kStep = "step";
inline constexpr std::string_view kSteps = "steps";
inline constexpr std::string_view kParamGroups = "param_groups";
inline constexpr std::string_view kParams = "params";
inline constexpr std::string_view kFrozen = "frozen";
inline constexpr std::string_view kWithoutState = "without_state";
inline constexpr std::string_view kScaler = "scaler";

// "optimizer.state.<kind>.<fqn>".
inline std::string optimizer_state_key(std::string_view kind, std::string_view fqn) {
  std::string key(kOptimizerStatePrefix);
  key.append(kind).append(".").append(fqn);
  return key;
}

// True for keys the optimizer owns (never model keys).
inline bool is_optimizer_key(std::string_view key) { return key.starts_with(kOptimizerPrefix); }
// "rng.rank.<rank>." + what follows "rng." in `key` ("rng.cpu" → "rng.rank.3.cpu").
inline std::string rng_rank_key(int rank, std::string_view key) {
  constexpr std::string_view rng = "rng.";
  std::string out(kRngRankPrefix);
  out.append(std::to_string(rank)).append(".").append(key.substr(key.starts_with(rng) ? 4 : 0));
  return out;
}

// True for the RNG tensors a training state adds.
inline bool is_rng_key(std::string_view key) {
  return key == kRngCpu || key.starts_with(kRngCudaPrefix) || key.starts_with(kRngRankPrefix);
}

}  // namespace mixprec::checkpoint::keys
