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
SIGTERM (SIGKILL 10 s later) and the launcher exits with the failed rank's
status, naming it; SIGINT and SIGTERM sent to the launcher are passed to
the ranks.
"""

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from ._torch_compat import rendezvous_env

_GRACE_S = 10.0


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


def _stop(procs, sig):
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass


def _wait(procs):
    """Waits for every rank; on the first failure stops the others. Returns
    (exit status, failed local rank or None)."""
    failed = None
    deadline = None
    while True:
        running = [p for p in procs if p.poll() is None]
        if failed is None:
            for i, p in enumerate(procs):
                if p.returncode not in (None, 0):
                    failed = i
                    _stop(procs, signal.SIGTERM)
                    deadline = time.monotonic() + _GRACE_S
                    break
        if not running:
            break
        if deadline is not None and time.monotonic() > deadline:
            _stop(procs, signal.SIGKILL)
            deadline = None
        time.sleep(0.05)
    if failed is None:
        return 0, None
    rc = procs[failed].returncode
    return (128 - rc if rc < 0 else rc), failed


def main(argv=None):
    ap = _parser()
    args = ap.parse_args(argv)
    _check(ap, args)
    # A private rendezvous directory on one machine (several machines need
    # one they all see: STRATA_GLOO_DIR, or MASTER_ADDR/MASTER_PORT's default).
    own_dir = None
    if args.nnodes == 1 and "STRATA_GLOO_DIR" not in os.environ:
        own_dir = tempfile.mkdtemp(prefix="strata-gloo-")
    rendezvous = own_dir if own_dir is not None else os.environ.get("STRATA_GLOO_DIR")
    cmd = [sys.executable] + (["-m"] if args.module else []) + [args.script] + args.script_args
    procs = []
    forwarded = []

    def forward(signum, _frame):
        forwarded.append(signum)
        _stop(procs, signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for env in rank_environments(args, os.environ, rendezvous):
            procs.append(subprocess.Popen(cmd, env=env))
        rc, failed = _wait(procs)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _stop(procs, signal.SIGKILL)
        for p in procs:
            p.wait()
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)
    if forwarded:
        return 128 + forwarded[0]
    if failed is not None:
        rank = args.node_rank * args.nproc_per_node + failed
        print(f"strata.launch: rank {rank} (local rank {failed}) of {args.script} exited with "
              f"status {rc}; the other ranks were stopped", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
