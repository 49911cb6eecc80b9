"""Lab weight files (tests/lab/weights.py), lab.py weights/evict/resident, and the stand-in's load_weights."""
import json
import mmap
import os
import shutil
import struct
import subprocess
import sys

import pytest

LAB = os.path.join(os.path.dirname(__file__), "..", "lab")
sys.path.insert(0, LAB)
sys.path.insert(0, os.path.join(LAB, "standin"))
import lab as labtool  # noqa: E402
import sglang_standin  # noqa: E402
import weights  # noqa: E402

MiB = 1 << 20


def _model_dir(tmp_path, name="m"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    return str(d)


def _page_cache_testable(path):
    """fincore is installed and ``path`` is on a filesystem whose page cache can be emptied (not tmpfs, whose
    pages are the files themselves)."""
    if not shutil.which(weights.FINCORE):
        pytest.skip("util-linux fincore is not installed (apt-get install util-linux-extra)")
    fs = subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True).stdout.strip()
    if fs in ("tmpfs", "ramfs"):
        pytest.skip("%s is on %s: its pages cannot leave the page cache" % (path, fs))


def test_checkpoint_has_the_shards_index_and_exact_size_asked_for(tmp_path):
    d = _model_dir(tmp_path)
    got = weights.write_checkpoint(d, 3, shards=2)
    names = sorted(os.listdir(d))
    assert names == [".gpufleet-lab-weights.json", "config.json", "model-00001-of-00002.safetensors",
                     "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    assert got["changed"] and got["tensor_bytes"] == 3 * MiB
    assert got["file_bytes"] == sum(os.path.getsize(f) for f in weights.weight_files(d))
    with open(os.path.join(d, weights.INDEX_NAME)) as fh:
        index = json.load(fh)
    assert index["metadata"]["total_size"] == 3 * MiB
    seen, dtypes = {}, set()
    for path in weights.weight_files(d):
        tensors, metadata, _ = weights.read_header(path)
        assert 1 < len(tensors) <= weights.TENSORS_PER_SHARD and metadata["format"] == "pt"
        for name, entry in tensors.items():
            seen[name] = os.path.basename(path)
            dtypes.add(entry["dtype"])
    assert index["weight_map"] == seen
    assert dtypes == {"BF16", "F16"}


def test_header_is_a_length_prefixed_json_padded_to_eight_bytes_then_random_data(tmp_path):
    """Read without weights.read_header, byte by byte as the format's description says."""
    d = _model_dir(tmp_path)
    weights.write_checkpoint(d, 1, shards=1)
    with open(weights.weight_files(d)[0], "rb") as fh:
        raw = fh.read()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    assert (8 + length) % 8 == 0
    assert all(isinstance(v, str) for v in header.pop("__metadata__").values())
    spans = sorted(tuple(e["data_offsets"]) for e in header.values())
    assert spans[0][0] == 0 and spans[-1][1] == len(raw) - 8 - length
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    for e in header.values():
        assert e["data_offsets"][1] - e["data_offsets"][0] == e["shape"][0] * e["shape"][1] * 2
    data = raw[8 + length:]
    assert len(set(data[:65536])) == 256 and data[:4096] != data[4096:8192]  # random, not a repeated block


def test_the_safetensors_library_reads_every_shard_as_the_lab_reader_does(tmp_path):
    safetensors = pytest.importorskip("safetensors")
    d = _model_dir(tmp_path)
    weights.write_checkpoint(d, 2, shards=3)
    for path in weights.weight_files(d):
        tensors, _, start = weights.read_header(path)
        with open(path, "rb") as fh:
            raw = fh.read()
        got = dict(safetensors.deserialize(raw))  # validates offsets, sizes and dtypes as safe_open does
        assert sorted(got) == sorted(tensors)
        for name, entry in tensors.items():
            begin, end = entry["data_offsets"]
            assert (got[name]["dtype"], list(got[name]["shape"])) == (entry["dtype"], entry["shape"])
            assert bytes(got[name]["data"]) == raw[start + begin:start + end]


def test_read_header_refuses_what_is_not_a_checkpoint(tmp_path):
    def file_with(header, data_len):
        text = json.dumps(header).encode()
        path = tmp_path / "bad.safetensors"
        path.write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * data_len)
        return str(path)

    cases = [
        ({"a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}, 6, "file at"),
        ({"a": {"dtype": "BF16", "shape": [2], "data_offsets": [2, 6]}}, 6, "back to back"),
        ({"a": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 4]}}, 4, "expected [0, 6]"),
        ({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 4]}}, 4, "needs dtype"),
    ]
    for header, data_len, words in cases:
        with pytest.raises(weights.WeightsError) as err:
            weights.read_header(file_with(header, data_len))
        assert words in str(err.value), str(err.value)
    short = tmp_path / "short.safetensors"
    short.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(weights.WeightsError, match="does not fit"):
        weights.read_header(str(short))


