"""Gloo's bandwidth between two "machines" against iperf3 over the same link.

The machines are the two network namespaces of tests/multinode/two_machines.py
(a veth pair, 10.99.0.1 and 10.99.0.2). Each repetition runs, back to back:
iperf3 one way (node 1 sends to node 0), iperf3 both ways at once (--bidir),
and `strata bench comm` with one rank in each namespace meeting at
MASTER_ADDR=10.99.0.1 (the TCP store; host device, Gloo over TCP). Medians
over the repetitions are printed.

The comparable figures: an all-gather of `size` bytes between 2 ranks sends
size/2 each way at once, so its busbw (nccl-tests' definition) is the bytes
per second that each direction of the link carries, the quantity iperf3
--bidir reports for each direction. A veth link is a memory copy in the
kernel: both tools are bound by the CPU here, not by a wire.

Root only. Usage: two_machines_bw.py BUILD_DIR [--reps N] [--sizes 1M..64M]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "multinode"))
import two_machines  # noqa: E402  (the namespaces)


def run_in(nodes, k, cmd, env, logname):
    log = open(os.path.join(nodes.logdir, logname), "w+")
    return nodes.start(k, cmd, env, log), log


def finish(proc, log, timeout):
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.seek(0)
    text = log.read()
    log.close()
    return proc.returncode, text


def iperf(nodes, port, seconds, bidir):
    """GB/s per direction (the mean of the directions with --bidir)."""
    server, slog = run_in(nodes, 0, ["iperf3", "-s", "-1", "-p", str(port)], dict(os.environ),
                          "iperf-server.log")
    time.sleep(0.5)
    cmd = ["iperf3", "-c", two_machines.ADDR[0], "-p", str(port), "-t", str(seconds), "-J"]
    if bidir:
        cmd.append("--bidir")
    client, clog = run_in(nodes, 1, cmd, dict(os.environ), "iperf-client.log")
    rc, text = finish(client, clog, seconds + 30)
    finish(server, slog, 10)
    if rc != 0:
        sys.exit(f"iperf3 failed ({rc}):\n{text}")
    result = json.loads(text[text.index("{"):text.rindex("}") + 1])["end"]
    if bidir:
        rates = [result["sum_received"]["bits_per_second"],
                 result["sum_received_bidir_reverse"]["bits_per_second"]]
        return statistics.mean(rates) / 8e9
    return result["sum_received"]["bits_per_second"] / 8e9


def bench_comm(nodes, cli, port, sizes):
    procs = []
    for k in range(2):
        env = dict(os.environ, RANK=str(k), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR=two_machines.ADDR[0], MASTER_PORT=str(port))
        for name in ("STRATA_GLOO_DIR", "STRATA_GLOO_HOST", "STRATA_GLOO_IFNAME",
                     "GLOO_SOCKET_IFNAME"):
            env.pop(name, None)
        procs.append(run_in(nodes, k, [cli, "bench", "comm", "--device", "host", "--sizes", sizes,
                                       "--reps", "1", "--json"], env, f"comm{k}.log"))
    outs = [finish(p, log, 600) for p, log in procs]
    if any(rc != 0 for rc, _ in outs):
        sys.exit("strata bench comm failed:\n" + "\n".join(t for _, t in outs))
    text = outs[0][1]
    return json.loads(text[text.index("{"):text.rindex("}") + 1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("build")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sizes", default="1M..64M")
    parser.add_argument("--iperf-seconds", type=int, default=5)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (network namespaces)")
    if shutil.which("iperf3") is None:
        sys.exit("no iperf3 (apt-get install iperf3)")
    cli = os.path.join(os.path.abspath(args.build), "apps", "strata", "strata")
    one_way, both_ways, comm = [], [], {}
    with two_machines.Nodes() as nodes:
        nodes.logdir = os.path.join(os.path.abspath(args.build), "Testing", "two_machines_bw")
        os.makedirs(nodes.logdir, exist_ok=True)
        port = 29400 + os.getpid() % 500
        for rep in range(args.reps):
            one_way.append(iperf(nodes, port + 100, args.iperf_seconds, bidir=False))
            both_ways.append(iperf(nodes, port + 100, args.iperf_seconds, bidir=True))
            result = bench_comm(nodes, cli, port + rep, args.sizes)
            for point in result["sizes"]:
                row = comm.setdefault(point["bytes"], {"ag": [], "rs": [], "ar": []})
                row["ag"].append(point["all_gather"]["busbw_gbytes_per_s"])
                row["rs"].append(point["reduce_scatter"]["busbw_gbytes_per_s"])
                row["ar"].append(point["all_reduce"]["busbw_gbytes_per_s"])
            print(f"repetition {rep + 1}: iperf3 {one_way[-1]:.3f} GB/s one way, "
                  f"{both_ways[-1]:.3f} GB/s each way with --bidir (load "
                  f"{os.getloadavg()[0]:.2f})", flush=True)
    iperf_bidir = statistics.median(both_ways)
    print(f"\niperf3 (TCP, 1 stream, {args.iperf_seconds} s), medians of {args.reps}: "
          f"{statistics.median(one_way):.3f} GB/s one way, {iperf_bidir:.3f} GB/s each way "
          f"both ways at once")
    print("Gloo across the link, busbw GB/s (medians); ag/iperf3: all-gather busbw over iperf3 "
          "--bidir")
    print(f"{'size':>10} | {'all-gather':>10} {'red-scat':>10} {'all-red':>10} | {'ag/iperf3':>9}")
    for size in sorted(comm):
        row = {k: statistics.median(v) for k, v in comm[size].items()}
        label = f"{size >> 20}M" if size >= 1 << 20 else f"{size >> 10}K"
        print(f"{label:>10} | {row['ag']:>10.3f} {row['rs']:>10.3f} {row['ar']:>10.3f} | "
              f"{row['ag'] / iperf_bidir:>9.3f}")


if __name__ == "__main__":
    main()
