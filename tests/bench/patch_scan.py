"""What searching the whole sglang package for _set_envs_and_config costs (issue 29), against parsing the one file.

    .venv/bin/python tests/bench/patch_scan.py 0.5.23 0.5.10 [--runs 15]

Releases come from tests/support/sglang_wheels.py (PyPI, cached in .cache/). Prints the median and range of
``find_set_envs_files`` (what the patch module does now, in preflight, the patch and check.yml) and of parsing
``srt/entrypoints/engine.py`` alone (what it did before), page cache warm.
"""
import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "collections"), os.path.join(ROOT, "tests")]

from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_sglang  # noqa: E402
from support.sglang_wheels import sglang_package_dir  # noqa: E402


def timed(fn, runs):
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000.0)
    return statistics.median(times), min(times), max(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="+")
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    for version in args.versions:
        pkg = str(sglang_package_dir(version))
        stats = {}
        gpufleet_sglang.find_set_envs_files(pkg, stats=stats)  # warms the page cache
        engine = gpufleet_sglang.find_set_envs_file(pkg)

        def one_file():
            with open(engine, "rb") as handle:
                gpufleet_sglang.defines_function(handle.read(), filename=engine)

        search = timed(lambda: gpufleet_sglang.find_set_envs_files(pkg), args.runs)
        single = timed(one_file, args.runs)
        print("sglang %s: %d .py files, %d parsed; search %.1f ms median (%.1f-%.1f), one file %.1f ms; adds %.1f ms"
              % (version, stats["files_scanned"], stats["files_parsed"], search[0], search[1], search[2], single[0],
                 search[0] - single[0]))


if __name__ == "__main__":
    main()
