// Cloning a module without losing keep_in_fp32 marks.
#pragma once

#include <memory>

namespace torch::nn {
class Module;
}

namespace mixprec {

// `module.clone()`, then re-applies every keep_in_fp32 mark of `module`, and the reason a
// conversion kept a tensor FP32 (kept_fp32_reason, convert.h), to the tensor with the same
// fully qualified name in the copy. LibTorch's clone() rebuilds tensors through reset(),
// so on its own it keeps only marks made inside reset(); this keeps marks made anywhere.
// Throws c10::Error if the module is not cloneable (no Cloneable base) or the copy lacks a
// marked name (a reset() that registers different tensors).
std::shared_ptr<torch::nn::Module> clone_module(const torch::nn::Module& module);

}  // namespace mixprec
