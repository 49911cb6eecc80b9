# -*- coding: utf-8 -*-
# gpufleet: the options of the NVIDIA GPU modules that select GPUs and the way to read them
# (gpufleet.fleet.nvidia_gpu_info, gpufleet.fleet.nvidia_gpu_wait): one text for both.
from __future__ import annotations


class ModuleDocFragment(object):

    DOCUMENTATION = r"""
options:
  gpus:
    description:
      - GPUs to read, each a zero-based index (C(0), C("3")) or a UUID (C(GPU-8b76e503-...)).
      - Empty (the default) means every GPU. An index or UUID that does not exist fails the task
        (C(error_class=bad_selector)) and lists the GPUs present.
    type: list
    elements: raw
    default: []
  backend:
    description:
      - V(auto) uses NVML when C(nvidia-ml-py) imports and C(nvmlInit) succeeds, else C(nvidia-smi).
      - V(nvml) requires C(nvidia-ml-py) and a working C(libnvidia-ml.so.1).
      - V(nvidia-smi) runs C(nvidia-smi --query-gpu=... --format=csv,noheader,nounits) with C(LC_ALL=C).
    type: str
    choices: [auto, nvml, nvidia-smi]
    default: auto
  expected_count:
    description:
      - Number of GPUs this host must have. Fewer fails the task at once (C(error_class=fewer_gpus)),
        naming the GPUs present. Zero GPUs always fails (C(error_class=no_devices)), with or without this
        option.
      - Playbooks pass the inventory variable C(gpufleet_expected_gpus) (unset by default).
    type: int
requirements:
  - nvidia-ml-py (for the NVML backend; V(auto) falls back to nvidia-smi without it)
  - An NVIDIA driver; C(nvidia-smi) on PATH for the nvidia-smi backend
"""
