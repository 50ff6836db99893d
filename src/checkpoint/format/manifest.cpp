#include "mixprec/checkpoint/format/manifest.h"

#include "fail.h"
#include "mixprec/checkpoint/format/checksum.h"
#include "mixprec/checkpoint/format/error.h"
#include "posix_file.h"
#include "strict_json.h"

#include <set>
#include <utility>

namespace mixprec::checkpoint {
namespace {

using detail::concat;
using detail::fail;
using nlohmann::json;

// Manifests list every chunk of every key; 1 GiB is far beyond any real one.
constexpr std::uint64_t kMaxManifestBytes = 1ull << 30;

std::uint64_t checksum_field(const json& obj, std::string_view context) {
  std::string hex = detail::string_field(obj, "xxh3", context);
  auto value = checksum_from_hex(hex);
  if (!value) fail(context, ": field 'xxh3': expected 16 lowercase hex digits, found '", hex, "'");
  return *value;
}

Chunk parse_chunk(const json& value, const std::string& context, bool with_blocks) {
  if (with_blocks) {
    detail::check_members(value, context,
                          {"file", "tensor", "offset", "shape", "bytes", "xxh3", "block_xxh3"});
  } else {
    detail::check_members(value, context, {"file", "tensor", "offset", "shape", "bytes", "xxh3"});
  }
  Chunk chunk;
  chunk.file = detail::string_field(value, "file", context);
  chunk.tensor = detail::string_field(value, "tensor", context);
  chunk.box.offset = detail::dims_field(value, "offset", context);
  chunk.box.shape = detail::dims_field(value, "shape", context);
  chunk.bytes = detail::u64_field(value, "bytes", context);
  chunk.checksum = checksum_field(value, context);
  if (with_blocks) {
    const json& blocks = value["block_xxh3"];
    if (!blocks.is_array()) fail(context, ": field 'block_xxh3': expected an array");
    chunk.block_checksums.reserve(blocks.size());
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      const json& hex = blocks[i];
      std::optional<std::uint64_t> v =
          hex.is_string() ? checksum_from_hex(hex.get_ref<const std::string&>()) : std::nullopt;
      if (!v) fail(context, ": field 'block_xxh3': entry ", i, " is not 16 lowercase hex digits");
      chunk.block_checksums.push_back(*v);
    }
  }
  return chunk;
}

KeyEntry parse_key(const json& value, const std::string& context, bool with_blocks) {
  detail::check_members(value, context, {"dtype", "shape", "chunks"});
  KeyEntry entry;
  entry.dtype = detail::dtype_field(value, "dtype", context);
  entry.shape = detail::dims_field(value, "shape", context);
  const json& chunks = value["chunks"];
  if (!chunks.is_array()) fail(context, ": field 'chunks': expected an array");
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    entry.chunks.push_back(parse_chunk(chunks[i], concat(context, ": chunk ", i), with_blocks));
  }
  return entry;
}

