// Flag parsing is table-driven so that --help, parsing, checkpoint metadata and resume checks
// can never disagree about a flag's name, type or meaning.
#include "config.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <sstream>
#include <string_view>
#include <variant>

namespace train {
namespace {

using Field = std::variant<int64_t TrainConfig::*, double TrainConfig::*,
                           std::string TrainConfig::*, bool TrainConfig::*>;

// What --resume does with a flag. The run's settings are saved in every checkpoint, so that
// `--resume` alone continues the run as it was started (as a resumed nanoGPT or torchtitan
// job takes its config from the checkpoint, not from today's defaults).
enum class OnResume {
  kThisRun,  // where and how this process runs (threads, paths, progress): never saved
  kCarried,  // the run's course (steps, schedule, cadence): saved; a flag given again changes it
  kFixed,    // what the checkpoint's tensors and data order depend on: saved; must not change
};

struct Flag {
  std::string_view section;  // printed once above the first flag of a section in --help
  std::string_view name;     // "d-model": the flag is --d-model, its JSON key d_model
  Field field;
  std::string_view metavar;  // "" for switches
  std::string_view help;
  OnResume on_resume = OnResume::kThisRun;
  // False for a fixed flag that older checkpoints did not save: resuming one of those keeps
  // this run's value rather than refusing the checkpoint.
  bool saved_by_every_version = true;
};

constexpr OnResume kFixed = OnResume::kFixed;
constexpr OnResume kCarried = OnResume::kCarried;

const std::vector<Flag>& flags() {
  using C = TrainConfig;
  static const std::vector<Flag> table = {
      {"model", "layers", &C::layers, "N", "transformer blocks", kFixed},
      {"model", "d-model", &C::d_model, "N", "width of the residual stream", kFixed},
      {"model", "heads", &C::heads, "N", "attention heads (must divide --d-model)", kFixed},
      {"model", "experts", &C::experts, "N", "experts per MoE layer", kFixed},
      {"model", "top-k", &C::top_k, "N", "experts each token is routed to", kFixed},
      {"model", "seq-len", &C::seq_len, "N", "tokens per sequence (context length)", kFixed},
      {"precision", "precision", &C::precision, "bf16|fp16",
       "dtype of everything not kept FP32; fp16 adds dynamic loss scaling", kFixed},
      {"precision", "fp8", &C::fp8, "off|e4m3|hybrid",
       "FP8 recipe for the expert GEMMs; simulated (fake quantization): operands are rounded to "
       "FP8 values and the GEMM runs in the model's dtype, which shows FP8's effect on the loss "
       "but costs time and saves nothing on a CPU",
       kFixed},
      {"precision", "loss-scale", &C::loss_scale, "F",
       "fp16: initial dynamic loss scale (halved after overflows, doubled after 1000 clean "
       "steps), and its upper bound; a resumed run continues from the saved scale",
       kFixed, /*saved_by_every_version=*/false},
      {"data", "data", &C::data, "FILE",
       "a text file to train on (default: Python's pydoc topics, found through the venv's "
       "python); on resume it may name another path to the same text, checked by content",
       kCarried},
      {"data", "val-fraction", &C::val_fraction, "F", "held-out tail of the text for validation",
       kFixed},
      {"training", "steps", &C::steps, "N", "optimizer steps in total", kCarried},
      {"training", "batch", &C::batch, "N",
       "sequences per optimizer step, split evenly over the ranks and their --grad-accum "
       "micro-batches (ranks x --grad-accum must divide it)",
       kFixed},
      {"training", "grad-accum", &C::grad_accum, "N",
       "micro-batches per step (each batch/N sequences)", kFixed},
      {"training", "lr", &C::lr, "F", "peak learning rate (AdamW)", kCarried},
      {"training", "warmup", &C::warmup, "N", "linear warm-up steps, then cosine decay", kCarried},
      {"training", "min-lr-ratio", &C::min_lr_ratio, "F", "final lr as a fraction of --lr",
       kCarried},
      {"training", "weight-decay", &C::weight_decay, "F", "AdamW weight decay (matrices only)",
       kCarried},
      {"training", "clip-grad", &C::clip_grad, "F", "clip gradients to this global norm (0: off)",
       kCarried},
      {"training", "aux-loss-coef", &C::aux_loss_coef, "F", "weight of the MoE balancing loss",
       kCarried},
      {"training", "bias-update-rate", &C::bias_update_rate, "F",
       "aux-loss-free balancing: expert-bias step per optimizer step", kCarried},
      {"training", "seed", &C::seed, "N", "seeds the weights, the data order and the sample",
       kFixed},
      {"training", "recompute", &C::recompute, "",
       "keep only each block's input for backward and run the block again there: less "
       "activation memory for one more forward per block, the same losses bit for bit"},
      {"training", "threads", &C::threads, "N", "intra-op threads (0: LibTorch's default)"},
      {"training", "omp-wait", &C::omp_wait, "auto|active|passive",
       "how idle OpenMP threads wait: active spins (up to 1.6x faster on a quiet 2-core machine), "
       "passive "
       "sleeps (spinning where threads outnumber cores makes steps up to 10x slower); auto is "
       "active when local ranks x threads fit the usable CPUs; an OMP_WAIT_POLICY in the "
       "environment wins over auto"},
      {"training", "malloc", &C::malloc_policy, "keep|system",
       "what glibc's malloc does with the memory a step frees: keep holds it for the next step "
       "(no new pages to fault in; the same peak RSS on the default model, 14% more at --batch 64 "
       "--seq-len 256), system gives it back and the next step faults it in again (about 1,400 "
       "page faults a step on the default model); a GLIBC_TUNABLES that sets a glibc.malloc "
       "threshold wins unless the flag is given"},
      {"evaluation and output", "eval-every", &C::eval_every, "N", "validation loss every N steps",
       kCarried},
      {"evaluation and output", "eval-batches", &C::eval_batches, "N",
       "batches of the validation split per evaluation", kCarried},
      {"evaluation and output", "log-every", &C::log_every, "N",
       "one progress line every N steps (when not drawing a bar)"},
      {"evaluation and output", "progress", &C::progress, "auto|bar|lines|none",
       "auto draws a bar on a terminal and prints lines otherwise"},
      {"evaluation and output", "out", &C::out, "DIR",
       "run directory for checkpoints/ and metrics.jsonl (default: runs/<date>-<time>)"},
      {"evaluation and output", "metrics", &C::metrics, "FILE",
       "JSON-lines metrics, one object per step (default: <out>/metrics.jsonl)"},
      {"evaluation and output", "profile-steps", &C::profile_steps, "A:B",
       "write a trace of steps A to B (LibTorch's profiler: every ATen op, and mixprec's own "
       "ranges) to trace-rank<R>.json beside metrics.jsonl, for Perfetto or chrome://tracing"},
      {"checkpoints", "ckpt-dir", &C::ckpt_dir, "DIR",
       "checkpoint root (default: <out>/checkpoints)"},
      {"checkpoints", "ckpt-every", &C::ckpt_every, "N", "save every N steps (and at the end)",
       kCarried},
      {"checkpoints", "keep-last", &C::keep_last, "N", "checkpoints kept (older ones removed)",
       kCarried},
      {"checkpoints", "async-save", &C::async_save, "",
       "write checkpoints in the background: training waits only while the state is copied "
       "to host memory (with several ranks too)"},
      {"checkpoints", "staging-budget-mb", &C::staging_budget_mb, "N",
       "--async-save: host memory the copy may take, checked before the first step", kCarried},
      {"checkpoints", "ckpt-timeout", &C::ckpt_timeout, "S",
       "several ranks: seconds a save's collectives may wait (their own group, not training's)",
       kCarried},
      {"checkpoints", "wait-for-ckpt-dir", &C::wait_for_ckpt_dir, "S",
       "seconds to wait while another run holds the checkpoint directory (0: fail at once)"},
      {"checkpoints", "resume", &C::resume, "",
       "continue from the newest complete checkpoint of the run (default: the newest run in "
       "runs/)"},
      {"checkpoints", "auto-resume", &C::auto_resume, "",
       "continue the run in --out/--ckpt-dir if it has a checkpoint, else start it there: one "
       "command for a job's first launch and its requeues"},
      {"checkpoints", "stop-at", &C::stop_at, "N",
       "stop after step N with a checkpoint, as if interrupted (0: never); --resume continues"},
      {"checkpoints", "init-from", &C::init_from, "PATH",
       "start from exported weights (a mixprec-ckpt export directory or a .safetensors file) "
       "instead of random ones; a new run, not with --resume"},
      {"sample", "prompt", &C::prompt, "TEXT", "text the final sample starts from", kCarried},
      {"sample", "sample-tokens", &C::sample_tokens, "N", "bytes to generate (0: no sample)",
       kCarried},
      {"sample", "temperature", &C::temperature, "F", "sampling temperature; 0 is greedy",
       kCarried},
  };
  return table;
}

std::string key_of(std::string_view name) {
  std::string key(name);
  std::replace(key.begin(), key.end(), '-', '_');
  return key;
}

// Levenshtein distance, for "did you mean".
size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1])});
      diagonal = up;
    }
  }
  return row[b.size()];
}

