#include "sample.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/types.h>

namespace train {
namespace {

constexpr int64_t kSampleShapeStep = 32;

}  // namespace

std::string generate(MixedModel& model, const std::string& prompt, int64_t n, double temperature,
                     uint64_t seed) {
  const int64_t context = model.gpt->config.seq_len;
  std::vector<int64_t> tokens;
  for (unsigned char c : prompt) tokens.push_back(c);
  if (tokens.empty()) tokens.push_back('\n');
  at::Generator gen = at::detail::createCPUGenerator(seed);
  torch::NoGradGuard no_grad;
  const bool was_training = model.module->is_training();
  model.module->eval();
  std::string out;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t begin = std::max<int64_t>(0, static_cast<int64_t>(tokens.size()) - context);
    std::vector<int64_t> window(tokens.begin() + begin, tokens.end());
    const int64_t length = static_cast<int64_t>(window.size());
    // The window goes in padded to a multiple of kSampleShapeStep, so that the model sees 4
    // shapes instead of one per length: each new shape costs oneDNN a compiled primitive it
    // keeps, and sampling 200 bytes at every length took 200 MiB, more than training's whole
    // peak. Attention is causal, so the padding reaches the last token's logits only through
    // the per-tensor scales of FP8 (--fp8) and the rounding of GEMMs of another height, as a
    // window of another length would: a sample, not a measurement.
    window.resize(
        std::min(context, (length + kSampleShapeStep - 1) / kSampleShapeStep * kSampleShapeStep),
        '\n');
    const at::Tensor input = at::tensor(window, at::kLong).unsqueeze(0);
    const at::Tensor last =
        std::get<0>(model.forward(input)).select(1, length - 1).squeeze(0).to(at::kFloat);
    int64_t next = 0;
    if (temperature == 0) {
      next = last.argmax().item<int64_t>();
    } else {
      const at::Tensor probs = at::softmax(last / temperature, -1);
      next = at::multinomial(probs, 1, /*replacement=*/false, gen).item<int64_t>();
    }
    tokens.push_back(next);
    out += static_cast<char>(next);
  }
  model.module->train(was_training);
  return out;
}

std::string printable(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t len = c < 0x80           ? 1
                 : (c >> 5) == 0x6  ? 2
                 : (c >> 4) == 0xE  ? 3
                 : (c >> 3) == 0x1E ? 4
                                    : 0;
    bool ok = len > 0 && i + len <= s.size();
    for (size_t k = 1; ok && k < len; ++k) ok = (static_cast<unsigned char>(s[i + k]) >> 6) == 0x2;
    if (!ok) {
      out += '?';
      ++i;
      continue;
    }
    if (len == 1 && c < 0x20 && c != '\n' && c != '\t')
      out += '?';
    else
      out.append(s, i, len);
    i += len;
  }
  return out;
}

}  // namespace train
