// The TCP rendezvous store (src/gpu/tcp_store.h): a server in this process
// and clients over loopback. Keys set by one client are read by another; a
// read waits for a later write; a read that times out leaves its
// connection usable; strangers' bytes are dropped without harm; and which
// store several ranks meet through by default.
#include "src/gpu/tcp_store.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>

#include "src/gpu/device.h"
#include "tests/test_util.h"

namespace strata::gpu {
namespace {

using strata::testing::ScopedEnv;

int FreePort() { return strata::testing::FreeLoopbackPort(); }

TEST(TcpStoreTest, ClientsShareKeysAndAReadWaitsForTheWrite) {
  const int port = FreePort();
  auto server = OpenTcpStore("127.0.0.1", port, /*serve=*/true, 10);
  ASSERT_TRUE(server.ok()) << server.status();
  auto other = OpenTcpStore("127.0.0.1", port, /*serve=*/false, 10);
  ASSERT_TRUE(other.ok()) << other.status();
  // Binary values of any byte, an empty one, and a large one.
  std::string blob(1 << 20, '\0');
  for (size_t i = 0; i < blob.size(); ++i) blob[i] = static_cast<char>(i * 131 + 7);
  ASSERT_TRUE((*server)->Set("a", std::string("\0\xff\x01", 3)).ok());
  ASSERT_TRUE((*server)->Set("empty", "").ok());
  ASSERT_TRUE((*other)->Set("blob", blob).ok());
  auto a = (*other)->Get("a", 5);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(*a, std::string("\0\xff\x01", 3));
  EXPECT_EQ((*other)->Get("empty", 5).value(), "");
  EXPECT_EQ((*server)->Get("blob", 5).value(), blob);
  // A read of a key set 300 ms later by the other client returns it.
  std::thread writer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    EXPECT_TRUE((*server)->Set("late", "here").ok());
  });
  auto late = (*other)->Get("late", 10);
  writer.join();
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_EQ(*late, "here");
  // Replaced, then removed: a read of a removed key waits, times out
  // naming it, and the connection serves the next call.
  ASSERT_TRUE((*other)->Set("a", "second").ok());
  EXPECT_EQ((*server)->Get("a", 5).value(), "second");
  ASSERT_TRUE((*server)->Remove("a").ok());
  ASSERT_TRUE((*server)->Remove("never-set").ok());
  auto gone = (*other)->Get("a", 0.3);
  ASSERT_FALSE(gone.ok());
  EXPECT_EQ(gone.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(std::string(gone.status().message()).find("key a not set within 0.3 s"),
            std::string::npos)
      << gone.status();
  ASSERT_TRUE((*server)->Set("after", "ok").ok());
  EXPECT_EQ((*other)->Get("after", 5).value(), "ok");
}

TEST(TcpStoreTest, AClientStartedFirstConnectsOnceTheServerListens) {
  const int port = FreePort();
  std::optional<StatusOr<std::shared_ptr<RendezvousStore>>> early;
  std::thread client([&] { early = OpenTcpStore("127.0.0.1", port, false, 10); });
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  auto server = OpenTcpStore("127.0.0.1", port, true, 10);
  client.join();
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE(early->ok()) << early->status();
  ASSERT_TRUE((**early)->Set("k", "v").ok());
  EXPECT_EQ((*server)->Get("k", 5).value(), "v");
}

TEST(TcpStoreTest, StrangersBytesAreDroppedAndTheStoreGoesOn) {
  const int port = FreePort();
  auto server = OpenTcpStore("127.0.0.1", port, true, 10);
  ASSERT_TRUE(server.ok()) << server.status();
  for (const std::string& junk :
       {std::string("GET / HTTP/1.0\r\n\r\n"), std::string("\x00\x01\x02\x03\x04", 5),
        std::string("\x01\xff\xff\xff\xff\xff\xff\xff\xff", 9)}) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    ASSERT_EQ(send(fd, junk.data(), junk.size(), MSG_NOSIGNAL), static_cast<ssize_t>(junk.size()));
    char c;
    // The server closes the connection (EOF) instead of answering.
    timeval tv{5, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    EXPECT_EQ(recv(fd, &c, 1, 0), 0) << "junk " << junk.size() << " bytes";
    close(fd);
  }
  ASSERT_TRUE((*server)->Set("still", "here").ok());
  EXPECT_EQ((*server)->Get("still", 5).value(), "here");
}

TEST(TcpStoreTest, ErrorsNameThePortAndTheAddress) {
  const int port = FreePort();
  auto first = OpenTcpStore("127.0.0.1", port, true, 5);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = OpenTcpStore("127.0.0.1", port, true, 5);
  ASSERT_FALSE(second.ok());
  EXPECT_NE(std::string(second.status().message()).find(fmt::format("port {}", port)),
            std::string::npos)
      << second.status();
  auto nobody = OpenTcpStore("127.0.0.1", FreePort(), false, 0.5);
  ASSERT_FALSE(nobody.ok());
  EXPECT_EQ(nobody.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(std::string(nobody.status().message()).find("MASTER_ADDR/MASTER_PORT"),
            std::string::npos)
      << nobody.status();
  EXPECT_FALSE(OpenTcpStore("127.0.0.1", 70000, false, 1).ok());
}

// One machine (a loopback MASTER_ADDR), one rank, or a directory named:
// no store (the directory under /tmp serves). Another MASTER_ADDR: the TCP
// store, served by rank 0.
TEST(TcpStoreTest, DefaultStoreOnlyAcrossMachinesWithoutADirectory) {
  CommOptions o;
  o.world_size = 2;
  o.rank = 0;
  o.timeout_s = 5;
  const std::string port = std::to_string(FreePort());
  ScopedEnv dir("STRATA_GLOO_DIR", nullptr), file("STRATA_NCCL_ID_FILE", nullptr),
      id("STRATA_NCCL_UNIQUE_ID", nullptr), p("MASTER_PORT", port.c_str());
  {
    ScopedEnv addr("MASTER_ADDR", "127.0.0.1");
    auto s = DefaultRendezvousStore(o);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(*s, nullptr);
  }
  // 127.0.0.1 as one number: not a loopback name, so it counts as another
  // machine's address.
  ScopedEnv addr("MASTER_ADDR", "2130706433");
  {
    ScopedEnv shared("STRATA_GLOO_DIR", "/shared/rdv");
    EXPECT_EQ(DefaultRendezvousStore(o).value(), nullptr);
  }
  o.world_size = 1;
  EXPECT_EQ(DefaultRendezvousStore(o).value(), nullptr);
  o.world_size = 2;
  auto served = DefaultRendezvousStore(o);
  ASSERT_TRUE(served.ok()) << served.status();
  ASSERT_NE(*served, nullptr);
  // A second engine of the process: the same store (the port is taken).
  EXPECT_EQ(DefaultRendezvousStore(o).value(), *served);
  auto client = OpenTcpStore("127.0.0.1", std::stoi(port), false, 5);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*served)->Set("x", "1").ok());
  EXPECT_EQ((*client)->Get("x", 5).value(), "1");
  o.rank = 1;
  ScopedEnv bad("MASTER_PORT", "29x");
  auto refused = DefaultRendezvousStore(o);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(refused.status().message()).find("MASTER_PORT=\"29x\""), std::string::npos)
      << refused.status();
}

