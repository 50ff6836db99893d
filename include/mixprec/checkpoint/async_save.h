// Asynchronous checkpoint saves: stage to host memory within a budget, write in the background.
//
// save() validates the state (exactly as save_checkpoint does, errors thrown right there),
// then copies its tensors piece by piece (≤ piece_bytes each, 64 MiB by default) into host
// memory while a background thread writes the pieces already staged. Staged-but-unwritten
// bytes never exceed the budget (a piece waits for the writer to free room), so a large state
// costs at most `budget` extra memory; the staging buffers are kept and reused by later
// saves. Any layout is staged piece by piece in time linear in its size: a non-contiguous
// tensor is never copied whole. save() returns once every piece is staged: from then on
// training may change the tensors. The background thread commits the checkpoint when the
// last byte is written — and only if staging completed.
//
// Consistency: a state dict aliases the live model and optimizer tensors, while its common
// state (the step count) is a snapshot taken when it was built. The saved state is a
// consistent snapshot because every tensor is staged before save() returns, and save()
// refuses (c10::Error naming the keys, nothing written) a state whose tensors changed
// after the dict was built — their version counters (ShardedTensor::version), which every
// in-place write and optimizer step bumps, are checked when save() starts and again after
// the last piece is staged. So "build the dict, step, save" and a step on another thread
// during staging are errors, not a checkpoint of step N+1 moments under step N. Build the
// dict right before save() and do not step until save() returns.
//
// Errors are reported once. One raised while staging (including the consistency check) is
// thrown by that save() itself, which abandons the save (nothing is committed; the
// background writer is stopped and joined; the next save() starts cleanly). An error of the
// background writer is rethrown by the next wait() or save(); the destructor waits too and
// reports (never throws) an error nobody collected. At most one save is in flight: a new
// save() first waits for the previous one.
#pragma once

#include "mixprec/checkpoint/save.h"

#include <torch/arg.h>

#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <thread>

namespace mixprec::checkpoint {

struct AsyncSaveOptions {
  // Most bytes staged but not yet written at once; ≥ piece_bytes.
  TORCH_ARG(std::size_t, staging_budget_bytes) = std::size_t{1} << 30;
  // Size of one staging buffer (the unit of staging and writing). The default, 64 MiB, keeps
  // write(2) at full speed; smaller pieces let tests put a small budget under pressure.
  TORCH_ARG(std::size_t, piece_bytes) = std::size_t{64} << 20;  // ≥ 4 KiB
  // Called on the thread that calls save() after each piece is staged, with the piece's key
  // (progress reporting; tests use it to step the optimizer in the middle of staging).
  TORCH_ARG(std::function<void(const std::string& key)>, on_piece_staged);
};

class AsyncCheckpointSaver {
 public:
  // Throws c10::Error if piece_bytes < 4 KiB or the budget is smaller than one piece.
  explicit AsyncCheckpointSaver(AsyncSaveOptions options = {});
  ~AsyncCheckpointSaver();
  AsyncCheckpointSaver(const AsyncCheckpointSaver&) = delete;
  AsyncCheckpointSaver& operator=(const AsyncCheckpointSaver&) = delete;

  // Starts saving `state` as <root>/<name>; returns when it is staged (see above).
  // Rethrows the previous save's background error, if any, before starting; throws
  // c10::Error if `state` cannot be saved or changed since it was built (see above).
  void save(const std::filesystem::path& root, const std::string& name, ShardedStateDict state,
            const SaveOptions& options = {});

  // Waits for the save in flight; returns its result (nullopt if none was in flight), or
  // rethrows its error.
  std::optional<SaveResult> wait();

  bool in_flight() const { return worker_.joinable(); }
  // Most bytes staged at once during the last save (≤ the budget).
  std::size_t peak_staged_bytes() const;

 private:
  struct Pipeline;
  struct BufferPool;
  void abandon();  // stops and joins the writer of a save whose staging failed
  AsyncSaveOptions options_;
  std::shared_ptr<BufferPool> pool_;  // staging buffers, reused across saves
  std::shared_ptr<Pipeline> pipeline_;
  std::thread worker_;
};

}  // namespace mixprec::checkpoint
