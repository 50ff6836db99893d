#!/usr/bin/env bash
# The device checks, in one script for a machine with an NVIDIA GPU: builds mixprec against the
# CUDA LibTorch of whatever Python there has a CUDA torch (nothing is downloaded), then runs
# these, each required to pass at least one case (and, where it says so, to skip none):
#   - the optimizer's CUDA cases (offloading from GPU parameters: the CUDA copy engine, pinned
#     staging, side streams; none may skip), then every offloading and remainder case;
#   - training-state checkpoints, which hold each CUDA device's generator state;
#   - a one-rank NCCL group on device and host tensors (tests/distributed/init_test.cpp; may
#     not skip);
#   - the multi-process suites (collectives, gradient reducer, model check, ZeRO-1 against one
#     process and plain data parallelism, ZeRO-1 following its model, its state dict and
#     collective checkpoints) in one process on NCCL (MIXPREC_TEST_BACKEND=nccl): their MixedNet
#     models and batches live on the GPU, and their host tensors take the communicator's copy
#     through the GPU. One GPU allows one NCCL rank: NCCL refuses two ranks on one device, and
#     the cases that need two ranks skip.
#
#   scripts/gpu-check.sh            build in build-gpu/ and run
#   scripts/gpu-check.sh --bench    also build the CPU benchmarks there and, after the checks,
#                                   run bench_dist and bench_train on that machine's cores:
#                                   data parallelism where every rank and its transfers have a
#                                   core of their own (the development machine has two)
#   scripts/gpu-check.sh --bench-only   the benchmarks alone, without the checks
#   MIXPREC_PYTHON=/path/python     the Python whose torch to use (else: .venv, python3, python)
#   MIXPREC_GPU_DEPS=/path/prefix   a prefix holding the Debian packages' files (GoogleTest,
#                                   nlohmann-json, highway, xxhash, gloo headers) for a machine
#                                   that lacks them and cannot fetch them (default: .gpu-deps/usr
#                                   when it exists; `scripts/gpu-check.sh --stage-deps` fills it
#                                   from this machine's installed packages)
#   GPU_CHECK_JOBS=N                build parallelism (default: all cores)
#   GPU_CHECK_BENCH_RUNS="a;b"      --bench: the benchmark command lines to run, ';'-separated
#                                   (default "bench_train --repeats 2 --ranks 2;bench_dist");
#                                   empty: build them and run none (the main job is configured
#                                   too: cmake --build build-gpu --target mixprec-train)
#
# Exit status: 0 checks passed, or skipped because no Python here has a CUDA torch with a
# visible device (the message says which); 1 a check failed; 3 the build cannot be set up on
# this machine (missing CUDA toolkit or build dependencies; the message says what).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
build="$root/build-gpu"
say() { echo "gpu-check: $*"; }

# --stage-deps: copy the installed Debian packages' files that the build needs into
# .gpu-deps/usr (run here, before carrying .gpu-deps to a GPU machine).
deps_packages=(libgtest-dev libgmock-dev nlohmann-json3-dev libhwy-dev libhwy1 libxxhash-dev
  libxxhash0 libgloo-dev libbenchmark-dev libbenchmark1debian)
if [[ "${1:-}" == "--stage-deps" ]]; then
  rm -rf "$root/.gpu-deps"
  for pkg in "${deps_packages[@]}"; do
    dpkg -L "$pkg" >/dev/null || { say "package $pkg is not installed here"; exit 3; }
    while read -r file; do
      [[ -f "$file" || -L "$file" ]] || continue
      mkdir -p "$root/.gpu-deps$(dirname "$file")"
      cp -a "$file" "$root/.gpu-deps$file"
    done < <(dpkg -L "$pkg")
  done
  rm -rf "$root/.gpu-deps/usr/share/doc" "$root/.gpu-deps/usr/share/man"
  say "staged ${deps_packages[*]} in .gpu-deps ($(du -sh "$root/.gpu-deps" | cut -f1))"
  exit 0
fi
bench=0 checks=1
[[ "${1:-}" == --bench* ]] && bench=1
[[ "${1:-}" == --bench-only ]] && checks=0

# 1. A Python whose torch has CUDA and sees a device.
probe='import torch, sys
ok = torch.version.cuda is not None and torch.cuda.is_available()
print(torch.__version__, torch.version.cuda, torch.cuda.device_count(), sep="|")
sys.exit(0 if ok else 1)'
python=""
tried=()
for candidate in "${MIXPREC_PYTHON:-}" "$root/.venv/bin/python" python3 python; do
  [[ -n "$candidate" ]] && command -v "$candidate" >/dev/null 2>&1 || continue
  if info="$("$candidate" -c "$probe" 2>/dev/null)"; then
    python="$(command -v "$candidate")"
    break
  fi
  tried+=("$candidate: ${info:-no torch}")