void validate_key(const std::string& key, const KeyEntry& entry, std::uint64_t block_bytes,
                  std::string_view source, std::set<std::pair<std::string, std::string>>& used) {
  const std::string context = concat(source, ": key '", key, "'");
  if (key.empty()) fail(source, ": a key has an empty name");
  std::uint64_t total = element_size(entry.dtype);
  for (std::int64_t d : entry.shape) {
    if (d < 0 || __builtin_mul_overflow(total, static_cast<std::uint64_t>(d), &total) ||
        total > static_cast<std::uint64_t>(INT64_MAX)) {
      fail(context, ": global shape ", dims_to_string(entry.shape),
           " has a negative dimension or more than 2^63 bytes");
    }
  }
  std::vector<Box> boxes;
  for (std::size_t i = 0; i < entry.chunks.size(); ++i) {
    const Chunk& c = entry.chunks[i];
    const std::string where = concat(context, ": chunk ", i);
    if (!is_valid_file_name(c.file)) {
      fail(where, ": field 'file': '", c.file, "' is not a plain file name in the directory");
    }
    if (c.tensor.empty()) fail(where, ": field 'tensor' is empty");
    if (!used.emplace(c.file, c.tensor).second) {
      fail(where, ": tensor '", c.tensor, "' in '", c.file, "' is already used by another chunk");
    }
    if (c.box.offset.size() != entry.shape.size() || c.box.shape.size() != entry.shape.size()) {
      fail(where, ": offset and shape must have the key's rank ", entry.shape.size(), ", found ",
           c.box.offset.size(), " and ", c.box.shape.size());
    }
    if (!fits_in(c.box, entry.shape)) {
      fail(where, ": box ", c.box.to_string(), " lies outside the global shape ",
           dims_to_string(entry.shape));
    }
    const std::uint64_t expected = c.box.volume() * element_size(entry.dtype);
    if (c.bytes != expected) {
      fail(where, ": field 'bytes' is ", c.bytes, " but shape ", c.box.to_string(), " of ",
           dtype_name(entry.dtype), " needs ", expected);
    }
    const std::uint64_t blocks = block_bytes == 0 ? 0 : block_count(c.bytes, block_bytes);
    if (c.block_checksums.size() != blocks) {
      fail(where, ": field 'block_xxh3' has ", c.block_checksums.size(), " checksums, but ",
           c.bytes, " bytes in blocks of ", block_bytes, " need ", blocks);
    }
    boxes.push_back(c.box);
  }
  auto problem = check_tiling(boxes, entry.shape);
  if (!problem) return;
  switch (problem->kind) {
    case TilingProblem::Kind::kOverlap:
      fail(context, ": chunks ", problem->first, " ", boxes[problem->first].to_string(), " and ",
           problem->second, " ", boxes[problem->second].to_string(), " overlap");
    case TilingProblem::Kind::kGap:
      fail(context, ": chunks cover ", problem->covered, " of ", problem->total,
           " elements (a gap in the global shape)");
    case TilingProblem::Kind::kOutOfBounds:
      fail(context, ": chunk ", problem->first, " lies outside the global shape");
  }
}

json chunk_to_json(const Chunk& c, bool with_blocks) {
  json out = {{"file", c.file},       {"tensor", c.tensor}, {"offset", c.box.offset},
              {"shape", c.box.shape}, {"bytes", c.bytes},   {"xxh3", checksum_to_hex(c.checksum)}};
  if (with_blocks) {
    json blocks = json::array();
    for (std::uint64_t b : c.block_checksums) blocks.push_back(checksum_to_hex(b));
    out["block_xxh3"] = std::move(blocks);
  }
  return out;
}

}  // namespace

int manifest_version(const Manifest& manifest) {
  return manifest.block_bytes > 0 ? kManifestVersion : kManifestVersionWithoutBlocks;
}

