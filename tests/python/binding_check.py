"""The _strata extension alone, on any Python 3: no torch, no numpy.

    python3 tests/python/binding_check.py PACKAGE_DIR [SCRATCH_DIR]

PACKAGE_DIR holds the built package (`strata/`, with the extension for this
interpreter: build/python, or scripts/build_python.sh's OUT_DIR/python).
The package's __init__ imports torch, so the extension is imported under a
bare `strata` package object, and tensors cross as DLPack capsules made and
read with ctypes. That is what lets the binding be checked on an interpreter
that has no torch (a Python 3.12 or 3.13 beside Debian's 3.11).

Two modules of odd-sized parameters train for three steps through the calls
the frontend makes (before_forward/after_forward, before_backward_grads/
after_backward, step) in fp32 and bf16, with the states on the CPU and on
NVMe; the parameters read back agree with AdamW computed here in float64
from the same gradients (fp32 within 2e-6 relative to the largest). A
checkpoint saved and loaded into a new engine reads back bitwise; errors
arrive as strata._errors classes naming what was wrong; write_safetensors
writes bytes given as a uint8 capsule.
"""
import ctypes
import importlib
import json
import math
import os
import random
import struct
import sys
import tempfile
import types


def load(pkg_dir):
    pkg = types.ModuleType("strata")
    pkg.__path__ = [os.path.join(pkg_dir, "strata")]
    sys.modules["strata"] = pkg
    return importlib.import_module("strata._strata"), importlib.import_module("strata._errors")


# ---- DLPack through ctypes ---------------------------------------------------

class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


KDL_CPU, KDL_UINT, KDL_FLOAT, KDL_BFLOAT = 1, 1, 2, 4
_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_keep = []  # what made capsules point at, alive until the end


def tensor_of(capsule):
    """The DLTensor of an unconsumed capsule, and its element count."""
    t = DLManagedTensor.from_address(_get_pointer(capsule, b"dltensor")).dl_tensor
    n = 1
    for i in range(t.ndim):
        n *= t.shape[i]
    assert t.device.device_type == KDL_CPU, "the host device's views are CPU memory"
    return t, n


def read_values(capsule):
    t, n = tensor_of(capsule)
    if t.dtype.code == KDL_FLOAT and t.dtype.bits == 32:
        return list((ctypes.c_float * n).from_address(t.data + t.byte_offset))
    assert t.dtype.code == KDL_BFLOAT and t.dtype.bits == 16, (t.dtype.code, t.dtype.bits)
    bits = (ctypes.c_uint16 * n).from_address(t.data + t.byte_offset)
    return [struct.unpack("<f", struct.pack("<I", b << 16))[0] for b in bits]


def bf16_bits(x):
    """x rounded to bf16, nearest even (x finite)."""
    u = struct.unpack("<I", struct.pack("<f", x))[0]
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def write_values(capsule, values):
    """Writes values into the capsule's memory in its dtype; returns what was
    written (bf16: the rounded values)."""
    t, n = tensor_of(capsule)
    assert n == len(values)
    if t.dtype.code == KDL_FLOAT and t.dtype.bits == 32:
        (ctypes.c_float * n).from_address(t.data + t.byte_offset)[:] = values
        return [struct.unpack("<f", struct.pack("<f", v))[0] for v in values]
    bits = [bf16_bits(v) for v in values]
    (ctypes.c_uint16 * n).from_address(t.data + t.byte_offset)[:] = bits
    return [struct.unpack("<f", struct.pack("<I", b << 16))[0] for b in bits]


def make_capsule(values, shape, code=KDL_FLOAT, bits=32, ctype=ctypes.c_float):
    """A capsule over a new CPU buffer (no deleter: the buffer lives in _keep)."""
    buf = (ctype * len(values))(*values)
    dims = (ctypes.c_int64 * len(shape))(*shape)
    mt = DLManagedTensor()
    mt.dl_tensor = DLTensor(ctypes.cast(buf, ctypes.c_void_p), DLDevice(KDL_CPU, 0), len(shape),
                            DLDataType(code, bits, 1), dims, None, 0)
    _keep.extend([buf, dims, mt])
    return _new_capsule(ctypes.addressof(mt), b"dltensor", None)


# ---- the training check ------------------------------------------------------

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.01
SHAPES = [[("m0.w", [3, 5]), ("m0.b", [5])], [("m1.w", [7])]]


def config(placement, dtype, nvme_dir):
    zero = {"stage": 3, "offload_optimizer": {"device": placement},
            "offload_param": {"device": placement}, "sub_group_size": 30000}
    if placement == "nvme":
        zero["offload_optimizer"]["nvme_path"] = nvme_dir
        zero["offload_param"]["nvme_path"] = nvme_dir
    return json.dumps({
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW",
                      "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD}},
        "bf16": {"enabled": dtype == "bf16"},
        "zero_optimization": zero,
        "strata": {"device": "host", "hbm_budget": "32M", "threads": 2},
    })


