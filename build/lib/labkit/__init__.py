"""labkit: pipeline, tensor and expert parallelism, implemented on torch.distributed
and proved equal to single-device training."""
__version__ = "0.1.0"
