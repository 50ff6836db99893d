#include "mixprec/checkpoint/load.h"

#include "detail/name_match.h"

#include "mixprec/checkpoint/format/box.h"
#include "mixprec/checkpoint/format/error.h"
#include "mixprec/checkpoint/format/latest.h"
#include "mixprec/checkpoint/format/manifest.h"
#include "mixprec/checkpoint/format/newest_checkpoint.h"
#include "mixprec/checkpoint/format/safetensors_reader.h"
#include "mixprec/checkpoint/tensor_dtype.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <memory>
#include <stop_token>
#include <string_view>
#include <system_error>
#include <thread>

namespace mixprec::checkpoint {
namespace {

constexpr std::string_view kErrorPrefix = "[mixprec::checkpoint] ";

}  // namespace

ResolvedCheckpoint find_checkpoint(const std::filesystem::path& path) {
  std::error_code ec;
  if (std::filesystem::exists(std::filesystem::symlink_status(path / kManifestFileName, ec))) {
    Directory::open(path);  // a checkpoint directory itself must be real, not a link
    return {path, ""};
  }
  const Directory root = Directory::open(path, Directory::Last::kMayBeLink);
  const NewestCheckpoint newest = find_newest_checkpoint(root);
  if (!newest.latest_error.empty()) throw FormatError(newest.latest_error);
  if (!newest.name && !newest.skipped.empty()) {
    // Checkpoints are there, all damaged: say which and why, not that there are none.
    std::string why;
    for (const NewestCheckpoint::Skipped& s : newest.skipped) {
      std::string_view error = s.error;
      if (error.starts_with(kErrorPrefix)) error.remove_prefix(kErrorPrefix.size());
      why += (why.empty() ? "" : "; ") + s.name + ": " + std::string(error);
    }
    throw NoIntactCheckpointError(
        std::string(kErrorPrefix) + path.string() +
        ": no 'latest', and none of its committed checkpoints verifies: " + why);
  }
  if (!newest.name) {
    throw FormatError(std::string(kErrorPrefix) + path.string() +
                      ": neither a checkpoint (no manifest.json) nor a root with a 'latest' file "
                      "or committed checkpoints");
  }
  std::vector<std::string> skipped;
  for (const NewestCheckpoint::Skipped& s : newest.skipped) skipped.push_back(s.name);
  return {path / *newest.name, newest.note(), std::move(skipped)};
}

std::filesystem::path resolve_checkpoint(const std::filesystem::path& path) {
  return find_checkpoint(path).dir;
}

namespace {

// The part of one chunk a read needs.
struct PartToRead {
  const Chunk* chunk;
  const SafetensorsReader* reader;
  Box part;  // global box: the chunk's box ∩ the wanted slice
};

// One box of a key's wanted slice and the chunk parts that fill it. A box slice is one
// region; a flat range is one region per box it decomposes into, each a contiguous run of
// the 1-D result starting at `flat_offset`.
struct Region {
  Box want;
  int64_t flat_offset = 0;
  std::vector<PartToRead> parts;
};

// One key's wanted slice, checked before anything is allocated.
struct KeyToRead {
  const std::string* key;
  const KeyEntry* entry;
  std::optional<FlatRange> flat;  // set: the result is flat, else the one region's box
  std::vector<Region> regions;
};

// The byte runs of `part` within its chunk's row-major layout, each paired with its place in
// `target` (global position `target_box`), produced one at a time in increasing chunk
// offset. Trailing dims where the part spans both the whole chunk and the whole target merge
// into one run.
class PartRuns {
 public:
  PartRuns(const Box& chunk_box, const Box& part, at::Tensor& target, const Box& target_box)
      : chunk_box_(chunk_box),
        part_(part),
        target_box_(target_box),
        elem_(target.element_size()),
        base_(static_cast<std::byte*>(target.data_ptr())) {
    const size_t rank = part.rank();
    if (rank == 0) {
      split_ = 0;
      run_ = 1;
      return;
    }
    split_ = rank - 1;
    while (split_ > 0 && part.shape[split_] == chunk_box.shape[split_] &&
           part.shape[split_] == target_box.shape[split_]) {
      --split_;
    }
    for (size_t d = split_; d < rank; ++d) run_ *= part.shape[d];
    chunk_stride_.assign(rank, 1);
    target_stride_.assign(rank, 1);
    for (size_t d = rank - 1; d > 0; --d) {
      chunk_stride_[d - 1] = chunk_stride_[d] * chunk_box.shape[d];
      target_stride_[d - 1] = target_stride_[d] * target_box.shape[d];
    }
    index_.assign(split_, 0);
  }

