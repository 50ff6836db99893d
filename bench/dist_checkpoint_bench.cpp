// Collective checkpoint benchmark: distributed::save_training_state and
// distributed::load_training_state of a ZeRO-1 training state, against raw writes and reads of the
// same bytes in the same run.
//
//   bench_dist_checkpoint        launcher mode: runs itself under torchrun, saving on
//                                N = 1, 2, 4 ranks and loading each checkpoint on M = 1, 2, 4
//                                (torchrun beside the project's Python, or --torchrun PATH)
//   torchrun ... bench_dist_checkpoint --save ROOT | --load ROOT     one launch's work
//
// Save on N: the bytes each rank writes (its data file) and the wall time of a save (max over
// ranks, median of kRepeats) against the same ranks writing as many bytes to plain files at the
// same moment (support/raw_write.h, the raw write bench_checkpoint uses: write(2), writeback
// started every 32 MiB as the library's writer does, fsync).
// Async save on N, against the sync save of the same state:
//   hidden      (the goal's figure) save_checkpoint_async, then a synthetic training step's
//               forward and backward on every rank (support/step_load.h: a fixed count of BF16
//               GEMMs on the rank's one intra-op thread, sized to last about as long as the
//               faster of two synchronous saves timed before the rounds), then wait_until_staged()
//               — where the next optimizer update may run. Training is blocked by wall(save + step
//               + wait_until_staged) − wall(the same step alone), slowest rank, the median of
//               the pairs' differences: the copy the step did not hide, and what the save in
//               flight (the copy, then the background writing, checksums and the ranks' agreement)
//               took from the step. With ranks x 1 thread filling the cores, nothing is left for
//               the background save but the step's cores. A difference of two walls, it is
//               printed with the range of the pairs' differences and of the step alone, and
//               flagged when that range is wider than the median (a goal met then may be met by
//               chance); the pair runs twice a round, once in each order (2 x kRepeats pairs, at
//               about three sync saves' time more per round than one pair).
//   worst case  the call and at once wait_until_staged() (the next update comes at once: the
//               whole copy), and the call alone.
//   background  the call until the commit, with nothing else running.
// The five (sync save, raw write, async worst case, step alone, step with an async save; the
// last two twice, as step alone, with a save, with a save, alone) take turns round by round, in
// reversed order every other round, so that the machine's drift favours none. Load on M (resharded
// when M != N): the bytes each rank reads, of its optimizer pieces (verified block by block; "used"
// is exactly its pieces) and of the model tensors and its RNG state (read whole), and the wall time
// of a load against a plain pread of as many bytes, alternating which goes first. Reads come from
// the page cache, for both. Against raw, ours is printed as a fraction of raw's throughput (raw
// time / ours, higher is better), as bench_checkpoint prints it. The root is under $TMPDIR; on this
// machine all ranks share one disk and two cores, so the ratios (the protocol's and checksums' cost
// over raw I/O) are what carries over.
#include "mixprec/checkpoint/async_save.h"
#include "mixprec/distributed/collective_checkpoint.h"
#include "mixprec/distributed/init.h"
#include "mixprec/precision/convert.h"
#include "mixprec/precision/keep_fp32.h"
#include "support/bench_paths.h"
#include "support/median.h"
#include "support/raw_write.h"
#include "support/remove_tree.h"
#include "support/step_load.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace {

using namespace mixprec;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr int64_t kWidth = 1024, kLayers = 6;
constexpr int kRepeats = 4;  // even: each order of the interleaved rounds runs as often

struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    at::manual_seed(3);
    for (int64_t i = 0; i < kLayers; ++i) {
      layers.push_back(
          register_module("fc" + std::to_string(i), torch::nn::Linear(kWidth, kWidth)));
      gates.push_back(
          register_parameter("gate" + std::to_string(i), keep_in_fp32(at::ones({kWidth}))));
    }
    convert_module_to_dtype_except_fp32_marked(*this, at::kBFloat16);
  }
  at::Tensor loss(const at::Tensor& x) {
    at::Tensor h = x.to(at::kBFloat16);
    for (int64_t i = 0; i < kLayers; ++i) {
      h = (at::tanh(layers[i](h)).to(at::kFloat) * gates[i]).to(at::kBFloat16);
    }
    return h.to(at::kFloat).pow(2).mean();
  }
  std::vector<torch::nn::Linear> layers;
  std::vector<at::Tensor> gates;
};
TORCH_MODULE(Mlp);

double max_over_ranks(distributed::Communicator& comm, double value) {
  at::Tensor t = at::tensor({value}, at::kDouble);
  comm.all_reduce_max(t).wait();
  return t.item<double>();
}

