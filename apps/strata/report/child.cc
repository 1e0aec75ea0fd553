#include "apps/strata/report/child.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

namespace strata::cli::report {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

std::string SelfExe() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "strata";
  return std::string(buf, static_cast<size_t>(n));
}

std::string CommandLine(const std::vector<std::string>& argv) {
  std::string line;
  for (const std::string& a : argv) {
    if (!line.empty()) line += ' ';
    if (a.find_first_of(" \t'\"$\\*?;&|<>()") == std::string::npos && !a.empty()) {
      line += a;
    } else {
      line += '\'';
      for (char c : a) line += c == '\'' ? std::string("'\\''") : std::string(1, c);
      line += '\'';
    }
  }
  return line;
}

ChildResult RunChild(const std::vector<std::string>& argv, double timeout_s) {
  ChildResult r;
  const double start = Now();
  int out_pipe[2], err_pipe[2];
  if (pipe2(out_pipe, O_CLOEXEC) != 0) {
    r.error = std::string("pipe: ") + std::strerror(errno);
    return r;
  }
  if (pipe2(err_pipe, O_CLOEXEC) != 0) {
    r.error = std::string("pipe: ") + std::strerror(errno);
    close(out_pipe[0]);
    close(out_pipe[1]);
    return r;
  }
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) {
    r.error = std::string("fork: ") + std::strerror(errno);
    for (int fd : {out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1]}) close(fd);
    return r;
  }
  if (pid == 0) {
    // Its own process group, so that the deadline stops what it started too.
    setpgid(0, 0);
    dup2(out_pipe[1], STDOUT_FILENO);
    dup2(err_pipe[1], STDERR_FILENO);
    execvp(args[0], args.data());
    const char msg[] = "exec failed\n";
    ssize_t ignored = write(STDERR_FILENO, msg, sizeof(msg) - 1);
    (void)ignored;
    _exit(127);
  }
  close(out_pipe[1]);
  close(err_pipe[1]);
  std::string err;
  bool out_open = true, err_open = true;
  double kill_at = start + timeout_s;
  bool termed = false, killed = false;
  while (out_open || err_open) {
    const double now = Now();
    if (now >= kill_at) {
      if (!termed) {
        r.timed_out = true;
        termed = true;
        kill(-pid, SIGTERM);
        kill_at = now + 5;  // then SIGKILL if it has not gone
      } else if (!killed) {
        killed = true;
        kill(-pid, SIGKILL);
        kill_at = now + 3600;
      }
    }
    pollfd fds[2];
    int nfds = 0;
    if (out_open) fds[nfds++] = {out_pipe[0], POLLIN, 0};
    if (err_open) fds[nfds++] = {err_pipe[0], POLLIN, 0};
    const int wait_ms = static_cast<int>(std::max(1.0, std::min(1000.0, (kill_at - now) * 1e3)));
    const int n = poll(fds, static_cast<nfds_t>(nfds), wait_ms);
    if (n < 0 && errno != EINTR) break;
    for (int i = 0; i < nfds && n > 0; ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buf[65536];
      const ssize_t got = read(fds[i].fd, buf, sizeof(buf));
      const bool is_out = fds[i].fd == out_pipe[0];
      if (got <= 0) {
        (is_out ? out_open : err_open) = false;
        continue;
      }
      if (is_out) {
        r.out.append(buf, static_cast<size_t>(got));
      } else {
        err.append(buf, static_cast<size_t>(got));
        if (err.size() > 65536) err.erase(0, err.size() - 8192);
      }
    }
  }
  close(out_pipe[0]);
  close(err_pipe[0]);
  // Both pipes closed; the child may still run (it closed them itself): the
  // same deadline applies to its exit.
  int status = 0;
  for (;;) {
    const pid_t w = waitpid(pid, &status, WNOHANG);
    if (w == pid || (w < 0 && errno != EINTR)) break;
    const double now = Now();
    if (now >= kill_at) {
      if (!termed) {
        r.timed_out = termed = true;
        kill(-pid, SIGTERM);
        kill_at = now + 5;
      } else if (!killed) {
        killed = true;
        kill(-pid, SIGKILL);
        kill_at = now + 3600;
      }
    }
    usleep(10000);
  }
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.err_tail = err.size() > 4096 ? err.substr(err.size() - 4096) : err;
  r.seconds = Now() - start;
  return r;
}

}  // namespace strata::cli::report
