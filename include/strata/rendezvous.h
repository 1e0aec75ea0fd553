// strata/rendezvous.h — the key-value store through which the ranks of a
// data-parallel run find each other.
//
// Several ranks exchange their listening addresses (Gloo, the host device)
// or NCCL's unique id before their first collective. Without a store they
// meet through a directory every rank sees (STRATA_GLOO_DIR, or
// /tmp/strata-gloo-<MASTER_ADDR>-<MASTER_PORT> on one machine). A program
// that already has a store every rank reaches over the network (the Python
// frontend passes torch.distributed's, the TCPStore at MASTER_ADDR:
// MASTER_PORT that torchrun and DeepSpeed use) passes it to Engine::Create
// instead, and then no filesystem is shared.
//
// The store is trusted as torch's is: whoever can reach it can read what the
// ranks write there (their addresses and the per-run secret each peer proves
// on connecting) and join the run.
#pragma once

#include <string>

#include "strata/status.h"

namespace strata {

class RendezvousStore {
 public:
  virtual ~RendezvousStore() = default;
  // Sets key to value (bytes), replacing what was there.
  virtual Status Set(const std::string& key, const std::string& value) = 0;
  // The value of key, waiting up to timeout_s seconds for some rank to set
  // it; Unavailable naming the key when the time passes.
  virtual StatusOr<std::string> Get(const std::string& key, double timeout_s) = 0;
  // Removes key (absent: nothing happens). The ranks remove the entries of a
  // rendezvous once every rank has read them, so that a store that outlives
  // one engine serves the next.
  virtual Status Remove(const std::string& key) = 0;
};

}  // namespace strata
