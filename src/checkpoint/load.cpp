#include "mixprec/checkpoint/load.h"

#include "mixprec/checkpoint/format/error.h"
#include "mixprec/checkpoint/format/latest.h"
#include "mixprec/checkpoint/format/manifest.h"
#include "mixprec/checkpoint/format/newest_checkpoint.h"
#include "mixprec/checkpoint/format/safetensors_reader.h"
#include "mixprec/checkpoint/tensor_dtype.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <memory>

namespace mixprec::checkpoint {

ResolvedCheckpoint find_checkpoint(const std::filesystem::path& path) {
  std::error_code ec;
  if (std::filesystem::exists(std::filesystem::symlink_status(path / kManifestFileName, ec))) {
    Directory::open(path);  // a checkpoint directory itself must be real, not a link
    return {path, ""};
  }
  const Directory root = Directory::open(path, Directory::Last::kMayBeLink);
  const NewestCheckpoint newest = find_newest_checkpoint(root);
  if (!newest.latest_error.empty()) throw FormatError(newest.latest_error);
  if (!newest.name) {
    throw FormatError("[mixprec::checkpoint] " + path.string() +
                      ": neither a checkpoint (no manifest.json) nor a root with a 'latest' file "
                      "or committed checkpoints");
  }
  std::string note;
  if (newest.latest_is_stale()) {
    note = (newest.recorded ? "'latest' names '" + *newest.recorded + "', but '" + *newest.name +
                                  "' is newer and complete (a save ended between its commit "
                                  "and the 'latest' update)"
                            : "there is no 'latest'; '" + *newest.name +
                                  "' is the newest complete checkpoint") +
           ": loading '" + *newest.name + "'; the next save repairs 'latest'";
  }
  for (const std::string& skipped : newest.skipped) {
    note += std::string(note.empty() ? "" : "; ") + "newer but does not verify: " + skipped;
  }
  return {path / *newest.name, note};
}

std::filesystem::path resolve_checkpoint(const std::filesystem::path& path) {
  return find_checkpoint(path).dir;
}

namespace {

std::span<std::byte> bytes_of(at::Tensor& t) {
  return {static_cast<std::byte*>(t.data_ptr()), t.nbytes()};
}

// Copies the intersection `part` of chunk `chunk_box` (stored row-major in `reader` under
// `tensor_name`) into `target`, whose global position is `target_box`. Reads only the bytes of
// the intersection, in runs as long as the layouts allow.
void read_part(const SafetensorsReader& reader, const std::string& tensor_name,
               const Box& chunk_box, const Box& part, at::Tensor& target, const Box& target_box) {
  const size_t rank = part.rank();
  const int64_t elem = target.element_size();
  if (rank == 0) {
    reader.read_range(tensor_name, 0, bytes_of(target));
    return;
  }
  // Trailing dims where the part spans the whole chunk and the whole target merge into runs.
  size_t split = rank - 1;  // dims >= split form one contiguous run in both layouts
  while (split > 0 && part.shape[split] == chunk_box.shape[split] &&
         part.shape[split] == target_box.shape[split]) {
    --split;
  }
  int64_t run = 1;
  for (size_t d = split; d < rank; ++d) run *= part.shape[d];
  std::vector<int64_t> chunk_stride(rank, 1), target_stride(rank, 1);
  for (size_t d = rank - 1; d > 0; --d) {
    chunk_stride[d - 1] = chunk_stride[d] * chunk_box.shape[d];
    target_stride[d - 1] = target_stride[d] * target_box.shape[d];
  }
  std::vector<int64_t> index(split, 0);  // position within the part, dims < split
  std::byte* base = static_cast<std::byte*>(target.data_ptr());
  while (true) {
    int64_t chunk_elem = 0, target_elem = 0;
    for (size_t d = 0; d < rank; ++d) {
      const int64_t g = part.offset[d] + (d < split ? index[d] : 0);
      chunk_elem += (g - chunk_box.offset[d]) * chunk_stride[d];
      target_elem += (g - target_box.offset[d]) * target_stride[d];
    }
    reader.read_range(tensor_name, static_cast<uint64_t>(chunk_elem * elem),
                      {base + target_elem * elem, static_cast<size_t>(run * elem)});
    size_t d = split;
    while (d > 0 && ++index[d - 1] == part.shape[d - 1]) index[--d] = 0;
    if (d == 0) break;
  }
}

}  // namespace

ShardedStateDict read_checkpoint(const std::filesystem::path& dir, const ReadOptions& options) {
  const Directory checkpoint_dir = Directory::open(dir);  // everything read relative to it
  const Manifest manifest = read_manifest(checkpoint_dir);
  ShardedStateDict out;
  out.common = read_common(checkpoint_dir, manifest);

  std::map<std::string, std::unique_ptr<SafetensorsReader>> readers;  // opened on first use
  auto reader_for = [&](const std::string& file) -> const SafetensorsReader& {
    auto& slot = readers[file];
    if (!slot) slot = std::make_unique<SafetensorsReader>(checkpoint_dir, file);
    return *slot;
  };

  for (const auto& key : options.keys) {
    TORCH_CHECK(manifest.keys.count(key), "[mixprec::checkpoint::read] ", dir.string(),
                ": no key '", key, "' in the checkpoint");
  }
  for (const auto& [key, entry] : manifest.keys) {
    if (!options.keys.empty() && !options.keys.count(key)) continue;
    Box want{std::vector<int64_t>(entry.shape.size(), 0), entry.shape};
    if (options.slice) {
      if (auto slice = options.slice(key, entry.shape)) want = *slice;
    }
    TORCH_CHECK(fits_in(want, entry.shape), "[mixprec::checkpoint::read] key '", key,
                "': requested slice ", want.to_string(), " is outside its shape ",
                dims_to_string(entry.shape));
    at::Tensor local = at::empty(want.shape, at::TensorOptions().dtype(to_scalar_type(entry.dtype)));
    for (const Chunk& chunk : entry.chunks) {
      const std::optional<Box> part = intersect(chunk.box, want);
      if (!part) continue;
      const SafetensorsReader& reader = reader_for(chunk.file);
      const TensorEntry& stored = reader.tensor(chunk.tensor);
      if (stored.dtype != entry.dtype || stored.shape != chunk.box.shape) {
        throw FormatError(
            "[mixprec::checkpoint] " + (dir / chunk.file).string() + ": tensor '" + chunk.tensor +
            "' of key '" + key + "' is " + std::string(dtype_name(stored.dtype)) + " " +
            dims_to_string(stored.shape) + ", the manifest says " +
            std::string(dtype_name(entry.dtype)) + " " + dims_to_string(chunk.box.shape));
      }
      if (part->shape == chunk.box.shape) {
        // Whole chunk needed: read it in one go and verify its checksum.
        if (part->shape == want.shape) {
          reader.read(chunk.tensor, bytes_of(local), chunk.checksum);
        } else {
          at::Tensor whole = at::empty(chunk.box.shape, local.options());
          reader.read(chunk.tensor, bytes_of(whole), chunk.checksum);
          at::Tensor view = local;
          for (size_t d = 0; d < want.rank(); ++d) {
            view = view.narrow(d, chunk.box.offset[d] - want.offset[d], chunk.box.shape[d]);
          }
          view.copy_(whole);
        }
      } else {
        read_part(reader, chunk.tensor, chunk.box, *part, local, want);
      }
    }
    ShardedTensor shard;
    shard.local = std::move(local);
    shard.global_shape = entry.shape;
    shard.global_offset = want.offset;
    out.tensors.emplace(key, std::move(shard));
  }
  return out;
}

}  // namespace mixprec::checkpoint
