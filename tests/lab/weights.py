"""Lab weight files: real safetensors checkpoints in a lab host's model dirs, their eviction and residency.

A lab model dir holds only ``config.json`` unless ``lab.py weights`` writes a checkpoint there (issue 35: the
stand-in then really reads it at start, and a prefetch has files to bring into the page cache). The checkpoint is
what Hugging Face's ``save_pretrained`` leaves for a sharded model:

- ``model-0000i-of-0000K.safetensors``: an 8-byte little-endian header length, a JSON header (per tensor
  ``dtype``, ``shape``, ``data_offsets`` relative to the end of the header; ``__metadata__`` with string values),
  padded with spaces to a multiple of 8 bytes as the safetensors library writes it, then the tensors' raw bytes
  back to back. Every tensor is ``[rows, 4096]`` BF16 or F16 (Llama-style names), filled with random bytes: no
  filesystem or disk can compress them, so a read costs what a real checkpoint's does.
- ``model.safetensors.index.json``: ``metadata.total_size`` (the tensors' bytes, without headers) and
  ``weight_map`` (tensor name -> shard file).
- ``.gpufleet-lab-weights.json``: this module's marker (size and shard count), written last: the same request
  again keeps the files.

Files are written with plain ``write``, ``fsync``'d and dropped from the page cache with
``posix_fadvise(POSIX_FADV_DONTNEED)``, so a new checkpoint starts cold. ``evict`` does the same for existing
files: never a machine-wide ``drop_caches``, which would empty the page cache every other lab shares. DONTNEED
leaves pages that a process has mapped (a serving stand-in's): the kernel does not invalidate mapped pages.

Residency is measured with util-linux ``fincore`` (``/usr/bin/fincore``, Debian package util-linux-extra). Its
2.38 counts through ``mincore``, which reports the page cache only for files the caller owns or may write (root
in the lab); for anyone else it sees only the caller's own mappings.

Standard library only: lab.py and the stand-in (a host venv without extra packages) import it.
"""
import json
import os
import struct
import subprocess
import time

SHARD_NAME = "model-%05d-of-%05d.safetensors"
INDEX_NAME = "model.safetensors.index.json"
MARKER_NAME = ".gpufleet-lab-weights.json"
MARKER_VERSION = 1
COLUMNS = 4096  # every tensor is [rows, 4096]: a row is 8 KiB in a 2-byte dtype, 128 rows per MiB
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "I32": 4, "I64": 8,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
ROW_BYTES = COLUMNS * 2
TENSORS_PER_SHARD = 4
# Four Llama-style projections per layer; the last one F16 so a reader meets both 2-byte dtypes.
PROJECTIONS = (("self_attn.q_proj", "BF16"), ("self_attn.o_proj", "BF16"), ("mlp.up_proj", "BF16"),
               ("mlp.down_proj", "F16"))
WRITE_CHUNK = 8 << 20
HEADER_MAX = 100 << 20  # the safetensors library refuses larger headers
FINCORE = "fincore"


class WeightsError(Exception):
    pass


