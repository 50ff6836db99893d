# Shared set-up for scripts/run-demo and scripts/run-tests. Sourced, not run.
# Every step checks before it acts, so running it twice does no work twice.
set -euo pipefail

MIXPREC_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MIXPREC_VENV="${MIXPREC_VENV:-$MIXPREC_ROOT/.venv}"
MIXPREC_BUILD="${MIXPREC_BUILD:-$MIXPREC_ROOT/build}"
MIXPREC_TORCH_VERSION="2.13.0"

log() { printf '[mixprec setup] %s\n' "$*" >&2; }

# Debian packages the build needs: compiler, CMake, Ninja, GoogleTest, Google Benchmark,
# and the libraries later layers use (JSON, SIMD dispatch, checksums).
# clang and its libFuzzer runtime build the format layer's fuzz targets (fuzz/run-fuzz.sh).
MIXPREC_DEBIAN_PACKAGES=(g++ cmake ninja-build python3-venv libgtest-dev libgmock-dev
  libbenchmark-dev nlohmann-json3-dev libhwy-dev libxxhash-dev clang libclang-rt-14-dev)

ensure_debian_packages() {
  local missing=()
  for pkg in "${MIXPREC_DEBIAN_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" ||
      missing+=("$pkg")
  done
  # python3-venv is only needed when the system python lacks the venv module.
  if [[ " ${missing[*]-} " == *" python3-venv "* ]] && python3 -c 'import venv, ensurepip' 2>/dev/null; then
    missing=("${missing[@]/python3-venv/}")
  fi
  local real=()
  for pkg in "${missing[@]-}"; do [[ -n "$pkg" ]] && real+=("$pkg"); done
  ((${#real[@]} == 0)) && return 0
  if [[ $(id -u) -eq 0 ]]; then
    log "installing Debian packages: ${real[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${real[@]}" >/dev/null
  else
    log "missing Debian packages: ${real[*]}"
    log "install them with: sudo apt-get install -y ${real[*]}"
    exit 1
  fi
}

ensure_venv() {
  if [[ ! -x "$MIXPREC_VENV/bin/python" ]]; then
    log "creating virtual environment $MIXPREC_VENV"
    python3 -m venv "$MIXPREC_VENV"
  fi
  if ! "$MIXPREC_VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$MIXPREC_TORCH_VERSION')" 2>/dev/null; then
    log "installing torch==$MIXPREC_TORCH_VERSION (LibTorch comes from its wheel)"
    "$MIXPREC_VENV/bin/pip" install -q "torch==$MIXPREC_TORCH_VERSION"
  fi
  # The tests use numpy-free PyTorch and safetensors as reference readers.
  if ! "$MIXPREC_VENV/bin/python" -c "import safetensors, numpy" 2>/dev/null; then
    log "installing safetensors and numpy (test oracles)"
    "$MIXPREC_VENV/bin/pip" install -q safetensors numpy
  fi
  # scripts/plot_metrics.py draws mixprec-train's loss curves.
  if ! "$MIXPREC_VENV/bin/python" -c "import matplotlib" 2>/dev/null; then
    log "installing matplotlib (scripts/plot_metrics.py)"
    "$MIXPREC_VENV/bin/pip" install -q matplotlib
  fi
}

# Configures once (a build folder with a CMakeCache is reused), then builds incrementally.
build_project() {
  if [[ ! -f "$MIXPREC_BUILD/CMakeCache.txt" ]]; then
    local prefix
    prefix="$("$MIXPREC_VENV/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>/dev/null)"
    local launcher=()
    command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
    log "configuring $MIXPREC_BUILD"
    cmake -S "$MIXPREC_ROOT" -B "$MIXPREC_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="${CMAKE_PREFIX_PATH:+$CMAKE_PREFIX_PATH;}$prefix" \
      -DMIXPREC_PYTHON="$MIXPREC_VENV/bin/python" "${launcher[@]}" >/dev/null
  fi
  local start=$SECONDS
  cmake --build "$MIXPREC_BUILD" --parallel "$(nproc)"
  log "build finished in $((SECONDS - start)) s"
}

setup_all() {
  ensure_debian_packages
  ensure_venv
  build_project
}
