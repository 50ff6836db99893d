// `mixprec-ckpt export` on checkpoints the built mixprec-train writes, run as users run both:
//   - Python's safetensors reads the export, and its values are the checkpoint's model tensors
//     as python/mixprec_reader.py assembles them — bit for bit with --dtype keep (FP32-kept
//     tensors stay FP32), torch's rounding of them with bf16/fp16/fp32; the metadata carries
//     the run's configuration and step; the same export twice gives the same bytes;
//   - sharded exports have HuggingFace's index, whose weight_map covers every tensor;
//   - mixprec-train --init-from starts from exactly the exported weights;
//   - bad arguments are one line on stderr, and a failed export leaves OUT as it was;
//   - a checkpoint written by 2 ranks (chunks) exports whole tensors;
//   - a signal that would end an export (SIGHUP, SIGINT, SIGQUIT, SIGTERM) leaves nothing behind.
#include "mixprec/checkpoint/format/safetensors_reader.h"
#include "mixprec/checkpoint/save.h"

#include "train/train_program.h"

#include <gtest/gtest.h>

#include <sys/stat.h>
#include <sys/wait.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>
#include <span>
#include <sstream>

namespace train {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using namespace train::testing;
using mixprec::checkpoint::SafetensorsReader;

// Model parameters and buffers of tiny_model(): 19 parameters and the expert bias; 8 of them
// kept FP32 by the precision plan (norms, router, expert bias).
constexpr size_t kModelTensors = 20;
constexpr size_t kKeptFp32 = 8;

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Runs `argv` through the shell, stdout and stderr captured in files of `scratch`.
ProgramRun run_command(const fs::path& scratch, const std::vector<std::string>& argv,
                       const std::string& tag = "cmd") {
  std::string command;
  for (const auto& a : argv) command.append(command.empty() ? "" : " ").append(shell_quote(a));
  const fs::path out = scratch / (tag + ".out"), err = scratch / (tag + ".err");
  command += " >" + shell_quote(out.string()) + " 2>" + shell_quote(err.string()) + " </dev/null";
  const int raw = std::system(command.c_str());
  ProgramRun run;
  run.status = (raw != -1 && WIFEXITED(raw)) ? WEXITSTATUS(raw) : -1;
  run.out = read_text(out);
  run.err = read_text(err);
  return run;
}

ProgramRun export_tool(const fs::path& scratch, std::vector<std::string> args) {
  args.insert(args.begin(), {mixprec::test::required_env("MIXPREC_CKPT_BIN"), "export"});
  return run_command(scratch, args, "export");
}

// The error contract of both programs: exit 2, exactly one line on stderr naming `fragment`.
void expect_one_line_error(const ProgramRun& run, const std::string& program,
                           const std::string& fragment) {
  EXPECT_EQ(run.status, 2) << run.err;
  EXPECT_EQ(run.err.rfind(program + ": ", 0), 0u) << run.err;
  EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << run.err;
  EXPECT_NE(run.err.find(fragment), std::string::npos) << "stderr lacks '" << fragment << "'";
}

// Nothing an export leaves behind when it is done: no mixprec-export.tmp-<pid>-<random> (its
// staging directory), no mixprec-export.old-<pid>-<random> (an export --force replaced); nor the
// OUT.tmp-<pid> and OUT.old-<pid> of earlier versions.
std::vector<std::string> leftovers(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.find(".tmp-") != std::string::npos || name.find(".old-") != std::string::npos)
      names.push_back(name);
  }
  return names;
}

std::vector<std::string> run_args(const Scratch& dir, const std::string& out, int steps) {
  return tiny_model() + std::vector<std::string>{"--data",       (dir / "corpus.txt").string(),
                                                 "--steps",      std::to_string(steps),
                                                 "--ckpt-every", "2",
                                                 "--eval-every", "2",
                                                 "--lr",         "1e-2",
                                                 "--warmup",     "1",
                                                 "--out",        out};
}

// Checks exports against their checkpoints with Python's safetensors and mixprec_reader: its
// arguments are (checkpoint, export folder, dtype) triples, checked in one Python start (each
// start imports torch: about 2 s). Prints one line per triple, "OK <tensors> <files> <FP32
// tensors>" or "FAIL" and the first difference.
constexpr const char* kPythonCheck = R"(
import json, os, sys
import torch
from safetensors import safe_open
from safetensors.torch import load_file
import mixprec_reader as mr

