"""tests/gpu/prefetch_h200.py: what counts as a sample, the ratios, the summary rows, residency without fincore."""
import json
import os
import shutil
import subprocess
import sys

import pytest

GPU = os.path.join(os.path.dirname(__file__), "..", "gpu")
sys.path.insert(0, GPU)
import prefetch_h200 as ph  # noqa: E402
import weights  # noqa: E402  (tests/lab, on the path through prefetch_h200)


def _sample(mode, pair, downtime, load, rc=0, result="ok", left=0.0, began=0.0, maps=0, **kw):
    rec = {"run": "%s%d" % (mode, pair), "mode": mode, "pair": pair, "rc": rc, "result": result,
           "downtime_s": downtime, "weights_load_s": load, "weights_bytes": 8 << 30,
           "resident_pct_after_evict": left, "weights_resident_before_pct": began, "weights_file_maps": maps,
           "start_to_ready_s": downtime - 1.0, "prefetch_s": None, "prefetch_gib": None, "resident_pct": None}
    rec.update(kw)
    return rec


def _report(tmp_path, samples):
    with open(tmp_path / "samples.jsonl", "w") as fh:
        for rec in samples:
            fh.write(json.dumps(rec) + "\n")
    return ph.report(str(tmp_path))


def test_ratio_is_median_over_median_of_the_runs_that_count(tmp_path):
    res = _report(tmp_path, [
        _sample("first", 0, 30.0, 20.0),
        _sample("cold", 1, 20.0, 10.0), _sample("prefetched", 1, 12.0, 2.0, prefetch_s=9.0, prefetch_gib=8.0),
        _sample("cold", 2, 22.0, 12.0), _sample("prefetched", 2, 11.0, 1.0),
        _sample("cold", 3, 30.0, 16.0), _sample("prefetched", 3, 13.0, 3.0),
    ])
    assert res[ph.RATIO_KEY] == round(12.0 / 22.0, 3)
    assert res["downtime_ratio_pairs"] == [0.6, 0.5, round(13.0 / 30.0, 3)]
    assert res["weights_load_ratio"] == round(2.0 / 12.0, 3)
    assert res["cold_read_gib_s"]["samples"] == [0.8, 0.67, 0.5] and res["cold_read_gib_s"]["median"] == 0.67
    assert res["counted"] == {"cold": 3, "prefetched": 3} and res["left_out"] == []
    assert res["prefetch_s"] == [9.0, None, None]
    with open(tmp_path / "prefetch_h200.json") as fh:
        assert json.load(fh)[ph.RATIO_KEY] == res[ph.RATIO_KEY]
    assert ph.RATIO_KEY + " = 0.545" in ph.summary_text(res)


def test_runs_that_were_not_cold_failed_or_kept_the_shards_mapped_do_not_count(tmp_path):
    res = _report(tmp_path, [
        _sample("cold", 1, 20.0, 10.0),
        _sample("cold", 2, 5.0, 0.5, left=35.0),            # the evict left the files in the page cache
        _sample("cold", 3, 5.0, 0.5, began=60.0),           # warm by the time the stand-in began to read
        _sample("prefetched", 1, 10.0, 1.0),
        _sample("prefetched", 2, 99.0, 1.0, rc=2, result="rolled_back"),
        _sample("prefetched", 3, 1.0, 1.0, maps=4),         # a server that maps its shards: DONTNEED cannot empty them
    ])
    assert res["counted"] == {"cold": 1, "prefetched": 1}
    assert res[ph.RATIO_KEY] == 0.5 and res["downtime_ratio_pairs"] == [0.5]
    assert len(res["left_out"]) == 4
    assert any("pair 2 cold: not cold: 35.0 %" in x for x in res["left_out"])
    assert any("pair 2 prefetched: restart.yml rc 2, result rolled_back" in x for x in res["left_out"])
    assert any("kept 4 mapping(s)" in x for x in res["left_out"])


