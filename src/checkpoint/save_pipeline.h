// Private: the save path split into pieces, so a synchronous save streams from the tensors'
// own memory and an asynchronous one from staged host copies, through the same writer.
#pragma once

#include "mixprec/checkpoint/save.h"

#include <functional>

namespace mixprec::checkpoint::detail {

// Pieces are at most this many bytes (an asynchronous saver may choose smaller ones).
inline constexpr int64_t kPieceBytes = int64_t{64} << 20;

// A run of elements of one shard, at most one piece's bytes: the unit of writing and staging.
struct Piece {
  size_t rank;
  std::string key;
  const at::Tensor* tensor;  // the shard's local tensor
  int64_t begin;             // first element (flat, row-major)
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

// Visits the pieces (at most piece_bytes each, at least one element) of one rank's replica-0
// shards in write order.
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

// save_checkpoint with the bytes coming from `source`.
SaveResult save_from_source(const std::filesystem::path& root, const std::string& name,
                            const std::vector<const ShardedStateDict*>& ranks, PieceSource& source,
                            const SaveOptions& options);

}  // namespace mixprec::checkpoint::detail
