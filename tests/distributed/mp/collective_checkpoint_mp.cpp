// Collective checkpoints on the ranks of one launch: save and load on the same N, the
// single-process checkpoint a ZeRO-1 one equals, what each rank reads, and failures that must
// fail every rank and change nothing. (Resuming on another number of ranks, and a rank
// killed mid-save, need several launches: collective_resume_mp.cpp with tests/distributed/*.sh.)
#include "../../../src/distributed/agreement.h"
#include "distributed/mp/zero_support.h"
#include "mixprec/checkpoint/async_save.h"
#include "mixprec/checkpoint/format/box.h"
#include "mixprec/checkpoint/format/crash_point.h"
#include "mixprec/checkpoint/format/error.h"
#include "mixprec/checkpoint/format/manifest.h"
#include "mixprec/checkpoint/format/root_writer.h"
#include "mixprec/checkpoint/format/safetensors_reader.h"
#include "mixprec/checkpoint/format/state_keys.h"
#include "mixprec/checkpoint/format/verify.h"
#include "mixprec/checkpoint/reshard.h"
#include "mixprec/checkpoint/training_state.h"
#include "mixprec/distributed/collective_checkpoint.h"
#include "optim/support_optim.h"
#include "support/error_message.h"
#include "support/test_env.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <future>
#include <set>
#include <stdexcept>
#include <thread>

namespace mixprec::testing {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

namespace fs = std::filesystem;
namespace keys = checkpoint::keys;
using distributed::DistributedOptimizer;

std::vector<std::string> staging_entries(const fs::path& root) {
  std::vector<std::string> out;
  for (const auto& entry : fs::directory_iterator(root)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with(".tmp-") || name.starts_with("latest.tmp")) out.push_back(name);
  }
  return out;
}

// This rank's contiguous share of the 1-D `values` as the flat shard "v" (the world's shares
// tile it).
ShardedStateDict flat_share(const at::Tensor& values) {
  const int n = world().size(), rank = world().rank();
  const int64_t total = values.numel(), begin = total * rank / n, end = total * (rank + 1) / n;
  ShardedStateDict dict;
  dict.tensors.emplace("v",
                       ShardedTensor::flat(values.narrow(0, begin, end - begin), {total}, begin));
  return dict;
}

std::string read_latest(const fs::path& root) {
  std::ifstream in(root / "latest");
  std::string name;
  std::getline(in, name);
  return name;
}

// Same N: a fresh model and optimizer loaded from the checkpoint continue exactly as the
// saving ones do; every rank gets its own RNG stream back; every rank returns one result.
TEST(CollectiveCheckpoint, SavedOnNLoadsOnNAndContinuesBitwise) {
  const int rank = world().rank(), n = world().size();
  SharedTempDir root;
  ZeroRun run;
  for (int64_t step = 0; step < 3; ++step) run.step(step);
  at::manual_seed(500 + rank);  // a different stream per rank
  const checkpoint::SaveResult saved = distributed::save_training_state(
      root.path(), "step-3", *run.model, *run.optimizer, {{"step", 3}},
      checkpoint::SaveOptions().checksum_block_bytes(256));
  const at::Tensor drawn_after_save = at::randn({4});
  EXPECT_EQ(saved.dir, root.path() / "step-3");
  EXPECT_EQ(read_latest(root.path()), "step-3");
  const auto results =
      world().all_gather_strings(saved.dir.string() + " " + std::to_string(saved.tensor_bytes) +
                                 " " + std::to_string(saved.files));
  for (const auto& r : results) EXPECT_EQ(r, results[0]) << "every rank returns one result";
  if (rank == 0) checkpoint::verify_checkpoint(saved.dir);
  EXPECT_EQ(saved.files, static_cast<size_t>(n));
  EXPECT_TRUE(staging_entries(root.path()).empty());
  for (int64_t step = 3; step < 5; ++step) run.step(step);

  ZeroRun resumed;
  at::manual_seed(77);  // anything: the load restores this rank's generator
  const distributed::ResumeResult loaded =
      distributed::load_training_state(root.path(), *resumed.model, *resumed.optimizer);
  EXPECT_EQ(loaded.dir, saved.dir);
  EXPECT_TRUE(loaded.model.clean() && loaded.optimizer.clean()) << loaded.optimizer.to_string();
  EXPECT_EQ(loaded.user, (nlohmann::json{{"step", 3}}));
  EXPECT_TRUE(at::equal(at::randn({4}), drawn_after_save)) << "rank " << rank << "'s RNG";
  if (n > 1) EXPECT_FALSE(same_on_all_ranks(drawn_after_save)) << "ranks' streams differ";

  // Each rank read exactly its pieces of the optimizer state (plus block rounding).
  const checkpoint::Manifest manifest = checkpoint::read_manifest(saved.dir);
  uint64_t pieces_bytes = 0, parts = 0;
  for (const auto& s : resumed.optimizer->local_shards()) {
    for (const auto& [key, entry] : manifest.keys) {
      if (!key.starts_with(keys::kOptimizerStatePrefix) || !key.ends_with("." + s.shard.fqn) ||
          key.size() - s.shard.fqn.size() - 1 <= keys::kOptimizerStatePrefix.size() ||
          key.substr(key.find('.', keys::kOptimizerStatePrefix.size()) + 1) != s.shard.fqn) {
        continue;
      }
      pieces_bytes += static_cast<uint64_t>(s.shard.numel()) * 4;
      for (const auto& box :
           checkpoint::flat_range_boxes(entry.shape, s.shard.begin, s.shard.end)) {
        for (const auto& chunk : entry.chunks)
          parts += checkpoint::intersect(chunk.box, box) ? 1 : 0;
      }
    }
  }
  EXPECT_EQ(loaded.optimizer_reads.bytes_used, pieces_bytes);
  EXPECT_EQ(pieces_bytes,
            static_cast<uint64_t>(resumed.optimizer->state_bytes(optim::ParamRole::kMaster) +
                                  resumed.optimizer->state_bytes(optim::ParamRole::kNativeFp32)));
  EXPECT_LE(loaded.optimizer_reads.bytes_read, pieces_bytes + 2 * 256 * parts);

  for (int64_t step = 3; step < 5; ++step) resumed.step(step);
  expect_params_equal(*resumed.model, *run.model, "resumed vs straight");
  ShardedStateDict straight = run.optimizer->sharded_state_dict();
  for (const auto& [key, piece] : resumed.optimizer->sharded_state_dict().tensors) {
    EXPECT_TRUE(at::equal(piece.local, straight.at(key).local)) << key;
  }
}

