#include "mixprec/distributed/init.h"

#include "support/error_message.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <map>

namespace mixprec::distributed {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using testing::error_of;
using Env = std::map<std::string, std::string>;

LauncherEnv parse(const Env& env) {
  return parse_launcher_env([&env](const std::string& name) -> std::optional<std::string> {
    auto it = env.find(name);
    if (it == env.end()) return std::nullopt;
    return it->second;
  });
}

Env torchrun(int rank, int world) {
  return {{"RANK", std::to_string(rank)},
          {"WORLD_SIZE", std::to_string(world)},
          {"LOCAL_RANK", std::to_string(rank)},
          {"LOCAL_WORLD_SIZE", std::to_string(world)},
          {"MASTER_ADDR", "localhost"},
          {"MASTER_PORT", "29511"},
          {"TORCHELASTIC_USE_AGENT_STORE", "True"},
          {"TORCHELASTIC_RESTART_COUNT", "2"}};
}

TEST(LauncherEnv, NoLauncherIsOneProcess) {
  const LauncherEnv env = parse({{"MASTER_PORT", "1234"}});  // stray variables are not a launch
  EXPECT_FALSE(env.launched);
  EXPECT_EQ(env.world_size, 1);
  EXPECT_EQ(env.rank, 0);
}

TEST(LauncherEnv, ReadsTorchrunsVariables) {
  const LauncherEnv env = parse(torchrun(2, 3));
  EXPECT_TRUE(env.launched);
  EXPECT_EQ(env.rank, 2);
  EXPECT_EQ(env.world_size, 3);
  EXPECT_EQ(env.local_rank, 2);
  EXPECT_EQ(env.master_addr, "localhost");
  EXPECT_EQ(env.master_port, 29511);
  EXPECT_TRUE(env.use_agent_store);
  EXPECT_EQ(env.restart_count, 2);
  Env manual = torchrun(0, 2);
  manual.erase("TORCHELASTIC_USE_AGENT_STORE");  // a hand-written launcher: rank 0 serves
  EXPECT_FALSE(parse(manual).use_agent_store);
}

// Each contradiction is an error naming the variable (and value) at fault.
TEST(LauncherEnv, ContradictionsNameTheVariable) {
  auto with = [](Env env, const std::string& key, const std::string& value) {
    env[key] = value;
    return env;
  };
  auto without = [](Env env, const std::string& key) {
    env.erase(key);
    return env;
  };
  const Env good = torchrun(1, 2);
  const std::vector<std::pair<Env, std::string>> cases = {
      {with(good, "RANK", "2"), "RANK=2 must be less than WORLD_SIZE=2"},
      {with(good, "RANK", "abc"), "RANK='abc' is not a non-negative decimal integer"},
      {with(good, "RANK", "-1"), "RANK='-1'"},
      {with(good, "RANK", "1 "), "RANK='1 '"},
      {with(good, "WORLD_SIZE", "0"), "WORLD_SIZE=0 is out of range"},
      {with(good, "WORLD_SIZE", "2x"), "WORLD_SIZE='2x'"},
      {with(good, "WORLD_SIZE", ""), "WORLD_SIZE=''"},
      {without(good, "WORLD_SIZE"), "RANK is set but WORLD_SIZE is not"},
      {without(good, "RANK"), "WORLD_SIZE is set but RANK is not"},
      {without(good, "MASTER_PORT"), "MASTER_PORT is not set"},
      {without(good, "MASTER_ADDR"), "MASTER_ADDR is not set"},
      {with(good, "MASTER_PORT", "70000"), "MASTER_PORT=70000 is out of range"},
      {with(good, "MASTER_PORT", "0"), "MASTER_PORT=0 is out of range"},
      {with(good, "MASTER_PORT", "http"), "MASTER_PORT='http'"},
      {with(good, "LOCAL_RANK", "5"), "LOCAL_RANK=5 is out of range"},
      {with(with(good, "LOCAL_WORLD_SIZE", "1"), "LOCAL_RANK", "1"),
       "LOCAL_RANK=1 must be less than LOCAL_WORLD_SIZE=1"},
      {with(good, "TORCHELASTIC_USE_AGENT_STORE", "maybe"), "TORCHELASTIC_USE_AGENT_STORE='maybe'"},
      {Env{{"LOCAL_RANK", "0"}}, "LOCAL_RANK is set but RANK and WORLD_SIZE are not"},
  };
  for (const auto& [env, expected] : cases) {
    const std::string message = error_of([&] { parse(env); });
    EXPECT_NE(message.find(expected), std::string::npos)
        << "expected '" << expected << "' in: " << message;
  }
}

// World size 1 needs no launcher; the collectives still run (through Gloo, on one rank).
TEST(SingleProcess, CollectivesOnOneRank) {
  auto comm = init_single_process();
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  EXPECT_EQ(comm->backend_name(), "gloo");
  at::Tensor t = at::arange(7, at::kFloat).to(at::kBFloat16);
  const at::Tensor before = t.clone();
  comm->all_reduce_sum(t).wait();
  EXPECT_TRUE(at::equal(t, before));
  at::Tensor out = at::empty({7}, at::kBFloat16);
  comm->reduce_scatter_sum(t, out).wait();
  EXPECT_TRUE(at::equal(out, before));
  at::Tensor gathered = at::empty({7}, at::kBFloat16);
  comm->all_gather(t, gathered).wait();
  EXPECT_TRUE(at::equal(gathered, before));
  EXPECT_EQ(comm->all_gather_strings("hello"), std::vector<std::string>{"hello"});
  comm->barrier();
  EXPECT_EQ(comm->traffic(Collective::kAllGather).calls, 3);  // one, plus two for the strings
}

TEST(SingleProcess, BadArgumentsFailBeforeSending) {
  auto comm = init_single_process();
  const at::Tensor bf16 = at::zeros({4}, at::kBFloat16);
  EXPECT_NE(error_of([&] {
              comm->reduce_scatter_sum(bf16, at::zeros({3}, at::kBFloat16)).wait();
            }).find("input has 4 elements; it must have world size (1) x output (3)"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              comm->all_gather(bf16, at::zeros({4}, at::kFloat)).wait();
            }).find("input is BFloat16, output is Float"),
            std::string::npos);
  EXPECT_NE(
      error_of([&] { comm->all_reduce_sum(at::zeros({4}, at::kInt)).wait(); }).find("dtype Int"),
      std::string::npos);
  EXPECT_NE(error_of([&] {
              comm->all_reduce_sum(at::zeros({4, 4}).t()).wait();
            }).find("contiguous"),
            std::string::npos);
  const at::Tensor both = at::zeros({5}, at::kBFloat16);
  EXPECT_NE(error_of([&] {
              comm->all_gather(both.narrow(0, 1, 4), both.narrow(0, 0, 4)).wait();
            }).find("overlaps output other than as this rank's chunk"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              comm->reduce_scatter_sum(both.narrow(0, 0, 4), both.narrow(0, 1, 4)).wait();
            }).find("reduce_scatter_sum] output overlaps input other than as this rank's chunk"),
            std::string::npos);
  EXPECT_EQ(comm->traffic(Collective::kAllReduce).calls, 0);
  EXPECT_EQ(comm->traffic(Collective::kReduceScatter).calls, 0);
}

