// Private: the save path split into pieces, so a synchronous save streams from the tensors'
// own memory and an asynchronous one from staged host copies, through the same writer.
#pragma once

#include "mixprec/checkpoint/format/commit.h"
#include "mixprec/checkpoint/format/manifest.h"
#include "mixprec/checkpoint/format/root_writer.h"
#include "mixprec/checkpoint/format/safetensors_writer.h"
#include "mixprec/checkpoint/save.h"

#include <functional>
#include <map>

namespace mixprec::checkpoint::detail {

// Pieces are at most this many bytes (an asynchronous saver may choose smaller ones).
inline constexpr int64_t kPieceBytes = int64_t{64} << 20;

// "data-<rank, 5 digits>.safetensors": the file rank `rank` writes.
std::string data_file_name(size_t rank);

// One tensor of a rank's data file: a box shard whole, or one box of a flat shard.
struct StoredTensor {
  std::string name;     // in the file: the key, or "<key>/<i>" for box i of a flat shard of several
  Box box;              // where it sits in the global tensor
  int64_t local_begin;  // its first element in the shard's local tensor (flat, row-major)
};
// A box shard is one stored tensor; a flat shard is one per box of flat_range_boxes (none for
// an empty range). Each is a contiguous run of the local tensor's elements, in order.
std::vector<StoredTensor> stored_tensors(const std::string& key, const ShardedTensor& shard);

// What one rank will write, checked and before any checksum is known.
struct RankPlan {
  struct Key {
    Dtype dtype;
    std::vector<int64_t> global_shape;
    std::vector<Chunk> chunks;  // replica-0 stored tensors (checksums unset); may be empty
  };
  std::map<std::string, Key> keys;  // every key of the rank's state, replicas included
};
// Checks rank `rank`'s shards (dtype storable, offsets or flat range consistent with the
// global shape) and plans its chunks in its data file. Appends each problem, naming the key
// (and the rank, with `name_rank`: a caller that does not know its rank, such as an async
// save's, whose collective writer says which rank failed, leaves it out), to `problems`. No I/O.
RankPlan plan_rank(const ShardedStateDict& state, size_t rank, std::vector<std::string>& problems,
                   bool name_rank = true);
// The manifest's keys from every rank's plan (index = rank): a key's dtype and global shape
// must agree across ranks, and its replica-0 chunks must tile it exactly. Throws c10::Error
// "[mixprec::checkpoint::save] cannot save" listing every problem (`problems` first).
std::map<std::string, KeyEntry> merge_plans(const std::vector<RankPlan>& ranks,
                                            std::vector<std::string> problems = {});

// A run of elements of one stored tensor, at most one piece's bytes: the unit of writing and
// staging.
struct Piece {
  size_t rank;
  std::string key;
  std::string tensor;       // the stored tensor's name in the data file
  const at::Tensor* local;  // the shard's local tensor
  int64_t begin;            // first element in `local` (flat, row-major)
  int64_t count;
};

// Where the writer gets a piece's bytes from. acquire() may block; the returned tensor is a
// contiguous CPU tensor of exactly the piece's bytes, valid until release(). finish() runs
// after the last piece is written and before anything is committed: it throws to abandon the
// save (the staging directory is then removed).
class PieceSource {
 public:
  virtual ~PieceSource() = default;
  virtual at::Tensor acquire(const Piece& piece) = 0;
  virtual void release(const Piece& piece) = 0;
  virtual void finish() {}
  // The piece size the writer asks for (for_each_piece); the same pieces are staged.
  virtual int64_t piece_bytes() const { return kPieceBytes; }
};

// Hands out the state's own memory: no copy for CPU contiguous tensors (piece_on_host).
// finish() checks that no tensor changed while it was written (check_unchanged): the bytes
// were read from live tensors, and a step meanwhile would mix two steps.
class DirectSource final : public PieceSource {
 public:
  explicit DirectSource(std::vector<const ShardedStateDict*> ranks) : ranks_(std::move(ranks)) {}
  at::Tensor acquire(const Piece& piece) override;
  void release(const Piece&) override {}
  void finish() override;

 private:
  std::vector<const ShardedStateDict*> ranks_;
};

// Visits the pieces (at most piece_bytes each, at least one element) of one rank's replica-0
// stored tensors in write order (the order of its data file).
void for_each_piece(const ShardedStateDict& state, size_t rank,
                    const std::function<void(const Piece&)>& fn, int64_t piece_bytes = kPieceBytes);

// Copies the piece's elements into `out`, a contiguous CPU tensor of piece.count elements of
// the tensor's dtype, from any layout and device, in time linear in the piece's size (a
// non-contiguous tensor is never flattened whole).
void copy_piece(const Piece& piece, const at::Tensor& out);

// The piece's bytes on the host: a view of the tensor when it is CPU and contiguous, else a
// fresh piece-sized copy (copy_piece).
at::Tensor piece_on_host(const Piece& piece);

// Throws c10::Error naming the keys whose tensor changed (its version counter moved) since
// the state dict was built (ShardedTensor::version): the state would mix two training steps.
// `when` completes "changed <when>".
void check_unchanged(const std::vector<const ShardedStateDict*>& ranks, const char* when);

// Throws, as save_checkpoint does, if `ranks` cannot be saved. No I/O.
void check_savable(const std::vector<const ShardedStateDict*>& ranks);
// Throws c10::Error naming each place (by JSON pointer) where `common` holds what a reader
// would refuse or JSON cannot hold: nesting deeper than kMaxJsonDepth, strings or keys that
// are not UTF-8, NaN or infinities. check_savable calls it.
void check_common_state(const nlohmann::json& common);

// Streams rank `rank`'s replica-0 stored tensors into `dir`/data_file_name(rank), piece by
// piece as `source` hands them over, and fsyncs it; returns each stored tensor's checksums by
// name and adds the bytes written to `bytes`. Writes no file when the rank stores nothing.
std::map<std::string, WrittenTensor> write_rank_file(const Directory& dir, size_t rank,
                                                     const ShardedStateDict& state,
                                                     PieceSource& source, uint64_t block_bytes,
                                                     uint64_t& bytes);

// Fills each chunk's checksums from what its file's writer returned (`written[file][tensor]`).
void fill_checksums(std::map<std::string, KeyEntry>& keys,
                    std::map<std::string, std::map<std::string, WrittenTensor>>& written);

// The commit every save ends with, once each rank's file is written and durable: fills the
// checksums, writes common.json (`common`) and, last, the manifest into `staging`, publishes
// it, and returns `result` (which holds what the writing counted: tensor_bytes, files) with
// the writer's open report, the checkpoint's directory, what retention deleted and every
// warning.
SaveResult commit_checkpoint(RootWriter& writer, CheckpointStaging& staging,
                             std::map<std::string, KeyEntry> keys,
                             std::map<std::string, std::map<std::string, WrittenTensor>>& written,
                             const nlohmann::json& common, const SaveOptions& options,
                             SaveResult result);

// save_checkpoint with the bytes coming from `source`.
SaveResult save_from_source(const std::filesystem::path& root, const std::string& name,
                            const std::vector<const ShardedStateDict*>& ranks, PieceSource& source,
                            const SaveOptions& options);

}  // namespace mixprec::checkpoint::detail
