// The training data: bytes of text, a train/validation split, and deterministic batches.
//
// Tokens are bytes (vocabulary 256): no tokenizer to build or ship, any text file works.
// The default corpus is the English text of Python's documentation topics (pydoc_corpus.h),
// which every machine that ran the project's set-up has.
//
// Batches are drawn by index: batch i is a pure function of (seed, split, i), so a run that
// resumes at step s draws exactly the batches the uninterrupted run would have drawn, with no
// sampler state to save beyond the step counter.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <string>

namespace train {

struct Corpus {
  std::string source;  // the file it came from, for messages and the summary
  at::Tensor train;    // uint8, the first (1 - val_fraction) of the bytes
  at::Tensor val;      // uint8, the rest
  // "419646 + 46627 bytes, xxh3 9e3c…/41d0…": what a resumed run compares to be sure it trains
  // on the text it started with.
  std::string fingerprint;
};

// Reads `path` ("" for the default corpus) and splits it. Throws UsageError naming the file if
// it is missing, unreadable, empty, or too short for `seq_len` + 2 bytes in each split (a
// sequence, its shifted target, and a second start to draw).
Corpus load_corpus(const std::string& path, double val_fraction, int64_t seq_len);

struct Batch {
  at::Tensor inputs;   // int64 [rows, seq_len]
  at::Tensor targets;  // int64 [rows, seq_len], the inputs shifted by one byte
};

class BatchSampler {
 public:
  // `stream` separates independent sequences of batches (training vs. validation).
  BatchSampler(at::Tensor tokens, int64_t seq_len, uint64_t seed, uint64_t stream);

  // Rows [row_begin, row_begin + rows) of global batch `index` of `global_rows` sequences,
  // each starting at a uniformly drawn offset. A data-parallel rank or a micro-batch asks for
  // its own rows of the same global batch.
  Batch batch(int64_t index, int64_t global_rows, int64_t row_begin, int64_t rows) const;

 private:
  at::Tensor tokens_;
  int64_t seq_len_;
  uint64_t seed_;
  uint64_t stream_;
};

}  // namespace train