// A caller's own backend or process group plugs in unchanged.
TEST(SingleProcess, CallersBackendOrProcessGroup) {
  auto own = init_single_process();
  auto wrapped = from_backend(own->backend(), std::chrono::seconds(5));
  at::Tensor t = at::full({3}, 2.0);
  wrapped->all_reduce_sum(t).wait();
  EXPECT_TRUE(at::equal(t, at::full({3}, 2.0)));
  auto group =
      c10::make_intrusive<c10d::ProcessGroup>(c10::make_intrusive<c10d::HashStore>(), 0, 1);
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, own->backend());
  auto through_group = from_process_group(group, c10::DeviceType::CPU, std::chrono::seconds(5));
  EXPECT_EQ(through_group->backend().get(), own->backend().get());
  EXPECT_EQ(through_group->size(), 1);
  EXPECT_NE(error_of([] { from_backend({}, std::chrono::seconds(1)); }).find("backend is null"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              from_backend(own->backend(), std::chrono::milliseconds(0));
            }).find("timeout must be > 0"),
            std::string::npos);
}

TEST(SingleProcess, NcclIsRefusedClearlyWithoutCuda) {
  if (nccl_available()) GTEST_SKIP() << "built against a CUDA LibTorch";
  InitOptions options;
  options.backend = BackendKind::kNccl;
  EXPECT_NE(error_of([&] { init_single_process(options); }).find("no NCCL backend"),
            std::string::npos);
}

