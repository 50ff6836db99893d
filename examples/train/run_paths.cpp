#include "run_paths.h"

#include "checkpointing.h"
#include "loop.h"

#include "mixprec/checkpoint/format/root_layout.h"
#include "mixprec/distributed/communicator.h"

#include <algorithm>
#include <chrono>
#include <ctime>
#include <vector>

namespace train {
namespace fs = std::filesystem;

namespace {

const fs::path kRunsDir = "runs";

// The newest run directory under runs/ whose checkpoints/ holds a checkpoint.
std::optional<fs::path> newest_resumable_run() {
  std::vector<fs::path> runs;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(kRunsDir, ec)) {
    if (entry.is_directory(ec)) runs.push_back(entry.path());
  }
  std::sort(runs.rbegin(), runs.rend());  // names are timestamps: newest first
  for (const fs::path& run : runs) {
    if (newest_checkpoint(run / "checkpoints")) return run;
  }
  return std::nullopt;
}

// Makes the run's directory with mkdir, which only one process succeeds at: two runs started
// in the same second from one directory (an array job, a sweep) get a directory each, where
// both would otherwise share one and the second fail on its lock. Rank 0 makes it; every rank
// adopts the name.
void claim_new_run_dir(const TrainConfig& config, RunPaths& paths,
                       mixprec::distributed::Communicator* ranks) {
  std::string claimed;
  on_every_rank_or_none(ranks, [&] {
    if (ranks != nullptr && ranks->rank() != 0) return;
    fs::path dir = paths.ckpt_root.parent_path();
    std::error_code ec;
    fs::create_directories(dir.parent_path(), ec);
    // create_directory() is false, without an error, when the directory existed already.
    while (!fs::create_directory(dir, ec) && !ec) dir = new_run_dir();
    if (ec) throw UsageError("cannot create run directory " + dir.string() + ": " + ec.message());
    claimed = dir.string();
  });
  if (ranks != nullptr && ranks->size() > 1) claimed = ranks->all_gather_strings(claimed).front();
  paths.ckpt_root = fs::path(claimed) / "checkpoints";
  if (config.metrics.empty()) paths.metrics = fs::path(claimed) / "metrics.jsonl";
}

}  // namespace

fs::path new_run_dir() {
  char stamp[32];
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", &local);
  fs::path dir = kRunsDir / stamp;
  std::error_code ec;
  for (int i = 2; fs::exists(dir, ec); ++i)
    dir = kRunsDir / (std::string(stamp) + "-" + std::to_string(i));
  return dir;
}

RunPaths resolve_run_paths(const TrainConfig& config) {
  fs::path out = config.out;
  if (config.resume && out.empty() && config.ckpt_dir.empty()) {
    const auto newest = newest_resumable_run();
    if (!newest) {
      throw UsageError("--resume: no checkpoint found under " + kRunsDir.string() +
                       "/ (pass --out DIR or --ckpt-dir DIR of the run to continue)");
    }
    out = *newest;
  }
  // "dir/ckpt/" names dir/ckpt too: its parent (where the metrics go) is dir, not dir/ckpt.
  fs::path ckpt_dir = fs::path(config.ckpt_dir).lexically_normal();
  if (!ckpt_dir.empty() && ckpt_dir.filename().empty()) ckpt_dir = ckpt_dir.parent_path();
  if (out.empty()) out = ckpt_dir.empty() ? new_run_dir() : ckpt_dir.parent_path();

  RunPaths paths;
  paths.ckpt_root = ckpt_dir.empty() ? out / "checkpoints" : ckpt_dir;
  paths.metrics = config.metrics.empty() ? out / "metrics.jsonl" : fs::path(config.metrics);
  std::error_code ec;
  if (config.resume && !fs::is_directory(paths.ckpt_root, ec)) {
    throw UsageError("--resume: no checkpoint in " + paths.ckpt_root.string() +
                     " (no such directory)");
  }
  return paths;
}