def check(ckpt_path, out_dir, dtype):
    ckpt = mr.Checkpoint(ckpt_path)
    source = ckpt.tensors(ckpt.model_keys())
    index_path = os.path.join(out_dir, "model.safetensors.index.json")
    index = json.load(open(index_path)) if os.path.exists(index_path) else None
    files = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
    assert sorted(os.listdir(out_dir)) == sorted(files + (["model.safetensors.index.json"] if index else []))
    got = {}
    for name in files:
        part = load_file(os.path.join(out_dir, name))
        assert not set(part) & set(got), name
        if index:
            assert all(index["weight_map"][k] == name for k in part), name
        got.update(part)
        with safe_open(os.path.join(out_dir, name), framework="pt") as f:
            meta = f.metadata()
        assert meta["format"] == "pt", meta
        assert json.loads(meta["mixprec.config"]) == ckpt.user()["config"], meta
        assert meta["mixprec.step"] == str(ckpt.user()["step"]), meta
        assert meta["mixprec.dtype"] == dtype, meta
        assert json.loads(meta["mixprec.kept_fp32"]) == ckpt.precision(), meta
    assert sorted(got) == sorted(source), (sorted(got), sorted(source))
    if index:
        assert sorted(index["weight_map"]) == sorted(source)
        size = sum(t.numel() * t.element_size() for t in got.values())
        assert index["metadata"]["total_size"] == size, (index["metadata"], size)
    wanted = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    for key, value in source.items():
        expected = value
        if dtype != "keep" and value.is_floating_point():
            expected = value.to(wanted[dtype])
        assert got[key].dtype == expected.dtype, (key, got[key].dtype, expected.dtype)
        assert got[key].shape == expected.shape, (key, got[key].shape, expected.shape)
        assert torch.equal(got[key], expected), key
    fp32 = sum(1 for t in got.values() if t.dtype == torch.float32)
    return "OK %d %d %d" % (len(got), len(files), fp32)

args = sys.argv[1:]
for i in range(0, len(args), 3):
    try:
        print(check(*args[i:i + 3]))
    except AssertionError as e:
        print("FAIL", repr(e)[:2000].replace("\n", " "))
)";

// One export to check: the checkpoint it came from, its folder, the dtype asked for.
struct ExportCheck {
  fs::path checkpoint;
  fs::path out;
  std::string dtype;
};

// kPythonCheck's line for each check, in order; or one line saying why Python failed.
std::vector<std::string> python_check(const fs::path& scratch,
                                      const std::vector<ExportCheck>& checks) {
  const fs::path script = scratch / "check_export.py";
  if (!fs::exists(script)) std::ofstream(script) << kPythonCheck;
  std::vector<std::string> argv = {"env", "PYTHONPATH=" + mixprec::test::source_dir() + "/python",
                                   mixprec::test::python(), script.string()};
  for (const ExportCheck& c : checks) {
    argv.insert(argv.end(), {c.checkpoint.string(), c.out.string(), c.dtype});
  }
  const ProgramRun run = run_command(scratch, argv, "python");
  if (run.status != 0) return {"python failed (" + std::to_string(run.status) + "): " + run.err};
  std::vector<std::string> lines;
  std::istringstream out(run.out);
  for (std::string line; std::getline(out, line);) lines.push_back(line);
  return lines;
}

// name → (dtype, shape, bytes) of every tensor in an export's files.
std::map<std::string, std::string> exported_tensors(const fs::path& out) {
  std::map<std::string, std::string> tensors;
  for (const auto& entry : fs::directory_iterator(out)) {
    if (entry.path().extension() != ".safetensors") continue;
    const SafetensorsReader reader(entry.path());
    for (const auto& t : reader.header().tensors) {
      std::string bytes(t.byte_size(), '\0');
      reader.read(t.name, std::as_writable_bytes(std::span(bytes.data(), bytes.size())));
      std::string shape;
      for (int64_t d : t.shape) shape += std::to_string(d) + ",";
      tensors[t.name] =
          std::string(mixprec::checkpoint::dtype_name(t.dtype)) + "[" + shape + "] " + bytes;
    }
  }
  return tensors;
}

// One trained run for the whole suite: steps 2 and 4 checkpointed.
class Export : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new Scratch;
    write_corpus(*dir_ / "corpus.txt");
    const ProgramRun run = run_program(dir_->path(), run_args(*dir_, "run", 4), "train");
    ASSERT_EQ(run.status, 0) << run.err;
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  const fs::path& scratch() const { return dir_->path(); }
  fs::path root() const { return *dir_ / "run/checkpoints"; }

  static Scratch* dir_;
};
Scratch* Export::dir_ = nullptr;

TEST_F(Export, KeepAndEveryDtypeMatchTheCheckpointInPython) {
  if (mixprec::test::python().empty())
    GTEST_SKIP() << "no Python with torch and safetensors (MIXPREC_PYTHON)";
  // Keep, from the root (its latest, step 4): the FP32-kept tensors stay FP32.
  const ProgramRun keep = export_tool(scratch(), {root().string(), (scratch() / "keep").string()});
  ASSERT_EQ(keep.status, 0) << keep.err;
  EXPECT_TRUE(keep.err.empty()) << keep.err;
  EXPECT_NE(keep.out.find(std::to_string(kModelTensors) + " model tensors"), std::string::npos)
      << keep.out;
  std::vector<ExportCheck> checks = {{root() / "step-000004", scratch() / "keep", "keep"}};
  std::vector<std::string> expected = {"OK " + std::to_string(kModelTensors) + " 1 " +
                                       std::to_string(kKeptFp32)};
  // Converted, from a checkpoint directory: every floating tensor in the dtype asked for.
  const std::map<std::string, size_t> fp32_expected = {{"bf16", 0}, {"fp16", 0}, {"fp32", 20}};
  for (const auto& [dtype, fp32] : fp32_expected) {
    SCOPED_TRACE(dtype);
    const fs::path out = scratch() / dtype;
    const ProgramRun run =
        export_tool(scratch(), {(root() / "step-000002").string(), out.string(), "--dtype", dtype});
    ASSERT_EQ(run.status, 0) << run.err;
    checks.push_back({root() / "step-000002", out, dtype});
    expected.push_back("OK " + std::to_string(kModelTensors) + " 1 " + std::to_string(fp32));
  }
  EXPECT_EQ(python_check(scratch(), checks), expected);  // keep, bf16, fp16, fp32
  EXPECT_EQ(leftovers(scratch()), std::vector<std::string>{});
}

