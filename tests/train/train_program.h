// Running the built mixprec-train as a subprocess, and reading what it leaves behind.
#pragma once

#include "metrics.h"
#include "mixprec/checkpoint/save.h"
#include "support/remove_tree.h"
#include "support/test_env.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace train::testing {

namespace fs = std::filesystem;

struct ProgramRun {
  int status = -1;  // exit status; -1 if it died from a signal
  std::string out, err;
};

inline std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// A scratch directory, removed at scope exit.
class Scratch {
 public:
  Scratch() {
    std::string templ = (fs::temp_directory_path() / "mixprec-train-test-XXXXXX").string();
    if (::mkdtemp(templ.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = templ;
  }
  ~Scratch() { mixprec::testing::remove_tree(path_); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  const fs::path& path() const { return path_; }
  fs::path operator/(const std::string& name) const { return path_ / name; }

 private:
  fs::path path_;
};

// The flags of a tiny model that trains in well under a second per few steps.
inline std::vector<std::string> tiny_model() {
  return {"--layers",   "1",     "--d-model", "32", "--heads", "2", "--experts",       "4",
          "--top-k",    "2",     "--seq-len", "32", "--batch", "8", "--sample-tokens", "0",
          "--progress", "lines", "--threads", "1"};
}

inline std::vector<std::string> operator+(std::vector<std::string> a,
                                          const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Starts mixprec-train with `args` (stdout/stderr to files in `scratch`); returns its pid.
// A non-empty `torchrun_args`: under `torchrun <torchrun_args> --no-python`.
inline pid_t start_launched(const fs::path& scratch, const std::vector<std::string>& torchrun_args,
                            const std::vector<std::string>& args, const std::string& tag) {
  const fs::path out = scratch / (tag + ".out"), err = scratch / (tag + ".err");
  // Resolved before fork(): the child only execs.
  std::string bin = mixprec::test::required_env("MIXPREC_TRAIN_BIN");
  std::vector<std::string> copy = args;
  const bool launched = !torchrun_args.empty();
  if (launched) {
    const std::string torchrun = mixprec::test::torchrun();
    if (torchrun.empty()) throw std::runtime_error("MIXPREC_TORCHRUN is not set: no torchrun");
    std::vector<std::string> prefix = torchrun_args;
    prefix.insert(prefix.end(), {"--no-python", bin});
    copy.insert(copy.begin(), prefix.begin(), prefix.end());
    bin = torchrun;
  }
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int o = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int e = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int in = ::open("/dev/null", O_RDONLY);
    ::dup2(o, 1), ::dup2(e, 2), ::dup2(in, 0);
    if (launched) ::setenv("OMP_NUM_THREADS", "1", 1);
    std::vector<char*> argv;
    argv.push_back(bin.data());
    for (auto& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::chdir(scratch.c_str());  // the default runs/ directory lands in the scratch directory
    ::execv(bin.c_str(), argv.data());
    ::_exit(127);
  }
  return pid;
}

// `ranks` > 0: under `torchrun --standalone --nproc-per-node <ranks> --no-python`.
inline pid_t start_program(const fs::path& scratch, const std::vector<std::string>& args,
                           const std::string& tag, int ranks = 0) {
  std::vector<std::string> torchrun_args;
  if (ranks > 0) torchrun_args = {"--standalone", "--nproc-per-node", std::to_string(ranks)};
  return start_launched(scratch, torchrun_args, args, tag);
}

inline ProgramRun wait_program(const fs::path& scratch, pid_t pid, const std::string& tag) {
  int raw = 0;
  ::waitpid(pid, &raw, 0);
  ProgramRun run;
  run.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  run.out = read_text(scratch / (tag + ".out"));
  run.err = read_text(scratch / (tag + ".err"));
  return run;
}

inline ProgramRun run_program(const fs::path& scratch, const std::vector<std::string>& args,
                              const std::string& tag = "run", int ranks = 0) {
  return wait_program(scratch, start_program(scratch, args, tag, ranks), tag);
}

// The metrics file's records, in file order.
inline std::vector<StepRecord> read_metrics(const fs::path& path) {
  std::vector<StepRecord> records;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    records.push_back(StepRecord::from_json(nlohmann::json::parse(line)));
  }
  return records;
}

inline size_t count_lines(const fs::path& path) {
  std::ifstream in(path);
  size_t n = 0;
  for (std::string line; std::getline(in, line);) ++n;
  return n;
}

// Every key's chunk checksums from a checkpoint's manifest.
inline std::map<std::string, std::vector<std::string>> chunk_checksums(const fs::path& dir) {
  const nlohmann::json manifest = nlohmann::json::parse(read_text(dir / "manifest.json"));
  std::map<std::string, std::vector<std::string>> sums;
  for (const auto& [key, entry] : manifest.at("keys").items()) {
    for (const auto& chunk : entry.at("chunks")) sums[key].push_back(chunk.at("xxh3"));
  }
  return sums;
}

// Every plain file under `dir` with its content: proves a failed command changed nothing.
inline std::map<std::string, std::string> snapshot(const fs::path& dir) {
  std::map<std::string, std::string> files;
  std::error_code ec;
  if (!fs::exists(dir, ec)) return files;
  for (const auto& entry : fs::recursive_directory_iterator(dir, ec)) {
    if (entry.is_regular_file(ec))
      files[fs::relative(entry.path(), dir).string()] = read_text(entry.path());
  }
  return files;
}

// A committed checkpoint <root>/<name> whose data no longer verifies (a byte flipped after the
// commit), and no `latest`: a run in `root` starts afresh, and its first save warns that this
// checkpoint, newer than `latest`, does not verify (SaveResult::warnings).
inline void write_unverifiable_checkpoint(const fs::path& root, const std::string& name) {
  mixprec::ShardedStateDict state;
  state.tensors.emplace("x", mixprec::ShardedTensor::whole(at::arange(64, at::kFloat)));
  const mixprec::checkpoint::SaveResult saved = mixprec::checkpoint::save_checkpoint(
      root, name, state, mixprec::checkpoint::SaveOptions().update_latest(false));
  const fs::path data = saved.dir / "data-00000.safetensors";
  std::string bytes = read_text(data);
  bytes.back() = static_cast<char>(bytes.back() ^ 0x10);
  std::ofstream(data, std::ios::trunc | std::ios::binary) << bytes;
}

// A two-step run of the tiny model into `dir`/`out`, saving after each step (blocking, or with
// `out` == "async" in the background), whose checkpoint root already holds a checkpoint newer
// than any it will save that does not verify: each of its saves commits with a warning.
inline std::vector<std::string> run_whose_saves_warn(const fs::path& dir, const std::string& out) {
  write_unverifiable_checkpoint(dir / out / "checkpoints", "damaged");
  std::vector<std::string> flags =
      tiny_model() + std::vector<std::string>{"--data",       (dir / "corpus.txt").string(),
                                              "--out",        out,
                                              "--eval-every", "1000",
                                              "--steps",      "2",
                                              "--ckpt-every", "1"};
  if (out == "async") flags.push_back("--async-save");
  return flags;
}

// How often `what` occurs in `text`.
inline size_t occurrences(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Text that a byte-level model learns quickly: a few sentences repeated with variations.
inline void write_corpus(const fs::path& path, int repeats = 400) {
  std::ofstream out(path);
  const char* lines[] = {"the quick brown fox jumps over the lazy dog.\n",
                         "a mixture of experts routes every token to two experts.\n",
                         "norms and routers stay in fp32 while the rest is bf16.\n",
                         "checkpoints are written durably and resume bit for bit.\n"};
  for (int i = 0; i < repeats; ++i) out << lines[i % 4] << lines[(i * 7 + 1) % 4];
}

}  // namespace train::testing
