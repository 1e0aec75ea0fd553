"""What differs between the torch versions the frontend runs on (1.13 to
2.x), in one place."""

import os

_LIBUV = None


def tcpstore_has_libuv():
    """Whether this torch's TCPStore can use libuv. torch >= 2.4 asks for
    it by default (env:// rendezvous, USE_LIBUV unset) and fails with "use_libuv
    was requested but PyTorch was build without libuv support" where it was
    built without (Debian's torch 2.6, for one). Probed once: a store on a
    free loopback port, closed at once. torch without the option: True
    (nothing to change)."""
    global _LIBUV
    if _LIBUV is None:
        try:
            import torch
        except ImportError:  # a launcher of scripts that do not use torch
            _LIBUV = True
            return _LIBUV
        store_cls = getattr(torch.distributed, "TCPStore", None) \
            if torch.distributed.is_available() else None
        if store_cls is None:
            _LIBUV = True
        else:
            try:
                store = store_cls("127.0.0.1", 0, 1, True, use_libuv=True)
                del store
                _LIBUV = True
            except TypeError:  # torch before the option: no libuv to ask for
                _LIBUV = True
            except RuntimeError as e:
                _LIBUV = "libuv" not in str(e)
    return _LIBUV


def rendezvous_env(env=None):
    """The variables a process needs beside env (default os.environ) for
    torch.distributed's env:// rendezvous to work with this torch:
    USE_LIBUV=0 where the TCPStore has no libuv and the user set nothing."""
    env = os.environ if env is None else env
    if "USE_LIBUV" not in env and not tcpstore_has_libuv():
        return {"USE_LIBUV": "0"}
    return {}


def tcp_store(host, port, world_size=None, is_master=False, **kwargs):
    """torch.distributed.TCPStore(...) that opens with this torch: with
    use_libuv=False where its TCPStore has no libuv (the constructor asks
    for libuv by default from torch 2.4 on, whatever USE_LIBUV says), unless
    the caller chose."""
    import torch.distributed as dist
    if "use_libuv" not in kwargs and not tcpstore_has_libuv():
        kwargs["use_libuv"] = False
    return dist.TCPStore(host, port, world_size, is_master, **kwargs)
