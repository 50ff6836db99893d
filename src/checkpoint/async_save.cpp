#include "mixprec/checkpoint/async_save.h"

#include "checkpoint/save_pipeline.h"
#include "detail/name_match.h"
#include "mixprec/checkpoint/format/error.h"
#include "mixprec/checkpoint/format/root_layout.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace mixprec::checkpoint {

namespace {

constexpr const char* kWho = "mixprec::checkpoint::AsyncCheckpointSaver";
constexpr std::size_t kAlignment = 64;

std::size_t aligned(std::size_t bytes) {
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

std::size_t shard_bytes(const ShardedTensor& shard) {
  return static_cast<std::size_t>(shard.local.numel()) *
         static_cast<std::size_t>(shard.local.element_size());
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The background thread yields the cores to training (async_save.h): with every core busy,
// a save at training's priority took as much from the step as a synchronous save would have
// (bench_checkpoint: training blocked 90–145% of a sync save behind a two-thread step; 19–27%,
// the staging copy, at the lowest priority). Linux gives each thread its own nice value, inherited
// by threads it starts; failing to lower it (a sandbox) costs speed, not correctness.
void lower_this_threads_priority(int niceness) {
  if (niceness <= 0) return;
  errno = 0;
  const int now = ::getpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()));
  if (errno == 0) ::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), now + niceness);
}

// A contiguous host tensor's bytes, copied in pieces by whichever copying thread takes them.
struct CopyPiece {
  std::byte* dst;
  const std::byte* src;
  std::size_t bytes;
};
constexpr std::size_t kCopyPieceBytes = std::size_t{1} << 20;

// Its slot was laid out when save() looked at it: a tensor resized or recast since (set_data
// moves no version counter) must not be copied past it.
void check_slot(const std::string& key, const at::Tensor& staged, const at::Tensor& live) {
  TORCH_CHECK(live.scalar_type() == staged.scalar_type() && live.sizes() == staged.sizes(),
              "[mixprec::checkpoint::AsyncCheckpointSaver] '", key, "' changed from ",
              staged.scalar_type(), " ", staged.sizes(), " to ", live.scalar_type(), " ",
              live.sizes(), " while it was being staged");
}

// Copies the pieces on up to `threads` threads of its own, started from (and so at the priority
// of) the calling thread, each taking the next 1 MiB piece as it is done. Not an intra-op team:
// its barrier would hold every member while any one of them, at this low priority, waits for a
// core; with pieces taken one by one, a thread that gets no core delays the copy by one piece.
void copy_pieces(const std::vector<CopyPiece>& pieces, unsigned threads) {
  std::atomic<std::size_t> next{0};
  const auto copy = [&] {
    for (std::size_t i = next++; i < pieces.size(); i = next++) {
      std::memcpy(pieces[i].dst, pieces[i].src, pieces[i].bytes);
    }
  };
  std::vector<std::thread> helpers;
  helpers.reserve(threads);
  try {
    for (unsigned t = 1; t < threads && t < pieces.size(); ++t) helpers.emplace_back(copy);
  } catch (...) {
    // No thread to spare (or no memory for one): fewer copy, as fast as they can.
  }
  copy();
  for (std::thread& helper : helpers) helper.join();
}

// The staging copy's threads: memory bandwidth is shared, so a few, at most one per core.
unsigned copy_threads() { return std::clamp(std::thread::hardware_concurrency(), 1u, 4u); }

}  // namespace

std::size_t staging_bytes_for(std::size_t tensor_bytes) { return aligned(tensor_bytes); }

std::size_t staging_bytes_for(const ShardedStateDict& state) {
  std::size_t total = 0;
  for (const auto& [key, shard] : state.tensors) {
    if (shard.replica_id == 0 && shard.local.defined()) total += aligned(shard_bytes(shard));
  }
  return total;
}

AsyncCheckpointSaver::AsyncCheckpointSaver(AsyncSaveOptions options)
    : options_(std::move(options)) {
  TORCH_CHECK(options_.staging_budget_bytes() > 0, "[", kWho, "] the staging budget is 0 bytes");
  TORCH_CHECK(options_.background_niceness() >= 0 && options_.background_niceness() <= 19, "[",
              kWho, "] background_niceness must lie in [0, 19] (a Linux nice increment), got ",
              options_.background_niceness());
}

