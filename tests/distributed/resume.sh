#!/usr/bin/env bash
# Save on N ranks, resume on M, for every pair given (ctest: distributed.resume;
# tests/distributed/mp/collective_resume_mp.cpp). Each N saves once, into its own root; every pair
# resumes from that root (a resume only reads it).
#   resume.sh TORCHRUN DIST_MP_TESTS N:M...
set -euo pipefail
torchrun=$1 binary=$2
shift 2
base=$(mktemp -d "${TMPDIR:-/tmp}/mixprec-resume-XXXXXX")
trap 'rm -rf "$base"' EXIT
export OMP_NUM_THREADS=1
launch() {  # ranks, root, test
  MIXPREC_TEST_ROOT=$2 "$torchrun" --standalone --nproc-per-node "$1" --no-python "$binary" \
    --gtest_filter="$3"
}
for pair in "$@"; do
  n=${pair%:*} m=${pair#*:}
  if [ ! -d "$base/n$n" ]; then
    echo "== save on $n rank(s)"
    mkdir "$base/n$n"
    launch "$n" "$base/n$n" CollectiveResume.Save
  fi
  echo "== resume on $m rank(s) from the save on $n"
  launch "$m" "$base/n$n" CollectiveResume.Continue
done
echo "PASS"
