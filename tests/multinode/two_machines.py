"""Two "machines" that share nothing but a network link: two Linux network
namespaces joined by a veth pair (10.99.0.1 and 10.99.0.2), each rank with
its own private /tmp and /dev/shm. The ranks meet at MASTER_ADDR:MASTER_PORT
only (no STRATA_GLOO_DIR, no STRATA_GLOO_HOST), as torchrun and DeepSpeed's
launcher start them.

Cases (worker.py trains; its digest is compared with one process that
accumulates 2 micro-batches):
  launch      `python3 -m strata.launch --nnodes 2 --node-rank K ...` on each
              node, rank 1 pausing 12 s mid-run (a slow peer: longer than
              the host device's deadlock check, shorter than the timeout):
              the same bits, and nothing left in either node's /tmp.
  deepspeed   strata.deepspeed.init_distributed() first (torch's process
              group over GLOO_SOCKET_IFNAME, which Strata's ranks use too):
              the same bits.
  train       `strata train --nnodes 2 --node-rank K ...` (the TCP store
              rank 0 serves at MASTER_ADDR:MASTER_PORT): node 0's losses
              equal one process's accumulating both micro-batches.
  cut         the link goes down mid-run with STRATA_COMM_TIMEOUT_S=10:
              both ranks report the failed collective and exit within the
              timeout (plus a margin); no rank is left running.

Root only (network namespaces); exits 77 (CTest's skip) with the reason
elsewhere. Usage: two_machines.py BUILD_DIR [PYTHON]."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "worker.py")
ADDR = ("10.99.0.1", "10.99.0.2")


def skip(reason):
    print(f"SKIPPED: {reason}")
    sys.exit(77)


def sh(*cmd):
    subprocess.run(cmd, check=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


class Nodes:
    """The two namespaces and their link; removed on exit."""

    def __init__(self):
        tag = str(os.getpid() % 100000)
        self.ns = (f"strata-a{tag}", f"strata-b{tag}")
        self.ifname = (f"sta{tag}", f"stb{tag}")
        self.keep = []  # trees under /tmp the nodes must still see

    def __enter__(self):
        try:
            for ns in self.ns:
                sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", self.ifname[0], "type", "veth", "peer", "name",
               self.ifname[1])
            for k in range(2):
                sh("ip", "link", "set", self.ifname[k], "netns", self.ns[k])
                sh("ip", "-n", self.ns[k], "addr", "add", f"{ADDR[k]}/24", "dev", self.ifname[k])
                sh("ip", "-n", self.ns[k], "link", "set", self.ifname[k], "up")
                sh("ip", "-n", self.ns[k], "link", "set", "lo", "up")
        except subprocess.CalledProcessError as e:
            self.__exit__()
            skip(f"cannot build two network namespaces here ({' '.join(e.cmd)}: "
                 f"{e.stdout.decode(errors='replace').strip()})")
        return self

    def __exit__(self, *exc):
        for ns in self.ns:  # the veth pair goes with its namespaces
            subprocess.run(["ip", "netns", "del", ns], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)

    def start(self, k, cmd, env, log):
        """cmd in node k with a private /tmp and /dev/shm; prints what was
        left in them at the end (LEFT: ...). The source and build trees stay
        visible where they are under /tmp (a clone there): they are bound
        back over the fresh /tmp, and not counted as left."""
        keep = " ".join(shlex.quote(p) for p in self.keep)
        script = (
            "set -e; i=0; mount -t tmpfs none /mnt; "
            f"for p in {keep}; do mkdir /mnt/$i; mount --bind \"$p\" /mnt/$i; i=$((i+1)); done; "
            "mount -t tmpfs none /tmp; mount -t tmpfs none /dev/shm; i=0; "
            f"for p in {keep}; do mkdir -p \"$p\"; mount --bind /mnt/$i \"$p\"; i=$((i+1)); done; "
            "set +e; \"$@\"; rc=$?; "
            "echo \"LEFT: $(ls -A /tmp /dev/shm | grep -v : | tr '\\n' ' ')\"; exit $rc")
        return subprocess.Popen(["ip", "netns", "exec", self.ns[k], "unshare", "--mount",
                                 "--propagation", "private", "sh", "-c", script, "sh", *cmd],
                                env=env, stdout=log, stderr=subprocess.STDOUT)

    def left(self, text):
        """What a node's LEFT line lists, less the kept trees' first parts."""
        m = re.search(r"^LEFT: (.*)$", text, re.M)
        if m is None:
            return None
        tops = {p.split("/")[2] for p in self.keep}
        return [name for name in m.group(1).split() if name not in tops]


def digests(text):
    return re.findall(r"^DIGEST \d+ ([0-9a-f]+)$", text, re.M)


def run_pair(nodes, python, port, extra, per_node=None, timeout=120, during=None, command=None):
    """Both nodes' launchers (`command(k)`, default strata.launch of the
    worker) with the environment plus `extra` and `per_node(k)`; returns
    their exit codes, outputs and the seconds they took."""
    procs, logs = [], []
    for k in range(2):
        env = dict(os.environ, **extra)
        for name in ("STRATA_GLOO_DIR", "STRATA_GLOO_HOST", "STRATA_GLOO_IFNAME",
                     "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            env.pop(name, None)
        env.update((per_node or (lambda k: {}))(k))
        log = open(os.path.join(nodes.logdir, f"node{k}-{port}.log"), "w+")
        logs.append(log)
        cmd = command(k) if command else [
            python, "-m", "strata.launch", "--nnodes", "2", "--node-rank", str(k),
            "--nproc-per-node", "1", "--master-addr", ADDR[0], "--master-port", str(port), WORKER]
        procs.append(nodes.start(k, cmd, env, log))
    if during is not None:
        during(logs)
    start = time.monotonic()
    for p in procs:
        try:
            p.wait(timeout=max(1, timeout - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    outs = []
    for log in logs:
        log.seek(0)
        outs.append(log.read())
        log.close()
    return [p.returncode for p in procs], outs, time.monotonic() - start


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    build = os.path.abspath(sys.argv[1])
    python = sys.argv[2] if len(sys.argv) > 2 else "/usr/bin/python3"
    if sys.platform != "linux" or os.geteuid() != 0:
        skip("needs root on Linux (network namespaces)")
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            skip(f"no `{tool}` command (iproute2, util-linux)")
    try:
        import torch  # noqa: F401
    except ImportError:
        skip("this interpreter has no torch")
    os.environ["PYTHONPATH"] = os.path.join(build, "python")
    failures = []

    one = subprocess.run([python, WORKER], env=dict(os.environ, RANK="0", WORLD_SIZE="1"),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    want = digests(one.stdout)
    if one.returncode != 0 or len(want) != 1:
        sys.exit(f"one process failed:\n{one.stdout}")
    want = want[0]

    with Nodes() as nodes:
        nodes.logdir = os.path.join(build, "Testing", "two_machines")
        # Trees a node must still see when they are under /tmp (nested ones
        # come with their parent).
        trees = sorted({os.path.dirname(os.path.dirname(HERE)), build})
        nodes.keep = [t for t in trees if t.startswith("/tmp/") and
                      not any(t != o and t.startswith(o + "/") for o in trees)]
        os.makedirs(nodes.logdir, exist_ok=True)
        port = 29400 + os.getpid() % 500
        with open(os.path.join(nodes.logdir, "probe.log"), "w+") as log:
            probe = nodes.start(0, ["true"], dict(os.environ), log)
            if probe.wait(timeout=30) != 0:
                log.seek(0)
                skip(f"cannot run a process in a namespace with a private /tmp here "
                     f"(exit {probe.returncode}): {log.read().strip()}")

        def expect_same(name, codes, outs):
            got = [d for o in outs for d in digests(o)]
            left = [nodes.left(o) for o in outs]
            if codes != [0, 0] or got != [want, want]:
                failures.append(f"{name}: exit codes {codes}, digests {got} (one process: {want})"
                                + "".join(f"\n--- node {k}:\n{o}" for k, o in enumerate(outs)))
            elif left != [[], []]:
                failures.append(f"{name}: files left in the nodes' /tmp or /dev/shm: {left}")
            else:
                print(f"{name}: ok, both nodes {want[:16]}, nothing left in /tmp")

        codes, outs, secs = run_pair(nodes, python, port, {"PAUSE_RANK": "1", "PAUSE_S": "12"})
        expect_same("launch (rank 1 pauses 12 s)", codes, outs)

        codes, outs, secs = run_pair(
            nodes, python, port + 1, {"INIT": "deepspeed"},
            per_node=lambda k: {"GLOO_SOCKET_IFNAME": nodes.ifname[k]})
        expect_same("deepspeed.init_distributed", codes, outs)

        # `strata train`'s own model: node 0's losses (it alone prints) are
        # those of one process accumulating both micro-batches.
        cli = os.path.join(build, "apps", "strata", "strata")
        configs = {}
        for name, gas, ranks in (("one", 2, 1), ("two", 1, 2)):
            configs[name] = os.path.join(nodes.logdir, f"{name}.json")
            with open(configs[name], "w") as f:
                json.dump({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
                           "train_batch_size": 2 * gas * ranks, "bf16": {"enabled": True},
                           "gradient_clipping": 1.0, "optimizer": {"params": {"lr": 3e-3}},
                           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                           "strata": {"device": "host", "hbm_budget": "8M", "threads": 2,
                                      "model": {"layers": 2, "hidden": 32, "seq_len": 16}}}, f)
        alone = subprocess.run([cli, "train", "--config", configs["one"], "--steps", "3", "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if alone.returncode != 0:
            sys.exit(f"strata train, one process, failed:\n{alone.stderr}")
        want_losses = json.loads(alone.stdout)["losses"]
        codes, outs, _ = run_pair(
            nodes, python, port + 3, {},
            command=lambda k: [cli, "train", "--config", configs["two"], "--steps", "3", "--json",
                               "--nnodes", "2", "--node-rank", str(k), "--nproc-per-node", "1",
                               "--master-addr", ADDR[0], "--master-port", str(port + 3)])
        got = re.search(r"^(\{.*\})$", outs[0], re.M)
        losses = json.loads(got.group(1)).get("losses") if got else None
        if codes != [0, 0] or losses != want_losses:
            failures.append(f"strata train --nnodes 2: exit codes {codes}, losses {losses} (one "
                            f"process: {want_losses})" +
                            "".join(f"\n--- node {k}:\n{o}" for k, o in enumerate(outs)))
        else:
            print(f"strata train --nnodes 2: ok, losses {losses} as one process")

        cut = {}

        def cut_link(logs):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if all("STEP 3" in open(log.name).read() for log in logs):
                    break
                time.sleep(0.2)
            sh("ip", "-n", nodes.ns[0], "link", "set", nodes.ifname[0], "down")
            cut["at"] = time.monotonic()

        timeout_s = 10
        codes, outs, _ = run_pair(nodes, python, port + 2,
                                  {"STEPS": "1000", "STEP_SLEEP": "0.2",
                                   "STRATA_COMM_TIMEOUT_S": str(timeout_s)},
                                  timeout=120, during=cut_link)
        took = time.monotonic() - cut.get("at", time.monotonic())
        # Each node names the other: its rank, its address, the timeout.
        named = all(f"rank {1 - k} at {ADDR[1 - k]} exited, stopped or became unreachable and "
                    f"did not take part within the collective timeout ({timeout_s} s" in o
                    for k, o in enumerate(outs))
        if any(c == 0 for c in codes) or not named or took > timeout_s + 15:
            failures.append(f"cut link: exit codes {codes}, both named the failed collective: "
                            f"{named}, all exited {took:.0f} s after the cut (timeout "
                            f"{timeout_s} s)" +
                            "".join(f"\n--- node {k}:\n{o}" for k, o in enumerate(outs)))
        else:
            said = re.search(r"gloo communicator rank 0 of 2 .*?;", outs[0])
            print(f"cut link: ok, both ranks named the other's address and the timeout, and "
                  f"exited {took:.0f} s after the cut (exit codes {codes}); node 0 said: "
                  f"{said.group(0) if said else '?'}")
        leftover = subprocess.run(["pgrep", "-f", WORKER], stdout=subprocess.PIPE, text=True)
        if leftover.stdout.strip():
            failures.append(f"ranks still running after the cases: {leftover.stdout.split()}")
    if failures:
        sys.exit("FAILED:\n" + "\n".join(failures))
    print("two machines: all cases passed")


if __name__ == "__main__":
    main()