std::string unknown_flag_message(std::string_view arg) {
  std::string_view name = arg.substr(0, arg.find('='));
  while (name.starts_with('-')) name.remove_prefix(1);
  const Flag* best = nullptr;
  size_t best_distance = 4;  // farther than this is no suggestion at all
  for (const Flag& f : flags()) {
    const size_t d = edit_distance(name, f.name);
    if (d < best_distance) best = &f, best_distance = d;
  }
  std::string message = "unknown flag '" + std::string(arg) + "'";
  if (best != nullptr) message += " (did you mean --" + std::string(best->name) + "?)";
  return message + "; --help lists the flags";
}

int64_t parse_int(std::string_view flag, const std::string& text) {
  int64_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty()) {
    throw UsageError("--" + std::string(flag) + " expects an integer, got '" + text + "'");
  }
  return value;
}

double parse_double(std::string_view flag, const std::string& text) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || text.empty() || !std::isfinite(value)) {
    throw UsageError("--" + std::string(flag) + " expects a number, got '" + text + "'");
  }
  return value;
}

void set_field(TrainConfig& config, const Flag& flag, const std::string& text) {
  std::visit(
      [&](auto member) {
        using T = std::remove_reference_t<decltype(config.*member)>;
        if constexpr (std::is_same_v<T, int64_t>) config.*member = parse_int(flag.name, text);
        if constexpr (std::is_same_v<T, double>) config.*member = parse_double(flag.name, text);
        if constexpr (std::is_same_v<T, std::string>) config.*member = text;
        if constexpr (std::is_same_v<T, bool>) config.*member = true;
      },
      flag.field);
}

