// A RendezvousStore over TCP (strata/rendezvous.h), for ranks that share
// nothing but a network when no caller gives a store: `strata train` and
// C++ programs across machines. Rank 0 serves it at MASTER_ADDR:MASTER_PORT
// (the address every launcher already gives), and every rank, rank 0
// included, is a client.
//
// Why not a library's: Debian's Gloo has file, hash (in-process) and Redis
// stores only, NCCL exposes none, and torch's TCPStore would mean linking
// libtorch into the command-line tool and the library. So the messages
// follow the layout of torch 2.x's TCPStore instead of a new design: a
// query byte, strings and byte vectors as a uint64 length then the bytes,
// in host (little-endian) order:
//   VALIDATE 0  uint32 0x3C85F7CE              (first, once per connection)
//   SET      1  key, value                     no reply
//   GET      3  key                            → value (the key must exist)
//   ADD      4  key, int64                     → int64 the new value
//   CHECK    5  uint64 n, n keys               → uint8 0 all exist, 1 not
//   WAIT     6  uint64 n, n keys               → uint8 0 once all exist
//   DELETE_KEY 8  key                          → int64 keys removed
//   CANCEL_WAIT 12                             → uint8 1 (the wait dropped)
//   PING    13  uint32 nonce                   → uint32 the nonce
// A connection that sends anything else (or a key or value over 16 MiB)
// is closed. The client sends every key with a "/" before it, as torch's
// TCPStore client does, so that torch's client and this one name the same
// entries: tests/python/test_tcp_store_torch.py has torch 2.x's client
// talk to this server and this client to torch's server.
//
// Whoever reaches the port can read and write every key, as with torch's
// store: the ranks' secrets (gloo_comm.cc) keep strangers' connections out
// of the mesh, not off this port.
#pragma once

#include <memory>
#include <string>

#include "strata/rendezvous.h"
#include "strata/status.h"

namespace strata::gpu {

struct CommOptions;

// A client of the store at host:port, which this process also serves when
// `serve` (listening on every address, port `port`; AlreadyExists-style
// errors name the port). Connecting retries until timeout_s; Unavailable
// names the address when nobody answers by then.
StatusOr<std::shared_ptr<RendezvousStore>> OpenTcpStore(const std::string& host, int port,
                                                        bool serve, double timeout_s);

// The store several ranks meet through when the caller gives none:
// nullptr for one rank, or when a directory or file is named
// (STRATA_GLOO_DIR, STRATA_NCCL_ID_FILE, STRATA_NCCL_UNIQUE_ID), or when
// MASTER_ADDR is unset or a loopback address (one machine: the directory
// under /tmp); else OpenTcpStore(MASTER_ADDR, MASTER_PORT, rank 0 serves,
// unless TORCHELASTIC_USE_AGENT_STORE=true says torchrun's agent does).
// InvalidArgument for a MASTER_PORT that is not a port.
StatusOr<std::shared_ptr<RendezvousStore>> DefaultRendezvousStore(const CommOptions& options);

}  // namespace strata::gpu
