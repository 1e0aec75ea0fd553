"""What the Python frontend writes and reads on a machine other users share.

Strata may run as root where other users can write: strata.deepspeed's
checkpoints (the tag directory, client_state.pt, `latest`),
save_16bit_model and zero_to_fp32's output keep src/common/private_fs.h's
rules. Each test below plants what another user could (a directory they
own, a symlink, a FIFO, a pickle that runs code, a tag that leaves the
directory) and checks that the call ends with one line naming the path and
what is wrong, within seconds, and leaves everything else alone.
"""

import argparse
import contextlib
import copy
import os
import re
import signal
import stat

import pytest
import torch

import strata
import strata.deepspeed as deepspeed
from strata import zero_to_fp32 as strata_zero_to_fp32
from strata.deepspeed.utils import zero_to_fp32 as ds_zero_to_fp32

OTHER_UID = 65534  # "nobody": a user other than this process's


def tiny_config():
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            "strata": {"device": "host", "hbm_budget": "64M", "threads": 1}}


def make_engine(scheduler=None, steps=1):
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 4)
    engine, _, _, _ = deepspeed.initialize(model=model, config=tiny_config(),
                                           lr_scheduler=scheduler)
    for _ in range(steps):
        engine.backward(engine(torch.randn(2, 4)).square().mean())
        engine.step()
    return engine


@pytest.fixture
def engine():
    e = make_engine()
    yield e
    e.destroy()


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


@contextlib.contextmanager
def deadline(seconds):
    """Fails the test instead of hanging (a FIFO opened for reading blocks
    until a writer comes)."""
    def expired(_sig, _frame):
        raise TimeoutError(f"still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


def give_to_another_user(path):
    """chown to OTHER_UID: what another user's planted file looks like (root
    only, as Strata runs on shared machines)."""
    if os.geteuid() != 0:
        pytest.skip("planting another user's file needs root")
    os.chown(path, OTHER_UID, OTHER_UID)


def shared_dir(tmp_path):
    """A directory every user may create files in (as /tmp: 1777)."""
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o1777)
    return d


