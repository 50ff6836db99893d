// Process-group initialisation: from torchrun's environment, from a store, from a backend the
// caller already has, or a single process with no launcher at all.
//
// torchrun --nproc-per-node N --no-python BINARY sets RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR and MASTER_PORT in every worker. Its agent already serves the TCPStore at
// MASTER_ADDR:MASTER_PORT and says so with TORCHELASTIC_USE_AGENT_STORE=True: then every rank
// connects as a client, under the key prefix "/worker/attempt_<TORCHELASTIC_RESTART_COUNT>"
// as torch.distributed does. Without the agent (a hand-written launcher), rank 0 serves the
// store. With neither RANK nor WORLD_SIZE set the program is one process (world size 1).
//
// Gloo types never appear here: the Gloo group is built inside src/distributed (the only code
// compiled with USE_C10D_GLOO) and handed out as a c10d::Backend.
#pragma once

#include "mixprec/distributed/communicator.h"

#include <c10/core/DeviceType.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace mixprec::distributed {

enum class BackendKind {
  kGloo,  // CPU tensors; always built
  // CUDA tensors; only in builds against a CUDA LibTorch (an error otherwise). NCCL takes one
  // GPU per rank: init_from_env binds each rank to the GPU of its LOCAL_RANK and makes it the
  // current device (as a PyTorch user's torch.cuda.set_device(local_rank) does); the other
  // init functions bind the current device.
  kNccl,
};

struct InitOptions {
  // Bounds the rendezvous (store connection, group formation) and every collective.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  BackendKind backend = BackendKind::kGloo;
  // A second group over the same ranks and store, apart from the first: collectives of two
  // groups never interleave, and each has its own timeout (e.g. "checkpoint": background
  // checkpoint saves beside the training collectives). Empty: the main group. Every rank
  // forms each group, in the same order; a named group's store client never serves.
  std::string group_name;
};

// The launcher's environment, checked.
struct LauncherEnv {
  bool launched = false;  // false: neither RANK nor WORLD_SIZE is set (one process)
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr;  // empty when not launched
  uint16_t master_port = 0;
  bool use_agent_store = false;  // TORCHELASTIC_USE_AGENT_STORE
  int64_t restart_count = 0;     // TORCHELASTIC_RESTART_COUNT
};

// Reads the variables through `lookup` (nullopt: not set) and checks that they agree:
// RANK and WORLD_SIZE both set or both unset; every number a plain decimal integer in range
// (WORLD_SIZE >= 1, 0 <= RANK < WORLD_SIZE, 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE when that is
// set, 1 <= MASTER_PORT <= 65535); MASTER_ADDR and MASTER_PORT set when launched;
// TORCHELASTIC_USE_AGENT_STORE one of True/False/true/false/1/0. Throws c10::Error
// "[mixprec::distributed::init] ..." naming the variable and its value otherwise.
LauncherEnv parse_launcher_env(
    const std::function<std::optional<std::string>(const std::string&)>& lookup);
// parse_launcher_env over the process environment.
LauncherEnv read_launcher_env();

// A group over every rank of the launcher's environment (see the header comment); a
// single-process group when not launched. Throws c10::Error naming the variable for a bad
// environment, or the address and rank when the group cannot form within the timeout.
std::shared_ptr<Communicator> init_from_env(const InitOptions& options = {});

// A group of `world_size` ranks that meet through `store` (every rank passes the same store
// contents, e.g. a TCPStore at one address, and its own rank).
std::shared_ptr<Communicator> init_with_store(const c10::intrusive_ptr<c10d::Store>& store,
                                              int rank, int world_size,
                                              const InitOptions& options = {});

// World size 1, no launcher and no network peer: an in-process store.
std::shared_ptr<Communicator> init_single_process(const InitOptions& options = {});

// Wraps a backend or process group the caller built (their own transport, their own store).
// `timeout` bounds our waits. For a ProcessGroup, the backend serving `device_type` is used.
std::shared_ptr<Communicator> from_backend(c10::intrusive_ptr<c10d::Backend> backend,
                                           std::chrono::milliseconds timeout);
std::shared_ptr<Communicator> from_process_group(
    const c10::intrusive_ptr<c10d::ProcessGroup>& group, c10::DeviceType device_type,
    std::chrono::milliseconds timeout);

// True when this build can create NCCL groups (it was compiled against a CUDA LibTorch).
bool nccl_available();

}  // namespace mixprec::distributed
