// --init-from PATH: a fresh run that starts from exported weights (`mixprec-ckpt export`,
// tools/ckpt/export.h) instead of random ones.
//
// PATH is a .safetensors file, or a directory holding model.safetensors.index.json
// (HuggingFace's shard index: {"weight_map": {name: file}}, files beside it) or else
// model.safetensors. Its tensors must be exactly the model's parameters and buffers
// (mixprec::model_sharded_state_dict: fully qualified names, tied tensors once), with the
// model's shapes. Floating values are converted to the model tensor's dtype (a BF16 export
// loads into the FP32 router, an FP32 one into the BF16 weights, rounding); other tensors
// must have the model's dtype. Only weights: the optimizer, its FP32 masters (taken from these
// weights when it is built), the schedule and the data order start fresh.
#pragma once

#include <filesystem>
#include <string>

namespace torch::nn {
class Module;
}

namespace train {

// What was loaded, for the start-up lines: "20 tensors from out/model.safetensors".
struct InitFromResult {
  std::size_t tensors = 0;
  std::string source;  // the file, or the index of a sharded export
};

// Loads the weights at `path` into `model` (before an optimizer is built on it). Reads and
// checks every file, name, shape and dtype before changing anything. Throws UsageError naming
// the file and the tensor: a missing or extra tensor, a shape or dtype mismatch, a malformed
// or unreadable file or index; the model is then unchanged.
InitFromResult init_from(torch::nn::Module& model, const std::filesystem::path& path);

}  // namespace train
