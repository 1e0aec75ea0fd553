"""deepspeed.runtime.lr_schedules on Strata: WarmupLR, WarmupDecayLR,
WarmupCosineLR, OneCycle and LRRangeTest as objects a script builds on its
own optimizer and passes to ``initialize(lr_scheduler=...)`` or steps
itself.

Each has DeepSpeed's constructor, ``step()``, ``get_lr()``,
``get_last_lr()``, ``state_dict()`` and ``load_state_dict()``, and writes
its learning rate (OneCycle: also ``betas``) into the optimizer's
param_groups, as DeepSpeed's do. The values come from the same formulas as
the config's "scheduler" section (strata::ScheduleAt, src/config/
lr_schedule.cc), one schedule per param group, so a script's schedule and
a config's give the same learning rates; a bad value is refused with the
config key that holds it (scheduler.params.NAME).
"""

import json
import logging

from ... import _strata

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"

_log = logging.getLogger("strata.deepspeed")


def get_torch_optimizer(optimizer):
    """The torch optimizer a schedule drives: `optimizer` itself, or the
    one it wraps as ``.optimizer`` (TypeError otherwise, as DeepSpeed)."""
    import torch
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    raise TypeError(f"{type(optimizer).__name__} is not a subclass of torch.optim.Optimizer")


def _per_group(optimizer, value, name):
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"expected {len(optimizer.param_groups)} values for {name} (one per "
                             f"param group), got {len(value)}")
        return list(value)
    return [value] * len(optimizer.param_groups)


class _Schedule:
    """A schedule of `kind` with one parameter dict per param group."""

    def __init__(self, optimizer, kind, group_params, last_batch_iteration):
        self.optimizer = get_torch_optimizer(optimizer)
        self._kind = kind
        self._configs = []
        for g, params in zip(self.optimizer.param_groups, group_params):
            config = {"optimizer": {"type": "AdamW", "params": {"lr": float(g["lr"])}},
                      "scheduler": {"type": kind, "params": params}}
            text = json.dumps(config)
            _strata.schedule_at(text, 0, f"{kind} schedule")  # refuses a bad value now
            self._configs.append(text)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = None

    def _values(self):
        # ScheduleAt takes applied steps: DeepSpeed's iteration i is i + 1 of them.
        return [_strata.schedule_at(c, self.last_batch_iteration + 1) for c in self._configs]

    def get_lr(self):
        return [v["lr"] for v in self._values()]

    def get_last_lr(self):
        assert self._last_lr is not None, "need to call step() first"
        return self._last_lr

    def _apply(self):
        for g, lr in zip(self.optimizer.param_groups, self.get_lr()):
            g["lr"] = lr
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def step(self, last_batch_iteration=None):
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply()

    def state_dict(self):
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd):
        self.last_batch_iteration = sd["last_batch_iteration"]


def _warmup_type(warmup_type):
    if warmup_type not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        _log.warning("Using unknown warmup_type: %s. The increasing function is set to default (log)",
                     warmup_type)
        return WARMUP_LOG_RATE
    return warmup_type


class WarmupLR(_Schedule):
    """From warmup_min_lr to warmup_max_lr over warmup_num_steps (log or
    linear), then constant. The lrs may be one per param group."""

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                 warmup_type=WARMUP_LOG_RATE, last_batch_iteration=-1, **extra):
        opt = get_torch_optimizer(optimizer)
        kind = extra.pop("_kind", WARMUP_LR)
        mins = _per_group(opt, warmup_min_lr, "warmup_min_lr")
        maxs = _per_group(opt, warmup_max_lr, "warmup_max_lr")
        params = [dict({"warmup_min_lr": lo, "warmup_max_lr": hi, "warmup_num_steps": warmup_num_steps,
                        "warmup_type": _warmup_type(warmup_type)}, **extra) for lo, hi in zip(mins, maxs)]
        super().__init__(opt, kind, params, last_batch_iteration)
        self.min_lrs, self.max_lrs = mins, maxs
        self.warmup_num_steps = max(2, warmup_num_steps)
        if last_batch_iteration == -1:
            self._apply()

    def get_lr(self):
        if self.last_batch_iteration < 0:
            _log.warning("Attempting to get learning rate from scheduler before it has started")
        return super().get_lr()


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps=1000, warmup_type=WARMUP_LOG_RATE, last_batch_iteration=-1):
        if total_num_steps < warmup_num_steps:
            _log.warning("total_num_steps %s is less than warmup_num_steps %s", total_num_steps,
                         warmup_num_steps)
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration, _kind=WARMUP_DECAY_LR, total_num_steps=total_num_steps)


