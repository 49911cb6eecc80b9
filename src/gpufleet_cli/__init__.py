"""gpufleet's command line: run check/restart/patch/unlock through ansible-runner, show per-host progress."""
from importlib import metadata

try:
    # what pip recorded from galaxy.yml, the one version source (setup.py)
    __version__ = metadata.version("gpufleet")
except metadata.PackageNotFoundError:  # the package copied without pip's metadata
    __version__ = "unknown"
