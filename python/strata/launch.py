"""Starts one process per rank, as torchrun does, on any Python and torch.

    python3 -m strata.launch --nproc_per_node 2 train.py --its --args
    python3 -m strata.launch --nproc-per-node 8 --nnodes 2 --node-rank 0 \\
        --master-addr 10.0.0.1 --master-port 29500 train.py

Each process runs `python3 SCRIPT ARGS` (or `python3 -m MODULE ARGS` with
-m) with torch.distributed's environment: RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT (a free port on one machine unless given), OMP_NUM_THREADS=1
when it is unset and there is more than one process (torchrun's rule), and
STRATA_GLOO_DIR: on one machine a fresh private directory for the host
device's rendezvous, removed when the ranks have ended. Both spellings of
every option are accepted (--nproc_per_node and --nproc-per-node), as
torch 1.13's torchrun knows only the first and torch 2's prefers the
second; torch 1.13's torchrun itself fails on Python 3.11 before starting a
worker, which is why this module exists.

The launcher waits for every rank. When one fails, the others are sent
SIGTERM and the launcher exits with the failed rank's status, naming it.
SIGINT, SIGTERM and SIGHUP sent to the launcher are passed to every rank,
and it then exits with 128 + the signal's number. Either way each signal
sent to a rank is followed by SIGCONT (a stopped rank runs again to handle
it), and a rank still running 10 s after the first is killed (SIGKILL,
named on stderr): the launcher always returns, also when a rank was
stopped (SIGSTOP) or ignores SIGTERM. These are `strata train
--nproc-per-node`'s rules (apps/strata/launch_ranks.h).

The ranks die with the launcher: each is started with PR_SET_PDEATHSIG
(SIGKILL), so `kill -9` of the launcher leaves no rank training on. The
rendezvous directory it made is then removed by a small watcher process
(_WATCH_RENDEZVOUS) that waits, in a session of its own, for the launcher
to end however it ends (the end of a pipe only the launcher holds).
"""

import argparse
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from ._torch_compat import rendezvous_env

# Seconds the ranks have to exit once told to stop (a signal passed on, or
# another rank failed) before the launcher kills them: kRankStopGraceS of
# apps/strata/launch_ranks.h.
_GRACE_S = 10.0

# The signals passed on to the ranks.
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

# The watcher of the rendezvous directory: reads its end of the pipe (fd
# argv[1]) until the launcher, the only holder of the other end, has ended
# (EOF: exited, or killed), then removes the directory (argv[2]). Without
# the site module and the user's environment (-I -S): it starts in
# milliseconds and imports nothing of the user's.
_WATCH_RENDEZVOUS = """
import os, shutil, sys
fd = int(sys.argv[1])
while os.read(fd, 4096):
    pass
shutil.rmtree(sys.argv[2], ignore_errors=True)
"""


def _parser():
    ap = argparse.ArgumentParser(
        prog="python3 -m strata.launch",
        description="Start one process per rank with torch.distributed's environment.")
    ap.add_argument("--nproc_per_node", "--nproc-per-node", dest="nproc_per_node", type=int,
                    default=1, help="processes on this machine (default 1)")
    ap.add_argument("--nnodes", type=int, default=1, help="machines (default 1)")
    ap.add_argument("--node_rank", "--node-rank", dest="node_rank", type=int, default=0,
                    help="this machine's index, 0..nnodes-1 (default 0)")
    ap.add_argument("--master_addr", "--master-addr", dest="master_addr", default="127.0.0.1",
                    help="rank 0's machine (default 127.0.0.1)")
    ap.add_argument("--master_port", "--master-port", dest="master_port", type=int, default=None,
                    help="rank 0's port (default: a free one with one machine, else 29500)")
    ap.add_argument("--standalone", action="store_true",
                    help="one machine (accepted for torchrun's command lines; the default)")
    ap.add_argument("-m", "--module", action="store_true",
                    help="run SCRIPT as a module (python3 -m SCRIPT)")
    ap.add_argument("script", help="the training script (or module with -m)")
    ap.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    return ap