bool is_valid_file_name(std::string_view name) {
  if (name.empty() || name.size() > 200 || name.front() == '.') return false;
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

void validate_manifest(const Manifest& manifest, std::string_view source) {
  if (manifest.sequence == 0) fail(source, ": field 'sequence' must be ≥ 1");
  if (manifest.common.has_value() == manifest.common_file.has_value()) {
    fail(source, ": exactly one of 'common' and 'common_file' must be present");
  }
  if (manifest.common && !manifest.common->is_object()) {
    fail(source, ": field 'common' must be a JSON object");
  }
  std::set<std::pair<std::string, std::string>> used;
  if (manifest.common_file && !is_valid_file_name(manifest.common_file->file)) {
    fail(source, ": field 'common_file': '", manifest.common_file->file,
         "' is not a plain file name in the directory");
  }
  for (const auto& [key, entry] : manifest.keys) {
    validate_key(key, entry, manifest.block_bytes, source, used);
  }
}

Manifest parse_manifest(std::string_view json_text, std::string_view source) {
  json root = detail::parse_json_strict(json_text, source, kMaxJsonDepth);
  if (!root.is_object()) fail(source, ": manifest is not a JSON object");
  // Format and version first: a newer writer may have changed anything else.
  std::string format = detail::string_field(root, "format", source);
  if (format != kManifestFormat) {
    fail(source, ": field 'format' is '", format, "', expected '", kManifestFormat, "'");
  }
  std::uint64_t version = detail::u64_field(root, "version", source);
  if (version > static_cast<std::uint64_t>(kManifestVersion)) {
    throw UnsupportedVersionError(
        detail::concat("[mixprec::checkpoint] ", source, ": manifest version ", version,
                       " is newer than this reader supports (", kManifestVersion,
                       "); upgrade mixprec to load this checkpoint"));
  }
  if (version != static_cast<std::uint64_t>(kManifestVersion) &&
      version != static_cast<std::uint64_t>(kManifestVersionWithoutBlocks)) {
    fail(source, ": manifest version ", version, " is not supported (expected ",
         kManifestVersionWithoutBlocks, " or ", kManifestVersion, ")");
  }
  const bool with_blocks = version == static_cast<std::uint64_t>(kManifestVersion);
  if (with_blocks) {
    detail::check_members(root, source, {"format", "version", "sequence", "block_bytes", "keys"},
                          {"common", "common_file"});
  } else {
    detail::check_members(root, source, {"format", "version", "sequence", "keys"},
                          {"common", "common_file"});
  }
  Manifest manifest;
  manifest.sequence = detail::u64_field(root, "sequence", source);
  if (with_blocks) {
    manifest.block_bytes = detail::u64_field(root, "block_bytes", source);
    if (manifest.block_bytes == 0) fail(source, ": field 'block_bytes' must be ≥ 1");
  }
  if (root.contains("common")) manifest.common = root["common"];
  if (root.contains("common_file")) {
    const std::string context = concat(source, ": field 'common_file'");
    const json& ref = root["common_file"];
    detail::check_members(ref, context, {"file", "bytes", "xxh3"});
    manifest.common_file =
        CommonFileRef{detail::string_field(ref, "file", context),
                      detail::u64_field(ref, "bytes", context), checksum_field(ref, context)};
  }
  const json& keys = root["keys"];
  if (!keys.is_object()) fail(source, ": field 'keys': expected an object");
  for (const auto& [key, value] : keys.items()) {
    manifest.keys.emplace(key, parse_key(value, concat(source, ": key '", key, "'"), with_blocks));
  }
  validate_manifest(manifest, source);
  return manifest;
}

std::string manifest_to_json(const Manifest& manifest) {
  validate_manifest(manifest, "manifest");
  const bool with_blocks = manifest.block_bytes > 0;
  json root = {{"format", kManifestFormat},
               {"version", manifest_version(manifest)},
               {"sequence", manifest.sequence}};
  if (with_blocks) root["block_bytes"] = manifest.block_bytes;
  if (manifest.common) root["common"] = *manifest.common;
  if (manifest.common_file) {
    root["common_file"] = {{"file", manifest.common_file->file},
                           {"bytes", manifest.common_file->bytes},
                           {"xxh3", checksum_to_hex(manifest.common_file->checksum)}};
  }
  json keys = json::object();
  for (const auto& [key, entry] : manifest.keys) {
    json chunks = json::array();
    for (const Chunk& c : entry.chunks) chunks.push_back(chunk_to_json(c, with_blocks));
    keys[key] = {{"dtype", dtype_name(entry.dtype)}, {"shape", entry.shape}, {"chunks", chunks}};
  }
  root["keys"] = std::move(keys);
  return detail::dump_json(root, 2, "manifest") + "\n";
}

Manifest read_manifest(const std::filesystem::path& checkpoint_dir) {
  return read_manifest(Directory::open(checkpoint_dir));
}

Manifest read_manifest(const Directory& checkpoint_dir) {
  const std::filesystem::path path = checkpoint_dir / kManifestFileName;
  return parse_manifest(
      detail::read_whole_file_at(checkpoint_dir.fd(), kManifestFileName, kMaxManifestBytes, path),
      path.string());
}

json read_common(const std::filesystem::path& checkpoint_dir, const Manifest& manifest) {
  if (manifest.common) return *manifest.common;
  return read_common(Directory::open(checkpoint_dir), manifest);
}

json read_common(const Directory& checkpoint_dir, const Manifest& manifest) {
  if (manifest.common) return *manifest.common;
  if (!manifest.common_file) fail(checkpoint_dir.path().string(), ": manifest has no common state");
  const CommonFileRef& ref = *manifest.common_file;
  const std::filesystem::path path = checkpoint_dir / ref.file;
  std::string text =
      detail::read_whole_file_at(checkpoint_dir.fd(), ref.file, kMaxManifestBytes, path);
  if (text.size() != ref.bytes) {
    fail(path.string(), ": common state is ", text.size(), " bytes, the manifest says ", ref.bytes);
  }
  const std::uint64_t actual = xxh3_64(std::as_bytes(std::span(text)));
  if (actual != ref.checksum) {
    throw ChecksumError(concat("[mixprec::checkpoint] ", path.string(),
                               ": common state checksum mismatch: expected xxh3 ",
                               checksum_to_hex(ref.checksum), ", got ", checksum_to_hex(actual)));
  }
  json common = detail::parse_json_strict(text, path.string(), kMaxJsonDepth);
  if (!common.is_object()) fail(path.string(), ": common state is not a JSON object");
  return common;
}

}  // namespace mixprec::checkpoint