nlohmann::json get_field(const TrainConfig& config, const Flag& flag) {
  return std::visit([&](auto member) { return nlohmann::json(config.*member); }, flag.field);
}

// A value the way a user would type it: a whole number stored as a double prints as one
// ("65536", "5", not "65536.0").
std::string typed(const nlohmann::json& value) {
  if (value.is_string()) return value.get<std::string>();
  const bool whole = value.is_number_float() && std::abs(value.get<double>()) < 1e15 &&
                     value.get<double>() == std::floor(value.get<double>());
  return whole ? std::to_string(static_cast<long long>(value.get<double>())) : value.dump();
}

// Shown in messages the way a user would type it: --layers 2, --data "" for the default.
std::string shown(const Flag& flag, const nlohmann::json& value) {
  std::string text = typed(value);
  if (text.empty()) text = "(default)";
  return "--" + std::string(flag.name) + " " + text;
}

void check(bool ok, const std::string& message) {
  if (!ok) throw UsageError(message);
}

}  // namespace

ParsedArgs parse_args(int argc, const char* const* argv) {
  ParsedArgs parsed;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      parsed.help = true;
      continue;
    }
    const size_t eq = arg.find('=');
    const std::string_view name = std::string_view(arg).substr(0, eq);
    const auto it = std::find_if(flags().begin(), flags().end(), [&](const Flag& f) {
      return name.starts_with("--") && name.substr(2) == f.name;
    });
    if (it == flags().end()) throw UsageError(unknown_flag_message(arg));
    const bool is_switch = it->metavar.empty();
    std::string value;
    if (is_switch) {
      check(eq == std::string::npos, "--" + std::string(it->name) + " takes no value");
    } else if (eq != std::string::npos) {
      value = arg.substr(eq + 1);
    } else {
      check(i + 1 < argc,
            "--" + std::string(it->name) + " needs a value (" + std::string(it->metavar) + ")");
      value = argv[++i];
    }
    set_field(parsed.config, *it, value);
    parsed.config.given.insert(key_of(it->name));
  }
  if (!parsed.help) validate(parsed.config);
  return parsed;
}

