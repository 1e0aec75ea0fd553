// Starting local ranks the way torchrun does, for `strata train
// --nproc-per-node N [--nnodes M --node-rank K --master-addr A --master-port
// P]` and `strata bench comm --nproc N`: N copies of this program
// (/proc/self/exe) with RANK (K*N + the local rank), LOCAL_RANK, WORLD_SIZE
// (M*N), LOCAL_WORLD_SIZE, GROUP_RANK (K), MASTER_ADDR and MASTER_PORT set.
// On one machine (M = 1) the port is a free one unless given, and without
// STRATA_GLOO_DIR in the environment the ranks get a fresh private
// rendezvous directory (removed afterwards). With several machines the port
// defaults to 29500 and the ranks meet through STRATA_GLOO_DIR (a directory
// every machine sees) when set, else through the TCP store global rank 0
// serves at MASTER_ADDR:MASTER_PORT (src/gpu/tcp_store.h).
//
// Global rank 0's stdout is this command's; the other ranks' stdout is
// discarded (their stderr is kept). SIGINT, SIGTERM and SIGHUP sent to the launcher
// are forwarded to every rank. When a rank fails (non-zero exit or a
// signal) the launcher says which and ends the others with SIGTERM, as
// torchrun's agent does; they also fail by themselves within the
// collectives' timeout. Either way each signal is followed by SIGCONT (a
// stopped rank runs again to handle it), and a rank still running
// kRankStopGraceS after the first is killed (SIGKILL): the launcher always
// returns. Each rank is killed (SIGKILL, PR_SET_PDEATHSIG) when the
// launcher dies, so that `kill -9` of the launcher leaves no rank behind.
// Returns the first failing rank's exit code (128 + N for signal N), 0 when
// all succeed.
#pragma once

#include <fmt/format.h>

#include <string>
#include <vector>

#include "strata/status.h"

namespace strata::cli {

// Seconds the ranks have to exit once told to stop (a signal forwarded, or
// another rank failed) before the launcher kills them.
inline constexpr double kRankStopGraceS = 10;

// Local rank k runs on CUDA device k (torchrun's LOCAL_RANK), and NCCL needs
// a GPU of its own per rank: FailedPrecondition when `device` (auto, cuda or
// host) would use CUDA and the machine has `gpus` GPUs, but fewer than
// `nproc` (`flag` names the option in the message). OK for host, or no GPU
// at all (the ranks then fall back to the host device or fail themselves).
inline Status GpusForLocalRanks(int nproc, const std::string& device, int gpus, const char* flag) {
  if (device == "host" || gpus == 0 || nproc <= gpus) return Status();
  return FailedPreconditionError(fmt::format(
      "{} {} with device {}: local rank k runs on CUDA device k, and this machine has {} CUDA "
      "device(s); NCCL needs a GPU of its own for each rank: start at most {} rank(s) here, or "
      "use --device host (Gloo)",
      flag, nproc, device, gpus, gpus));
}
// The same for this machine's GPUs (gpu::ListCudaDevices).
Status CheckGpusForLocalRanks(int nproc, const std::string& device, const char* flag);

// Where this machine's ranks sit among all ranks (torchrun's options).
struct LaunchOptions {
  int nproc = 1;      // ranks on this machine (--nproc-per-node)
  int nnodes = 1;     // machines (--nnodes)
  int node_rank = 0;  // this machine's index, 0..nnodes-1 (--node-rank)
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: a free port on one machine, 29500 on several
};

// `args`: the command line each rank runs, after the program name.
int LaunchLocalRanks(const char* cmd, const LaunchOptions& options,
                     const std::vector<std::string>& args);
inline int LaunchLocalRanks(const char* cmd, int nproc, const std::vector<std::string>& args) {
  LaunchOptions o;
  o.nproc = nproc;
  return LaunchLocalRanks(cmd, o, args);
}

}  // namespace strata::cli
