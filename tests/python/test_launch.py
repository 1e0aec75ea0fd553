"""python3 -m strata.launch: torchrun's environment on any Python and torch.

Both spellings of its options; the environment of each rank; two ranks of
a real training script (strata.initialize under torch.distributed's gloo
group) that end with the same parameters and leave no rendezvous directory
behind; a failing rank that stops the others and sets the exit status;
SIGTERM that ends stopped and stubborn ranks within the grace period; and
ranks that die with a launcher killed with SIGKILL, their rendezvous
directory removed.
"""

import glob
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

from strata import launch  # noqa: E402
from launch_util import run_launch  # noqa: E402


def parse(argv):
    ap = launch._parser()
    args = ap.parse_args(argv)
    launch._check(ap, args)
    return args


def test_both_spellings_and_the_environment():
    for argv in (["--nproc_per_node", "3", "--node_rank", "1", "--nnodes", "2",
                  "--master_addr", "10.0.0.1", "--master_port", "29511", "t.py", "--lr", "1"],
                 ["--nproc-per-node", "3", "--node-rank", "1", "--nnodes", "2",
                  "--master-addr", "10.0.0.1", "--master-port", "29511", "t.py", "--lr", "1"]):
        args = parse(argv)
        assert args.script == "t.py" and args.script_args == ["--lr", "1"]
        envs = launch.rank_environments(args, {"PATH": "/bin"}, "/tmp/rdv")
        assert [e["RANK"] for e in envs] == ["3", "4", "5"]
        assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2"]
        for e in envs:
            assert e["WORLD_SIZE"] == "6" and e["LOCAL_WORLD_SIZE"] == "3"
            assert e["GROUP_RANK"] == "1" and e["ROLE_WORLD_SIZE"] == "6"
            assert e["MASTER_ADDR"] == "10.0.0.1" and e["MASTER_PORT"] == "29511"
            assert e["OMP_NUM_THREADS"] == "1" and e["STRATA_GLOO_DIR"] == "/tmp/rdv"
            assert e["PATH"] == "/bin"
    # One process: OMP_NUM_THREADS untouched; a set value is kept; a free port.
    one = launch.rank_environments(parse(["t.py"]), {}, None)
    assert len(one) == 1 and "OMP_NUM_THREADS" not in one[0] and "STRATA_GLOO_DIR" not in one[0]
    assert int(one[0]["MASTER_PORT"]) > 0
    kept = launch.rank_environments(parse(["--nproc_per_node", "2", "t.py"]),
                                    {"OMP_NUM_THREADS": "4"}, None)
    assert all(e["OMP_NUM_THREADS"] == "4" for e in kept)


@pytest.mark.parametrize("argv, what", [
    (["--nproc_per_node", "0", "t.py"], "must be at least 1"),
    (["--nnodes", "2", "--node_rank", "2", "t.py"], "must be in 0..1"),
    (["--master_port", "70000", "t.py"], "must be in 1..65535"),
    (["--standalone", "--nnodes", "2", "t.py"], "--nnodes must be 1"),
])
def test_bad_options_are_refused_naming_them(argv, what, capsys):
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    assert what in capsys.readouterr().err


# Two ranks train a small model through strata.initialize with the
# optimizer on the CPU; each writes its parameters' bytes.
TRAIN = textwrap.dedent("""
    import hashlib, json, os, sys
    import torch
    import torch.distributed as dist
    import strata

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
           "strata": {"device": "host", "hbm_budget": "64M", "threads": 1}}
    engine = strata.initialize(model, cfg)
    rank = dist.get_rank()
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(2, 16, generator=g)
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
    sd = engine.state_dict()  # a collective: every rank asks
    digest = hashlib.sha256()
    for k in sorted(sd):
        digest.update(bytes(sd[k].float().contiguous().view(-1).view(torch.uint8).tolist()))
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": dist.get_world_size(),
                   "local_rank": int(os.environ["LOCAL_RANK"]), "digest": digest.hexdigest()}, f)
    engine.close()
    dist.destroy_process_group()
""")


