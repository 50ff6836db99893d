// Asynchronous checkpoint saves: stage to host memory within a budget, write in the background.
//
// save() validates the state (exactly as save_checkpoint does, errors thrown right there),
// then copies its tensors piece by piece (≤ 64 MiB each) into host memory while a background
// thread writes the pieces already staged. Staged-but-unwritten bytes never exceed the budget
// (a piece waits for the writer to free room), so a large state costs at most `budget` extra
// memory; the staging buffers are kept and reused by later saves. save() returns once every
// piece is staged: from then on training may change the tensors. The background thread
// commits the checkpoint when the last byte is written.
//
// At most one save is in flight: a new save() first waits for the previous one. An error of
// the background save is rethrown by the next wait() or save(); the destructor waits too and
// reports (never throws) an error nobody collected.
#pragma once

#include "mixprec/checkpoint/save.h"

#include <exception>
#include <memory>
#include <optional>
#include <thread>

namespace mixprec::checkpoint {

struct AsyncSaveOptions {
  std::size_t staging_budget_bytes = std::size_t{1} << 30;  // ≥ 64 MiB
};

class AsyncCheckpointSaver {
 public:
  // Throws c10::Error if the budget is smaller than one piece (64 MiB).
  explicit AsyncCheckpointSaver(AsyncSaveOptions options = {});
  ~AsyncCheckpointSaver();
  AsyncCheckpointSaver(const AsyncCheckpointSaver&) = delete;
  AsyncCheckpointSaver& operator=(const AsyncCheckpointSaver&) = delete;

  // Starts saving `state` as <root>/<name>; returns when it is staged (see above).
  // Rethrows the previous save's error, if any, before starting.
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
  AsyncSaveOptions options_;
  std::shared_ptr<BufferPool> pool_;  // staging buffers, reused across saves
  std::shared_ptr<Pipeline> pipeline_;
  std::thread worker_;
};

}  // namespace mixprec::checkpoint
