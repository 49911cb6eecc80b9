#!/usr/bin/python
# -*- coding: utf-8 -*-
# gpufleet: bring the new launch's model files into the page cache before the stop, within free memory (issue 35).
from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_weights_prefetch
short_description: Read the files an SGLang launch will load into the page cache, without pushing anything out
description:
  - "Run on the host while the old server still serves: reads the model files the new launch will read
    (C(model-path), C(speculative-draft-model-path)) into the page cache. The new server's start then reads
    them from memory, not from storage."
  - "Which files: for a directory, what SGLang's loader reads from it (0.5.23, load format C(auto)): the shards
    C(model.safetensors.index.json) names, else every C(*.safetensors), else C(*.bin), else C(*.pt), and the small
    files at its top level (C(*.json) (config, generation config, tokenizer config, the index), C(tokenizer*),
    C(*.model), C(*.tiktoken), C(vocab*), C(merges*), C(*.jinja), C(*.py) for trust-remote-code). Small files
    first, then the weights, each set sorted. Subdirectories are not read: repositories keep other copies of the
    weights there (C(original/), C(onnx/)) that the launch never loads. A file given directly is read as is. A file
    reached twice (a Hugging Face cache snapshot links into C(blobs/)) counts once."
  - "Memory bound: before each chunk (16 MiB, less at a low O(rate_mib_s)) the module reads C(MemFree) in C(/proc/meminfo) and stops when
    C(MemFree) less the zones' C(high) watermarks (C(/proc/zoneinfo)) less O(reserve_mib) is below the chunk's
    bytes not yet cached (C(stopped_by=memory)). So free memory never falls to where C(kswapd) wakes (below
    C(low)) and nothing is evicted to make room: the serving process keeps its pages. C(MemAvailable) is not used
    because it counts page cache the kernel would evict."
  - "Residency is measured with the system call C(mincore) through C(mmap) (C(residency_method=mincore)), per file,
    before and after; chunks already in the page cache are not read again."
  - "Reads are plain C(pread) calls into one buffer (C(read_method=read), no C(O_DIRECT)), paced to O(rate_mib_s).
    Readahead is off on the module's own file descriptor (C(POSIX_FADV_RANDOM)), so a read brings in exactly the
    chunk's missing pages: the memory bound and the rate hold to the page. The server's later reads of the same files
    keep the normal readahead."
  - "Per-file problems (missing, unreadable, on a network filesystem) skip that file with the reason; the module
    fails only for bad options or when the host itself cannot be read (no C(/proc/meminfo), no C(mincore))."
  - "Called in slices like M(gpufleet.fleet.nvidia_gpu_wait): each call returns after O(slice_s) with
    C(done=false) and a C(progress) line, and the next call passes O(started_at) (and O(resident_at_start_bytes),
    O(read_before_bytes)) from the previous result."
version_added: "0.3.0"
author: gpufleet maintainers (!UNKNOWN)
options:
  paths:
    description:
      - "Model directories or files, absolute paths (C(sglang_launch_args) C(model-path) and
        C(speculative-draft-model-path))."
      - "A value that is not an absolute path (a Hugging Face hub id such as C(meta-llama/Llama-3.1-8B)) and a
        missing path are reported in C(skipped_paths), not failed."
    type: list
    elements: str
    required: true
  reserve_mib:
    description:
      - "Memory kept free on top of the kernel's C(high) watermarks, MiB: room for the serving process and others to
        allocate while the prefetch runs."
    type: int
    default: 4096
  rate_mib_s:
    description:
      - "Bound on the read rate, MiB/s, so the old server's own I/O keeps its share. C(0) reads as fast as the
        storage gives."
    type: int
    default: 2048
  network_fs:
    description:
      - "Also read files on network filesystems (NFS, SMB/CIFS, CephFS, GlusterFS, Lustre, GPFS, BeeGFS, WekaFS, 9p,
        AFS, WebDAV) and FUSE mounts (object storage such as s3fs, gcsfuse, JuiceFS). Off, they are skipped with
        the reason: their reads load storage that other hosts share, and a FUSE mount in C(direct_io) mode keeps
        nothing in the page cache. C(fuseblk) (FUSE over a local disk) counts as local."
    type: bool
    default: false
  timeout_s:
    description:
      - "Bound on the whole prefetch, all slices, seconds from O(started_at). What is not read by then is left cold
        and said (C(stopped_by=timeout))."
    type: float
    default: 900
  slice_s:
    description:
      - "Return after at most this many seconds with C(done=false) and a C(progress) line when files are left to
        read. Must be more than 0."
      - "At least O(timeout_s) / 100: a whole prefetch takes at most about 100 calls (the role chains them by a
        recursive include, which ansible-core cannot take a few hundred levels deep)."
    type: float
    default: 10
  started_at:
    description:
      - "When the whole prefetch began, seconds since the epoch on the host: the C(started_at) a previous slice
        returned. Unset means now."
    type: float
  resident_at_start_bytes:
    description:
      - "The C(resident_at_start_bytes) of the first slice, so that C(msg) and C(progress) count from the
        start of the whole prefetch. Unset means this call's C(resident_before_bytes)."
    type: int
  read_before_bytes:
    description:
      - "Bytes earlier slices read (the previous slice's C(total_read_bytes)), so that C(total_read_bytes) counts
        the whole prefetch."
    type: int
    default: 0
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: Measures residency and the memory bound and says what it would read; reads nothing.
  diff_mode:
    support: none
    details: Writes no file.
  platform:
    support: full
    platforms: linux