done
if [[ -z "$python" ]]; then
  say "SKIP: no Python here has a CUDA torch with a visible device"
  for t in "${tried[@]}"; do say "  tried $t (version|cuda|devices)"; done
  exit 0
fi
IFS='|' read -r torch_version torch_cuda devices <<<"$info"
say "torch $torch_version (CUDA $torch_cuda, $devices device(s)) from $python"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu-check:   /'

# 2. The CUDA toolkit LibTorch's CMake package looks for (headers, nvcc): a system one, or
# the pip nvidia-* packages beside this torch.
prefix="$("$python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
site="$("$python" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')"
cuda_root=""
for dir in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda /usr/local/cuda-"$torch_cuda" /usr; do
  if [[ -n "$dir" && -x "$dir/bin/nvcc" && -f "$dir/include/cuda_runtime_api.h" ]]; then
    cuda_root="$dir"
    break
  fi
done
if [[ -z "$cuda_root" ]]; then
  for dir in "$site"/nvidia/cuda_nvcc "$site"/nvidia/cu*; do
    if [[ -x "$dir/bin/nvcc" ]]; then
      cuda_root="$dir"
      break
    fi
  done
fi
if [[ -z "$cuda_root" ]]; then
  say "CANNOT BUILD: LibTorch's CMake package needs a CUDA toolkit (nvcc + headers) and none"
  say "  was found (CUDA_HOME, /usr/local/cuda, pip nvidia-cuda-nvcc); install one matching CUDA $torch_cuda"
  exit 3
fi
say "CUDA toolkit: $cuda_root"
# NCCL's header: first the one of the pip nvidia-nccl package this torch was built with (an
# inline constructor in ProcessGroupNCCL.hpp sizes NCCL's config struct from the header we
# compile with, so another NCCL version's header could disagree with libtorch), then the
# toolkit's or the system's.
nccl_include=""
while IFS= read -r header; do
  [[ -f "$header" ]] && nccl_include="$(dirname "$header")" && break
done < <(find "$site/nvidia" -name nccl.h 2>/dev/null; echo "$cuda_root/include/nccl.h"
  echo /usr/include/nccl.h)
nccl_args=()
if [[ -n "$nccl_include" ]]; then
  say "NCCL header: $nccl_include/nccl.h"
  nccl_args=(-DMIXPREC_NCCL_INCLUDE_DIR="$nccl_include")
fi

# 3. Configure (the library and its tests; with --bench, the benchmarks and the main job too)
# and build the test binaries the checks run.
deps="${MIXPREC_GPU_DEPS:-}"
[[ -z "$deps" && -d "$root/.gpu-deps/usr" ]] && deps="$root/.gpu-deps/usr"
[[ -n "$deps" ]] && say "build dependencies from $deps" && prefix="$prefix;$deps"
generator=()
keep_going=()  # every compile error in one run: device time is short
command -v ninja >/dev/null && generator=(-G Ninja) && keep_going=(-- -k 0)
mkdir -p "$build"
# torchrun of this Python, wherever its scripts were installed (the tests and benchmarks run it).
printf '#!/bin/sh\nexec %q -m torch.distributed.run "$@"\n' "$python" >"$build/torchrun"
chmod +x "$build/torchrun"
jobs="${GPU_CHECK_JOBS:-$(nproc)}"
if ! cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" -DMIXPREC_PYTHON="$python" -DMIXPREC_TORCHRUN="$build/torchrun" \
  -DCUDAToolkit_ROOT="$cuda_root" -DCMAKE_CUDA_COMPILER="$cuda_root/bin/nvcc" "${nccl_args[@]}" \
  -DMIXPREC_BUILD_BENCH="$bench" -DMIXPREC_BUILD_EXAMPLES="$bench" -DMIXPREC_FUZZ_IN_TESTS=OFF \
  >"$build/check-configure.log" 2>&1; then
  tail -25 "$build/check-configure.log" | sed 's/^/gpu-check:   /'
  say "CANNOT BUILD: configuring failed (log: $build/check-configure.log); the build needs the"
  say "  packages scripts/common.sh lists (MIXPREC_DEBIAN_PACKAGES), or MIXPREC_GPU_DEPS"
  exit 3