// The upstream interleaved model (BF16 pre, frozen BF16, FP32 gate, BF16 post), shard
// boundaries inside parameters: the collective checkpoint holds, key by key and bit for bit,
// what a single-process Float16Optimizer fed the same averaged gradients saves — read back by
// read_checkpoint, and by the Python reader.
TEST(CollectiveCheckpoint, InterleavedModelCheckpointIsTheSingleProcessOne) {
  const int rank = world().rank();
  SharedTempDir root;
  at::manual_seed(7);
  Interleaved zero_model;
  at::manual_seed(7);
  Interleaved dp_model;
  const auto reduce = distributed::GradReducerOptions().bucket_numel(40).shard_alignment(1);
  distributed::GradReducer zero_reducer(
      world_ptr(), *zero_model,
      distributed::GradReducerOptions(reduce).mode(distributed::ReduceMode::kReduceScatter));
  distributed::GradReducer dp_reducer(world_ptr(), *dp_model, reduce);
  const auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(zero_model->optimizer_order());
  DistributedOptimizer zero(zero_reducer, *zero_model, std::move(groups),
                            std::make_unique<torch::optim::AdamWOptions>(adamw));
  auto reference = make_optimizer(dp_model, adamw);
  bool split_inside_a_param = false;
  for (const auto& s : zero.local_shards()) {
    int64_t numel = 1;
    for (int64_t d : s.shard.global_shape) numel *= d;
    split_inside_a_param |= s.shard.begin > 0 || s.shard.end < numel;
  }
  if (world().size() == 3) EXPECT_TRUE(split_inside_a_param);
  for (int64_t step = 0; step < 3; ++step) {
    at::manual_seed(50 + step);
    const at::Tensor x = at::randn({4, 8});
    zero_reducer.zero_grad();
    dp_reducer.zero_grad();
    zero_model->loss(x).backward();
    dp_model->loss(x).backward();
    zero.update();
    dp_reducer.finish();
    reference->update();
  }
  const fs::path zero_dir =
      distributed::save_training_state(root.path() / "zero", "step-3", *zero_model, zero).dir;
  const fs::path single_dir = root.path() / "single" / "step-3";
  if (rank == 0)
    checkpoint::save_training_state(single_dir.parent_path(), "step-3", *dp_model, *reference);
  world().barrier();

  const ShardedStateDict a = checkpoint::read_checkpoint(zero_dir);
  const ShardedStateDict b = checkpoint::read_checkpoint(single_dir);
  std::set<std::string> keys_a, keys_b;
  for (const auto& [key, t] : a.tensors) {
    if (!keys::is_rng_key(key)) keys_a.insert(key);
  }
  for (const auto& [key, t] : b.tensors) {
    if (!keys::is_rng_key(key)) keys_b.insert(key);
  }
  EXPECT_EQ(keys_a, keys_b);
  for (const std::string& key : keys_a) {
    if (!keys_b.count(key)) continue;
    const at::Tensor& x = a.at(key).local;
    const at::Tensor& y = b.at(key).local;
    EXPECT_TRUE(x.scalar_type() == y.scalar_type() && at::equal(x, y)) << key;
  }
  EXPECT_EQ(a.common.at("optimizer"), b.common.at("optimizer"));
  EXPECT_EQ(a.common.at("precision"), b.common.at("precision"));
  EXPECT_TRUE(a.tensors.count(keys::rng_rank_key(world().size() - 1, "rng.cpu")));

  // The Python oracle once (it costs a Python start): where boundaries fall inside params.
  // Without one, CMake said so when it configured (tests/CMakeLists.txt).
  if (rank == 0 && world().size() == 3 && !mixprec::test::python().empty()) {
    const std::string command = mixprec::test::python() + " " + mixprec::test::source_dir() +
                                "/tests/distributed/compare_checkpoints.py " + zero_dir.string() +
                                " " + single_dir.string() + " 2>&1";
    FILE* pipe = ::popen(command.c_str(), "r");
    ASSERT_NE(pipe, nullptr);
    std::string out;
    char buf[4096];
    for (size_t got; (got = std::fread(buf, 1, sizeof buf, pipe)) > 0;) out.append(buf, got);
    const int status = ::pclose(pipe);
    EXPECT_EQ(status, 0) << out;
    EXPECT_NE(out.find("\"problems\": []"), std::string::npos) << out;
  }
  world().barrier();
}

