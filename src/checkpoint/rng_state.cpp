#include "checkpoint/rng_state.h"

#include "mixprec/checkpoint/format/state_keys.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/util/Exception.h>

#include <mutex>

namespace mixprec::checkpoint::detail {
namespace {

namespace keys = mixprec::checkpoint::keys;

// CUDA is reached through ATen's hooks, so this compiles and runs against a CPU-only LibTorch:
// there hasCUDA() is false and nothing below it is called.
int cuda_devices() { return at::hasCUDA() ? at::detail::getCUDAHooks().getNumGPUs() : 0; }

at::Tensor state_of(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_state(at::Generator gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// A state is checked by setting it on a scratch generator of the same kind: the generator's
// own validation (size, layout) without touching the process's default one.
std::string invalid(at::Generator scratch, const at::Tensor& state) {
  try {
    scratch.set_state(state);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return {};
}

}  // namespace

std::map<std::string, at::Tensor> rng_states() {
  std::map<std::string, at::Tensor> out;
  out.emplace(std::string(keys::kRngCpu), state_of(at::detail::getDefaultCPUGenerator()));
  for (int i = 0; i < cuda_devices(); ++i) {
    const at::Generator& gen = at::detail::getCUDAHooks().getDefaultGenerator(i);
    out.emplace(std::string(keys::kRngCudaPrefix) + std::to_string(i), state_of(gen));
  }
  return out;
}

CheckedRng check_rng(const std::map<std::string, at::Tensor>& states,
                     const std::filesystem::path& dir) {
  const std::string where = "[mixprec::load_training_state] " + dir.string() + ": ";
  CheckedRng out;
  const std::string cpu_key(keys::kRngCpu);
  auto cpu = states.find(cpu_key);
  TORCH_CHECK(cpu != states.end(), where, "no '", cpu_key,
              "' tensor (not a training-state checkpoint?)");
  const std::string bad_cpu = invalid(at::detail::createCPUGenerator(), cpu->second);
  TORCH_CHECK(bad_cpu.empty(), where, "'", cpu_key, "' is not a CPU generator state: ", bad_cpu);
  out.cpu = cpu->second;

  const int devices = cuda_devices();
  std::vector<bool> restored(devices, false);
  bool per_rank = false;
  for (const auto& [key, state] : states) {
    if (key == cpu_key) continue;
    // A collective save's per-rank generators (state_keys.h): rng.cpu is its rank 0's.
    if (key.starts_with(keys::kRngRankPrefix)) {
      per_rank = true;
      continue;
    }
    const bool cuda_key = key.starts_with(keys::kRngCudaPrefix);
    const std::string digits = cuda_key ? key.substr(keys::kRngCudaPrefix.size()) : "";
    TORCH_CHECK(cuda_key && !digits.empty() && digits.size() < 6 &&
                    digits.find_first_not_of("0123456789") == std::string::npos,
                where, "'", key, "' is not an RNG key this version knows");
    const int index = std::stoi(digits);
    if (index >= devices) {
      out.report.notes.push_back(
          key + ": ignored, " +
          (devices == 0 ? std::string("CUDA is not available here")
                        : "this process sees " + std::to_string(devices) + " CUDA devices"));
      continue;
    }
    const std::string bad = invalid(at::detail::getCUDAHooks().getNewGenerator(index), state);
    TORCH_CHECK(bad.empty(), where, "'", key, "' is not a CUDA generator state: ", bad);
    out.cuda.emplace_back(index, state);
    restored[index] = true;
  }
  if (per_rank) {
    out.report.notes.push_back("per-rank RNG states (" + std::string(keys::kRngRankPrefix) +
                               "*) of a data-parallel save ignored: '" + cpu_key +
                               "' is its rank 0's");
  }
  for (int i = 0; i < devices; ++i) {
    if (!restored[i]) {
      out.report.notes.push_back("CUDA device " + std::to_string(i) +
                                 ": no RNG state in the checkpoint, left as it is");
    }
  }
  return out;
}

void apply_rng(const CheckedRng& checked) {
  set_state(at::detail::getDefaultCPUGenerator(), checked.cpu);
  for (const auto& [index, state] : checked.cuda) {
    set_state(at::detail::getCUDAHooks().getDefaultGenerator(index), state);
  }
}

}  // namespace mixprec::checkpoint::detail
