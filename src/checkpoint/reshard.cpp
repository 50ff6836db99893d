#include "mixprec/checkpoint/reshard.h"

#include <c10/util/Exception.h>

namespace mixprec::checkpoint {

Box dp_slice(const std::vector<int64_t>& global_shape, int64_t rank, int64_t world) {
  TORCH_CHECK(world > 0 && rank >= 0 && rank < world, "[mixprec::checkpoint::dp_slice] rank ", rank,
              " is not in [0, ", world, ")");
  Box box{std::vector<int64_t>(global_shape.size(), 0), global_shape};
  if (global_shape.empty()) return box;
  const int64_t rows = global_shape[0];
  const int64_t base = rows / world;
  const int64_t extra = rows % world;
  box.offset[0] = rank * base + std::min(rank, extra);
  box.shape[0] = base + (rank < extra ? 1 : 0);
  return box;
}

ShardedStateDict shard_for_rank(const ShardedStateDict& whole, int64_t rank, int64_t world) {
  ShardedStateDict out;
  out.common = whole.common;
  for (const auto& [key, shard] : whole.tensors) {
    TORCH_CHECK(shard.is_whole(), "[mixprec::checkpoint::shard_for_rank] key '", key,
                "' is already a shard");
    const Box box = dp_slice(shard.global_shape, rank, world);
    ShardedTensor part;
    part.global_shape = shard.global_shape;
    part.global_offset = box.offset;
    part.version = shard.version;  // the slice is a view: it shares the version counter
    if (shard.global_shape.empty()) {
      part.local = shard.local;
      part.replica_id = rank;
    } else {
      part.local = shard.local.narrow(0, box.offset[0], box.shape[0]);
    }
    out.tensors.emplace(key, std::move(part));
  }
  return out;
}

ReadOptions read_options_for_rank(int64_t rank, int64_t world) {
  dp_slice({}, rank, world);  // validates rank and world now, not at read time
  ReadOptions options;
  options.slice = [rank, world](const std::string&, const std::vector<int64_t>& shape) {
    return std::optional<Box>(dp_slice(shape, rank, world));
  };
  return options;
}

}  // namespace mixprec::checkpoint
