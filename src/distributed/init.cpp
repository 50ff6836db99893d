#include "mixprec/distributed/init.h"

#include "distributed/backend_factory.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <charconv>
#include <cstdlib>
#include <limits>

namespace mixprec::distributed {

namespace {

using Lookup = std::function<std::optional<std::string>(const std::string&)>;

// A plain decimal integer in [lo, hi]: no sign, no spaces, no trailing characters.
int64_t parse_integer(const Lookup& lookup, const std::string& name, int64_t lo, int64_t hi) {
  const std::optional<std::string> value = lookup(name);
  TORCH_INTERNAL_ASSERT(value.has_value());
  int64_t parsed = 0;
  const char* begin = value->data();
  const char* end = begin + value->size();
  auto [ptr, ec] = std::from_chars(begin, end, parsed);
  TORCH_CHECK(!value->empty() && ec == std::errc() && ptr == end && (*value)[0] != '-',
              "[mixprec::distributed::init] ", name, "='", *value,
              "' is not a non-negative decimal integer");
  TORCH_CHECK(parsed >= lo && parsed <= hi, "[mixprec::distributed::init] ", name, "=", parsed,
              " is out of range [", lo, ", ", hi, "]");
  return parsed;
}

bool parse_bool(const std::string& name, const std::string& value) {
  if (value == "True" || value == "true" || value == "1") return true;
  if (value == "False" || value == "false" || value == "0") return false;
  TORCH_CHECK(false, "[mixprec::distributed::init] ", name, "='", value,
              "' is not a boolean (True/False/true/false/1/0)");
}

// NCCL's one GPU per rank: `local_rank`'s (< 0: the current device) becomes the current
// device and the backend's bound device, which the communicator stages host tensors through.
// Reached through c10's device registry, so this file compiles without CUDA.
void bind_cuda_device(c10d::Backend& backend, int local_rank) {
  const c10::impl::DeviceGuardImplInterface* cuda =
      c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  const int devices = cuda->deviceCount();
  TORCH_CHECK(devices > 0, "[mixprec::distributed::init] NCCL needs a GPU; this process sees none");
  const c10::Device device =
      local_rank < 0
          ? cuda->getDevice()
          : c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(local_rank));
  TORCH_CHECK(local_rank < devices, "[mixprec::distributed::init] LOCAL_RANK=", local_rank,
              " has no GPU of its own: this process sees ", devices,
              " CUDA device(s), and NCCL takes one GPU per rank of a node");
  cuda->setDevice(device);
  backend.setBoundDeviceId(device);
}

std::shared_ptr<Communicator> make_group(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                         int world_size, const InitOptions& options,
                                         const std::string& where, int local_rank = -1) {
  TORCH_CHECK(world_size >= 1 && rank >= 0 && rank < world_size,
              "[mixprec::distributed::init] rank ", rank, " is not in [0, ", world_size, ")");
  TORCH_CHECK(options.timeout.count() > 0, "[mixprec::distributed::init] timeout must be > 0 ms");
  c10::intrusive_ptr<c10d::Backend> backend;
  try {
    backend = options.backend == BackendKind::kNccl
                  ? detail::make_nccl_backend(store, rank, world_size, options.timeout)
                  : detail::make_gloo_backend(store, rank, world_size, options.timeout);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "[mixprec::distributed::init] rank ", rank, " of ", world_size,
                " could not form the group", where, " within ", options.timeout.count(),
                " ms: ", e.what_without_backtrace());
  }
  if (options.backend == BackendKind::kNccl) bind_cuda_device(*backend, local_rank);
  return std::make_shared<Communicator>(std::move(backend), options.timeout);
}

}  // namespace

