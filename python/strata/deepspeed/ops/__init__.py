"""deepspeed.ops on Strata: the optimizer classes scripts build and pass to
initialize (ops.adam). DeepSpeed's other kernels (transformer, sparse
attention, quantizer) are not provided."""

from . import adam  # noqa: F401
