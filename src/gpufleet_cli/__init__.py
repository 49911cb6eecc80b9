"""gpufleet's command line: run check/restart/patch/unlock through ansible-runner, show per-host progress."""
__version__ = "0.1.0"
