#include "apps/strata/launch_ranks.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>

#include "apps/strata/bench_stats.h"
#include "apps/strata/exit_codes.h"
#include "src/common/status_util.h"
#include "src/gpu/device.h"

namespace strata::cli {
namespace {

// A TCP port on 127.0.0.1 that was free a moment ago (the kernel's pick).
StatusOr<int> FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return ErrnoError("socket", errno);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    const int e = errno;
    close(fd);
    return ErrnoError("binding a free port on 127.0.0.1", e);
  }
  close(fd);
  return static_cast<int>(ntohs(a.sin_port));
}

// The signal to forward (set by the handler, read by the wait loop).
std::atomic<int> g_forward{0};
void OnSignal(int sig) { g_forward.store(sig); }

// Sends `sig` to a rank, and SIGCONT after it: a stopped rank (SIGSTOP, a
// debugger detached) handles nothing else until it runs again.
void SignalRank(pid_t pid, int sig) {
  kill(pid, sig);
  kill(pid, SIGCONT);
}

int CodeOf(int wait_status) {
  return WIFEXITED(wait_status) ? WEXITSTATUS(wait_status)
                                : kExitSignalBase + WTERMSIG(wait_status);
}

}  // namespace

Status CheckGpusForLocalRanks(int nproc, const std::string& device, const char* flag) {
  if (device == "host") return Status();  // no CUDA driver call
  return GpusForLocalRanks(nproc, device, static_cast<int>(gpu::ListCudaDevices().devices.size()),
                           flag);
}

int LaunchLocalRanks(const char* cmd, const LaunchOptions& o,
                     const std::vector<std::string>& args) {
  const int nproc = o.nproc;
  int port = o.master_port;
  if (port == 0 && o.nnodes > 1) port = 29500;  // torchrun's default
  if (port == 0) {
    auto free = FreePort();
    if (!free.ok()) return Fail(cmd, free.status());
    port = *free;
  }
  // One machine without STRATA_GLOO_DIR: a private rendezvous directory of
  // its own. Several: the environment's directory when set, else the TCP
  // store rank 0 serves at MASTER_ADDR:MASTER_PORT (the engine opens it).
  std::string dir;
  if (o.nnodes == 1 && std::getenv("STRATA_GLOO_DIR") == nullptr) {
    char dir_template[] = "/tmp/strata-ranks-XXXXXX";
    if (mkdtemp(dir_template) == nullptr)
      return Fail(cmd, ErrnoError("creating the rendezvous directory under /tmp", errno));
    dir = dir_template;
  }
  const int first_rank = o.node_rank * nproc;
  std::error_code ec;
  const std::string exe = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  if (ec) return Fail(cmd, "cannot find this program (/proc/self/exe): " + ec.message());
  std::vector<std::string> argv = {exe};
  argv.insert(argv.end(), args.begin(), args.end());
  std::fflush(stdout);
  std::fflush(stderr);
  // Signals arrive here from now on (and are forwarded); the ranks get the
  // default handlers back before exec.
  struct sigaction sa {
  }, old_int{}, old_term{}, old_hup{};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);
  sigaction(SIGHUP, &sa, &old_hup);
  auto restore = [&] {
    sigaction(SIGINT, &old_int, nullptr);
    sigaction(SIGTERM, &old_term, nullptr);
    sigaction(SIGHUP, &old_hup, nullptr);
  };
  const pid_t launcher = getpid();
  std::vector<pid_t> pids;
  for (int r = 0; r < nproc; ++r) {
    const pid_t pid = fork();
    if (pid < 0) {
      const int e = errno;
      for (pid_t p : pids) kill(p, SIGKILL);
      for (pid_t p : pids) waitpid(p, nullptr, 0);
      restore();
      return Fail(cmd, ErrnoError("fork", e));
    }
    if (pid == 0) {
      // The rank dies with the launcher, which cannot end it once it is
      // killed itself (SIGKILL); a launcher gone before prctl took effect is
      // seen as a new parent.
      if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != launcher) _exit(kExitFailed);
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
      signal(SIGHUP, SIG_DFL);
      setenv("RANK", std::to_string(first_rank + r).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(o.nnodes * nproc).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      setenv("GROUP_RANK", std::to_string(o.node_rank).c_str(), 1);
      setenv("MASTER_ADDR", o.master_addr.c_str(), 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      if (!dir.empty()) setenv("STRATA_GLOO_DIR", dir.c_str(), 1);
      // (A rank takes a second SIGINT/SIGTERM/SIGHUP soon after the first for
      // this launcher's forwarded copy: cmd_train.cc.)
      setenv("STRATA_LAUNCHER_PID", std::to_string(launcher).c_str(), 1);
      if (first_rank + r != 0) {
        if (FILE* null = std::freopen("/dev/null", "w", stdout); null == nullptr) _exit(kExitIo);
      }
      std::vector<char*> cargv;
      for (auto& s : argv) cargv.push_back(s.data());
      cargv.push_back(nullptr);
      execv(exe.c_str(), cargv.data());
      std::fprintf(stderr, "strata %s: exec %s: %s\n", cmd, exe.c_str(), std::strerror(errno));
      _exit(kExitFailed);
    }
    pids.push_back(pid);
  }
  using Clock = std::chrono::steady_clock;
  std::vector<int> status(pids.size(), -1);
  int result = 0;
  size_t left = pids.size();
  // Once the ranks are told to stop (a signal forwarded, or a rank failed),
  // those still running at `kill_at` are killed.
  bool ending = false, killed = false;
  Clock::time_point kill_at;
  auto end_ranks = [&](int sig) {
    for (size_t i = 0; i < pids.size(); ++i)
      if (status[i] == -1) SignalRank(pids[i], sig);
    if (!ending)
      kill_at = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(kRankStopGraceS));
    ending = true;
  };
  while (left > 0) {
    if (const int sig = g_forward.exchange(0); sig != 0) end_ranks(sig);
    bool any = false;
    for (size_t i = 0; i < pids.size(); ++i) {
      if (status[i] != -1) continue;
      int st = 0;
      const pid_t got = waitpid(pids[i], &st, WNOHANG);
      if (got != pids[i]) continue;
      any = true;
      status[i] = st;
      --left;
      const int code = CodeOf(st);
      if (code == 0) continue;
      std::fprintf(stderr, "strata %s: rank %zu %s %d\n", cmd, first_rank + i,
                   WIFEXITED(st) ? "exited with" : "was ended by signal",
                   WIFEXITED(st) ? code : WTERMSIG(st));
      if (result == 0) result = code;
      if (!ending) end_ranks(SIGTERM);  // (ranks already stopping are not signalled twice)
    }
    if (ending && !killed && left > 0 && Clock::now() >= kill_at) {
      killed = true;
      for (size_t i = 0; i < pids.size(); ++i)
        if (status[i] == -1) {
          std::fprintf(stderr, "strata %s: rank %zu did not exit within %.0f s: killing it\n", cmd,
                       first_rank + i, kRankStopGraceS);
          kill(pids[i], SIGKILL);
        }
    }
    if (!any && left > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  restore();
  if (!dir.empty()) std::filesystem::remove_all(dir, ec);
  return result;
}

}  // namespace strata::cli
