"""deepspeed.pipe on Strata: importable, refused when used: pipeline
parallelism is not supported."""

from ._refuse import refuse


class PipelineModule:
    def __init__(self, *args, **kwargs):
        refuse("deepspeed.pipe.PipelineModule", "pipeline parallelism is not supported")


class LayerSpec:
    def __init__(self, *args, **kwargs):
        refuse("deepspeed.pipe.LayerSpec", "pipeline parallelism is not supported")