LauncherEnv parse_launcher_env(const Lookup& lookup) {
  LauncherEnv env;
  const bool has_rank = lookup("RANK").has_value();
  const bool has_world = lookup("WORLD_SIZE").has_value();
  if (!has_rank && !has_world) {
    TORCH_CHECK(!lookup("LOCAL_RANK").has_value(),
                "[mixprec::distributed::init] LOCAL_RANK is set but RANK and WORLD_SIZE are not");
    return env;
  }
  TORCH_CHECK(has_rank, "[mixprec::distributed::init] WORLD_SIZE is set but RANK is not");
  TORCH_CHECK(has_world, "[mixprec::distributed::init] RANK is set but WORLD_SIZE is not");
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  env.launched = true;
  env.world_size = static_cast<int>(parse_integer(lookup, "WORLD_SIZE", 1, kIntMax));
  env.rank = static_cast<int>(parse_integer(lookup, "RANK", 0, kIntMax));
  TORCH_CHECK(env.rank < env.world_size, "[mixprec::distributed::init] RANK=", env.rank,
              " must be less than WORLD_SIZE=", env.world_size);
  env.local_rank = env.rank;
  if (lookup("LOCAL_RANK")) {
    env.local_rank = static_cast<int>(parse_integer(lookup, "LOCAL_RANK", 0, env.world_size - 1));
    if (lookup("LOCAL_WORLD_SIZE")) {
      const int64_t local_world = parse_integer(lookup, "LOCAL_WORLD_SIZE", 1, env.world_size);
      TORCH_CHECK(env.local_rank < local_world,
                  "[mixprec::distributed::init] LOCAL_RANK=", env.local_rank,
                  " must be less than LOCAL_WORLD_SIZE=", local_world);
    }
  }
  const std::optional<std::string> addr = lookup("MASTER_ADDR");
  TORCH_CHECK(addr.has_value() && !addr->empty(),
              "[mixprec::distributed::init] MASTER_ADDR is not set (RANK and WORLD_SIZE are)");
  env.master_addr = *addr;
  TORCH_CHECK(lookup("MASTER_PORT").has_value(),
              "[mixprec::distributed::init] MASTER_PORT is not set (RANK and WORLD_SIZE are)");
  env.master_port = static_cast<uint16_t>(parse_integer(lookup, "MASTER_PORT", 1, 65535));
  if (auto agent = lookup("TORCHELASTIC_USE_AGENT_STORE")) {
    env.use_agent_store = parse_bool("TORCHELASTIC_USE_AGENT_STORE", *agent);
  }
  if (lookup("TORCHELASTIC_RESTART_COUNT")) {
    env.restart_count = parse_integer(lookup, "TORCHELASTIC_RESTART_COUNT", 0, kIntMax);
  }
  return env;
}

LauncherEnv read_launcher_env() {
  return parse_launcher_env([](const std::string& name) -> std::optional<std::string> {
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  });
}

std::shared_ptr<Communicator> init_from_env(const InitOptions& options) {
  const LauncherEnv env = read_launcher_env();
  if (!env.launched) return init_single_process(options);
  const std::string where = " at " + env.master_addr + ":" + std::to_string(env.master_port);
  c10::intrusive_ptr<c10d::Store> store;
  try {
    c10d::TCPStoreOptions tcp;
    tcp.port = env.master_port;
    // Without torchrun's agent rank 0 serves the store, once: for the main group.
    tcp.isServer = !env.use_agent_store && env.rank == 0 && options.group_name.empty();
    tcp.numWorkers = env.world_size;
    tcp.waitWorkers = false;  // the group's rendezvous below waits for every rank, with a timeout
    tcp.timeout = options.timeout;
    store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, tcp);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "[mixprec::distributed::init] rank ", env.rank, " could not reach the store",
                where, " within ", options.timeout.count(), " ms: ", e.what_without_backtrace());
  }
  // torch.distributed's prefix under torchrun's agent store, so keys of an earlier attempt
  // (an elastic restart) never meet this one's.
  std::string prefix = env.use_agent_store ? "/worker/attempt_" + std::to_string(env.restart_count)
                                           : std::string("mixprec");
  if (!options.group_name.empty()) prefix += "/mixprec-group/" + options.group_name;
  return make_group(c10::make_intrusive<c10d::PrefixStore>(prefix, store), env.rank, env.world_size,
                    options, where, env.local_rank);
}

std::shared_ptr<Communicator> init_with_store(const c10::intrusive_ptr<c10d::Store>& store,
                                              int rank, int world_size,
                                              const InitOptions& options) {
  TORCH_CHECK(store, "[mixprec::distributed::init_with_store] the store is null");
  if (options.group_name.empty()) return make_group(store, rank, world_size, options, "");
  return make_group(
      c10::make_intrusive<c10d::PrefixStore>("mixprec-group/" + options.group_name, store), rank,
      world_size, options, "");
}

std::shared_ptr<Communicator> init_single_process(const InitOptions& options) {
  return make_group(c10::make_intrusive<c10d::HashStore>(), 0, 1, options, " (single process)");
}

std::shared_ptr<Communicator> from_backend(c10::intrusive_ptr<c10d::Backend> backend,
                                           std::chrono::milliseconds timeout) {
  return std::make_shared<Communicator>(std::move(backend), timeout);
}

std::shared_ptr<Communicator> from_process_group(
    const c10::intrusive_ptr<c10d::ProcessGroup>& group, c10::DeviceType device_type,
    std::chrono::milliseconds timeout) {
  TORCH_CHECK(group, "[mixprec::distributed::from_process_group] the process group is null");
  return from_backend(group->getBackend(device_type), timeout);
}

bool nccl_available() { return detail::nccl_compiled(); }

}  // namespace mixprec::distributed
