"""deepspeed.ops.adam on Strata: DeepSpeedCPUAdam and FusedAdam with
DeepSpeed's constructors. Given to initialize(optimizer=...), the engine
runs them on Strata's optimizer (strata.deepspeed._client_optimizer)."""

from ..._client_optimizer import DeepSpeedCPUAdam, FusedAdam  # noqa: F401