class RunsCode:
    """Unpickling this calls os.mkdir(path): what a planted pickle can do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


# ---- client_state.pt: never unpickled into code -------------------------------------------

def test_a_planted_client_state_runs_no_code(tmp_path, engine):
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint(ckpt)
    marker = tmp_path / "ran"
    cs = ckpt / "global_step1" / "client_state.pt"
    cs.unlink()
    with open(cs, "wb") as f:
        torch.save({"x": RunsCode(str(marker))}, f)
    os.chmod(cs, 0o600)
    with deadline(20), pytest.raises(strata.FailedPreconditionError) as e:
        engine.load_checkpoint(ckpt)
    msg = str(e.value)
    assert str(cs) in msg and "STRATA_TRUST_CLIENT_STATE=1" in msg and "\n" not in msg
    assert not marker.exists()


def test_client_state_of_other_objects_needs_the_opt_in(tmp_path, engine, monkeypatch):
    with pytest.raises(strata.InvalidArgumentError, match="'_strata_json' is reserved"):
        engine.save_checkpoint(tmp_path / "c", client_state={"_strata_json": 1})
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint(ckpt, client_state={"args": argparse.Namespace(lr=0.5), "epoch": 3})
    monkeypatch.delenv("STRATA_TRUST_CLIENT_STATE", raising=False)
    with pytest.raises(strata.FailedPreconditionError, match="argparse.Namespace"):
        engine.load_checkpoint(ckpt)
    monkeypatch.setenv("STRATA_TRUST_CLIENT_STATE", "1")
    _, client = engine.load_checkpoint(ckpt)
    assert client == {"args": argparse.Namespace(lr=0.5), "epoch": 3}


@pytest.mark.parametrize("make", [
    lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.9 ** s),
], ids=["StepLR", "LambdaLR"])
def test_the_lr_schedulers_state_round_trips_without_unpickling_code(tmp_path, make,
                                                                      monkeypatch):
    monkeypatch.delenv("STRATA_TRUST_CLIENT_STATE", raising=False)
    saver = make_engine(make, steps=3)
    ckpt = tmp_path / "ckpt"
    # (Python floats too, which torch 1.13's weights-only loader cannot read.)
    client_state = {"epoch": 2, "w": torch.arange(3), "loss": 0.25,
                    "history": {"lr": [1e-3, float("inf")], "note": None, "ok": True}}
    saver.save_checkpoint(ckpt, client_state=client_state)
    want = saver.lr_scheduler.state_dict()
    saver.destroy()
    # The file is one that torch's weights-only loader reads (on torch 1.13 too).
    with open(ckpt / "global_step3" / "client_state.pt", "rb") as f:
        torch.load(f, weights_only=True)
    loader = make_engine(make, steps=0)
    _, client = loader.load_checkpoint(ckpt)
    assert set(client) == set(client_state) and torch.equal(client["w"], torch.arange(3))
    assert {k: v for k, v in client.items() if k != "w"} == \
        {k: v for k, v in client_state.items() if k != "w"}
    assert type(client["loss"]) is float and type(client["epoch"]) is int
    got = loader.lr_scheduler.state_dict()
    assert got == want and got["last_epoch"] == 3
    loader.destroy()


# ---- the tag directory and its files: this user's alone ------------------------------------

def test_a_tag_directory_another_user_made_is_refused_on_save(tmp_path, engine):
    shared = shared_dir(tmp_path)
    planted = shared / "global_step1"
    planted.mkdir()
    give_to_another_user(planted)
    owned = re.escape(f"{planted}: owned by uid {OTHER_UID}, not by this process's")
    with pytest.raises(strata.StrataError, match=owned):
        engine.save_checkpoint(shared)
    assert os.listdir(planted) == [] and not (shared / "latest").exists()
    # Ours, but writable by others.
    os.chown(planted, os.geteuid(), os.getegid())
    os.chmod(planted, 0o777)
    with pytest.raises(strata.StrataError, match="writable by group or others \\(mode 0777\\)"):
        engine.save_checkpoint(shared)
    assert os.listdir(planted) == []
    # A symlink where the tag would go.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, shared / "t")
    with pytest.raises(strata.StrataError, match="a symbolic link, not a directory"):
        engine.save_checkpoint(shared, tag="t")
    assert os.listdir(elsewhere) == []
    # A new tag directory is made private.
    engine.save_checkpoint(shared, tag="mine")
    assert mode(shared / "mine") == 0o700 and mode(shared / "mine" / "client_state.pt") == 0o600
    assert mode(shared / "latest") == 0o600


@pytest.mark.parametrize("plant, why", [
    ("tag_foreign", f"owned by uid {OTHER_UID}"),
    ("tag_open", "writable by group or others"),
    ("tag_symlink", "a symbolic link, not a directory"),
    ("cs_foreign", f"owned by uid {OTHER_UID}"),
    ("cs_open", "writable by group or others"),
    ("cs_symlink", "a symbolic link, not a regular file"),
    ("cs_directory", "a directory, not a regular file"),
    ("latest_foreign", f"owned by uid {OTHER_UID}"),
])
def test_what_another_user_could_have_changed_is_refused_on_load(tmp_path, engine, plant, why):
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint(ckpt, tag="real")
    tag = ckpt / "real"
    cs = tag / "client_state.pt"
    named = {"tag": tag, "cs": cs, "latest": ckpt / "latest"}[plant.split("_")[0]]
    kind = plant.split("_")[1]
    if kind == "foreign":
        give_to_another_user(named)
    elif kind == "open":
        os.chmod(named, 0o777 if named.is_dir() else 0o666)
    elif kind == "symlink":
        os.rename(named, tmp_path / "moved")
        os.symlink(tmp_path / "moved", named)
    elif kind == "directory":
        named.unlink()
        named.mkdir()
    with deadline(20), pytest.raises(strata.StrataError) as e:
        engine.load_checkpoint(ckpt)
    msg = str(e.value)
    assert str(named) in msg and why in msg and "\n" not in msg, msg


def test_a_fifo_is_refused_without_blocking(tmp_path, engine):
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint(ckpt)
    cs = ckpt / "global_step1" / "client_state.pt"
    cs.unlink()
    os.mkfifo(cs, 0o600)
    with deadline(10), pytest.raises(strata.StrataError, match=re.escape(f"{cs}: a FIFO")):
        engine.load_checkpoint(ckpt)
    os.unlink(cs)
    (ckpt / "latest").unlink()
    os.mkfifo(ckpt / "latest", 0o600)
    with deadline(10), pytest.raises(strata.StrataError, match="latest: a FIFO"):
        engine.load_checkpoint(ckpt)
    with deadline(10), pytest.raises(strata.StrataError, match="latest: a FIFO"):
        ds_zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(ckpt)


# ---- `latest` and tags: one rule for every reader ------------------------------------------

@pytest.mark.parametrize("content, why", [
    (b"", "empty"), (b" \n\t", "empty"), (b"\xff\xfe", "not UTF-8"),
    (b"../other/t0", "one directory name"), (b"/abs/t0", "one directory name"),
    (b"..", "one directory name"), (b"a\nb", "one directory name"),
])
def test_an_unusable_latest_is_refused_naming_it(tmp_path, engine, content, why):
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint(ckpt)
    (tmp_path / "other").mkdir()
    engine.save_checkpoint(tmp_path / "other", tag="t0")  # what "../other/t0" would reach
    latest = ckpt / "latest"
    latest.write_bytes(content)
    for load in (engine.load_checkpoint, ds_zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint):
        with pytest.raises(strata.InvalidArgumentError) as e:
            load(ckpt)
        msg = str(e.value)
        assert f"{latest}" in msg and why in msg and "\n" not in msg, msg


@pytest.mark.parametrize("kind, why", [("symlink", "a symbolic link"),
                                       ("directory", "a directory")])
def test_a_latest_that_is_not_a_file_is_refused(tmp_path, engine, kind, why):
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint(ckpt)
    latest = ckpt / "latest"
    latest.unlink()
    if kind == "symlink":
        (tmp_path / "t").write_text("global_step1")
        os.symlink(tmp_path / "t", latest)
    else:
        latest.mkdir()
    for load in (engine.load_checkpoint, ds_zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint):
        with pytest.raises(strata.StrataError,
                           match=re.escape(f"{latest}: {why}, not a regular file")):
            load(ckpt)
    # No `latest` at all: nothing to resume, as in DeepSpeed.
    os.unlink(latest) if kind == "symlink" else os.rmdir(latest)
    assert engine.load_checkpoint(ckpt) == (None, None)


def test_every_reader_refuses_a_tag_outside_the_directory(tmp_path, engine):
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint(ckpt)
    (tmp_path / "other").mkdir()
    engine.save_checkpoint(tmp_path / "other", tag="t0")
    out = tmp_path / "out.pt"
    for tag in ("../other/t0", str(tmp_path / "other" / "t0"), "..", ""):
        calls = [
            lambda: engine.load_checkpoint(ckpt, tag=tag),
            lambda: ds_zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(ckpt, tag=tag),
            lambda: ds_zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, tag=tag),
            lambda: ds_zero_to_fp32.load_state_dict_from_zero_checkpoint(
                torch.nn.Linear(4, 4), ckpt, tag=tag),
            lambda: strata_zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
                tmp_path / "other", tag=tag),
            lambda: strata_zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(
                tmp_path / "other", out, tag=tag),
        ]
        for call in calls:
            with pytest.raises(strata.InvalidArgumentError, match="one directory name"):
                call()
        assert not out.exists()


# ---- files written: new, private, renamed over a regular file only ------------------------

def writers(engine, ckpt):
    """(name, write(path)) of every Python writer of a file a user names."""
    return [
        ("save_16bit_model", lambda p: engine.save_16bit_model(p.parent, p.name)),
        ("strata.Engine.save_16bit_model", lambda p: strata.Engine.save_16bit_model(engine, p)),
        ("strata.zero_to_fp32", lambda p: strata_zero_to_fp32.
         convert_zero_checkpoint_to_fp32_state_dict(ckpt / "global_step1", p)),
        ("deepspeed.utils.zero_to_fp32",
         lambda p: ds_zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(ckpt, p)),
    ]


def test_writers_never_write_through_a_planted_file(tmp_path, engine, umask_022):
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint(ckpt)
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    for name, write in writers(engine, ckpt):
        d = tmp_path / f"out-{name}"
        d.mkdir()
        os.chmod(d, 0o1777)  # where other users could plant files
        target = d / "pytorch_model.bin"
        # A symlink at the target: refused and left alone.
        os.symlink(victim, target)
        with deadline(20), pytest.raises(strata.StrataError,
                                         match=re.escape(f"{target}: a symbolic link")):
            write(target)
        assert victim.read_bytes() == b"keep" and os.path.islink(target), name
        os.unlink(target)
        # A FIFO or a directory: refused, without blocking.
        os.mkfifo(target)
        with deadline(20), pytest.raises(strata.StrataError, match=re.escape(f"{target}: a FIFO")):
            write(target)
        os.unlink(target)
        target.mkdir()
        with deadline(20), pytest.raises(strata.StrataError,
                                         match=re.escape(f"{target}: a directory")):
            write(target)
        os.rmdir(target)
        # A symlink at the first temporary name: not followed, another name taken.
        os.symlink(victim, f"{target}.tmp")
        with deadline(20):
            write(target)
        assert victim.read_bytes() == b"keep", name
        assert stat.S_ISREG(os.lstat(target).st_mode) and mode(target) == 0o600, name
        assert sorted(os.listdir(d)) == ["pytorch_model.bin", "pytorch_model.bin.tmp"], name
        # A regular file is replaced.
        os.unlink(f"{target}.tmp")
        os.chmod(target, 0o644)
        write(target)
        assert mode(target) == 0o600 and os.listdir(d) == ["pytorch_model.bin"], name
        sd = torch.load(target, weights_only=True)
        assert set(sd) == {"weight", "bias"}, name


def test_save_16bit_model_makes_private_directories(tmp_path, engine, umask_022):
    engine.save_16bit_model(tmp_path / "a" / "b")
    assert mode(tmp_path / "a") == 0o700 and mode(tmp_path / "a" / "b") == 0o700
    assert mode(tmp_path / "a" / "b" / "pytorch_model.bin") == 0o600


def test_the_checkpoint_files_are_private_and_latest_names_the_tag(tmp_path, engine, umask_022):
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint(ckpt)
    assert mode(ckpt) == 0o700 and mode(ckpt / "global_step1") == 0o700
    assert mode(ckpt / "global_step1" / "client_state.pt") == 0o600
    assert mode(ckpt / "latest") == 0o600 and (ckpt / "latest").read_text() == "global_step1"
    assert deepspeed.read_latest(ckpt) == "global_step1"
    assert deepspeed.read_latest(tmp_path / "none") is None
    assert sorted(os.listdir(ckpt)) == ["global_step1", "latest"]
    # A `latest` symlink is refused and left alone, never written through.
    (ckpt / "latest").unlink()
    victim = tmp_path / "victim"
    victim.write_text("keep")
    os.symlink(victim, ckpt / "latest")
    with pytest.raises(strata.StrataError, match="latest: a symbolic link is there"):
        engine.save_checkpoint(ckpt)
    assert victim.read_text() == "keep"


def test_spill_files_are_private(tmp_path, umask_022):
    with strata.init(spill=tmp_path) as ctx:
        layer = torch.nn.Linear(4, 4)
    clone = copy.deepcopy(layer)  # its files copied in the store
    files = [os.path.join(ctx.spill_dir, f) for f in os.listdir(ctx.spill_dir)]
    assert len(files) == 4 and mode(ctx.spill_dir) == 0o700
    assert all(mode(f) == 0o600 for f in files), [oct(mode(f)) for f in files]
    del clone
