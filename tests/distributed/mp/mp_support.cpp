#include "distributed/mp/mp_support.h"

#include "mixprec/distributed/init.h"
#include "optim/support_optim.h"

#include <c10/util/Exception.h>
#include <limits>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace mixprec::testing {

namespace {
std::shared_ptr<distributed::Communicator>& world_slot() {
  static std::shared_ptr<distributed::Communicator> world;
  return world;
}
}  // namespace

void set_world(std::shared_ptr<distributed::Communicator> comm) { world_slot() = std::move(comm); }
distributed::Communicator& world() { return *world_slot(); }
std::shared_ptr<distributed::Communicator> world_ptr() { return world_slot(); }

c10::Device test_device() {
  if (world().backend_name() != "nccl") return c10::Device(c10::DeviceType::CPU);
  const std::optional<at::Device> bound = world().backend()->getBoundDeviceId();
  TORCH_INTERNAL_ASSERT(bound.has_value(), "init binds an NCCL group to its GPU");
  return *bound;
}

c10::intrusive_ptr<c10d::Store> test_store(const std::string& prefix,
                                           std::chrono::milliseconds timeout) {
  const distributed::LauncherEnv env = distributed::read_launcher_env();
  TORCH_CHECK(env.launched && env.use_agent_store, "test_store needs torchrun's agent store");
  c10d::TCPStoreOptions options;
  options.port = env.master_port;
  options.isServer = false;
  options.timeout = timeout;
  auto store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, options);
  return c10::make_intrusive<c10d::PrefixStore>("mixprec-test/" + prefix, store);
}

std::shared_ptr<distributed::Communicator> own_group(const std::string& name,
                                                     std::chrono::milliseconds timeout) {
  distributed::InitOptions options;
  options.timeout = timeout;
  // The store's own waits (rendezvous) get at least its default, whatever the collectives get.
  return distributed::init_with_store(
      test_store(name, std::max(timeout, std::chrono::milliseconds(std::chrono::seconds(10)))),
      world().rank(), world().size(), options);
}

bool equal_or_close(const at::Tensor& a, const at::Tensor& b, bool bitwise) {
  if (bitwise) return bitwise_equal(a, b);
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const double rtol = a.scalar_type() == at::kFloat ? 1e-5 : 2e-2;
  return at::allclose(a.cpu().to(at::kFloat), b.cpu().to(at::kFloat), rtol, 1e-6);
}

bool same_on_all_ranks(const at::Tensor& t) {
  const at::Tensor bytes = t.cpu().contiguous().view(at::kByte).view({-1});
  std::string description = std::string(c10::toString(t.scalar_type())) + " [";
  for (int64_t d : t.sizes()) description += std::to_string(d) + ",";
  description += "] ";
  description.append(reinterpret_cast<const char*>(bytes.const_data_ptr<uint8_t>()), bytes.numel());
  const auto all = world().all_gather_strings(description);
  for (const auto& s : all) {
    if (s != all[0]) return false;
  }
  return true;
}

MixedNetImpl::MixedNetImpl(at::ScalarType half, uint64_t seed) : half(half) {
  at::manual_seed(seed);
  using torch::nn::Linear;
  using torch::nn::LinearOptions;
  fc1 = register_module("fc1", Linear(LinearOptions(13, 16)));
  gate = register_parameter("gate", keep_in_fp32(at::randn({16})));
  fc2 = register_module("fc2", Linear(LinearOptions(16, 7)));
  frozen = register_module("frozen", Linear(LinearOptions(7, 7)));
  for (auto& p : frozen->parameters()) p.set_requires_grad(false);
  head = register_module("head", Linear(LinearOptions(7, 5)));
  scale = register_parameter("scale", keep_in_fp32(at::rand({5}) + 0.5));
  convert_module_to_dtype_except_fp32_marked(*this, half);
  to(test_device());
}

at::Tensor MixedNetImpl::loss(const at::Tensor& x) {
  at::Tensor h = at::tanh(fc1(x.to(half))).to(at::kFloat) * gate;
  h = frozen(fc2(h.to(half)));
  h = head(at::tanh(h)).to(at::kFloat) * scale;
  return (h - 0.25).pow(2).mean();
}

at::Tensor batch(int64_t step, int rank) {
  at::manual_seed(1000 + step * 17 + (rank >= 0 ? 7919 * (rank + 1) : 0));
  return at::randn({6, 13}).to(test_device());
}

at::Tensor gather_pieces(const at::Tensor& local, int64_t begin, int64_t end) {
  distributed::Communicator& comm = world();
  const int n = comm.size();
  const at::Tensor values = local.to(at::kFloat).cpu().contiguous().view({-1});
  const int64_t numel = values.numel();
  at::Tensor all = at::empty({numel * n}, at::kFloat);
  comm.all_gather(values, all).wait();
  at::Tensor range = at::tensor({begin, end}, at::kLong);
  at::Tensor ranges = at::empty({2 * n}, at::kLong);
  comm.all_gather(range, ranges).wait();
  at::Tensor out = at::full({numel}, std::numeric_limits<float>::quiet_NaN());
  at::Tensor owners = at::zeros({numel}, at::kLong);
  for (int r = 0; r < n; ++r) {
    const int64_t b = ranges[2 * r].item<int64_t>(), e = ranges[2 * r + 1].item<int64_t>();
    if (b >= e) continue;
    out.narrow(0, b, e - b).copy_(all.narrow(0, r * numel + b, e - b));
    owners.narrow(0, b, e - b).add_(1);
  }
  // An element owned twice or never is a layout bug: poison it so comparisons fail.
  out.masked_fill_(owners.ne(1), std::numeric_limits<float>::quiet_NaN());
  return out.view(local.sizes());
}

}  // namespace mixprec::testing
