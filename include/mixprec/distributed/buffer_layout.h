// Where every trainable parameter's gradient lives, and which rank owns which part of it.
//
// The layout is pure arithmetic over (FQN, shape, dtype) lists, the same on every rank, so it
// is computed in one place, printed in one place (describe()) and unit-tested without processes.
// As Megatron's param_and_grad_buffer.py:
//   * one contiguous buffer per gradient dtype (BF16, FP16, FP32): a parameter's gradient is
//     the range [begin, end) of its buffer, in the parameter's row-major element order;
//   * parameters enter their buffer in *reverse* model order (backward produces the last
//     layers' gradients first), and each buffer is cut into buckets at parameter boundaries:
//     a bucket closes once it holds at least `bucket_numel` elements (a bigger parameter gets
//     a bucket of its own);
//   * every bucket is padded to a multiple of world_size * shard_alignment elements and split
//     into world_size equal shards: rank r owns [begin + r*S, begin + (r+1)*S) of each bucket.
//     Shard boundaries may fall inside parameters: a parameter's part on a rank is always one
//     contiguous range of its flattened elements (ParamShard), which is what ZeRO-1 steps.
// Padding is at most world_size * shard_alignment - 1 elements per bucket; it holds zeros and
// belongs to no parameter.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace mixprec::distributed {

// A trainable parameter as the layout sees it.
struct LayoutParam {
  std::string fqn;
  std::vector<int64_t> shape;
  at::ScalarType dtype;  // Float, BFloat16 or Half
  int64_t numel() const;
};

struct LayoutOptions {
  int64_t bucket_numel = int64_t{1} << 22;  // close a bucket at >= this many elements (> 0)
  int64_t shard_alignment = 16;             // shard sizes are multiples of this many elements (> 0)
};

// One parameter's range in its buffer.
struct ParamSpan {
  size_t param;   // index into the list passed to make_grad_layout
  size_t bucket;  // index into BufferLayout::buckets
  int64_t begin;  // buffer elements [begin, end)
  int64_t end;
};

struct BucketSpan {
  int64_t begin;  // buffer elements [begin, end), padding included
  int64_t end;
  std::vector<size_t> spans;  // indices into BufferLayout::spans, in buffer order
  int64_t numel() const { return end - begin; }
};

struct BufferLayout {
  at::ScalarType dtype;
  int64_t numel = 0;             // padded total
  std::vector<ParamSpan> spans;  // in buffer order
  std::vector<BucketSpan> buckets;
};

// A rank's part of one parameter: elements [begin, end) of its row-major flattening.
struct ParamShard {
  std::string fqn;
  std::vector<int64_t> global_shape;
  at::ScalarType dtype;
  int64_t begin;
  int64_t end;
  size_t param;          // index into the list passed to make_grad_layout
  size_t buffer;         // index into GradLayout::buffers
  size_t bucket;         // index into that buffer's buckets
  int64_t buffer_begin;  // where element `begin` sits in the buffer
  int64_t numel() const { return end - begin; }
};

struct GradLayout {
  int world_size = 1;
  LayoutOptions options;
  std::vector<LayoutParam> params;    // as passed in
  std::vector<BufferLayout> buffers;  // in order of first appearance (reverse model order)
  // A launch order over every bucket of every buffer: by the position (in reverse model
  // order) of the bucket's first parameter, i.e. roughly the order backward fills them.
  std::vector<std::pair<size_t, size_t>> bucket_order;  // (buffer, bucket)

  // Rank `rank`'s shard of a bucket, in buffer elements.
  std::pair<int64_t, int64_t> shard_range(size_t buffer, size_t bucket, int rank) const;
  // Every non-empty part of every parameter that `rank` owns, in (buffer, buffer offset)
  // order. Over all ranks they partition every parameter's elements exactly.
  std::vector<ParamShard> param_shards(int rank) const;
  // A human-readable table: per buffer and bucket, the parameters with their ranges and every
  // rank's [begin, end) with the parameter pieces in it.
  std::string describe() const;
};

// Throws c10::Error "[mixprec::distributed::make_grad_layout] ..." naming the parameter for a dtype
// other than Float/BFloat16/Half, a negative dimension or a repeated FQN, and for
// world_size < 1 or non-positive options.
GradLayout make_grad_layout(std::vector<LayoutParam> params, int world_size,
                            const LayoutOptions& options = {});

}  // namespace mixprec::distributed
