"""The PyTorch frontend on a GPU (strata.device "cuda") against plain PyTorch in HBM.

Every test here needs a CUDA torch and a GPU and skips without them, naming
why. The models and helpers are test_torch_frontend.py's; the reference
trains the same model on the GPU with torch.optim.AdamW. What only a GPU
exercises: the engine's views are CUDA tensors (DLPack capsules of device
memory), the hooks run under `torch.cuda.stream` over the engine's compute
stream (`torch.cuda.ExternalStream`), and the caller's stream is ordered
before the engine reads what it wrote (the frontend's `_caller_ordered`).

fp32 agrees within 1e-5 relative per micro-batch: forward and backward are
torch's own kernels on both sides, so only the optimizer's arithmetic can
differ (a rounding in the last bits of a step). bf16 parameters agree within
2e-3: Strata keeps fp32 masters and bf16 working copies, as the reference
does by hand; a master within its tolerance of a bf16 rounding midpoint may
round to the other bf16 neighbour (2^-8 of that weight), which moves a loss
by far less than that.
"""

import copy

import pytest
import torch

import strata
from test_torch_frontend import (GPT, PLACEMENTS, CheckpointedGPT, FlakyGPT, assert_close,
                                 batches, bf16_reference_losses, config, reference_losses,
                                 strata_losses)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA torch and a GPU (torch.cuda.is_available() is False)")

ALL_PLACEMENTS = [("none", "none"), ("cpu", "none"), ("cpu", "cpu"), ("nvme", "nvme")]


def cuda_config(opt, par, nvme_dir, **kw):
    cfg = config(opt, par, nvme_dir, **kw)
    cfg["strata"]["device"] = "cuda"
    cfg["strata"]["hbm_budget"] = "256M"
    cfg["strata"].pop("threads", None)
    return cfg


def on_cuda(data):
    return [(i.cuda(), t.cuda()) for i, t in data]


@pytest.mark.parametrize("opt,par", ALL_PLACEMENTS)
def test_fp32_gpt_matches_torch_in_hbm(opt, par, tmp_path):
    torch.manual_seed(1)
    model = GPT()
    ref = copy.deepcopy(model).cuda()
    cfg = cuda_config(opt, par, tmp_path)
    data = on_cuda(batches(20))
    want = reference_losses(ref, cfg, data, 20)
    engine = strata.initialize(model, cfg)
    assert engine.device.type == "cuda"
    got = strata_losses(engine, data, 20)
    assert_close(got, want)
    assert want[-1] < want[0] * 0.9  # it trained
    sd, ref_sd = engine.state_dict(), ref.state_dict()
    for k in sd:
        torch.testing.assert_close(sd[k].cpu(), ref_sd[k].cpu(), rtol=1e-4, atol=1e-5, msg=k)
    engine.close()


@pytest.mark.parametrize("opt,par", ALL_PLACEMENTS)
def test_bf16_gpt_matches_torch_with_fp32_masters(opt, par, tmp_path):
    torch.manual_seed(3)
    model = GPT()
    ref = copy.deepcopy(model).cuda()
    cfg = cuda_config(opt, par, tmp_path, dtype="bf16")
    data = on_cuda(batches(12, seed=9))
    want = bf16_reference_losses(ref, cfg, data, 12)
    engine = strata.initialize(model, cfg)
    got = strata_losses(engine, data, 12)
    assert_close(got, want, rel=2e-3)
    engine.close()


# The compact state formats in HBM (the device Adam's kernels) and in DRAM,
# against torch's fp32 AdamW: test_torch_frontend.py's bounds for the same
# formats (the losses within `rel`, the parameters' distance from torch's at
# most `dist` of the distance torch's moved).
@pytest.mark.parametrize("states,rel,dist", [("bf16", 2e-3, 0.01), ("bf16-master", 1e-2, 0.25),
                                             ("int8", 1e-2, 0.08)])
@pytest.mark.parametrize("opt", ["none", "cpu"])
def test_compact_optimizer_states_track_torch(states, rel, dist, opt, tmp_path):
    torch.manual_seed(1)
    model = GPT()
    init = {k: v.detach().clone().cuda() for k, v in model.state_dict().items()}
    ref = copy.deepcopy(model).cuda()
    cfg = cuda_config(opt, "none", tmp_path)
    cfg["strata"]["optimizer_states"] = states
    data = on_cuda(batches(20))
    want = reference_losses(ref, cfg, data, 20)
    engine = strata.initialize(model, cfg)
    got = strata_losses(engine, data, 20)
    assert_close(got, want, rel=rel)
    sd, ref_sd = engine.state_dict(), ref.state_dict()
    off = sum(((sd[k].cuda() - ref_sd[k]) ** 2).sum().item() for k in sd) ** 0.5
    moved = sum(((ref_sd[k] - init[k]) ** 2).sum().item() for k in sd) ** 0.5
    assert off <= dist * moved, f"{states}: {off / moved:.4f} of the distance moved"
    engine.close()


