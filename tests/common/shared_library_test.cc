// SharedLibrary: a library that is not there, a symbol that is not there,
// and a library that does not fit under RLIMIT_AS, each a Status naming the
// library and the loader's own words.
#include "src/common/shared_library.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

#include "src/common/host_memory.h"
#include "tests/status_matchers.h"

namespace strata {
namespace {

bool Has(const Status& s, const std::string& part) {
  return std::string(s.message()).find(part) != std::string::npos;
}

TEST(SharedLibraryTest, MissingLibraryIsUnavailableNamingItAndDlerror) {
  auto lib = SharedLibrary::Open("Frobnicator", "libstrata-no-such-library.so.7");
  ASSERT_FALSE(lib.ok());
  const Status& s = lib.status();
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_TRUE(Has(s, "Frobnicator could not be loaded")) << s;
  EXPECT_TRUE(Has(s, "dlopen(\"libstrata-no-such-library.so.7\")")) << s;
  // dlerror()'s text, as glibc words it.
  EXPECT_TRUE(Has(s, "cannot open shared object file")) << s;
}

TEST(SharedLibraryTest, FallbackDirectoryIsTriedAndNamed) {
  auto lib = SharedLibrary::Open("Frobnicator", "libstrata-no-such-library.so.7", "/nonexistent");
  ASSERT_FALSE(lib.ok());
  EXPECT_TRUE(Has(lib.status(), "dlopen(\"/nonexistent/libstrata-no-such-library.so.7\")"))
      << lib.status();
  // Not found as given (a relative path: the working directory is not /),
  // found in the fallback directory.
  if (access("/lib/x86_64-linux-gnu/libc.so.6", R_OK) != 0)
    GTEST_SKIP() << "no /lib/x86_64-linux-gnu/libc.so.6 here";
  ASSERT_EQ(access("x86_64-linux-gnu/libc.so.6", F_OK), -1);
  auto libc = SharedLibrary::Open("libc", "x86_64-linux-gnu/libc.so.6", "/lib");
  ASSERT_TRUE(libc.ok()) << libc.status();
  EXPECT_EQ(libc->path(), "/lib/x86_64-linux-gnu/libc.so.6");
}

TEST(SharedLibraryTest, BindsFunctionsAndNamesAMissingSymbol) {
  auto lib = SharedLibrary::Open("libc", "libc.so.6");
  ASSERT_TRUE(lib.ok()) << lib.status();
  EXPECT_EQ(lib->path(), "libc.so.6");
  pid_t (*get_pid)() = nullptr;
  ASSERT_OK(lib->Bind(&get_pid, "getpid"));
  ASSERT_NE(get_pid, nullptr);
  EXPECT_EQ(get_pid(), getpid());

  int (*nothing)() = nullptr;
  Status s = lib->Bind(&nothing, "strata_no_such_symbol");
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_TRUE(Has(s, "libc: libc.so.6 has no symbol strata_no_such_symbol")) << s;
  EXPECT_EQ(nothing, nullptr);
}

// In a child: RLIMIT_AS = what is mapped + 1 MiB, then a library of tens of
// MiB that this test does not link (OpenBLAS, which Strata depends on).
TEST(SharedLibraryTest, NoRoomUnderRlimitAsIsResourceExhaustedNamingTheLimit) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer reserves terabytes of address space: no RLIMIT_AS here";
#endif
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const rlim_t lim = ReadHostMemory().vm_size + (1u << 20);
    rlimit rl{lim, lim};
    if (setrlimit(RLIMIT_AS, &rl) != 0) _exit(2);
    auto lib = SharedLibrary::Open("OpenBLAS", "libopenblas.so.0");
    if (lib.ok()) _exit(3);
    const Status& s = lib.status();
    if (Has(s, "cannot open shared object file")) _exit(77);  // not installed
    if (s.code() != StatusCode::kResourceExhausted) _exit(4);
    if (!Has(s, "RLIMIT_AS (`ulimit -v`) is " + std::to_string(lim) + " bytes")) _exit(5);
    if (!Has(s, "OpenBLAS could not be loaded: dlopen(\"libopenblas.so.0\")")) _exit(6);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 77) GTEST_SKIP() << "libopenblas.so.0 is not installed";
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

}  // namespace
}  // namespace strata