def train(S, placement, dtype, scratch, rng):
    nvme_dir = tempfile.mkdtemp(dir=scratch)
    eng = S.Engine(config(placement, dtype, nvme_dir), f"<{placement} {dtype}>", {}, True)
    ids, master, target = {}, {}, {}
    for module, params in enumerate(SHAPES):
        for name, shape in params:
            n = math.prod(shape)
            init = [rng.uniform(-1, 1) for _ in range(n)]
            if name.endswith(".b"):  # one through a fill callable, the rest from capsules
                ids[name] = eng.register_parameter_fn(
                    name, shape, dtype, module, lambda cap, v=init: write_values(cap, v))
            else:
                ids[name] = eng.register_parameter(name, shape, dtype, module,
                                                   make_capsule(init, shape))
            master[name] = [struct.unpack("<f", struct.pack("<f", v))[0] for v in init]
            target[name] = [rng.uniform(-1, 1) for _ in range(n)]
    eng.plan()
    m = {k: [0.0] * len(v) for k, v in master.items()}
    v2 = {k: [0.0] * len(v) for k, v in master.items()}
    for step in range(1, 4):
        seen = {}
        for module, params in enumerate(SHAPES):  # forward: the working copies
            for (name, _), cap in zip(params, eng.before_forward(module)):
                seen[name] = read_values(cap)
            eng.after_forward(module)
        grads = {}
        for module in reversed(range(len(SHAPES))):  # backward, last module first
            params = SHAPES[module]
            for (name, _), cap in zip(params, eng.before_backward_grads(module)):
                # d/dp of 0.5 (p - target)^2 at the copy the forward saw
                grads[name] = write_values(
                    cap, [p - t for p, t in zip(seen[name], target[name])])
            eng.after_backward(module)
        stats = json.loads(eng.step())
        assert stats, "step returned no statistics"
        b1, b2 = BETAS
        for name in master:  # AdamW in float64 from the same gradients
            for i, g in enumerate(grads[name]):
                m[name][i] = b1 * m[name][i] + (1 - b1) * g
                v2[name][i] = b2 * v2[name][i] + (1 - b2) * g * g
                mh, vh = m[name][i] / (1 - b1 ** step), v2[name][i] / (1 - b2 ** step)
                p = master[name][i] * (1 - LR * WD)
                master[name][i] = p - LR * mh / (math.sqrt(vh) + EPS)
    worst = 0.0
    for name, pid in ids.items():
        got = read_values(eng.read_parameter(pid))
        scale = max(abs(x) for x in master[name])
        worst = max(worst, max(abs(a - b) for a, b in zip(got, master[name])) / scale)
    return eng, ids, worst


def main():
    pkg_dir = sys.argv[1]
    scratch = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp()
    S, E = load(pkg_dir)
    rng = random.Random(20261129)
    problems = []
    for placement in ("cpu", "nvme"):
        for dtype in ("fp32", "bf16"):
            eng, ids, worst = train(S, placement, dtype, scratch, rng)
            # The engine's fp32 masters against float64: a few fp32 roundings
            # per step; bf16 only changes what the forward saw (the gradients).
            ok = worst <= 2e-6
            print(f"binding_check: {placement}/{placement} {dtype}: 3 AdamW steps, largest "
                  f"difference to float64 AdamW {worst:.2e} of the largest parameter"
                  f"{'' if ok else ' (more than 2e-06)'}")
            if not ok:
                problems.append(f"{placement} {dtype}: {worst:.2e}")
            if placement == "cpu" and dtype == "fp32":
                ckpt = os.path.join(scratch, "ckpt")
                eng.save_checkpoint(ckpt)
                before = {n: read_values(eng.read_parameter(p)) for n, p in ids.items()}
                eng.close()
                again, ids2, _ = train(S, placement, dtype, scratch, random.Random(1))
                again.load_checkpoint(ckpt)
                after = {n: read_values(again.read_parameter(ids2[n])) for n in ids}
                if after != before:
                    problems.append("a checkpoint loaded into a new engine reads back other values")
                again.close()
            else:
                eng.close()
    # Errors: strata._errors classes, with the message naming the problem.
    eng = S.Engine(config("cpu", "fp32", scratch), "<errors>", {}, True)
    checks = [
        (lambda: eng.register_parameter("x", [2], "int4", 0, make_capsule([1.0, 2.0], [2])),
         "dtype 'int4'"),
        (lambda: eng.register_parameter("y", [3], "fp32", 0, make_capsule([1.0, 2.0], [2])),
         "it has 2 elements, the parameter 3"),
        (lambda: eng.register_parameter(
            "z", [2], "fp32", 0, make_capsule([1, 2], [2], KDL_UINT, 8, ctypes.c_uint8)),
         "it is not float32"),
        (lambda: S.parse_config('{"optimizer": {"type": "Adam", "params": {"lr": -1}}}'),
         "lr"),
    ]
    for call, want in checks:
        try:
            call()
            problems.append(f"no error where one naming {want!r} was expected")
        except E.StrataError as e:
            if want not in str(e):
                problems.append(f"error {e!r} does not name {want!r}")
    eng.close()
    path = os.path.join(scratch, "t.safetensors")
    payload = [rng.randrange(256) for _ in range(12)]
    size = S.write_safetensors(path, [("format", "pt")], [
        ("t", "F32", [3], make_capsule(payload, [12], KDL_UINT, 8, ctypes.c_uint8))])
    with open(path, "rb") as f:
        data = f.read()
    if size != len(data) or data[-12:] != bytes(payload):
        problems.append(f"write_safetensors: {size} bytes reported, {len(data)} written, "
                        "the tensor's bytes not at the end")
    print(f"binding_check: Python {sys.version.split()[0]}, "
          f"{'all passed' if not problems else 'FAILED: ' + '; '.join(problems)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