// A single-process checkpoint (Float16Optimizer, checkpoint::save_training_state) loads into
// ZeRO-1 on N ranks, and training continues as plain DP continues from it: bitwise, any N.
TEST(CollectiveCheckpoint, SingleProcessCheckpointLoadsIntoZero) {
  SharedTempDir root;
  Fp16Run single(/*data_parallel=*/false);
  for (int64_t step = 0; step < 2; ++step) single.step(step);
  if (world().rank() == 0) {
    checkpoint::save_training_state(root.path(), "one", *single.model, *single.optimizer);
  }
  world().barrier();
  ZeroRun zero;
  Fp16Run dp(/*data_parallel=*/true);
  const distributed::ResumeResult loaded =
      distributed::load_training_state(root.path(), *zero.model, *zero.optimizer);
  EXPECT_TRUE(loaded.optimizer.clean()) << loaded.optimizer.to_string();
  checkpoint::load_training_state(root.path(), *dp.model, *dp.optimizer);
  expect_zero_state_equals(*zero.optimizer, dp.optimizer->sharded_state_dict(), "loaded");
  for (int64_t step = 2; step < 4; ++step) {
    zero.step(step);
    dp.step(step);
  }
  expect_params_equal(*zero.model, *dp.model, "continued");
}

// Offloading (masters and moments on the host) changes where the state lives, not the
// checkpoint: a plain ZeRO-1 checkpoint loads into an offloaded one and the reverse, and both
// continue bitwise alike. (With the models on a GPU the plain run steps there and the offloaded
// one on the host, which round differently: there the two continue alike within rounding.)
TEST(CollectiveCheckpoint, OffloadedAndPlainZeroLoadEachOthersCheckpoints) {
  const bool same_processor = test_device().is_cpu();
  SharedTempDir root;
  const auto offloaded = optim::Float16OptimizerOptions().offload(
      optim::OffloadOptions().chunk_bytes(256).chunks_in_flight(2));
  auto expect_same_state = [](const ZeroRun& a, const ZeroRun& b, const std::string& what) {
    const ShardedStateDict sa = a.optimizer->sharded_state_dict();
    const ShardedStateDict sb = b.optimizer->sharded_state_dict();
    EXPECT_EQ(sa.tensors.size(), sb.tensors.size()) << what;
    for (const auto& [key, piece] : sa.tensors) {
      EXPECT_TRUE(sb.tensors.count(key) && bitwise_equal(piece.local, sb.at(key).local))
          << what << ": " << key;
    }
    EXPECT_EQ(sa.common, sb.common) << what;
  };
  ZeroRun plain;
  for (int64_t step = 0; step < 2; ++step) plain.step(step);
  distributed::save_training_state(root.path(), "plain", *plain.model, *plain.optimizer);
  ZeroRun off(offloaded);
  distributed::load_training_state(root.path() / "plain", *off.model, *off.optimizer);
  expect_same_state(off, plain, "plain -> offloaded");
  for (const auto& s : off.optimizer->local_shards()) {
    for (const at::Tensor& t : s.state) {
      if (t.defined()) EXPECT_TRUE(t.device().is_cpu()) << s.shard.fqn;
    }
  }
  for (int64_t step = 2; step < 4; ++step) {
    plain.step(step);
    off.step(step);
  }
  expect_params_equal(*off.model, *plain.model, "continued offloaded vs plain", same_processor);
  distributed::save_training_state(root.path(), "offloaded", *off.model, *off.optimizer);
  ZeroRun back;
  distributed::load_training_state(root.path() / "offloaded", *back.model, *back.optimizer);
  expect_same_state(back, off, "offloaded -> plain");
  expect_params_equal(*back.model, *off.model, "offloaded -> plain");
}

// Everything a rank's model and optimizer hold, to tell that a failed load changed nothing.
std::vector<at::Tensor> snapshot(ZeroRun& run) {
  std::vector<at::Tensor> out;
  for (const auto& p : run.model->parameters()) out.push_back(p.clone());
  for (const auto& [key, t] : run.optimizer->sharded_state_dict().tensors)
    out.push_back(t.local.clone());
  out.push_back(at::tensor({run.optimizer->param_step(0), run.optimizer->param_step(2)}));
  return out;
}

void expect_unchanged(ZeroRun& run, const std::vector<at::Tensor>& before) {
  const std::vector<at::Tensor> after = snapshot(run);
  ASSERT_EQ(after.size(), before.size());
  for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(at::equal(after[i], before[i])) << i;
}

// A DistributedOptimizer is a Float16Optimizer, so the single-process functions accept it at
// compile time; they refuse it, naming the collective function, before touching anything: its
// state is one rank's pieces (saved alone, a partial checkpoint; loaded alone, no agreement
// between ranks and rank 0's RNG state everywhere).
TEST(CollectiveCheckpoint, TheSingleProcessFunctionsRefuseZeroNamingTheCollectiveOnes) {
  SharedTempDir root;
  ZeroRun run;
  run.step(0);
  distributed::save_training_state(root.path(), "zero", *run.model, *run.optimizer);
  const std::vector<at::Tensor> before = snapshot(run);
  const std::pair<std::string, std::function<void()>> calls[] = {
      {"training_state_dict", [&] { checkpoint::training_state_dict(*run.model, *run.optimizer); }},
      {"save_training_state",
       [&] { checkpoint::save_training_state(root.path(), "alone", *run.model, *run.optimizer); }},
      {"load_training_state",
       [&] { checkpoint::load_training_state(root.path(), *run.model, *run.optimizer); }},
  };
  for (const auto& [function, call] : calls) {
    const std::string message = error_of(call);
    EXPECT_NE(message.find("[mixprec::checkpoint::" + function + "]"), std::string::npos)
        << message;
    EXPECT_NE(message.find("every rank calls mixprec::distributed::" + function + " together"),
              std::string::npos)
        << message;
  }
  expect_unchanged(run, before);
  world().barrier();
  EXPECT_FALSE(fs::exists(root.path() / "alone"));
}