TEST_F(Export, SameCheckpointSameBytes) {
  ASSERT_EQ(export_tool(scratch(), {root().string(), (scratch() / "again-1").string()}).status, 0);
  ASSERT_EQ(export_tool(scratch(), {root().string(), (scratch() / "again-2").string()}).status, 0);
  const auto a = snapshot(scratch() / "again-1");
  EXPECT_EQ(a.size(), 1u);
  EXPECT_EQ(a, snapshot(scratch() / "again-2"));
}

TEST_F(Export, ShardsHaveAHuggingFaceIndexCoveringEveryTensor) {
  const fs::path out = scratch() / "sharded";
  const ProgramRun run =
      export_tool(scratch(), {root().string(), out.string(), "--max-shard-size", "20KB"});
  ASSERT_EQ(run.status, 0) << run.err;
  const nlohmann::json index =
      nlohmann::json::parse(read_text(out / "model.safetensors.index.json"));
  const auto& weight_map = index.at("weight_map");
  EXPECT_EQ(weight_map.size(), kModelTensors);
  std::set<std::string> files;
  for (const auto& [name, file] : weight_map.items()) files.insert(file.get<std::string>());
  ASSERT_GT(files.size(), 1u);
  uint64_t total = 0;
  size_t k = 1;
  for (const std::string& file : files) {
    char expected[64];
    std::snprintf(expected, sizeof expected, "model-%05zu-of-%05zu.safetensors", k++, files.size());
    EXPECT_EQ(file, expected);
    const SafetensorsReader reader(out / file);
    // At most 20 kB of tensor bytes per shard, unless one tensor alone is larger.
    EXPECT_TRUE(reader.header().data_size <= 20000 || reader.header().tensors.size() == 1) << file;
    total += reader.header().data_size;
    for (const auto& t : reader.header().tensors) EXPECT_EQ(weight_map.at(t.name), file);
  }
  EXPECT_EQ(index.at("metadata").at("total_size").get<uint64_t>(), total);
  // The same tensors as the single-file export.
  ASSERT_EQ(export_tool(scratch(), {root().string(), (scratch() / "whole").string()}).status, 0);
  EXPECT_EQ(exported_tensors(out), exported_tensors(scratch() / "whole"));
  if (mixprec::test::python().empty())
    GTEST_SKIP() << "no Python with torch and safetensors (MIXPREC_PYTHON)";
  EXPECT_EQ(
      python_check(scratch(), {{root() / "step-000004", out, "keep"}}),
      std::vector<std::string>{"OK " + std::to_string(kModelTensors) + " " +
                               std::to_string(files.size()) + " " + std::to_string(kKeptFp32)});
}

