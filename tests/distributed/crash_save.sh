#!/usr/bin/env bash
# A rank SIGKILLed during a collective save (ctest: distributed.crash_save;
# tests/distributed/mp/collective_resume_mp.cpp, CollectiveCrash). Two scenarios, each in its own root:
#   1. rank 1 of 3 dies halfway through writing its data file while "b" is saved: `latest`
#      still names "a", which loads on 2 ranks and on 1;
#   2. rank 0 of 2 (the committing rank) dies the same way: its staging directory stays
#      behind; "a" loads on 3 ranks, whose next save cleans the staging and commits "c".
#   3. as 1, rank 1 of 2, but "b" is saved in the background (save_checkpoint_async) while
#      training goes on: the same guarantees; "a" loads on 1 rank and on 3, which save "c".
#   crash_save.sh TORCHRUN DIST_MP_TESTS
set -uo pipefail
torchrun=$1 binary=$2
base=$(mktemp -d "${TMPDIR:-/tmp}/mixprec-crash-XXXXXX")
trap 'rm -rf "$base"' EXIT
export OMP_NUM_THREADS=1
launch() {  # ranks, test
  "$torchrun" --standalone --nproc-per-node "$1" --no-python "$binary" --gtest_filter="$2"
}
expect_killed() {  # ranks, dying rank
  echo "== save on $1 ranks; rank $2 is killed mid-save"
  if MIXPREC_TEST_DIE_RANK=$2 launch "$1" CollectiveCrash.SaveThenDie; then
    echo "FAIL: the launch with a killed rank succeeded"
    exit 1
  fi
}
check() {  # ranks, extra environment...
  local ranks=$1
  shift
  echo "== load on $ranks rank(s) $*"
  env "$@" "$torchrun" --standalone --nproc-per-node "$ranks" --no-python "$binary" \
    --gtest_filter=CollectiveCrash.PreviousCheckpointStillLoads || { echo "FAIL"; exit 1; }
}

export MIXPREC_TEST_ROOT=$base/one
expect_killed 3 1
ls -a "$MIXPREC_TEST_ROOT"
check 1 X=1
check 2 MIXPREC_TEST_SAVE_AFTER=1

export MIXPREC_TEST_ROOT=$base/two
expect_killed 2 0
ls -a "$MIXPREC_TEST_ROOT"
check 3 MIXPREC_TEST_EXPECT_STALE=1 MIXPREC_TEST_SAVE_AFTER=1

export MIXPREC_TEST_ROOT=$base/async
MIXPREC_TEST_ASYNC=1 expect_killed 2 1
ls -a "$MIXPREC_TEST_ROOT"
check 1 X=1
check 3 MIXPREC_TEST_SAVE_AFTER=1
echo "PASS"