// A checkpoint of another model (other names; another shape): an error on every rank naming
// the key, the same message everywhere; nothing changes on any rank.
TEST(CollectiveCheckpoint, CheckpointOfAnotherModelIsRefusedOnEveryRank) {
  SharedTempDir root;
  ZeroRun run;
  run.step(0);
  run.step(1);
  const std::vector<at::Tensor> before = snapshot(run);
  const ShardedStateDict state = distributed::training_state_dict(*run.model, *run.optimizer);

  // Other names: every fc1 tensor (model and optimizer) saved under fc9.
  ShardedStateDict renamed;
  renamed.common = state.common;
  for (const auto& [key, t] : state.tensors) {
    std::string k = key;
    if (const size_t at = k.find("fc1."); at != std::string::npos) k.replace(at, 4, "fc9.");
    renamed.tensors.emplace(k, t);
  }
  for (auto& group : renamed.common["optimizer"]["param_groups"]) {
    for (auto& fqn : group["params"]) {
      const std::string name = fqn.get<std::string>();
      if (name.starts_with("fc1.")) fqn = "fc9." + name.substr(4);
    }
  }
  distributed::save_checkpoint(world(), root.path(), "renamed", renamed);
  const std::string message = error_of([&] {
    distributed::load_training_state(root.path() / "renamed", *run.model, *run.optimizer);
  });
  EXPECT_NE(message.find("missing key 'fc1.weight'"), std::string::npos) << message;
  EXPECT_NE(message.find("failed on rank 0 of " + std::to_string(world().size())),
            std::string::npos)
      << message;
  const auto messages = world().all_gather_strings(message);
  for (const auto& m : messages) EXPECT_EQ(m, messages[0]) << "the same error on every rank";
  expect_unchanged(run, before);

  // Another shape: fc2.weight and its optimizer state saved as [7, 15].
  ShardedStateDict reshaped;
  reshaped.common = state.common;
  const int64_t numel = 7 * 15, r = world().rank(), n = world().size();
  const int64_t begin = numel * r / n, end = numel * (r + 1) / n;
  for (const auto& [key, t] : state.tensors) {
    if (!key.ends_with("fc2.weight")) reshaped.tensors.emplace(key, t);
  }
  // Every rank writes its even share of each of them (a rank owns ZeRO-1 pieces of some).
  reshaped.tensors.emplace(
      "fc2.weight", ShardedTensor::flat(at::zeros({end - begin}, at::kBFloat16), {7, 15}, begin));
  for (std::string_view kind : keys::kStateKinds) {
    if (kind == keys::kMomentumBuffer) continue;
    reshaped.tensors.emplace(keys::optimizer_state_key(kind, "fc2.weight"),
                             ShardedTensor::flat(at::zeros({end - begin}), {7, 15}, begin));
  }
  distributed::save_checkpoint(world(), root.path(), "reshaped", reshaped);
  const std::string shape_message = error_of([&] {
    distributed::load_training_state(root.path() / "reshaped", *run.model, *run.optimizer);
  });
  EXPECT_NE(shape_message.find("'fc2.weight': shape [7, 15] in the state, [7, 16] in the model"),
            std::string::npos)
      << shape_message;
  const auto shape_messages = world().all_gather_strings(shape_message);
  for (const auto& m : shape_messages) EXPECT_EQ(m, shape_messages[0]);
  expect_unchanged(run, before);
}

// A corrupt byte that only the rank owning that piece reads: that rank's check fails, every
// rank throws its message, and no rank changed anything (the others' checks had passed).
TEST(CollectiveCheckpoint, CorruptPieceReadByOneRankFailsEveryRankAndChangesNothing) {
  SharedTempDir root;
  ZeroRun run;
  run.step(0);
  const fs::path dir =
      distributed::save_training_state(root.path(), "a", *run.model, *run.optimizer, {},
                                       checkpoint::SaveOptions().checksum_block_bytes(64))
          .dir;
  const std::string key = keys::optimizer_state_key(keys::kExpAvg, "fc1.weight");
  if (world().rank() == 0) {
    // Flip the last byte of the last chunk of the key (in its file's data section).
    const checkpoint::Manifest manifest = checkpoint::read_manifest(dir);
    const checkpoint::Chunk& chunk = manifest.keys.at(key).chunks.back();
    uint64_t offset = 0;
    {
      checkpoint::SafetensorsReader reader(dir / chunk.file);
      offset = reader.header().data_offset() + reader.tensor(chunk.tensor).end - 1;
    }
    std::fstream f(dir / chunk.file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(offset));
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x40);
    f.seekp(static_cast<std::streamoff>(offset));
    f.write(&c, 1);
  }
  world().barrier();
  ZeroRun fresh;
  fresh.step(5);
  const std::vector<at::Tensor> before = snapshot(fresh);
  const std::string message =
      error_of([&] { distributed::load_training_state(dir, *fresh.model, *fresh.optimizer); });
  EXPECT_NE(message.find(key), std::string::npos) << message;
  EXPECT_NE(message.find("checksum mismatch"), std::string::npos) << message;
  // Only the owners of the corrupt block read it; the others' checks passed, and still they
  // changed nothing.
  const int n = world().size();
  if (n >= 3) {
    EXPECT_EQ(message.find(c10::str("(", n, " rank(s) failed)")), std::string::npos) << message;
  }
  const auto messages = world().all_gather_strings(message);
  for (const auto& m : messages) EXPECT_EQ(m, messages[0]);
  expect_unchanged(fresh, before);
}

