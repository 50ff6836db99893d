// Collective checkpoints: every data-parallel rank writes only its own shard, one commit.
//
// On disk a collective checkpoint is an ordinary mixprec checkpoint (docs/checkpoint-format.md,
// "A ZeRO-1 checkpoint"): the same keys, global shapes and common state as a single-process
// Float16Optimizer's, so either loads into the other on any number of ranks, and the Python
// reader and mixprec-ckpt read it unchanged. Rank r's data file data-<r>.safetensors holds
//   * its flat piece [begin, end) of every optimizer state tensor it owns (ZeRO-1,
//     DistributedOptimizer::sharded_state_dict), stored as the at most 2·(ndim − 1) + 1 boxes
//     that range decomposes into (tensor names "<key>" for one box, "<key>/<i>" for several);
//   * elements [⌊r·n/N⌋, ⌊(r+1)·n/N⌋) of every model parameter of n elements (parameters are
//     replicated on every rank, identical as data parallelism keeps them: spreading the write
//     this way moves 1/N of the model bytes per rank instead of all of them on rank 0);
//     buffers, which data parallelism does not keep identical (e.g. BatchNorm statistics),
//     are rank 0's, written whole by rank 0;
//   * its own RNG states, "rng.rank.<r>.cpu" and "rng.rank.<r>.cuda.<index>"; rank 0 also
//     writes its own as "rng.cpu" / "rng.cuda.<index>", which a single-process load restores.
// common.json is rank 0's common state ("optimizer", "precision", "user").
//
// Save, in three phases; each ends with one all-gather in which every rank learns every
// rank's outcome, and goes on only if every rank succeeded: otherwise every rank throws the
// same c10::Error, naming the first failing rank and its message.
//   1. prepare: every rank plans its chunks. Every plan, with the rank's checkpoint name and
//      SaveOptions, goes to every rank, and all are checked together (the same name and options
//      on every rank, each key's dtype and global shape agree, its chunks tile it exactly)
//      before anything is written. Then rank 0, the committing rank, opens the root as its one
//      writer (it alone takes the lock, cleans stale staging and repairs `latest`:
//      checkpoint/format/root_writer.h) and creates the staging directory, while the other
//      ranks wait for its outcome in slices of a quarter of the communicator's timeout (a wait
//      for the lock, or verifying a checkpoint newer than `latest`, may take longer than it).
//   2. write: every rank writes only its own data file into the staging directory and fsyncs
//      it; its checksums go to every rank (rank 0 puts them in the manifest).
//   3. commit: rank 0 writes common.json and, last, manifest.json, commits the directory
//      (rename, root fsync: checkpoint/format/commit.h), points `latest` at it and applies
//      retention, while the other ranks wait in slices as in phase 1 (fsyncs and deletes may
//      be slow); every rank returns rank 0's SaveResult.
// A rank that dies mid-save. The survivors' next all-gather fails — at once when the dead
// peer's connections close (Gloo: "Connection closed by peer"), at the latest after the
// communicator's timeout — and throws on each of them:
//   * dead before its phase-2 outcome was sent (its file not yet durable, the usual case):
//     nothing is committed; `latest` still names the previous checkpoint, which loads on any
//     number of ranks. Rank 0's staging directory is removed when its save throws; if rank 0
//     itself died (or was stopped by the launcher), its staging stays behind and the next
//     save's cleanup removes it: its name carries rank 0's host, boot and pid, and a dead pid
//     on the same host, or a directory of another host idle for stale_staging_timeout, is
//     stale (format/retention.h);
//   * a rank other than 0 dead after phase 2: every file is durable, so rank 0 commits; the
//     checkpoint is complete and `latest` names it, but the survivors' phase-3 all-gather
//     throws. Rank 0 dead in phase 3: committed if it got past the rename (the next save or
//     load finds it even if `latest` was not updated: format/newest_checkpoint.h), else not.
// Only the committing rank cleans, while it holds the root's lock and before it creates its
// staging directory; that directory belongs to its live process throughout, so no rank's
// cleanup removes a save in progress, and another writer of the root waits for the lock.
// The root must be on a filesystem every rank sees.
//
// Load (load_training_state): rank 0 resolves the checkpoint (`latest`, or the newest complete
// one) and every rank loads that one. Each rank reads the model tensors whole (they are
// replicated) and, of the optimizer state, only the byte ranges of its own pieces (its flat
// ranges as boxes, verified block by block: checkpoint/load.h), whatever number of ranks
// wrote it. Every rank checks everything — checksums, keys, shapes, dtypes, hyper-parameters,
// RNG states — then all ranks agree; only if every rank's check passed does any rank change
// its model, optimizer or RNG. Otherwise every rank throws the same c10::Error and nothing
// changed anywhere. Rank r restores rng.rank.<r>.*; a rank the checkpoint has no state for
// (more ranks than saved it) keeps its generators, with a note.
#pragma once

