// Private: the save path split into pieces, so a synchronous save streams from the tensors'
// own memory and an asynchronous one from staged host copies, through the same writer.
#pragma once

#include "mixprec/checkpoint/save.h"

#include <functional>

namespace mixprec::checkpoint::detail {

// Pieces are at most this many bytes.
inline constexpr int64_t kPieceBytes = int64_t{64} << 20;

// A run of elements of one shard, at most 64 MiB: the unit of writing and of staging.
struct Piece {
  size_t rank;
  std::string key;
  const at::Tensor* tensor;  // the shard's local tensor
  int64_t begin;             // first element (flat, row-major)
  int64_t count;
};

// Where the writer gets a piece's bytes from. acquire() may block; the returned tensor is a
// contiguous CPU tensor of exactly the piece's bytes, valid until release().
class PieceSource {
 public:
  virtual ~PieceSource() = default;
  virtual at::Tensor acquire(const Piece& piece) = 0;
  virtual void release(const Piece& piece) = 0;
};

// Visits the pieces of one rank's replica-0 shards in write order.
void for_each_piece(const ShardedStateDict& state, size_t rank,
                    const std::function<void(const Piece&)>& fn);

// The piece's bytes on the host (a view of the tensor when it is CPU and contiguous).
at::Tensor piece_on_host(const Piece& piece);

// Throws, as save_checkpoint does, if `ranks` cannot be saved. No I/O.
void check_savable(const std::vector<const ShardedStateDict*>& ranks);

// save_checkpoint with the bytes coming from `source`.
SaveResult save_from_source(const std::filesystem::path& root, const std::string& name,
                            const std::vector<const ShardedStateDict*>& ranks,
                            PieceSource& source, const SaveOptions& options);

}  // namespace mixprec::checkpoint::detail
