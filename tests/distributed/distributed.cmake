# Distributed tests under torchrun (included from tests/CMakeLists.txt, which builds the
# single-process distributed_tests with every other area).
#
#   distributed_mp_tests  cases every rank runs together: ctest starts it through torchrun with
#                  N = 1..4 processes, one ctest entry per N that runs every suite meant for N
#                  ranks. `--standalone` makes torchrun pick a free port, so these entries can
#                  run in parallel. This machine has 2 cores: the tests check results, never
#                  timings. One entry per (suite, N) cost a torchrun start (about 2 s of Python
#                  importing torch) for every 1-3 s of testing; a suite is still one filter away:
#                  `torchrun --standalone --nproc-per-node 2 --no-python
#                  build/tests/distributed_mp_tests --gtest_filter='GradReducer.*'`.
file(GLOB distributed_mp_sources CONFIGURE_DEPENDS ${CMAKE_CURRENT_LIST_DIR}/mp/*.cpp)
mixprec_test_objects(distributed_mp_test_objects ${distributed_mp_sources})
add_executable(distributed_mp_tests $<TARGET_OBJECTS:distributed_mp_test_objects>)
target_link_libraries(distributed_mp_tests PRIVATE mixprec::mixprec GTest::gtest)

if(NOT _mixprec_torchrun_for_tests)
  message(WARNING "mixprec: no torchrun at ${MIXPREC_TORCHRUN}; multi-process tests not added")
  return()
endif()
# distributed.mp.np<n>: the given suites (and their parameterized instances) on n ranks.
function(mixprec_mp_world n)
  set(filter "")
  foreach(suite IN LISTS ARGN)
    string(APPEND filter "${suite}.*:${suite}/*:")
  endforeach()
  add_test(NAME distributed.mp.np${n}
           COMMAND "${MIXPREC_TORCHRUN}" --standalone --nproc-per-node ${n} --no-python
                   $<TARGET_FILE:distributed_mp_tests> --gtest_filter=${filter})
  set_tests_properties(distributed.mp.np${n} PROPERTIES TIMEOUT 600 LABELS distributed
                       ENVIRONMENT "OMP_NUM_THREADS=1;${MIXPREC_TEST_ENVIRONMENT}")
endfunction()
set(_mixprec_mp_suites Collectives GradReducer ModelCheck DistributedOptimizer ZeroStateDict
                       CollectiveCheckpoint ReducerMisuse)
mixprec_mp_world(1 ${_mixprec_mp_suites})
# Following the model, broadcasts, failures and allocations: an even and an odd world.
mixprec_mp_world(2 ${_mixprec_mp_suites} ZeroFollowsModel)
mixprec_mp_world(3 ${_mixprec_mp_suites} ZeroFollowsModel)
mixprec_mp_world(4 ${_mixprec_mp_suites})

# Checkpoints across launches: saved by N ranks and resumed by M (one entry: each torchrun
# start costs seconds here), and a rank SIGKILLed in the middle of a collective save.
add_test(NAME distributed.resume
         COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/resume.sh "${MIXPREC_TORCHRUN}"
                 $<TARGET_FILE:distributed_mp_tests> 1:2 2:3 3:2 4:1 2:4)
set_tests_properties(distributed.resume PROPERTIES TIMEOUT 300 LABELS distributed
  ENVIRONMENT "TMPDIR=${MIXPREC_TEST_TMPDIR}")
add_test(NAME distributed.crash_save
         COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/crash_save.sh "${MIXPREC_TORCHRUN}"
                 $<TARGET_FILE:distributed_mp_tests>)
set_tests_properties(distributed.crash_save PROPERTIES TIMEOUT 300 LABELS distributed
  ENVIRONMENT "TMPDIR=${MIXPREC_TEST_TMPDIR}")

# A launcher environment that contradicts itself fails at start-up with the variable named.
add_test(NAME distributed.env.rank_not_below_world_size COMMAND distributed_mp_tests)
set_tests_properties(distributed.env.rank_not_below_world_size PROPERTIES TIMEOUT 60
  ENVIRONMENT "RANK=2;WORLD_SIZE=2;MASTER_ADDR=localhost;MASTER_PORT=29400"
  PASS_REGULAR_EXPRESSION "RANK=2 must be less than WORLD_SIZE=2")
add_test(NAME distributed.env.missing_master_port COMMAND distributed_mp_tests)
set_tests_properties(distributed.env.missing_master_port PROPERTIES TIMEOUT 60
  ENVIRONMENT "RANK=0;WORLD_SIZE=2;MASTER_ADDR=localhost"
  PASS_REGULAR_EXPRESSION "MASTER_PORT is not set")
