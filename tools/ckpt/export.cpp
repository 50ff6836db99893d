#include "ckpt/export.h"

#include "ckpt/cli.h"
#include "ckpt/text_table.h"

#include "mixprec/checkpoint/format/directory.h"
#include "mixprec/checkpoint/format/error.h"
#include "mixprec/checkpoint/format/manifest.h"
#include "mixprec/checkpoint/format/safetensors_writer.h"
#include "mixprec/checkpoint/format/state_keys.h"
#include "mixprec/checkpoint/load.h"
#include "mixprec/checkpoint/tensor_dtype.h"

#include <csignal>
#include <cstdlib>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <iterator>
#include <random>
#include <regex>
#include <sstream>

namespace mixprec::tools {
namespace {

namespace fs = std::filesystem;
namespace keys = checkpoint::keys;
using checkpoint::Dtype;

constexpr std::uint64_t kExportBatchBytes = std::uint64_t{256} << 20;
constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

[[noreturn]] void usage_error(const std::string& message) {
  throw ToolError(kExitUsage, "export: " + message);
}

std::optional<Dtype> parse_export_dtype(const std::string& name) {
  if (name == "bf16") return Dtype::BF16;
  if (name == "fp16") return Dtype::F16;
  if (name == "fp32") return Dtype::F32;
  if (name == "keep") return std::nullopt;
  usage_error("unknown --dtype '" + name + "' (one of bf16, fp16, fp32, keep)");
}

std::string shard_name(std::size_t index, std::size_t count) {
  char name[64];
  std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", index + 1, count);
  return name;
}

bool is_export_file(const std::string& name) {
  static const std::regex shard(R"(model-\d{5}-of-\d{5}\.safetensors)");
  return name == kSingleFile || name == kIndexFile || std::regex_match(name, shard);
}

// One tensor as it goes out: the checkpoint key, what it is stored as, what it is written as.
struct Planned {
  std::string name;
  Dtype stored;
  checkpoint::TensorSpec spec;
};

struct Shard {
  std::string file;
  std::vector<Planned> tensors;
  std::uint64_t bytes = 0;
};

// The model's keys, converted, cut into shards in name order (HuggingFace's rule: a new shard
// when the next tensor would overflow a non-empty one).
std::vector<Shard> plan_shards(const checkpoint::Manifest& manifest, const ExportOptions& options) {
  std::vector<Shard> shards(1);
  for (const auto& [key, entry] : manifest.keys) {
    if (keys::is_optimizer_key(key) || keys::is_rng_key(key)) continue;
    const bool floating = at::isFloatingType(checkpoint::to_scalar_type(entry.dtype));
    const Dtype written = options.dtype && floating ? *options.dtype : entry.dtype;
    Planned planned{key, entry.dtype, {key, written, entry.shape}};
    const std::uint64_t bytes = planned.spec.byte_size();
    if (!shards.back().tensors.empty() && shards.back().bytes + bytes > options.max_shard_bytes) {
      shards.emplace_back();
    }
    shards.back().tensors.push_back(std::move(planned));
    shards.back().bytes += bytes;
  }
  for (std::size_t i = 0; i < shards.size(); ++i) {
    shards[i].file = shards.size() == 1 ? kSingleFile : shard_name(i, shards.size());
  }
  return shards;
}

// The "__metadata__" of every file: string → string.
std::map<std::string, std::string> file_metadata(const fs::path& dir, const nlohmann::json& common,
                                                 const ExportOptions& options) {
  std::map<std::string, std::string> metadata = {{"format", "pt"},
                                                 {"mixprec.checkpoint", dir.filename().string()},
                                                 {"mixprec.dtype", options.dtype_name}};
  const std::string user_field(keys::kCommonUser), optimizer_field(keys::kCommonOptimizer);
  const auto field = [&](const std::string& name) {
    return common.is_object() && common.contains(name) ? common.at(name) : nlohmann::json();
  };
  const nlohmann::json user = field(user_field), optimizer = field(optimizer_field);
  if (user.is_object() && user.contains("step") && user.at("step").is_number_integer()) {
    metadata["mixprec.step"] = user.at("step").dump();
  } else if (optimizer.is_object() && optimizer.contains(keys::kStep)) {
    metadata["mixprec.step"] = optimizer.at(keys::kStep).dump();
  }
  if (user.is_object() && user.contains("config")) {
    metadata["mixprec.config"] = user.at("config").dump();
  }
  const nlohmann::json precision = field(std::string(keys::kCommonPrecision));
  if (!precision.is_null()) metadata["mixprec.kept_fp32"] = precision.dump();
  return metadata;
}

std::string errno_message(const std::string& what, int err) {
  return what + ": " + std::strerror(err);
}

// A signal that ends a process by default, while an export writes: it stops at the next
// tensor and unwinds, so the staging directory is removed and OUT stays as it was (instead of
// dying with a half-written staging directory beside it). SIGTERM (a scheduler), SIGINT
// (Ctrl-C), SIGHUP (the terminal or ssh session went away) and SIGQUIT (Ctrl-\).
volatile std::sig_atomic_t g_interrupted = 0;
extern "C" void on_interrupt(int signal_number) { g_interrupted = signal_number; }

struct HandledSignal {
  int number;
  const char* name;
  // Reset to the default action once caught: a second one (a person insisting) ends the
  // process at once. SIGTERM and SIGHUP stay handled: a scheduler often sends two SIGTERMs
  // milliseconds apart, and a hangup may come with others.
  bool second_ends_process;
};
constexpr HandledSignal kHandledSignals[] = {{SIGTERM, "SIGTERM", false},
                                             {SIGHUP, "SIGHUP", false},
                                             {SIGINT, "SIGINT", true},
                                             {SIGQUIT, "SIGQUIT", true}};
constexpr std::size_t kSignalCount = std::size(kHandledSignals);

// A signal the process was started with ignored stays ignored: `nohup` ignores SIGHUP (and a
// background job of a non-interactive shell SIGINT and SIGQUIT) precisely so that the export
// outlives the session; catching it would end the export where it would have finished.
class InterruptGuard {
 public:
  InterruptGuard() {
    g_interrupted = 0;
    for (std::size_t i = 0; i < kSignalCount; ++i) {
      sigaction(kHandledSignals[i].number, nullptr, &previous_[i]);
      if (previous_[i].sa_handler == SIG_IGN) continue;
      struct sigaction action {};
      action.sa_handler = on_interrupt;
      sigemptyset(&action.sa_mask);
      action.sa_flags = kHandledSignals[i].second_ends_process ? SA_RESETHAND : 0;
      sigaction(kHandledSignals[i].number, &action, nullptr);
      installed_[i] = true;
    }
  }
  ~InterruptGuard() {
    for (std::size_t i = 0; i < kSignalCount; ++i) {
      if (installed_[i]) sigaction(kHandledSignals[i].number, &previous_[i], nullptr);
    }
  }
  InterruptGuard(const InterruptGuard&) = delete;
  InterruptGuard& operator=(const InterruptGuard&) = delete;