def test_the_same_request_keeps_the_files_and_another_rewrites_them(tmp_path):
    d = _model_dir(tmp_path)
    weights.write_checkpoint(d, 2, shards=2)
    first = {f: os.stat(f).st_ino for f in weights.weight_files(d)}
    again = weights.write_checkpoint(d, 2, shards=2)
    assert not again["changed"] and {f: os.stat(f).st_ino for f in weights.weight_files(d)} == first
    # a shard cut short (an interrupted copy) is noticed by its size
    with open(weights.weight_files(d)[1], "r+b") as fh:
        fh.truncate(100)
    assert weights.write_checkpoint(d, 2, shards=2)["changed"]
    assert all(weights.read_header(f) for f in weights.weight_files(d))
    regrown = weights.write_checkpoint(d, 2, shards=3)
    assert regrown["changed"] and [os.path.basename(f) for f in weights.weight_files(d)] == [
        "model-0000%d-of-00003.safetensors" % i for i in (1, 2, 3)]


def test_size_zero_removes_the_checkpoint_and_leaves_config_json(tmp_path):
    d = _model_dir(tmp_path)
    weights.write_checkpoint(d, 1, shards=2)
    assert weights.write_checkpoint(d, 0)["changed"]
    assert os.listdir(d) == ["config.json"]
    assert not weights.write_checkpoint(d, 0)["changed"]


def test_plan_refuses_more_shards_than_the_size_has_rows():
    assert sum(len(s) for s in weights.plan(1, 128)) == 128  # one 8 KiB row per shard
    with pytest.raises(weights.WeightsError, match="cannot fill 129 shards"):
        weights.plan(1, 129)
    with pytest.raises(weights.WeightsError, match="at least 1"):
        weights.plan(1, 0)


def test_a_new_checkpoint_starts_cold_and_evict_drops_one_that_was_read(tmp_path):
    d = _model_dir(tmp_path)
    _page_cache_testable(d)
    weights.write_checkpoint(d, 16, shards=2)
    files = weights.weight_files(d)
    size = sum(os.path.getsize(f) for f in files)
    assert sum(weights.resident_bytes(f) for f in files) <= 2 * mmap.PAGESIZE
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(MiB):
                pass
    assert sum(weights.resident_bytes(f) for f in files) >= 0.99 * size
    evicted = weights.evict([d])
    assert sorted(evicted) == sorted(weights.model_files(d))
    assert sum(weights.resident_bytes(f) for f in files) <= 0.01 * size


def test_evict_leaves_the_pages_a_process_maps(tmp_path):
    """posix_fadvise(DONTNEED) skips mapped pages: a serving loader keeps its weights through an eviction."""
    d = _model_dir(tmp_path)
    _page_cache_testable(d)
    weights.write_checkpoint(d, 8, shards=1)
    path = weights.weight_files(d)[0]
    with open(path, "rb") as fh:
        m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        for off in range(0, len(m), mmap.PAGESIZE):
            m[off]
        weights.evict([d])
        assert weights.resident_bytes(path) >= 0.99 * len(m)
    finally:
        m.close()
    weights.evict([d])
    assert weights.resident_bytes(path) <= 0.01 * os.path.getsize(path)