notes:
  - "C(POSIX_FADV_WILLNEED) (C(posix_fadvise)) is not used: it only queues readahead and returns at once, so
    neither the memory bound nor the rate can be kept while the kernel reads."
  - "Since Linux 5.0, mincore tells the page cache only of files the user owns or may write, or to root; for other
    files it says every page is resident. Their residency is reported unknown (null) instead, and each is read in full
    and counted cold against the memory bound. Run with C(become)."
  - "The bound adds the watermarks of every zone of every NUMA node: with C(vm.zone_reclaim_mode=0) (the default)
    an allocation moves to another node before the kernel reclaims. With zone reclaim on, a node can reclaim while
    others still have room; raise O(reserve_mib) there."
  - "A memory cgroup limit of the module's own process is not part of the bound."
seealso:
  - module: gpufleet.fleet.nvidia_gpu_wait
"""

EXAMPLES = r"""
- name: Prefetch the new model while the old server serves (one 10 s slice)
  gpufleet.fleet.sglang_weights_prefetch:
    paths:
      - /models/Llama-3.1-8B-Instruct
      - /models/EAGLE3-LLaMA3.1-Instruct-8B
    reserve_mib: 8192
  register: prefetch

- name: Next slice, counting from the first
  gpufleet.fleet.sglang_weights_prefetch:
    paths: [/models/Llama-3.1-8B-Instruct]
    started_at: "{{ prefetch.started_at }}"
    resident_at_start_bytes: "{{ prefetch.resident_at_start_bytes }}"
    read_before_bytes: "{{ prefetch.total_read_bytes }}"
  register: prefetch
  when: not prefetch.done

- name: What would be read (reads nothing)
  gpufleet.fleet.sglang_weights_prefetch:
    paths: [/models/Kimi-K2-Instruct]
  check_mode: true
"""

RETURN = r"""
msg:
  description: >-
    One sentence of what is true at the end, e.g. C(12.0 GiB in 4 files: 100 % resident (was 31 %), 8.3 GiB read
    in 9.8 s), or with C(; stopped at the memory bound: 5.2 GiB left cold (MemFree 9.1 GiB - watermarks 0.3 GiB -
    reserve 4.0 GiB)), and the files skipped.
  returned: always
  type: str
progress:
  description: >-
    One line on where the whole prefetch stands (read so far of what was cold at the start, this call's rate,
    resident share, seconds since O(started_at)), e.g. C(read 3.1 of 12.0 GiB cold, 412 MiB/s, 27 % resident, 7 s).
  returned: always
  type: str
done:
  description: >-
    False only when this slice ended with files left to read and time left; true when everything is resident or
    skipped, or the prefetch stopped (C(stopped_by)).
  returned: always
  type: bool
stopped_by:
  description: >-
    Why reading stopped before everything was resident: C(memory) (the headroom was below the next chunk),
    C(timeout) (O(timeout_s) since O(started_at)), or null.
  returned: always
  type: str
started_at:
  description: Start of the whole prefetch, seconds since the epoch on the host; pass it to the next slice.
  returned: always
  type: float
  sample: 1796000000.25
elapsed_s:
  description: Duration of this call, s.
  returned: always
  type: float
total_elapsed_s:
  description: Time since O(started_at), s.
  returned: always
  type: float
