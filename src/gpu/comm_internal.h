// Internal to src/gpu: the NCCL backend's factory (nccl_comm.cc, or
// nccl_stub.cc in builds without NCCL) and the unique-id file helpers.
#pragma once

#include <array>
#include <memory>
#include <optional>
#include <string>

#include "src/gpu/device.h"

namespace strata::gpu::internal {

inline constexpr size_t kUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
using UniqueId = std::array<char, kUniqueIdBytes>;

StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(Device& device,
                                                               const CommOptions& options);
bool HaveNccl();

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

}  // namespace strata::gpu::internal
