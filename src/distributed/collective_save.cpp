// distributed::save_checkpoint: the three agreed phases of a collective save
// (collective_checkpoint.h).
#include "mixprec/distributed/collective_checkpoint.h"

#include "checkpoint/save_pipeline.h"
#include "detail/name_match.h"
#include "distributed/agreement.h"
#include "distributed/checkpoint_messages.h"
#include "mixprec/checkpoint/format/checksum.h"
#include "mixprec/checkpoint/format/commit.h"
#include "mixprec/checkpoint/format/root_layout.h"
#include "mixprec/checkpoint/format/root_writer.h"

#include <c10/util/Exception.h>

#include <memory>

namespace mixprec::distributed {

namespace ckpt = mixprec::checkpoint;
using ckpt::detail::RankPlan;

namespace {

constexpr const char* kSaveOp = "mixprec::distributed::save_checkpoint";

// What rank 0 holds from phase 1 to 3: the root's lock and the staging directory. Destroyed
// by a throw before the commit, they remove the staging directory and release the lock.
struct Committer {
  std::unique_ptr<ckpt::RootWriter> writer;
  std::unique_ptr<ckpt::CheckpointStaging> staging;
};

// The staging directory, on a rank other than the committing one: a name rank 0 sent, checked
// to be a staging name (root_layout.h) before it is opened relative to the root.
ckpt::Directory open_staging(const std::filesystem::path& root, const std::string& name) {
  TORCH_CHECK(name.starts_with(ckpt::kStagingPrefix) && name.find('/') == std::string::npos, "[",
              kSaveOp, "] rank 0 sent '", name, "', which is not a staging directory name");
  return ckpt::open_root(root).subdirectory(name);
}

// An option's value as a message shows it: strings without their quotes.
std::string printed(const nlohmann::json& value) {
  return value.is_string() ? value.get<std::string>() : value.dump();
}

}  // namespace

namespace {

// The collective save, with this rank's part already failed when `failed` is set (an async
// save whose state could not be staged): it still takes part in phase 1, so that every rank
// fails there with that error instead of waiting for this rank's next save.
ckpt::SaveResult save_collectively(Communicator& comm, const std::filesystem::path& root,
                                   const std::string& name, const ShardedStateDict& mine,
                                   const ckpt::SaveOptions& options,
                                   const std::exception_ptr& failed) {
  const int rank = comm.rank();
  const bool committing = rank == 0;
  Committer committer;

  // 1. prepare: plans from everyone; then the writer and the staging directory on rank 0.
  const std::vector<std::string> prepared = detail::agree(comm, kSaveOp, [&] {
    if (failed) std::rethrow_exception(failed);
    std::vector<std::string> problems;
    ckpt::detail::check_unchanged({&mine}, "since the state dict was built");
    if (committing) ckpt::detail::check_common_state(mine.common);  // rank 0's is written
    const RankPlan plan = ckpt::detail::plan_rank(mine, static_cast<size_t>(rank), problems);
    mixprec::detail::check_no_problems(problems, "[mixprec::checkpoint::save] cannot save");
    return nlohmann::json{{"plan", detail::plan_to_json(plan)},
                          {"name", name},
                          {"options", detail::options_to_json(options)}}
        .dump();
  });
  std::vector<nlohmann::json> payloads;
  for (const std::string& text : prepared) payloads.push_back(nlohmann::json::parse(text));
  const std::string first_name = payloads[0].at("name").get<std::string>();
  std::vector<RankPlan> plans;
  for (size_t r = 0; r < payloads.size(); ++r) {
    // Ranks whose saves are out of step (a rank that skipped one) must not pair two saves:
    // every rank compares the same names, so all throw alike.
    const std::string theirs = payloads[r].at("name").get<std::string>();
    TORCH_CHECK(theirs == first_name, "[", kSaveOp,
                "] the ranks are not saving the same checkpoint: rank 0 saves '", first_name,
                "', rank ", r, " '", theirs,
                "' (every rank must save at the same step, under the same name)");
    // The manifest, `latest` and retention are rank 0's, each data file its rank's: options
    // that differ would fail the commit after every rank wrote, or be overridden silently.
    for (const auto& [option, ours] : payloads[0].at("options").items()) {
      const nlohmann::json& theirs_option = payloads[r].at("options").at(option);
      TORCH_CHECK(theirs_option == ours, "[", kSaveOp, "] the ranks' save options differ: ", option,
                  " is ", printed(ours), " on rank 0, ", printed(theirs_option), " on rank ", r,
                  " (every rank must pass the same SaveOptions)");
    }
    plans.push_back(detail::plan_from_json(payloads[r].at("plan")));
  }
  // Every rank checks the same plans alike: all throw, or none does.
  std::map<std::string, ckpt::KeyEntry> keys = ckpt::detail::merge_plans(plans);
  // Opening the root may take rank 0 longer than the group's timeout: waiting for its lock
  // (SaveOptions::lock_timeout), removing stale staging, verifying checkpoints newer than
  // `latest`. The other ranks wait for it in slices of a quarter of the timeout.
  const std::string staging_name =
      detail::agree_on_one_ranks_part(comm, kSaveOp, /*worker=*/0, [&] {
        committer.writer = std::make_unique<ckpt::RootWriter>(
            root, ckpt::WriterOptions{options.lock_timeout(), options.stale_staging_timeout()});
        committer.staging = committer.writer->stage(name);
        return committer.staging->dir().filename().string();
      });

  // 2. write: each rank its own data file, fsynced.
  const std::vector<std::string> written = detail::agree(comm, kSaveOp, [&] {
    const ckpt::Directory dir =
        committing ? committer.staging->directory().duplicate() : open_staging(root, staging_name);
    ckpt::detail::DirectSource source({&mine});
    uint64_t bytes = 0;
    const auto checksums = ckpt::detail::write_rank_file(
        dir, static_cast<size_t>(rank), mine, source, options.checksum_block_bytes(), bytes);
    source.finish();  // nothing changed while it was written
    return nlohmann::json{{"bytes", bytes}, {"tensors", detail::written_to_json(checksums)}}.dump();
  });

  // 3. commit, on rank 0; everyone returns its result. Rank 0's fsyncs and retention's deletes
  // may outlast the group's timeout on slow storage: the others wait in slices, as in phase 1.
  const std::string committed =
      detail::agree_on_one_ranks_part(comm, kSaveOp, /*worker=*/0, [&]() -> std::string {
        ckpt::SaveResult result;
        std::map<std::string, std::map<std::string, ckpt::WrittenTensor>> by_file;
        for (size_t r = 0; r < written.size(); ++r) {
          const nlohmann::json w = nlohmann::json::parse(written[r]);
          result.tensor_bytes += w.at("bytes").get<uint64_t>();
          auto tensors = detail::written_from_json(w.at("tensors"));
          if (tensors.empty()) continue;
          by_file[ckpt::detail::data_file_name(r)] = std::move(tensors);
          ++result.files;
        }
        result =
            ckpt::detail::commit_checkpoint(*committer.writer, *committer.staging, std::move(keys),
                                            by_file, mine.common, options, std::move(result));
        return detail::result_to_json(result).dump();
      });
  return detail::result_from_json(nlohmann::json::parse(committed));
}

}  // namespace

ckpt::SaveResult save_checkpoint(Communicator& comm, const std::filesystem::path& root,
                                 const std::string& name, const ShardedStateDict& mine,
                                 const ckpt::SaveOptions& options) {
  return save_collectively(comm, root, name, mine, options, nullptr);
}

std::optional<ckpt::SaveResult> save_checkpoint_async(checkpoint::AsyncCheckpointSaver& saver,
                                                      std::shared_ptr<Communicator> checkpoint_comm,
                                                      const std::filesystem::path& root,
                                                      const std::string& name,
                                                      ShardedStateDict mine,
                                                      const checkpoint::SaveOptions& options) {
  TORCH_CHECK(checkpoint_comm, "[mixprec::distributed::save_checkpoint_async] the group is null");
  checkpoint_comm->check_usable("mixprec::distributed::save_checkpoint_async");
  // The name is checked in the save's first phase, which every rank must reach: thrown here on
  // a rank whose name alone is bad, it would leave the others' save to pair with its next one.
  return saver.save(std::move(mine),
                    [comm = std::move(checkpoint_comm), root, name, options](
                        const ShardedStateDict& staged, const std::exception_ptr& failed) {
                      return save_collectively(*comm, root, name, staged, options, failed);
                    });
}

}  // namespace mixprec::distributed
