// The run's configuration: every command-line flag of mixprec-train, its default and its help.
//
// One table (config.cpp) drives parsing, --help, validation messages and the copy of the
// configuration a checkpoint carries. Flags marked "fixed on resume" shape the run (model size,
// precision, data, batch): on --resume they are read back from the checkpoint, and giving one
// with another value is an error naming the flag.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace train {

// A mistake on the command line or in the files it names. main() prints the message as one
// line, "mixprec-train: <message>", and exits with status 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct TrainConfig {
  // Model (a GPT with MoE blocks; vocabulary: the 256 byte values).
  int64_t vocab = 256;
  int64_t layers = 2;
  int64_t d_model = 128;
  int64_t heads = 4;
  int64_t experts = 4;
  int64_t top_k = 2;
  int64_t seq_len = 128;

  // Precision: "bf16" or "fp16" (dynamic loss scaling); FP8 on the expert GEMMs: "off",
  // "e4m3" or "hybrid" (E4M3 forward, E5M2 gradients).
  std::string precision = "bf16";
  std::string fp8 = "hybrid";
  double loss_scale = 65536;  // FP16: the dynamic loss scale to start from
  // Activation recomputation: keep each block's input only and run the block again in backward
  // (recompute.h). Changes memory and time, not one bit of the results.
  bool recompute = false;

  // Data: a text file, or "" for the built-in corpus (Python's pydoc topics).
  std::string data;
  double val_fraction = 0.1;

  // Optimization.
  int64_t steps = 600;
  int64_t batch = 16;      // sequences per optimizer step (over all ranks and micro-batches)
  int64_t grad_accum = 1;  // micro-batches per optimizer step
  double lr = 6e-3;
  int64_t warmup = 30;
  double min_lr_ratio = 0.1;  // the cosine schedule ends at lr * min_lr_ratio
  double weight_decay = 0.1;
  double clip_grad = 1.0;
  double aux_loss_coef = 0.01;      // weight of the MoE load-balancing loss
  double bias_update_rate = 0.001;  // aux-loss-free balancing: expert-bias step per update
  int64_t seed = 1337;

  // Evaluation and logging.
  int64_t eval_every = 50;
  int64_t eval_batches = 8;
  int64_t log_every = 10;         // plain-line progress: one line every N steps
  std::string progress = "auto";  // "auto" (bar on a terminal), "bar", "lines", "none"

  // Outputs: a run directory holding checkpoints/ and metrics.jsonl, unless set separately.
  std::string out;       // default: runs/<date>-<time> (a new directory per fresh run)
  std::string ckpt_dir;  // default: <out>/checkpoints
  std::string metrics;   // default: <out>/metrics.jsonl
  int64_t ckpt_every = 200;
  int64_t keep_last = 3;
  bool async_save = false;
  int64_t staging_budget_mb = 4096;  // --async-save: host memory for staging, checked at start
  int64_t ckpt_timeout = 1800;       // seconds a collective checkpoint save may take
  int64_t wait_for_ckpt_dir = 0;     // seconds to wait for another run to free --ckpt-dir
  bool resume = false;
  bool auto_resume = false;  // resume if the checkpoint root holds a checkpoint, else start
  int64_t stop_at = 0;       // stop after this step as if interrupted (0: run to --steps)
  std::string init_from;  // a fresh run's weights: a mixprec-ckpt export (init_from.h); "": random

  // The sample printed at the end.
  std::string prompt = "The ";
  int64_t sample_tokens = 200;
  double temperature = 0.8;  // 0: greedy

  int64_t threads = 0;            // intra-op threads; 0: LibTorch's default
  std::string omp_wait = "auto";  // OMP_WAIT_POLICY, set before OpenMP starts (main.cpp)
  std::string profile_steps;      // "A:B": trace steps A..B (profile.h); "": no trace
  // --malloc: what glibc does with freed memory, set first thing in main (host_memory.h).
  std::string malloc_policy = "keep";

  // Data parallelism: this process's rank and the number of ranks (1 without a launcher).
  int64_t rank = 0;
  int64_t world_size = 1;

  std::set<std::string> given;  // flags set on the command line ("layers", "d_model", …)

  bool is_given(const std::string& key) const { return given.count(key) != 0; }
  int64_t tokens_per_step() const { return batch * seq_len; }
};

// Parses argv (argv[0] is skipped). Throws UsageError naming an unknown flag (with the closest
// known one), a missing or malformed value, or a value out of range (see validate()).
// Returns nullopt-like `help = true` when --help was given.
struct ParsedArgs {
  TrainConfig config;
  bool help = false;
};
ParsedArgs parse_args(int argc, const char* const* argv);

// Checks ranges and combinations; throws UsageError naming the flag. With --resume, ranges
// only: the combinations involve the run's own settings, which adopt_run_shape() checks once
// it has read them from the checkpoint.
void validate(const TrainConfig& config);
// Each value alone (ranges, choices), and the values together (--heads divides --d-model, the
// batch splits over ranks and micro-batches, the traced steps lie within --steps).
void validate_values(const TrainConfig& config);
void validate_combinations(const TrainConfig& config);

// The --help text.
std::string usage();

// --profile-steps "A:B" (1 ≤ A ≤ B): the steps a trace covers. Throws UsageError otherwise.
struct ProfileSteps {
  int64_t first = 0;
  int64_t last = 0;
};
ProfileSteps parse_profile_steps(const std::string& text);

// The run's settings, as JSON {"layers": 2, "steps": 600, …}: stored in every checkpoint. Every
// flag but those of this process alone (threads, paths, progress, switches, --stop-at).
nlohmann::json run_shape(const TrainConfig& config);

// A setting a resumed run changes: "--steps", "--steps 600", "--steps 1200".
struct ResumeChange {
  std::string flag;
  std::string saved;
  std::string now;
};

// Takes the run's settings from a checkpoint's saved `shape`: flags not given on the command
// line are set from it. A flag fixed on resume given with another value is a UsageError naming
// it and both values (`source` names the checkpoint); any other flag given with another value
// wins, and is returned, so that the run can say what it changed.
std::vector<ResumeChange> adopt_run_shape(TrainConfig& config, const nlohmann::json& shape,
                                          const std::string& source);

// One line describing the model and precision, e.g.
// "2 layers, d_model 128, 4 heads, 4 experts (top-2), seq 128 | bf16, fp8 hybrid".
std::string describe(const TrainConfig& config);

}  // namespace train
