// libFuzzer target: a whole safetensors file image in memory.
//
// Property: parse_safetensors_buffer either throws FormatError or returns a header whose
// tensors tile the data section; re-encoding those tensors yields a header that parses back
// to the same tensors. Any other exception, a crash, or a sanitizer report is a bug.
#include "mixprec/checkpoint/format/error.h"
#include "mixprec/checkpoint/format/safetensors_header.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

using namespace mixprec::checkpoint;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto bytes = std::as_bytes(std::span(data, size));
  SafetensorsHeader header;
  try {
    header = parse_safetensors_buffer(bytes, "fuzz");
  } catch (const FormatError&) {
    return 0;
  }
  std::uint64_t total = 0;
  std::vector<TensorSpec> specs;
  std::vector<const TensorEntry*> by_offset;
  for (const TensorEntry& t : header.tensors) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  for (const TensorEntry* t : by_offset) {
    total += t->byte_size();
    specs.push_back({t->name, t->dtype, t->shape});
    if (header.find(t->name) != t) std::abort();
  }
  if (total != header.data_size) std::abort();

  const std::string encoded = encode_safetensors_header(specs, header.metadata);
  std::string image = encoded + std::string(header.data_size, '\0');
  const SafetensorsHeader again =
      parse_safetensors_buffer(std::as_bytes(std::span(image.data(), image.size())), "re-encoded");
  if (again.tensors.size() != header.tensors.size() || again.metadata != header.metadata) {
    std::abort();
  }
  for (std::size_t i = 0; i < header.tensors.size(); ++i) {
    const TensorEntry& a = header.tensors[i];
    const TensorEntry& b = again.tensors[i];
    if (a.name != b.name || a.dtype != b.dtype || a.shape != b.shape ||
        a.byte_size() != b.byte_size()) {
      std::abort();
    }
  }
  return 0;
}