// Input and output of one reduce-scatter or all-gather on two devices: refused at the call,
// naming both devices, with the input untouched (a meta tensor stands for the second device).
TEST(SingleProcess, CollectiveWithInputAndOutputOnTwoDevicesIsRefused) {
  auto comm = init_single_process();
  const at::Tensor host = at::arange(4, at::kFloat);
  const at::Tensor elsewhere = at::empty({4}, at::TensorOptions(at::kFloat).device(at::kMeta));
  EXPECT_NE(error_of([&] {
              comm->reduce_scatter_sum(host, elsewhere).wait();
            }).find("[mixprec::distributed::reduce_scatter_sum] input is on cpu, output on meta"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              comm->all_gather(host, elsewhere).wait();
            }).find("[mixprec::distributed::all_gather] input is on cpu, output on meta"),
            std::string::npos);
  EXPECT_TRUE(at::equal(host, at::arange(4, at::kFloat)));
  EXPECT_FALSE(comm->failed());  // refused before anything was sent: the group goes on
  at::Tensor t = at::ones({2});
  comm->all_reduce_sum(t).wait();
}

// On a GPU machine (scripts/gpu-check.sh): a one-rank NCCL group runs every collective on
// device tensors, and on host tensors through a device copy (the library's agreements are host
// tensors). Skipped elsewhere. With one rank most collectives leave their data as it was; the
// outputs apart from their inputs start at -1, so those show that wait() copies results back
// to the host.
TEST(SingleProcess, NcclRunsEveryCollectiveOnDeviceAndHostTensors) {
  if (!nccl_available() || !torch::cuda::is_available())
    GTEST_SKIP() << "needs a CUDA LibTorch and a visible GPU";
  InitOptions options;
  options.backend = BackendKind::kNccl;
  options.timeout = std::chrono::seconds(60);
  auto comm = init_single_process(options);
  EXPECT_EQ(comm->backend_name(), "nccl");
  for (const c10::Device device : {c10::Device(at::kCUDA, 0), c10::Device(at::kCPU)}) {
    SCOPED_TRACE(device.str());
    const auto on = at::TensorOptions(at::kFloat).device(device);
    at::Tensor t = at::arange(6, on);
    comm->all_reduce_sum(t).wait();
    comm->all_reduce_max(t).wait();
    EXPECT_TRUE(at::equal(t.cpu(), at::arange(6, at::kFloat)));
    at::Tensor out = at::full({6}, -1.0, on);
    comm->reduce_scatter_sum(t, out).wait();
    EXPECT_TRUE(at::equal(out.cpu(), at::arange(6, at::kFloat)));
    at::Tensor gathered = at::full({6}, -1.0, on);
    comm->all_gather(t, gathered).wait();
    EXPECT_TRUE(at::equal(gathered.cpu(), at::arange(6, at::kFloat)));
    comm->all_gather(gathered, gathered).wait();  // in place: the input is this rank's chunk
    EXPECT_TRUE(at::equal(gathered.cpu(), at::arange(6, at::kFloat)));
    at::Tensor ids = at::arange(4, at::TensorOptions(at::kLong).device(device));
    comm->broadcast(ids, 0).wait();
    EXPECT_TRUE(at::equal(ids.cpu(), at::arange(4, at::kLong)));
    EXPECT_TRUE(t.device() == device && ids.device() == device);
  }
  EXPECT_EQ(comm->all_gather_strings("rank zero"), std::vector<std::string>{"rank zero"});
  comm->barrier();
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::distributed
