"""plugins/plugin_utils/prefetch.py: the prefetch's inputs and what the summary says of it."""
from ansible_collections.gpufleet.fleet.plugins.plugin_utils import prefetch

GIB = 1 << 30


def test_preflights_resolved_paths_win_over_the_launch_args_and_repeat_once():
    args = {"model-path": "/models/a", "tokenizer-path": "/models/tok"}
    # preflight resolved an abbreviation (--model /models/b) the exact-name fallback would miss
    assert prefetch.paths(["/models/b", "/models/d", "/models/b"], args) == ["/models/b", "/models/d"]
    assert prefetch.paths([], args) == []  # preflight saw no path flags: nothing, not a guess


def test_without_preflight_the_path_flags_of_the_launch_args_are_read():
    args = {"model-path": "/m/target", "speculative-draft-model-path": "/m/draft", "tp-size": 8,
            "tokenizer-path": "/m/target", "trust-remote-code": True, "model": "/ignored/no-exact-name"}
    assert prefetch.paths(None, args) == ["/m/target", "/m/draft"]
    assert prefetch.paths(None, {"model-path": "org/name"}) == ["org/name"]  # a hub id: the module says skipped
    assert prefetch.paths(None, None) == []


def test_a_load_format_that_reads_no_local_checkpoint_prefetches_nothing():
    for fmt in ("dummy", "remote", "remote_instance", "Remote-Instance"):
        assert prefetch.paths(["/models/a"], {"model-path": "/models/a", "load-format": fmt}) == []
    assert prefetch.paths(["/models/a"], {"model-path": "/models/a", "load-format": "safetensors"}) == ["/models/a"]


def result(**kw):
    base = {"total_bytes": 10 * GIB, "resident_before_bytes": 2 * GIB, "resident_after_bytes": 10 * GIB,
            "cold_bytes": 0, "resident_pct": 100.0, "total_elapsed_s": 4.26, "stopped_by": None, "skipped_paths": [],
            "files": [], "done": True}
    base.update(kw)
    return base


def test_prefetched_is_what_became_resident_from_the_first_call_to_the_last():
    first = result(resident_after_bytes=5 * GIB, resident_pct=50.0, total_elapsed_s=10.0, done=False)
    last = result(resident_before_bytes=5 * GIB)
    out = prefetch.outcome(first, last)
    assert out == {"prefetch_gib": 8.0, "prefetch_s": 4.3, "resident_pct": 100.0, "prefetch_note": None}
    assert prefetch.cell(out) == "8.0G/4.3s/100%"
    # one call was enough: last defaults to first; all resident before: 0 GiB, not negative
    assert prefetch.outcome(result(resident_before_bytes=10 * GIB))["prefetch_gib"] == 0.0


def test_what_the_prefetch_read_from_storage_is_the_figure_when_the_module_counts_it():
    first = result(resident_after_bytes=5 * GIB, resident_pct=50.0, done=False, total_read_bytes=3 * GIB)
    last = result(resident_before_bytes=5 * GIB, total_read_bytes=int(7.5 * GIB))
    assert prefetch.outcome(first, last)["prefetch_gib"] == 7.5