def launch_env(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    env.pop("STRATA_GLOO_DIR", None)
    return env


def test_two_ranks_train_alike_and_leave_no_rendezvous_directory(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    out = tmp_path / "out"
    out.mkdir()
    r = run_launch(["--nproc-per-node", "2", str(script), str(out)], launch_env(tmp_path),
                   timeout=240, before_retry=lambda: [p.unlink() for p in out.glob("rank*.json")])
    assert r.returncode == 0, r.stdout
    results = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")),
                     key=lambda j: j["rank"])
    assert [(j["rank"], j["world"], j["local_rank"]) for j in results] == [(0, 2, 0), (1, 2, 1)]
    # The ranks trained on different data and stepped the same parameters.
    assert results[0]["digest"] == results[1]["digest"]
    assert glob.glob(str(tmp_path / "strata-gloo-*")) == []


def test_a_failing_rank_stops_the_others_and_sets_the_status(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        if os.environ["RANK"] == "1":
            sys.exit(3)
        time.sleep(120)
    """))
    r = run_launch(["--nproc_per_node", "2", str(script)], launch_env(tmp_path), timeout=60)
    assert r.returncode == 3, r.stdout
    assert "rank 1 (local rank 1)" in r.stdout and "exited with status 3" in r.stdout
    assert glob.glob(str(tmp_path / "strata-gloo-*")) == []


def test_docs_one_machine_commands_run_as_written(tmp_path):
    """Every `python3 -m strata.launch` command of docs/data-parallel.md that
    runs on one machine, with this interpreter as python3."""
    with open(os.path.join(ROOT, "docs", "data-parallel.md"), encoding="utf-8") as f:
        text = f.read()
    commands = [line.strip() for line in text.splitlines()
                if line.strip().startswith("python3 -m strata.launch") and "--nnodes" not in line]
    assert commands, "docs/data-parallel.md has no strata.launch command"
    for command in commands:
        argv = command.split()[3:]  # after "python3 -m strata.launch"
        r = run_launch(argv, launch_env(tmp_path), cwd=ROOT)
        assert r.returncode == 0, f"{command}:\n{r.stdout}"
        assert glob.glob(str(tmp_path / "strata-gloo-*")) == []


# The launcher with a short grace period (10 s in use), and a rank script
# that records its pid once it is running.
LAUNCH_WITH_GRACE = textwrap.dedent("""
    import sys
    from strata import launch
    launch._GRACE_S = 1.0
    sys.exit(launch.main(sys.argv[1:]))
""")


def start_launcher(tmp_path, rank_code, grace=True):
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent("""
        import os, signal, sys, time
        out = sys.argv[1]
        rank = os.environ["RANK"]
    """) + textwrap.dedent(rank_code) + textwrap.dedent("""
        with open(os.path.join(out, f"pid{rank}.tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.rename(os.path.join(out, f"pid{rank}.tmp"), os.path.join(out, f"pid{rank}"))
        if rank == "0" and STOP:
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(60)
    """))
    out = tmp_path / "out"
    out.mkdir()
    argv = ["--nproc_per_node", "2", str(script), str(out)]
    cmd = ([sys.executable, "-c", LAUNCH_WITH_GRACE] if grace
           else [sys.executable, "-m", "strata.launch"]) + argv
    proc = subprocess.Popen(cmd, env=launch_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    pids = []
    while time.monotonic() < deadline and len(pids) < 2:
        pids = [int((out / f"pid{r}").read_text()) for r in range(2) if (out / f"pid{r}").exists()]
        time.sleep(0.05)
    assert len(pids) == 2, "the ranks did not start"
    return proc, pids


def gone(pid):
    """Whether process `pid` has ended (a zombie no one reaped counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def kill_all(proc, pids):
    for pid in [proc.pid, *pids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def test_sigterm_ends_stopped_and_stubborn_ranks(tmp_path):
    """Rank 0 stopped (SIGSTOP), rank 1 ignoring SIGTERM: the launcher sends
    SIGTERM and SIGCONT, kills what is left after the grace period and
    exits 128 + 15."""
    proc, pids = start_launcher(tmp_path, """
        STOP = True
        if rank == "1":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
    """)
    try:
        time.sleep(0.2)  # rank 0 stops itself
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 128 + signal.SIGTERM, out
        assert time.monotonic() - start < 10, out
        assert "rank 1 (local rank 1) did not exit within 1 s: killing it" in out, out
        assert "rank 0" not in out, out  # it ran again and ended on SIGTERM
        deadline = time.monotonic() + 5
        while not all(gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(gone(p) for p in pids)
        assert glob.glob(str(tmp_path / "strata-gloo-*")) == []
    finally:
        kill_all(proc, pids)


def test_ranks_die_with_the_launcher_and_the_rendezvous_directory_goes(tmp_path):
    proc, pids = start_launcher(tmp_path, "STOP = False", grace=False)
    try:
        assert len(glob.glob(str(tmp_path / "strata-gloo-*"))) == 1
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (
                all(gone(p) for p in pids) and not glob.glob(str(tmp_path / "strata-gloo-*"))):
            time.sleep(0.05)
        assert all(gone(p) for p in pids)
        assert glob.glob(str(tmp_path / "strata-gloo-*")) == []
    finally:
        kill_all(proc, pids)