  bool next(ByteRun& out) {
    if (done_) return false;
    int64_t chunk_elem = 0, target_elem = 0;
    for (size_t d = 0; d < part_.rank(); ++d) {
      const int64_t g = part_.offset[d] + (d < split_ ? index_[d] : 0);
      chunk_elem += (g - chunk_box_.offset[d]) * chunk_stride_[d];
      target_elem += (g - target_box_.offset[d]) * target_stride_[d];
    }
    out.offset = static_cast<uint64_t>(chunk_elem * elem_);
    out.out = {base_ + target_elem * elem_, static_cast<size_t>(run_ * elem_)};
    size_t d = split_;
    while (d > 0 && ++index_[d - 1] == part_.shape[d - 1]) index_[--d] = 0;
    done_ = d == 0;
    return true;
  }

 private:
  const Box& chunk_box_;
  const Box& part_;
  const Box& target_box_;
  int64_t elem_;
  std::byte* base_;
  size_t split_ = 0;  // dims >= split_ form one contiguous run in both layouts
  int64_t run_ = 1;   // elements per run
  std::vector<int64_t> chunk_stride_, target_stride_;
  std::vector<int64_t> index_;  // position within the part, dims < split_
  bool done_ = false;
};

// A BOOL tensor's bytes must be 0 or 1: any other byte is not a bool (reading it is undefined
// behaviour in C++ and gives inconsistent results in LibTorch's kernels).
void check_bool_bytes(const at::Tensor& local, const Box& want, const PartToRead& p,
                      const std::string& key, const std::filesystem::path& dir) {
  at::Tensor view = local;
  for (size_t d = 0; d < want.rank(); ++d) {
    view = view.narrow(static_cast<int64_t>(d), p.part.offset[d] - want.offset[d], p.part.shape[d]);
  }
  const at::Tensor bytes = view.view(at::kByte);
  const at::Tensor bad = bytes.gt(1);
  if (!bad.any().item<bool>()) return;
  const at::Tensor first = at::nonzero(bad)[0].contiguous();
  std::vector<int64_t> index(first.data_ptr<int64_t>(), first.data_ptr<int64_t>() + first.numel());
  for (size_t d = 0; d < index.size(); ++d) index[d] += p.part.offset[d];
  const int value = bytes.masked_select(bad)[0].item<int>();  // row-major, as nonzero
  throw FormatError("[mixprec::checkpoint] " + (dir / p.chunk->file).string() + ": tensor '" +
                    p.chunk->tensor + "' of key '" + key + "': BOOL element " +
                    dims_to_string(index) + " holds byte " + std::to_string(value) +
                    "; a bool must be 0 or 1");
}

// Faults the destinations' pages in, writable, without changing a byte (madvise
// MADV_POPULATE_WRITE), in order, until `stop`. Run on a second thread ahead of the reads, it
// takes the page faults that fresh memory would otherwise make inside each read, one 4 KiB page
// at a time, off the reading thread: a 1 GiB load from the page cache took 0.52 s with the
// faults in the reads and 0.32 s with them ahead, against 0.28 s for a raw read doing the same
// (bench_checkpoint with MIXPREC_BENCH_CACHED=1, medians). In pieces, so that a failed read
// waits for one piece at most, and so that the call, which holds the process's memory-map lock,
// never keeps another thread's mmap waiting for long. Not transparent huge pages (MADV_HUGEPAGE,
// what loads asked for before): where the kernel's THP defrag setting is `madvise`, a common
// default, a hinted fault may wait for direct compaction, and such a load took 1.5-3.5 s
// instead of 0.4 s in about half the rounds. A kernel before 5.14 refuses the call at once.
constexpr std::size_t kPrefaultBytes = std::size_t{1} << 20;  // smaller ones are not worth it

void prefault(const std::vector<at::Tensor>& tensors, const std::stop_token& stop) {
#ifdef MADV_POPULATE_WRITE
  constexpr std::uintptr_t kPiece = std::uintptr_t{64} << 20;
  static const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  for (const at::Tensor& t : tensors) {
    if (t.nbytes() < kPrefaultBytes) continue;
    const auto begin = reinterpret_cast<std::uintptr_t>(t.const_data_ptr());
    const std::uintptr_t last = (begin + t.nbytes()) & ~(page - 1);  // whole pages only
    for (std::uintptr_t at = (begin + page - 1) & ~(page - 1); at < last; at += kPiece) {
      if (stop.stop_requested()) return;  // the read failed
      const std::size_t length = std::min(kPiece, last - at);
      if (::madvise(reinterpret_cast<void*>(at), length, MADV_POPULATE_WRITE) != 0 &&
          errno == EINVAL) {
        return;  // not supported here
      }
    }
  }
#else
  (void)tensors;
  (void)stop;
#endif
}

}  // namespace

ShardedStateDict read_checkpoint(const std::filesystem::path& dir, const ReadOptions& options) {
  const Directory checkpoint_dir = Directory::open(dir);  // everything read relative to it
  std::error_code ec;
  if (!std::filesystem::exists(std::filesystem::symlink_status(dir / kManifestFileName, ec)) &&
      std::filesystem::exists(std::filesystem::symlink_status(dir / kLatestFileName, ec))) {
    // Not "manifest.json: No such file": say what the directory is and what reads it.
    throw FormatError(std::string(kErrorPrefix) + dir.string() +
                      ": a checkpoint root (it holds 'latest'), not a checkpoint: read the one "
                      "resolve_checkpoint(root) names");
  }
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
    if (manifest.keys.count(key)) continue;
    std::vector<std::string> saved;
    for (const auto& [name, entry] : manifest.keys) saved.push_back(name);
    const std::vector<std::string> near = mixprec::detail::close_matches(key, saved);
    TORCH_CHECK(
        false, "[mixprec::checkpoint::read] ", dir.string(), ": no key '", key,
        "' in the checkpoint",
        near.empty() ? std::string() : " (close matches: " + mixprec::detail::join(near) + ")");
  }