 private:
  struct sigaction previous_[kSignalCount] = {};
  bool installed_[kSignalCount] = {};
};

void stop_if_interrupted() {
  const int caught = g_interrupted;
  if (caught == 0) return;
  std::string name = "signal " + std::to_string(caught);
  for (const HandledSignal& s : kHandledSignals) {
    if (s.number == caught) name = s.name;
  }
  throw ToolError(128 + caught, "interrupted by " + name);
}

// The name of a temporary sibling of OUT ("tmp": the staging directory; "old": an export that
// --force replaces, moved aside): a fixed prefix, this process's id and 8 random hex digits.
// Not derived from OUT's name, which may already be as long as a name can be (NAME_MAX). The
// random part keeps the name free when an earlier export with the same pid was killed
// (SIGKILL) and left its sibling behind.
std::string sibling_name(const char* role) {
  std::random_device entropy;
  char random[9];
  std::snprintf(random, sizeof random, "%08x", static_cast<unsigned>(entropy()));
  return std::string("mixprec-export.") + role + "-" + std::to_string(::getpid()) + "-" + random;
}

// The temporary sibling mixprec-export.tmp-<pid>-<random>: removed unless it was renamed to
// OUT.
class StagingDir {
 public:
  StagingDir(const checkpoint::Directory& parent, std::string name)
      : parent_(parent.duplicate()), name_(std::move(name)) {
    if (::mkdirat(parent_.fd(), name_.c_str(), 0755) != 0) {
      throw ToolError(
          kExitUsage,
          errno_message("create the staging directory " + (parent_ / name_).string(), errno));
    }
    created_ = true;
    dir_.emplace(checkpoint::Directory::open(parent_ / name_));
  }
  ~StagingDir() {
    if (!created_) return;
    dir_.reset();
    try {
      parent_.remove_tree(name_);
    } catch (const std::exception&) {
      // best effort: a leftover names this process
    }
  }
  StagingDir(const StagingDir&) = delete;
  StagingDir& operator=(const StagingDir&) = delete;

