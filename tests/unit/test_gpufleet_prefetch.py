"""gpufleet_prefetch: which files, the memory bound, network filesystems, residency, the rate, slices and timeout.

Most tests read real files in ``tmp_path`` and measure them with mincore; they need a filesystem whose page cache
``posix_fadvise(DONTNEED)`` can drop (not tmpfs), and skip otherwise. The /proc texts are fixtures
(``data/prefetch``: README.md says where each comes from) or this machine's own.
"""
import json
import mmap
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_prefetch as P

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "prefetch")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 1 << 20
PAGE = P.PAGE_SIZE


def fixture(name):
    with open(os.path.join(DATA, name)) as fh:
        return fh.read()


def params(paths, **kw):
    p = dict(reserve_mib=0, rate_mib_s=0, network_fs=False, timeout_s=900.0, slice_s=600.0, started_at=None,
             resident_at_start_bytes=None, read_before_bytes=0)
    p.update(kw, paths=[str(x) for x in paths])
    return p


def write(path, size=0, text=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    if text is not None:
        path.write_text(text)
    else:
        with open(path, "wb") as fh:
            left = size
            block = os.urandom(min(size, 4 * MIB)) if size else b""
            while left > 0:
                fh.write(block[:left])
                left -= len(block)
    return path


def resident(path):
    fd = os.open(str(path), os.O_RDONLY)
    try:
        with P.FileMap(fd, os.fstat(fd).st_size) as fmap:
            return fmap.resident()
    finally:
        os.close(fd)


def evict(*paths):
    """Write back and drop the files' page cache; skip the test where the kernel keeps it (tmpfs)."""
    for path in paths:
        fd = os.open(str(path), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        if resident(path) > 64 * 1024:
            pytest.skip("%s stays in the page cache after DONTNEED (tmpfs?): residency cannot be tested here" % path)


def cold_file(path, size):
    write(path, size)
    evict(path)
    return path


class Clock(object):
    """A clock that moves only when slept on (reads take no time)."""

    def __init__(self, t=1000.0):
        self.t, self.slept = t, []

    def now(self):
        return self.t

    def sleep(self, s):
        self.slept.append(s)
        self.t += s


def proc_with(meminfo=None, zoneinfo=None, mountinfo=None):
    """``proc`` for prefetch(): fixture texts where given (a callable is called per read), this machine's otherwise."""
    given = {"meminfo": meminfo, "zoneinfo": zoneinfo, "self/mountinfo": mountinfo}

    def proc(name):
        value = given[name]
        if value is None:
            return P.read_proc(name)
        return value() if callable(value) else value
    return proc


# --- Which files ---------------------------------------------------------------------------------------------------

def model_dir(root, names, index=None):
    for name in names:
        write(root / name, 4096)
    if index is not None:
        write(root / "model.safetensors.index.json", text=json.dumps({"metadata": {}, "weight_map": index}))
    return root


def names(files):
    return [os.path.basename(f["path"]) for f in files]


def test_index_picks_the_shards_its_weight_map_names_sorted_and_leaves_the_consolidated_copy(tmp_path):
    d = model_dir(tmp_path / "m", ["model-00002-of-00002.safetensors", "model-00001-of-00002.safetensors",
                                   "consolidated.safetensors", "config.json", "tokenizer.json",
                                   "tokenizer_config.json", "generation_config.json", "README.md"],
                  index={"a.weight": "model-00002-of-00002.safetensors", "b.weight": "model-00001-of-00002.safetensors",
                         "c.weight": "model-00002-of-00002.safetensors"})
    files, skipped, notes = P.select_files([str(d)])
    assert names(files) == ["config.json", "generation_config.json", "model.safetensors.index.json",
                            "tokenizer.json", "tokenizer_config.json",
                            "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert skipped == [] and notes == []


def test_without_index_every_safetensors_is_read_in_sorted_order(tmp_path):
    d = model_dir(tmp_path / "m", ["b.safetensors", "a.safetensors", "config.json", "pytorch_model.bin"])
    files, _, _ = P.select_files([str(d)])
    assert names(files) == ["config.json", "a.safetensors", "b.safetensors"]  # .bin beside safetensors: not loaded


def test_bin_only_checkpoint_reads_bins_without_training_leftovers_then_pt(tmp_path):
    d = model_dir(tmp_path / "bin", ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin",
                                     "training_args.bin", "optimizer.pt", "pytorch_model.bin.index.json",
                                     "config.json"])
    files, _, _ = P.select_files([str(d)])
    assert names(files) == ["config.json", "pytorch_model.bin.index.json", "pytorch_model-00001-of-00002.bin",
                            "pytorch_model-00002-of-00002.bin"]
    d = model_dir(tmp_path / "pt", ["model.pt", "scheduler.pt", "config.json"])
    assert names(P.select_files([str(d)])[0]) == ["config.json", "model.pt"]


def test_small_files_come_first_across_paths_and_subdirectories_are_not_read(tmp_path):
    main = model_dir(tmp_path / "main", ["model.safetensors", "config.json", "tokenizer.model", "vocab.json",
                                         "merges.txt", "modeling_x.py", "chat_template.jinja", "LICENSE"])
    write(main / "original" / "consolidated.00.pth", 4096)
    write(main / "original" / "params.json", text="{}")
    draft = model_dir(tmp_path / "draft", ["model.safetensors", "config.json"])
    files, _, _ = P.select_files([str(main), str(draft)])
    assert [os.path.relpath(f["path"], str(tmp_path)) for f in files] == [
        "main/chat_template.jinja", "main/config.json", "main/merges.txt", "main/modeling_x.py",
        "main/tokenizer.model", "main/vocab.json", "draft/config.json",
        "main/model.safetensors", "draft/model.safetensors"]


def test_hf_snapshot_symlinks_into_blobs_count_once(tmp_path):
    repo = tmp_path / "hub" / "models--org--m"
    write(repo / "blobs" / "aaa", 8192)
    write(repo / "blobs" / "ccc", text="{}")
    snap = repo / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    os.symlink("../../blobs/aaa", str(snap / "model.safetensors"))
    os.symlink("../../blobs/ccc", str(snap / "config.json"))
    files, skipped, _ = P.select_files([str(snap), str(snap), str(repo / "blobs" / "aaa")])
    assert [f["path"] for f in files] == [str(snap / "config.json"), str(snap / "model.safetensors")]
    assert files[1]["size_bytes"] == 8192 and skipped == []


def test_hub_id_relative_and_missing_paths_are_skipped_with_the_reason(tmp_path):
    files, skipped, _ = P.select_files(["meta-llama/Llama-3.1-8B", str(tmp_path / "gone")])
    assert files == []
    assert skipped[0] == {"path": "meta-llama/Llama-3.1-8B",
                          "reason": "not a local path: meta-llama/Llama-3.1-8B (a hub id or a relative path; "
                                    "nothing to prefetch here)"}
    assert skipped[1]["reason"] == "%s: No such file or directory" % (tmp_path / "gone")


def test_a_shard_the_index_names_but_the_disk_lacks_is_listed_as_skipped(tmp_path):
    d = model_dir(tmp_path / "m", ["model-1.safetensors"], index={"a": "model-1.safetensors", "b": "model-2.safetensors"})
    files, _, _ = P.select_files([str(d)])
    assert names(files)[-2:] == ["model-1.safetensors", "model-2.safetensors"]
    assert files[-1]["skipped"] == "missing: No such file or directory" and files[-1]["size_bytes"] == 0


def test_the_loaders_mistral_rule_without_index_and_an_unreadable_index_said(tmp_path):
    d = model_dir(tmp_path / "mistral", ["consolidated.safetensors", "model.safetensors"])
    assert names(P.select_files([str(d)])[0]) == ["model.safetensors"]
    d = model_dir(tmp_path / "bad", ["a.safetensors", "b.safetensors"])
    write(d / "model.safetensors.index.json", text="{not json")
    files, _, notes = P.select_files([str(d)])
    assert names(files)[-2:] == ["a.safetensors", "b.safetensors"]
    assert len(notes) == 1 and "model.safetensors.index.json unreadable" in notes[0]


def test_index_values_the_loader_never_loads_are_left_out_and_do_not_fail_the_selection(tmp_path):
    # A non-string value made sorted() raise TypeError: the module crashed and the whole prefetch was lost. A name in
    # another directory or not a *.safetensors is never loaded (the loader keeps its top-level glob's files that the
    # index names), so it is not read here either -- ../ would have read a file outside the model directory.
    write(tmp_path / "outside.safetensors", 4096)
    d = model_dir(tmp_path / "m", ["model-1.safetensors", "model-2.safetensors"],
                  index={"a": "model-1.safetensors", "b": 5, "c": ["x"], "d": "../outside.safetensors",
                         "e": str(tmp_path / "outside.safetensors"), "f": "sub/model-3.safetensors",
                         "g": "model-2.safetensors", "h": "notes.txt"})
    write(d / "sub" / "model-3.safetensors", 4096)
    files, skipped, notes = P.select_files([str(d)])
    assert names(files) == ["model.safetensors.index.json", "model-1.safetensors", "model-2.safetensors"]
    assert skipped == [] and notes == []


def test_an_index_whose_weight_map_is_not_a_mapping_is_said_and_every_shard_taken(tmp_path):
    d = model_dir(tmp_path / "m", ["a.safetensors", "b.safetensors"])
    write(d / "model.safetensors.index.json", text=json.dumps({"weight_map": ["a.safetensors"]}))
    files, _, notes = P.select_files([str(d)])
    assert names(files)[-2:] == ["a.safetensors", "b.safetensors"]
    assert len(notes) == 1 and "unreadable" in notes[0]


def test_hidden_files_are_not_the_checkpoint_as_for_the_loaders_glob(tmp_path):
    d = model_dir(tmp_path / "m", ["model.safetensors", "._model.safetensors", "config.json", ".marker.json"])
    assert names(P.select_files([str(d)])[0]) == ["config.json", "model.safetensors"]


def test_a_fifo_named_like_a_shard_is_skipped_not_opened(tmp_path):
    # Opening a FIFO for reading blocks until a writer comes: the module hung before the lock, past every slice and
    # timeout, and the restart with it.
    d = model_dir(tmp_path / "m", ["config.json"])
    os.mkfifo(str(d / "model.safetensors"))
    os.mkdir(str(d / "dir.safetensors"))
    files, _, _ = P.select_files([str(d)])
    assert [(os.path.basename(f["path"]), f["skipped"]) for f in files][-2:] == [
        ("dir.safetensors", "not a regular file"), ("model.safetensors", "not a regular file")]
    # Had it regressed, the open would block: SIGALRM turns that into a failure instead of a hung test run.
    def hung(*_):
        raise AssertionError("the prefetch blocked on the FIFO")
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        r = P.prefetch(params([d]))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert r["done"] and "2 files skipped" in r["msg"]


def test_a_symlink_loop_is_not_called_missing(tmp_path):
    d = model_dir(tmp_path / "m", ["config.json"])
    os.symlink(str(d / "b.safetensors"), str(d / "a.safetensors"))
    os.symlink(str(d / "a.safetensors"), str(d / "b.safetensors"))
    files, _, _ = P.select_files([str(d)])
    assert [f["skipped"] for f in files][-2:] == ["cannot stat: Too many levels of symbolic links"] * 2


def test_weight_names_prefers_the_loaders_index_over_others():
    indexes = {"model.safetensors.index.json": {"weight_map": {"x": "b.safetensors"}},
               "consolidated.safetensors.index.json": {"weight_map": {"x": "consolidated.safetensors"}}}
    shards, note = P.weight_names(["a.safetensors", "b.safetensors", "consolidated.safetensors"] + sorted(indexes),
                                  indexes.__getitem__)
    assert shards == ["b.safetensors"] and note is None


# --- Memory bound --------------------------------------------------------------------------------------------------

def test_zoneinfo_of_this_vm_sums_zone_high_watermarks_not_the_pagesets_high():
    zones = P.parse_zoneinfo(fixture("zoneinfo-vm-1node.txt"))
    assert [(z["zone"], z["high_pages"]) for z in zones] == [
        ("DMA", 32), ("DMA32", 6813), ("Normal", 18493), ("Movable", 32), ("Device", 0)]
    # The Movable zone manages no memory: its token watermark does not count.
    assert P.watermark_pages(zones) == 32 + 6813 + 18493


def test_zoneinfo_of_a_two_node_host_sums_every_zone_of_both_nodes():
    zones = P.parse_zoneinfo(fixture("zoneinfo-2node-example.txt"))
    assert len(zones) == 10 and {z["node"] for z in zones} == {0, 1}
    assert [z["high_pages"] for z in zones if z["managed_pages"]] == [7, 5750, 544000, 559600]
    assert P.watermark_pages(zones) == 1109357


def test_meminfo_values_in_bytes():
    info = P.parse_meminfo(fixture("meminfo-vm.txt"))
    assert info["MemFree"] == 21647596 * 1024 and info["MemTotal"] == 24683784 * 1024
    assert "HugePages_Total" not in info  # a count, not kB


def test_memory_bound_is_memfree_less_watermarks_less_reserve():
    b = P.memory_bound("MemTotal: 100 kB\nMemFree:   8388608 kB\nMemAvailable: 9999999 kB\n",
                       fixture("zoneinfo-2node-example.txt"), 4096 * MIB, page_size=4096)
    assert b == {"mem_free_bytes": 8 << 30, "watermark_bytes": 1109357 * 4096, "reserve_bytes": 4 << 30,
                 "headroom_bytes": (8 << 30) - 1109357 * 4096 - (4 << 30)}


def test_memory_bound_fails_without_memfree():
    with pytest.raises(ValueError, match="MemFree"):
        P.memory_bound("MemTotal: 1 kB\n", "", 0)


def test_prefetch_stops_when_the_headroom_is_below_the_next_chunk(tmp_path):
    f = cold_file(tmp_path / "m" / "model.safetensors", 8 * MIB)
    zoneinfo = fixture("zoneinfo-vm-1node.txt")
    marks = P.watermark_pages(P.parse_zoneinfo(zoneinfo)) * PAGE
    reads = []

    def meminfo():  # MemFree falls by one chunk per check, as it does while the reads fill the page cache
        reads.append(1)
        return "MemFree: %d kB\n" % ((marks + 3 * MIB + MIB // 2 - (len(reads) - 1) * MIB) // 1024)

    r = P.prefetch(params([f.parent]), proc=proc_with(meminfo=meminfo, zoneinfo=zoneinfo), chunk_bytes=MIB)
    assert r["stopped_by"] == "memory" and r["done"] is True and r["changed"] is True
    assert r["read_bytes"] == 3 * MIB  # headroom 3.5, 2.5, 1.5 MiB: read; 0.5 MiB: stop
    assert r["files"][0]["resident_after_bytes"] == 3 * MIB and r["cold_bytes"] == 5 * MIB
    assert r["bound"]["watermark_bytes"] == marks and r["bound"]["reserve_bytes"] == 0
    assert "stopped at the memory bound: 5.0 MiB left cold (MemFree " in r["msg"]
    assert "- watermarks %s - reserve 0.0 MiB)" % P._size(marks) in r["msg"]


def test_memfree_is_read_before_every_chunk_and_the_watermarks_once_a_second(tmp_path):
    f = cold_file(tmp_path / "m" / "model.safetensors", 8 * MIB)
    clock, calls = Clock(), []
    real = proc_with()

    def proc(name):
        calls.append(name)
        return real(name)
    r = P.prefetch(params([f.parent], rate_mib_s=2), now=clock.now, sleep=clock.sleep, proc=proc)
    assert r["read_bytes"] == 8 * MIB  # eight 1 MiB chunks, 0.5 s each
    assert calls.count("meminfo") == 8 + 1  # one per chunk, one for the bound reported at the end
    assert calls.count("zoneinfo") == 4 + 1  # at 0, 1, 2 and 3 s, and at the end


# --- Network filesystems -------------------------------------------------------------------------------------------

MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
60 27 0:50 / /models rw,relatime shared:7 - nfs4 storage:/export/models rw,vers=4.2
61 60 0:51 / /models/s3 rw,nosuid - fuse.s3fs s3fs rw,user_id=0
62 27 8:17 / /mnt/usb\\040disk rw - fuseblk /dev/sdb1 rw,user_id=0
63 27 0:52 / /models rw,relatime - ext4 /dev/nvme0n1 rw
64 27 0:60 /@home /home rw - btrfs /dev/nvme1n1p2 rw
"""


def test_mountinfo_fields_and_escapes():
    mounts = P.parse_mountinfo(MOUNTINFO)
    assert mounts[2] == {"dev": (0, 50), "mount_point": "/models", "fstype": "nfs4"}
    assert mounts[4]["mount_point"] == "/mnt/usb disk" and mounts[4]["fstype"] == "fuseblk"


@pytest.mark.parametrize("fstype, network", [
    ("nfs4", True), ("nfs", True), ("cifs", True), ("ceph", True), ("lustre", True), ("wekafs", True),
    ("9p", True), ("fuse.s3fs", True), ("fuse.gcsfuse", True), ("fuse", True),
    ("fuseblk", False), ("ext4", False), ("xfs", False), ("overlay", False), ("tmpfs", False), ("btrfs", False)])
def test_network_filesystem_decision(fstype, network):
    assert P.is_network_fstype(fstype) is network


def test_mount_by_device_number_then_by_longest_prefix_and_the_last_mount_wins():
    mounts = P.parse_mountinfo(MOUNTINFO)
    assert P.mount_for("/models/llama/model.safetensors", os.makedev(0, 50), mounts)["fstype"] == "nfs4"
    assert P.mount_for("/models/s3/x.safetensors", os.makedev(0, 51), mounts)["fstype"] == "fuse.s3fs"
    # btrfs reports a subvolume's own anonymous device, which no mountinfo line has: the path decides
    assert P.mount_for("/home/u/m/x", os.makedev(0, 99), mounts)["fstype"] == "btrfs"
    # /models mounted twice: the later (ext4) mount hides the nfs4 one
    assert P.mount_for("/models/other/x", os.makedev(0, 98), mounts)["fstype"] == "ext4"


def _mountinfo_putting(directory, fstype):
    dev = os.stat(str(directory)).st_dev
    return P.read_proc("self/mountinfo") + "900 27 %d:%d / %s rw - %s srv:/x rw\n" % (
        os.major(dev), os.minor(dev), directory, fstype)


def test_files_on_a_network_filesystem_are_skipped_unless_network_fs(tmp_path):
    f = cold_file(tmp_path / "m" / "model.safetensors", 2 * MIB)
    proc = proc_with(mountinfo=_mountinfo_putting(f.parent, "nfs4"))
    r = P.prefetch(params([f.parent]), proc=proc)
    assert r["files"][0]["fstype"] == "nfs4" and r["read_bytes"] == 0 and r["changed"] is False
    assert r["files"][0]["skipped"] == ("on nfs4 (network filesystem): set network_fs (sglang_prefetch_network_fs "
                                        "in the role) to read it")
    assert "1 file skipped" in r["msg"] and r["cold_bytes"] == 2 * MIB
    r = P.prefetch(params([f.parent], network_fs=True), proc=proc)
    assert r["files"][0]["skipped"] is None and r["read_bytes"] == 2 * MIB


# --- Residency, reads ----------------------------------------------------------------------------------------------

def test_mincore_counts_the_last_page_only_up_to_the_file_size(tmp_path):
    f = write(tmp_path / "small.json", text="x" * 5000)
    f.read_bytes()
    assert resident(f) == 5000
    assert resident(write(tmp_path / "empty.json", text="")) == 0


def test_a_64_mib_file_dropped_from_the_cache_is_resident_after_the_prefetch(tmp_path):
    f = cold_file(tmp_path / "m" / "model.safetensors", 64 * MIB)
    assert resident(f) <= 64 * 1024  # DONTNEED emptied it
    r = P.prefetch(params([f.parent]))
    assert r["done"] is True and r["stopped_by"] is None and r["changed"] is True
    assert r["read_bytes"] == 64 * MIB and r["files"][0]["resident_before_bytes"] <= 64 * 1024
    assert resident(f) == 64 * MIB and r["resident_after_bytes"] == 64 * MIB and r["resident_pct"] == 100.0
    assert r["residency_method"] == "mincore" and r["read_method"] == "read"
    assert r["msg"].startswith("64 MiB in 1 file: 100 % resident (was 0 %), 64 MiB read in ")
    if shutil.which("fincore"):  # util-linux agrees
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", str(f)], capture_output=True,
                             text=True, check=True).stdout.split()
        assert int(out[0]) == 64 * MIB


def write_around_the_cache(path, size):
    """Write ``size`` bytes with O_DIRECT: the file never enters the page cache, so no DONTNEED frees a burst of
    pages just before the test (they would park on the per-CPU lists and come back into MemFree while it runs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    block = mmap.mmap(-1, 4 * MIB)  # page-aligned, as O_DIRECT wants
    block.write(os.urandom(4 * MIB))
    try:
        fd = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
    except OSError:  # a filesystem without O_DIRECT (tmpfs): evict() skips the test there
        return cold_file(path, size)
    try:
        for _ in range(size // (4 * MIB)):
            os.write(fd, block)
    finally:
        os.close(fd)
    evict(path)
    return path


def per_cpu_free_bytes():
    """Free pages parked on the per-CPU lists (the ``count:`` of every pageset in /proc/zoneinfo)."""
    return sum(int(line.split()[1]) for line in P.read_proc("zoneinfo").splitlines()
               if line.strip().startswith("count:")) * PAGE


def test_reserve_leaving_32_mib_of_headroom_reads_about_that_and_stops_at_memory(tmp_path):
    # Page-cache allocations take pages from the per-CPU free lists first, and those are in neither MemFree nor the
    # kernel's watermark checks: the prefetch may read that much beyond the headroom, reclaiming nothing. The file
    # is larger than all of it, so the bound is what stops the reads.
    parked = per_cpu_free_bytes()
    size = (32 * MIB + parked + 4 * P.CHUNK_BYTES) // P.CHUNK_BYTES * P.CHUNK_BYTES
    f = write_around_the_cache(tmp_path / "m" / "model.safetensors", size)
    now = P.memory_bound(P.read_proc("meminfo"), P.read_proc("zoneinfo"), 0)
    reserve_mib = now["headroom_bytes"] // MIB - 32
    seen = []  # MemFree at each check, as the module read it from this machine

    def meminfo():
        text = P.read_proc("meminfo")
        seen.append(P.mem_free(text))
        return text
    r = P.prefetch(params([f.parent], reserve_mib=reserve_mib), proc=proc_with(meminfo=meminfo))
    headroom = [free - now["watermark_bytes"] - reserve_mib * MIB for free in seen]
    reads = r["read_bytes"] // P.CHUNK_BYTES
    assert abs(resident(f) - r["read_bytes"]) <= 64 * 1024  # no readahead beyond the checked chunks
    # Every chunk was read on a MemFree that left room for it, whatever the rest of the machine did meanwhile.
    assert r["read_bytes"] == reads * P.CHUNK_BYTES and all(h >= P.CHUNK_BYTES for h in headroom[:reads])
    if r["stopped_by"] == "memory":
        assert len(seen) == reads + 2 and headroom[reads] < P.CHUNK_BYTES  # a check per chunk, the stop, the end
        assert r["done"] is True and "left cold (MemFree " in r["msg"]
    # Where the machine held still (other tests in parallel free memory too: CI runs them beside this one), the
    # bound is what stopped it: the 32 MiB, what was parked on the per-CPU lists, one chunk, 16 MiB for the rest.
    if max(seen) - seen[0] <= 8 * MIB:
        assert r["stopped_by"] == "memory", (r["read_bytes"], seen[:3], seen[-3:])
        assert r["read_bytes"] <= 32 * MIB + parked + P.CHUNK_BYTES + 16 * MIB


def test_resident_chunks_are_not_read_again(tmp_path, monkeypatch):
    f = cold_file(tmp_path / "m" / "model.safetensors", 8 * MIB)
    fd = os.open(str(f), os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: exactly these pages come in
    os.pread(fd, 2 * MIB, 0)
    os.pread(fd, MIB, 5 * MIB)
    os.close(fd)
    assert resident(f) == 3 * MIB
    offsets, preadv = [], os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, offset: offsets.append(offset) or preadv(fd, bufs, offset))
    r = P.prefetch(params([f.parent]), chunk_bytes=MIB)
    assert offsets == [2 * MIB, 3 * MIB, 4 * MIB, 6 * MIB, 7 * MIB]  # the 1 MiB chunks at 0, 1 and 5 MiB: no read
    assert r["files"][0]["resident_before_bytes"] == 3 * MIB
    assert r["read_bytes"] == 5 * MIB and resident(f) == 8 * MIB


def test_check_mode_measures_and_reads_nothing(tmp_path):
    f = cold_file(tmp_path / "m" / "model.safetensors", 8 * MIB)
    r = P.prefetch(params([f.parent]), check_mode=True)
    assert r["changed"] is False and r["read_bytes"] == 0 and resident(f) <= 64 * 1024
    assert r["done"] is True and r["stopped_by"] is None
    assert r["msg"].startswith("check mode: 8.0 MiB in 1 file: 0 % resident; would read 8.0 MiB (headroom now ")


def test_check_mode_says_how_much_fits_under_the_bound(tmp_path):
    f = cold_file(tmp_path / "m" / "model.safetensors", 8 * MIB)
    zoneinfo = fixture("zoneinfo-vm-1node.txt")
    marks = P.watermark_pages(P.parse_zoneinfo(zoneinfo)) * PAGE
    proc = proc_with(meminfo="MemFree: %d kB\n" % ((marks + 2 * MIB) // 1024), zoneinfo=zoneinfo)
    r = P.prefetch(params([f.parent]), check_mode=True, proc=proc)
    assert "would read 8.0 MiB (headroom now 2.0 MiB: 2.0 MiB of it fits)" in r["msg"]


def test_an_unreadable_file_is_skipped_and_the_others_are_read(tmp_path, monkeypatch):
    d = tmp_path / "m"
    a, b = cold_file(d / "a.safetensors", MIB), cold_file(d / "b.safetensors", MIB)
    real_open = P._open

    def no_access(path):
        if path == str(a):
            raise PermissionError(13, "Permission denied", path)
        return real_open(path)
    monkeypatch.setattr(P, "_open", no_access)
    r = P.prefetch(params([d]))
    assert [f["skipped"] for f in r["files"]] == ["cannot open: Permission denied", None]
    assert r["read_bytes"] == MIB and resident(b) == MIB
    assert "1 file skipped (%s: cannot open: Permission denied)" % a in r["msg"]


def test_mincore_is_trusted_only_for_files_we_own_or_may_write_or_as_root(tmp_path):
    f = write(tmp_path / "x", 10)
    entry = {"path": str(f), "_uid": 4242}
    assert P.mincore_shows_cache(entry, euid=0)
    assert P.mincore_shows_cache(entry, euid=4242)
    os.chmod(str(f), 0o444)
    if os.geteuid() != 0:  # root may write anything; os.access says so
        assert not P.mincore_shows_cache(entry, euid=os.geteuid())


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and util-linux setpriv")
def test_for_a_user_who_may_not_write_the_file_mincore_lies_and_the_prefetch_does_not_trust_it():
    # Under /var/tmp: pytest's tmp_path (mode 0700) is closed to nobody.
    d = tempfile.mkdtemp(prefix="gpufleet-prefetch-", dir="/var/tmp")
    try:
        os.chmod(d, 0o755)
        f = cold_file(pathlib.Path(d) / "model.safetensors", 4 * MIB)
        os.chmod(str(f), 0o644)
        script = ("import json, os, sys\n"
                  "from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_prefetch as P\n"
                  "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
                  "with P.FileMap(fd, os.fstat(fd).st_size) as m: said = m.resident()\n"
                  "p = dict(paths=[os.path.dirname(sys.argv[1])], reserve_mib=0, rate_mib_s=0, network_fs=False,"
                  " timeout_s=60.0, slice_s=60.0, started_at=None, resident_at_start_bytes=None, read_before_bytes=0)\n"
                  "print(json.dumps([said, P.prefetch(p)]))\n")
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "collections"))
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c"]
        probe = subprocess.run(nobody + ["import ansible_collections.gpufleet.fleet"], capture_output=True, env=env)
        if probe.returncode != 0:  # e.g. a pyenv interpreter under root's 0700 home (CI's ansible-core 2.21 venv)
            pytest.skip("nobody cannot run %s here (rc %d)" % (sys.executable, probe.returncode))
        out = subprocess.run(nobody + [script, str(f)], capture_output=True, text=True, env=env, check=True).stdout
        said, r = json.loads(out)
        assert said == 4 * MIB  # a cold file, all "resident" to nobody (Linux >= 5.0)
        assert r["files"][0]["resident_before_bytes"] is None and r["read_bytes"] == 4 * MIB
        assert resident(f) == 4 * MIB and "residency of 1 file unknown" in r["msg"]
    finally:
        shutil.rmtree(d)


def test_files_of_unknown_residency_are_read_in_full_and_said(tmp_path, monkeypatch):
    f = cold_file(tmp_path / "m" / "model.safetensors", 2 * MIB)
    monkeypatch.setattr(P, "mincore_shows_cache", lambda entry, euid=None: False)
    r = P.prefetch(params([f.parent]), chunk_bytes=MIB)
    assert r["files"][0]["resident_before_bytes"] is None and r["files"][0]["resident_after_bytes"] is None
    assert r["read_bytes"] == 2 * MIB and resident(f) == 2 * MIB
    assert "residency of 1 file unknown" in r["msg"] and "run with become" in r["msg"]


# --- Rate, slices, timeout -----------------------------------------------------------------------------------------

def test_pacer_sleeps_until_the_bytes_read_fit_the_rate():
    clock = Clock()
    pacer = P.Pacer(4 * MIB, clock.now, clock.sleep)
    pacer.pace(2 * MIB, clock.now())
    assert clock.slept == [0.5]
    start = clock.now()
    clock.t += 0.2  # the read itself took 0.2 s: only the rest is slept
    pacer.pace(2 * MIB, start)
    assert clock.slept == [0.5, pytest.approx(0.3)]
    P.Pacer(0, clock.now, clock.sleep).pace(100 * MIB, clock.now())
    assert len(clock.slept) == 2  # 0: no bound


def test_chunks_shrink_to_half_a_second_of_the_rate_in_whole_pages():
    assert P.chunk_length(16 * MIB, 0) == 16 * MIB
    assert P.chunk_length(16 * MIB, 2048 * MIB) == 16 * MIB
    assert P.chunk_length(16 * MIB, 10 * MIB) == 5 * MIB
    assert P.chunk_length(16 * MIB, 1000, page_size=4096) == 4096


def test_prefetch_keeps_the_rate(tmp_path):
    f = cold_file(tmp_path / "m" / "model.safetensors", 8 * MIB)
    clock = Clock()
    r = P.prefetch(params([f.parent], rate_mib_s=2), now=clock.now, sleep=clock.sleep)
    assert r["read_bytes"] == 8 * MIB and r["rate_mib_s"] == 2
    assert sum(clock.slept) == pytest.approx(4.0) and len(clock.slept) == 8  # 1 MiB chunks, 0.5 s each
    assert r["progress"] == "read 8.0 MiB of 8.0 MiB cold, 2 MiB/s, 100 % resident, 4 s"


def test_slices_end_with_done_false_and_the_next_goes_on_until_timeout(tmp_path):
    f = cold_file(tmp_path / "m" / "model.safetensors", 8 * MIB)
    clock = Clock()
    first = P.prefetch(params([f.parent], rate_mib_s=1, slice_s=2.0, timeout_s=3.0), now=clock.now, sleep=clock.sleep)
    assert first["done"] is False and first["stopped_by"] is None and first["changed"] is True
    assert first["read_bytes"] == 2 * MIB and first["started_at"] == 1000.0  # four 0.5 MiB chunks in 2 s
    assert first["progress"] == "read 2.0 MiB of 8.0 MiB cold, 1 MiB/s, 25 % resident, 2 s"
    assert "goes on in the next slice (6.0 MiB left cold)" in first["msg"]
    nxt = params([f.parent], rate_mib_s=1, slice_s=2.0, timeout_s=3.0, started_at=first["started_at"],
                 resident_at_start_bytes=first["resident_at_start_bytes"], read_before_bytes=first["total_read_bytes"])
    second = P.prefetch(nxt, now=clock.now, sleep=clock.sleep)
    assert second["done"] is True and second["stopped_by"] == "timeout"
    assert second["read_bytes"] == MIB and second["total_read_bytes"] == 3 * MIB
    assert second["total_elapsed_s"] == 3.0 and second["elapsed_s"] == 1.0
    assert second["msg"].startswith("8.0 MiB in 1 file: 37 % resident (was 0 %), 3.0 MiB read in 3.0 s; "
                                    "stopped at timeout_s (3.0 s): 5.0 MiB left cold")


def test_a_slice_lasts_at_least_a_hundredth_of_the_timeout_so_the_calls_stay_about_a_hundred(tmp_path):
    # The role chains slices by a recursive include_tasks; ansible-core died with a RecursionError a few hundred
    # levels deep, which -e sglang_prefetch_timeout_s=3600 with 10 s slices (both within the guard's ranges) reached
    # on a slow or rate-bound read.
    assert P.slice_length(10, 900) == 10.0  # the defaults: unchanged
    assert P.slice_length(10, 3600) == 36.0 and P.slice_length(0.001, 86400) == 864.0
    f = cold_file(tmp_path / "m" / "model.safetensors", 8 * MIB)
    clock = Clock()
    r = P.prefetch(params([f.parent], rate_mib_s=1, slice_s=0.5, timeout_s=400.0), now=clock.now, sleep=clock.sleep)
    assert r["done"] is False and r["read_bytes"] == 4 * MIB  # 4 s of reading (400 / 100), not 0.5 s


def test_a_call_after_the_timeout_reads_nothing_but_reports(tmp_path):
    f = cold_file(tmp_path / "m" / "model.safetensors", MIB)
    clock = Clock()
    r = P.prefetch(params([f.parent], timeout_s=5.0, started_at=clock.t - 10), now=clock.now, sleep=clock.sleep)
    assert r["stopped_by"] == "timeout" and r["read_bytes"] == 0 and r["done"] is True and r["cold_bytes"] == MIB


def test_nothing_cold_is_done_even_past_the_timeout(tmp_path):
    f = write(tmp_path / "m" / "config.json", text="{}")
    open(str(f)).read()
    clock = Clock()
    r = P.prefetch(params([f.parent], timeout_s=0.0, started_at=clock.t - 10), now=clock.now, sleep=clock.sleep)
    assert r["stopped_by"] is None and r["done"] is True and r["resident_pct"] == 100.0


@pytest.mark.parametrize("key, value, text", [
    ("reserve_mib", -1, "reserve_mib must be 0 or more (got -1)"),
    ("rate_mib_s", -5, "rate_mib_s must be 0 or more (got -5)"),
    ("timeout_s", -1.0, "timeout_s must be 0 or more (got -1.0)"),
    ("slice_s", 0.0, "slice_s must be more than 0 (got 0.0)")])
def test_bad_options_are_named(key, value, text):
    assert P.bad_option(params([], **{key: value})).startswith(text)
    assert P.bad_option(params([])) is None
