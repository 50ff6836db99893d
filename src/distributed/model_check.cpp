#include "mixprec/distributed/model_check.h"

#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <sstream>

namespace mixprec::distributed {

namespace {

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::string fqn_of(const std::string& line) { return line.substr(0, line.find(' ')); }

}  // namespace

std::string model_description(const torch::nn::Module& model) {
  std::ostringstream os;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    os << item.key() << ' ';
    if (!p.defined()) {
      os << "undefined\n";
      continue;
    }
    os << c10::toString(p.scalar_type()) << " [";
    for (int64_t d = 0; d < p.dim(); ++d) os << (d ? ", " : "") << p.size(d);
    os << "] " << (p.requires_grad() ? "trainable" : "frozen") << '\n';
  }
  return os.str();
}

void check_same_model(Communicator& comm, const torch::nn::Module& model) {
  const std::vector<std::string> all = comm.all_gather_strings(model_description(model));
  const std::vector<std::string> reference = lines_of(all[0]);
  for (int r = 1; r < comm.size(); ++r) {
    if (all[r] == all[0]) continue;
    const std::vector<std::string> other = lines_of(all[r]);
    size_t i = 0;
    while (i < reference.size() && i < other.size() && reference[i] == other[i]) ++i;
    const std::string fqn = fqn_of(i < reference.size() ? reference[i] : other[i]);
    const std::string mine = i < reference.size() ? "'" + reference[i] + "'" : "nothing";
    const std::string theirs = i < other.size() ? "'" + other[i] + "'" : "nothing";
    TORCH_CHECK(false, "[mixprec::distributed::check_same_model] the ranks hold different models: ",
                "first difference at parameter '", fqn, "' (position ", i, "): rank 0 has ", mine,
                ", rank ", r, " has ", theirs, " (rank 0 has ", reference.size(),
                " parameters, rank ", r, " has ", other.size(), ")");
  }
}

}  // namespace mixprec::distributed
