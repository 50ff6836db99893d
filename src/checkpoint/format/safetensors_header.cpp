#include "mixprec/checkpoint/format/safetensors_header.h"

#include "fail.h"
#include "mixprec/checkpoint/format/box.h"
#include "strict_json.h"

#include <algorithm>
#include <cstring>
#include <set>

namespace mixprec::checkpoint {
namespace {

using detail::fail;
using nlohmann::json;

constexpr std::string_view kMetadataKey = "__metadata__";
// Tensor entries sit at depth 2 and their arrays at 3; anything deeper is not a header.
constexpr int kMaxHeaderDepth = 8;

// product(shape) × elem, or nullopt on a negative dim or 64-bit overflow.
std::optional<std::uint64_t> checked_byte_size(const std::vector<std::int64_t>& shape,
                                               std::size_t elem) {
  std::uint64_t total = elem;
  for (std::int64_t d : shape) {
    if (d < 0) return std::nullopt;
    if (__builtin_mul_overflow(total, static_cast<std::uint64_t>(d), &total)) return std::nullopt;
  }
  return total;
}

TensorEntry parse_entry(const std::string& name, const json& value, const std::string& context) {
  detail::check_members(value, context, {"dtype", "shape", "data_offsets"});
  TensorEntry entry;
  entry.name = name;
  entry.dtype = detail::dtype_field(value, "dtype", context);
  entry.shape = detail::dims_field(value, "shape", context);

  const json& offsets = value["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned()) {
    fail(context, ": field 'data_offsets': expected [begin, end] as two unsigned integers");
  }
  entry.begin = offsets[0].get<std::uint64_t>();
  entry.end = offsets[1].get<std::uint64_t>();
  if (entry.end < entry.begin) {
    fail(context, ": data_offsets [", entry.begin, ", ", entry.end, "] end before they begin");
  }
  auto expected = checked_byte_size(entry.shape, element_size(entry.dtype));
  if (!expected) fail(context, ": shape ", dims_to_string(entry.shape), " overflows 64 bits");
  if (*expected != entry.byte_size()) {
    fail(context, ": data_offsets [", entry.begin, ", ", entry.end, "] hold ", entry.byte_size(),
         " bytes but shape ", dims_to_string(entry.shape), " of ", dtype_name(entry.dtype),
         " needs ", *expected);
  }
  return entry;
}

// The tensors must cover the data section exactly, in offset order, with nothing between them:
// a gap would be bytes no checksum covers, an overlap two tensors sharing storage.
void check_layout(std::vector<TensorEntry>& tensors, std::uint64_t data_size,
                  std::string_view source) {
  std::sort(tensors.begin(), tensors.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t expected_begin = 0;
  const TensorEntry* previous = nullptr;
  for (const TensorEntry& t : tensors) {
    if (t.begin != expected_begin) {
      if (t.begin < expected_begin) {
        fail(source, ": tensor '", t.name, "' data_offsets [", t.begin, ", ", t.end,
             "] overlap tensor '", previous->name, "' [", previous->begin, ", ", previous->end,
             "]");
      }
      fail(source, ": tensor '", t.name, "' starts at data offset ", t.begin, " but the ",
           previous ? "previous tensor '" + previous->name + "' ends" : std::string("data starts"),
           " at ", expected_begin, " (gap in the data section)");
    }
    expected_begin = t.end;
    previous = &t;
  }
  if (expected_begin != data_size) {
    fail(source, ": tensors end at data offset ", expected_begin, " but the data section holds ",
         data_size, " bytes (", expected_begin > data_size ? "file truncated" : "trailing bytes",
         ")");
  }
}

}  // namespace

std::uint64_t TensorSpec::byte_size() const {
  auto size = checked_byte_size(shape, element_size(dtype));
  if (!size) {
    fail("tensor '", name, "': shape ", dims_to_string(shape),
         " has a negative dimension or overflows 64 bits");
  }
  return *size;
}

const TensorEntry* SafetensorsHeader::find(std::string_view name) const {
  auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                             [](const TensorEntry& t, std::string_view n) { return t.name < n; });
  return it != tensors.end() && it->name == name ? &*it : nullptr;
}

std::string encode_safetensors_header(const std::vector<TensorSpec>& tensors,
                                      const std::map<std::string, std::string>& metadata,
                                      std::string_view source) {
  // ordered_json keeps the declared order, so the header reads in data-section order.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header[std::string(kMetadataKey)] = metadata;
  std::set<std::string_view> names;
  std::uint64_t offset = 0;
  for (const TensorSpec& t : tensors) {
    if (t.name.empty()) fail(source, ": a tensor has an empty name");
    if (t.name == kMetadataKey) fail(source, ": '__metadata__' is not a tensor name");
    if (!names.insert(t.name).second) fail(source, ": tensor '", t.name, "' is declared twice");
    auto size = checked_byte_size(t.shape, element_size(t.dtype));
    if (!size) {
      fail(source, ": tensor '", t.name, "': shape ", dims_to_string(t.shape),
           " has a negative dimension or overflows 64 bits");
    }
    std::uint64_t end;
    if (__builtin_add_overflow(offset, *size, &end)) {
      fail(source, ": tensor '", t.name, "': data section overflows 64 bits");
    }
    header[t.name] = {{"dtype", std::string(dtype_name(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, end}}};
    offset = end;
  }
  std::string json_text;
  try {
    json_text = header.dump();
  } catch (const nlohmann::json::type_error& e) {
    fail(source, ": tensor names and metadata must be valid UTF-8: ", e.what());
  }
  // Spaces up to the next multiple of 8, so the data section starts 8-byte aligned.
  json_text.append((8 - json_text.size() % 8) % 8, ' ');
  if (json_text.size() > kMaxSafetensorsHeaderSize) {
    fail(source, ": header of ", json_text.size(), " bytes exceeds the limit of ",
         kMaxSafetensorsHeaderSize);
  }
  std::string out(8, '\0');
  std::uint64_t n = json_text.size();
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<char>(n >> (8 * i));
  return out + json_text;
}

std::uint64_t decode_header_length(std::span<const std::byte, 8> prefix) {
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<std::uint64_t>(prefix[i]);
  return n;
}

SafetensorsHeader parse_safetensors_header(std::span<const std::byte> header_json,
                                           std::uint64_t data_size, std::string_view source) {
  if (header_json.size() > kMaxSafetensorsHeaderSize) {
    fail(source, ": header length ", header_json.size(), " exceeds the limit of ",
         kMaxSafetensorsHeaderSize);
  }
  std::string_view text(reinterpret_cast<const char*>(header_json.data()), header_json.size());
  if (text.empty() || text.front() != '{') {
    fail(source, ": header does not start with '{' (byte 8 of the file): not a safetensors file");
  }
  json root = detail::parse_json_strict(text, source, kMaxHeaderDepth);
  if (!root.is_object()) fail(source, ": header is not a JSON object");

  SafetensorsHeader header;
  header.header_size = header_json.size();
  header.data_size = data_size;
  for (const auto& [name, value] : root.items()) {
    if (name == kMetadataKey) {
      if (!value.is_object()) fail(source, ": '__metadata__' must be an object of strings");
      for (const auto& [key, meta] : value.items()) {
        if (!meta.is_string()) {
          fail(source, ": '__metadata__' entry '", key, "' must be a string");
        }
        header.metadata.emplace(key, meta.get<std::string>());
      }
      continue;
    }
    std::string context = detail::concat(source, ": tensor '", name, "'");
    if (name.empty()) fail(source, ": a tensor has an empty name");
    header.tensors.push_back(parse_entry(name, value, context));
  }
  check_layout(header.tensors, data_size, source);
  // nlohmann objects iterate in key order; sort anyway so find() does not depend on it.
  std::sort(header.tensors.begin(), header.tensors.end(),
            [](const TensorEntry& a, const TensorEntry& b) { return a.name < b.name; });
  return header;
}

SafetensorsHeader parse_safetensors_buffer(std::span<const std::byte> file_bytes,
                                           std::string_view source) {
  if (file_bytes.size() < 8) {
    fail(source, ": ", file_bytes.size(), " bytes is too short for a safetensors file (< 8)");
  }
  std::uint64_t n = decode_header_length(file_bytes.first<8>());
  if (n > kMaxSafetensorsHeaderSize) {
    fail(source, ": header length ", n, " (bytes 0-7) exceeds the limit of ",
         kMaxSafetensorsHeaderSize);
  }
  if (n > file_bytes.size() - 8) {
    fail(source, ": header length ", n, " (bytes 0-7) runs past the end of the ", file_bytes.size(),
         "-byte file");
  }
  return parse_safetensors_header(file_bytes.subspan(8, n), file_bytes.size() - 8 - n, source);
}

}  // namespace mixprec::checkpoint
