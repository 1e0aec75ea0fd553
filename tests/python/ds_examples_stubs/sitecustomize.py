"""For DeepSpeedExamples' scripts on a machine without CUDA: the examples
call torch.cuda.set_device(local_rank) and torch.cuda.synchronize()
unconditionally, which a torch without CUDA refuses. Here they do nothing
when torch has no CUDA; nothing else changes."""

try:
    import torch
except ImportError:
    torch = None

if torch is not None and not torch.cuda.is_available():
    def _no_device(*args, **kwargs):
        """No CUDA here: nothing to select or wait for."""

    torch.cuda.set_device = _no_device
    torch.cuda.synchronize = _no_device
