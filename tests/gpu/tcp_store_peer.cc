// One side of a conversation with torch's own TCPStore, for
// tests/python/test_tcp_store_torch.py (which runs torch's side):
//
//   tcp_store_peer client HOST PORT   a client of torch's server
//   tcp_store_peer serve PORT         serves the store; torch is the client
//
// Each step prints what it did; the exit status is 0 when every value read
// is the one torch wrote, 1 otherwise (the reason on stderr).
#include <cstdio>
#include <cstdlib>
#include <string>

#include "src/gpu/tcp_store.h"

namespace {

// Bytes no text-only store would keep: a NUL, a high byte, a newline.
const std::string kBinary("strata\0\xff\n", 9);

int Fail(const std::string& what) {
  std::fprintf(stderr, "tcp_store_peer: %s\n", what.c_str());
  return 1;
}

#define CHECK_OK(expr)                                     \
  do {                                                     \
    auto _s = (expr);                                      \
    if (!_s.ok()) return Fail(#expr ": " + _s.ToString()); \
  } while (0)

int Expect(const strata::StatusOr<std::string>& got, const std::string& want,
           const std::string& key) {
  if (!got.ok()) return Fail("get " + key + ": " + got.status().ToString());
  if (*got != want) return Fail("get " + key + ": \"" + *got + "\", not \"" + want + "\"");
  std::printf("got %s\n", key.c_str());
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (!((mode == "client" && argc == 4) || (mode == "serve" && argc == 3))) {
    std::fprintf(stderr, "usage: tcp_store_peer client HOST PORT | serve PORT\n");
    return 2;
  }
  const bool serve = mode == "serve";
  auto store = strata::gpu::OpenTcpStore(serve ? "127.0.0.1" : argv[2],
                                         std::atoi(argv[serve ? 2 : 3]), serve, 30);
  if (!store.ok()) return Fail(store.status().ToString());
  std::printf("connected\n");
  std::fflush(stdout);
  if (serve) {
    // torch's client reads this, writes its own, then "done" last: the
    // other values are final once "done" is there.
    CHECK_OK((*store)->Set("from_strata", kBinary));
    if (int rc = Expect((*store)->Get("done", 60), "1", "done")) return rc;
    if (int rc = Expect((*store)->Get("from_torch", 60), "torch wrote this", "from_torch"))
      return rc;
    if (int rc = Expect((*store)->Get("counter", 60), "7", "counter")) return rc;
    return 0;
  }
  // torch's server has "from_torch" already and writes "later" after this
  // client says it is connected (a wait that must block until then).
  if (int rc = Expect((*store)->Get("from_torch", 30), "torch wrote this", "from_torch")) return rc;
  if (int rc = Expect((*store)->Get("later", 60), "written later", "later")) return rc;
  if (int rc = Expect((*store)->Get("counter", 30), "7", "counter")) return rc;
  CHECK_OK((*store)->Remove("from_torch"));
  CHECK_OK((*store)->Set("from_strata", kBinary));
  std::printf("set from_strata\n");
  std::fflush(stdout);
  return 0;
}
