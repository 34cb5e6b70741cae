// Default runtime options of the sanitizer runtimes, compiled into the executables of the
// DETOPS_SANITIZE=ON build (tests/cpp/CMakeLists.txt), so that they hold however the programs
// are started (CTest, tools/sanitize_cpu.sh, by hand). ASAN_OPTIONS / UBSAN_OPTIONS in the
// environment are applied on top of these.
extern "C" {

// AddressSanitizer.
//   detect_leaks=0: LibTorch keeps process-long allocations it never frees (operator and
//     kernel registrations, thread pools, the CPU allocator's caches); LeakSanitizer reports
//     them at exit, and a suppression list for them would also hide detops' own leaks, which
//     are allocated through the same torch frames (at::empty under the dispatcher).
//   allocator_may_return_null=1: a request for more memory than there is returns null, as
//     malloc does, so that torch's allocator throws its c10 "not enough memory" error and the
//     op under test reports it, instead of ASan ending the process.
//   check_initialization_order=1, strict_init_order=1: globals of the detops libraries that
//     read globals of another file before those are constructed.
//   detect_stack_use_after_return=1: references to a kernel's stack that outlive its call.
const char* __asan_default_options() {
  return "detect_leaks=0:allocator_may_return_null=1:check_initialization_order=1:"
         "strict_init_order=1:detect_stack_use_after_return=1";
}

// UndefinedBehaviorSanitizer: the stack of each report (the build stops at the first,
// -fno-sanitize-recover=undefined).
const char* __ubsan_default_options() { return "print_stacktrace=1"; }

}  // extern "C"