@pytest.mark.parametrize("opt,par", PLACEMENTS)
def test_tied_weights_and_non_reentrant_checkpointing(opt, par, tmp_path):
    """GPT's head is tied to the token embedding; its blocks run under
    non-reentrant activation checkpointing (recomputed in backward, the
    parameters fetched again on the GPU)."""
    torch.manual_seed(13)
    model = CheckpointedGPT()
    ref = copy.deepcopy(model).cuda()
    assert ref.head.weight is ref.wte.weight
    cfg = cuda_config(opt, par, tmp_path)
    data = on_cuda(batches(6, seed=21))
    want = reference_losses(ref, cfg, data, 6)
    engine = strata.initialize(model, cfg)
    got = strata_losses(engine, data, 6)
    assert_close(got, want)
    engine.close()


@pytest.mark.parametrize("opt,par", PLACEMENTS)
def test_exception_inside_forward_then_training_goes_on(opt, par, tmp_path):
    torch.manual_seed(16)
    model = FlakyGPT()
    ref = copy.deepcopy(model).cuda()
    cfg = cuda_config(opt, par, tmp_path)
    data = on_cuda(batches(4, seed=24))
    engine = strata.initialize(model, cfg)
    got = strata_losses(engine, data[:1], 1)
    model.blocks[0].fc.fail = True
    with pytest.raises(RuntimeError, match="flaky forward"):
        engine(*data[1])
    model.blocks[0].fc.fail = False
    want = reference_losses(ref, cfg, data, 4)
    got += strata_losses(engine, data[1:], 3)
    assert_close(got, want)
    engine.close()


@pytest.mark.parametrize("opt,par", PLACEMENTS)
def test_eval_under_no_grad(opt, par, tmp_path):
    torch.manual_seed(7)
    model = GPT()
    ref = copy.deepcopy(model).cuda()
    cfg = cuda_config(opt, par, tmp_path)
    data = on_cuda(batches(5))
    reference_losses(ref, cfg, data, 4)
    engine = strata.initialize(model, cfg)
    strata_losses(engine, data, 4)
    engine.eval()
    ref.eval()
    with torch.no_grad():
        got = engine(*data[4]).item()
        want = ref(*data[4]).item()
    assert got == pytest.approx(want, rel=1e-5)
    engine.close()


def test_the_callers_stream_is_ordered_before_the_engine(tmp_path):
    """Inputs produced on a side stream the caller made current: the engine's
    forward reads them after that stream's work (the frontend orders the
    compute stream after the caller's)."""
    torch.manual_seed(5)
    model = GPT()
    ref = copy.deepcopy(model).cuda()
    cfg = cuda_config("cpu", "cpu", tmp_path)
    data = batches(4, seed=31)
    want = reference_losses(ref, cfg, on_cuda(data), 4)
    engine = strata.initialize(model, cfg)
    side = torch.cuda.Stream()
    got = []
    for idx, tgt in data:
        with torch.cuda.stream(side):
            # A slow producer on the side stream: the copy lands late.
            torch.cuda._sleep(10_000_000)
            idx_d, tgt_d = idx.cuda(non_blocking=True), tgt.cuda(non_blocking=True)
            loss = engine(idx_d, tgt_d)
            engine.backward(loss)
            engine.step()
            got.append(loss.item())
    engine.synchronize()
    assert_close(got, want)
    engine.close()


# ---- examples/torch/train_llama.py on the GPU ---------------------------------

LLAMA = ["--device", "cuda", "--quiet", "--layers", "2", "--hidden", "64", "--heads", "4",
         "--vocab", "96", "--seq", "32", "--micro-batch", "3", "--grad-accum", "2", "--lr",
         "1e-2", "--warmup", "3", "--steps", "6", "--dtype", "fp32"]


@pytest.mark.parametrize("opt,par", ALL_PLACEMENTS)
def test_llama_example_matches_torch_in_hbm(opt, par, tmp_path):
    from test_train_llama_example import reference_losses as llama_reference, train_llama
    argv = LLAMA + ["--offload-optimizer", opt, "--offload-param", par, "--nvme-path",
                    str(tmp_path)]
    args = train_llama.parse_args(argv)
    got = train_llama.main(argv)["losses"]
    want = llama_reference(args, lambda m: train_llama.param_groups(m, args.weight_decay),
                           device="cuda")
    assert_close(got, want)
