#!/usr/bin/env bash
# The device checks, in one script for a machine with an NVIDIA GPU: builds mixprec against the
# CUDA LibTorch of whatever Python there has a CUDA torch (nothing is downloaded), then runs
# the optimizer tests with the CUDA cases (offloading from GPU parameters: the CUDA copy
# engine, pinned staging, side streams) required to run, not skip.
#
#   scripts/gpu-check.sh            build in build-gpu/ and run
#   MIXPREC_PYTHON=/path/python     the Python whose torch to use (else: .venv, python3, python)
#   GPU_CHECK_JOBS=N                build parallelism (default: all cores)
#
# Exit status: 0 checks passed, or skipped because no Python here has a CUDA torch with a
# visible device (the message says which); 1 a check failed; 3 the build cannot be set up on
# this machine (missing CUDA toolkit or build dependencies; the message says what).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
build="$root/build-gpu"
say() { echo "gpu-check: $*"; }

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
cuda_root=""
for dir in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda /usr/local/cuda-"$torch_cuda" /usr; do
  if [[ -n "$dir" && -x "$dir/bin/nvcc" && -f "$dir/include/cuda_runtime_api.h" ]]; then
    cuda_root="$dir"
    break
  fi
done
if [[ -z "$cuda_root" ]]; then
  site="$("$python" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')"
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

# 3. Configure (only the library and its tests) and build the optimizer tests.
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
jobs="${GPU_CHECK_JOBS:-$(nproc)}"
if ! cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" -DMIXPREC_PYTHON="$python" \
  -DCUDAToolkit_ROOT="$cuda_root" -DCMAKE_CUDA_COMPILER="$cuda_root/bin/nvcc" \
  -DMIXPREC_BUILD_BENCH=OFF -DMIXPREC_BUILD_EXAMPLES=OFF -DMIXPREC_FUZZ_IN_TESTS=OFF \
  >"$build.configure.log" 2>&1; then
  tail -25 "$build.configure.log" | sed 's/^/gpu-check:   /'
  say "CANNOT BUILD: configuring failed (log: $build.configure.log); the build needs the"
  say "  packages scripts/common.sh lists (MIXPREC_DEBIAN_PACKAGES), which cannot be fetched here"
  exit 3
fi
if ! grep -q "building the CUDA offload copy engine" "$build.configure.log"; then
  say "FAIL: CMake did not see a CUDA LibTorch (TORCH_CUDA_LIBRARIES empty); log: $build.configure.log"
  exit 1
fi
say "building optim_tests with $jobs jobs"
start=$SECONDS
if ! cmake --build "$build" --target optim_tests -j "$jobs" >"$build.build.log" 2>&1; then
  grep -E "error|Error" "$build.build.log" | head -30 | sed 's/^/gpu-check:   /'
  say "FAIL: the build failed (log: $build.build.log)"
  exit 1
fi
say "built in $((SECONDS - start)) s"

# 4. The CUDA cases must run (not skip), then every offloading and remainder case.
status=0
out="$build.tests.log"
"$build/tests/optim_tests" --gtest_filter='OffloadCuda.*' 2>&1 | tee "$out" | tail -20
if [[ ${PIPESTATUS[0]} -ne 0 ]] || ! grep -q '^\[  PASSED  \] 1 test' "$out" ||
  grep -q '^\[  SKIPPED \]' "$out"; then
  say "FAIL: the CUDA offloading case failed or was skipped"
  status=1
fi
"$build/tests/optim_tests" --gtest_brief=1 \
  --gtest_filter='Offload*:*Offload*:Remainder*:*Remainders*:*Holdings*:SnapshotChecks*' 2>&1 |
  tail -8 || status=1
[[ $status -eq 0 ]] && say "PASS" || say "FAIL"
exit $status