void find_resume_point(TrainConfig& config, RunPaths& paths) {
  // The newest complete checkpoint, whatever `latest` says: a save that died after its commit
  // is resumed from, not replayed into an "already committed" error.
  std::string note;
  const std::optional<fs::path> latest =
      newest_checkpoint(paths.ckpt_root, &note, &paths.unverified);
  if (config.auto_resume && latest && !config.resume) {
    // A requeued job: it continues what its last launch saved, from that checkpoint's weights
    // (--init-from only chooses a new run's).
    config.resume = true;
    config.init_from.clear();
  }
  if (!config.resume) {
    if (latest) {
      throw UsageError("checkpoint directory " + paths.ckpt_root.string() +
                       " already holds a run (newest checkpoint: " + latest->filename().string() +
                       "); --resume continues it, or choose another --out or --ckpt-dir");
    }
    return;
  }
  if (!latest) {
    throw UsageError("--resume: no checkpoint in " + paths.ckpt_root.string());
  }
  paths.resume_note = note;
  // A step directory after the resume point that is not a committed checkpoint (a damaged
  // manifest: no lookup lists it) would stop the run at that step's save just the same.
  for (const std::string& name : uncommitted_steps_after(paths.ckpt_root, latest->filename())) {
    paths.unverified.push_back(name);
  }
  nlohmann::json user;
  try {
    user = read_user_metadata(*latest);
  } catch (const UsageError& e) {
    const std::string message = e.what();
    throw UsageError(message.substr(0, message.find('\n')) + advice_if_damaged(*latest));
  }
  const std::string source = "checkpoint " + latest->string();
  if (!user.contains("config")) throw UsageError(source + " was not written by mixprec-train");
  paths.changes = adopt_run_shape(config, user.at("config"), source);
  paths.saved_shape = user.at("config");
  const RunState saved = RunState::from_json(user, source);
  paths.resume_step = saved.step;
  paths.saved_text = saved.text;
  if (config.steps < paths.resume_step) {
    throw UsageError("--steps " + std::to_string(config.steps) + ": " + source +
                     " is already at step " + std::to_string(paths.resume_step) +
                     "; give a larger --steps to train on from it");
  }
  // Steps the run will not take again: a stop or a trace there would never happen. Refused
  // when the user asked for this resume; a requeue of the job's own command line
  // (--auto-resume) passed them on an earlier launch: dropped, and said so.
  const bool requeued = config.auto_resume && !config.is_given("resume");
  const bool stop_passed = config.stop_at > 0 && config.stop_at <= paths.resume_step;
  const bool trace_passed = !config.profile_steps.empty() &&
                            parse_profile_steps(config.profile_steps).first <= paths.resume_step;
  const std::string at = source + " is already at step " + std::to_string(paths.resume_step);
  if (stop_passed) {
    if (!requeued)
      throw UsageError("--stop-at " + std::to_string(config.stop_at) + ": " + at +
                       "; give a later step to stop at");
    paths.passed.push_back("--stop-at " + std::to_string(config.stop_at));
    config.stop_at = 0;
  }
  if (trace_passed) {
    if (!requeued)
      throw UsageError("--profile-steps " + config.profile_steps + ": " + at +
                       "; trace steps after it");
    paths.passed.push_back("--profile-steps " + config.profile_steps);
    config.profile_steps.clear();
  }
  // The metrics file the saved run wrote, unless this run is told where it lives (--out,
  // --ckpt-dir, --metrics): a copy of a run resumed in another directory must not append to,
  // and cut back, the original's file. One inside the run's directory is found from the
  // checkpoint root, wherever the run now lies; one the run placed elsewhere (--metrics)
  // stays where it was.
  if (config.metrics.empty() && config.out.empty() && config.ckpt_dir.empty()) {
    const auto saved = [&](const char* key) {
      return user.contains(key) && user.at(key).is_string() ? user.at(key).get<std::string>()
                                                            : std::string();
    };
    if (const std::string from_root = saved("metrics_from_root"); !from_root.empty()) {
      paths.metrics = (paths.ckpt_root / from_root).lexically_normal();
    } else if (const std::string file = saved("metrics"); !file.empty()) {
      paths.metrics = file;
    }
  }
  paths.resume_from = latest;
}

HeldRun hold_run(TrainConfig& config, RunPaths& paths, mixprec::distributed::Communicator* ranks) {
  HeldRun held;
  const std::chrono::seconds wait(config.wait_for_ckpt_dir);
  if (paths.new_run_dir) claim_new_run_dir(config, paths, ranks);
  ensure_writable_dir(paths.ckpt_root, "checkpoint directory");
  held.checkpoints =
      hold_run_dir(paths.ckpt_root, std::string(mixprec::checkpoint::kRunLockFileName),
                   "checkpoint directory", wait, ranks);
  if (ranks != nullptr && ranks->size() > 1) check_shared_root(paths.ckpt_root, *ranks);
  // Before, while it waits for the directory, the default action ends the run with nothing to
  // save; from here a scheduler's SIGTERM is a request to stop.
  held.stop = std::make_unique<StopRequest>();
  on_every_rank_or_none(ranks, [&] { find_resume_point(config, paths); });
  // Every rank reads the root itself: a filesystem that shows ranks different checkpoints (or
  // one a checkpoint and another none, under --auto-resume) would start them from different
  // states.
  if (ranks != nullptr && ranks->size() > 1) {
    const auto name = [](const std::string& s) { return s.empty() ? std::string("none") : s; };
    const std::vector<std::string> points = ranks->all_gather_strings(
        paths.resume_from ? paths.resume_from->filename().string() : std::string());
    for (size_t r = 1; r < points.size(); ++r) {
      if (points[r] == points[0]) continue;
      throw UsageError("rank " + std::to_string(r) + " would resume from " + name(points[r]) +
                       " in " + paths.ckpt_root.string() + ", rank 0 from " + name(points[0]) +
                       ": the ranks see different checkpoints there");
    }
  }
  // A second run with its own --ckpt-dir would truncate the metrics file.
  const fs::path metrics_file = fs::absolute(paths.metrics);
  held.metrics =
      hold_run_dir(metrics_file.parent_path(), "." + metrics_file.filename().string() + ".run-lock",
                   "metrics file " + paths.metrics.string(), wait, ranks);
  set_aside_unverified(paths.ckpt_root, paths.unverified, ranks, &held.set_aside);
  return held;
}

}  // namespace train