TEST_F(Export, BadArgumentsAreOneLineAndLeaveOutAsItWas) {
  const std::string ckpt = "mixprec-ckpt";
  const std::string x = (scratch() / "x").string();
  const fs::path out = scratch() / "existing";
  ASSERT_EQ(export_tool(scratch(), {root().string(), out.string()}).status, 0);
  const auto before = snapshot(out);

  expect_one_line_error(export_tool(scratch(), {(scratch() / "nope").string(), x}), ckpt,
                        (scratch() / "nope").string() + ": no such file or directory");
  expect_one_line_error(export_tool(scratch(), {root().string(), x, "--dtype", "int8"}), ckpt,
                        "unknown --dtype 'int8' (one of bf16, fp16, fp32, keep)");
  expect_one_line_error(export_tool(scratch(), {root().string()}), ckpt,
                        "export: expected 2 arguments, got 1");
  expect_one_line_error(export_tool(scratch(), {root().string(), x, "extra"}), ckpt,
                        "export: expected 2 arguments, got 3");
  expect_one_line_error(export_tool(scratch(), {root().string(), x, "--max-shard-size", "lots"}),
                        ckpt, "--max-shard-size 'lots'");
  expect_one_line_error(
      export_tool(scratch(), {root().string(), x, "--max-shard-size", "1" + std::string(400, '0')}),
      ckpt, "below 2^63");
  expect_one_line_error(export_tool(scratch(), {root().string(), x, "--max-shard-size", "0"}), ckpt,
                        "--max-shard-size '0' must be at least 1 byte");
  expect_one_line_error(export_tool(scratch(), {root().string(), x, "--frobnicate"}), ckpt,
                        "unknown option '--frobnicate'");
  EXPECT_FALSE(fs::exists(x));

  // An existing OUT is refused without --force.
  expect_one_line_error(export_tool(scratch(), {root().string(), out.string(), "--dtype", "bf16"}),
                        ckpt, out.string() + ": already exists");
  EXPECT_EQ(snapshot(out), before);

  // --force never replaces what is not an export: a file,
  const fs::path file = scratch() / "file";
  std::ofstream(file) << "mine\n";
  expect_one_line_error(export_tool(scratch(), {root().string(), file.string(), "--force"}), ckpt,
                        file.string() + ": exists and is not a directory");
  EXPECT_EQ(read_text(file), "mine\n");
  // a directory holding another file,
  const fs::path other = scratch() / "other";
  fs::create_directories(other);
  std::ofstream(other / "notes.txt") << "mine\n";
  expect_one_line_error(export_tool(scratch(), {root().string(), other.string(), "--force"}), ckpt,
                        "holds 'notes.txt'");
  EXPECT_EQ(read_text(other / "notes.txt"), "mine\n");
  // or a directory that only bears an export file's name.
  const fs::path nested = scratch() / "nested";
  fs::create_directories(nested / "model.safetensors");
  std::ofstream(nested / "model.safetensors" / "notes.txt") << "mine\n";
  expect_one_line_error(export_tool(scratch(), {root().string(), nested.string(), "--force"}), ckpt,
                        "holds 'model.safetensors'");
  EXPECT_EQ(read_text(nested / "model.safetensors" / "notes.txt"), "mine\n");

  // A corrupt model tensor (tok_emb.weight: written last) fails the export half-way through
  // the writing: OUT is as it was.
  const fs::path corrupt = scratch() / "corrupt";
  fs::copy(root() / "step-000004", corrupt, fs::copy_options::recursive);
  const nlohmann::json chunk = nlohmann::json::parse(read_text(corrupt / "manifest.json"))
                                   .at("keys")
                                   .at("tok_emb.weight")
                                   .at("chunks")
                                   .at(0);
  const fs::path data = corrupt / chunk.at("file").get<std::string>();
  const SafetensorsReader reader(data);
  const auto& header = reader.header();
  const uint64_t at =
      header.data_offset() + header.find(chunk.at("tensor").get<std::string>())->begin;
  std::string bytes = read_text(data);
  bytes[at] = static_cast<char>(bytes[at] ^ 0x10);
  std::ofstream(data, std::ios::binary | std::ios::trunc) << bytes;
  expect_one_line_error(export_tool(scratch(), {corrupt.string(), out.string(), "--force"}), ckpt,
                        "left as it was");
  EXPECT_EQ(snapshot(out), before);
  EXPECT_EQ(leftovers(scratch()), std::vector<std::string>{});

  // With --force, a good export replaces it whole.
  const ProgramRun replaced =
      export_tool(scratch(), {root().string(), out.string(), "--force", "--dtype=bf16"});
  ASSERT_EQ(replaced.status, 0) << replaced.err;
  EXPECT_NE(snapshot(out), before);
  EXPECT_EQ(SafetensorsReader(out / "model.safetensors").header().metadata.at("mixprec.dtype"),
            "bf16");
  EXPECT_EQ(leftovers(scratch()), std::vector<std::string>{});
}

// mixprec-train --init-from: a fresh run starts from the export's weights. One step with a
// learning rate too small to move any weight (1e-30: below half an ULP of every weight; no
// weight decay, no expert-bias update) leaves them as they were, so the checkpoint after it,
// exported again, holds exactly the tensors that were loaded.
TEST_F(Export, InitFromStartsTrainingFromTheExportedWeights) {
  const fs::path out = scratch() / "init";
  ASSERT_EQ(export_tool(scratch(), {root().string(), out.string()}).status, 0);
  const fs::path sharded = scratch() / "init-sharded";
  ASSERT_EQ(export_tool(scratch(), {root().string(), sharded.string(), "--max-shard-size", "20KB"})
                .status,
            0);
  const std::vector<std::string> still = {
      "--steps",        "1", "--ckpt-every",       "1", "--lr", "1e-30",
      "--weight-decay", "0", "--bias-update-rate", "0"};
  // From the export directory, from its file, and from a sharded export.
  const std::map<std::string, fs::path> sources = {
      {"dir", out}, {"file", out / "model.safetensors"}, {"shards", sharded}};
  for (const auto& [how, source] : sources) {
    SCOPED_TRACE(how);
    const std::string name = "from-" + how;
    const ProgramRun run = run_program(
        scratch(),
        run_args(*dir_, name, 1) + still + std::vector<std::string>{"--init-from", source.string()},
        name);
    ASSERT_EQ(run.status, 0) << run.err;
    EXPECT_NE(run.out.find("weights      20 tensors from"), std::string::npos) << run.out;
    const fs::path again = scratch() / (name + "-export");
    ASSERT_EQ(export_tool(scratch(), {(scratch() / name / "checkpoints").string(), again.string()})
                  .status,
              0);
    EXPECT_EQ(exported_tensors(again), exported_tensors(out));
  }
  // A BF16 export loads too: into the FP32 router and norms, converted.
  const fs::path bf16 = scratch() / "init-bf16";
  ASSERT_EQ(export_tool(scratch(), {root().string(), bf16.string(), "--dtype", "bf16"}).status, 0);
  const ProgramRun from_bf16 = run_program(
      scratch(),
      run_args(*dir_, "from-bf16", 1) + std::vector<std::string>{"--init-from", bf16.string()},
      "from-bf16");
  EXPECT_EQ(from_bf16.status, 0) << from_bf16.err;
}

