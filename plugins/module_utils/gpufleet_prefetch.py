# -*- coding: utf-8 -*-
# gpufleet: bring the files the new launch will read into the page cache while the old server still serves, without
# making the kernel reclaim anything (issue 35). Plain functions: the module sglang_weights_prefetch calls prefetch().
"""Prefetch a launch's model files into the page cache, bounded by free memory, an I/O rate and time.

- :func:`select_files` -- the files SGLang's loader reads from ``model-path`` style paths (:func:`weight_names`
  picks the weights of one directory listing), duplicates counted once.
- :func:`parse_meminfo`, :func:`parse_zoneinfo`, :func:`memory_bound` -- the memory bound from the texts of
  ``/proc/meminfo`` and ``/proc/zoneinfo``.
- :func:`parse_mountinfo`, :func:`mount_for`, :func:`is_network_fstype` -- which files sit on network storage.
- :class:`FileMap` -- page-cache residency of a file through ``mmap`` + ``mincore(2)`` (ctypes on libc).
- :class:`Pacer` -- the I/O rate bound.
- :func:`prefetch` -- one call (one slice) of the module, returning its result.
"""
from __future__ import absolute_import, division, print_function

import ctypes
import ctypes.util
import errno
import fnmatch
import json
import mmap
import os
import stat
import time

MIB = 1 << 20
GIB = 1 << 30
PAGE_SIZE = mmap.PAGESIZE
CHUNK_BYTES = 16 * MIB
# mincore is asked about at most this many bytes at once: its vector (one byte per page) stays at 256 KiB even for
# the multi-hundred-GB checkpoints this is for.
_WINDOW_BYTES = GIB

PREFETCH_OPTIONS = dict(
    paths=dict(type="list", elements="str", required=True),
    reserve_mib=dict(type="int", default=4096),
    rate_mib_s=dict(type="int", default=2048),
    network_fs=dict(type="bool", default=False),
    timeout_s=dict(type="float", default=900),
    slice_s=dict(type="float", default=10),
    started_at=dict(type="float"),
    resident_at_start_bytes=dict(type="int"),
    read_before_bytes=dict(type="int", default=0),
)

# --- Which files -------------------------------------------------------------------------------------------------

# SGLang's loader (0.5.23 model_loader/loader.py _prepare_weights, load_format auto) globs *.safetensors, else *.bin,
# in the model directory itself, keeps only the shards model.safetensors.index.json names (Mistral repositories ship
# a consolidated.safetensors beside the shards), and drops training leftovers (weight_utils.py
# filter_files_not_needed_for_inference). *.pt is its fallback for some quantised models.
INDEX_NAME = "model.safetensors.index.json"
NOT_FOR_INFERENCE = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt")
# What else a start reads at the top level: config, generation config, tokenizer files, chat templates, indexes,
# trust-remote-code Python.
SMALL_PATTERNS = ("*.json", "*.py", "*.model", "*.tiktoken", "*.jinja", "tokenizer*", "vocab*", "merges*")


def _matching(names, pattern):
    """The names matching ``pattern``, sorted; as the loader's ``glob.glob``, a leading dot is matched only by a dot
    (hidden files such as macOS ``._model.safetensors`` are not the checkpoint)."""
    return sorted(n for n in names if fnmatch.fnmatchcase(n, pattern) and not n.startswith("."))


def _index_shards(weight_map):
    """The shard names an index's ``weight_map`` gives that the loader can load: it keeps the top-level
    ``*.safetensors`` its glob found that the index names, so a value that is not a string, names a file in another
    directory (``sub/x``, ``../x``, ``/abs``) or is not a ``*.safetensors`` is never read by the launch -- nor here."""
    if not isinstance(weight_map, dict):
        raise TypeError("weight_map is not a mapping")
    return set(v for v in weight_map.values()
               if isinstance(v, str) and "/" not in v and fnmatch.fnmatchcase(v, "*.safetensors")
               and not v.startswith("."))


