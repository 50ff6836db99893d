// Loading a whole training state from a hostile root (SPEC §4): a symbolic link to a valid
// copy outside the root, a FIFO or a device node in place of a file or of the checkpoint
// directory is a FormatError naming the path; model, optimizer and RNG stay exactly as they
// were; no file outside the root is read or written; nothing blocks.
#include "mixprec/checkpoint/format/error.h"
#include "mixprec/checkpoint/training_state.h"

#include "checkpoint/format/format_test_util.h"
#include "checkpoint/support_training.h"
#include "checkpoint/support_unchanged.h"

#include <gtest/gtest.h>

#include <functional>

namespace mixprec::checkpoint {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

namespace fs = std::filesystem;
using mixprec::testing::TrainingSetup;

struct Hostility {
  std::string name;
  // Changes <root> (holding step-1, named by `latest`); returns the path the error must name,
  // or "" to skip the case where it cannot be set up (device nodes need CAP_MKNOD).
  std::function<fs::path(const fs::path& root, const fs::path& outside)> apply;
  std::string what;  // in the error message
};

std::vector<Hostility> hostilities() {
  const auto link_file = [](const std::string& file) {
    return [file](const fs::path& root, const fs::path& outside) {
      const fs::path path = root / "step-1" / file;
      checkpoint::testing::replace_with_symlink(path, outside / "step-1" / file);
      return path;
    };
  };
  return {
      {"data file linked to a valid outside copy", link_file("data-00000.safetensors"),
       "symbolic link"},
      {"manifest linked to a valid outside copy", link_file("manifest.json"), "symbolic link"},
      {"common.json linked to a valid outside copy", link_file("common.json"), "symbolic link"},
      {"checkpoint directory linked to a valid outside copy",
       [](const fs::path& root, const fs::path& outside) {
         checkpoint::testing::replace_with_symlink(root / "step-1", outside / "step-1");
         return root / "step-1";
       },
       "symbolic link"},
      {"latest linked to an outside file naming step-1",
       [](const fs::path& root, const fs::path& outside) {
         checkpoint::testing::replace_with_symlink(root / "latest", outside / "latest");
         return root / "latest";
       },
       "symbolic link"},
      {"FIFO in place of the data file",
       [](const fs::path& root, const fs::path&) {
         checkpoint::testing::replace_with_fifo(root / "step-1" / "data-00000.safetensors");
         return root / "step-1" / "data-00000.safetensors";
       },
       "FIFO"},
      {"device node in place of the data file",
       [](const fs::path& root, const fs::path&) {
         const fs::path path = root / "step-1" / "data-00000.safetensors";
         return checkpoint::testing::replace_with_char_device(path) ? path : fs::path();
       },
       "character device"},
  };
}

TEST(LoadHostileRoot, RefusedNamingThePathNothingChangedNothingReadOutside) {
  for (const Hostility& h : hostilities()) {
    SCOPED_TRACE(h.name);
    checkpoint::testing::TempDir tmp;
    const fs::path root = tmp.path() / "root", outside = tmp.path() / "outside";
    TrainingSetup a(at::kBFloat16);
    for (int i = 0; i < 2; ++i) a.step();  // b below takes one step: a load would change it
    save_training_state(root, "step-1", *a.model, *a.optimizer);
    fs::create_directories(outside);
    fs::copy(root / "step-1", outside / "step-1", fs::copy_options::recursive);
    checkpoint::testing::write_file(outside / "latest", "step-1\n");
    const auto outside_stamps = checkpoint::testing::age_and_stamp_tree(outside);
    const fs::path named = h.apply(root, outside);
    if (named.empty()) {
      std::printf("[ skipped  ] %s: cannot be set up here\n", h.name.c_str());
      continue;
    }

    TrainingSetup b(at::kBFloat16);
    b.step();
    const ShardedStateDict before = mixprec::testing::snapshot(b);
    const at::Tensor rng_before = at::detail::getDefaultCPUGenerator().get_state();
    std::string message;
    {
      checkpoint::testing::AlarmGuard guard(120);  // a FIFO must fail the test, not hang it
      try {
        load_training_state(root, *b.model, *b.optimizer);
      } catch (const FormatError& e) {
        message = e.what();
      }
    }
    EXPECT_NE(message.find(named.string()), std::string::npos) << "message: " << message;
    EXPECT_NE(message.find(h.what), std::string::npos) << "message: " << message;
    mixprec::testing::expect_unchanged(b, before);
    EXPECT_TRUE(at::equal(at::detail::getDefaultCPUGenerator().get_state(), rng_before));
    EXPECT_EQ(checkpoint::testing::current_stamps(outside_stamps), outside_stamps)
        << "a file outside the root was read or written";
  }
}

// A link planted at the old fixed temporary name of `latest`: the save must not write
// through it (it used to open latest.tmp with O_TRUNC and follow the link).
TEST(LoadHostileRoot, PlantedLatestTmpLinkLeavesTheOutsideFileAlone) {
  checkpoint::testing::TempDir tmp;
  const fs::path root = tmp.path() / "root", victim = tmp.path() / "victim";
  TrainingSetup a(at::kBFloat16);
  save_training_state(root, "step-1", *a.model, *a.optimizer);
  checkpoint::testing::write_file(victim, "precious bytes\n");
  const checkpoint::testing::FileStamp before = checkpoint::testing::age_and_stamp(victim);
  fs::create_symlink(victim, root / "latest.tmp");
  a.step();
  try {
    save_training_state(root, "step-2", *a.model, *a.optimizer);
    EXPECT_EQ(resolve_checkpoint(root), root / "step-2");
  } catch (const FormatError& e) {
    // Failing is allowed if it is clear; writing outside the root is not.
    EXPECT_NE(std::string(e.what()).find("latest"), std::string::npos) << e.what();
  }
  EXPECT_EQ(checkpoint::testing::current_stamp(victim), before);
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::checkpoint
