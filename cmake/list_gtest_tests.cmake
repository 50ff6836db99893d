# cmake -D EXECUTABLE=<gtest binary> -D OUTPUT=<file> -D MODE=suite|case -P list_gtest_tests.cmake
#
# Writes the executable's test suites (MODE=suite: "Suite", "Prefix/Suite", "Typed/0") or cases
# (MODE=case: "Suite.Case") to OUTPUT, one per line, from `--gtest_list_tests`. Run after each
# link by mixprec_add_gtest_tests (gtest_suites.cmake). Fails, naming the executable, if the
# listing fails or lists nothing.
cmake_minimum_required(VERSION 3.25)
foreach(var EXECUTABLE OUTPUT MODE)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "list_gtest_tests.cmake: -D${var}=... is required")
  endif()
endforeach()

execute_process(COMMAND "${EXECUTABLE}" --gtest_list_tests
                RESULT_VARIABLE status OUTPUT_VARIABLE listing ERROR_VARIABLE errors
                TIMEOUT 120)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "${EXECUTABLE} --gtest_list_tests failed (${status}):\n${errors}")
endif()

# Suite lines start in column 0 and end with '.', cases are indented; either may carry a
# trailing "  # GetParam() = ..." or "  # TypeParam = ..." comment.
# Brackets and semicolons appear only in those comments; they would break CMake's list splitting.
string(REGEX REPLACE "[][;]" "_" listing "${listing}")
string(REPLACE "\n" ";" lines "${listing}")
set(names "")
set(current_suite "")
foreach(line IN LISTS lines)
  string(REGEX REPLACE "  #.*$" "" line "${line}")
  if(line MATCHES "^([^ ].*)\\.$")
    set(current_suite "${CMAKE_MATCH_1}")
    if(MODE STREQUAL "suite")
      list(APPEND names "${current_suite}")
    endif()
  elseif(line MATCHES "^  ([^ ]+)$" AND MODE STREQUAL "case")
    list(APPEND names "${current_suite}.${CMAKE_MATCH_1}")
  endif()
endforeach()
if(NOT names)
  message(FATAL_ERROR "${EXECUTABLE} lists no tests")
endif()
list(JOIN names "\n" content)
file(WRITE "${OUTPUT}" "${content}\n")
