# DETOPS_SANITIZE=ON: AddressSanitizer + UndefinedBehaviorSanitizer for everything this project
# compiles (libdetops, libdetops_aot, the GoogleTest tests, tests/cpp/sanitize_driver.cpp).
# Included from the top CMakeLists.txt before any target is made; tools/sanitize_cpu.sh
# configures, builds and runs it.
#
# LibTorch itself is not instrumented: its code runs as usual, its heap blocks come from ASan's
# malloc (so detops reading past a tensor's end is caught), but what it does inside is not
# checked. The executables are linked with -fsanitize, which puts the sanitizer runtimes first
# in their list of libraries, so no LD_PRELOAD is needed (a Python extension would need one).
# The runtime options the executables carry are in tests/cpp/sanitizer_options.cpp.
if(NOT CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  message(FATAL_ERROR "detops: DETOPS_SANITIZE=ON needs GCC or Clang, got ${CMAKE_CXX_COMPILER_ID}")
endif()
if(DETOPS_WITH_CUDA STREQUAL "ON")
  message(FATAL_ERROR "detops: DETOPS_SANITIZE=ON builds the CPU library only; use tools/sanitize_cuda.sh "
                      "(compute-sanitizer) for the CUDA kernels")
endif()
set(DETOPS_WITH_CUDA OFF)  # shadows the cache entry for this configuration

set(DETOPS_SANITIZE_FLAGS
  -fsanitize=address,undefined
  # a UBSan report ends the program with an error, as an ASan report does, instead of printing
  # and going on: CTest and the scripts then see it as a failure
  -fno-sanitize-recover=all
  # stacks with file and line in the reports, also through the kernels' inlined lambdas; -g1
  # (line tables) compiles in two thirds of -g's time
  -fno-omit-frame-pointer -g1)
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  # GCC leaves float-to-integer conversions that overflow (or of NaN) out of -fsanitize=undefined
  # (Clang includes them): the RoI ops turn float coordinates and batch indices into integers.
  list(APPEND DETOPS_SANITIZE_FLAGS -fsanitize=float-cast-overflow)
endif()
add_compile_options(
  ${DETOPS_SANITIZE_FLAGS}
  # -O1: the kernels run some ten times faster than at -O0 under ASan, and the reports stay exact
  -O1
  # bounds checks of std::vector::operator[] and the like in the standard library's headers
  # (no ABI change): they catch an index past size() but within the capacity, which ASan cannot
  -D_GLIBCXX_ASSERTIONS)
add_link_options(-fsanitize=address,undefined)
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  add_link_options(-fsanitize=float-cast-overflow)
endif()
message(STATUS "detops: ASan + UBSan build (${CMAKE_CXX_COMPILER_ID} ${CMAKE_CXX_COMPILER_VERSION}), CPU only")
