#include "mixprec/distributed/model_check.h"

#include "mixprec/checkpoint/format/checksum.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <map>
#include <sstream>
#include <unordered_map>

namespace mixprec::distributed {

namespace {

constexpr const char* kWho =
    "[mixprec::distributed::check_same_model] the ranks hold different "
    "models: ";

// What a rank's own checks (GradReducer: dense and contiguous, one device type) depend on is
// described too: a rank that differs there would otherwise fail alone, after this collective,
// while the others wait for it in the next one. The device's index is not: each rank has its
// own GPU.
void describe_tensor(std::ostringstream& os, const at::Tensor& t) {
  os << c10::toString(t.scalar_type()) << " [";
  for (int64_t d = 0; d < t.dim(); ++d) os << (d ? ", " : "") << t.size(d);
  os << "]";
  if (t.layout() != at::kStrided) {
    os << ' ' << t.layout();
  } else if (!t.is_contiguous()) {
    os << " non-contiguous";
  }
  if (!t.is_cpu()) os << " on " << c10::DeviceTypeName(t.device().type(), /*lower_case=*/true);
}

// A description line's entry name: "<fqn>" for a parameter, "buffer <fqn>" for a buffer.
std::string entry_name(const std::string& line) {
  const size_t first = line.find(' ');
  if (line.starts_with("buffer ")) return line.substr(0, line.find(' ', first + 1));
  return line.substr(0, first);
}

struct Entries {
  std::vector<std::string> names;              // in order
  std::map<std::string, std::string> line_of;  // name → whole line
};

Entries entries_of(const std::string& text) {
  Entries out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    const std::string name = entry_name(line);
    out.names.push_back(name);
    out.line_of.emplace(name, line);
  }
  return out;
}

std::string quoted_list(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < 5; ++i) out += (i ? ", '" : "'") + names[i] + "'";
  if (names.size() > 5) out += " and " + std::to_string(names.size() - 5) + " more";
  return out;
}

// Why rank `r`'s model differs from rank 0's, naming what differs.
std::string difference(const Entries& zero, const Entries& other, int r) {
  std::vector<std::string> only_zero, only_other;
  for (const std::string& name : zero.names) {
    if (!other.line_of.count(name)) only_zero.push_back(name);
  }
  for (const std::string& name : other.names) {
    if (!zero.line_of.count(name)) only_other.push_back(name);
  }
  if (!only_zero.empty() || !only_other.empty()) {
    std::string message;
    if (!only_zero.empty()) message += quoted_list(only_zero) + " only on rank 0";
    if (!only_other.empty()) {
      message += (message.empty() ? "" : "; ") + quoted_list(only_other) + " only on rank " +
                 std::to_string(r);
    }
    return message;
  }
  for (const std::string& name : zero.names) {
    const std::string& mine = zero.line_of.at(name);
    const std::string& theirs = other.line_of.at(name);
    if (mine != theirs) {
      return "'" + name + "' differs: rank 0 has '" + mine + "', rank " + std::to_string(r) +
             " has '" + theirs + "'";
    }
  }
  for (size_t i = 0; i < zero.names.size(); ++i) {
    if (zero.names[i] != other.names[i]) {
      return "the same tensors registered in another order: position " + std::to_string(i) +
             " is '" + zero.names[i] + "' on rank 0, '" + other.names[i] + "' on rank " +
             std::to_string(r);
    }
  }
  return "the descriptions differ";  // unreachable: equal entries in equal order
}

}  // namespace

std::string model_description(const torch::nn::Module& model) {
  std::ostringstream os;
  std::unordered_map<const c10::TensorImpl*, std::string> first_name;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    os << item.key() << ' ';
    if (!p.defined()) {
      os << "undefined\n";
      continue;
    }
    describe_tensor(os, p);
    os << ' ' << (p.requires_grad() ? "trainable" : "frozen");
    auto [it, first] = first_name.emplace(p.unsafeGetTensorImpl(), item.key());
    if (!first) os << " tied to '" << it->second << "'";
    os << '\n';
  }
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    os << "buffer " << item.key() << ' ';
    if (item.value().defined()) {
      describe_tensor(os, item.value());
    } else {
      os << "undefined";
    }
    os << '\n';
  }
  return os.str();
}

void check_same_model(Communicator& comm, const torch::nn::Module& model) {
  const std::vector<std::string> all = comm.all_gather_strings(model_description(model));
  for (int r = 1; r < comm.size(); ++r) {
    if (all[r] == all[0]) continue;
    TORCH_CHECK(false, kWho, difference(entries_of(all[0]), entries_of(all[r]), r));
  }
}

void check_same_values(Communicator& comm, const torch::nn::Module& model) {
  // One line per tensor: its name and the digest of its bytes, in rank 0's order (the
  // descriptions match, so every rank lists the same names in the same order).
  std::vector<std::string> names;
  std::string mine;
  auto add = [&](const std::string& name, const at::Tensor& t) {
    uint64_t digest = 0;
    if (t.defined() && t.numel() > 0) {
      const at::Tensor dense = t.detach().contiguous().cpu();
      digest = checkpoint::xxh3_64(
          {static_cast<const std::byte*>(dense.const_data_ptr()), dense.nbytes()});
    }
    names.push_back(name);
    mine += checkpoint::checksum_to_hex(digest) + "\n";
  };
  for (const auto& item : model.named_parameters(/*recurse=*/true)) add(item.key(), item.value());
  for (const auto& item : model.named_buffers(/*recurse=*/true)) {
    add("buffer " + item.key(), item.value());
  }
  const std::vector<std::string> all = comm.all_gather_strings(mine);
  constexpr size_t kLine = 17;  // 16 hex digits and a newline
  for (int r = 1; r < comm.size(); ++r) {
    if (all[r] == all[0]) continue;
    size_t i = 0;
    while (i < names.size() && all[r].compare(i * kLine, kLine, all[0], i * kLine, kLine) == 0) {
      ++i;
    }
    TORCH_CHECK(false,
                "[mixprec::distributed::check_same_values] the ranks start from different "
                "weights: '",
                i < names.size() ? names[i] : "?", "' holds other values on rank ", r,
                " than on rank 0 (seed every rank alike, load the same weights everywhere, or "
                "leave GradReducerOptions::broadcast_from_rank0 on)");
  }
}

}  // namespace mixprec::distributed
