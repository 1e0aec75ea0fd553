"""Strata's TCP rendezvous store (src/gpu/tcp_store.cc) talks to torch's own
TCPStore both ways: a Strata client of torch's server (torchrun's agent
store, `init_process_group`'s), and torch's client of Strata's server
(`strata train`'s rank 0). The messages follow torch 2.x's layout, so the
test needs torch 2.x (skipped on 1.x, whose store speaks an older layout),
and the tcp_store_peer tool (STRATA_TCP_STORE_PEER, set by CTest)."""

import contextlib
import os
import socket
import subprocess
import time
from datetime import timedelta

import pytest
import torch

PEER = os.environ.get("STRATA_TCP_STORE_PEER", "")
BINARY = b"strata\0\xff\n"

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="no torch.distributed")


def with_torchs_store(test):
    """Skips a test of the wire layout where it cannot run."""
    test = pytest.mark.skipif(int(torch.__version__.split(".")[0]) < 2,
                              reason=f"torch {torch.__version__}: the layout is torch 2.x's")(test)
    return pytest.mark.skipif(not os.path.isfile(PEER),
                              reason="STRATA_TCP_STORE_PEER (the tcp_store_peer tool) not "
                              "given")(test)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def peer_process(*args):
    """tcp_store_peer ARGS, killed when the block ends (it has exited by
    then unless the block failed)."""
    proc = subprocess.Popen([PEER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def wait_for_line(proc, line, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = proc.stdout.readline()
        if got.strip() == line:
            return
        if not got and proc.poll() is not None:
            break
    pytest.fail(f"tcp_store_peer did not print {line!r} (exit {proc.poll()}): "
                f"{proc.stderr.read() if proc.poll() is not None else ''}")


@with_torchs_store
def test_strata_client_of_torchs_server():
    # The frontend's way to open torch's store (Debian's torch 2.6 has no
    # libuv, which the constructor asks for by default).
    from strata._torch_compat import tcp_store as TCPStore
    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=60))
    server.set("from_torch", "torch wrote this")
    assert server.add("counter", 7) == 7
    with peer_process("client", "127.0.0.1", str(port)) as peer:
        wait_for_line(peer, "got from_torch")
        time.sleep(0.5)  # the client now waits for "later"
        assert peer.poll() is None, peer.stderr.read()
        server.set("later", "written later")
        out, err = peer.communicate(timeout=60)
    assert peer.returncode == 0, err
    assert "set from_strata" in out
    assert server.get("from_strata") == BINARY
    assert not server.check(["from_torch"])  # the Strata client removed it


@with_torchs_store
def test_torch_client_of_stratas_server():
    # The frontend's way to open torch's store (Debian's torch 2.6 has no
    # libuv, which the constructor asks for by default).
    from strata._torch_compat import tcp_store as TCPStore
    port = free_port()
    with peer_process("serve", str(port)) as peer:
        wait_for_line(peer, "connected")
        client = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
        assert client.get("from_strata") == BINARY
        assert client.check(["from_strata"])
        assert not client.check(["nobody_wrote_this"])
        client.set("from_torch", "torch wrote this")
        assert client.add("counter", 3) == 3
        assert client.add("counter", 4) == 7
        client.set("scratch", "x")
        assert client.delete_key("scratch")
        assert not client.delete_key("scratch")
        client.set("done", "1")
        out, err = peer.communicate(timeout=60)
    assert peer.returncode == 0, err
    assert "got counter" in out


def test_frontends_own_store_opens_with_this_torch(monkeypatch):
    """Without torch.distributed up, the frontend opens a TCPStore at
    MASTER_ADDR:MASTER_PORT itself (rank 0 serves it): it opens with the
    torch at hand (Debian's torch 2.6 has no libuv) and the ranks' keys are
    there for torch's own client."""
    import torch.distributed as dist
    from strata import engine
    from strata._torch_compat import tcp_store
    if dist.is_initialized():
        pytest.skip("a process group is up in this process")
    port = free_port()
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(port))):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("STRATA_GLOO_DIR", raising=False)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setattr(engine, "_OWN_STORES", {})
    store = engine._rendezvous_store()
    assert store is not None
    assert engine._rendezvous_store()._store is store._store  # kept for the process
    store.set("strata/x", b"from rank 0")
    peer = tcp_store("127.0.0.1", port, is_master=False, wait_for_workers=False,
                     timeout=timedelta(seconds=30))
    assert peer.get("strata/x") == b"from rank 0"
    peer.set("strata/y", b"from rank 1")
    assert store.get("strata/y", 10) == b"from rank 1"
    store.remove("strata/y")
    assert not peer.delete_key("strata/y")  # gone already
