#include "data.h"

#include "config.h"
#include "pydoc_corpus.h"

#include "mixprec/checkpoint/format/checksum.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

namespace train {
namespace fs = std::filesystem;

namespace {

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError("cannot read data file " + path.string() + ": " + std::strerror(errno));
  std::ostringstream s;
  s << in.rdbuf();
  if (in.bad()) throw UsageError("cannot read data file " + path.string());
  return s.str();
}

std::string fingerprint(const Corpus& corpus) {
  const auto hash = [](const at::Tensor& bytes) {
    const auto* data = static_cast<const std::byte*>(bytes.const_data_ptr());
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx",
                  static_cast<unsigned long long>(
                      mixprec::checkpoint::xxh3_64({data, static_cast<size_t>(bytes.numel())})));
    return std::string(hex);
  };
  return std::to_string(corpus.train.numel()) + " + " + std::to_string(corpus.val.numel()) +
         " bytes, xxh3 " + hash(corpus.train) + "/" + hash(corpus.val);
}

// The validation tail of an n-byte text: the fraction's share, rounded down.
int64_t validation_bytes(int64_t n, double val_fraction) {
  return static_cast<int64_t>(static_cast<double>(n) * val_fraction);
}

// Whether an n-byte text splits into two parts of at least `need` bytes each.
bool splits_into(int64_t n, double val_fraction, int64_t need) {
  const int64_t n_val = validation_bytes(n, val_fraction);
  return n - n_val >= need && n_val >= need;
}

// The shortest text that does, for the error message. Both parts grow with n (the validation
// tail by at most one byte per byte), so a bisection finds it; need / min(f, 1 - f) bytes are
// enough, up to rounding.
int64_t smallest_that_splits(double val_fraction, int64_t need) {
  const double share = std::min(val_fraction, 1 - val_fraction);
  int64_t enough = static_cast<int64_t>(static_cast<double>(need) / share) + 2;
  while (!splits_into(enough, val_fraction, need)) enough *= 2;
  int64_t too_few = 2 * need - 1;  // each part holds need bytes at the least
  while (enough - too_few > 1) {
    const int64_t middle = too_few + (enough - too_few) / 2;
    (splits_into(middle, val_fraction, need) ? enough : too_few) = middle;
  }
  return enough;
}

}  // namespace

Corpus load_corpus(const std::string& path, double val_fraction, int64_t seq_len) {
  Corpus corpus;
  std::string bytes;
  if (path.empty()) {
    const fs::path topics = default_corpus_path();
    const std::string source = read_file(topics);
    bytes = decode_pydoc_topics(source);
    // Another Python's file layout we cannot decode is still text: train on it as it is.
    if (bytes.size() < source.size() / 2) bytes = source;
    corpus.source = topics.string();
  } else {
    std::error_code ec;
    if (!fs::exists(path, ec)) throw UsageError("data file " + path + " does not exist");
    if (fs::is_directory(path, ec)) throw UsageError("data file " + path + " is a directory");
    bytes = read_file(path);
    if (bytes.empty()) throw UsageError("data file " + path + " is empty");
    corpus.source = fs::absolute(path).lexically_normal().string();
  }
  const int64_t n = static_cast<int64_t>(bytes.size());
  const int64_t need = seq_len + 2;  // one sequence plus its shifted target, plus a start choice
  if (!splits_into(n, val_fraction, need)) {
    throw UsageError("data file " + corpus.source + " has " + std::to_string(n) +
                     " bytes; --seq-len " + std::to_string(seq_len) + " needs at least " +
                     std::to_string(smallest_that_splits(val_fraction, need)) +
                     " (each split must hold one sequence)");
  }
  const int64_t n_val = validation_bytes(n, val_fraction);
  at::Tensor all = at::empty({n}, at::kByte);
  std::memcpy(all.data_ptr(), bytes.data(), bytes.size());
  corpus.train = all.narrow(0, 0, n - n_val);
  corpus.val = all.narrow(0, n - n_val, n_val);
  corpus.fingerprint = fingerprint(corpus);
  return corpus;
}

BatchSampler::BatchSampler(at::Tensor tokens, int64_t seq_len, uint64_t seed, uint64_t stream)
    : tokens_(std::move(tokens)), seq_len_(seq_len), seed_(seed), stream_(stream) {}

Batch BatchSampler::batch(int64_t index, int64_t global_rows, int64_t row_begin,
                          int64_t rows) const {
  // One generator per batch, seeded from (seed, stream, index): splitmix-style mixing keeps
  // neighbouring indices' seeds unrelated.
  uint64_t z = seed_ * 0x9E3779B97F4A7C15ull + stream_ * 0xBF58476D1CE4E5B9ull +
               static_cast<uint64_t>(index) * 0x94D049BB133111EBull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  at::Generator gen = at::detail::createCPUGenerator(z);
  const int64_t max_start = tokens_.size(0) - seq_len_ - 1;
  const at::Tensor starts =
      at::randint(0, max_start + 1, {global_rows}, gen, at::kLong).narrow(0, row_begin, rows);
  const at::Tensor positions = starts.unsqueeze(1) + at::arange(seq_len_ + 1, at::kLong);
  const at::Tensor window = tokens_.index({positions}).to(at::kLong);
  return {window.narrow(1, 0, seq_len_).contiguous(), window.narrow(1, 1, seq_len_).contiguous()};
}

}  // namespace train
