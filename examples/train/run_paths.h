// Where a run keeps its files, and which checkpoint a --resume continues from.
//
// A fresh run gets a new directory, runs/<date>-<time>/ (or --out DIR), holding checkpoints/
// and metrics.jsonl; --ckpt-dir and --metrics place those elsewhere. A fresh run never writes
// into a checkpoint root that already holds checkpoints: that is the job of --resume, which
// continues the root's newest complete checkpoint, whatever `latest` says (by default the
// newest run under runs/ that has one).
#pragma once

#include "checkpointing.h"
#include "config.h"
#include "signals.h"

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace train {

struct RunPaths {
  std::filesystem::path ckpt_root;
  std::filesystem::path metrics;
  std::optional<std::filesystem::path> resume_from;  // the checkpoint to load (with --resume)
  std::string resume_note;     // why that is not what `latest` names (a save ended early); or ""
  int64_t resume_step = 0;     // the step resume_from was saved after
  std::string saved_text;      // the fingerprint of its training text (data.h), or "" if older
  nlohmann::json saved_shape;  // its run settings (config.h, run_shape)
  std::vector<ResumeChange> changes;  // settings this run gives anew (config.h)
  // Newer checkpoints than resume_from that do not verify (set_aside_unverified moves them).
  std::vector<std::string> unverified;
  // Flags of a requeued command line (--auto-resume) for steps the run has passed: dropped.
  std::vector<std::string> passed;
  // The run lives in a runs/<date>-<time> it named itself (no --out, --ckpt-dir or --resume):
  // hold_run() claims it, or the next free name.
  bool new_run_dir = false;
};

// runs/<date>-<time> (with a suffix if taken): a fresh run's directory unless --out is given.
std::filesystem::path new_run_dir();

// Decides the paths without writing anything; with --resume, the run to continue (by default
// the newest under runs/). Throws UsageError for --resume without a checkpoint directory.
RunPaths resolve_run_paths(const TrainConfig& config);

// What the checkpoint root holds decides how the run starts; call it holding the run lock
// (hold_run_dir), so that a run that waited for another sees that run's checkpoints.
// With --resume, or --auto-resume and a checkpoint in the root (which then sets
// config.resume): the newest complete checkpoint into `paths.resume_from`, its saved
// configuration into `config` (adopt_run_shape) and its metrics path unless --out, --ckpt-dir
// or --metrics says where this run lives (a copy resumed elsewhere writes its own metrics). Throws
// UsageError: --resume without a checkpoint; a fresh run into a root with checkpoints; a checkpoint
// of another configuration (naming the flag).
void find_resume_point(TrainConfig& config, RunPaths& paths);

// What a run holds from the moment it owns its directories, to its end.
struct HeldRun {
  std::unique_ptr<RunLock> checkpoints;  // the checkpoint root's run lock (rank 0)
  std::unique_ptr<RunLock> metrics;      // the metrics file's (rank 0)
  // SIGTERM and SIGINT ask the loop to stop from the moment the directory is held (signals.h).
  std::unique_ptr<StopRequest> stop;
  std::vector<std::string> set_aside;  // "<name> -> <new name>" (set_aside_unverified)
};

// Takes the run's directories, collectively (`ranks` may be null): a new run directory of its
// own (paths.new_run_dir: created by rank 0 where no other run created it first), the
// checkpoint root's lock,
// waiting up to --wait-for-ckpt-dir, and with several ranks the check that every rank sees the
// root; then the resume point (find_resume_point: what the root holds now), the metrics file's
// lock, and newer checkpoints that would stop the run at their step set aside. Throws
// UsageError on every rank as those do.
HeldRun hold_run(TrainConfig& config, RunPaths& paths, mixprec::distributed::Communicator* ranks);

}  // namespace train