// Under torchrun with TORCHELASTIC_USE_AGENT_STORE=true its agent serves
// the store at MASTER_PORT: rank 0 connects as a client there instead of
// trying to listen on a port in use.
TEST(TcpStoreTest, RankZeroUsesTorchrunsAgentStore) {
  const int port = FreePort();
  const std::string port_text = std::to_string(port);
  auto agent = OpenTcpStore("127.0.0.1", port, /*serve=*/true, 5);  // the agent's
  ASSERT_TRUE(agent.ok()) << agent.status();
  CommOptions o;
  o.world_size = 2;
  o.rank = 0;
  o.timeout_s = 5;
  ScopedEnv dir("STRATA_GLOO_DIR", nullptr), file("STRATA_NCCL_ID_FILE", nullptr),
      id("STRATA_NCCL_UNIQUE_ID", nullptr), p("MASTER_PORT", port_text.c_str()),
      addr("MASTER_ADDR", "2130706433"), use("TORCHELASTIC_USE_AGENT_STORE", "true");
  auto rank0 = DefaultRendezvousStore(o);
  ASSERT_TRUE(rank0.ok()) << rank0.status();
  ASSERT_NE(*rank0, nullptr);
  ASSERT_TRUE((*rank0)->Set("from-rank-0", "r0").ok());
  EXPECT_EQ((*agent)->Get("from-rank-0", 5).value(), "r0");
}

}  // namespace
}  // namespace strata::gpu
