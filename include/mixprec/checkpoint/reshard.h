// Data-parallel slicing: which part of each tensor a rank holds, for saving and for loading.
//
// The layout is an even split along dimension 0 (the first `rows % world` ranks get one row
// more), the layout of ZeRO-style sharded optimizer state. A checkpoint saved by N ranks
// records every chunk's global box, so M ≠ N ranks can load it: each asks read_checkpoint
// (load.h) for its own slice and reads only the checksum blocks that overlap it (1 MiB by
// default; a 3 → 2 reshard reads ~1.6% more than it uses), verifying every byte it uses.
#pragma once

#include "mixprec/checkpoint/format/box.h"
#include "mixprec/checkpoint/load.h"
#include "mixprec/sharded_state_dict.h"

namespace mixprec::checkpoint {

// Rank `rank`'s slice of a tensor of `global_shape` among `world` ranks. A 0-dim tensor is not
// split: every rank's slice is the whole (rank 0 owns it, see shard_for_rank).
// Throws c10::Error unless 0 <= rank < world.
Box dp_slice(const std::vector<int64_t>& global_shape, int64_t rank, int64_t world);

// Rank `rank`'s part of a whole-tensor state dict: each local tensor is a view (no copy) of
// its dp_slice. Tensors that are not split (0-dim) are replicas on ranks > 0 (replica_id =
// rank), so they are written once. Common state is kept on every rank.
ShardedStateDict shard_for_rank(const ShardedStateDict& whole, int64_t rank, int64_t world);

// ReadOptions that make read_checkpoint return rank `rank`'s dp_slice of every key.
ReadOptions read_options_for_rank(int64_t rank, int64_t world);

}  // namespace mixprec::checkpoint