  const checkpoint::Directory& directory() const { return *dir_; }
  const std::string& name() const { return name_; }
  void released() { created_ = false; }

 private:
  checkpoint::Directory parent_;
  std::string name_;
  std::optional<checkpoint::Directory> dir_;
  bool created_ = false;
};

void write_text_file(const checkpoint::Directory& dir, const std::string& name,
                     const std::string& text) {
  const std::string path = (dir / name).string();
  const int fd =
      ::openat(dir.fd(), name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) throw ToolError(kExitUsage, errno_message("create " + path, errno));
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      throw ToolError(kExitUsage, errno_message("write " + path, err));
    }
    done += static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    throw ToolError(kExitUsage, errno_message("fsync " + path, errno));
  }
}

// Streams one shard: its tensors read in batches (whole, checksums verified), converted,
// appended in declared order.
void write_shard(const fs::path& checkpoint_dir, const Shard& shard,
                 const std::map<std::string, std::string>& metadata,
                 const checkpoint::Directory& out) {
  std::vector<checkpoint::TensorSpec> specs;
  for (const Planned& p : shard.tensors) specs.push_back(p.spec);
  checkpoint::SafetensorsWriter writer(out, shard.file, specs, metadata);
  std::size_t next = 0;
  while (next < shard.tensors.size()) {
    checkpoint::ReadOptions batch;
    std::uint64_t bytes = 0;
    std::size_t end = next;
    for (; end < shard.tensors.size(); ++end) {
      const std::uint64_t size = shard.tensors[end].spec.byte_size();
      if (end > next && bytes + size > kExportBatchBytes) break;
      batch.keys.insert(shard.tensors[end].name);
      bytes += size;
    }
    const ShardedStateDict read = checkpoint::read_checkpoint(checkpoint_dir, batch);
    for (; next < end; ++next) {
      stop_if_interrupted();
      const Planned& p = shard.tensors[next];
      at::Tensor value = read.at(p.name).local;
      TORCH_INTERNAL_ASSERT(read.at(p.name).is_whole(), p.name, ": read a slice, not the whole");
      if (p.spec.dtype != p.stored) value = value.to(checkpoint::to_scalar_type(p.spec.dtype));
      value = value.contiguous();
      writer.write(p.name, {static_cast<const std::byte*>(value.const_data_ptr()), value.nbytes()});
    }
  }
  writer.close();
}

std::string index_json(const std::vector<Shard>& shards) {
  nlohmann::json weight_map = nlohmann::json::object();
  std::uint64_t total = 0;
  for (const Shard& shard : shards) {
    total += shard.bytes;
    for (const Planned& p : shard.tensors) weight_map[p.name] = shard.file;
  }
  const nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  return index.dump(2) + "\n";
}

// Where OUT goes: its parent (opened) and its name there. Checks what can be checked before
// anything is written.
struct Target {
  checkpoint::Directory parent;
  std::string name;
  bool exists = false;
};

// The first entry of `dir` an export does not write (another name, or not a regular file), or
// "" if there is none.
// Errors go to `ec` (the iterator is advanced with increment(ec): a range-for's ++ throws).
std::string foreign_entry(const fs::path& dir, std::error_code& ec) {
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string file = it->path().filename().string();
    if (!is_export_file(file) || !it->is_regular_file(ec) || it->is_symlink(ec)) return file;
  }
  return "";
}

Target check_target(const ExportOptions& options) {
  if (options.out.empty()) usage_error("empty output path");
  fs::path out = fs::path(options.out).lexically_normal();
  if (out.filename().empty()) out = out.parent_path();  // "dir/" → "dir"
  const std::string name = out.filename().string();
  if (name.empty() || name == "." || name == "..") {
    usage_error(options.out + ": not a name for a new directory");
  }
  const fs::path parent = out.parent_path().empty() ? fs::path(".") : out.parent_path();
  std::error_code ec;
  if (!fs::is_directory(parent, ec)) usage_error(parent.string() + ": no such directory");
  Target target{checkpoint::Directory::open(parent, checkpoint::Directory::Last::kMayBeLink), name};
  const fs::file_status status = fs::symlink_status(out, ec);
  if (status.type() == fs::file_type::not_found) return target;
  target.exists = true;
  if (!options.force) usage_error(options.out + ": already exists (--force replaces an export)");
  if (status.type() != fs::file_type::directory) {
    usage_error(options.out + ": exists and is not a directory; --force replaces only an export");
  }
  if (const std::string file = foreign_entry(out, ec); !file.empty()) {
    usage_error(options.out + ": holds '" + file +
                "', which an export does not write; --force replaces only an export");
  }
  if (ec) usage_error(options.out + ": " + ec.message());
  return target;
}