void validate(const TrainConfig& c) {
  validate_values(c);
  // A resumed run's own settings come from its checkpoint (adopt_run_shape checks them then):
  // checked against the defaults, a combination would name values nobody gave.
  if (!c.resume) validate_combinations(c);
}

void validate_values(const TrainConfig& c) {
  auto positive = [](const char* flag, int64_t v) {
    check(v > 0, std::string("--") + flag + " must be at least 1, got " + std::to_string(v));
  };
  positive("layers", c.layers);
  positive("d-model", c.d_model);
  positive("heads", c.heads);
  positive("experts", c.experts);
  positive("top-k", c.top_k);
  positive("seq-len", c.seq_len);
  positive("steps", c.steps);
  positive("batch", c.batch);
  positive("grad-accum", c.grad_accum);
  positive("eval-every", c.eval_every);
  positive("eval-batches", c.eval_batches);
  positive("log-every", c.log_every);
  positive("ckpt-every", c.ckpt_every);
  positive("keep-last", c.keep_last);
  positive("staging-budget-mb", c.staging_budget_mb);
  // Seconds become a steady_clock deadline (nanoseconds in 64 bits): a year is plenty, and
  // ~292 years would overflow it.
  constexpr int64_t kYear = 365LL * 24 * 3600;
  check(c.ckpt_timeout >= 1 && c.ckpt_timeout <= kYear,
        "--ckpt-timeout must lie in [1, " + std::to_string(kYear) + "] seconds, got " +
            std::to_string(c.ckpt_timeout));
  check(c.wait_for_ckpt_dir >= 0 && c.wait_for_ckpt_dir <= kYear,
        "--wait-for-ckpt-dir must lie in [0, " + std::to_string(kYear) + "] seconds, got " +
            std::to_string(c.wait_for_ckpt_dir));
  check(c.precision == "bf16" || c.precision == "fp16",
        "--precision must be bf16 or fp16, got '" + c.precision + "'");
  check(c.fp8 == "off" || c.fp8 == "e4m3" || c.fp8 == "hybrid",
        "--fp8 must be off, e4m3 or hybrid, got '" + c.fp8 + "'");
  check(
      c.progress == "auto" || c.progress == "bar" || c.progress == "lines" || c.progress == "none",
      "--progress must be auto, bar, lines or none, got '" + c.progress + "'");
  check(c.lr > 0, "--lr must be positive");
  check(c.loss_scale >= 1, "--loss-scale must be at least 1");
  check(c.warmup >= 0, "--warmup must not be negative");
  check(c.min_lr_ratio >= 0 && c.min_lr_ratio <= 1, "--min-lr-ratio must lie in [0, 1]");
  check(c.weight_decay >= 0, "--weight-decay must not be negative");
  check(c.clip_grad >= 0, "--clip-grad must not be negative (0 turns clipping off)");
  check(c.aux_loss_coef >= 0, "--aux-loss-coef must not be negative");
  check(c.bias_update_rate >= 0, "--bias-update-rate must not be negative");
  check(c.val_fraction > 0 && c.val_fraction < 1, "--val-fraction must lie in (0, 1)");
  check(c.seed >= 0, "--seed must not be negative");
  check(c.stop_at >= 0, "--stop-at must not be negative");
  // (Given: --auto-resume itself sets `resume` once it finds a checkpoint.)
  check(!c.auto_resume || !c.is_given("resume"),
        "--auto-resume resumes when there is a checkpoint, --resume always: give one of them");
  check(!c.auto_resume || !c.out.empty() || !c.ckpt_dir.empty(),
        "--auto-resume needs --out or --ckpt-dir: the directory of the run to continue or start");
  check(c.init_from.empty() || !c.resume,
        "--init-from starts a new run from exported weights; --resume continues a run from its "
        "checkpoint: give one of them");
  // (LibTorch takes an int, and OpenMP allocates per thread: a typo should be an error, not
  // an out-of-memory abort.)
  check(c.threads >= 0 && c.threads <= 1024,
        "--threads must lie in [0, 1024], got " + std::to_string(c.threads));
  if (!c.profile_steps.empty()) parse_profile_steps(c.profile_steps);  // throws UsageError
  check(c.omp_wait == "auto" || c.omp_wait == "passive" || c.omp_wait == "active",
        "--omp-wait must be auto, active or passive, not '" + c.omp_wait + "'");
  check(c.malloc_policy == "keep" || c.malloc_policy == "system",
        "--malloc must be keep or system, not '" + c.malloc_policy + "'");
  check(c.sample_tokens >= 0, "--sample-tokens must not be negative");
  check(c.temperature >= 0, "--temperature must not be negative");
}

