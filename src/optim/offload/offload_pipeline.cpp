// The offloading pipeline: planning chunks, running copies beside host steps.
//
// Order of work for D = chunks_in_flight staging buffers and chunks 0..n-1:
//   download 0..D-1;  then for each k: wait for download k, step k on the host, upload k, and
//   download k+D into k's buffer once upload k is done (the copier orders that).
// So while chunk k is stepped, the copier uploads chunk k-1 and downloads chunk k+1 (D >= 2).
#include "optim/offload/offload_pipeline.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <utility>

namespace mixprec::optim::detail {
namespace {

// Each piece's gradient and parameter start at a cache-line boundary of the staging buffer.
constexpr int64_t kAlign = 64;
int64_t align_up(int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// `numel` elements of `dtype` at byte `offset` of a staging buffer.
at::Tensor staged(const at::Tensor& staging, int64_t offset, int64_t numel, at::ScalarType dtype) {
  return staging.narrow(0, offset, numel * static_cast<int64_t>(c10::elementSize(dtype)))
      .view(dtype);
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

void OffloadPipeline::check_options(const OffloadOptions& options, const char* who) {
  TORCH_CHECK(options.chunk_bytes() >= 256, "[", who,
              "] OffloadOptions::chunk_bytes must be at least 256, got ", options.chunk_bytes());
  TORCH_CHECK(options.chunks_in_flight() >= 1, "[", who,
              "] OffloadOptions::chunks_in_flight must be at least 1, got ",
              options.chunks_in_flight());
}

OffloadPipeline::OffloadPipeline(const OffloadOptions& options, c10::Device device, const char* who)
    : options_(options), device_(device) {
  check_options(options, who);
  copier_ = make_device_copier(device);
}

OffloadPipeline::~OffloadPipeline() = default;

std::vector<OffloadPipeline::Chunk> OffloadPipeline::plan(
    const std::vector<OffloadItem>& items) const {
  std::vector<Chunk> chunks;
  Chunk current;
  int64_t used = 0;  // bytes of the current chunk's buffer taken, a multiple of kAlign
  for (size_t i = 0; i < items.size(); ++i) {
    const int64_t numel = items[i].param.numel();
    const int64_t grad_size = static_cast<int64_t>(items[i].grad.element_size());
    const int64_t param_size = static_cast<int64_t>(items[i].param.element_size());
    for (int64_t begin = 0; begin < numel;) {
      // Two regions, each padded to kAlign: n elements fit when n·(g+p) + 2·(kAlign−1) fit.
      const int64_t fit =
          (options_.chunk_bytes() - used - 2 * (kAlign - 1)) / (grad_size + param_size);
      if (fit < 1) {
        TORCH_INTERNAL_ASSERT(!current.empty());  // chunk_bytes >= 256 holds one element
        chunks.push_back(std::move(current));
        current.clear();
        used = 0;
        continue;
      }
      const int64_t n = std::min(fit, numel - begin);
      Piece piece{i, begin, begin + n, used, used + align_up(n * grad_size)};
      used = piece.param_offset + align_up(n * param_size);
      current.push_back(piece);
      begin += n;
    }
  }
  if (!current.empty()) chunks.push_back(std::move(current));
  return chunks;
}

void OffloadPipeline::step_chunk(const AlgorithmTraits& traits,
                                 const std::vector<OffloadItem>& items, const Chunk& chunk,
                                 const at::Tensor& staging, double grad_multiplier) const {
  for (const Piece& p : chunk) {
    const OffloadItem& item = items[p.item];
    const int64_t n = p.end - p.begin;
    const at::Tensor grad = staged(staging, p.grad_offset, n, item.grad.scalar_type());
    const at::Tensor param = staged(staging, p.param_offset, n, item.param.scalar_type());
    auto slice = [&](const at::Tensor& t) {
      return t.defined() ? t.narrow(0, p.begin, n) : at::Tensor();
    };
    const at::Tensor master = slice(item.master);
    const at::Tensor remainder = slice(item.remainder);
    std::vector<at::Tensor> state;
    for (const at::Tensor& t : item.state) state.push_back(slice(t));
    // The FP32 value stepped: the main copy, or the native FP32 parameter staged here.
    const at::Tensor target =
        remainder.defined() ? at::Tensor() : (master.defined() ? master : param);
    const at::Tensor model_param = master.defined() || remainder.defined() ? param : at::Tensor();
    traits.step(*item.options,
                StepArgs{target, grad, model_param, item.steps_before, grad_multiplier, remainder,
                         item.fresh},
                state);
  }
}

void OffloadPipeline::prepare(const std::vector<OffloadItem>& items) {
  reserve_staging(plan(items).size());
}

size_t OffloadPipeline::reserve_staging(size_t chunks) {
  const size_t depth = std::min<size_t>(static_cast<size_t>(options_.chunks_in_flight()), chunks);
  while (staging_.size() < depth) staging_.push_back(copier_->staging(options_.chunk_bytes()));
  return depth;
}

OffloadStats OffloadPipeline::run(const AlgorithmTraits& traits,
                                  const std::vector<OffloadItem>& items, double grad_multiplier) {
  for (const OffloadItem& item : items) {
    TORCH_INTERNAL_ASSERT(item.options && item.grad.device() == device_ &&
                          item.param.device() == device_ && item.grad.is_contiguous() &&
                          item.param.is_contiguous() && item.grad.dim() == 1 &&
                          item.grad.numel() == item.param.numel());
  }
  OffloadStats stats;
  const std::vector<Chunk> chunks = plan(items);
  const size_t n = chunks.size();
  stats.chunks = static_cast<int64_t>(n);
  if (n == 0) return stats;
  const size_t depth = reserve_staging(n);
  // The parameters are written by copies, which bump no version counter on every engine: bump
  // each once, before the first host step, as the kernels do for what they write. Not
  // earlier: a step that fails before it changes anything (staging memory, a download) must
  // not look like a write from outside, which the optimizer would answer by re-seeding every
  // master from its parameter (with remainders: losing their low halves). From the first host
  // step on, a failure leaves masters ahead of their parameters, and the re-seed is the repair.
  bool bumped = false;
  const auto before_first_write = [&] {
    if (std::exchange(bumped, true)) return;
    for (const OffloadItem& item : items) item.param.unsafeGetTensorImpl()->bump_version();
  };

  auto copies = [&](size_t k, bool down) {
    std::vector<CopySpan> spans;
    const at::Tensor& buffer = staging_[k % depth];
    for (const Piece& p : chunks[k]) {
      const OffloadItem& item = items[p.item];
      const int64_t len = p.end - p.begin;
      const at::Tensor param_host = staged(buffer, p.param_offset, len, item.param.scalar_type());
      const at::Tensor param_device = item.param.narrow(0, p.begin, len);
      if (down) {
        spans.push_back({staged(buffer, p.grad_offset, len, item.grad.scalar_type()),
                         item.grad.narrow(0, p.begin, len)});
        stats.bytes_down += static_cast<int64_t>(spans.back().dst.nbytes());
        if (item.param_down) {
          spans.push_back({param_host, param_device});
          stats.bytes_down += static_cast<int64_t>(param_host.nbytes());
        }
      } else {
        spans.push_back({param_device, param_host});
        stats.bytes_up += static_cast<int64_t>(param_host.nbytes());
      }
    }
    return spans;
  };

  std::vector<DeviceCopier::Ticket> issued;  // every ticket, so a failure can drain them
  struct Drain {
    DeviceCopier& copier;
    const std::vector<DeviceCopier::Ticket>& tickets;
    bool armed = true;
    ~Drain() {
      if (!armed) return;
      // Staging buffers and the tensors copies read must outlive the copies.
      for (DeviceCopier::Ticket t : tickets) {
        try {
          copier.wait(t);
        } catch (...) {  // the error that brought us here is the one reported
        }
      }
      copier.take_busy_seconds();
    }
  } drain{*copier_, issued};

  const auto start = std::chrono::steady_clock::now();
  copier_->begin();
  std::vector<DeviceCopier::Ticket> down(n, DeviceCopier::kNone), up(n, DeviceCopier::kNone);
  for (size_t k = 0; k < depth; ++k) {
    down[k] = copier_->download(copies(k, true), DeviceCopier::kNone);
    issued.push_back(down[k]);
  }
  for (size_t k = 0; k < n; ++k) {
    copier_->wait(down[k]);
    before_first_write();
    const auto step_start = std::chrono::steady_clock::now();
    step_chunk(traits, items, chunks[k], staging_[k % depth], grad_multiplier);
    stats.step_seconds += seconds_since(step_start);
    up[k] = copier_->upload(copies(k, false));
    issued.push_back(up[k]);
    if (k + depth < n) {
      down[k + depth] = copier_->download(copies(k + depth, true), up[k]);
      issued.push_back(down[k + depth]);
    }
  }
  for (size_t k = 0; k < n; ++k) copier_->wait(up[k]);
  copier_->end();
  drain.armed = false;
  stats.wall_seconds = seconds_since(start);
  stats.copy_seconds = copier_->take_busy_seconds();
  return stats;
}

}  // namespace mixprec::optim::detail