// A rank that never arrives at a collective save: every other rank gets an error within the
// timeout, nothing is committed, `latest` still names the previous checkpoint, and rank 0's
// staging directory is gone.
TEST(CollectiveCheckpoint, ARankThatNeverArrivesIsAnErrorNotAHang) {
  const int n = world().size(), rank = world().rank();
  // Two ranks show it; each run waits out the timeout, so only one world size pays it.
  if (n != 2) GTEST_SKIP() << "runs on two ranks";
  SharedTempDir root;
  auto group = own_group("save-timeout", std::chrono::seconds(3));
  const at::Tensor values = at::arange(12, at::kFloat);
  const ShardedStateDict mine = flat_share(values);
  distributed::save_checkpoint(*group, root.path(), "first", mine);
  if (rank != n - 1) {
    const std::string message =
        error_of([&] { distributed::save_checkpoint(*group, root.path(), "second", mine); });
    EXPECT_NE(message.find("timeout 3000 ms"), std::string::npos) << message;
  }
  world().barrier();
  EXPECT_EQ(read_latest(root.path()), "first");
  EXPECT_FALSE(fs::exists(root.path() / "second"));
  EXPECT_TRUE(staging_entries(root.path()).empty());
  EXPECT_TRUE(at::equal(checkpoint::read_checkpoint(root.path() / "first").at("v").local, values));
}

// An async save whose part fails on one rank only — its state changed before save() looked at
// it, or while it was being staged — fails on every rank, commits nothing, and leaves the ranks'
// next saves paired: the failing rank still takes part in the save's first agreement.
TEST(CollectiveCheckpoint, AnAsyncSaveFailingOnOneRankFailsOnEveryRankAndTheNextOnePairs) {
  const int n = world().size(), rank = world().rank();
  if (n < 2) GTEST_SKIP() << "needs a rank that fails and one that does not";
  const bool failing = rank == n - 1;
  SharedTempDir root;
  auto group = own_group("async-one-rank-fails", std::chrono::seconds(60));
  const at::Tensor values = at::arange(12, at::kFloat);
  const auto mine = [&] { return flat_share(values); };
  bool sabotage_staging = failing;
  checkpoint::AsyncCheckpointSaver saver(
      checkpoint::AsyncSaveOptions().on_tensor_staged([&](const std::string&) {
        // A write during staging (the version moves; the values stay, so later saves compare).
        if (std::exchange(sabotage_staging, false)) values.add_(0);
      }));

  const auto expect_failed_everywhere = [&](const std::string& name, const std::string& why) {
    const std::string staged = error_of([&] { saver.wait_until_staged(); });
    const std::string waited = error_of([&] { (void)saver.wait(); });
    if (failing) {
      EXPECT_NE(staged.find(why), std::string::npos) << "rank " << rank << ": " << staged;
    } else {
      EXPECT_EQ(staged, "") << "rank " << rank << " staged its part";
    }
    // Every rank, the failing one too, then has the same error at the same call.
    EXPECT_NE(waited.find("failed on rank " + std::to_string(n - 1) + " of " + std::to_string(n)),
              std::string::npos)
        << "rank " << rank << ": " << waited;
    EXPECT_NE(waited.find(why), std::string::npos) << "rank " << rank << ": " << waited;
    const std::vector<std::string> all = world().all_gather_strings(waited);
    for (const std::string& other : all) EXPECT_EQ(other, waited);
    world().barrier();
    EXPECT_FALSE(fs::exists(root.path() / name));
    EXPECT_TRUE(staging_entries(root.path()).empty());
    world().barrier();  // every rank has looked before rank 0 stages the next save
  };

  (void)distributed::save_checkpoint_async(saver, group, root.path(), "a", mine());
  expect_failed_everywhere("a", "while it was being staged");

  ShardedStateDict changed = mine();
  if (failing) values.add_(0);  // after the dict was built: save() itself finds it
  (void)distributed::save_checkpoint_async(saver, group, root.path(), "b", std::move(changed));
  expect_failed_everywhere("b", "since the state dict was built");
  EXPECT_FALSE(fs::exists(root.path() / "latest"));

  // A state this rank alone cannot save: a key spelled like a piece of a flat slice. The
  // message names the keys; the rank is the one the agreement names, not 0.
  ShardedStateDict colliding = mine();
  const at::Tensor grid = at::arange(16, at::kFloat);
  if (failing) {
    colliding.tensors.emplace("w", ShardedTensor::flat(grid.narrow(0, 2, 8), {4, 4}, 2));
    colliding.tensors.emplace("w/1", ShardedTensor::whole(at::ones({2})));
  }
  (void)distributed::save_checkpoint_async(saver, group, root.path(), "b2", std::move(colliding));
  expect_failed_everywhere("b2", "keys 'w' and 'w/1' would both be stored as tensor 'w/1'");

  (void)distributed::save_checkpoint_async(saver, group, root.path(), "c", mine());
  saver.wait_until_staged();
  const std::optional<checkpoint::SaveResult> saved = saver.wait();
  ASSERT_TRUE(saved.has_value());
  EXPECT_EQ(saved->dir, root.path() / "c");
  world().barrier();
  EXPECT_EQ(read_latest(root.path()), "c");
  EXPECT_TRUE(at::equal(checkpoint::read_checkpoint(root.path() / "c").at("v").local, values));
}