// The export OUT held, now at <parent>/<name> after the rename: removed if it still holds only
// export files. Something added to it while the new export was written (check_target looked
// before) is no export's to delete: the directory is kept under a sibling name, and the note
// says where.
std::string retire_replaced(const Target& target, const std::string& name) {
  const fs::path replaced = target.parent / name;
  std::error_code ec;
  const std::string file = foreign_entry(replaced, ec);
  if (!file.empty() || ec) {
    std::string kept = name;
    if (!name.starts_with("mixprec-export.old-")) {
      kept = sibling_name("old");
      if (::renameat(target.parent.fd(), name.c_str(), target.parent.fd(), kept.c_str()) != 0) {
        kept = name;  // stays under the staging name
      }
    }
    return "the replaced export gained '" + (file.empty() ? ec.message() : file) +
           "' while exporting, which an export does not write: kept as " +
           (target.parent / kept).string();
  }
  try {
    target.parent.remove_tree(name);
  } catch (const std::exception& e) {
    return "could not remove the replaced export " + replaced.string() + ": " + e.what();
  }
  return "";
}

// Renames the staging directory to OUT: atomically, without ever replacing anything but the
// export that check_target accepted. Returns a note for the report, if any.
std::string publish(Target& target, StagingDir& staging) {
  const int fd = target.parent.fd();
  const char* from = staging.name().c_str();
  const char* to = target.name.c_str();
  const fs::path out = target.parent / target.name;
  std::string note;
  if (!target.exists) {
    if (::renameat2(fd, from, fd, to, RENAME_NOREPLACE) != 0) {
      const int err = errno;
      if (err == EEXIST) usage_error(out.string() + ": appeared while exporting; not replaced");
      if ((err != EINVAL && err != ENOSYS) || ::renameat(fd, from, fd, to) != 0) {
        throw ToolError(kExitUsage, errno_message("rename to " + out.string(), errno));
      }
    }
    staging.released();
  } else if (::renameat2(fd, from, fd, to, RENAME_EXCHANGE) == 0) {
    // The staging name now holds the old export.
    staging.released();
    note = retire_replaced(target, staging.name());
  } else {
    // No RENAME_EXCHANGE here: the old export is moved aside first.
    const std::string aside = sibling_name("old");
    if (::renameat(fd, to, fd, aside.c_str()) != 0) {
      throw ToolError(kExitUsage, errno_message("rename " + out.string() + " aside", errno));
    }
    if (::renameat(fd, from, fd, to) != 0) {
      const int err = errno;
      ::renameat(fd, aside.c_str(), fd, to);
      throw ToolError(kExitUsage, errno_message("rename to " + out.string(), err));
    }
    staging.released();
    note = retire_replaced(target, aside);
  }
  if (::fsync(fd) != 0) throw ToolError(kExitUsage, errno_message("fsync " + out.string(), errno));
  return note;
}

}  // namespace

