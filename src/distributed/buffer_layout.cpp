#include "mixprec/distributed/buffer_layout.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <sstream>
#include <tuple>

namespace mixprec::distributed {

int64_t LayoutParam::numel() const {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
}

namespace {

int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

GradLayout make_grad_layout(std::vector<LayoutParam> params, int world_size,
                            const LayoutOptions& options) {
  TORCH_CHECK(world_size >= 1,
              "[mixprec::distributed::make_grad_layout] world_size must be >= 1, got ", world_size);
  TORCH_CHECK(
      options.bucket_numel > 0 && options.shard_alignment > 0,
      "[mixprec::distributed::make_grad_layout] bucket_numel and shard_alignment must be > 0, "
      "got ",
      options.bucket_numel, " and ", options.shard_alignment);
  std::set<std::string> seen;
  for (const LayoutParam& p : params) {
    TORCH_CHECK(p.dtype == at::kFloat || p.dtype == at::kBFloat16 || p.dtype == at::kHalf,
                "[mixprec::distributed::make_grad_layout] '", p.fqn, "' has dtype ", p.dtype,
                "; gradient buffers hold Float, BFloat16 or Half");
    TORCH_CHECK(std::all_of(p.shape.begin(), p.shape.end(), [](int64_t d) { return d >= 0; }),
                "[mixprec::distributed::make_grad_layout] '", p.fqn, "' has shape ",
                shape_string(p.shape));
    TORCH_CHECK(seen.insert(p.fqn).second, "[mixprec::distributed::make_grad_layout] '", p.fqn,
                "' appears twice");
  }

  GradLayout layout;
  layout.world_size = world_size;
  layout.options = options;
  layout.params = std::move(params);
  const int64_t granule = world_size * options.shard_alignment;

  std::map<at::ScalarType, size_t> buffer_of;
  std::vector<int64_t> open_since;  // per buffer: begin of the open bucket (-1: none)
  // (reverse position of the first param, buffer, bucket) for the launch order
  std::vector<std::tuple<size_t, size_t, size_t>> firsts;
  auto close_bucket = [&](size_t b) {
    BufferLayout& buf = layout.buffers[b];
    if (open_since[b] < 0) return;
    const int64_t begin = open_since[b];
    const int64_t end = begin + round_up(buf.numel - begin, granule);
    buf.buckets.back().end = end;
    buf.numel = end;
    open_since[b] = -1;
  };
  const size_t count = layout.params.size();
  for (size_t k = 0; k < count; ++k) {
    const size_t index = count - 1 - k;  // reverse model order
    const LayoutParam& p = layout.params[index];
    auto [it, fresh] = buffer_of.emplace(p.dtype, layout.buffers.size());
    if (fresh) {
      layout.buffers.push_back(BufferLayout{p.dtype, 0, {}, {}});
      open_since.push_back(-1);
    }
    const size_t b = it->second;
    BufferLayout& buf = layout.buffers[b];
    if (open_since[b] < 0) {
      open_since[b] = buf.numel;
      buf.buckets.push_back(BucketSpan{buf.numel, buf.numel, {}});
      firsts.emplace_back(k, b, buf.buckets.size() - 1);
    }
    const int64_t begin = buf.numel;
    buf.spans.push_back(ParamSpan{index, buf.buckets.size() - 1, begin, begin + p.numel()});
    buf.buckets.back().spans.push_back(buf.spans.size() - 1);
    buf.numel = begin + p.numel();
    if (buf.numel - open_since[b] >= options.bucket_numel) close_bucket(b);
  }
  for (size_t b = 0; b < layout.buffers.size(); ++b) close_bucket(b);
  std::sort(firsts.begin(), firsts.end());
  for (const auto& [position, b, bucket] : firsts) layout.bucket_order.emplace_back(b, bucket);
  return layout;
}

std::pair<int64_t, int64_t> GradLayout::shard_range(size_t buffer, size_t bucket, int rank) const {
  TORCH_CHECK(buffer < buffers.size() && bucket < buffers[buffer].buckets.size(),
              "[mixprec::distributed::GradLayout::shard_range] no bucket ", bucket, " in buffer ",
              buffer);
  TORCH_CHECK(rank >= 0 && rank < world_size,
              "[mixprec::distributed::GradLayout::shard_range] rank ", rank, " is not in [0, ",
              world_size, ")");
  const BucketSpan& b = buffers[buffer].buckets[bucket];
  const int64_t shard = b.numel() / world_size;
  return {b.begin + rank * shard, b.begin + (rank + 1) * shard};
}

std::vector<ParamShard> GradLayout::param_shards(int rank) const {
  std::vector<ParamShard> out;
  for (size_t b = 0; b < buffers.size(); ++b) {
    const BufferLayout& buf = buffers[b];
    for (size_t k = 0; k < buf.buckets.size(); ++k) {
      const auto [lo, hi] = shard_range(b, k, rank);
      for (size_t s : buf.buckets[k].spans) {
        const ParamSpan& span = buf.spans[s];
        const int64_t begin = std::max(lo, span.begin);
        const int64_t end = std::min(hi, span.end);
        if (begin >= end) continue;
        const LayoutParam& p = params[span.param];
        out.push_back(ParamShard{p.fqn, p.shape, p.dtype, begin - span.begin, end - span.begin,
                                 span.param, b, k, begin});
      }
    }
  }
  return out;
}

std::string GradLayout::describe() const {
  std::ostringstream os;
  os << "grad buffers for world size " << world_size << " (bucket_numel " << options.bucket_numel
     << ", shard_alignment " << options.shard_alignment << ")\n";
  for (size_t b = 0; b < buffers.size(); ++b) {
    const BufferLayout& buf = buffers[b];
    os << "buffer " << b << ": " << c10::toString(buf.dtype) << ", " << buf.numel << " elements, "
       << buf.buckets.size() << " bucket(s)\n";
    for (size_t k = 0; k < buf.buckets.size(); ++k) {
      const BucketSpan& bucket = buf.buckets[k];
      os << "  bucket " << k << " [" << bucket.begin << ", " << bucket.end << ")\n";
      for (size_t s : bucket.spans) {
        const ParamSpan& span = buf.spans[s];
        const LayoutParam& p = params[span.param];
        os << "    param " << p.fqn << " " << shape_string(p.shape) << " at [" << span.begin << ", "
           << span.end << ")\n";
      }
      for (int r = 0; r < world_size; ++r) {
        const auto [lo, hi] = shard_range(b, k, r);
        os << "    rank " << r << " [" << lo << ", " << hi << "):";
        bool any = false;
        for (size_t s : bucket.spans) {
          const ParamSpan& span = buf.spans[s];
          const int64_t begin = std::max(lo, span.begin), end = std::min(hi, span.end);
          if (begin >= end) continue;
          os << " " << params[span.param].fqn << "[" << begin - span.begin << ":"
             << end - span.begin << "]";
          any = true;
        }
        os << (any ? "" : " (padding only)") << "\n";
      }
    }
  }
  return os.str();
}

}  // namespace mixprec::distributed
