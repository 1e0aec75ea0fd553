// Internal to src/gpu: the NCCL backend's factory (nccl_comm.cc, or
// nccl_stub.cc in builds without NCCL), the unique-id file helpers, and the
// Gloo backend's factory (gloo_comm.cc: the host device with several ranks).
#pragma once

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "src/gpu/device.h"

namespace strata::gpu::internal {

inline constexpr size_t kUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
using UniqueId = std::array<char, kUniqueIdBytes>;

StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(Device& device,
                                                               const CommOptions& options);
// Whether this build has the NCCL backend (it loads libnccl at run time).
bool HaveNccl();
// Opens libnccl (dlopen, the first call only; later calls return the first
// answer) and binds the functions the backend calls. Unavailable naming the
// library and dlerror() when it is missing, ResourceExhausted when RLIMIT_AS
// left no room for it; the first failure is logged once. NotSupported in a
// build without NCCL. Thread-safe.
Status LoadNcclLibrary();
// What LoadNcclLibrary does, for `soname` and without caching: for tests.
Status ProbeNcclLibrary(const std::string& soname);

// The path rank 0 writes the id to (options.unique_id_file, or one derived
// from MASTER_ADDR/MASTER_PORT).
std::string UniqueIdPath(const CommOptions& options);
// Atomically writes the id (temp file + rename).
Status WriteUniqueId(const std::string& path, const UniqueId& id);
// Polls until the file holds a full id or the timeout passes (Unavailable).
StatusOr<UniqueId> ReadUniqueId(const std::string& path, double timeout_s);
// STRATA_NCCL_UNIQUE_ID as 256 hex digits; nullopt if unset.
StatusOr<std::optional<UniqueId>> UniqueIdFromEnv();
std::string UniqueIdToHex(const UniqueId& id);

// CommOptions::connect_timeout_s, or timeout_s when that is 0.
inline double ConnectTimeoutS(const CommOptions& options) {
  return options.connect_timeout_s > 0 ? options.connect_timeout_s : options.timeout_s;
}

// Connects options.world_size ranks over TCP, meeting through
// options.store, else Gloo's FileStore in GlooRendezvousDir; Unavailable (naming the directory, the
// address and the timeout) when the peers do not all arrive within ConnectTimeoutS(options).
StatusOr<std::unique_ptr<Communicator>> CreateGlooCommunicator(Device& device,
                                                               const CommOptions& options);
// Called by a host function of the host device that waits on other
// processes, bounded by a timeout of its own (a Gloo collective waiting for
// its peers): while it runs, the device's deadlock check
// (DeviceOptions::host_deadlock_timeout_s) does not count it as stuck, so a
// slow peer is waited for and a lost one is reported by the collective's
// timeout, naming it. No effect on any other thread.
void HostFunctionWaitsOnPeers();

// options.rendezvous_dir, or "/tmp/strata-gloo-<MASTER_ADDR>-<MASTER_PORT>".
std::string GlooRendezvousDir(const CommOptions& options);
// Whether a MASTER_ADDR names this machine by a loopback name (empty,
// localhost, 127.*, ::1): the ranks are on one machine.
inline bool IsLoopbackName(const std::string& addr) {
  return addr.empty() || addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

// Where a rank listens for its peers: options.listen_host; else
// options.listen_iface (InvalidArgument when no such interface exists);
// else 127.0.0.1 when MASTER_ADDR is unset or a loopback address; else this
// machine's address on its route to MASTER_ADDR (Unavailable naming
// MASTER_ADDR when it does not resolve or has no route).
struct GlooListen {
  std::string host;   // a name or address; empty when iface is set
  std::string iface;  // an interface name; empty when host is set
  std::string Describe() const;
  // The address peers reach: host, or the interface's first address.
  std::string Address() const;
};

// "rank K at ADDR" for the peer of `hosts` (every rank's address, `self`
// excluded) whose "[ADDR]" alone appears in a Gloo error, or the only peer;
// else "a peer rank (rank 0 at ..., ...)" listing up to eight (Gloo's
// timeouts do not say which peer they waited for).
std::string NamePeer(const std::vector<std::string>& hosts, int self, const std::string& error);
StatusOr<GlooListen> GlooListenAddress(const CommOptions& options);

}  // namespace strata::gpu::internal