void validate_combinations(const TrainConfig& c) {
  check(c.d_model % c.heads == 0, "--heads " + std::to_string(c.heads) +
                                      " does not divide --d-model " + std::to_string(c.d_model));
  check(c.top_k <= c.experts,
        "--top-k " + std::to_string(c.top_k) + " exceeds --experts " + std::to_string(c.experts));
  check(c.batch % c.grad_accum == 0, "--grad-accum " + std::to_string(c.grad_accum) +
                                         " does not divide --batch " + std::to_string(c.batch));
  if (!c.profile_steps.empty()) {
    const ProfileSteps p = parse_profile_steps(c.profile_steps);
    check(p.last <= c.steps,
          "--profile-steps " + c.profile_steps + " ends after --steps " + std::to_string(c.steps));
  }
  // A resumed run keeps its --batch and --grad-accum (kFixed): the number of ranks it continues
  // on, times --grad-accum, must divide --batch, which the message says, since "any number of
  // ranks" is what a checkpoint allows.
  check(c.batch % (c.world_size * c.grad_accum) == 0,
        "--batch " + std::to_string(c.batch) + " does not split into " +
            std::to_string(c.world_size) + " ranks x --grad-accum " + std::to_string(c.grad_accum) +
            " micro-batches (every rank takes the same number of sequences in each micro-batch; "
            "--batch and --grad-accum are fixed on resume, so a run continues on a number of "
            "ranks that, times --grad-accum, divides --batch)");
}

ProfileSteps parse_profile_steps(const std::string& text) {
  const std::string what = "--profile-steps '" + text + "': expected A:B, steps 1 <= A <= B";
  const size_t colon = text.find(':');
  if (colon == std::string::npos) throw UsageError(what);
  ProfileSteps p;
  const char* begin = text.data();
  const char* mid = begin + colon;
  const char* end = begin + text.size();
  const auto a = std::from_chars(begin, mid, p.first);
  const auto b = std::from_chars(mid + 1, end, p.last);
  if (a.ec != std::errc() || a.ptr != mid || b.ec != std::errc() || b.ptr != end || p.first < 1 ||
      p.last < p.first) {
    throw UsageError(what);
  }
  return p;
}