fi
for feature in "CUDA offload copy engine" "NCCL backend"; do
  if ! grep -q "building the $feature" "$build/check-configure.log"; then
    say "FAIL: CMake did not build the $feature against this CUDA LibTorch; log: $build/check-configure.log"
    exit 1
  fi
done
targets=(optim_tests checkpoint_tests resume_worker distributed_tests distributed_mp_tests)
[[ $checks -eq 0 ]] && targets=(bench_dist bench_train)
say "building ${targets[*]} with $jobs jobs"
start=$SECONDS
if ! cmake --build "$build" --target "${targets[@]}" -j "$jobs" "${keep_going[@]}" >"$build/check-build.log" 2>&1; then
  grep -E -A3 "error:|Error " "$build/check-build.log" | head -60 | sed 's/^/gpu-check:   /'
  say "FAIL: the build failed (log: $build/check-build.log)"
  exit 1
fi
say "built in $((SECONDS - start)) s"

# 4. The checks. `required [--allow-skips] NAME COMMAND...` runs a filter that must run at
# least one case and pass, and skip none unless --allow-skips (a multi-process suite skips its
# cases that need two ranks).
status=0
required() {
  local allow_skips=0
  [[ "$1" == --allow-skips ]] && allow_skips=1 && shift
  local name="$1" log="$build/check-$1.log"
  shift
  say "$name: $*"
  timeout 300 "$@" >"$log" 2>&1
  local rc=$?
  grep -E -A4 '^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|error' "$log" | head -60
  if [[ $rc -ne 0 ]] || ! grep -q '^\[  PASSED  \] [1-9]' "$log" ||
    { [[ $allow_skips -eq 0 ]] && grep -q '^\[  SKIPPED \]' "$log"; }; then
    say "FAIL: $name (log: $log)"
    status=1
  fi
}
if [[ $checks -eq 1 ]]; then
  required offload-cuda "$build/tests/optim_tests" --gtest_filter='OffloadCuda.*'
  required offload "$build/tests/optim_tests" \
    --gtest_filter='Offload*:*Offload*:Remainder*:*Remainders*:*Holdings*:SnapshotChecks*:-OffloadCuda.*'
  # Training-state checkpoints save and restore each CUDA device's generator where CUDA is.
  required --allow-skips training-state env MIXPREC_RESUME_WORKER="$build/tests/resume_worker" \
    "$build/tests/checkpoint_tests" \
    --gtest_filter='TrainingState.*:AsyncSave.*:*ResumeTest*'
  required nccl-group "$build/tests/distributed_tests" \
    --gtest_filter='SingleProcess.NcclRunsEveryCollectiveOnDeviceAndHostTensors'
  # Under torchrun (some cases use its agent's store), one process.
  for suite in Collectives GradReducer ModelCheck DistributedOptimizer ZeroStateDict CollectiveCheckpoint \
    ZeroFollowsModel; do
    required --allow-skips "nccl-$suite" env MIXPREC_TEST_BACKEND=nccl \
      "$python" -m torch.distributed.run --standalone --nproc-per-node 1 --no-python \
      "$build/tests/distributed_mp_tests" --gtest_filter="$suite.*:$suite/*"
  done
  [[ $status -eq 0 ]] && say "PASS" || say "FAIL"
fi

# 5. --bench: the data-parallel and main-job benchmarks on this machine's CPU cores (Gloo; the
# GPU is not used), after the checks so that a benchmark's failure cannot hide their result.
if [[ $bench -eq 1 ]]; then
  if [[ $checks -eq 1 ]]; then  # --bench-only built them in step 3
    say "building bench_dist bench_train"
    start=$SECONDS
    if ! cmake --build "$build" --target bench_dist bench_train -j "$jobs" "${keep_going[@]}" \
      >"$build/check-bench-build.log" 2>&1; then
      grep -E -A3 "error:|Error " "$build/check-bench-build.log" | head -40 | sed 's/^/gpu-check:   /'
      say "FAIL: building the benchmarks failed (log: $build/check-bench-build.log)"
      exit 1
    fi
    say "built in $((SECONDS - start)) s"
  fi
  say "$(nproc) cores"
  IFS=';' read -r -a runs <<<"${GPU_CHECK_BENCH_RUNS-bench_train --repeats 2 --ranks 2;bench_dist}"
  for run in "${runs[@]}"; do
    say "$run"
    # shellcheck disable=SC2086
    if ! timeout 240 "$build/bench/"$run 2>&1 | tee "$build/check-${run%% *}.log"; then
      say "FAIL: ${run%% *} (log: $build/check-${run%% *}.log)"
      status=1
    fi
  done
fi
exit $status
