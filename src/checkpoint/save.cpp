#include "mixprec/checkpoint/save.h"

#include "detail/name_match.h"

#include "checkpoint/save_pipeline.h"

#include "mixprec/checkpoint/format/checksum.h"
#include "mixprec/checkpoint/format/commit.h"
#include "mixprec/checkpoint/format/manifest.h"
#include "mixprec/checkpoint/format/root_writer.h"
#include "mixprec/checkpoint/format/safetensors_writer.h"
#include "mixprec/checkpoint/tensor_dtype.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdio>

namespace mixprec::checkpoint {
namespace {

// Pieces (detail::kPieceBytes) are large enough for full-speed write(2), small enough that a
// device tensor's host copy and an async save's staging unit stay small.
using detail::kPieceBytes;

std::string data_file_name(size_t rank) {
  char name[48];
  std::snprintf(name, sizeof(name), "data-%05zu.safetensors", rank);
  return name;
}

struct KeyPlan {
  Dtype dtype;
  std::vector<int64_t> global_shape;
  std::vector<Chunk> chunks;  // replica-0 shards, in rank order
  std::vector<size_t> chunk_rank;
};

// Checks every shard of every rank and builds the per-key plan. Throws before any I/O.
std::map<std::string, KeyPlan> plan_keys(const std::vector<const ShardedStateDict*>& ranks) {
  std::map<std::string, KeyPlan> plan;
  std::vector<std::string> problems;
  for (size_t r = 0; r < ranks.size(); ++r) {
    TORCH_CHECK(ranks[r] != nullptr, "[mixprec::checkpoint::save] rank ", r, " state is null");
  }
  detail::check_unchanged(ranks, "since the state dict was built");
  for (size_t r = 0; r < ranks.size(); ++r) {
    for (const auto& [key, shard] : ranks[r]->tensors) {
      const std::string where = "key '" + key + "' (rank " + std::to_string(r) + ")";
      if (!shard.local.defined()) {
        problems.push_back(where + ": undefined tensor");
        continue;
      }
      const Dtype dtype = to_checkpoint_dtype(shard.local.scalar_type());
      if (shard.global_offset.size() != shard.global_shape.size() ||
          shard.local.dim() != static_cast<int64_t>(shard.global_shape.size())) {
        problems.push_back(where + ": local rank " + std::to_string(shard.local.dim()) +
                           ", global shape " + dims_to_string(shard.global_shape) + ", offset " +
                           dims_to_string(shard.global_offset));
        continue;
      }
      auto [it, inserted] = plan.try_emplace(key, KeyPlan{dtype, shard.global_shape, {}, {}});
      KeyPlan& kp = it->second;
      if (!inserted && (kp.dtype != dtype || kp.global_shape != shard.global_shape)) {
        problems.push_back(where + ": dtype/global shape " + std::string(dtype_name(dtype)) + " " +
                           dims_to_string(shard.global_shape) + " disagrees with another rank's " +
                           std::string(dtype_name(kp.dtype)) + " " +
                           dims_to_string(kp.global_shape));
        continue;
      }
      if (shard.replica_id != 0) continue;  // a replica: written once, by its replica 0
      Chunk chunk;
      chunk.file = data_file_name(r);
      chunk.tensor = key;
      chunk.box = Box{shard.global_offset, shard.local.sizes().vec()};
      chunk.bytes = static_cast<uint64_t>(shard.local.numel()) * element_size(dtype);
      kp.chunks.push_back(std::move(chunk));
      kp.chunk_rank.push_back(r);
    }
  }
  for (const auto& [key, kp] : plan) {
    std::vector<Box> boxes;
    for (const auto& c : kp.chunks) boxes.push_back(c.box);
    if (auto problem = check_tiling(boxes, kp.global_shape)) {
      using Kind = TilingProblem::Kind;
      std::string what =
          problem->kind == Kind::kOverlap
              ? "shards of ranks " + std::to_string(kp.chunk_rank[problem->first]) + " and " +
                    std::to_string(kp.chunk_rank[problem->second]) +
                    " overlap (a shard written twice? mark duplicates with replica_id > 0)"
          : problem->kind == Kind::kGap
              ? "replica-0 shards cover " + std::to_string(problem->covered) + " of " +
                    std::to_string(problem->total) + " elements"
              : "shard " + kp.chunks[problem->first].box.to_string() + " lies outside " +
                    dims_to_string(kp.global_shape);
      problems.push_back("key '" + key + "': " + what);
    }
  }
  mixprec::detail::check_no_problems(problems, "[mixprec::checkpoint::save] cannot save");
  return plan;
}

// Streams one rank's replica-0 shards into its data file, piece by piece as `source` hands
// them over; returns each key's checksums (whole and per block).
std::map<std::string, WrittenTensor> write_rank_file(const CheckpointStaging& staging, size_t rank,
                                                     const ShardedStateDict& state,
                                                     detail::PieceSource& source,
                                                     uint64_t block_bytes, uint64_t& bytes) {
  std::vector<TensorSpec> specs;
  for (const auto& [key, shard] : state.tensors) {
    if (shard.replica_id != 0) continue;
    specs.push_back(
        {key, to_checkpoint_dtype(shard.local.scalar_type()), shard.local.sizes().vec()});
  }
  std::map<std::string, WrittenTensor> checksums;
  if (specs.empty()) return checksums;
  SafetensorsWriter writer(staging.directory(), data_file_name(rank), specs);
  if (block_bytes > 0) writer.checksum_blocks(block_bytes);
  detail::for_each_piece(
      state, rank,
      [&](const detail::Piece& piece) {
        const at::Tensor bytes_on_host = source.acquire(piece);
        writer.write(piece.key, {static_cast<const std::byte*>(bytes_on_host.const_data_ptr()),
                                 bytes_on_host.nbytes()});
        source.release(piece);
      },
      source.piece_bytes());
  for (auto& written : writer.close()) {
    bytes += written.byte_size;
    checksums[written.name] = std::move(written);
  }
  return checksums;
}

// Hands out the state's own memory: no copy for CPU contiguous tensors.
class DirectSource final : public detail::PieceSource {
 public:
  explicit DirectSource(const std::vector<const ShardedStateDict*>& ranks) : ranks_(ranks) {}
  at::Tensor acquire(const detail::Piece& piece) override { return detail::piece_on_host(piece); }
  void release(const detail::Piece&) override {}
  // The bytes were read from live tensors: a step while they were written would mix steps.
  void finish() override { detail::check_unchanged(ranks_, "while it was being written"); }