// Wall time of `fn` on every rank at once: barrier, run, max over ranks.
template <typename Fn>
double timed(distributed::Communicator& comm, Fn&& fn) {
  comm.barrier();
  const auto t0 = Clock::now();
  fn();
  return max_over_ranks(comm, std::chrono::duration<double>(Clock::now() - t0).count());
}

// The raw baseline's pieces: `bytes` of `buffer`, repeated (written by bench::raw_write).
std::vector<std::span<const char>> raw_pieces(uint64_t bytes, const std::vector<char>& buffer) {
  std::vector<std::span<const char>> pieces;
  for (uint64_t left = bytes; left > 0;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buffer.size(), left));
    pieces.emplace_back(buffer.data(), n);
    left -= n;
  }
  return pieces;
}

void raw_read(const fs::path& path, uint64_t bytes, std::vector<char>& buffer) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) std::abort();
  for (uint64_t done = 0; done < bytes;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buffer.size(), bytes - done));
    const ssize_t got = ::pread(fd, buffer.data(), n, static_cast<off_t>(done));
    if (got <= 0) std::abort();
    done += static_cast<uint64_t>(got);
  }
  ::close(fd);
}

std::string root_of(distributed::Communicator& comm, const std::string& given) {
  return comm.all_gather_strings(given)[0];
}