def test_no_ratio_without_a_counted_run_of_each_mode(tmp_path):
    res = _report(tmp_path, [_sample("cold", 1, 20.0, 10.0, left=50.0), _sample("prefetched", 1, 10.0, 1.0)])
    assert res[ph.RATIO_KEY] is None and res["counted"] == {"cold": 0, "prefetched": 1}
    assert ph.main(["report", str(tmp_path)]) == 1


def test_summary_row_is_the_named_runs_from_its_set_stats(tmp_path):
    path = tmp_path / "stats.jsonl"
    lines = [{"run": "cold1", "custom_stats": {"_run": {"gpufleet_restart": {"localhost": {"downtime_s": 9.1}}}}},
             {"run": "prefetched1", "custom_stats": {"_run": {"gpufleet_restart": {"localhost": {"downtime_s": 4.2,
                                                                                             "prefetch_gib": 8.0}}}}},
             {"run": "cold2", "custom_stats": {}}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert ph.summary_row(str(path), "prefetched1") == {"downtime_s": 4.2, "prefetch_gib": 8.0}
    assert ph.summary_row(str(path), "cold1")["downtime_s"] == 9.1
    assert ph.summary_row(str(path), "cold2") is None
    assert ph.summary_row(str(tmp_path / "missing.jsonl"), "cold1") is None


def test_memory_is_touched_only_when_the_prefetch_headroom_is_short(monkeypatch):
    readings = [{"prefetch_headroom_gib": 10.0}, {"prefetch_headroom_gib": 30.0}]
    touched = []
    monkeypatch.setattr(ph, "memory", lambda: readings.pop(0))
    monkeypatch.setattr(ph, "touch_anonymous", touched.append)
    got = ph.mem_check(24, grow=True)
    assert touched == [int(16.0 * ph.GIB)]  # 14 GiB short, plus 2
    assert got["enough"] and got["grown_gib"] == 16.0 and got["after"]["prefetch_headroom_gib"] == 30.0

    monkeypatch.setattr(ph, "memory", lambda: {"prefetch_headroom_gib": 10.0})
    got = ph.mem_check(24, grow=False)
    assert not got["enough"] and got["grown_gib"] == 0 and len(touched) == 1
    got = ph.mem_check(8, grow=True)
    assert got["enough"] and len(touched) == 1


def _page_cache_testable(path):
    if not shutil.which(weights.FINCORE):
        pytest.skip("util-linux fincore is not installed")
    fs = subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True).stdout.strip()
    if fs in ("tmpfs", "ramfs"):
        pytest.skip("%s is on %s: its pages cannot leave the page cache" % (path, fs))


def test_residency_without_fincore_is_mincore_and_agrees_with_it(tmp_path, monkeypatch):
    d = str(tmp_path / "m")
    os.mkdir(d)
    weights.write_checkpoint(d, 2, shards=2)
    _page_cache_testable(d)
    with open(weights.weight_files(d)[0], "rb") as fh:
        fh.read()
    method, by_fincore = ph.residency([d])
    assert method == "fincore"
    monkeypatch.setattr(weights, "FINCORE", "no-such-fincore-here")
    method, by_mincore = ph.residency([d])
    assert method == "mincore" and sorted(by_mincore) == sorted(by_fincore)
    for f, (res, size) in by_mincore.items():  # fincore counts the file's last page whole, mincore to its size
        assert size == by_fincore[f][1] and abs(res - by_fincore[f][0]) < 4096, f
    shard = weights.weight_files(d)[0]
    assert by_mincore[shard][0] == by_mincore[shard][1] == os.path.getsize(shard)
    assert by_mincore[weights.weight_files(d)[1]][0] == 0


def test_dontneed_check_reads_a_shard_whole_and_sees_it_leave(tmp_path):
    d = str(tmp_path / "m")
    os.mkdir(d)
    weights.write_checkpoint(d, 4, shards=2)
    _page_cache_testable(d)
    got = ph.dontneed_check(d)
    assert got["ok"] and got["resident_pct_after_read"] >= 99.0 and got["resident_pct_after_dontneed"] <= 1.0
    assert got["file"] == weights.weight_files(d)[0] and got["read_s"] > 0
    cold = ph.cold(d)
    assert cold["cold"] and cold["files"] == 4  # the two shards, the index and the marker
