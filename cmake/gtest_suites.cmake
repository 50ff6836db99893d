# mixprec_add_gtest_tests(<target> [PREFIX <p>] [LABELS <l>...] [ENVIRONMENT <VAR=value>...]
#                         [TIMEOUT <s>])
#
# Registers the GoogleTest cases of executable <target> with ctest: one ctest entry per test
# suite (`<target> --gtest_filter=<Suite>.*`), or one per case with -DMIXPREC_CTEST_PER_CASE=ON.
#
# Why suites: every process that loads LibTorch spends ~0.3 s in its static initialisation
# before the first test runs; with ~550 mostly sub-second cases, one process per case spent
# more time starting than testing. A suite's cases share one process, so a case must not
# depend on running alone (none does: every binary also passes run whole).
#
# As gtest_discover_tests does, the list is read from the built executable after each link
# (--gtest_list_tests) and included by ctest. An executable that was not built yet (the
# sanitized pass's are not part of `all`) registers one failing entry, <prefix><target>.not_built,
# carrying the same labels, so a pass that selects by label fails loudly instead of running
# nothing.
option(MIXPREC_CTEST_PER_CASE "One ctest entry per GoogleTest case instead of per suite" OFF)
set(_MIXPREC_LIST_GTEST_SCRIPT ${CMAKE_CURRENT_LIST_DIR}/list_gtest_tests.cmake)

function(mixprec_add_gtest_tests target)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "PREFIX;TIMEOUT" "LABELS;ENVIRONMENT")
  if(NOT arg_TIMEOUT)
    set(arg_TIMEOUT 600)
  endif()
  set(mode suite)
  if(MIXPREC_CTEST_PER_CASE)
    set(mode case)
  endif()
  set(list_file "${CMAKE_CURRENT_BINARY_DIR}/${target}_gtest_${mode}s.txt")
  set(include_file "${CMAKE_CURRENT_BINARY_DIR}/${target}_gtest_include.cmake")
  add_custom_command(TARGET ${target} POST_BUILD
    COMMAND ${CMAKE_COMMAND} -D "EXECUTABLE=$<TARGET_FILE:${target}>" -D "OUTPUT=${list_file}"
            -D "MODE=${mode}" -P ${_MIXPREC_LIST_GTEST_SCRIPT}
    BYPRODUCTS ${list_file}
    VERBATIM)
  # Bracket arguments keep each list (VAR=value;VAR=value) one argument of set_tests_properties.
  if(mode STREQUAL "suite")
    set(filter "\${name}.*")
  else()
    set(filter "\${name}")
  endif()
  file(GENERATE OUTPUT ${include_file} CONTENT "\
if(EXISTS [==[${list_file}]==] AND EXISTS [==[$<TARGET_FILE:${target}>]==])
  file(STRINGS [==[${list_file}]==] names)
  foreach(name IN LISTS names)
    add_test(\"${arg_PREFIX}\${name}\" [==[$<TARGET_FILE:${target}>]==] \"--gtest_filter=${filter}\")
    set_tests_properties(\"${arg_PREFIX}\${name}\" PROPERTIES
      TIMEOUT ${arg_TIMEOUT} LABELS [==[${arg_LABELS}]==] ENVIRONMENT [==[${arg_ENVIRONMENT}]==])
  endforeach()
else()
  add_test([==[${arg_PREFIX}${target}.not_built]==] ${CMAKE_COMMAND} -E echo
           [==[${target} was not built]==])
  set_tests_properties([==[${arg_PREFIX}${target}.not_built]==] PROPERTIES
    LABELS [==[${arg_LABELS}]==] WILL_FAIL ON)
endif()
")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES ${include_file})
endfunction()
