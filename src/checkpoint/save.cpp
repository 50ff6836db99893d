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

std::map<std::string, WrittenTensor> write_rank_file(const Directory& dir, size_t rank,
                                                     const ShardedStateDict& state,
                                                     PieceSource& source, uint64_t block_bytes,
                                                     uint64_t& bytes) {
  std::vector<TensorSpec> specs;
  for (const auto& [key, shard] : state.tensors) {
    if (shard.replica_id != 0) continue;
    const Dtype dtype = to_checkpoint_dtype(shard.local.scalar_type());
    for (const StoredTensor& stored : stored_tensors(key, shard)) {
      specs.push_back({stored.name, dtype, stored.box.shape});
    }
  }
  std::map<std::string, WrittenTensor> checksums;
  if (specs.empty()) return checksums;
  SafetensorsWriter writer(dir, data_file_name(rank), specs);
  if (block_bytes > 0) writer.checksum_blocks(block_bytes);
  for_each_piece(
      state, rank,
      [&](const Piece& piece) {
        const at::Tensor bytes_on_host = source.acquire(piece);
        writer.write(piece.tensor, {static_cast<const std::byte*>(bytes_on_host.const_data_ptr()),
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
              "); an optimizer step, or a forward in training mode (it updates buffers such as "
              "BatchNorm's statistics), between building the state dict and saving it would "
              "store one step's values under another's step count. Build the state dict right "
              "before saving, and change nothing until save() returns (an async save: until "
              "wait_until_staged() returns).");
}

void for_each_piece(const ShardedStateDict& state, size_t rank,
                    const std::function<void(const Piece&)>& fn, int64_t piece_bytes) {
  for (const auto& [key, shard] : state.tensors) {
    if (shard.replica_id != 0) continue;
    const int64_t per_piece = std::max<int64_t>(1, piece_bytes / shard.local.element_size());
    for (const StoredTensor& stored : stored_tensors(key, shard)) {
      const auto numel = static_cast<int64_t>(stored.box.volume());
      for (int64_t done = 0; done < numel; done += per_piece) {
        fn(Piece{rank, key, stored.name, &shard.local, stored.local_begin + done,
                 std::min(per_piece, numel - done)});
      }
    }
  }
}

void copy_piece(const Piece& piece, const at::Tensor& out) {
  TORCH_INTERNAL_ASSERT(out.is_contiguous() && out.numel() == piece.count &&
                        out.scalar_type() == piece.local->scalar_type());
  copy_flat_range(*piece.local, piece.begin, piece.count, out);
}

at::Tensor DirectSource::acquire(const Piece& piece) { return piece_on_host(piece); }
void DirectSource::finish() { check_unchanged(ranks_, "while it was being written"); }

at::Tensor piece_on_host(const Piece& piece) {
  const at::Tensor& t = *piece.local;
  if (t.is_cpu() && t.is_contiguous()) return t.reshape({-1}).narrow(0, piece.begin, piece.count);
  at::Tensor out = at::empty({piece.count}, t.options().device(at::kCPU));
  copy_piece(piece, out);
  return out;
}

SaveResult save_from_source(const std::filesystem::path& root, const std::string& name,
                            const std::vector<const ShardedStateDict*>& ranks, PieceSource& source,
                            const SaveOptions& options) {
  check_savable(ranks);
  std::vector<std::string> problems;
  std::vector<RankPlan> plans;
  for (size_t r = 0; r < ranks.size(); ++r) plans.push_back(plan_rank(*ranks[r], r, problems));
  std::map<std::string, KeyEntry> keys = merge_plans(plans, std::move(problems));

  SaveResult result;
  RootWriter writer(root, WriterOptions{options.lock_timeout(), options.stale_staging_timeout()});
  const std::unique_ptr<CheckpointStaging> staging = writer.stage(name);
  std::map<std::string, std::map<std::string, WrittenTensor>> written;
  for (size_t r = 0; r < ranks.size(); ++r) {
    auto checksums = write_rank_file(staging->directory(), r, *ranks[r], source,
                                     options.checksum_block_bytes(), result.tensor_bytes);
    if (checksums.empty()) continue;
    written[data_file_name(r)] = std::move(checksums);
    ++result.files;
  }
  source.finish();  // may abandon the save: nothing is committed yet
  return commit_checkpoint(writer, *staging, std::move(keys), written, ranks[0]->common, options,
                           std::move(result));
}

SaveResult commit_checkpoint(RootWriter& writer, CheckpointStaging& staging,
                             std::map<std::string, KeyEntry> keys,
                             std::map<std::string, std::map<std::string, WrittenTensor>>& written,
                             const nlohmann::json& common, const SaveOptions& options,
                             SaveResult result) {
  result.cleaned_staging = writer.report().cleaned_staging;
  result.repaired_latest = writer.report().repaired_latest;
  result.warnings = writer.report().warnings;
  Manifest manifest;
  manifest.sequence = writer.next_sequence();
  manifest.block_bytes = options.checksum_block_bytes();
  fill_checksums(keys, written);
  manifest.keys = std::move(keys);
  const std::string common_text = common.dump(2) + "\n";
  staging.write_file("common.json", common_text);
  manifest.common_file = CommonFileRef{
      "common.json", common_text.size(),
      xxh3_64({reinterpret_cast<const std::byte*>(common_text.data()), common_text.size()})};
  // Last: the table of contents.
  staging.write_file(kManifestFileName, manifest_to_json(manifest));
  PublishReport published = writer.publish(
      staging, PublishOptions{options.update_latest(), options.keep_last(), options.in_use()});
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
  detail::DirectSource source(ranks);
  return detail::save_from_source(root, name, ranks, source, options);
}

SaveResult save_checkpoint(const std::filesystem::path& root, const std::string& name,
                           const ShardedStateDict& state, const SaveOptions& options) {
  return save_checkpoint(root, name, std::vector<const ShardedStateDict*>{&state}, options);
}

}  // namespace mixprec::checkpoint