// An async collective save in which some ranks' parts hold no elements (a 1-row tensor split
// by rows leaves every rank but 0 an empty slice) commits and loads: a part with nothing to
// stage needs no staging memory, and no rank is left waiting for another's.
TEST(CollectiveCheckpoint, AnAsyncSaveWithRanksWhosePartsAreEmptyCommitsAndLoads) {
  const int n = world().size(), rank = world().rank();
  if (n < 2) GTEST_SKIP() << "needs a rank with an empty part";
  SharedTempDir root;
  // Its own group: a rank that fails alone must not leave the shared one waiting.
  auto group = own_group("async-empty-parts", std::chrono::seconds(20));
  ShardedStateDict whole;
  whole.tensors.emplace("w", ShardedTensor::whole(at::arange(4, at::kFloat).view({1, 4})));
  whole.tensors.emplace("h", ShardedTensor::whole(at::ones({1, 3}, at::kHalf)));
  whole.common["step"] = 1;
  ShardedStateDict mine = checkpoint::shard_for_rank(whole, rank, n);
  if (rank > 0) {
    for (const auto& [key, shard] : mine.tensors) EXPECT_EQ(shard.local.numel(), 0) << key;
  }
  checkpoint::AsyncCheckpointSaver saver;
  std::string error;
  std::optional<checkpoint::SaveResult> saved;
  try {
    (void)distributed::save_checkpoint_async(saver, group, root.path(), "step-1", std::move(mine));
    saved = saver.wait();
  } catch (const std::exception& e) {
    error = e.what();
  }
  EXPECT_EQ(error, "") << "rank " << rank;
  EXPECT_TRUE(saved.has_value() && saved->dir == root.path() / "step-1") << "rank " << rank;
  world().barrier();
  EXPECT_EQ(read_latest(root.path()), "step-1");
  if (fs::exists(root.path() / "step-1")) {  // alike on every rank: the barrier passed
    if (rank == 0) checkpoint::verify_checkpoint(root.path() / "step-1");
    const ShardedStateDict loaded = checkpoint::read_checkpoint(root.path() / "step-1");
    for (const auto& [key, shard] : whole.tensors) {
      EXPECT_TRUE(at::equal(loaded.tensors.at(key).local, shard.local)) << key;
    }
  }
  world().barrier();  // every rank has read before the directory goes
}

// The next async collective save returns the result of the one it waited for, warnings
// included, on every rank alike (here: an unusable `latest`, which rank 0 replaces).
TEST(CollectiveCheckpoint, TheNextAsyncSaveReturnsThePreviousResultOnEveryRank) {
  const int n = world().size(), rank = world().rank();
  SharedTempDir root;
  auto group = own_group("async-results", std::chrono::seconds(20));
  ShardedStateDict whole;
  whole.tensors.emplace("w", ShardedTensor::whole(at::arange(8, at::kFloat)));
  if (rank == 0) std::ofstream(root.path() / "latest") << "../../etc\n";
  world().barrier();  // before any rank's save can reach the root
  checkpoint::AsyncCheckpointSaver saver;
  EXPECT_FALSE(distributed::save_checkpoint_async(saver, group, root.path(), "step-1",
                                                  checkpoint::shard_for_rank(whole, rank, n)));
  const std::optional<checkpoint::SaveResult> first = distributed::save_checkpoint_async(
      saver, group, root.path(), "step-2", checkpoint::shard_for_rank(whole, rank, n));
  ASSERT_TRUE(first.has_value()) << "rank " << rank;
  EXPECT_EQ(first->dir, root.path() / "step-1");
  ASSERT_EQ(first->warnings.size(), 1u) << "rank " << rank;
  EXPECT_NE(first->warnings[0].find("'latest' is unusable"), std::string::npos)
      << first->warnings[0];
  const std::optional<checkpoint::SaveResult> second = saver.wait();
  ASSERT_TRUE(second.has_value()) << "rank " << rank;
  EXPECT_EQ(second->dir, root.path() / "step-2");
  EXPECT_TRUE(second->warnings.empty()) << "rank " << rank;
  EXPECT_FALSE(saver.wait().has_value()) << "a result is returned once";
  world().barrier();  // every rank is done before the directory goes
}

// A reserved or invalid name, on every rank or on one only, fails the collective async save on
// every rank alike (at wait(): every rank must reach the save's first phase, where it is
// checked), and the next saves still pair: none is left waiting for another rank's next one.
TEST(CollectiveCheckpoint, AnAsyncSaveUnderAnInvalidNameFailsOnEveryRankAndTheNextPairs) {
  const int n = world().size(), rank = world().rank();
  SharedTempDir root;
  auto group = own_group("async-bad-name", std::chrono::seconds(20));
  ShardedStateDict whole;
  whole.tensors.emplace("w", ShardedTensor::whole(at::arange(8, at::kFloat)));
  checkpoint::AsyncCheckpointSaver saver;
  const auto save = [&](const std::string& name) {
    std::string message;
    try {
      (void)distributed::save_checkpoint_async(saver, group, root.path(), name,
                                               checkpoint::shard_for_rank(whole, rank, n));
      (void)saver.wait();
    } catch (const std::exception& e) {
      message = e.what();
    }
    return message;
  };
  EXPECT_NE(save("latest").find("'latest' is a reserved name"), std::string::npos);
  // Rank n-1 alone passes a bad name (with one rank, every rank does).
  EXPECT_NE(save(rank == n - 1 ? "a/b" : "step-1"), "");
  for (const std::string name : {"step-2", "step-3"}) EXPECT_EQ(save(name), "") << name;
  world().barrier();
  EXPECT_EQ(read_latest(root.path()), "step-3");
  world().barrier();
}

