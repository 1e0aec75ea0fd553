"""Clearing gradients as a torch script does, with two engines whose
backwards cross: a GAN trained as DeepSpeedExamples' DCGAN trains (one
engine for the generator, one for the discriminator, the generator's loss
going through the discriminator's parameters).

In torch the generator's backward leaves gradients in the discriminator's
.grad, and the script's ``netD.zero_grad()`` at the next iteration clears
them. In Strata those gradients land in the discriminator engine's window:
``zero_grad()`` of the model (or the engine's optimizer, or the engine) must
discard them, and a clearing Strata cannot see (``p.grad = None``) must end
in an error at the step, never in a silently different step.
"""

import copy

import pytest
import torch

import strata
import strata.deepspeed as deepspeed

ITERS = 5
BATCH = 8
NOISE = 6
FEATURES = 10


def config():
    # The DCGAN example's own optimizer (Adam, lr 2e-4, betas 0.5/0.999) at
    # stage 0, fp32.
    return {"train_batch_size": BATCH,
            "optimizer": {"type": "Adam",
                          "params": {"lr": 2e-4, "betas": [0.5, 0.999], "eps": 1e-8}},
            "zero_optimization": {"stage": 0},
            "strata": {"device": "host", "hbm_budget": "64M", "threads": 1}}


class Generator(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.main = torch.nn.Sequential(torch.nn.Linear(NOISE, 16), torch.nn.ReLU(),
                                        torch.nn.Linear(16, FEATURES), torch.nn.Tanh())

    def forward(self, z):
        return self.main(z)


class Discriminator(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.main = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.LeakyReLU(0.2),
                                        torch.nn.Linear(16, 1), torch.nn.Sigmoid())

    def forward(self, x):
        return self.main(x).view(-1)


def data():
    g = torch.Generator().manual_seed(11)
    return [(torch.rand(BATCH, FEATURES, generator=g) * 2 - 1, torch.randn(BATCH, NOISE,
                                                                           generator=g))
            for _ in range(ITERS)]


def models():
    torch.manual_seed(3)
    return Generator(), Discriminator()


def gan_iteration(netG, netD, real, noise, clear_d, backward_d, step_d, clear_g, backward_g,
                  step_g):
    """One iteration of the DCGAN example's loop."""
    criterion = torch.nn.BCELoss()
    clear_d()
    label = torch.full((BATCH,), 1.0)
    err_real = criterion(netD(real), label)
    backward_d(err_real)
    fake = netG(noise)
    label.fill_(0.0)
    err_fake = criterion(netD(fake.detach()), label)
    backward_d(err_fake)
    step_d()
    clear_g()
    label.fill_(1.0)
    err_g = criterion(netD(fake), label)  # goes through the discriminator's parameters
    backward_g(err_g)
    step_g()
    return (err_real + err_fake).item(), err_g.item()


def torch_reference(netG, netD):
    optD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999), eps=1e-8)
    optG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999), eps=1e-8)
    return [x for real, noise in data()
            for x in gan_iteration(netG, netD, real, noise, netD.zero_grad,
                                   lambda l: l.backward(), optD.step, netG.zero_grad,
                                   lambda l: l.backward(), optG.step)]


def max_difference(a, b):
    return max((x.detach() - y.detach()).abs().max().item()
               for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("clear", ["module", "optimizer", "engine"])
def test_a_gan_trains_as_torch_however_the_script_clears_the_gradients(clear):
    netG, netD = models()
    refG, refD = copy.deepcopy(netG), copy.deepcopy(netD)
    ref_losses = torch_reference(refG, refD)

    engineD, optD, _, _ = deepspeed.initialize(model=netD, model_parameters=netD.parameters(),
                                               config=config())
    engineG, optG, _, _ = deepspeed.initialize(model=netG, model_parameters=netG.parameters(),
                                               config=config())
    clears = {"module": (netD.zero_grad, netG.zero_grad),
              "optimizer": (optD.zero_grad, optG.zero_grad),
              "engine": (engineD.zero_grad, engineG.zero_grad)}[clear]
    losses = [x for real, noise in data()
              for x in gan_iteration(netG, netD, real, noise, clears[0], engineD.backward,
                                     engineD.step, clears[1], engineG.backward, engineG.step)]
    engineD.close()
    engineG.close()
    assert losses == pytest.approx(ref_losses, abs=1e-6)
    assert max_difference(netD, refD) < 1e-6
    assert max_difference(netG, refG) < 1e-6
    # The routing ends with the engine: the model's zero_grad is torch's again.
    assert "zero_grad" not in netD.__dict__ and "zero_grad" not in netD.main[0].__dict__


def test_gradients_from_another_engines_backward_cleared_unseen_are_refused():
    netG, netD = models()
    engineD = strata.initialize(netD, config())
    engineG = strata.initialize(netG, config())
    real, noise = data()[0]
    criterion = torch.nn.BCELoss()
    # The generator's step: its loss's backward goes through the discriminator.
    engineG.backward(criterion(netD(netG(noise)), torch.ones(BATCH)))
    engineG.step()
    # Cleared as plain torch allows, in a way the engine cannot see.
    for p in netD.parameters():
        p.grad = None
    engineD.backward(criterion(netD(real), torch.ones(BATCH)))
    with pytest.raises(strata.FailedPreconditionError,
                       match="another engine's backward\\(\\) sent through Discriminator's "
                             "parameters \\(the engine of Generator\\).*Discriminator.zero_grad"):
        engineD.step()
    # Refused, not consumed: cleared, the same step then runs.
    netD.zero_grad()
    engineD.backward(criterion(netD(real), torch.ones(BATCH)))
    assert engineD.step()["applied"]
    engineD.close()
    engineG.close()


def test_zero_grad_of_a_part_of_the_model():
    _, netD = models()
    engine = strata.initialize(netD, config())
    real, _ = data()[0]
    netD.main[0].zero_grad()  # an empty window: nothing to keep apart
    engine.backward(torch.nn.BCELoss()(netD(real), torch.ones(BATCH)))
    with pytest.raises(strata.FailedPreconditionError,
                       match="main.0.zero_grad\\(\\): main.0 holds some of the parameters"):
        netD.main[0].zero_grad()
    # Nothing was cleared: the window steps; the next one starts empty.
    assert engine.step()["applied"]
    netD.main[0].zero_grad()
    netD.main.zero_grad()  # holds them all: the whole window
    engine.close()
