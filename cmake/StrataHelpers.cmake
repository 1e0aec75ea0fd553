# strata_cc_library(NAME <name> SRCS <files...> [DEPS <targets...>] [PUBLIC_DEPS <targets...>])
# A static, position-independent module library. Private headers are found
# from the repository root ("src/nvme/nvme.h" style includes); the public API
# from include/.
function(strata_cc_library)
  cmake_parse_arguments(A "" "NAME" "SRCS;DEPS;PUBLIC_DEPS" ${ARGN})
  add_library(${A_NAME} STATIC ${A_SRCS})
  target_include_directories(${A_NAME} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}>
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
    $<BUILD_INTERFACE:${PROJECT_BINARY_DIR}/generated>)
  target_link_libraries(${A_NAME} PUBLIC ${A_PUBLIC_DEPS} ${A_DEPS})
  target_compile_options(${A_NAME} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>)
endfunction()

# strata_cc_test(NAME <name> SRCS <files...> [DEPS <targets...>] [LABELS <labels...>]
#                [TIMEOUT <seconds>])
# A GoogleTest binary registered with CTest (one CTest entry per test case).
# Each case gets TIMEOUT seconds (default 120: the slowest case takes ~10 s on
# a 2-core machine), so a hang fails in minutes; the TIMEOUT property
# overrides `ctest --timeout`. LABELS default to the name of the test's
# folder (tests/nvme: "nvme"). Value-parameterized cases are named by their
# suite's name generator (Engines/IoServiceTest.ReadWrite/uring); the
# printed parameter (`# GetParam() = 0x...`) is left out of the CTest name
# (NO_PRETTY_VALUES), so every INSTANTIATE_TEST_SUITE_P gives a generator.
#
# The properties are set by a script CTest runs after the discovered tests
# are added (TEST_LIST): gtest_discover_tests' own PROPERTIES splits list
# values, so a list of labels or an empty one would shift the pairs.
#
# With STRATA_TEST_LABELS_BUILT set (a list of labels), a test program with
# none of them is left out of the default build and of CTest; its target
# stays (`ninja <name>` builds it) and its sources are listed in
# tests_left_out.txt in the build tree, for scripts/check_syntax.sh to compile
# with -fsyntax-only (scripts/check_platform.sh --ci: the warnings of a newer
# compiler over every test, in less time than building them all).
function(strata_cc_test)
  cmake_parse_arguments(A "" "NAME;TIMEOUT" "SRCS;DEPS;LABELS" ${ARGN})
  if(NOT A_TIMEOUT)
    set(A_TIMEOUT 120)
  endif()
  if(NOT A_LABELS)
    get_filename_component(A_LABELS "${CMAKE_CURRENT_SOURCE_DIR}" NAME)
  endif()
  set(built ON)
  if(STRATA_TEST_LABELS_BUILT)
    set(built OFF)
    foreach(label IN LISTS A_LABELS)
      if(label IN_LIST STRATA_TEST_LABELS_BUILT)
        set(built ON)
      endif()
    endforeach()
  endif()
  if(built)
    add_executable(${A_NAME} ${A_SRCS})
  else()
    add_executable(${A_NAME} EXCLUDE_FROM_ALL ${A_SRCS})
  endif()
  target_link_libraries(${A_NAME} PRIVATE ${A_DEPS} strata_test_util GTest::gtest GTest::gmock GTest::gtest_main)
  target_compile_options(${A_NAME} PRIVATE -Wall -Wextra -Wno-unused-parameter)
  if(NOT built)
    foreach(src IN LISTS A_SRCS)
      get_filename_component(src "${src}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_SOURCE_DIR}")
      set_property(GLOBAL APPEND PROPERTY STRATA_TESTS_LEFT_OUT "${src}")
    endforeach()
    return()
  endif()
  gtest_discover_tests(${A_NAME} DISCOVERY_TIMEOUT 60 TEST_LIST ${A_NAME}_TESTS NO_PRETTY_VALUES)
  set(props "${CMAKE_CURRENT_BINARY_DIR}/${A_NAME}_properties.cmake")
  file(WRITE "${props}"
    "foreach(t IN LISTS ${A_NAME}_TESTS)\n"
    "  set_tests_properties(\"\${t}\" PROPERTIES LABELS \"${A_LABELS}\" TIMEOUT ${A_TIMEOUT})\n"
    "endforeach()\n")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${props}")
endfunction()