def free_port():
    """A TCP port free on 127.0.0.1 now (MASTER_PORT of a one-machine run)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check(ap, args):
    if args.nproc_per_node < 1:
        ap.error(f"--nproc_per_node {args.nproc_per_node}: must be at least 1")
    if args.nnodes < 1:
        ap.error(f"--nnodes {args.nnodes}: must be at least 1")
    if not 0 <= args.node_rank < args.nnodes:
        ap.error(f"--node_rank {args.node_rank}: must be in 0..{args.nnodes - 1} "
                 f"(--nnodes {args.nnodes})")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        ap.error(f"--master_port {args.master_port}: must be in 1..65535")
    if args.standalone and args.nnodes != 1:
        ap.error("--standalone runs on one machine: --nnodes must be 1")


def rank_environments(args, base_env, rendezvous_dir):
    """The environment of each local rank (a list, local rank order)."""
    port = args.master_port
    if port is None:
        port = free_port() if args.nnodes == 1 else 29500
    world = args.nnodes * args.nproc_per_node
    envs = []
    for local in range(args.nproc_per_node):
        env = dict(base_env)
        rank = args.node_rank * args.nproc_per_node + local
        env.update(RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(args.nproc_per_node), GROUP_RANK=str(args.node_rank),
                   ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(world),
                   MASTER_ADDR=args.master_addr, MASTER_PORT=str(port))
        if args.nproc_per_node > 1 and "OMP_NUM_THREADS" not in base_env:
            env["OMP_NUM_THREADS"] = "1"
        if rendezvous_dir is not None:
            env["STRATA_GLOO_DIR"] = rendezvous_dir
        env.update(rendezvous_env(base_env))  # USE_LIBUV=0 for a torch without libuv
        envs.append(env)
    return envs


def _signal_ranks(procs, sig):
    """Sends `sig` to every rank still running, and SIGCONT after it: a
    stopped rank (SIGSTOP, a debugger detached) handles nothing else until
    it runs again."""
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(sig)
                p.send_signal(signal.SIGCONT)
            except ProcessLookupError:
                pass


def _wait(procs, received, first_rank=0):
    """Waits for every rank. `received` is the list the signal handler
    appends the launcher's signals to: each is passed on to the ranks. On
    the first failure the others are sent SIGTERM. Ranks still running
    _GRACE_S after the first signal sent to them are killed. Returns (exit
    status, failed local rank or None); first_rank is local rank 0's rank,
    for the messages."""
    failed = None
    kill_at = None
    handled = 0

    def end_ranks(sig):
        nonlocal kill_at
        _signal_ranks(procs, sig)
        if kill_at is None:
            kill_at = time.monotonic() + _GRACE_S

    while True:
        while handled < len(received):
            end_ranks(received[handled])
            handled += 1
        running = [p for p in procs if p.poll() is None]
        if failed is None:
            for i, p in enumerate(procs):
                if p.returncode not in (None, 0):
                    failed = i
                    if kill_at is None:  # (ranks already stopping are not signalled twice)
                        end_ranks(signal.SIGTERM)
                    break
        if not running:
            break
        if kill_at is not None and time.monotonic() >= kill_at:
            for i, p in enumerate(procs):
                if p.poll() is None:
                    print(f"strata.launch: rank {first_rank + i} (local rank {i}) did not exit "
                          f"within {_GRACE_S:.0f} s: killing it", file=sys.stderr, flush=True)
                    p.kill()
            kill_at = float("inf")
        time.sleep(0.02)
    if failed is None:
        return 0, None
    rc = procs[failed].returncode
    return (128 - rc if rc < 0 else rc), failed


def _die_with_launcher():
    """The preexec_fn of a rank (run in the child between fork and exec):
    PR_SET_PDEATHSIG, so that the kernel kills the rank (SIGKILL) when the
    launcher dies, which cannot end it once it is killed itself. A launcher
    that died before prctl took effect is seen as a new parent: the rank
    exits at once. prctl is looked up here, before any fork."""
    launcher = os.getpid()
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: ranks outlive a killed launcher
        return None

    def preexec():
        if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or os.getppid() != launcher:
            os._exit(1)
    return preexec


def _watch_rendezvous(directory):
    """Starts the watcher that removes `directory` once this process has
    ended; returns (watcher, the pipe's write end, which this process
    keeps). Its own session: a Ctrl-C or a signal to the launcher's process
    group does not end it before the launcher."""
    r, w = os.pipe()  # (neither end inherited by the ranks: close_fds)
    try:
        watcher = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCH_RENDEZVOUS, str(r),
                                    directory], pass_fds=(r,), start_new_session=True,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
    except BaseException:
        os.close(w)
        raise
    finally:
        os.close(r)
    return watcher, w


def main(argv=None):
    ap = _parser()
    args = ap.parse_args(argv)
    _check(ap, args)
    # A private rendezvous directory on one machine. Several machines meet
    # at MASTER_ADDR:MASTER_PORT (torch.distributed's store), or through
    # STRATA_GLOO_DIR when it is set.
    own_dir = None
    if args.nnodes == 1 and "STRATA_GLOO_DIR" not in os.environ:
        own_dir = tempfile.mkdtemp(prefix="strata-gloo-")
    rendezvous = own_dir if own_dir is not None else os.environ.get("STRATA_GLOO_DIR")
    cmd = [sys.executable] + (["-m"] if args.module else []) + [args.script] + args.script_args
    procs = []
    watcher = watch_fd = None
    received = []  # the signals sent to the launcher, in order (_wait passes them on)

    def on_signal(signum, _frame):
        received.append(signum)

    old = {s: signal.signal(s, on_signal) for s in _FORWARDED}
    try:
        if own_dir is not None:
            watcher, watch_fd = _watch_rendezvous(own_dir)
        envs = rank_environments(args, os.environ, rendezvous)
        preexec = _die_with_launcher()
        for env in envs:
            if received:  # told to stop while starting: start no more
                break
            procs.append(subprocess.Popen(cmd, env=env, preexec_fn=preexec))
        rc, failed = _wait(procs, received, args.node_rank * args.nproc_per_node)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)
        if watcher is not None:
            os.close(watch_fd)  # the watcher sees the end, finds nothing to remove, exits
            watcher.wait()
    if received:
        return 128 + received[0]
    if failed is not None:
        rank = args.node_rank * args.nproc_per_node + failed
        print(f"strata.launch: rank {rank} (local rank {failed}) of {args.script} exited with "
              f"status {rc}; the other ranks were stopped", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
