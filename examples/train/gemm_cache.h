// ideep's cache of oneDNN GEMM descriptors, and why mixprec-train keeps it to one entry.
//
// LibTorch runs BF16 matmuls on the CPU through ideep, its glue to oneDNN. ideep keeps each GEMM
// shape's oneDNN primitive descriptor in an LRU cache of its own (LRU_CACHE_CAPACITY, default
// 1024 entries), and oneDNN's primitive cache keeps a copy of the same descriptor inside each
// compiled primitive. A brgemm matmul descriptor is about 260 KiB, and the padded expert GEMMs
// of mixprec-train's default model have about 150 shapes: heaptrack put 85 MiB of the heap's
// peak in oneDNN's allocations, half of them ideep's copies. With one entry ideep makes the
// descriptor again for each call (microseconds), while oneDNN's cache still hands back the
// compiled primitive: on the default model peak RSS fell from 336 to 298 MiB at the same speed
// (150-step runs, three interleaved rounds: 32.2k, 32.6k, 34.3k against 33.6k, 35.4k, 33.4k
// tokens/s). A PyTorch or LibTorch program can set the same variable; bench_train gives it to
// the peers' tuned rows.
#pragma once

#include <string>

namespace train {

// The environment setting, for a benchmark's peer.
inline constexpr const char* kGemmDescriptorCacheEnv = "LRU_CACHE_CAPACITY=1";

// Sets LRU_CACHE_CAPACITY=1 unless the environment sets it (then that wins). ideep reads it at
// the first BF16 GEMM: call it in main, before any. Returns what is in force, for the start-up
// lines.
std::string limit_gemm_descriptor_cache();

}  // namespace train
