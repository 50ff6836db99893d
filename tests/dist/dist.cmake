# Distributed tests (included from tests/CMakeLists.txt after mixprec_test_binary is defined).
#
#   dist_tests     single-process cases (layout arithmetic, launcher environment, world size 1),
#                  discovered like every other area's tests;
#   dist_mp_tests  cases every rank runs together: ctest starts it through torchrun with
#                  N = 1..4 processes, one ctest entry per (suite, N). `--standalone` makes
#                  torchrun pick a free port, so these entries can run in parallel. This
#                  machine has 2 cores: the tests check results, never timings.
file(GLOB dist_unit_tests CONFIGURE_DEPENDS ${CMAKE_CURRENT_LIST_DIR}/*_test.cpp)
if(dist_unit_tests)
  mixprec_test_binary(dist_tests ${dist_unit_tests})
endif()
if(MIXPREC_SANITIZED_SUITE)
  return()  # launches of several ranks: the first pass runs them
endif()

file(GLOB dist_mp_sources CONFIGURE_DEPENDS ${CMAKE_CURRENT_LIST_DIR}/mp/*.cpp)
add_executable(dist_mp_tests ${dist_mp_sources})
target_link_libraries(dist_mp_tests PRIVATE mixprec::mixprec GTest::gtest)
target_include_directories(dist_mp_tests PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_precompile_headers(dist_mp_tests REUSE_FROM mixprec)
# The Python reader is an oracle of the collective checkpoint tests.
target_compile_definitions(dist_mp_tests PRIVATE
  MIXPREC_SOURCE_DIR="${PROJECT_SOURCE_DIR}" MIXPREC_PYTHON="${MIXPREC_PYTHON}")

# torchrun sits beside the python that has torch (MIXPREC_PYTHON, as the other tests use it).
get_filename_component(_mixprec_python_bin "${MIXPREC_PYTHON}" DIRECTORY)
set(MIXPREC_TORCHRUN "${_mixprec_python_bin}/torchrun" CACHE FILEPATH
    "torchrun that launches the multi-process tests")
if(NOT EXISTS "${MIXPREC_TORCHRUN}")
  message(WARNING "mixprec: no torchrun at ${MIXPREC_TORCHRUN}; multi-process tests not added")
  return()
endif()
foreach(suite Collectives GradReducer ModelCheck DistributedOptimizer ZeroStateDict
              CollectiveCheckpoint)
  foreach(n 1 2 3 4)
    add_test(NAME dist.mp.${suite}.np${n}
             COMMAND "${MIXPREC_TORCHRUN}" --standalone --nproc-per-node ${n} --no-python
                     $<TARGET_FILE:dist_mp_tests> --gtest_filter=${suite}.*:${suite}/*)
    set_tests_properties(dist.mp.${suite}.np${n} PROPERTIES TIMEOUT 300 LABELS dist
                         ENVIRONMENT "OMP_NUM_THREADS=1")
  endforeach()
endforeach()

# Checkpoints across launches: saved by N ranks and resumed by M (one entry: each torchrun
# start costs seconds here), and a rank SIGKILLed in the middle of a collective save.
add_test(NAME dist.resume
         COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/resume.sh "${MIXPREC_TORCHRUN}"
                 $<TARGET_FILE:dist_mp_tests> 1:2 2:3 3:2 4:1 2:4)
set_tests_properties(dist.resume PROPERTIES TIMEOUT 300 LABELS dist)
add_test(NAME dist.crash_save
         COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/crash_save.sh "${MIXPREC_TORCHRUN}"
                 $<TARGET_FILE:dist_mp_tests>)
set_tests_properties(dist.crash_save PROPERTIES TIMEOUT 300 LABELS dist)

# A launcher environment that contradicts itself fails at start-up with the variable named.
add_test(NAME dist.env.rank_not_below_world_size COMMAND dist_mp_tests)
set_tests_properties(dist.env.rank_not_below_world_size PROPERTIES TIMEOUT 60
  ENVIRONMENT "RANK=2;WORLD_SIZE=2;MASTER_ADDR=localhost;MASTER_PORT=29400"
  PASS_REGULAR_EXPRESSION "RANK=2 must be less than WORLD_SIZE=2")
add_test(NAME dist.env.missing_master_port COMMAND dist_mp_tests)
set_tests_properties(dist.env.missing_master_port PROPERTIES TIMEOUT 60
  ENVIRONMENT "RANK=0;WORLD_SIZE=2;MASTER_ADDR=localhost"
  PASS_REGULAR_EXPRESSION "MASTER_PORT is not set")