TEST_F(Export, InitFromRefusesWhatDoesNotFit) {
  const std::string train = "mixprec-train";
  const fs::path out = scratch() / "init-refused";
  ASSERT_EQ(export_tool(scratch(), {root().string(), out.string()}).status, 0);
  const auto with = [&](const std::string& name, std::vector<std::string> extra) {
    return run_program(scratch(), run_args(*dir_, name, 1) + extra, name);
  };
  expect_one_line_error(with("r1", {"--init-from", out.string(), "--resume"}), train,
                        "--init-from starts a new run from exported weights; --resume");
  expect_one_line_error(with("r2", {"--init-from", (scratch() / "missing").string()}), train,
                        (scratch() / "missing").string() + ": no such file or directory");
  expect_one_line_error(with("r3", {"--init-from", root().string()}), train,
                        "holds neither model.safetensors.index.json nor model.safetensors");
  // Another model shape: the first tensor that differs, and the file.
  expect_one_line_error(with("r4", {"--init-from", out.string(), "--d-model", "64"}), train,
                        "--init-from " + (out / "model.safetensors").string() +
                            ": tensor 'blocks.0.attn.proj.weight'"
                            " has shape [32, 32], the model's is [64, 64]");
  // Another number of layers: a tensor the model lacks.
  expect_one_line_error(with("r5", {"--init-from", out.string(), "--layers", "2"}), train,
                        "no tensor 'blocks.1.attn.proj.weight', which the model has");
}

// A checkpoint written by 2 ranks stores each model tensor in chunks; the export holds them
// whole, equal to what Python assembles from the chunks, with the names, shapes and dtypes of
// a one-process run's export. (The values differ from one process's: 2 ranks sum BF16
// gradients in another order, tests/train/data_parallel_test.cpp.)
TEST_F(Export, TwoRankCheckpointExportsWholeTensors) {
  if (mixprec::test::torchrun().empty()) GTEST_SKIP() << "no torchrun beside MIXPREC_PYTHON";
  const ProgramRun run = run_program(scratch(), run_args(*dir_, "two", 4), "two", 2);
  ASSERT_EQ(run.status, 0) << run.err;
  const fs::path ckpt = scratch() / "two/checkpoints/step-000004";
  const nlohmann::json manifest = nlohmann::json::parse(read_text(ckpt / "manifest.json"));
  EXPECT_EQ(manifest.at("keys").at("tok_emb.weight").at("chunks").size(), 2u);

  const fs::path out = scratch() / "two-export";
  ASSERT_EQ(export_tool(scratch(), {ckpt.string(), out.string()}).status, 0);
  ASSERT_EQ(export_tool(scratch(), {root().string(), (scratch() / "one-export").string()}).status,
            0);
  const auto header = [](const fs::path& file) {
    std::map<std::string, std::string> layout;
    const SafetensorsReader reader(file);  // owns the header the loop reads
    for (const auto& t : reader.header().tensors) {
      layout[t.name] = std::string(mixprec::checkpoint::dtype_name(t.dtype)) + " " +
                       std::to_string(t.byte_size());
    }
    return layout;
  };
  EXPECT_EQ(header(out / "model.safetensors"), header(scratch() / "one-export/model.safetensors"));
  if (mixprec::test::python().empty())
    GTEST_SKIP() << "no Python with torch and safetensors (MIXPREC_PYTHON)";
  EXPECT_EQ(python_check(scratch(), {{ckpt, out, "keep"}}),
            std::vector<std::string>{"OK " + std::to_string(kModelTensors) + " 1 " +
                                     std::to_string(kKeptFp32)});
}

// OUT's name may be as long as a name can be (255 bytes): the export's temporary names do not
// grow with it.
TEST_F(Export, AnOutNameOfTheLongestLengthIsExportedAndReplaced) {
  const fs::path parent = scratch() / "long";
  fs::create_directories(parent);
  const fs::path out = parent / std::string(255, 'o');
  const ProgramRun first = export_tool(scratch(), {root().string(), out.string()});
  ASSERT_EQ(first.status, 0) << first.err;
  EXPECT_TRUE(fs::exists(out / "model.safetensors"));
  const ProgramRun forced =
      export_tool(scratch(), {root().string(), out.string(), "--force", "--dtype", "bf16"});
  ASSERT_EQ(forced.status, 0) << forced.err;
  EXPECT_EQ(SafetensorsReader(out / "model.safetensors").header().metadata.at("mixprec.dtype"),
            "bf16");
  EXPECT_EQ(leftovers(parent), std::vector<std::string>{});
  EXPECT_EQ(std::distance(fs::directory_iterator(parent), fs::directory_iterator()), 1);
}