#include "mixprec/checkpoint/async_save.h"
#include "mixprec/checkpoint/load.h"
#include "mixprec/checkpoint/save.h"
#include "mixprec/checkpoint/training_state.h"
#include "mixprec/distributed/communicator.h"
#include "mixprec/distributed/distributed_optimizer.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <optional>
#include <string>

namespace torch::nn {
class Module;
}

namespace mixprec::distributed {

// Collective: saves every rank's `mine` as the checkpoint <root>/<name> (phases above). A
// key's shards from all ranks together must tile it (replica_id > 0 marks duplicates); the
// common state is rank 0's. Every rank passes the same `name` and `options` (a rank that
// differs is refused on every rank before anything is written, the error naming the option
// and both ranks' values). Every rank returns the same SaveResult (tensor_bytes and files
// over all ranks), or every rank throws: c10::Error naming the first failing rank and its
// message (a bad state, a held lock, an existing <name>, an I/O error), or the communicator's
// error when a rank does not arrive. Nothing is committed unless every rank's data file is
// durable (a rank lost after that: see the header comment).
checkpoint::SaveResult save_checkpoint(Communicator& comm, const std::filesystem::path& root,
                                       const std::string& name, const ShardedStateDict& mine,
                                       const checkpoint::SaveOptions& options = {});

// Collective, asynchronous: stages this rank's `mine` in `saver` (training waits only for that
// copy, checkpoint/async_save.h) and returns; the collective save above then runs in the
// background on `checkpoint_comm`, a group of its own (init.h: InitOptions::group_name), so that
// its collectives never interleave with training's and wait with their own timeout (rank 0 may
// wait for the root's lock or clean stale staging first). Every rank calls it at the same step
// with a saver of its own; at most one save is in flight (the saver waits for the previous one
// first). Returns the previous save's result as AsyncCheckpointSaver::save does (the same on
// every rank, as save_checkpoint's: log its warnings on one; a saver destroyed with one
// uncollected prints them on every rank). An error surfaces at the next save
// or saver.wait(): the phases agree on outcomes, so every rank has the same error; a rank lost
// mid-save is the group's error on the others, with the guarantees of a synchronous save
// (nothing committed unless every file is durable). So is an invalid or reserved name, or names
// that differ between ranks: the first phase refuses them on every rank, and the next saves
// still pair.
[[nodiscard]] std::optional<checkpoint::SaveResult> save_checkpoint_async(
    checkpoint::AsyncCheckpointSaver& saver, std::shared_ptr<Communicator> checkpoint_comm,
    const std::filesystem::path& root, const std::string& name, ShardedStateDict mine,
    const checkpoint::SaveOptions& options = {});

// This rank's part of the training state (model pieces, optimizer pieces, RNG, user), as the
// header comment lays it out, once any parameter gather in flight has completed. Throws
// c10::Error if a model tensor's name is one the checkpoint reserves. Not collective.
ShardedStateDict training_state_dict(const torch::nn::Module& model,
                                     const DistributedOptimizer& optimizer,
                                     const nlohmann::json& user = nlohmann::json::object());

// The staging bytes of this rank's training_state_dict once every trainable parameter has been
// stepped (checkpoint::staging_bytes_when_stepped over this rank's pieces): what this rank's
// AsyncCheckpointSaver::reserve() must be given when training starts. Not collective.
std::size_t staging_bytes_when_stepped(const torch::nn::Module& model,
                                       const DistributedOptimizer& optimizer);

// Collective over the optimizer's communicator:
// save_checkpoint(comm, root, name, training_state_dict(model, optimizer, user), options).
checkpoint::SaveResult save_training_state(const std::filesystem::path& root,
                                           const std::string& name, const torch::nn::Module& model,
                                           const DistributedOptimizer& optimizer,
                                           const nlohmann::json& user = nlohmann::json::object(),
                                           const checkpoint::SaveOptions& options = {});

struct ResumeResult : checkpoint::ResumeResult {
  // What this rank read from the optimizer state (its pieces: bytes_used is exactly their
  // bytes; bytes_read exceeds it by at most one checksum block at each end of each chunk part)
  // and from the model tensors and its RNG states (read whole).
  checkpoint::ReadStats optimizer_reads;
  checkpoint::ReadStats model_reads;
};

// Collective over the optimizer's communicator: loads `path` (a checkpoint directory, or a
// root: the checkpoint rank 0 finds there, checkpoint/load.h: find_checkpoint — the other ranks
// wait for that lookup in slices of a quarter of the communicator's timeout, so verifying a
// checkpoint newer than `latest` may take longer than the timeout) into model,
// optimizer and RNG, as the header comment describes; saved by any number of ranks, or by one
// process (checkpoint::save_training_state). Throws c10::Error on every rank if any rank's
// read or check fails (the first failing rank's message, naming file and key), with model,
// optimizer and RNG unchanged on every rank.
ResumeResult load_training_state(const std::filesystem::path& path, torch::nn::Module& model,
                                 DistributedOptimizer& optimizer, const LoadOptions& options = {});

}  // namespace mixprec::distributed
