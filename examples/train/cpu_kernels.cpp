#include "cpu_kernels.h"

#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>

namespace train {
namespace {

// The flags oneDNN, MKL and ATen dispatch on for this program's kernels, in order of age.
constexpr const char* kKernelFlags[] = {"avx2",        "avx512f",  "avx512_vnni", "avx512_bf16",
                                        "avx512_fp16", "amx_tile", "amx_bf16"};
// Variables that cap the instruction sets those libraries use.
constexpr const char* kCapVariables[] = {"ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
                                         "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY"};

// "key : value" → value, for the first line starting with `key`.
std::string field(const std::string& cpuinfo, const std::string& key) {
  std::istringstream lines(cpuinfo);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(key, 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    const size_t begin = line.find_first_not_of(" \t", colon + 1);
    return begin == std::string::npos ? "" : line.substr(begin);
  }
  return "";
}

const char* from_environment(const char* name) { return std::getenv(name); }

}  // namespace

std::string cpu_kernel_identity(const std::string& cpuinfo, const char* (*getenv)(const char*)) {
  std::string model = field(cpuinfo, "model name");
  if (model.empty()) model = "unknown CPU";
  std::set<std::string> flags;
  std::istringstream words(field(cpuinfo, "flags"));
  for (std::string word; words >> word;) flags.insert(word);
  std::string out = model + " [";
  bool first = true;
  for (const char* flag : kKernelFlags) {
    if (!flags.count(flag)) continue;
    out += (first ? "" : " ") + std::string(flag);
    first = false;
  }
  out += "]";
  for (const char* name : kCapVariables) {
    const char* value = getenv(name);
    if (value != nullptr && *value != '\0') out += std::string(" ") + name + "=" + value;
  }
  return out;
}

std::string cpu_kernel_identity() {
  std::ifstream in("/proc/cpuinfo");
  std::ostringstream text;
  text << in.rdbuf();
  return cpu_kernel_identity(text.str(), from_environment);
}

}  // namespace train