// A hand-made checkpoint: `tensors` and `common` saved as <dir>/root/step-1.
fs::path save_state(const Scratch& dir, const std::map<std::string, at::Tensor>& tensors,
                    const nlohmann::json& common = nlohmann::json::object()) {
  mixprec::ShardedStateDict state;
  for (const auto& [name, value] : tensors) {
    state.tensors.emplace(name, mixprec::ShardedTensor::whole(value));
  }
  state.common = common;
  return mixprec::checkpoint::save_checkpoint(dir / "root", "step-1", state).dir;
}

// The tensors of each file of an export, in the files' order: file → names.
std::map<std::string, std::vector<std::string>> shard_layout(const fs::path& out) {
  std::map<std::string, std::vector<std::string>> layout;
  for (const auto& entry : fs::directory_iterator(out)) {
    if (entry.path().extension() != ".safetensors") continue;
    auto& names = layout[entry.path().filename().string()];
    const SafetensorsReader reader(entry.path());  // owns the header the loop reads
    for (const auto& t : reader.header().tensors) names.push_back(t.name);
  }
  return layout;
}

// A zero-size tensor (an empty expert, a [0, d] parameter) is exported like any other, with
// its shape.
TEST(ExportZeroSize, AZeroSizeTensorIsExportedWithItsShape) {
  Scratch dir;
  save_state(dir, {{"w", at::arange(4, at::kFloat)}, {"empty", at::zeros({0, 8}, at::kBFloat16)}});
  const ProgramRun run =
      export_tool(dir.path(), {(dir / "root/step-1").string(), (dir / "out").string()});
  ASSERT_EQ(run.status, 0) << run.err;
  const SafetensorsReader reader(dir / "out/model.safetensors");
  ASSERT_NE(reader.header().find("empty"), nullptr) << run.out;
  EXPECT_EQ(reader.header().find("empty")->shape, (std::vector<int64_t>{0, 8}));
  ASSERT_NE(reader.header().find("w"), nullptr);
}

// --dtype converts the floating tensors only: integer and bool tensors keep theirs. The metadata
// names the checkpoint (not its path), and the step is the optimizer's when the run recorded none.
TEST(ExportHandMade, DtypeConvertsOnlyFloatingTensors) {
  Scratch dir;
  save_state(dir,
             {{"w", at::ones({4})},
              {"h", at::ones({2}, at::kBFloat16)},
              {"count", at::arange(3, at::kLong)},
              {"mask", at::ones({2}, at::kBool)}},
             {{"optimizer", {{"step", 7}}}});
  const ProgramRun run =
      export_tool(dir.path(), {(dir / "root").string(), (dir / "out").string(), "--dtype", "fp16"});
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_NE(run.out.find("4 model tensors, 38 bytes (38 B), dtype fp16 (2 converted), step 7\n"),
            std::string::npos)
      << run.out;
  const SafetensorsReader reader(dir / "out/model.safetensors");
  using mixprec::checkpoint::Dtype;
  const std::map<std::string, Dtype> expected = {
      {"w", Dtype::F16}, {"h", Dtype::F16}, {"count", Dtype::I64}, {"mask", Dtype::BOOL}};
  for (const auto& [name, dtype] : expected) {
    ASSERT_NE(reader.header().find(name), nullptr) << name;
    EXPECT_EQ(reader.header().find(name)->dtype, dtype) << name;
  }
  EXPECT_EQ(reader.header().metadata.at("mixprec.checkpoint"), "step-1");
  EXPECT_EQ(reader.header().metadata.at("mixprec.step"), "7");
}

// --max-shard-size counts tensor bytes, KB as 1000 and KiB as 1024: a shard may be exactly that
// large, and a tensor larger than it gets a shard of its own (no empty shard before it).
TEST(ExportHandMade, ShardsAreCutAtMaxShardSize) {
  Scratch dir;
  // Three tensors of 512 bytes.
  const fs::path ckpt =
      save_state(dir, {{"a", at::zeros({128})}, {"b", at::zeros({128})}, {"c", at::zeros({128})}});
  using Names = std::vector<std::string>;
  using Layout = std::map<std::string, Names>;
  const Layout one = {{"model.safetensors", Names{"a", "b", "c"}}};
  const Layout two = {{"model-00001-of-00002.safetensors", Names{"a", "b"}},
                      {"model-00002-of-00002.safetensors", Names{"c"}}};
  const Layout three = {{"model-00001-of-00003.safetensors", Names{"a"}},
                        {"model-00002-of-00003.safetensors", Names{"b"}},
                        {"model-00003-of-00003.safetensors", Names{"c"}}};
  const std::pair<std::string, Layout> cases[] = {{"1KiB", two},  {"1024", two},  {"1023B", three},
                                                  {"1KB", three}, {"100", three}, {"2kb", one}};
  for (const auto& [size, layout] : cases) {
    SCOPED_TRACE(size);
    const fs::path out = dir / ("out-" + size);
    const ProgramRun run =
        export_tool(dir.path(), {ckpt.string(), out.string(), "--max-shard-size", size});
    ASSERT_EQ(run.status, 0) << run.err;
    EXPECT_EQ(shard_layout(out), layout);
  }
}