AsyncCheckpointSaver::~AsyncCheckpointSaver() {
  try {
    // A committed save's warnings nobody collected are printed as its error would be: they are
    // what a user must hear ('latest' not updated, retention that failed).
    if (const std::optional<SaveResult> result = wait()) {
      for (const std::string& warning : result->warnings) {
        std::fprintf(stderr, "[%s] warning nobody collected, saving %s: %s\n", kWho,
                     result->dir.c_str(), warning.c_str());
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[%s] a background checkpoint save failed and nobody asked: %s\n", kWho,
                 e.what());
  } catch (...) {
    std::fprintf(stderr, "[%s] a background checkpoint save failed and nobody asked\n", kWho);
  }
}

void AsyncCheckpointSaver::reserve(std::size_t bytes) {
  finish_in_flight();
  TORCH_CHECK(bytes <= options_.staging_budget_bytes(), "[", kWho, "] the checkpoint needs ", bytes,
              " bytes of host staging memory, the budget is ", options_.staging_budget_bytes(),
              " bytes (AsyncSaveOptions::staging_budget_bytes); raise it or save synchronously");
  if (bytes <= arena_bytes_) return;
  // Zero-filled: every page is touched here, once, not inside a save's blocked window.
  arena_ = at::zeros({static_cast<int64_t>(bytes)}, at::kByte);
  arena_bytes_ = bytes;
}

void AsyncCheckpointSaver::wait_until_staged() {
  const auto start = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(mutex_);
  staged_signal_.wait(lock, [this] { return !staging_; });
  last_blocked_seconds_ += seconds_since(start);
  if (staging_error_) {
    // Thrown now, without waiting for the writer: a collective one is still telling the other
    // ranks, and its agreed error (naming this rank) is what wait() and the next save() throw,
    // here as on every rank, so that all ranks' next saves start together. A writer that only
    // rethrows this error is not reported twice.
    std::exception_ptr error = staging_error_;
    staging_error_ = nullptr;
    reported_ = error;
    lock.unlock();
    // This process's own writer only rethrows it: the save is over.
    if (!writer_reports_ && worker_.joinable()) worker_.join();
    std::rethrow_exception(error);
  }
}

void AsyncCheckpointSaver::finish_in_flight() {
  if (worker_.joinable()) worker_.join();
  state_ = ShardedStateDict();   // no more handles to live tensors
  staged_ = ShardedStateDict();  // the copy's views only; the arena stays
  staging_error_ = nullptr;      // the same error as error_, reported here or already
  const std::exception_ptr reported = std::exchange(reported_, nullptr);
  if (error_) {
    std::exception_ptr error = std::exchange(error_, nullptr);
    result_.reset();
    if (error != reported) std::rethrow_exception(error);
  }
  // Kept, not dropped, until a save() or wait() returns it: its warnings are the caller's.
  // One save at a time: a result not returned yet means none was in flight.
  if (result_) {
    TORCH_INTERNAL_ASSERT(!unreturned_, "[", kWho, "] two results to return");
    unreturned_ = std::exchange(result_, std::nullopt);
  }
}

std::optional<SaveResult> AsyncCheckpointSaver::wait() {
  finish_in_flight();
  return std::exchange(unreturned_, std::nullopt);
}

std::optional<SaveResult> AsyncCheckpointSaver::save(const std::filesystem::path& root,
                                                     const std::string& name,
                                                     ShardedStateDict state,
                                                     const SaveOptions& options) {
  // One process writes the whole checkpoint: its shards must cover every tensor.
  detail::check_savable({&state});
  // Cheap to see now; found by the writer, it would surface only at the next save() (whose
  // own state that error then costs). The name first, as save_checkpoint checks it: `lock` or
  // `latest` exist in a used root, and "already exists" would blame the wrong thing.
  check_checkpoint_name(root, name);
  std::error_code ec;
  if (std::filesystem::exists(std::filesystem::symlink_status(root / name, ec))) {
    throw FormatError("[mixprec::checkpoint] " + (root / name).string() +
                      ": already exists; refusing to overwrite it: save under another name");
  }
  return start(
      std::move(state),
      [root, name, options](const ShardedStateDict& staged, const std::exception_ptr& failed) {
        if (failed) std::rethrow_exception(failed);
        return save_checkpoint(root, name, staged, options);
      },
      /*defer_errors=*/false);
}

std::optional<SaveResult> AsyncCheckpointSaver::save(ShardedStateDict state, Writer write) {
  return start(std::move(state), std::move(write), /*defer_errors=*/true);
}

std::optional<SaveResult> AsyncCheckpointSaver::start(ShardedStateDict state, Writer write,
                                                      bool defer_errors) {
  const auto start = std::chrono::steady_clock::now();
  // One save in flight; rethrows its error. Its result stays in unreturned_ until this save has
  // started: a save() that throws returns nothing, and the next save() or wait() returns it.
  finish_in_flight();
  writer_reports_ = defer_errors;
  // This process's part only: on N ranks the writer's collective checks what they cover
  // together (collective_checkpoint.h).
  std::exception_ptr failed;
  staged_ = ShardedStateDict();
  try {
    std::vector<std::string> problems;
    // No rank in the messages: this process's may not be 0 (a collective writer names it).
    detail::plan_rank(state, 0, problems, /*name_rank=*/false);
    mixprec::detail::check_no_problems(problems, "[mixprec::checkpoint::save] cannot save");
    detail::check_unchanged({&state}, "since the state dict was built");
    reserve(staging_bytes_for(state));
    // The copy's layout in the arena; the bytes follow on the background thread. Inside this
    // try: an error here is this process's part failing too, which a collective writer must
    // hear, or the other ranks would wait in the save's first agreement.
    staged_.common = state.common;
    std::size_t offset = 0;
    for (const auto& [key, shard] : state.tensors) {
      ShardedTensor copy = shard;
      // Unchecked: only the writer reads the arena until the next save, which waits for it.
      // (Its views share one version counter, which every copy moves.)
      copy.version = -1;
      if (shard.replica_id == 0 && shard.local.defined()) {
        const std::size_t bytes = shard_bytes(shard);
        // No elements, no slot: a state of only such tensors (a rank's empty slices) needs
        // 0 bytes, and so has no arena to lay them in.
        copy.local =
            bytes == 0 ? at::empty(shard.local.sizes(), at::dtype(shard.local.scalar_type()))
                       : arena_.narrow(0, static_cast<int64_t>(offset), static_cast<int64_t>(bytes))
                             .view(shard.local.scalar_type())
                             .view(shard.local.sizes());
        offset += aligned(bytes);
      }
      staged_.tensors.emplace(key, std::move(copy));
    }
  } catch (...) {
    staged_ = ShardedStateDict();
    // A writer that takes part in a collective must still take part, with this error, or the
    // other ranks' saves would wait for this one and pair with its next (async_save.h).
    if (!defer_errors) throw;
    failed = std::current_exception();
  }
  if (!failed) state_ = std::move(state);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    staging_ = true;
    staging_error_ = nullptr;
  }
  last_blocked_seconds_ = seconds_since(start);
  // If the thread cannot start, nothing is in flight: undone before the error leaves save().
  struct Unstarted {
    AsyncCheckpointSaver& saver;
    bool armed = true;
    ~Unstarted() {
      if (!armed) return;
      {
        std::lock_guard<std::mutex> lock(saver.mutex_);
        saver.staging_ = false;
        saver.staging_error_ = nullptr;
      }
      saver.state_ = ShardedStateDict();
      saver.staged_ = ShardedStateDict();
    }
  } unstarted{*this};
  worker_ = std::thread([this, write = std::move(write), failed] {
    lower_this_threads_priority(options_.background_niceness());
    const auto staging_start = std::chrono::steady_clock::now();
    std::exception_ptr error = failed;
    if (!error) {
      try {
        // Contiguous host tensors (every state's) go in pieces over the copying threads; any
        // other layout or device through copy_. With on_tensor_staged, one tensor after another
        // on this thread, in key order, as that callback promises.
        const bool in_order = static_cast<bool>(options_.on_tensor_staged());
        std::vector<CopyPiece> pieces;
        // The tensors whose pieces are pending, with their memory held: a tensor given new
        // storage meanwhile (set_data) must not free what a piece reads, and is refused after.
        struct Source {
          const std::string* key;
          const at::Tensor* staged;
          const at::Tensor* live;
          const void* data;
          c10::Storage storage;
        };
        std::vector<Source> sources;
        const auto copy_pending = [&](unsigned threads) {
          copy_pieces(pieces, threads);
          for (const Source& s : sources) {
            check_slot(*s.key, *s.staged, *s.live);
            TORCH_CHECK(s.live->const_data_ptr() == s.data, "[", kWho, "] '", *s.key,
                        "' was given other memory while it was being staged");
          }
          pieces.clear();
          sources.clear();
        };
        for (auto& [key, copy] : staged_.tensors) {
          const ShardedTensor& shard = state_.tensors.at(key);
          if (shard.replica_id == 0 && shard.local.defined()) {
            const at::Tensor& live = shard.local;
            check_slot(key, copy.local, live);
            if (live.is_cpu() && live.is_contiguous()) {
              auto* dst = static_cast<std::byte*>(copy.local.data_ptr());
              const auto* src = static_cast<const std::byte*>(live.const_data_ptr());
              sources.push_back({&key, &copy.local, &live, src, live.storage()});
              for (std::size_t at = 0; at < copy.local.nbytes(); at += kCopyPieceBytes) {
                pieces.push_back(
                    {dst + at, src + at, std::min(kCopyPieceBytes, copy.local.nbytes() - at)});
              }
            } else {
              at::NoGradGuard no_grad;
              copy.local.copy_(live);  // any layout, any device
            }
          }
          if (in_order) {
            copy_pending(1);
            options_.on_tensor_staged()(key);
          }
        }
        copy_pending(copy_threads());
        detail::check_unchanged({&state_}, "while it was being staged");
      } catch (...) {
        error = std::current_exception();
      }
    }
    state_ = ShardedStateDict();
    last_staging_seconds_ = seconds_since(staging_start);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      staging_ = false;
      staging_error_ = error;
    }
    staged_signal_.notify_all();
    const auto background_start = std::chrono::steady_clock::now();
    try {
      // After a failure the writer only reports it (a collective one to every rank); nothing
      // is written.
      result_ = write(staged_, error);
      TORCH_INTERNAL_ASSERT(!error, "[", kWho, "] the writer succeeded after a failed staging");
    } catch (...) {
      error_ = std::current_exception();
    }
    last_background_seconds_ = seconds_since(background_start);
  });
  unstarted.armed = false;
  return std::exchange(unreturned_, std::nullopt);
}

}  // namespace mixprec::checkpoint