// What each rank reserves at training start, before any step, is exactly what its part of
// the save at step 3 stages (its own pieces: the ranks' sizes differ), not its state's size at
// start, which holds no moments yet.
TEST(CollectiveCheckpoint, StagingBytesWhenSteppedAtStartAreWhatEachRanksSaveStagesLater) {
  const int rank = world().rank();
  SharedTempDir root;
  ZeroRun run;
  const std::size_t when_stepped =
      distributed::staging_bytes_when_stepped(*run.model, *run.optimizer);
  const std::size_t at_start =
      checkpoint::staging_bytes_for(distributed::training_state_dict(*run.model, *run.optimizer));
  checkpoint::AsyncCheckpointSaver saver(
      checkpoint::AsyncSaveOptions().staging_budget_bytes(when_stepped));
  saver.reserve(when_stepped);
  for (int64_t step = 0; step < 3; ++step) run.step(step);
  const ShardedStateDict stepped = distributed::training_state_dict(*run.model, *run.optimizer);
  EXPECT_LT(at_start, checkpoint::staging_bytes_for(stepped)) << "rank " << rank;
  EXPECT_EQ(when_stepped, checkpoint::staging_bytes_for(stepped)) << "rank " << rank;
  (void)distributed::save_checkpoint_async(saver, world_ptr(), root.path(), "step-3", stepped);
  std::string error;
  try {
    (void)saver.wait();
  } catch (const std::exception& e) {
    error = e.what();
  }
  EXPECT_EQ(error, "") << "rank " << rank;
  EXPECT_EQ(saver.staging_bytes(), when_stepped) << "rank " << rank;
}

// Ranks whose saves are out of step (one saves under another name) are refused on every rank
// before anything is written, rather than paired into one checkpoint.
TEST(CollectiveCheckpoint, RanksSavingDifferentCheckpointsAreRefused) {
  const int n = world().size(), rank = world().rank();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  SharedTempDir root;
  const at::Tensor values = at::arange(12, at::kFloat);
  const ShardedStateDict mine = flat_share(values);
  const std::string name = rank == n - 1 ? "step-2" : "step-1";
  const std::string message =
      error_of([&] { distributed::save_checkpoint(world(), root.path(), name, mine); });
  EXPECT_NE(message.find("the ranks are not saving the same checkpoint: rank 0 saves 'step-1', "
                         "rank " +
                         std::to_string(n - 1) + " 'step-2'"),
            std::string::npos)
      << message;
  world().barrier();
  EXPECT_FALSE(fs::exists(root.path() / "step-1"));
  EXPECT_FALSE(fs::exists(root.path() / "step-2"));
  EXPECT_TRUE(staging_entries(root.path()).empty());
}

// Ranks passing different SaveOptions are refused on every rank before anything is written,
// naming the option and each rank's value: the manifest and retention are rank 0's, so a
// difference would otherwise fail after every rank wrote (blaming rank 0's manifest) or be
// silently overridden by rank 0's. Synchronous and async saves alike.
TEST(CollectiveCheckpoint, RanksPassingDifferentSaveOptionsAreRefused) {
  const int n = world().size(), rank = world().rank();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  const bool odd_one = rank == n - 1;
  const std::string last = std::to_string(n - 1);
  SharedTempDir root;
  const at::Tensor values = at::arange(12, at::kFloat);
  const ShardedStateDict mine = flat_share(values);
  const auto refused = [&](const std::string& name, const checkpoint::SaveOptions& options,
                           const std::string& expected) {
    const std::string message =
        error_of([&] { distributed::save_checkpoint(world(), root.path(), name, mine, options); });
    EXPECT_NE(message.find(expected), std::string::npos) << "rank " << rank << ": " << message;
    EXPECT_EQ(message.find("manifest"), std::string::npos) << message;
    world().barrier();
    EXPECT_FALSE(fs::exists(root.path() / name));
    EXPECT_TRUE(staging_entries(root.path()).empty());
    world().barrier();  // every rank has looked before rank 0 stages the next save
  };
  const checkpoint::SaveOptions same = checkpoint::SaveOptions().checksum_block_bytes(256);
  refused(
      "blocks", checkpoint::SaveOptions(same).checksum_block_bytes(odd_one ? 0 : 256),
      "the ranks' save options differ: checksum_block_bytes is 256 on rank 0, 0 on rank " + last);
  refused("keep", checkpoint::SaveOptions(same).keep_last(odd_one ? 2 : 0),
          "keep_last is 0 on rank 0, 2 on rank " + last);
  refused("no-latest", checkpoint::SaveOptions(same).update_latest(!odd_one),
          "update_latest is true on rank 0, false on rank " + last);
  refused("in-use",
          checkpoint::SaveOptions(same).in_use(odd_one ? std::set<std::string>{"a"}
                                                       : std::set<std::string>{}),
          "in_use is [] on rank 0, [\"a\"] on rank " + last);
  EXPECT_FALSE(fs::exists(root.path() / "latest")) << "nothing was ever committed";

  // An async save is refused alike, at wait(), and the ranks' next saves still pair.
  auto group = own_group("async-options-differ", std::chrono::seconds(60));
  checkpoint::AsyncCheckpointSaver saver;
  (void)distributed::save_checkpoint_async(
      saver, group, root.path(), "async", mine,
      checkpoint::SaveOptions(same).keep_last(odd_one ? 1 : 0));
  const std::string message = error_of([&] { (void)saver.wait(); });
  EXPECT_NE(message.find("keep_last is 0 on rank 0, 1 on rank " + last), std::string::npos)
      << "rank " << rank << ": " << message;
  (void)distributed::save_checkpoint_async(saver, group, root.path(), "agreed", mine, same);
  const std::optional<checkpoint::SaveResult> saved = saver.wait();
  EXPECT_TRUE(saved.has_value() && saved->dir == root.path() / "agreed") << "rank " << rank;
  world().barrier();
  EXPECT_FALSE(fs::exists(root.path() / "async"));
  EXPECT_EQ(read_latest(root.path()), "agreed");
  world().barrier();
}

