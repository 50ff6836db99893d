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
  int64_t piece_bytes = 0;
  std::vector<at::Tensor> free;  // uint8 buffers of piece_bytes

  at::Tensor take() {
    std::lock_guard<std::mutex> lock(mutex);
    if (free.empty()) return at::empty({piece_bytes}, at::kByte);
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
  std::size_t piece_size = 0;
  bool producer_failed = false;   // the writer must stop
  bool producer_done = false;     // every piece is staged and the state was unchanged
  bool writer_done = false;       // the producer must stop
  bool writer_abandoned = false;  // the writer stopped because staging failed
  ShardedStateDict state;         // shapes only, for the writer
  std::shared_ptr<BufferPool> pool;
  std::optional<SaveResult> result;
  std::exception_ptr error;

  // Called by save(): blocks while the budget is full, unless the writer has stopped.
  bool stage(const detail::Piece& piece) {
    const std::size_t bytes = static_cast<std::size_t>(piece.count * piece.local->element_size());
    {
      std::unique_lock<std::mutex> lock(mutex);
      changed.wait(lock, [&] {
        return writer_done || staged.empty() || staged_bytes + piece_size <= budget;
      });
      if (writer_done) return false;
    }
    at::Tensor buffer = pool->take();
    // Straight from the tensor (any layout, any device) into the staging buffer.
    detail::copy_piece(
        piece, buffer.narrow(0, 0, static_cast<int64_t>(bytes)).view(piece.local->scalar_type()));
    std::lock_guard<std::mutex> lock(mutex);
    staged_bytes += piece_size;
    peak_bytes = std::max(peak_bytes, staged_bytes);
    staged.push_back({std::move(buffer), bytes});
    changed.notify_all();
    return true;
  }

  // Called by save() when staging ends: successfully, or not (the writer then abandons).
  void producer_finished(bool ok) {
    std::lock_guard<std::mutex> lock(mutex);
    (ok ? producer_done : producer_failed) = true;
    changed.notify_all();
  }

  at::Tensor acquire(const detail::Piece& piece) override {
    std::unique_lock<std::mutex> lock(mutex);
    changed.wait(lock, [&] { return producer_failed || !staged.empty(); });
    writer_abandoned = producer_failed;
    TORCH_CHECK(!producer_failed, "[mixprec::checkpoint::AsyncCheckpointSaver] staging of '",
                piece.key, "' failed; the save is abandoned");
    const Staged& front = staged.front();
    TORCH_INTERNAL_ASSERT(
        front.bytes == static_cast<std::size_t>(piece.count * piece.local->element_size()),
        "staged piece out of order");
    return front.buffer.narrow(0, 0, static_cast<int64_t>(front.bytes));
  }

  void release(const detail::Piece&) override {
    std::lock_guard<std::mutex> lock(mutex);
    staged_bytes -= piece_size;
    pool->give_back(std::move(staged.front().buffer));
    staged.pop_front();
    changed.notify_all();
  }

  int64_t piece_bytes() const override { return static_cast<int64_t>(piece_size); }

  // Nothing is committed until save() has staged the last piece and found the state
  // unchanged: the writer may have written every byte before that check.
  void finish() override {
    std::unique_lock<std::mutex> lock(mutex);
    changed.wait(lock, [&] { return producer_failed || producer_done; });
    writer_abandoned = producer_failed;
    TORCH_CHECK(!producer_failed,
                "[mixprec::checkpoint::AsyncCheckpointSaver] staging failed; the save is "
                "abandoned");
  }
};

AsyncCheckpointSaver::AsyncCheckpointSaver(AsyncSaveOptions options)
    : options_(std::move(options)), pool_(std::make_shared<BufferPool>()) {
  TORCH_CHECK(options_.piece_bytes() >= 4096,
              "[mixprec::checkpoint::AsyncCheckpointSaver] piece_bytes must be at least 4 KiB, "
              "got ",
              options_.piece_bytes());
  TORCH_CHECK(options_.staging_budget_bytes() >= options_.piece_bytes(),
              "[mixprec::checkpoint::AsyncCheckpointSaver] staging_budget_bytes must be at least "
              "one piece (",
              options_.piece_bytes(), " bytes), got ", options_.staging_budget_bytes());
  pool_->piece_bytes = static_cast<int64_t>(options_.piece_bytes());
}

AsyncCheckpointSaver::~AsyncCheckpointSaver() {
  try {
    wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[mixprec::checkpoint] asynchronous save failed: %s\n", e.what());
  }
}

void AsyncCheckpointSaver::abandon() {
  pipeline_->producer_finished(/*ok=*/false);
  worker_.join();
  // An error that only says staging failed is not reported again: save() throws the cause.
  // One the writer hit on its own (before it noticed) is still reported by the next call.
  if (pipeline_->writer_abandoned) pipeline_->error = nullptr;
}

void AsyncCheckpointSaver::save(const std::filesystem::path& root, const std::string& name,
                                ShardedStateDict state, const SaveOptions& options) {
  wait();  // at most one in flight; surfaces the previous error
  const std::vector<const ShardedStateDict*> ranks{&state};
  detail::check_savable(ranks);  // includes: unchanged since the dict was built

  // The writer sees only shapes and dtypes (meta tensors): it reads bytes from the staged
  // copies, never from the caller's tensors, and holds none of them alive.
  ShardedStateDict shapes_only;
  shapes_only.common = state.common;
  for (const auto& [key, shard] : state.tensors) {
    ShardedTensor meta = shard;
    meta.local = at::empty(shard.local.sizes(), shard.local.options().device(at::kMeta));
    meta.version = -1;
    shapes_only.tensors.emplace(key, std::move(meta));
  }
  auto pipeline = std::make_shared<Pipeline>();
  pipeline->budget = options_.staging_budget_bytes();
  pipeline->piece_size = options_.piece_bytes();
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
    detail::for_each_piece(
        state, 0,
        [&](const detail::Piece& piece) {
          if (!pipeline->stage(piece)) throw WriterStopped{};
          if (options_.on_piece_staged()) options_.on_piece_staged()(piece.key);
        },
        static_cast<int64_t>(options_.piece_bytes()));
    detail::check_unchanged(ranks, "while it was being staged");
  } catch (const WriterStopped&) {
    // The writer failed on its own; wait() or the next save() reports why, once.
    pipeline->producer_finished(/*ok=*/false);
    return;
  } catch (...) {
    abandon();
    throw;
  }
  pipeline->producer_finished(/*ok=*/true);
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