std::uint64_t parse_byte_size(std::string_view text) {
  static const std::regex form(R"(([0-9]+(\.[0-9]+)?)\s*([kmgt]i?)?b?)", std::regex::icase);
  std::cmatch match;
  const std::string copy(text);
  if (!std::regex_match(copy.c_str(), match, form)) {
    usage_error("--max-shard-size '" + copy + "' is not a size (e.g. 5GB, 200MB, 64KiB, 1000)");
  }
  std::string unit = match[3].str();
  for (char& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const double base = unit.size() == 2 ? 1024.0 : 1000.0;
  const std::string prefixes = "kmgt";
  const double scale = unit.empty() ? 1.0 : std::pow(base, prefixes.find(unit[0]) + 1);
  // The regex admits only digits, so strtod cannot fail; a number too large is HUGE_VAL,
  // refused below.
  const double bytes = std::floor(std::strtod(match[1].str().c_str(), nullptr) * scale);
  if (!(bytes >= 1) || bytes >= 9.2e18) {
    usage_error("--max-shard-size '" + copy + "' must be at least 1 byte and below 2^63");
  }
  return static_cast<std::uint64_t>(bytes);
}

ExportOptions parse_export_args(const std::vector<std::string>& args) {
  ExportOptions options;
  std::vector<std::string> positional;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg.size() < 2 || arg[0] != '-') {
      positional.push_back(arg);
      continue;
    }
    const std::size_t eq = arg.find('=');
    const std::string name = arg.substr(0, eq);
    if (name == "--force") {
      if (eq != std::string::npos) usage_error("--force takes no value");
      options.force = true;
      continue;
    }
    if (name != "--dtype" && name != "--max-shard-size") {
      usage_error("unknown option '" + arg + "' (options: --dtype, --max-shard-size, --force)");
    }
    std::string value;
    if (eq != std::string::npos) {
      value = arg.substr(eq + 1);
    } else if (i + 1 < args.size()) {
      value = args[++i];
    } else {
      usage_error(name + " needs a value" +
                  (name == "--dtype" ? " (bf16, fp16, fp32 or keep)" : " (e.g. 5GB)"));
    }
    if (name == "--dtype") {
      options.dtype = parse_export_dtype(value);
      options.dtype_name = value;
    } else {
      options.max_shard_bytes = parse_byte_size(value);
    }
  }
  if (positional.size() != 2) {
    usage_error("expected 2 arguments, got " + std::to_string(positional.size()) +
                " (usage: mixprec-ckpt " + std::string(kExportSynopsis) + ")");
  }
  options.checkpoint = positional[0];
  options.out = positional[1];
  return options;
}

int run_export(const ExportOptions& options, std::ostream& out, Notes& notes) {
  Target target = check_target(options);
  const fs::path dir = checkpoint_from_arg(options.checkpoint, notes).dir;
  std::vector<Shard> shards;
  std::map<std::string, std::string> metadata;
  std::string note;
  try {
    const checkpoint::Manifest manifest = checkpoint::read_manifest(dir);
    shards = plan_shards(manifest, options);
    if (shards.front().tensors.empty()) {
      usage_error(dir.string() + " holds no model tensors (only optimizer or RNG state)");
    }
    metadata = file_metadata(dir, checkpoint::read_common(dir, manifest), options);

    const InterruptGuard interrupts;
    StagingDir staging(target.parent, sibling_name("tmp"));
    for (const Shard& shard : shards) write_shard(dir, shard, metadata, staging.directory());
    stop_if_interrupted();  // the last moment OUT can still be left as it was
    if (shards.size() > 1) write_text_file(staging.directory(), kIndexFile, index_json(shards));
    if (::fsync(staging.directory().fd()) != 0) {
      throw ToolError(kExitUsage,
                      errno_message("fsync " + staging.directory().path().string(), errno));
    }
    note = publish(target, staging);
  } catch (const ToolError& e) {
    throw ToolError(e.code(), std::string(e.what()) + "; " + options.out + " left as it was");
  } catch (const checkpoint::FormatError& e) {
    usage_error(std::string(e.what()) + "; " + options.out + " left as it was");
  } catch (const c10::Error& e) {
    usage_error(std::string(e.what_without_backtrace()) + "; " + options.out + " left as it was");
  }

  // The report: what went where.
  std::size_t tensors = 0, converted = 0;
  std::uint64_t total = 0;
  TextTable table({"FILE", "TENSORS", "BYTES"}, {1, 2});
  for (const Shard& shard : shards) {
    tensors += shard.tensors.size();
    total += shard.bytes;
    for (const Planned& p : shard.tensors) converted += p.spec.dtype != p.stored;
    std::error_code ec;
    const auto size = fs::file_size(fs::path(options.out) / shard.file, ec);
    table.add_row({shard.file, std::to_string(shard.tensors.size()),
                   ec ? std::string("?") : std::to_string(size)});
  }
  if (shards.size() > 1) table.add_row({kIndexFile, "", ""});
  std::ostringstream text;
  text << "exported " << dir.string() << " to " << options.out << "\n"
       << "  " << tensors << " model tensors, " << total << " bytes (" << human_bytes(total)
       << "), dtype " << options.dtype_name << " (" << converted << " converted)";
  if (metadata.count("mixprec.step")) text << ", step " << metadata.at("mixprec.step");
  text << "\n";
  table.print(text);
  if (!note.empty()) text << "note: " << note << "\n";
  out << text.str();
  return kExitOk;
}

}  // namespace mixprec::tools