def test_the_memory_bound_and_the_timeout_say_how_much_was_left_cold():
    bound = {"mem_free_bytes": 9 * GIB, "watermark_bytes": GIB // 4, "reserve_bytes": 4 * GIB}
    out = prefetch.outcome(result(resident_after_bytes=6 * GIB, cold_bytes=4 * GIB, resident_pct=60.0,
                                  stopped_by="memory", bound=bound))
    assert out["prefetch_gib"] == 4.0 and out["resident_pct"] == 60.0
    assert out["prefetch_note"] == ("prefetch stopped at the memory bound (it never makes the kernel reclaim): "
                                    "4.0 GiB left cold (MemFree 9.0 GiB less watermarks 0.2 GiB and reserve 4.0 GiB)")
    out = prefetch.outcome(result(cold_bytes=3 * GIB, stopped_by="timeout", total_elapsed_s=900.04))
    assert out["prefetch_note"] == "prefetch stopped at sglang_prefetch_timeout_s after 900.0 s: 3.0 GiB left cold"


def test_skipped_paths_and_files_are_named_and_a_long_list_is_cut():
    skipped = [{"path": "/nfs/m%d" % i, "reason": "on nfs4 (network filesystem)"} for i in range(5)]
    files = [{"path": "/m/x.safetensors", "skipped": "permission denied"}]
    note = prefetch.outcome(result(skipped_paths=skipped, files=files))["prefetch_note"]
    assert note.startswith("prefetch skipped /nfs/m0 (on nfs4 (network filesystem)); prefetch skipped /nfs/m1")
    assert note.endswith("; and 2 more") and "/m/x.safetensors" not in note


def test_a_failed_prefetch_is_a_note_and_no_figures_and_check_mode_reads_nothing():
    out = prefetch.outcome({"failed": True, "msg": "OSError:\n  [Errno 5] Input/output error"})
    assert out["prefetch_gib"] is None and out["prefetch_s"] is None
    assert out["prefetch_note"] == ("prefetch failed, so the launch read its weights cold: OSError: [Errno 5] "
                                    "Input/output error")
    # registered with failed_when false: failed reads false, the figures are missing
    assert prefetch.outcome(result(), {"failed": False, "failed_when_result": False, "msg": "MODULE FAILURE"})[
        "prefetch_note"] == "prefetch failed, so the launch read its weights cold: MODULE FAILURE"
    assert prefetch.outcome({"skipped": True, "skip_reason": "Conditional result was False"}) == dict.fromkeys(
        ("prefetch_gib", "prefetch_s", "resident_pct", "prefetch_note"))
    checked = prefetch.outcome(result(resident_after_bytes=2 * GIB, resident_pct=20.0), check_mode=True)
    assert checked["prefetch_gib"] is None and checked["prefetch_s"] is None and checked["resident_pct"] == 20.0
    assert prefetch.cell(checked) == "-/-/20%"
    assert prefetch.cell({}) == "-"
    # an empty model dir set (nothing to read): no share to speak of
    assert prefetch.outcome(result(total_bytes=0, resident_before_bytes=0, resident_after_bytes=0,
                                   resident_pct=None))["resident_pct"] is None


def test_unknown_residency_gives_no_share_and_says_how_to_measure_it():
    files = [{"path": "/m/a.safetensors", "skipped": None, "resident_after_bytes": None, "size_bytes": GIB},
             {"path": "/m/config.json", "skipped": None, "resident_after_bytes": 100, "size_bytes": 100}]
    out = prefetch.outcome(result(files=files, total_read_bytes=GIB))
    assert out["resident_pct"] is None and out["prefetch_gib"] == 1.0
    assert out["prefetch_note"] == ("residency of 1 file(s) unknown (mincore tells the page cache only to a file's "
                                    "owner or writer; they were read whole): set sglang_prefetch_become=true to "
                                    "measure it")
    assert prefetch.cell(out) == "1.0G/4.3s/-"


def test_reading_more_than_was_cold_says_pages_left_the_cache_meanwhile():
    # The lab VM's kdamond (DAMON pageout) dropped pages the prefetch had read: the row said 0.4G read of a 0.375 GiB
    # checkpoint and 99 % resident, with no word why.
    MIB = 1 << 20
    last = result(total_bytes=384 * MIB, resident_at_start_bytes=0, total_read_bytes=405 * MIB,
                  resident_after_bytes=383 * MIB, resident_pct=99.7)
    note = prefetch.outcome(last)["prefetch_note"]
    assert note == ("prefetch read 21 MiB again: pages it had read left the page cache before it ended (proactive "
                    "reclaim such as DAMON pageout or a memory.reclaim agent, or another process dropping them)")
    # read no more than was cold (or within a chunk of it): nothing to say
    assert prefetch.outcome(result(total_bytes=384 * MIB, resident_at_start_bytes=0,
                                   total_read_bytes=390 * MIB))["prefetch_note"] is None