 private:
  const std::vector<const ShardedStateDict*>& ranks_;
};

// Copies the row-major elements [begin, begin + count) of `t` into the flat contiguous `out`
// one sub-box at a time: a partial leading row, the whole rows, a partial trailing row (the
// partial rows recursively). Each element is copied once.
void copy_flat_range(const at::Tensor& t, int64_t begin, int64_t count, const at::Tensor& out) {
  if (count == 0) return;
  if (t.dim() <= 1 || t.is_contiguous()) {
    out.copy_(t.reshape({-1}).narrow(0, begin, count));  // a view: t is contiguous or 1-D
    return;
  }
  const int64_t row = t.numel() / t.size(0);
  int64_t r = begin / row, offset = begin % row, done = 0;
  if (offset != 0) {
    const int64_t take = std::min(count, row - offset);
    copy_flat_range(t.select(0, r), offset, take, out.narrow(0, 0, take));
    done += take;
    ++r;
  }
  const int64_t rows = (count - done) / row;
  if (rows > 0) {
    at::Tensor block = t.narrow(0, r, rows);
    out.narrow(0, done, rows * row).view(block.sizes()).copy_(block);
    done += rows * row;
    r += rows;
  }
  if (done < count)
    copy_flat_range(t.select(0, r), 0, count - done, out.narrow(0, done, count - done));
}

}  // namespace

namespace detail {

void check_savable(const std::vector<const ShardedStateDict*>& ranks) {
  TORCH_CHECK(!ranks.empty(), "[mixprec::checkpoint::save] no state to save");
  plan_keys(ranks);
}

void check_unchanged(const std::vector<const ShardedStateDict*>& ranks, const char* when) {
  std::vector<std::string> changed;
  for (const ShardedStateDict* state : ranks) {
    for (const auto& [key, shard] : state->tensors) {
      if (shard.version >= 0 && shard.local.defined() && !shard.local.is_inference() &&
          shard.local._version() != shard.version) {
        changed.push_back(key);
      }
    }
  }
  TORCH_CHECK(changed.empty(), "[mixprec::checkpoint::save] the state dict is not a consistent ",
              "snapshot: ", changed.size(), " tensor(s) changed ", when, " (",
              mixprec::detail::join(changed),
              "); an optimizer step between building the state dict and saving it would store "
              "moments of one step under the step count of another. Build the state dict "
              "right before saving, and do not step until save() returns.");
}

void for_each_piece(const ShardedStateDict& state, size_t rank,
                    const std::function<void(const Piece&)>& fn, int64_t piece_bytes) {
  for (const auto& [key, shard] : state.tensors) {
    if (shard.replica_id != 0) continue;
    const int64_t numel = shard.local.numel();
    const int64_t per_piece = std::max<int64_t>(1, piece_bytes / shard.local.element_size());
    for (int64_t begin = 0; begin < numel; begin += per_piece) {
      fn(Piece{rank, key, &shard.local, begin, std::min(per_piece, numel - begin)});
    }
  }
}

void copy_piece(const Piece& piece, const at::Tensor& out) {
  TORCH_INTERNAL_ASSERT(out.is_contiguous() && out.numel() == piece.count &&
                        out.scalar_type() == piece.tensor->scalar_type());
  copy_flat_range(*piece.tensor, piece.begin, piece.count, out);
}

at::Tensor piece_on_host(const Piece& piece) {
  const at::Tensor& t = *piece.tensor;
  if (t.is_cpu() && t.is_contiguous()) return t.reshape({-1}).narrow(0, piece.begin, piece.count);
  at::Tensor out = at::empty({piece.count}, t.options().device(at::kCPU));
  copy_piece(piece, out);
  return out;
}

SaveResult save_from_source(const std::filesystem::path& root, const std::string& name,
                            const std::vector<const ShardedStateDict*>& ranks, PieceSource& source,
                            const SaveOptions& options) {
  TORCH_CHECK(!ranks.empty(), "[mixprec::checkpoint::save] no state to save");
  std::map<std::string, KeyPlan> plan = plan_keys(ranks);

  SaveResult result;
  RootWriter writer(root, WriterOptions{options.lock_timeout(), options.stale_staging_timeout()});
  result.cleaned_staging = writer.report().cleaned_staging;
  result.repaired_latest = writer.report().repaired_latest;
  result.warnings = writer.report().warnings;
  const std::unique_ptr<CheckpointStaging> staging = writer.stage(name);
  std::vector<std::map<std::string, WrittenTensor>> checksums(ranks.size());
  for (size_t r = 0; r < ranks.size(); ++r) {
    checksums[r] = write_rank_file(*staging, r, *ranks[r], source, options.checksum_block_bytes(),
                                   result.tensor_bytes);
    result.files += checksums[r].empty() ? 0 : 1;
  }
  source.finish();  // may abandon the save: nothing is committed yet

  Manifest manifest;
  manifest.sequence = writer.next_sequence();
  manifest.block_bytes = options.checksum_block_bytes();
  for (auto& [key, kp] : plan) {
    KeyEntry entry{kp.dtype, kp.global_shape, {}};
    for (size_t i = 0; i < kp.chunks.size(); ++i) {
      Chunk chunk = kp.chunks[i];
      WrittenTensor& written = checksums[kp.chunk_rank[i]].at(key);
      chunk.checksum = written.checksum;
      chunk.block_checksums = std::move(written.block_checksums);
      entry.chunks.push_back(std::move(chunk));
    }
    manifest.keys.emplace(key, std::move(entry));
  }
  const std::string common = ranks[0]->common.dump(2) + "\n";
  staging->write_file("common.json", common);
  manifest.common_file = CommonFileRef{
      "common.json", common.size(),
      xxh3_64({reinterpret_cast<const std::byte*>(common.data()), common.size()})};
  // Last: the table of contents.
  staging->write_file(kManifestFileName, manifest_to_json(manifest));
  PublishReport published = writer.publish(
      *staging, PublishOptions{options.update_latest(), options.keep_last(), options.in_use()});
  result.dir = std::move(published.dir);
  result.deleted = std::move(published.deleted);
  result.warnings.insert(result.warnings.end(), published.warnings.begin(),
                         published.warnings.end());
  return result;
}

}  // namespace detail

SaveResult save_checkpoint(const std::filesystem::path& root, const std::string& name,
                           const std::vector<const ShardedStateDict*>& ranks,
                           const SaveOptions& options) {
  DirectSource source(ranks);
  return detail::save_from_source(root, name, ranks, source, options);
}

SaveResult save_checkpoint(const std::filesystem::path& root, const std::string& name,
                           const ShardedStateDict& state, const SaveOptions& options) {
  return save_checkpoint(root, name, std::vector<const ShardedStateDict*>{&state}, options);
}

}  // namespace mixprec::checkpoint
