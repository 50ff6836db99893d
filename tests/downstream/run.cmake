# ctest install.downstream: proves that an installed mixprec is usable by another project.
#
#   cmake -DBUILD_DIR=<mixprec build> -DWORK_DIR=<scratch> -DSOURCE_DIR=<tests/downstream>
#         -DGENERATOR=... -DCXX_COMPILER=... [-DCXX_LAUNCHER=word|word...] -P run.cmake
#
# 1. `cmake --install` the build into WORK_DIR/prefix (a fresh prefix every run);
# 2. configure tests/downstream against that prefix alone: CMAKE_PREFIX_PATH is the prefix
#    and nothing else, so LibTorch and the other dependencies must be found by
#    mixprecConfig.cmake itself;
# 3. build it, run it (it trains, saves, loads and resumes), and run the installed
#    mixprec-ckpt on the checkpoint it wrote.
foreach(var BUILD_DIR WORK_DIR SOURCE_DIR GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run.cmake: -D${var}=... is required")
  endif()
endforeach()

function(step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE status OUTPUT_VARIABLE out
                  ERROR_VARIABLE out)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "install.downstream: ${what} failed (${status}):\n${out}")
  endif()
  message(STATUS "install.downstream: ${what}: ok")
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

# Only the prefix: whatever the calling environment points at must not help.
unset(ENV{CMAKE_PREFIX_PATH})
unset(ENV{Torch_DIR})
unset(ENV{TORCH_INSTALL_PREFIX})

file(REMOVE_RECURSE "${WORK_DIR}")
set(prefix "${WORK_DIR}/prefix")
step("cmake --install" ${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${prefix}")
foreach(file include/mixprec/mixprec.h lib/cmake/mixprec/mixprecConfig.cmake
             lib/cmake/mixprec/mixprecConfigVersion.cmake bin/mixprec-ckpt)
  if(NOT EXISTS "${prefix}/${file}")
    message(FATAL_ERROR "install.downstream: ${prefix}/${file} was not installed")
  endif()
endforeach()

set(launcher "")
if(CXX_LAUNCHER)
  # The launcher's words come joined by '|' (one -D argument cannot hold a ';' list).
  string(REPLACE "|" ";" launcher "${CXX_LAUNCHER}")
  set(launcher "-DCMAKE_CXX_COMPILER_LAUNCHER=${launcher}")
endif()
step("configure" ${CMAKE_COMMAND} -S "${SOURCE_DIR}" -B "${WORK_DIR}/build" -G "${GENERATOR}"
     -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" ${launcher}
     "-DCMAKE_PREFIX_PATH=${prefix}")
step("build" ${CMAKE_COMMAND} --build "${WORK_DIR}/build")
step("run" "${WORK_DIR}/build/downstream" "${WORK_DIR}/checkpoints")
if(NOT last_output MATCHES "downstream: ok")
  message(FATAL_ERROR "install.downstream: the program did not finish:\n${last_output}")
endif()
message(STATUS "${last_output}")
step("installed mixprec-ckpt" "${prefix}/bin/mixprec-ckpt" inspect "${WORK_DIR}/checkpoints")
# The checkpoint says which rule kept each FP32 tensor (common "precision").
foreach(line "  router +F32 +mark" "  norm_scale +F32 +pattern norm\\*")
  if(NOT last_output MATCHES "${line}")
    message(FATAL_ERROR "install.downstream: inspect lacks '${line}':\n${last_output}")
  endif()
endforeach()
message(STATUS "install.downstream: passed")