  // Check every key's chunks before allocating anything: a damaged or hostile checkpoint must
  // fail on what it says, not on an allocation sized by what it claims.
  std::vector<KeyToRead> plan;
  for (const auto& [key, entry] : manifest.keys) {
    if (!options.keys.empty() && !options.keys.count(key)) continue;
    KeyToRead k{&key, &entry, std::nullopt, {}};
    if (options.flat_range) k.flat = options.flat_range(key, entry.shape);
    if (k.flat) {
      int64_t numel = 1;
      for (int64_t d : entry.shape) numel *= d;
      TORCH_CHECK(k.flat->begin >= 0 && k.flat->begin <= k.flat->end && k.flat->end <= numel,
                  "[mixprec::checkpoint::read] key '", key, "': requested flat range [",
                  k.flat->begin, ", ", k.flat->end, ") is outside its ", numel, " elements ",
                  dims_to_string(entry.shape));
      int64_t offset = 0;
      for (Box& box : flat_range_boxes(entry.shape, k.flat->begin, k.flat->end)) {
        const auto volume = static_cast<int64_t>(box.volume());
        k.regions.push_back({std::move(box), offset, {}});
        offset += volume;
      }
    } else {
      Box want{std::vector<int64_t>(entry.shape.size(), 0), entry.shape};
      if (options.slice) {
        if (auto slice = options.slice(key, entry.shape)) want = *slice;
      }
      TORCH_CHECK(fits_in(want, entry.shape), "[mixprec::checkpoint::read] key '", key,
                  "': requested slice ", want.to_string(), " is outside its shape ",
                  dims_to_string(entry.shape));
      k.regions.push_back({std::move(want), 0, {}});
    }
    for (Region& region : k.regions) {
      uint64_t covered = 0;
      for (const Chunk& chunk : entry.chunks) {
        std::optional<Box> part = intersect(chunk.box, region.want);
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
        covered += part->volume();
        region.parts.push_back({&chunk, &reader, std::move(*part)});
      }
      // The manifest's chunks tile the key (read_manifest checked it), so this holds unless
      // that check is wrong; a gap would leave uninitialized memory in the result.
      if (covered != region.want.volume()) {
        throw FormatError("[mixprec::checkpoint] " + dir.string() + ": key '" + key +
                          "': its chunks cover " + std::to_string(covered) + " of the " +
                          std::to_string(region.want.volume()) + " elements of slice " +
                          region.want.to_string());
      }
    }
    plan.push_back(std::move(k));
  }

