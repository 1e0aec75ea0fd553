// Implementation helpers shared by the nvme module's .cc files. Not part of
// the module's contract (see nvme.h).
#pragma once

#include <cstdint>
#include <string>

#include "strata/status.h"

namespace strata::nvme::internal {

// Why a directory cannot hold swap files: NotFound (missing), InvalidArgument
// (not a directory), FailedPrecondition (not writable / read-only filesystem).
Status CheckWritableDir(const std::string& dir);

// Free bytes for an unprivileged writer in `dir` (statvfs f_bavail × f_frsize).
StatusOr<uint64_t> FreeBytes(const std::string& dir);

struct BlockSize {
  uint32_t bytes = 4096;
  const char* source = "default";
};
// The alignment O_DIRECT needs on `fd`: statx(STATX_DIOALIGN) where the kernel
// reports it, else the backing device's queue/logical_block_size in sysfs,
// else 4096 (a multiple of every logical block size in use).
BlockSize LogicalBlockSize(int fd);

// The directory part of a path ("." when none).
std::string DirName(const std::string& path);

// Filesystem type name of `path` from statfs (ext4, xfs, tmpfs, ...), or hex.
std::string FsTypeName(const std::string& path);

// open(2) for the O_DIRECT descriptor of an IoFile. Tests swap it to simulate
// a filesystem that refuses O_DIRECT (tmpfs before Linux 6.6 did; 6.6+
// accepts it); nullptr restores open(2). Not thread-safe with Open().
using DirectOpenFn = int (*)(const char* path, int flags);
void SetDirectOpenForTest(DirectOpenFn fn);
int OpenDirect(const char* path, int flags);

// Test seam of the io_uring engine, whose io_uring_submit cannot be made to
// fail on demand otherwise: after `skip` more calls that go through, the next
// `count` io_uring_submit calls (any ring of any engine) fail with -err without
// entering the kernel, the queued SQEs published as a real failure leaves
// them. err = 0 or count = 0 disarms. Thread-safe; process-wide.
void SetUringSubmitFaultForTest(int err, int skip = 0, int count = 1);
// What the engine consults before each io_uring_submit: 0, or the -errno to
// fail it with.
int UringSubmitFaultForTest();

}  // namespace strata::nvme::internal