def _rss_of_mappings(path):
    """kB of Rss over this process's mappings of ``path`` (/proc/self/smaps)."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:
                inside = line.rstrip("\n").endswith(path)
            elif inside and head and head[0] == "Rss:":
                rss += int(head[1])
    return rss


def test_standin_load_weights_reads_every_shard_and_keeps_it_mapped(tmp_path):
    target, draft = _model_dir(tmp_path, "target"), _model_dir(tmp_path, "draft")
    weights.write_checkpoint(target, 4, shards=2)
    weights.write_checkpoint(draft, 1, shards=1)
    got = sglang_standin.load_weights([target, draft])
    try:
        files = weights.weight_files(target) + weights.weight_files(draft)
        assert got["files"] == files
        assert got["reader"] == ("safetensors+mmap" if sglang_standin._safetensors_open() else "mmap")
        assert got["bytes"] == sum(os.path.getsize(f) for f in files)
        assert got["seconds"] > 0
        for f in files:  # every page of every shard is in this process's page tables
            assert _rss_of_mappings(f) * 1024 >= os.path.getsize(f) - mmap.PAGESIZE, f
    finally:
        for m in got["maps"]:
            m.close()


def test_standin_load_weights_skips_model_dirs_without_shards(tmp_path):
    assert sglang_standin.load_weights([_model_dir(tmp_path), str(tmp_path / "missing")]) is None


def test_standin_load_weights_refuses_a_broken_shard(tmp_path):
    d = _model_dir(tmp_path)
    weights.write_checkpoint(d, 1, shards=1)
    with open(weights.weight_files(d)[0], "r+b") as fh:
        fh.truncate(4096)
    with pytest.raises(weights.WeightsError, match="tensors end at byte"):
        sglang_standin.load_weights([d])


def test_checkpoint_written_by_several_processes_is_the_one_a_single_process_writes(tmp_path):
    one, many = _model_dir(tmp_path, "one"), _model_dir(tmp_path, "many")
    weights.write_checkpoint(one, 3, shards=3)
    got = weights.write_checkpoint(many, 3, shards=3, jobs=3)
    assert got["changed"] and [os.path.basename(f) for f in got["files"]] == [
        os.path.basename(f) for f in weights.weight_files(one)]
    for a, b in zip(weights.weight_files(one), weights.weight_files(many)):
        assert weights.read_header(a)[0] == weights.read_header(b)[0]  # same tensors, shapes, offsets
        assert os.path.getsize(a) == os.path.getsize(b)
    with open(weights.weight_files(many)[0], "rb") as x, open(weights.weight_files(many)[1], "rb") as y:
        assert x.read()[-4096:] != y.read()[-4096:]  # each process drew its own random bytes
    for name in (weights.INDEX_NAME, weights.MARKER_NAME):
        with open(os.path.join(one, name)) as x, open(os.path.join(many, name)) as y:
            assert json.load(x) == json.load(y)
    assert not weights.write_checkpoint(many, 3, shards=3, jobs=2)["changed"]  # the marker holds: kept


# -- the stand-in's weights on a device (GPUFLEET_STANDIN_WEIGHTS_DEVICE) ------------------------------------------
def test_weights_device_knob_is_off_unless_set_and_names_a_device():
    env = sglang_standin.WEIGHTS_DEVICE_ENV
    assert sglang_standin.weights_device({}) is None
    assert sglang_standin.weights_device({env: " "}) is None
    for value in ("cpu", "cuda", "cuda:0", "cuda:7"):
        assert sglang_standin.weights_device({env: value}) == value
    assert sglang_standin.weights_device({env: " cuda:1\n"}) == "cuda:1"
    for value in ("gpu", "cuda:", "cuda:x", "cuda0", "cpu:0", "mps"):
        with pytest.raises(sglang_standin.WeightsDeviceError) as err:
            sglang_standin.weights_device({env: value})
        assert env in str(err.value) and "cpu, cuda or cuda:N" in str(err.value)


def _server(model_dir):
    import argparse
    args = argparse.Namespace(model_path=model_dir, speculative_draft_model_path=None, host="127.0.0.1",
                              port=30000, tp_size=1)
    return sglang_standin.Server(args, [], None, "0.5.23")


def test_without_the_device_knob_the_server_keeps_its_shards_mapped(tmp_path, monkeypatch):
    monkeypatch.delenv(sglang_standin.WEIGHTS_DEVICE_ENV, raising=False)
    d = _model_dir(tmp_path)
    weights.write_checkpoint(d, 2, shards=2)
    server = _server(d)
    server.load_weights()
    try:
        files = weights.weight_files(d)
        assert len(server.weights["maps"]) == 2 and "device" not in server.weights
        assert sglang_standin.shard_mappings(files) == 2
        info = server.server_info()
        assert info["weights_bytes"] == sum(os.path.getsize(f) for f in files)
        assert not [k for k in info if k.startswith("weights_device") or k == "weights_file_maps"]
    finally:
        for m in server.weights["maps"]:
            m.close()
    assert sglang_standin.shard_mappings(files) == 0


def test_a_bad_device_knob_fails_the_start_saying_what_to_give(tmp_path, monkeypatch, capsys):
    d = _model_dir(tmp_path)
    weights.write_checkpoint(d, 1, shards=1)
    monkeypatch.setenv(sglang_standin.WEIGHTS_DEVICE_ENV, "gpu0")
    server = _server(d)

    def exit_(rc):
        raise SystemExit(rc)
    monkeypatch.setattr(server, "kill_tree_and_exit", exit_)
    with pytest.raises(SystemExit) as ended:
        server.load_weights()
    assert ended.value.code == 1
    assert "GPUFLEET_STANDIN_WEIGHTS_DEVICE=gpu0 is not a device" in capsys.readouterr().err


def test_the_device_knob_without_torch_fails_the_load_naming_what_is_missing(tmp_path, monkeypatch):
    d = _model_dir(tmp_path)
    weights.write_checkpoint(d, 1, shards=1)
    monkeypatch.setattr(sglang_standin, "_safetensors_open", lambda: None)
    with pytest.raises(sglang_standin.WeightsDeviceError, match="needs safetensors and torch"):
        sglang_standin.load_weights([d], device="cpu")


def test_shard_mappings_counts_this_process_maps_of_the_files(tmp_path):
    d = _model_dir(tmp_path)
    weights.write_checkpoint(d, 2, shards=2)
    files = weights.weight_files(d)
    assert sglang_standin.shard_mappings(files) == 0
    with open(files[1], "rb") as fh:
        m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        assert sglang_standin.shard_mappings(files) == 1
        assert sglang_standin.shard_mappings(files[:1]) == 0
    finally:
        m.close()


def test_weights_on_the_cpu_are_copies_and_the_files_can_leave_the_page_cache(tmp_path):
    """The real path (safetensors + torch), on the CPU: every tensor's bytes are the file's, the server maps no
    shard afterwards, and DONTNEED then empties the files while the tensors live (prefetch_h200.sh's premise)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    d = _model_dir(tmp_path)
    weights.write_checkpoint(d, 4, shards=2)
    got = sglang_standin.load_weights([d], device="cpu")
    files = weights.weight_files(d)
    assert got["reader"] == "safetensors->cpu" and got["device"] == "cpu" and got["maps"] == []
    assert got["file_maps"] == 0 and sglang_standin.shard_mappings(files) == 0
    assert got["bytes"] == sum(os.path.getsize(f) for f in files) and got["seconds"] > 0
    expect = []
    for path in files:
        header, _, start = weights.read_header(path)
        with open(path, "rb") as fh:
            raw = fh.read()
        expect += [raw[start + e["data_offsets"][0]:start + e["data_offsets"][1]] for e in header.values()]
    assert all(t.device.type == "cpu" for t in got["tensors"])
    # random bytes: each tensor's are unique, so comparing the sorted lists matches every tensor to its own
    assert sorted(t.contiguous().view(torch.uint8).numpy().tobytes() for t in got["tensors"]) == sorted(expect)
    _page_cache_testable(d)
    weights.evict([d])
    assert sum(weights.resident_bytes(f) for f in files) <= 0.01 * got["bytes"]
    assert got["tensors"][0].sum() is not None  # still there, and readable


# -- lab.py weights / evict / resident against a lab state file (no namespaces needed) ------------------
def _fake_lab(tmp_path):
    lab_dir = tmp_path / "lab"
    hosts = []
    for i in (1, 2):
        hdir = lab_dir / "hosts" / ("gpu-lab-%02d" % i)
        for model in (labtool.TARGET_MODEL, labtool.DRAFT_MODEL):
            (hdir / "models" / model).mkdir(parents=True)
            (hdir / "models" / model / "config.json").write_text("{}")
        hosts.append({"name": "gpu-lab-%02d" % i, "dir": str(hdir)})
    (lab_dir / "lab.json").write_text(json.dumps({"hosts": hosts}))
    return str(lab_dir), hosts


def test_lab_weights_writes_only_the_hosts_and_model_named(tmp_path, capsys):
    lab_dir, hosts = _fake_lab(tmp_path)
    assert labtool.main(["weights", "--lab-dir", lab_dir, "--host", "2", "--size-mib", "2", "--model", "draft",
                         "--shards", "2"]) == 0
    assert "gpu-lab-02 %s: 2 MiB in 2 shard(s) written, cold" % labtool.DRAFT_MODEL in capsys.readouterr().out
    dirs = {h["name"]: labtool.model_dirs(h) for h in hosts}
    assert len(weights.weight_files(dirs["gpu-lab-02"][labtool.DRAFT_MODEL])) == 2
    assert not weights.weight_files(dirs["gpu-lab-02"][labtool.TARGET_MODEL])
    assert not weights.weight_files(dirs["gpu-lab-01"][labtool.DRAFT_MODEL])
    labtool.main(["weights", "--lab-dir", lab_dir, "--size-mib", "0", "--model", "draft"])
    assert "gpu-lab-02 %s: checkpoint removed" % labtool.DRAFT_MODEL in capsys.readouterr().out
    assert not weights.weight_files(dirs["gpu-lab-02"][labtool.DRAFT_MODEL])


def test_lab_resident_reports_each_model_dir_and_evict_empties_it(tmp_path, capsys):
    lab_dir, hosts = _fake_lab(tmp_path)
    _page_cache_testable(lab_dir)
    labtool.main(["weights", "--lab-dir", lab_dir, "--host", "gpu-lab-01", "--size-mib", "4"])
    target = labtool.model_dirs(hosts[0])[labtool.TARGET_MODEL]
    for f in weights.weight_files(target):
        with open(f, "rb") as fh:
            fh.read()
    capsys.readouterr()
    assert labtool.main(["resident", "--lab-dir", lab_dir, "--host", "gpu-lab-01"]) == 0
    report = json.loads(capsys.readouterr().out)
    entry = report["gpu-lab-01"][labtool.TARGET_MODEL]
    assert list(report) == ["gpu-lab-01"] and entry["path"] == target and entry["weight_files"] == 1
    assert entry["total_bytes"] == sum(os.path.getsize(f) for f in weights.model_files(target))
    assert entry["resident_bytes"] >= 4 * MiB
    assert labtool.main(["evict", "--lab-dir", lab_dir, "--host", "gpu-lab-01"]) == 0
    # target: config.json, the shard, the index, the marker; draft: config.json
    assert "gpu-lab-01: 5 file(s) evicted" in capsys.readouterr().out
    labtool.main(["resident", "--lab-dir", lab_dir])
    after = json.loads(capsys.readouterr().out)
    assert sorted(after) == ["gpu-lab-01", "gpu-lab-02"]
    assert after["gpu-lab-01"][labtool.TARGET_MODEL]["resident_bytes"] <= 0.01 * entry["total_bytes"]


def test_lab_weights_says_what_is_wrong_with_the_size(tmp_path, capsys):
    lab_dir, _ = _fake_lab(tmp_path)
    with pytest.raises(SystemExit):
        labtool.main(["weights", "--lab-dir", lab_dir, "--size-mib", "1", "--shards", "200"])
    assert "1 MiB cannot fill 200 shards" in capsys.readouterr().err


def test_shard_rss_counts_the_resident_pages_of_the_mapped_shards_only(tmp_path):
    model, other = tmp_path / "model", tmp_path / "model-other"
    model.mkdir()
    other.mkdir()
    weights.write_checkpoint(str(model), 8, shards=2)
    weights.write_checkpoint(str(other), 4, shards=1)
    maps = []
    try:
        for path in weights.weight_files(str(model)) + weights.weight_files(str(other)):
            with open(path, "rb") as fh:
                maps.append(mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ))
        with open("/proc/self/smaps") as fh:
            assert weights.shard_rss_bytes(fh.read(), str(model)) == 0  # mapped, nothing touched: cold
        first = maps[0]
        for offset in range(0, len(first), mmap.PAGESIZE):  # touch every page of the first shard
            first[offset]
        with open("/proc/self/smaps") as fh:
            smaps = fh.read()
        assert weights.shard_rss_bytes(smaps, str(model)) == -(-len(first) // mmap.PAGESIZE) * mmap.PAGESIZE
        assert weights.shard_rss_bytes(smaps, str(model) + "/") == weights.shard_rss_bytes(smaps, str(model))
        assert weights.shard_rss_bytes(smaps, str(other)) == 0  # a prefix of another dir's name is not that dir
    finally:
        for m in maps:
            m.close()