  ReadStats stats;
  std::vector<at::Tensor> locals;
  for (const KeyToRead& k : plan) {
    const auto options_of = at::TensorOptions().dtype(to_scalar_type(k.entry->dtype));
    locals.push_back(k.flat ? at::empty({k.flat->numel()}, options_of)
                            : at::empty(k.regions.at(0).want.shape, options_of));
  }
  // Every destination exists before the first read, so that a second thread can fault them in
  // ahead of it (see prefault).
  std::jthread prefaulter;
  if (std::any_of(locals.begin(), locals.end(),
                  [](const at::Tensor& t) { return t.nbytes() >= kPrefaultBytes; })) {
    try {
      prefaulter = std::jthread([&locals](std::stop_token stop) { prefault(locals, stop); });
    } catch (const std::system_error&) {
      // No thread to be had (a process at its thread limit): the reads fault the pages in.
    }
  }
  for (size_t ki = 0; ki < plan.size(); ++ki) {
    const KeyToRead& k = plan[ki];
    const std::string& key = *k.key;
    at::Tensor local = locals[ki];
    for (const Region& region : k.regions) {
      at::Tensor target =
          k.flat ? local.narrow(0, region.flat_offset, static_cast<int64_t>(region.want.volume()))
                       .view(region.want.shape)
                 : local;
      for (const PartToRead& p : region.parts) {
        // A chunk needed whole is checked against its own checksum; one needed in part against
        // the checksums of the blocks the part touches (version 2), else again as a whole.
        const bool whole = p.part.shape == p.chunk->box.shape;
        TensorChecksums sums{p.chunk->checksum, 0, {}};
        if (!whole && manifest.block_bytes > 0) {
          sums.block_bytes = manifest.block_bytes;
          sums.blocks = p.chunk->block_checksums;
        }
        PartRuns runs(p.chunk->box, p.part, target, region.want);
        try {
          stats.bytes_read += p.reader->read_verified(
              p.chunk->tensor, [&](ByteRun& run) { return runs.next(run); }, sums);
        } catch (const ChecksumError& e) {
          if (p.chunk->tensor == key) throw;
          throw ChecksumError(std::string(e.what()) + " (key '" + key + "')");
        }
        stats.bytes_used += p.part.volume() * static_cast<uint64_t>(local.element_size());
        if (k.entry->dtype == Dtype::BOOL) check_bool_bytes(target, region.want, p, key, dir);
      }
    }
    ShardedTensor shard;
    shard.local = std::move(local);
    shard.global_shape = k.entry->shape;
    if (k.flat) {
      shard.flat_range = k.flat;
    } else {
      shard.global_offset = k.regions.at(0).want.offset;
    }
    out.tensors.emplace(key, std::move(shard));
  }
  if (options.stats != nullptr) *options.stats = stats;
  return out;
}

}  // namespace mixprec::checkpoint