struct Setup {
  Mlp model;
  std::unique_ptr<distributed::GradReducer> reducer;
  std::unique_ptr<distributed::DistributedOptimizer> optimizer;
  explicit Setup(const std::shared_ptr<distributed::Communicator>& comm) {
    reducer = std::make_unique<distributed::GradReducer>(
        comm, *model,
        distributed::GradReducerOptions().mode(distributed::ReduceMode::kReduceScatter));
    optimizer = std::make_unique<distributed::DistributedOptimizer>(
        *reducer, *model, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
  }
};

// "a b c": every rank's value, in rank order (on rank 0).
std::string per_rank(distributed::Communicator& comm, uint64_t value) {
  std::string out;
  for (const std::string& v : comm.all_gather_strings(std::to_string(value))) {
    out += (out.empty() ? "" : " ") + v;
  }
  return out;
}

int save_worker(const std::string& given) {
  auto comm = distributed::init_from_env();
  const int rank = comm->rank(), n = comm->size();
  const fs::path root = root_of(*comm, given);
  Setup s(comm);
  s.reducer->zero_grad();
  at::manual_seed(7);
  s.model->loss(at::randn({8, kWidth})).backward();
  s.optimizer->update();

  // The background saves' collectives run on a group of their own, as mixprec-train
  // --async-save does.
  distributed::InitOptions group;
  group.group_name = "checkpoint";
  const std::shared_ptr<distributed::Communicator> checkpoint_comm =
      distributed::init_from_env(group);
  checkpoint::AsyncCheckpointSaver saver;
  saver.reserve(
      checkpoint::staging_bytes_for(distributed::training_state_dict(*s.model, *s.optimizer)));

  char file[48];
  std::snprintf(file, sizeof file, "data-%05d.safetensors", rank);
  uint64_t written = 0;
  auto sync_save = [&](const std::string& name) {
    const fs::path dir = distributed::save_training_state(root, name, *s.model, *s.optimizer, {},
                                                          checkpoint::SaveOptions().keep_last(1))
                             .dir;
    written = fs::file_size(dir / file);
  };
  // Two untimed sync saves: the warm-up (the first of a run also flushes whatever else was
  // dirty), and the faster one's length is what the synthetic step is sized to.
  double first_save = 0;
  for (int i = 0; i < 2; ++i) {
    const double seconds = timed(*comm, [&] { sync_save("warmup-" + std::to_string(i)); });
    first_save = i == 0 ? seconds : std::min(first_save, seconds);
  }
  comm->barrier();  // every rank times its products at once, as they will run
  const double per_gemm = max_over_ranks(*comm, bench::StepLoad::seconds_per_gemm());
  const bench::StepLoad step_load(bench::StepLoad::gemms_for(first_save, per_gemm));

  std::vector<char> buffer(size_t{64} << 20, 'x');
  const std::vector<std::span<const char>> pieces = raw_pieces(written, buffer);
  const fs::path raw = root / ("raw-" + std::to_string(rank));
  std::vector<double> save_s, write_s, in_call_s, blocked_s, async_s;
  // The step alone and with a save in flight run back to back in every round: the figure is the
  // median of the rounds' differences (a pair shares the machine's state of the moment).
  std::vector<double> step_alone_s, step_with_save_s;
  int round = 0;
  const std::function<void()> step_alone = [&] {
    step_alone_s.push_back(timed(*comm, [&] { step_load.run(); }));
  };
  // The next step's forward and backward run while the copy is made; its update waits.
  const std::function<void()> step_with_save = [&] {
    step_with_save_s.push_back(timed(*comm, [&] {
      (void)distributed::save_checkpoint_async(
          saver, checkpoint_comm, root,
          "hidden-" + std::to_string(round) + "-" + std::to_string(step_with_save_s.size()),
          distributed::training_state_dict(*s.model, *s.optimizer),
          checkpoint::SaveOptions().keep_last(1));
      step_load.run();
      saver.wait_until_staged();
    }));
    (void)saver.wait();  // the rest of the save overlaps later steps in a job: not counted
  };
  const std::vector<std::function<void()>> configurations = {
      [&] { save_s.push_back(timed(*comm, [&] { sync_save("step-" + std::to_string(round)); })); },
      [&] { write_s.push_back(timed(*comm, [&] { bench::raw_write(raw, pieces); })); },
      // The worst case: the call, then at once the wait for the copy (as if the next optimizer
      // update came at once), then the rest of the save with nothing else running.
      [&] {
        double in_call = 0, blocked = 0;
        async_s.push_back(timed(*comm, [&] {
          const auto t0 = Clock::now();
          (void)distributed::save_checkpoint_async(
              saver, checkpoint_comm, root, "async-" + std::to_string(round),
              distributed::training_state_dict(*s.model, *s.optimizer),
              checkpoint::SaveOptions().keep_last(1));
          in_call = std::chrono::duration<double>(Clock::now() - t0).count();
          saver.wait_until_staged();
          blocked = std::chrono::duration<double>(Clock::now() - t0).count();
          (void)saver.wait();
        }));
        in_call_s.push_back(max_over_ranks(*comm, in_call));
        blocked_s.push_back(max_over_ranks(*comm, blocked));
      },
      step_alone,
      step_with_save,
      // The pair again in the other order (the k-th of each pair up): the hidden figure is a
      // small difference of two walls and gets twice the rounds of the others.
      step_with_save,
      step_alone,
  };
  for (round = 0; round < kRepeats; ++round) {
    if (round % 2 == 0) {
      for (const auto& run : configurations) run();
    } else {
      for (auto it = configurations.rbegin(); it != configurations.rend(); ++it) (*it)();
    }
  }
  fs::remove(raw);
  const std::string all = per_rank(*comm, written);
  comm->barrier();
  if (rank == 0) {
    const double save = bench::median(save_s), write = bench::median(write_s);
    const double in_call = bench::median(in_call_s), worst = bench::median(blocked_s),
                 async = bench::median(async_s);
    std::vector<double> differences;
    for (size_t i = 0; i < step_alone_s.size(); ++i)
      differences.push_back(step_with_save_s[i] - step_alone_s[i]);
    const bench::Spread hidden = bench::spread(differences),
                        step_alone = bench::spread(step_alone_s);
    std::printf(
        "save on N=%d: bytes written per rank [%s]; save %.1f ms vs raw write+fsync %.1f ms: "
        "ours %.2f of raw's throughput (raw time / ours)\n"
        "  async on N=%d: training blocked %.1f ms (pairs %.1f to %.1f) = %.1f%% of the sync "
        "save (goal <= 10%%) behind a synthetic step (%lld BF16 GEMMs of %lld x %lld per rank, "
        "sized to one sync save; %.1f ms alone, %.1f to %.1f, = %.2f of the sync save): median "
        "over %zu interleaved pairs of (save + step + wait_until_staged) - (the step alone)%s\n"
        "    worst case, the next update at once (no compute: the whole copy): blocked %.1f ms "
        "= %.1f%% of the sync save (the call alone %.1f ms); whole background save %.1f ms: "
        "throughput %.2f of the sync save's (goal >= 0.8)\n",
        n, all.c_str(), save * 1e3, write * 1e3, write / save, n, hidden.median * 1e3,
        hidden.min * 1e3, hidden.max * 1e3, 100 * hidden.median / save,
        static_cast<long long>(step_load.gemms()), static_cast<long long>(bench::StepLoad::kSide),
        static_cast<long long>(bench::StepLoad::kSide), step_alone.median * 1e3,
        step_alone.min * 1e3, step_alone.max * 1e3, step_alone.median / save, differences.size(),
        hidden.wider_than_median()
            ? "\n    NOISY: the pairs' differences spread wider than their median; the figure "
              "(and the goal) is not to be trusted from this run"
            : "",
        worst * 1e3, 100 * worst / save, in_call * 1e3, async * 1e3, save / async);
    std::fflush(stdout);
  }
  return 0;
}

int load_worker(const std::string& given) {
  auto comm = distributed::init_from_env();
  const int rank = comm->rank(), m = comm->size();
  const fs::path root = root_of(*comm, given);
  std::vector<double> load_s, read_s;
  distributed::ResumeResult loaded;
  std::vector<char> buffer(size_t{64} << 20, 'x');
  auto load = [&] {
    Setup fresh(comm);
    load_s.push_back(timed(*comm, [&] {
      loaded = distributed::load_training_state(root, *fresh.model, *fresh.optimizer);
    }));
  };
  // As many bytes as the last load read, pread from the files this rank read (page cache, as
  // the load's were).
  auto read = [&] {
    uint64_t left = loaded.optimizer_reads.bytes_read + loaded.model_reads.bytes_read;
    read_s.push_back(timed(*comm, [&] {
      for (const auto& entry : fs::directory_iterator(loaded.dir)) {
        if (left == 0 || entry.path().extension() != ".safetensors") continue;
        const uint64_t take = std::min<uint64_t>(left, fs::file_size(entry.path()));
        raw_read(entry.path(), take, buffer);
        left -= take;
      }
    }));
  };
  // The raw read needs a load's byte counts: the first round loads first, then they alternate.
  for (int i = 0; i < kRepeats; ++i) {
    if (i % 2 == 0) {
      load();
      read();
    } else {
      read();
      load();
    }
  }
  const std::string opt_read = per_rank(*comm, loaded.optimizer_reads.bytes_read);
  const std::string opt_used = per_rank(*comm, loaded.optimizer_reads.bytes_used);
  const std::string model_read = per_rank(*comm, loaded.model_reads.bytes_read);
  comm->barrier();
  if (rank == 0) {
    const double load_ms = bench::median(load_s) * 1e3, read_ms = bench::median(read_s) * 1e3;
    std::printf(
        "  load on M=%d: optimizer bytes read per rank [%s] (used [%s]); model+RNG "
        "bytes read per rank [%s]; load %.1f ms vs raw read %.1f ms: ours %.2f of raw's "
        "throughput (raw time / ours)\n",
        m, opt_read.c_str(), opt_used.c_str(), model_read.c_str(), load_ms, read_ms,
        read_ms / load_ms);
    std::fflush(stdout);
  }
  return 0;
}

int launcher(const std::string& self, std::string torchrun) {
  if (torchrun.empty()) {
    torchrun = mixprec::bench::kTorchrun;
  }
  if (torchrun.empty()) {
    std::cerr << "bench_dist_checkpoint: pass --torchrun PATH, or run it under torchrun with "
                 "--save ROOT / --load ROOT\n";
    return 2;
  }
  std::cout << "bench_dist_checkpoint: collective save/load of a ZeRO-1 training state (" << kLayers
            << " x " << kWidth << " BF16 MLP with FP32 gates, AdamW) on Gloo; "
            << "N, M = 1, 2, 4 on this machine's cores and disk (compare ratios)\n";
  std::string templ = (fs::temp_directory_path() / "mixprec-bench-ckpt-XXXXXX").string();
  if (::mkdtemp(templ.data()) == nullptr) return 1;
  const fs::path base = templ;
  auto launch = [&](int ranks, const std::string& mode, const fs::path& root) {
    const std::string command = "OMP_NUM_THREADS=1 " + torchrun +
                                " --standalone --nproc-per-node " + std::to_string(ranks) +
                                " --no-python " + self + " " + mode + " " + root.string() +
                                " 2>/dev/null";
    std::cout.flush();
    const bool ok = std::system(command.c_str()) == 0;
    if (!ok) std::cerr << "bench_dist_checkpoint: failed: " << command << "\n";
    return ok;
  };
  bool ok = true;
  for (int n : {1, 2, 4}) {
    const fs::path root = base / ("n" + std::to_string(n));
    fs::create_directories(root);
    ok = ok && launch(n, "--save", root);
    for (int m : {1, 2, 4}) ok = ok && launch(m, "--load", root);
  }
  mixprec::testing::remove_tree(base);
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string torchrun;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--save") == 0 && i + 1 < argc) return save_worker(argv[i + 1]);
    if (std::strcmp(argv[i], "--load") == 0 && i + 1 < argc) return load_worker(argv[i + 1]);
    if (std::strcmp(argv[i], "--torchrun") == 0 && i + 1 < argc) torchrun = argv[++i];
  }
  return launcher(argv[0], torchrun);
}