// A collective save's rank 0 opens the root as its one writer while the other ranks wait for it
// in slices: a save whose rank 0 waits for the root's lock (SaveOptions::lock_timeout) longer
// than the group's timeout goes through on every rank. (Two ranks show it.)
TEST(CollectiveCheckpoint, ASaveWaitingForTheRootsLockLongerThanTheTimeoutGoesThrough) {
  if (world().size() != 2) GTEST_SKIP() << "runs on two ranks";
  SharedTempDir root;
  auto group = own_group("lock-wait", std::chrono::seconds(4));
  std::thread holder;  // on rank 0: another writer of the root, for 6 s
  if (world().rank() == 0) {
    std::promise<void> held;
    std::future<void> holding = held.get_future();
    holder = std::thread([&root, held = std::move(held)]() mutable {
      const checkpoint::RootWriter writer(root.path());
      held.set_value();
      std::this_thread::sleep_for(std::chrono::seconds(6));
    });
    holding.wait();
  }
  world().barrier();
  const at::Tensor values = at::arange(12, at::kFloat);
  EXPECT_EQ(
      distributed::save_checkpoint(*group, root.path(), "waited", flat_share(values),
                                   checkpoint::SaveOptions().lock_timeout(std::chrono::seconds(60)))
          .dir,
      root.path() / "waited");
  if (holder.joinable()) holder.join();
  world().barrier();
  EXPECT_EQ(read_latest(root.path()), "waited");
  EXPECT_TRUE(at::equal(checkpoint::read_checkpoint(root.path() / "waited").at("v").local, values));
}

// Rank 0 commits alone (fsyncs, the rename, `latest`, retention's deletes) while the other ranks
// wait for it in slices: a commit slower than the group's timeout (storage slow at the rename,
// format/crash_point.h) goes through on every rank.
TEST(CollectiveCheckpoint, ACommitSlowerThanTheTimeoutGoesThrough) {
  if (world().size() != 2) GTEST_SKIP() << "runs on two ranks";
  SharedTempDir root;
  auto group = own_group("slow-commit", std::chrono::seconds(4));
  const bool slow = world().rank() == 0;
  if (slow) {
    ::setenv("MIXPREC_CRASH_POINT", "slow:commit: before rename:6000", 1);
    checkpoint::detail::reset_crash_points();
  }
  const at::Tensor values = at::arange(12, at::kFloat);
  std::string message;
  try {
    distributed::save_checkpoint(*group, root.path(), "slow", flat_share(values));
  } catch (const std::exception& e) {
    message = e.what();
  }
  if (slow) {
    ::unsetenv("MIXPREC_CRASH_POINT");
    checkpoint::detail::reset_crash_points();
  }
  EXPECT_EQ(message, "");
  world().barrier();
  EXPECT_EQ(read_latest(root.path()), "slow");
  EXPECT_TRUE(at::equal(checkpoint::read_checkpoint(root.path() / "slow").at("v").local, values));
}

// A collective load given a checkpoint root asks rank 0 which checkpoint to load, and rank 0
// may verify checkpoints newer than `latest` for longer than the group's timeout: the other
// ranks wait for its answer in slices, so a slow answer, and a slow error, reach every rank
// instead of timing the group out. (Two ranks show it; the waits are paid once.)
TEST(CollectiveCheckpoint, ALoadsLookupLongerThanTheTimeoutReachesEveryRank) {
  if (world().size() != 2) GTEST_SKIP() << "runs on two ranks";
  auto group = own_group("slow-lookup", std::chrono::seconds(4));
  const auto lookup = [&](std::chrono::milliseconds takes, bool fails) {
    return distributed::detail::agree_on_one_ranks_part(
        *group, "lookup", /*worker=*/0, [=]() -> std::string {
          std::this_thread::sleep_for(takes);
          if (fails) throw std::runtime_error("no checkpoint in the root verifies");
          return "step-000007";
        });
  };
  EXPECT_EQ(lookup(std::chrono::seconds(6), /*fails=*/false), "step-000007");
  const std::string message = error_of([&] { lookup(std::chrono::seconds(5), /*fails=*/true); });
  EXPECT_NE(message.find("[lookup] failed on rank 0 of 2 (1 rank(s) failed): no checkpoint in "
                         "the root verifies"),
            std::string::npos)
      << message;
  world().barrier();
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::testing
