"""labkit: pipeline, tensor and expert parallelism, implemented on torch.distributed
and proved equal to single-device training."""
__version__ = "0.1.0"

# under torchrun: SIGINT, SIGTERM and SIGHUP stop this rank with one line from here on, even while torch imports
# (labkit.launch.torchrun.guard_at_import); nothing is imported outside torchrun
if "TORCHELASTIC_RUN_ID" in __import__("os").environ:
    from .launch.torchrun import guard_at_import as _guard_at_import

    _guard_at_import()