def weight_names(names, load_index):
    """The weight files SGLang loads from a directory holding ``names`` (sorted), and a note or None.

    ``load_index(name)`` returns the parsed index JSON (raises OSError/ValueError when unreadable)."""
    shards = _matching(names, "*.safetensors")
    if not shards:
        bins = [n for n in _matching(names, "*.bin") if n not in NOT_FOR_INFERENCE]
        return bins or [n for n in _matching(names, "*.pt") if n not in NOT_FOR_INFERENCE], None
    indexes = [INDEX_NAME] if INDEX_NAME in names else _matching(names, "*.safetensors.index.json")
    if not indexes:
        if shards == ["consolidated.safetensors", "model.safetensors"]:
            return ["model.safetensors"], None  # the loader's Mistral rule: never both
        return shards, None
    named = set()
    for index in indexes:
        try:
            named.update(_index_shards(load_index(index)["weight_map"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return shards, "%s unreadable (%s): every *.safetensors taken" % (index, exc)
    return sorted(named), None


def _load_json(directory):
    def load(name):
        with open(os.path.join(directory, name), "rb") as fh:
            return json.loads(fh.read().decode("utf-8"))
    return load


def model_files(directory):
    """``(small, weights, note)``: paths of the top-level small files and of the weight files of a model directory.

    Only the top level: the loader globs there, and model repositories keep other copies of the weights in
    subdirectories (Meta's ``original/consolidated.00.pth``, ``onnx/``, GGUF variants) that the launch never reads
    and that would fill the page cache for nothing."""
    names = os.listdir(directory)
    weights, note = weight_names(names, _load_json(directory))
    small = set()
    for pattern in SMALL_PATTERNS:
        small.update(n for n in _matching(names, pattern) if os.path.isfile(os.path.join(directory, n)))
    return ([os.path.join(directory, n) for n in sorted(small - set(weights))],
            [os.path.join(directory, n) for n in weights], note)


def _file_entry(path, st=None, reason=None):
    entry = {"path": path, "size_bytes": 0, "resident_before_bytes": None, "resident_after_bytes": None,
             "read_bytes": 0, "fstype": None, "skipped": reason, "_key": None, "_dev": None, "_uid": None}
    if st is not None:
        entry.update(size_bytes=st.st_size, _key=(st.st_dev, st.st_ino), _dev=st.st_dev, _uid=st.st_uid)
    return entry


def _reason(exc):
    return exc.strerror or str(exc)


def select_files(paths):
    """``(files, skipped, notes)`` for the given ``paths``: every small file first, then the weights, in path order.

    ``files`` are entries (see RETURN ``files``) with internal ``_key`` (st_dev, st_ino), ``_dev`` and ``_uid``;
    a file reached twice (an HF snapshot symlink and its blob, a path given twice) is listed once. ``skipped``
    holds the given paths that were skipped as a whole, ``notes`` what else a reader should know."""
    small, weights, skipped, notes = [], [], [], []
    for given in paths:
        if not os.path.isabs(given):
            skipped.append({"path": given, "reason": "not a local path: %s (a hub id or a relative path; nothing to "
                                                     "prefetch here)" % given})
            continue
        try:
            st = os.stat(given)
        except OSError as exc:
            skipped.append({"path": given, "reason": "%s: %s" % (given, _reason(exc))})
            continue
        if stat.S_ISDIR(st.st_mode):
            try:
                s, w, note = model_files(given)
            except OSError as exc:
                skipped.append({"path": given, "reason": "cannot list %s: %s" % (given, _reason(exc))})
                continue
            small.extend(s)
            weights.extend(w)
            if note:
                notes.append("%s: %s" % (given, note))
        elif stat.S_ISREG(st.st_mode):
            weights.append(given)
        else:
            skipped.append({"path": given, "reason": "%s is neither a directory nor a regular file" % given})
    files, seen = [], set()
    for path in small + weights:
        try:
            st = os.stat(path)
        except OSError as exc:
            # e.g. a shard the index names; "missing" only when it is (a symlink loop or EACCES is not)
            files.append(_file_entry(path, reason="%s: %s" % (
                "missing" if exc.errno == errno.ENOENT else "cannot stat", _reason(exc))))
            continue
        if not stat.S_ISREG(st.st_mode):
            # A FIFO named like a shard would block the open (and the whole module, past any slice or timeout); a
            # directory or device named so is not a checkpoint either.
            files.append(_file_entry(path, reason="not a regular file"))
            continue
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            files.append(_file_entry(path, st))
    return files, skipped, notes


# --- Memory bound ------------------------------------------------------------------------------------------------
# MemFree, not MemAvailable: MemAvailable counts the page cache the kernel would evict to satisfy an allocation --
# the serving process's mapped files among it -- so filling it is exactly the eviction this must not cause.
# Less the sum of every zone's `high` watermark: kswapd wakes when a zone falls below `low` and reclaims until it
# is back above `high`, so free memory that stays above `high` never wakes it (and allocations fall back to other
# zones and NUMA nodes before that under the default vm.zone_reclaim_mode 0). The reserve covers what this sum does
# not: other processes allocating meanwhile, lowmem_reserve of the DMA zones. Free pages parked on the per-CPU lists
# (zoneinfo's pageset `count:`, hundreds of MiB on a busy host) are in neither MemFree nor the kernel's watermark
# checks; reads served from them leave MemFree where it is, so the reads may pass the headroom by that much -- safely,
# as the kernel's own test does not count them either.


def parse_meminfo(text):
    """``{field: bytes}`` from /proc/meminfo text (values in kB; HugePages_* counts are skipped)."""
    out = {}
    for line in text.splitlines():
        key, value = (line.split(":", 1) + [""])[:2]
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            out[key.strip()] = int(parts[0]) * 1024
    return out


def parse_zoneinfo(text):
    """``[{node, zone, free_pages, high_pages, managed_pages}]`` from /proc/zoneinfo text, one entry per zone.

    The zone's watermark line is ``high <pages>``; the per-CPU pagesets below it have ``high: <n>`` lines (a list
    length, not a watermark), which this leaves alone. ``managed_pages`` is None when the kernel prints none."""
    fields = {("pages", "free"): "free_pages", ("high",): "high_pages", ("managed",): "managed_pages"}
    zones = []
    for line in text.splitlines():
        parts = line.split()
        if line.startswith("Node ") and len(parts) >= 4 and parts[2] == "zone":
            zones.append({"node": int(parts[1].rstrip(",")), "zone": parts[3], "free_pages": 0, "high_pages": 0,
                          "managed_pages": None})
        elif zones and len(parts) in (2, 3) and tuple(parts[:-1]) in fields and parts[-1].isdigit():
            zones[-1][fields[tuple(parts[:-1])]] = int(parts[-1])
    return zones


def watermark_pages(zones):
    """Sum of the ``high`` watermarks of the zones that hold memory (an empty zone -- ``managed 0``, such as an
    unused Movable zone -- still prints a token watermark that guards nothing)."""
    return sum(z["high_pages"] for z in zones if z["managed_pages"] != 0)


def memory_bound(meminfo_text, zoneinfo_text, reserve_bytes, page_size=PAGE_SIZE):
    """``{mem_free_bytes, watermark_bytes, reserve_bytes, headroom_bytes}``: what may still come into the page cache
    without reclaim (headroom = MemFree - sum of the zones' high watermarks - reserve; negative when short)."""
    marks = watermark_pages(parse_zoneinfo(zoneinfo_text)) * page_size
    return bound_figures(mem_free(meminfo_text), marks, reserve_bytes)


def mem_free(meminfo_text):
    free = parse_meminfo(meminfo_text).get("MemFree")
    if free is None:
        raise ValueError("no MemFree line in /proc/meminfo")
    return free


def bound_figures(mem_free, watermarks, reserve):
    return {"mem_free_bytes": mem_free, "watermark_bytes": watermarks, "reserve_bytes": reserve,
            "headroom_bytes": mem_free - watermarks - reserve}


# --- Network filesystems -----------------------------------------------------------------------------------------
# Skipped unless asked: reading hundreds of GB from shared storage while the old server serves loads the storage and
# the network every other host depends on, object-storage mounts bill or throttle per request, and FUSE mounts in
# direct_io mode bypass the page cache, so the reads would buy nothing. fuseblk is FUSE over a local block device
# (ntfs-3g, exfat-fuse): local.
NETWORK_FSTYPES = frozenset(("nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "lustre", "gpfs", "beegfs",
                             "wekafs", "9p", "afs", "davfs", "fuse"))


def is_network_fstype(fstype):
    return fstype in NETWORK_FSTYPES or fstype.startswith("fuse.")


def _unescape(field):
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit() and len(field[i + 1:i + 4]) == 3:
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text):
    """``[{dev: (major, minor), mount_point, fstype}]`` from /proc/self/mountinfo text, in mount order."""
    mounts = []
    for line in text.splitlines():
        fields = line.split(" ")
        if "-" not in fields[6:] or len(fields) < 7:
            continue
        sep = fields.index("-", 6)
        dev = fields[2].split(":")
        if len(fields) > sep + 1 and len(dev) == 2 and dev[0].isdigit() and dev[1].isdigit():
            mounts.append({"dev": (int(dev[0]), int(dev[1])), "mount_point": _unescape(fields[4]),
                           "fstype": fields[sep + 1]})
    return mounts


def _under(path, mount_point):
    return mount_point == "/" or path == mount_point or path.startswith(mount_point.rstrip("/") + "/")


def mount_for(path, st_dev, mounts):
    """The mount holding ``path`` (a real path) whose device is ``st_dev``: among the mounts of that major:minor the
    one with the longest mount point above ``path``, else (btrfs subvolumes and overlayfs report a device no
    mountinfo line has) the longest mount point above ``path``; a later mount on the same point shadows an earlier
    one. None when nothing matches."""
    dev = (os.major(st_dev), os.minor(st_dev))
    same = [m for m in mounts if m["dev"] == dev]
    for candidates in ([m for m in same if _under(path, m["mount_point"])], same,
                       [m for m in mounts if _under(path, m["mount_point"])]):
        if candidates:
            return max(reversed(candidates), key=lambda m: len(m["mount_point"]))
    return None


# --- Residency ---------------------------------------------------------------------------------------------------
# Python's mmap module has no mincore, so libc's mmap/mincore/munmap through ctypes. Mapping reads nothing and
# faults nothing in: the address is only handed to mincore, never touched.
_LOW_BIT = bytes(b & 1 for b in range(256))  # mincore sets bit 0 for a resident page; the other bits are reserved
_PROT_READ = 1
_MAP_SHARED = 1
_MAP_FAILED = ctypes.c_void_p(-1).value
_libc = None


def _load_libc():
    global _libc  # pylint: disable=global-statement
    if _libc is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _libc = libc
    return _libc


def _os_error(call):
    err = ctypes.get_errno()
    return OSError(err, "%s: %s" % (call, os.strerror(err)))


class FileMap(object):
    """A read-only shared mapping of an open file, asked about page-cache residency with mincore(2)."""

    def __init__(self, fd, size, page_size=PAGE_SIZE):
        self.size, self.page_size, self.addr = size, page_size, None
        self._libc = _load_libc()
        self._vec = (ctypes.c_ubyte * (min(_WINDOW_BYTES, max(size, 1)) // page_size + 1))()
        if size:
            addr = self._libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
            if addr is None or addr == _MAP_FAILED:
                raise _os_error("mmap")
            self.addr = addr

    def resident(self, offset=0, length=None):
        """Bytes of ``[offset, offset + length)`` in the page cache (``offset`` page-aligned; the last page of the
        file counts only up to the file's size)."""
        end = self.size if length is None else min(self.size, offset + length)
        total = 0
        while offset < end:
            n = min(_WINDOW_BYTES, end - offset)
            pages = (n + self.page_size - 1) // self.page_size
            if self._libc.mincore(self.addr + offset, n, self._vec) != 0:
                raise _os_error("mincore")
            flags = bytes(memoryview(self._vec)[:pages]).translate(_LOW_BIT)
            total += flags.count(1) * self.page_size
            if offset + n == self.size and self.size % self.page_size and flags[-1]:
                total -= self.page_size - self.size % self.page_size
            offset += n
        return total

    def close(self):
        if self.addr is not None:
            self._libc.munmap(self.addr, self.size)
            self.addr = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def mincore_shows_cache(entry, euid=None):
    """Whether mincore tells this process the truth about the file's page cache. Since Linux 5.0 (commit
    134fca9063ad, mm/mincore.c can_do_mincore) it does only for files the caller owns or may write (root may); for
    any other file mapping it reports every page as resident -- a prefetch trusting that would read nothing."""
    euid = os.geteuid() if euid is None else euid
    return euid == 0 or entry["_uid"] == euid or os.access(entry["path"], os.W_OK)


def _open(path):
    # O_NONBLOCK: a file swapped for a FIFO after select_files checked it must not block the module (for a regular
    # file the flag changes nothing).
    return os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))


def measure(entry):
    """Resident bytes of the file of ``entry``; None when they cannot be known (see :func:`mincore_shows_cache`;
    a file that cannot be mapped, such as on a FUSE mount without mmap). Opening errors propagate."""
    if not mincore_shows_cache(entry):
        return None
    fd = _open(entry["path"])
    try:
        with FileMap(fd, os.fstat(fd).st_size) as fmap:
            return fmap.resident()
    except OSError:
        return None
    finally:
        os.close(fd)


# --- Reading -----------------------------------------------------------------------------------------------------


WATERMARKS_FOR_S = 1.0
# At a rate bound, a chunk holds at most this long's worth of bytes: the rate then holds chunk by chunk, and a slice
# or timeout_s is overrun by at most this plus one chunk's read.
PACE_S = 0.5
# A slice lasts at least timeout_s / MAX_SLICES, so a whole prefetch takes at most about this many calls. The role
# chains its slices by a recursive include_tasks (roles/sglang_prefetch/tasks/slice.yml), and ansible-core's play
# iterator recurses once per level: a few hundred levels end ansible-playbook with a RecursionError (a bare
# two-task recursive include died between 200 and 400 levels), and each level costs more than the one before.
# The defaults (900 s / 10 s) stay below this bound; -e sglang_prefetch_timeout_s=3600 with 10 s slices did not.
MAX_SLICES = 100


def slice_length(slice_s, timeout_s):
    """Seconds this call reads before it returns with ``done`` false: ``slice_s``, longer where ``timeout_s`` would
    otherwise take more than :data:`MAX_SLICES` calls."""
    return max(float(slice_s), float(timeout_s) / MAX_SLICES)


def chunk_length(chunk_bytes, rate_bytes_s, page_size=PAGE_SIZE):
    """Bytes per read: ``chunk_bytes``, less at a rate under ``chunk_bytes / PACE_S``; a whole number of pages
    (mincore is asked about page-aligned ranges)."""
    if rate_bytes_s > 0:
        chunk_bytes = min(chunk_bytes, int(rate_bytes_s * PACE_S))
    return max(page_size, chunk_bytes // page_size * page_size)


class Pacer(object):
    """Keeps reads at or below ``rate_bytes_s`` (0: no bound): after each read, sleeps until the read has taken as
    long as the bytes it brought in allow. No credit carries over from resident chunks or pauses, so no burst
    follows them."""

    def __init__(self, rate_bytes_s, now=time.time, sleep=time.sleep):
        self.rate, self.now, self.sleep = rate_bytes_s, now, sleep

    def pace(self, nbytes, started):
        if self.rate <= 0:
            return
        wait = started + nbytes / float(self.rate) - self.now()
        if wait > 0:
            self.sleep(wait)


def read_proc(name, root="/proc"):
    with open(os.path.join(root, name), "rb") as fh:
        return fh.read().decode("ascii", "replace")


class _Run(object):
    """The reading of one call: limits, counters and the seams tests replace."""

    def __init__(self, params, now, sleep, proc, chunk_bytes, started_at):
        self.now, self.proc = now, proc
        self.chunk = chunk_length(chunk_bytes, params["rate_mib_s"] * MIB)
        self.reserve = params["reserve_mib"] * MIB
        self.started = now()
        self.deadline = started_at + params["timeout_s"]
        self.slice_end = self.started + slice_length(params["slice_s"], params["timeout_s"])
        self.pacer = Pacer(params["rate_mib_s"] * MIB, now, sleep)
        self.buf = bytearray(self.chunk)
        self.bound = self._marks = None

    def memory(self, fresh=False):
        """The bound now: MemFree read each time (it falls as the reads fill the cache); the watermarks at most
        :data:`WATERMARKS_FOR_S` old -- on a many-CPU host /proc/zoneinfo is some 200 KB of per-CPU lists (2.4 ms to
        parse for 256 CPUs), too much per 16 MiB chunk, and the watermarks move only when vm.min_free_kbytes or
        vm.watermark_scale_factor change or a zone's watermark boost comes and goes."""
        t = self.now()
        if fresh or self._marks is None or t - self._marks[0] >= WATERMARKS_FOR_S:
            self._marks = (t, watermark_pages(parse_zoneinfo(self.proc("zoneinfo"))) * PAGE_SIZE)
        self.bound = bound_figures(mem_free(self.proc("meminfo")), self._marks[1], self.reserve)
        return self.bound

    def stop_before(self, cold):
        """Why no more may be read before a chunk with ``cold`` bytes not resident: None, or a stopped_by value."""
        t = self.now()
        if t >= self.deadline:
            return "timeout"
        if t >= self.slice_end:
            return "slice"
        if self.memory()["headroom_bytes"] < cold:
            return "memory"
        return None

    def read_file(self, entry):
        """Read the file's cold chunks; returns a stop reason or None when the file is done (or failed)."""
        fd = _open(entry["path"])
        try:
            # No readahead on this descriptor: a read() then brings in exactly the chunk's missing pages, so the
            # memory bound, the rate and read_bytes hold to the page (with the default readahead, read_ahead_kb --
            # 8 MiB on some disks -- would come in beyond each chunk, unchecked and uncounted). It changes only this
            # open file, not the server's later reads of the same file.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            size = os.fstat(fd).st_size
            if entry["resident_before_bytes"] is None:  # residency unknown: every chunk counts as cold
                return self._chunks(entry, fd, size, None)
            with FileMap(fd, size) as fmap:
                return self._chunks(entry, fd, size, fmap)
        finally:
            os.close(fd)

    def _chunks(self, entry, fd, size, fmap):
        view = memoryview(self.buf)
        offset = 0
        while offset < size:
            n = min(self.chunk, size - offset)
            cold = n - fmap.resident(offset, n) if fmap else n
            if cold <= 0:
                offset += n  # already in the page cache: no I/O
                continue
            why = self.stop_before(cold)
            if why:
                return why
            t0 = self.now()
            try:
                got = self._read_at(fd, view[:n], offset)
            except OSError as exc:
                entry["skipped"] = "read failed at byte %d: %s" % (offset, _reason(exc))
                return None
            # Counted: what was not resident (what came from storage), not the resident pages read again with it.
            entry["read_bytes"] += min(cold, got)
            if got < n:
                return None  # the file got shorter while we read: nothing more to read
            self.pacer.pace(min(cold, got), t0)
            offset += n
        return None

    @staticmethod
    def _read_at(fd, view, offset):
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                break
            done += got
        return done


# --- One call ----------------------------------------------------------------------------------------------------


def bad_option(params):
    """The message for the first invalid option in ``params``, or None."""
    for key in ("reserve_mib", "rate_mib_s", "timeout_s", "read_before_bytes", "resident_at_start_bytes"):
        if params.get(key) is not None and params[key] < 0:
            return "%s must be 0 or more (got %s)" % (key, params[key])
    if params["slice_s"] <= 0:
        return "slice_s must be more than 0 (got %s); for one call that runs until timeout_s, set slice_s to it" % (
            params["slice_s"])
    return None


def _classify(files, mounts, network_fs):
    for f in files:
        if f["skipped"]:
            continue
        mount = mount_for(os.path.realpath(f["path"]), f["_dev"], mounts)
        f["fstype"] = mount["fstype"] if mount else None
        if f["fstype"] and is_network_fstype(f["fstype"]) and not network_fs:
            f["skipped"] = ("on %s (network filesystem): set network_fs (sglang_prefetch_network_fs in the role) to "
                            "read it" % f["fstype"])


def _measure_all(files, key):
    for f in files:
        if f["_key"] is None or (f["skipped"] or "").startswith("cannot open"):
            continue
        try:
            f[key] = measure(f)
        except OSError as exc:
            f["skipped"] = f["skipped"] or "cannot open: %s" % _reason(exc)


def _read_all(files, run):
    for f in files:
        if f["skipped"] or f["size_bytes"] == 0:
            continue
        try:
            why = run.read_file(f)
        except OSError as exc:  # opened and mapped before, not now: permissions or the file changed meanwhile
            f["skipped"] = "cannot read: %s" % _reason(exc)
            continue
        if why:
            return why
    return None


def prefetch(params, check_mode=False, now=time.time, sleep=time.sleep, proc=None, chunk_bytes=CHUNK_BYTES):
    """One call of sglang_weights_prefetch with module-shaped ``params`` (:data:`PREFETCH_OPTIONS`): the result
    mapping (RETURN). ``now``/``sleep``/``proc`` (``proc(name)`` -> text of /proc/<name>) are seams for tests.
    Raises OSError/ValueError only for the host as a whole (/proc unreadable, no mincore)."""
    proc = proc or read_proc
    call_start = now()
    _load_libc()  # a host without libc's mincore fails here, not file by file
    started_at = call_start if params.get("started_at") is None else float(params["started_at"])
    files, skipped, notes = select_files(params["paths"])
    _classify(files, parse_mountinfo(proc("self/mountinfo")), params["network_fs"])
    _measure_all(files, "resident_before_bytes")
    run = _Run(params, now, sleep, proc, chunk_bytes, started_at)
    why = None if check_mode else _read_all(files, run)
    _measure_all(files, "resident_after_bytes")
    bound = run.memory(fresh=True)
    return _result(params, files, skipped, notes, why, bound, started_at, call_start, now(), check_mode)


def _size(nbytes):
    if abs(nbytes) >= GIB:
        return "%.1f GiB" % (nbytes / float(GIB))
    return "%.0f MiB" % (nbytes / float(MIB)) if abs(nbytes) >= 10 * MIB else "%.1f MiB" % (nbytes / float(MIB))


def _pct(part, total):
    """Share as the messages show it: whole percent, rounded down, so 100 means all of it."""
    return "%d" % (100 * part // total) if total else "100"


def _result(params, files, skipped, notes, why, bound, started_at, call_start, end, check_mode):
    total = sum(f["size_bytes"] for f in files)
    before = sum(f["resident_before_bytes"] or 0 for f in files)
    after = sum(f["resident_after_bytes"] or 0 for f in files)
    read = sum(f["read_bytes"] for f in files)
    at_start = before if params.get("resident_at_start_bytes") is None else params["resident_at_start_bytes"]
    total_read = params.get("read_before_bytes") or 0
    total_read += read
    elapsed = max(0.0, end - call_start)
    stopped_by = why if why in ("memory", "timeout") else None
    out = {
        "changed": read > 0,
        "files": [{k: v for k, v in f.items() if not k.startswith("_")} for f in files],
        # not "skipped": a top-level "skipped" makes Ansible show the whole task as skipped
        "skipped_paths": skipped,
        "total_bytes": total,
        "resident_before_bytes": before,
        "resident_after_bytes": after,
        "resident_at_start_bytes": at_start,
        "read_bytes": read,
        "total_read_bytes": total_read,
        "cold_bytes": total - after,
        # Rounded down: 100.0 only when every byte is resident.
        "resident_pct": (1000 * after // total) / 10.0 if total else 100.0,
        "elapsed_s": round(elapsed, 3),
        "total_elapsed_s": round(max(0.0, end - started_at), 3),
        "started_at": round(started_at, 3),
        "done": why != "slice",
        "stopped_by": stopped_by,
        "bound": bound,
        "rate_mib_s": params["rate_mib_s"],
        "residency_method": "mincore",
        "read_method": "read",
    }
    out["progress"] = "read %s of %s cold, %.0f MiB/s, %s %% resident, %.0f s" % (
        _size(total_read), _size(max(0, total - at_start)), read / float(MIB) / elapsed if elapsed else 0.0,
        _pct(after, total), out["total_elapsed_s"])
    out["msg"] = _message(out, files, why, notes, params, check_mode)
    return out


def _files(n):
    return "%d file%s" % (n, "" if n == 1 else "s")


def _message(r, files, why, notes, params, check_mode):
    """The one sentence of what is true at the end of the call."""
    total, b = r["total_bytes"], r["bound"]
    head = "%s in %s" % (_size(total), _files(len([f for f in files if not f["skipped"]])))
    if check_mode:
        cold = sum(f["size_bytes"] - (f["resident_before_bytes"] or 0) for f in files if not f["skipped"])
        room = max(0, b["headroom_bytes"])
        text = "check mode: %s: %s %% resident; would read %s (headroom now %s%s)" % (
            head, _pct(r["resident_before_bytes"], total), _size(cold), _size(room),
            ": %s of it fits" % _size(room) if cold > room else "")
    else:
        text = "%s: %s %% resident (was %s %%), %s read in %.1f s" % (
            head, _pct(r["resident_after_bytes"], total), _pct(r["resident_at_start_bytes"], total),
            _size(r["total_read_bytes"]), r["total_elapsed_s"])
    if why == "memory":
        text += ("; stopped at the memory bound: %s left cold (MemFree %s - watermarks %s - reserve %s), the launch "
                 "reads it from storage" % (_size(r["cold_bytes"]), _size(b["mem_free_bytes"]),
                                            _size(b["watermark_bytes"]), _size(b["reserve_bytes"])))
    elif why == "timeout":
        text += "; stopped at timeout_s (%s s): %s left cold" % (params["timeout_s"], _size(r["cold_bytes"]))
    elif why == "slice":
        text += "; goes on in the next slice (%s left cold)" % _size(r["cold_bytes"])
    skipped = [f for f in files if f["skipped"]]
    if skipped:
        text += "; %s skipped (%s: %s)" % (_files(len(skipped)), skipped[0]["path"], skipped[0]["skipped"])
    if r["skipped_paths"]:
        text += "; skipped: " + "; ".join(s["reason"] for s in r["skipped_paths"])
    unknown = len([f for f in files if not f["skipped"] and f["resident_before_bytes"] is None])
    if unknown:
        text += ("; residency of %s unknown (mincore tells the page cache only of files this user owns or may write: "
                 "run with become), read in full" % _files(unknown))
    return "; ".join([text] + notes)
