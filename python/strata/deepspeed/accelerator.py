"""deepspeed.accelerator on Strata: get_accelerator() with the methods
scripts use, for the device Strata trains on (CUDA when torch sees it, else
the CPU, as Strata's host device)."""

import torch


class _Accelerator:
    def __init__(self):
        self._cuda = torch.cuda.is_available()

    def device_name(self, device_index=None):
        name = "cuda" if self._cuda else "cpu"
        return name if device_index is None else f"{name}:{device_index}"

    def current_device(self):
        return torch.cuda.current_device() if self._cuda else 0

    def current_device_name(self):
        return self.device_name(self.current_device()) if self._cuda else "cpu"

    def device(self, device_index=None):
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index):
        if self._cuda:
            torch.cuda.set_device(device_index)

    def device_count(self):
        return torch.cuda.device_count() if self._cuda else 1

    def is_available(self):
        return True

    def synchronize(self, device_index=None):
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self):
        return "nccl" if self._cuda else "gloo"

    def is_bf16_supported(self):
        return True

    def is_fp16_supported(self):
        # As DeepSpeed's CPU accelerator: scripts then pick bf16 on the CPU.
        return self._cuda

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def empty_cache(self):
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index=None):
        return torch.cuda.memory_allocated(device_index) if self._cuda else 0

    def max_memory_allocated(self, device_index=None):
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else 0

    def pin_memory(self, tensor, align_bytes=1):
        return tensor.pin_memory() if self._cuda else tensor


_ACCELERATOR = None


def get_accelerator():
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = _Accelerator()
    return _ACCELERATOR
