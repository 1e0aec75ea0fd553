// The rules of src/common/private_fs.h with the things another user could
// plant: symlinks, FIFOs, directories of another owner or open to all. The
// chown cases need root (CI and the build machines run the tests as root);
// elsewhere they skip.
#include "src/common/private_fs.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "tests/test_util.h"

namespace strata {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

std::string Slurp(const std::string& path) {
  std::ifstream f(path);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

mode_t ModeOf(const std::string& path) {
  struct stat st;
  EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}

TEST(PrivateFs, CreatedFilesAndDirectoriesAreTheOwnersOnly) {
  testing::ScratchDir dir;
  const mode_t old = ::umask(022);
  const std::string d = dir.str() + "/a/b/c";
  ASSERT_TRUE(MakeDirs(d, "--plot").ok());
  EXPECT_EQ(ModeOf(dir.str() + "/a"), 0700u);
  EXPECT_EQ(ModeOf(d), 0700u);
  StatusOr<bool> made = MakePrivateDir(d + "/rank-0", "nvme_path");
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  EXPECT_TRUE(*made);
  EXPECT_EQ(ModeOf(d + "/rank-0"), 0700u);
  ASSERT_TRUE(WriteFileReplacing(d + "/f", "one", "plot").ok());
  EXPECT_EQ(ModeOf(d + "/f"), 0600u);
  ASSERT_TRUE(WriteFileReplacing(d + "/f", "two", "plot").ok());
  EXPECT_EQ(Slurp(d + "/f"), "two");
  StatusOr<int> fd = CreateNewFile(d + "/g", O_WRONLY, "checkpoint file");
  ASSERT_TRUE(fd.ok());
  ::close(*fd);
  EXPECT_EQ(ModeOf(d + "/g"), 0600u);
  ::umask(old);
}

TEST(PrivateFs, SymlinksAndFifosAreRefusedNamingThePath) {
  testing::ScratchDir dir;
  const std::string victim = dir.str() + "/victim";
  std::ofstream(victim) << "precious";
  const std::string link = dir.str() + "/loss.dat";
  ASSERT_EQ(::symlink(victim.c_str(), link.c_str()), 0);
  Status s = WriteFileReplacing(link, "x", "--plot file");
  EXPECT_EQ(s.code(), StatusCode::kIOError);
  EXPECT_THAT(s.message(), HasSubstr(link + ": a symbolic link is there"));
  StatusOr<int> fd = OpenRegularFile(link, O_RDWR | O_CREAT, "checkpoint lock file");
  EXPECT_EQ(fd.status().code(), StatusCode::kIOError);
  EXPECT_THAT(fd.status().message(), HasSubstr(link + ": a symbolic link, not a regular file"));
  fd = CreateNewFile(link, O_WRONLY, "checkpoint file");
  EXPECT_EQ(fd.status().code(), StatusCode::kIOError);
  EXPECT_EQ(Slurp(victim), "precious");
  // A FIFO: neither blocks the open nor is used.
  const std::string fifo = dir.str() + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0666), 0);
  fd = OpenRegularFile(fifo, O_RDONLY, "checkpoint manifest");
  EXPECT_EQ(fd.status().code(), StatusCode::kIOError);
  EXPECT_THAT(fd.status().message(), HasSubstr("a FIFO"));
  EXPECT_EQ(WriteFileReplacing(fifo, "x", "plot").code(), StatusCode::kIOError);
  // A symlink where a directory is reused.
  const std::string dlink = dir.str() + "/rank-0";
  ASSERT_EQ(::symlink(dir.str().c_str(), dlink.c_str()), 0);
  StatusOr<bool> made = MakePrivateDir(dlink, "nvme_path");
  EXPECT_EQ(made.status().code(), StatusCode::kIOError);
  EXPECT_THAT(made.status().message(),
              HasSubstr("nvme_path " + dlink + ": a symbolic link, not a directory"));
}

TEST(PrivateFs, DirectoriesOfAnotherOwnerOrOpenToOthersAreRefused) {
  testing::ScratchDir dir;
  const std::string open_dir = dir.str() + "/open";
  ASSERT_EQ(::mkdir(open_dir.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(open_dir.c_str(), 0777), 0);
  Status s = CheckPrivateDir(open_dir, "checkpoint");
  EXPECT_EQ(s.code(), StatusCode::kIOError);
  EXPECT_THAT(s.message(), HasSubstr(open_dir + ": writable by group or others (mode 0777)"));
  if (::geteuid() != 0) GTEST_SKIP() << "chown needs root";
  const std::string theirs = dir.str() + "/theirs";
  ASSERT_EQ(::mkdir(theirs.c_str(), 0700), 0);
  ASSERT_EQ(::chown(theirs.c_str(), 12345, 12345), 0);
  StatusOr<bool> made = MakePrivateDir(theirs, "nvme_path");
  EXPECT_EQ(made.status().code(), StatusCode::kIOError);
  EXPECT_THAT(made.status().message(),
              HasSubstr("nvme_path " + theirs + ": owned by uid 12345, not by this process's (0)"));
}

TEST(PrivateFs, ControlCharacters) {
  EXPECT_TRUE(HasControlChar("dir\nx"));
  EXPECT_TRUE(HasControlChar(std::string("a\x7f")));
  EXPECT_FALSE(HasControlChar("/tmp/ckpt dir/é"));
}

}  // namespace
}  // namespace strata
