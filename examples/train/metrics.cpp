#include "metrics.h"

#include "config.h"

#include <cmath>
#include <cstdio>
#include <cstring>

namespace train {
namespace fs = std::filesystem;

namespace {
nlohmann::json finite_or_null(double v) { return std::isfinite(v) ? nlohmann::json(v) : nullptr; }
double number_or_nan(const nlohmann::json& j) {
  return j.is_null() ? std::nan("") : j.get<double>();
}
}  // namespace

nlohmann::json StepRecord::to_json() const {
  return {{"step", step},
          {"loss", finite_or_null(loss)},
          {"aux_loss", finite_or_null(aux_loss)},
          {"val_loss", val_loss ? finite_or_null(*val_loss) : nullptr},
          {"lr", lr},
          {"grad_norm", finite_or_null(grad_norm)},
          {"loss_scale", loss_scale},
          {"skipped", skipped},
          {"skipped_total", skipped_total},
          {"tokens", tokens},
          {"tokens_per_s", finite_or_null(tokens_per_s)},
          {"step_s", step_s},
          {"elapsed_s", elapsed_s},
          {"forward_s", phases.forward_s},
          {"backward_s", phases.backward_s},
          {"reduce_s", phases.reduce_s},
          {"optimizer_s", phases.optimizer_s},
          {"checkpoint_s", phases.checkpoint_s},
          {"other_s", phases.other_s},
          {"page_faults", page_faults}};
}

StepRecord StepRecord::from_json(const nlohmann::json& j) {
  StepRecord r;
  r.step = j.at("step").get<int64_t>();
  r.loss = number_or_nan(j.at("loss"));
  r.aux_loss = number_or_nan(j.at("aux_loss"));
  if (!j.at("val_loss").is_null()) r.val_loss = j.at("val_loss").get<double>();
  r.lr = j.at("lr").get<double>();
  r.grad_norm = number_or_nan(j.at("grad_norm"));
  r.loss_scale = j.at("loss_scale").get<double>();
  r.skipped = j.at("skipped").get<bool>();
  r.skipped_total = j.at("skipped_total").get<int64_t>();
  r.tokens = j.at("tokens").get<int64_t>();
  r.tokens_per_s = number_or_nan(j.at("tokens_per_s"));
  r.step_s = j.at("step_s").get<double>();
  r.elapsed_s = j.at("elapsed_s").get<double>();
  // The phases were added later: an older run's records have none.
  const auto phase = [&](const char* name) { return j.value(name, 0.0); };
  r.phases = {phase("forward_s"),   phase("backward_s"),   phase("reduce_s"),
              phase("optimizer_s"), phase("checkpoint_s"), phase("other_s")};
  r.page_faults = j.value("page_faults", int64_t{0});  // added later still
  return r;
}

MetricsLog::MetricsLog(fs::path path, std::optional<int64_t> resume_step) : path_(std::move(path)) {
  std::error_code ec;
  if (path_.has_parent_path()) fs::create_directories(path_.parent_path(), ec);
  if (resume_step) {
    // Keep what the earlier run logged up to the checkpoint; anything unreadable is dropped
    // (a line cut short by a crash cannot be trusted).
    std::ifstream in(path_);
    for (std::string line; std::getline(in, line);) {
      try {
        StepRecord r = StepRecord::from_json(nlohmann::json::parse(line));
        if (r.step <= *resume_step && (history_.empty() || r.step > history_.back().step)) {
          history_.push_back(r);
        }
      } catch (const nlohmann::json::exception&) {
      }
    }
    const fs::path tmp = path_.string() + ".tmp";
    {
      std::ofstream rewrite(tmp, std::ios::trunc);
      for (const StepRecord& r : history_) rewrite << r.to_json().dump() << '\n';
      if (!rewrite.flush()) {
        throw UsageError("cannot write metrics file " + tmp.string() + ": " + std::strerror(errno));
      }
    }
    fs::rename(tmp, path_, ec);
    if (ec) throw UsageError("cannot replace metrics file " + path_.string() + ": " + ec.message());
  }
  out_.open(path_, resume_step ? std::ios::app : std::ios::trunc);
  if (!out_) {
    throw UsageError("cannot write metrics file " + path_.string() + ": " + std::strerror(errno));
  }
}

void MetricsLog::write(const StepRecord& record) {
  if (!problem_.empty()) return;  // the file is cut short already: no record after the gap
  out_ << record.to_json().dump() << '\n';
  out_.flush();
  if (!out_) {
    // Training goes on (the checkpoints are what a run cannot lose), but not silently.
    problem_ = "cannot write " + path_.string() + " (" + std::strerror(errno) +
               "): its records end before step " + std::to_string(record.step);
    std::fprintf(stderr, "mixprec-train: warning: metrics file %s; training goes on\n",
                 problem_.c_str());
  }
}

}  // namespace train
