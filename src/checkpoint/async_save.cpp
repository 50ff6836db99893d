#include "mixprec/checkpoint/async_save.h"

#include "checkpoint/save_pipeline.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>

namespace mixprec::checkpoint {

// Reused staging buffers of one piece each: allocating (and page-faulting) a fresh 64 MiB
// buffer per piece would cost more than the copy itself, on every save.
struct AsyncCheckpointSaver::BufferPool {
  std::mutex mutex;
  std::vector<at::Tensor> free;  // uint8 buffers of kPieceBytes

  at::Tensor take() {
    std::lock_guard<std::mutex> lock(mutex);
    if (free.empty()) return at::empty({detail::kPieceBytes}, at::kByte);
    at::Tensor buffer = std::move(free.back());
    free.pop_back();
    return buffer;
  }
  void give_back(at::Tensor buffer) {
    std::lock_guard<std::mutex> lock(mutex);
    free.push_back(std::move(buffer));
  }
};

// Producer (save()) and consumer (the writer thread) share this; pieces flow in write order.
struct AsyncCheckpointSaver::Pipeline final : detail::PieceSource {
  struct Staged {
    at::Tensor buffer;  // from the pool
    std::size_t bytes;
  };
  std::mutex mutex;
  std::condition_variable changed;
  std::deque<Staged> staged;
  std::size_t staged_bytes = 0;
  std::size_t peak_bytes = 0;
  std::size_t budget = 0;
  bool producer_failed = false;  // the writer must stop
  bool writer_done = false;      // the producer must stop
  ShardedStateDict state;        // shapes only, for the writer
  std::shared_ptr<BufferPool> pool;
  std::optional<SaveResult> result;
  std::exception_ptr error;

  // Called by save(): blocks while the budget is full, unless the writer has stopped.
  bool stage(const detail::Piece& piece) {
    const at::Tensor source = detail::piece_on_host(piece);
    const std::size_t bytes = source.nbytes();
    {
      std::unique_lock<std::mutex> lock(mutex);
      changed.wait(lock, [&] {
        return writer_done || staged.empty() || staged_bytes + detail::kPieceBytes <= budget;
      });
      if (writer_done) return false;
    }
    at::Tensor buffer = pool->take();
    std::memcpy(buffer.data_ptr(), source.const_data_ptr(), bytes);
    std::lock_guard<std::mutex> lock(mutex);
    staged_bytes += detail::kPieceBytes;
    peak_bytes = std::max(peak_bytes, staged_bytes);
    staged.push_back({std::move(buffer), bytes});
    changed.notify_all();
    return true;
  }

  at::Tensor acquire(const detail::Piece& piece) override {
    std::unique_lock<std::mutex> lock(mutex);
    changed.wait(lock, [&] { return producer_failed || !staged.empty(); });
    TORCH_CHECK(!producer_failed, "[mixprec::checkpoint::AsyncCheckpointSaver] staging of '",
                piece.key, "' failed; the save is abandoned");
    const Staged& front = staged.front();
    TORCH_INTERNAL_ASSERT(
        front.bytes == static_cast<std::size_t>(piece.count * piece.tensor->element_size()),
        "staged piece out of order");
    return front.buffer.narrow(0, 0, static_cast<int64_t>(front.bytes));
  }

  void release(const detail::Piece&) override {
    std::lock_guard<std::mutex> lock(mutex);
    staged_bytes -= detail::kPieceBytes;
    pool->give_back(std::move(staged.front().buffer));
    staged.pop_front();
    changed.notify_all();
  }
};

AsyncCheckpointSaver::AsyncCheckpointSaver(AsyncSaveOptions options)
    : options_(options), pool_(std::make_shared<BufferPool>()) {
  TORCH_CHECK(options_.staging_budget_bytes >= (std::size_t{64} << 20),
              "[mixprec::checkpoint::AsyncCheckpointSaver] staging_budget_bytes must be at least "
              "64 MiB (one piece), got ",
              options_.staging_budget_bytes);
}

AsyncCheckpointSaver::~AsyncCheckpointSaver() {
  try {
    wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[mixprec::checkpoint] asynchronous save failed: %s\n", e.what());
  }
}

void AsyncCheckpointSaver::save(const std::filesystem::path& root, const std::string& name,
                                ShardedStateDict state, const SaveOptions& options) {
  wait();  // at most one in flight; surfaces the previous error
  detail::check_savable({&state});

  // The writer sees only shapes and dtypes (meta tensors): it reads bytes from the staged
  // copies, never from the caller's tensors, and holds none of them alive.
  ShardedStateDict shapes_only;
  shapes_only.common = state.common;
  for (const auto& [key, shard] : state.tensors) {
    ShardedTensor meta = shard;
    meta.local = at::empty(shard.local.sizes(), shard.local.options().device(at::kMeta));
    shapes_only.tensors.emplace(key, std::move(meta));
  }
  auto pipeline = std::make_shared<Pipeline>();
  pipeline->budget = options_.staging_budget_bytes;
  pipeline->pool = pool_;
  pipeline->state = std::move(shapes_only);
  pipeline_ = pipeline;
  worker_ = std::thread([pipeline, root, name, options] {
    try {
      pipeline->result =
          detail::save_from_source(root, name, {&pipeline->state}, *pipeline, options);
    } catch (...) {
      pipeline->error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(pipeline->mutex);
    pipeline->writer_done = true;
    for (auto& entry : pipeline->staged) pipeline->pool->give_back(std::move(entry.buffer));
    pipeline->staged.clear();
    pipeline->changed.notify_all();
  });
  struct WriterStopped {};
  try {
    detail::for_each_piece(state, 0, [&](const detail::Piece& piece) {
      if (!pipeline->stage(piece)) throw WriterStopped{};
    });
  } catch (const WriterStopped&) {
    // The writer failed; wait() and the next save() report why.
  } catch (...) {
    std::lock_guard<std::mutex> lock(pipeline->mutex);
    pipeline->producer_failed = true;
    pipeline->changed.notify_all();
    throw;
  }
}

std::optional<SaveResult> AsyncCheckpointSaver::wait() {
  if (!worker_.joinable()) return std::nullopt;
  worker_.join();
  auto pipeline = pipeline_;
  if (pipeline->error) std::rethrow_exception(pipeline->error);
  return pipeline->result;
}

std::size_t AsyncCheckpointSaver::peak_staged_bytes() const {
  if (!pipeline_) return 0;
  std::lock_guard<std::mutex> lock(pipeline_->mutex);  // the writer may still be running
  return pipeline_->peak_bytes;
}

}  // namespace mixprec::checkpoint