// A checkpoint with optimizer and RNG state only has nothing to export.
TEST(ExportHandMade, ACheckpointWithoutModelTensorsIsRefused) {
  Scratch dir;
  const fs::path ckpt = save_state(
      dir, {{"optimizer.state.exp_avg.w", at::zeros({2})}, {"rng.cpu", at::zeros({8}, at::kByte)}});
  expect_one_line_error(export_tool(dir.path(), {ckpt.string(), (dir / "out").string()}),
                        "mixprec-ckpt", "holds no model tensors (only optimizer or RNG state)");
  EXPECT_FALSE(fs::exists(dir / "out"));
}

// Starts `mixprec-ckpt export <args>`, stdout and stderr to files in `scratch` (wait_program
// reads them); its pid.
// `ignored`: a signal the export starts with ignored (as under nohup), 0 for none.
// `ignored`: a signal the export starts with ignored. `leftover_in`: a directory in which the
// child first makes mixprec-export.tmp-<its pid>, as a killed export of that pid left it.
pid_t start_export(const fs::path& scratch, const std::vector<std::string>& args,
                   const std::string& tag, int ignored = 0, const fs::path& leftover_in = {}) {
  // Everything resolved before fork(): the child only execs.
  std::string bin = mixprec::test::required_env("MIXPREC_CKPT_BIN"), command = "export";
  std::vector<std::string> copy = args;
  std::vector<char*> argv = {bin.data(), command.data()};
  for (std::string& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  const std::string out = (scratch / (tag + ".out")).string();
  const std::string err = (scratch / (tag + ".err")).string();
  const std::string leftover_prefix =
      leftover_in.empty() ? "" : (leftover_in / "mixprec-export.tmp-").string();
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (!leftover_prefix.empty()) {
      char name[4096];
      std::snprintf(name, sizeof name, "%s%ld", leftover_prefix.c_str(),
                    static_cast<long>(::getpid()));
      if (::mkdir(name, 0755) != 0) ::_exit(126);
    }
    ::dup2(::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644), 1);
    ::dup2(::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644), 2);
    ::dup2(::open("/dev/null", O_RDONLY), 0);
    if (ignored != 0) ::signal(ignored, SIG_IGN);  // kept across exec, as nohup relies on
    ::execv(bin.c_str(), argv.data());
    ::_exit(127);
  }
  return pid;
}

// A signal that would end the process (a scheduler's SIGTERM, Ctrl-C, a dropped ssh session's
// SIGHUP, Ctrl-\) while an export writes: it stops, removes its staging directory and exits
// with 128 + the signal; OUT does not appear and nothing is left beside it.
// The suite exports one checkpoint, 64 MiB in 32 tensors (an export of it takes long enough to
// be caught writing), written once for all its tests; each exports into a parent of its own.
class ExportInterrupted : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new Scratch;
    mixprec::ShardedStateDict state;
    at::manual_seed(3);
    for (int i = 0; i < 32; ++i) {
      state.tensors.emplace("layer." + std::to_string(i) + ".weight",
                            mixprec::ShardedTensor::whole(at::rand({512, 1024})));
    }
    ckpt_ = new fs::path(mixprec::checkpoint::save_checkpoint(*dir_ / "root", "big", state).dir);
  }
  static void TearDownTestSuite() {
    delete ckpt_;
    delete dir_;
    ckpt_ = nullptr;
    dir_ = nullptr;
  }
  // The suite's scratch directory (the exports' stdout and stderr files go there).
  const fs::path& scratch() const { return dir_->path(); }
  const fs::path& ckpt() const { return *ckpt_; }
  // A new, empty directory `name` in the scratch directory: an export's OUT goes in it.
  fs::path empty_parent(const std::string& name) const {
    const fs::path parent = *dir_ / name;
    fs::create_directories(parent);
    return parent;
  }

 private:
  static inline Scratch* dir_ = nullptr;
  static inline fs::path* ckpt_ = nullptr;
};

