#include "checkpointing.h"

#include "config.h"

#include "mixprec/checkpoint/format/error.h"
#include "mixprec/checkpoint/format/latest.h"
#include "mixprec/checkpoint/format/state_keys.h"
#include "mixprec/checkpoint/load.h"
#include "mixprec/checkpoint/save.h"
#include "mixprec/distributed/collective_checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <c10/util/Exception.h>

#include <chrono>
#include <cstring>

namespace train {
namespace fs = std::filesystem;
namespace keys = mixprec::checkpoint::keys;

std::string checkpoint_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%06lld", static_cast<long long>(step));
  return buf;
}

std::optional<fs::path> latest_checkpoint(const fs::path& root) {
  std::optional<std::string> name;
  try {
    name = mixprec::checkpoint::read_latest(root);
  } catch (const mixprec::checkpoint::FormatError& e) {
    throw UsageError(std::string("checkpoint root ") + root.string() + " is damaged: " + e.what());
  }
  if (!name) return std::nullopt;
  return root / *name;
}

nlohmann::json read_user_metadata(const fs::path& checkpoint) {
  try {
    // Asking for one small tensor reads the manifest and common state and nothing else big.
    mixprec::checkpoint::ReadOptions only_rng;
    only_rng.keys = {std::string(keys::kRngCpu)};
    const mixprec::ShardedStateDict state =
        mixprec::checkpoint::read_checkpoint(checkpoint, only_rng);
    const auto& common = state.common;
    const std::string user_key(keys::kCommonUser);
    if (!common.contains(user_key) || !common.at(user_key).is_object()) {
      throw UsageError("checkpoint " + checkpoint.string() +
                       " was not written by mixprec-train (no user metadata)");
    }
    return common.at(user_key);
  } catch (const mixprec::checkpoint::FormatError& e) {
    throw UsageError("cannot read checkpoint " + checkpoint.string() + ": " + e.what());
  } catch (const c10::Error& e) {
    throw UsageError("cannot read checkpoint " + checkpoint.string() + ": " +
                     e.what_without_backtrace());
  }
}

void ensure_writable_dir(const fs::path& dir, const std::string& what) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw UsageError("cannot create " + what + " " + dir.string() + ": " + ec.message());
  if (!fs::is_directory(dir, ec))
    throw UsageError(what + " " + dir.string() + " is not a directory");
  // access(2) answers "yes" to root on read-only directories and says nothing about read-only
  // mounts; creating a file is the only honest test.
  const fs::path probe = dir / (".mixprec-train-probe-" + std::to_string(::getpid()));
  const int fd = ::open(probe.c_str(), O_CREAT | O_EXCL | O_WRONLY, 0600);
  if (fd < 0) {
    throw UsageError(what + " " + dir.string() + " is not writable: " + std::strerror(errno));
  }
  ::close(fd);
  ::unlink(probe.c_str());
}

Checkpointer::Checkpointer(fs::path root, bool async, int64_t keep_last,
                           std::shared_ptr<mixprec::distributed::Communicator> ranks)
    : root_(std::move(root)), keep_last_(keep_last), ranks_(std::move(ranks)) {
  if (async && ranks_) {
    throw UsageError(
        "--async-save writes from one process; with several ranks every save is a blocking "
        "collective (drop --async-save)");
  }
  if (async) {
    // The budget bounds staged-but-unwritten bytes; the smallest allowed is plenty for the
    // models this program trains.
    mixprec::checkpoint::AsyncSaveOptions options;
    options.staging_budget_bytes(std::size_t{64} << 20);
    async_ = std::make_unique<mixprec::checkpoint::AsyncCheckpointSaver>(options);
  }
}

void Checkpointer::save(int64_t step, mixprec::ShardedStateDict state) {
  mixprec::checkpoint::SaveOptions options;
  options.keep_last(static_cast<std::size_t>(keep_last_));
  const std::string name = checkpoint_name(step);
  const auto start = std::chrono::steady_clock::now();
  if (async_) {
    async_->save(root_, name, std::move(state), options);
  } else if (ranks_) {
    mixprec::distributed::save_checkpoint(*ranks_, root_, name, state, options);
  } else {
    mixprec::checkpoint::save_checkpoint(root_, name, state, options);
  }
  stats_.last_blocked_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  stats_.blocked_s += stats_.last_blocked_s;
  stats_.saves += 1;
  stats_.last_dir = root_ / name;
}

void Checkpointer::finish() {
  if (!async_) return;
  const auto start = std::chrono::steady_clock::now();
  async_->wait();
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  stats_.blocked_s += waited;
}

uint64_t directory_bytes(const fs::path& dir) {
  uint64_t total = 0;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (entry.is_regular_file(ec)) total += entry.file_size(ec);
  }
  return total;
}

}  // namespace train