# ---------------------------------------------------------------------------------------------------
# layout
# ---------------------------------------------------------------------------------------------------
def plan(size_mib, shards):
    """The checkpoint's tensors: one list per shard of ``(name, dtype, [rows, COLUMNS])``; all tensors together
    hold exactly ``size_mib`` MiB, spread over the shards as evenly as whole rows allow."""
    if shards < 1:
        raise WeightsError("--shards must be at least 1 (got %d)" % shards)
    total_rows = size_mib * ((1 << 20) // ROW_BYTES)
    if size_mib < 1 or total_rows < shards:
        raise WeightsError("%d MiB cannot fill %d shards: give --size-mib >= 1 and at most %d shards per MiB"
                           % (size_mib, shards, (1 << 20) // ROW_BYTES))
    layout, tensor = [], 0
    for i in range(shards):
        rows = total_rows // shards + (1 if i < total_rows % shards else 0)
        count = min(TENSORS_PER_SHARD, rows)
        shard = []
        for j in range(count):
            proj, dtype = PROJECTIONS[tensor % len(PROJECTIONS)]
            shard.append(("model.layers.%d.%s.weight" % (tensor // len(PROJECTIONS), proj), dtype,
                          [rows // count + (1 if j < rows % count else 0), COLUMNS]))
            tensor += 1
        layout.append(shard)
    return layout


def tensor_bytes(dtype, shape):
    n = DTYPE_BYTES[dtype]
    for dim in shape:
        n *= dim
    return n


def encode_header(tensors, metadata=None):
    """The 8-byte length and the JSON header for ``tensors`` ``[(name, dtype, shape)]`` laid back to back."""
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, dtype, shape in tensors:
        size = tensor_bytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the safetensors writer pads so the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text, offset


def read_header(path):
    """``(tensors, metadata, data_start)`` of a safetensors file: ``tensors`` maps each name to its header entry
    (``dtype``, ``shape``, ``data_offsets``); ``data_start`` is where the offsets count from. Raises WeightsError
    for a file that is not one (lengths, offsets, dtypes and sizes checked as the safetensors library checks)."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        raw = fh.read(8)
        if len(raw) < 8:
            raise WeightsError("%s: %d bytes, too short for a safetensors header" % (path, size))
        (length,) = struct.unpack("<Q", raw)
        if length > HEADER_MAX or 8 + length > size:
            raise WeightsError("%s: header length %d does not fit the file (%d bytes)" % (path, length, size))
        try:
            header = json.loads(fh.read(length))
        except ValueError as exc:
            raise WeightsError("%s: header is not JSON: %s" % (path, exc))
    if not isinstance(header, dict):
        raise WeightsError("%s: header is not a JSON object" % path)
    metadata = header.pop("__metadata__", None) or {}
    for name, entry in header.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and entry.get("dtype") in DTYPE_BYTES and isinstance(entry.get("shape"), list)):
            raise WeightsError("%s: tensor %s needs dtype (one of %s), shape and data_offsets [begin, end]: %r"
                               % (path, name, ", ".join(sorted(DTYPE_BYTES)), entry))
    end = 0
    for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
        begin, stop = entry["data_offsets"]
        want = tensor_bytes(entry["dtype"], entry["shape"])
        if begin != end or stop - begin != want:
            raise WeightsError("%s: tensor %s has data_offsets %s, expected [%d, %d] (tensors back to back)"
                               % (path, name, entry["data_offsets"], end, end + want))
        end = stop
    if 8 + length + end != size:
        raise WeightsError("%s: tensors end at byte %d, the file at %d" % (path, 8 + length + end, size))
    return header, metadata, 8 + length


# ---------------------------------------------------------------------------------------------------
# write, remove
# ---------------------------------------------------------------------------------------------------
def weight_files(model_dir):
    """The ``*.safetensors`` files of a model dir, sorted (what a loader reads)."""
    try:
        names = os.listdir(model_dir)
    except FileNotFoundError:
        return []
    return [os.path.join(model_dir, n) for n in sorted(names)
            if n.endswith(".safetensors") and os.path.isfile(os.path.join(model_dir, n))]


def model_files(path):
    """Every regular file under ``path`` (a file gives itself), sorted: what evict and residency look at."""
    if os.path.isfile(path):
        return [path]
    found = []
    for top, dirs, files in os.walk(path):
        dirs.sort()
        found += [os.path.join(top, f) for f in sorted(files) if os.path.isfile(os.path.join(top, f))]
    return found


def _read_marker(model_dir):
    try:
        with open(os.path.join(model_dir, MARKER_NAME)) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def _intact(model_dir, marker, size_mib, shards):
    if not marker or (marker.get("version"), marker.get("size_mib"), marker.get("shards")) != (
            MARKER_VERSION, size_mib, shards):
        return False
    for name, size in (marker.get("files") or {}).items():
        try:
            if os.path.getsize(os.path.join(model_dir, name)) != size:
                return False
        except OSError:
            return False
    return bool(marker.get("files"))


def _write_cold(path, parts):
    """Write ``parts`` (bytes, or an int = that many random bytes) to ``path`` through a temporary name, fsync,
    drop the file's pages from the page cache (clean after the fsync, so DONTNEED frees them) and rename."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for part in parts:
            if isinstance(part, int):
                left = part
                while left:
                    n = min(WRITE_CHUNK, left)
                    os.write(fd, os.urandom(n))
                    left -= n
            else:
                view = memoryview(part)
                while view:
                    view = view[os.write(fd, view):]
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return os.path.getsize(path)


def remove_checkpoint(model_dir):
    """Remove the checkpoint from a model dir (shards, index, marker; ``config.json`` and anything else stay).
    Returns the names removed."""
    removed = []
    try:
        names = sorted(os.listdir(model_dir))
    except FileNotFoundError:
        return removed
    for name in names:
        if name.endswith((".safetensors", ".safetensors.tmp")) or name in (INDEX_NAME, MARKER_NAME):
            os.unlink(os.path.join(model_dir, name))
            removed.append(name)
    return removed


def _write_shards(work, jobs):
    """``_write_cold`` of each ``(path, parts)`` of ``work``, ``jobs`` at a time in as many processes; the sizes,
    in order. Random bytes cost CPU (``os.urandom``: 0.18 GiB/s on one core of the 2-core development machine), so a
    checkpoint of tens of GiB is written in minutes by one process and in a fraction of that by one per shard."""
    jobs = max(1, min(jobs, len(work)))
    if jobs == 1:
        return [_write_cold(path, parts) for path, parts in work]
    import concurrent.futures
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(_write_cold, [w[0] for w in work], [w[1] for w in work]))


def write_checkpoint(model_dir, size_mib, shards=1, jobs=1):
    """A ``size_mib`` MiB checkpoint in ``shards`` shards in ``model_dir``, cold in the page cache; ``size_mib``
    0 removes it. The same size and shard count as the marker's, with every file still its size, keeps the files.
    ``jobs``: shards written at once, each by its own process (see _write_shards).

    Returns ``{"changed", "files" (paths), "tensor_bytes", "file_bytes", "seconds"}``.
    """
    t0 = time.monotonic()
    if size_mib == 0:
        removed = remove_checkpoint(model_dir)
        return {"changed": bool(removed), "files": [], "tensor_bytes": 0, "file_bytes": 0,
                "seconds": round(time.monotonic() - t0, 3)}
    layout = plan(size_mib, shards)
    if not os.path.isdir(model_dir):
        raise WeightsError("no model dir %s (lab.py up makes one per model)" % model_dir)
    marker = _read_marker(model_dir)
    if _intact(model_dir, marker, size_mib, shards):
        files = [os.path.join(model_dir, n) for n in sorted(marker["files"])]
        return {"changed": False, "files": files, "tensor_bytes": marker["tensor_bytes"],
                "file_bytes": sum(marker["files"].values()), "seconds": round(time.monotonic() - t0, 3)}
    remove_checkpoint(model_dir)
    work, weight_map, total = [], {}, 0
    for i, tensors in enumerate(layout, 1):
        name = SHARD_NAME % (i, shards)
        header, data = encode_header(tensors, {"format": "pt", "gpufleet_lab": "random weights (lab.py weights)"})
        work.append((os.path.join(model_dir, name), [header, data]))
        weight_map.update((t[0], name) for t in tensors)
        total += data
    sizes = dict((os.path.basename(w[0]), size) for w, size in zip(work, _write_shards(work, jobs)))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_cold(os.path.join(model_dir, INDEX_NAME), [json.dumps(index, indent=2).encode() + b"\n"])
    marker = {"version": MARKER_VERSION, "size_mib": size_mib, "shards": shards, "tensor_bytes": total,
              "files": sizes}
    _write_cold(os.path.join(model_dir, MARKER_NAME), [json.dumps(marker, indent=1).encode() + b"\n"])
    return {"changed": True, "files": [os.path.join(model_dir, n) for n in sorted(sizes)], "tensor_bytes": total,
            "file_bytes": sum(sizes.values()), "seconds": round(time.monotonic() - t0, 3)}


# ---------------------------------------------------------------------------------------------------
# page cache
# ---------------------------------------------------------------------------------------------------
def evict(paths):
    """Drop every file under ``paths`` (files or dirs) from the page cache: fsync (dirty pages are not dropped),
    then ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the whole file. Pages a process has mapped stay. Returns the
    files evicted."""
    done = []
    for path in paths:
        for f in model_files(path):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            done.append(f)
    return done


def residency(paths):
    """``{file: (resident bytes, size bytes)}`` for every file under ``paths``, from ``fincore --bytes --raw``."""
    files = [f for p in paths for f in model_files(p)]
    if not files:
        return {}
    argv = [FINCORE, "--bytes", "--noheadings", "--raw", "--output", "RES,SIZE,FILE", "--"] + files
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, LC_ALL="C"))
    except FileNotFoundError:
        raise WeightsError("util-linux fincore is not installed: apt-get install util-linux-extra "
                           "(make system-packages does)")
    got = {}
    for line in proc.stdout.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit():
            got[parts[2]] = (int(parts[0]), int(parts[1]))
    missing = [f for f in files if f not in got]
    if proc.returncode != 0 or missing:
        raise WeightsError("fincore rc %d, no figure for %s: %s" % (
            proc.returncode, ", ".join(missing) or "-", proc.stderr.strip()))
    return {f: got[f] for f in files}


def resident_bytes(path):
    """Bytes of ``path`` (a file, or every file under a dir) in the page cache now (fincore)."""
    return sum(res for res, _ in residency([path]).values())


def shard_rss_bytes(smaps_text, model_dir):
    """Bytes of Rss over the mappings of the safetensors shards in ``model_dir``, from a process's
    ``/proc/<pid>/smaps`` text: the pages of its mapped weights that are resident (what reclaim would take)."""
    rss, inside = 0, False
    for line in smaps_text.splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's header: range perms offset dev inode [path]
            inside = len(head) == 6 and head[5].startswith(model_dir.rstrip("/") + "/") and \
                head[5].endswith(".safetensors")
        elif inside and head[:1] == ["Rss:"]:
            rss += int(head[1]) * 1024
    return rss