// Returns once the export started as `pid` has created its staging directory in the empty
// `parent` (it is writing); false if it ended first.
bool wait_until_writing(pid_t pid, const fs::path& parent, int& raw) {
  while (fs::is_empty(parent)) {
    if (::waitpid(pid, &raw, WNOHANG) == pid) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

TEST_F(ExportInterrupted, EverySignalThatWouldEndItLeavesNothingBehind) {
  const std::pair<int, std::string> signals[] = {
      {SIGHUP, "SIGHUP"}, {SIGINT, "SIGINT"}, {SIGQUIT, "SIGQUIT"}, {SIGTERM, "SIGTERM"}};
  for (const auto& [signal, name] : signals) {
    SCOPED_TRACE(name);
    const fs::path parent = empty_parent("out-" + name);
    const pid_t pid = start_export(
        scratch(), {ckpt().string(), (parent / "out").string(), "--dtype", "fp16"}, name);
    // Its staging directory is the first entry of the empty parent: once it is there, the
    // export is writing.
    int raw = 0;
    ASSERT_TRUE(wait_until_writing(pid, parent, raw))
        << "the export ended before it wrote: " << read_text(scratch() / (name + ".err"));
    ASSERT_EQ(::kill(pid, signal), 0);
    const ProgramRun run = wait_program(scratch(), pid, name);
    ASSERT_NE(run.status, 0) << "the export finished before the signal came; make it larger";
    EXPECT_EQ(run.status, 128 + signal) << "(-1: killed by the signal) " << run.err;
    EXPECT_EQ(run.err, "mixprec-ckpt: interrupted by " + name + "; " + (parent / "out").string() +
                           " left as it was\n");
    EXPECT_TRUE(fs::is_empty(parent))
        << "left beside OUT: " << fs::directory_iterator(parent)->path();
  }
}

// Under nohup SIGHUP is ignored from the start, so that the export outlives the session: it
// must stay ignored, and the export finish.
TEST_F(ExportInterrupted, ASignalIgnoredAtStartStaysIgnored) {
  const fs::path parent = empty_parent("out-nohup");
  const pid_t pid =
      start_export(scratch(), {ckpt().string(), (parent / "out").string()}, "nohup", SIGHUP);
  int raw = 0;
  ASSERT_TRUE(wait_until_writing(pid, parent, raw))
      << "the export ended before it wrote: " << read_text(scratch() / "nohup.err");
  ASSERT_EQ(::kill(pid, SIGHUP), 0);
  const ProgramRun run = wait_program(scratch(), pid, "nohup");
  EXPECT_EQ(run.status, 0) << "(-1: killed by the signal) " << run.err;
  EXPECT_TRUE(fs::exists(parent / "out" / "model.safetensors"));
}

// An export killed outright (SIGKILL, the OOM killer) leaves its staging directory. A later
// export that gets the same pid must not trip over it.
TEST_F(ExportInterrupted, ALeftoverOfAKilledExportWithTheSamePidIsNoObstacle) {
  const fs::path parent = empty_parent("out-reused-pid");
  const pid_t pid =
      start_export(scratch(), {ckpt().string(), (parent / "out").string()}, "reused", 0, parent);
  const ProgramRun run = wait_program(scratch(), pid, "reused");
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_TRUE(fs::exists(parent / "out" / "model.safetensors"));
  EXPECT_TRUE(fs::exists(parent / ("mixprec-export.tmp-" + std::to_string(pid))))
      << "someone else's leftover is not the export's to remove";
}

// --force replaces an export that held only export files when the export began. A file added
// to it while the new one is written is nobody's to delete: the replaced directory is kept
// beside OUT, and the report's note says where.
TEST_F(ExportInterrupted, AFileAddedToTheReplacedExportMeanwhileIsKept) {
  const fs::path parent = empty_parent("out-force");
  const fs::path out = parent / "out";
  ASSERT_EQ(wait_program(scratch(), start_export(scratch(), {ckpt().string(), out.string()}, "one"),
                         "one")
                .status,
            0);
  const pid_t pid =
      start_export(scratch(), {ckpt().string(), out.string(), "--force", "--dtype", "fp16"}, "two");
  // Writing once its staging directory is there beside OUT.
  const auto staging_exists = [&] {
    for (const auto& entry : fs::directory_iterator(parent)) {
      if (entry.path().filename().string().starts_with("mixprec-export.tmp-")) return true;
    }
    return false;
  };
  int raw = 0;
  while (!staging_exists()) {
    ASSERT_NE(::waitpid(pid, &raw, WNOHANG), pid) << "the export ended before it wrote";
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  std::ofstream(out / "notes.txt") << "mine\n";
  const ProgramRun run = wait_program(scratch(), pid, "two");
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_TRUE(fs::exists(out / "model.safetensors"));
  EXPECT_FALSE(fs::exists(out / "notes.txt"));
  std::vector<fs::path> kept;
  for (const auto& entry : fs::directory_iterator(parent)) {
    if (entry.path() != out) kept.push_back(entry.path());
  }
  ASSERT_EQ(kept.size(), 1u) << "the replaced export, kept";
  EXPECT_EQ(read_text(kept[0] / "notes.txt"), "mine\n");
  EXPECT_NE(run.out.find("note: the replaced export gained 'notes.txt' while exporting, which an "
                         "export does not write: kept as " +
                         kept[0].string()),
            std::string::npos)
      << run.out;
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace train