total_bytes:
  description: Size of every file in C(files) (skipped ones included), bytes.
  returned: always
  type: int
resident_before_bytes:
  description: Bytes of C(files) in the page cache at the start of this call (unknown ones count 0), bytes.
  returned: always
  type: int
resident_after_bytes:
  description: Bytes of C(files) in the page cache at the end of this call, bytes.
  returned: always
  type: int
resident_at_start_bytes:
  description: >-
    Bytes in the page cache when the whole prefetch began (O(resident_at_start_bytes), else
    C(resident_before_bytes)); pass it to the next slice.
  returned: always
  type: int
read_bytes:
  description: Bytes this call read, bytes.
  returned: always
  type: int
total_read_bytes:
  description: Bytes read by the whole prefetch (O(read_before_bytes) plus C(read_bytes)); pass it to the next slice.
  returned: always
  type: int
cold_bytes:
  description: Bytes of C(files) not in the page cache at the end (C(total_bytes) - C(resident_after_bytes)), bytes.
  returned: always
  type: int
resident_pct:
  description: Share of C(total_bytes) in the page cache at the end, percent (0-100, one decimal, rounded down).
  returned: always
  type: float
  sample: 27.4
bound:
  description: The memory bound at the end of the call.
  returned: always
  type: dict
  contains:
    mem_free_bytes:
      description: C(MemFree) of C(/proc/meminfo), bytes.
      type: int
    watermark_bytes:
      description: Sum of every zone's C(high) watermark in C(/proc/zoneinfo) (pages times the page size), bytes.
      type: int
    reserve_bytes:
      description: O(reserve_mib), bytes.
      type: int
    headroom_bytes:
      description: C(mem_free_bytes) - C(watermark_bytes) - C(reserve_bytes); negative when short, bytes.
      type: int
rate_mib_s:
  description: The rate bound applied, MiB/s (0 for none).
  returned: always
  type: int
residency_method:
  description: How residency was measured, C(mincore).
  returned: always
  type: str
read_method:
  description: How files were read, C(read).
  returned: always
  type: str
skipped_paths:
  description: Given paths skipped as a whole (not a local path, missing, not a file or directory).
  returned: always
  type: list
  elements: dict
  contains:
    path:
      description: The path as given.
      type: str
    reason:
      description: Why it was skipped.
      type: str
files:
  description: Every file the launch would read from O(paths), in reading order.
  returned: always
  type: list
  elements: dict
  contains:
    path:
      description: The path in the model directory (as the loader opens it; symlinks not resolved).
      type: str
    size_bytes:
      description: File size, bytes.
      type: int
    resident_before_bytes:
      description: In the page cache at the start of this call, bytes; null when unknown.
      type: int
    resident_after_bytes:
      description: In the page cache at the end of this call, bytes; null when unknown.
      type: int
    read_bytes:
      description: Read by this call, bytes.
      type: int
    fstype:
      description: Filesystem type of its mount (C(/proc/self/mountinfo)); null when not found.
      type: str
    skipped:
      description: >-
        Null, or why it was not read (missing, cannot open, on a network filesystem, read failed at a given byte).
      type: str
"""

import gc

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_prefetch import (
    PREFETCH_OPTIONS,
    bad_option,
    prefetch,
)


def main():
    module = AnsibleModule(argument_spec=dict(PREFETCH_OPTIONS), supports_check_mode=True)
    problem = bad_option(module.params)
    if problem:
        module.fail_json(msg=problem)
    try:
        result = prefetch(module.params, check_mode=module.check_mode)
    except (OSError, ValueError) as exc:
        # Not one file's problem (those are skipped): the host's /proc or libc could not be read.
        module.fail_json(msg="cannot prefetch on this host: %s. The memory bound needs /proc/meminfo and "
                             "/proc/zoneinfo, residency needs libc's mincore; run on Linux with /proc mounted." % exc)
    except Exception as exc:  # pylint: disable=broad-except
        # The role registers with failed_when: false, and ansible-core 2.19 then drops a crashed module's message
        # and traceback: the summary's note could only say "no message". A failure that names itself instead.
        module.fail_json(msg="the prefetch failed unexpectedly: %s: %s" % (type(exc).__name__, exc))
    module.exit_json(**result)


if __name__ == "__main__":
    # Imports and constants to the permanent GC generation: the exit skips walking them (about 20 ms less per
    # call; docs/benchmarks.md, module exit)
    gc.freeze()
    main()