class WarmupCosineLR(_Schedule):
    """Each group's own lr times a ratio: from warmup_min_ratio to 1 over
    warmup_num_steps, then a cosine to cos_min_ratio at total_num_steps."""

    def __init__(self, optimizer, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000,
                 cos_min_ratio=0.0001, warmup_type=WARMUP_LOG_RATE, last_batch_iteration=-1):
        opt = get_torch_optimizer(optimizer)
        if total_num_steps < warmup_num_steps:
            _log.warning("total_num_steps %s is less than warmup_num_steps %s", total_num_steps,
                         warmup_num_steps)
        params = {"total_num_steps": total_num_steps, "warmup_min_ratio": warmup_min_ratio,
                  "warmup_num_steps": warmup_num_steps, "cos_min_ratio": cos_min_ratio,
                  "warmup_type": _warmup_type(warmup_type)}
        super().__init__(opt, WARMUP_COSINE_LR, [params] * len(opt.param_groups), last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.org_lrs = [g["lr"] for g in opt.param_groups]
        if last_batch_iteration == -1:
            self._apply()

    def get_lr_ratio(self):
        return self._values()[0]["lr_ratio"]

    def get_lr(self):
        if self.last_batch_iteration < 0:
            # DeepSpeed's value before the start: a single 0.0 (so only the
            # first param group's lr is set to it).
            _log.warning("Attempting to get learning rate from scheduler before it has started")
            return [0.0]
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class LRRangeTest(_Schedule):
    """lr_range_test_min_lr growing by lr_range_test_step_rate every
    lr_range_test_step_size steps (continuously or as a staircase)."""

    def __init__(self, optimizer, lr_range_test_min_lr=1e-3, lr_range_test_step_size=2000,
                 lr_range_test_step_rate=1.0, lr_range_test_staircase=False, last_batch_iteration=-1):
        opt = get_torch_optimizer(optimizer)
        mins = _per_group(opt, lr_range_test_min_lr, "lr_range_test_min_lr")
        params = [{"lr_range_test_min_lr": lo, "lr_range_test_step_size": lr_range_test_step_size,
                   "lr_range_test_step_rate": lr_range_test_step_rate,
                   "lr_range_test_staircase": bool(lr_range_test_staircase)} for lo in mins]
        super().__init__(opt, LR_RANGE_TEST, params, last_batch_iteration)
        self.min_lr = mins
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        if last_batch_iteration == -1:
            self._apply()


class OneCycle(_Schedule):
    """The 1Cycle policy: lr from cycle_min_lr up to cycle_max_lr and back
    over the cycle, then decaying; with cycle_momentum, betas[0] the other
    way between cycle_max_mom and cycle_min_mom (betas[1] set to 0.99, as
    DeepSpeed's does)."""

    def __init__(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate=0.0,
                 cycle_first_step_size=2000, cycle_second_step_size=None, cycle_first_stair_count=0,
                 cycle_second_stair_count=None, decay_step_size=0, cycle_momentum=True,
                 cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate=0.0, last_batch_iteration=-1):
        opt = get_torch_optimizer(optimizer)
        if cycle_momentum and "betas" not in opt.defaults:
            _log.warning("cycle_momentum is disabled because optimizer %s does not support momentum, "
                         "no betas attribute in defaults", type(opt).__name__)
            cycle_momentum = False
        self.cycle_momentum = cycle_momentum
        params = {"cycle_min_lr": cycle_min_lr, "cycle_max_lr": cycle_max_lr,
                  "decay_lr_rate": decay_lr_rate, "cycle_first_step_size": cycle_first_step_size,
                  "cycle_first_stair_count": cycle_first_stair_count, "decay_step_size": decay_step_size,
                  "cycle_momentum": bool(cycle_momentum), "cycle_min_mom": cycle_min_mom,
                  "cycle_max_mom": cycle_max_mom, "decay_mom_rate": decay_mom_rate}
        if cycle_second_step_size is not None:
            params["cycle_second_step_size"] = cycle_second_step_size
        if cycle_second_stair_count is not None:
            params["cycle_second_stair_count"] = cycle_second_stair_count
        super().__init__(opt, ONE_CYCLE, [params] * len(opt.param_groups), last_batch_iteration)
        second = cycle_first_step_size if cycle_second_step_size is None else cycle_second_step_size
        self.total_size = float(cycle_first_step_size) + float(second)
        self.min_lrs = [cycle_min_lr] * len(opt.param_groups)
        self.max_lrs = [cycle_max_lr] * len(opt.param_groups)
        if last_batch_iteration == -1:
            for g in opt.param_groups:
                g["lr"] = cycle_min_lr
                if cycle_momentum:
                    g["betas"] = (cycle_min_mom, 0.99)

    def get_lr(self):
        return [v["lr"] for v in self._values()]

    def get_mom(self):
        if not self.cycle_momentum:
            return None
        return [(v["beta1"], v["beta2"]) for v in self._values()]

    def step(self, batch_iteration=None):
        super().step(batch_iteration)
        if self.cycle_momentum:
            for g, betas in zip(self.optimizer.param_groups, self.get_mom()):
                g["betas"] = betas