std::string usage() {
  std::ostringstream s;
  s << "usage: mixprec-train [flags]\n\n"
       "Trains a small GPT with mixture-of-experts blocks on bytes of text: BF16 (or FP16)\n"
       "weights, router, expert bias and norms in FP32, FP8 expert GEMMs, AdamW with FP32\n"
       "masters, durable checkpoints. With no flags it trains on Python's documentation\n"
       "topics for about a minute on two cores. SIGINT/SIGTERM save and exit.\n"
       "--resume continues with the settings the run was started with: a flag given\n"
       "again changes its setting, except those fixed on resume; threads, paths, output\n"
       "and switches are this run's own.\n";
  const TrainConfig defaults;
  std::string_view section;
  for (const Flag& f : flags()) {
    if (f.section != section) {
      section = f.section;
      s << "\n" << section << ":\n";
    }
    std::string left = "  --" + std::string(f.name);
    if (!f.metavar.empty()) left += " " + std::string(f.metavar);
    if (left.size() < 30)
      left.resize(30, ' ');
    else
      left += "  ";
    s << left << f.help;
    const nlohmann::json value = get_field(defaults, f);
    const bool has_default =
        !f.metavar.empty() && !(value.is_string() && value.get<std::string>().empty());
    if (has_default) s << " [" << typed(value) << "]";
    if (f.on_resume == kFixed) s << " (fixed on resume)";
    s << "\n";
  }
  return s.str();
}

nlohmann::json run_shape(const TrainConfig& config) {
  nlohmann::json shape = nlohmann::json::object();
  for (const Flag& f : flags()) {
    if (f.on_resume != OnResume::kThisRun) shape[key_of(f.name)] = get_field(config, f);
  }
  return shape;
}

std::vector<ResumeChange> adopt_run_shape(TrainConfig& config, const nlohmann::json& shape,
                                          const std::string& source) {
  check(shape.is_object(), source + " holds no mixprec-train configuration");
  TrainConfig adopted = config;  // validate first, then change `config`
  std::vector<ResumeChange> changes;
  for (const Flag& f : flags()) {
    if (f.on_resume == OnResume::kThisRun) continue;
    const std::string key = key_of(f.name);
    if (!shape.contains(key)) {
      // Checkpoints from before the run's course was saved hold the first fixed flags only.
      check(f.on_resume != kFixed || !f.saved_by_every_version,
            source + " holds no value for --" + std::string(f.name) +
                " (not written by this version of mixprec-train?)");
      continue;
    }
    const nlohmann::json saved = shape.at(key);
    const nlohmann::json current = get_field(config, f);
    check(saved.is_primitive() && !saved.is_null() &&
              std::string_view(saved.type_name()) == current.type_name(),
          source + ": malformed value for --" + std::string(f.name));
    if (saved == current) continue;
    if (config.is_given(key)) {
      check(f.on_resume != kFixed, source + " was trained with " + shown(f, saved) +
                                       "; this run asks for " + shown(f, current));
      changes.push_back({std::string(f.name), shown(f, saved), shown(f, current)});
      continue;
    }
    std::visit(
        [&](auto member) {
          using T = std::remove_reference_t<decltype(adopted.*member)>;
          adopted.*member = saved.get<T>();
        },
        f.field);
  }
  validate_values(adopted);
  validate_combinations(adopted);
  config = std::move(adopted);
  return changes;
}

std::string describe(const TrainConfig& c) {
  std::ostringstream s;
  s << c.layers << (c.layers == 1 ? " layer" : " layers") << ", d_model " << c.d_model << ", "
    << c.heads << " heads, " << c.experts << " experts (top-" << c.top_k << "), seq " << c.seq_len
    << " | " << c.precision << ", fp8 " << c.fp8 << (c.recompute ? ", recompute" : "");
  if (c.world_size > 1) s << " | " << c.world_size << " ranks, ZeRO-1";
  return s.str();
}

}  // namespace train
