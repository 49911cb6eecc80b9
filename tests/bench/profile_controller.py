#!/usr/bin/env python3
"""Where the controller's CPU goes in a single-host restart (issue 14, batch overhead): py-spy samples
``ansible-playbook playbooks/restart.yml -e target=gpu-lab-01`` with its forked workers, and this script folds the
samples into the Ansible functions that hold them.

    make bench-site   # or: .venv/bin/python -m pip install --target .cache/bench-site -r requirements/bench.txt
    .venv/bin/python tests/bench/profile_controller.py [--lab-dir DIR] [--rate 50] [--keep-lab] [--top 25]

Brings up its own 2-host lab (default .lab-profile; an existing one there is reused), starts a server on
gpu-lab-01 with an unmeasured restart, then runs one restart under ``py-spy record --subprocesses`` (py-spy from
.cache/bench-site/bin or PATH). Prints the wall and CPU time of the run (getrusage of the waited-for children:
ansible-playbook, its workers and their ssh clients; the target's module processes run in the lab host's namespace
and are not counted), then the sample share of: the task workers' fork, the AnsiballZ build on the controller
(``modify_module``: parsing each module and its module_utils to find what to ship, once per module per run),
the strategy's loops, templating and post-validation; then the top functions by inclusive and by own samples.
Counts are py-spy samples (1 sample = 1/rate s of one process on a CPU; idle samples are not recorded).
"""
import argparse
import collections
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOST = "gpu-lab-01"

# (label, predicate over one sample's frames, root first) in the order they are reported. A forked worker's stacks
# begin with the parent's frames up to the fork (Popen._launch), then BaseProcess._bootstrap.
def _has(frames, needle):
    return any(needle in f for f in frames)


BUCKETS = [
    ("forked task workers (child side: everything a worker does for its task)",
     lambda fr: _has(fr, "BaseProcess._bootstrap (")),
    ("  of which building the module payload (AnsiballZ modify_module)",
     lambda fr: _has(fr, "BaseProcess._bootstrap (") and _has(fr, "modify_module (")),
    ("    of which parsing module and module_utils sources (_compile_module_ast)",
     lambda fr: _has(fr, "BaseProcess._bootstrap (") and _has(fr, "_compile_module_ast (")),
    ("parent: forking the workers (Popen._launch, parent side)",
     lambda fr: _has(fr, "Popen._launch (") and not _has(fr, "BaseProcess._bootstrap (")),
    ("parent: strategy and result loops' own samples (1 ms internal poll)",
     lambda fr: bool(fr) and ("StrategyModule.run (" in fr[-1] or "_wait_on_pending_results (" in fr[-1])),
    ("parent: templating (TemplateEngine.template)",
     lambda fr: _has(fr, "TemplateEngine.template (") and not _has(fr, "BaseProcess._bootstrap (")),
    ("parent: post-validation of task fields (post_validate)",
     lambda fr: _has(fr, "post_validate (") and not _has(fr, "BaseProcess._bootstrap (")),
    ("parent: callback plugins (send_callback)", lambda fr: _has(fr, "send_callback (")),
    ("start-up and playbook load (before the task queue manager runs)",
     lambda fr: not _has(fr, "TaskQueueManager.run (")),
]


def _short(frame):
    return re.sub(r"\([^()]*/(?:site-packages|lib/python3\.\d+)/", "(", frame)


def fold(raw_lines):
    """py-spy raw lines ('f1;f2;...;fn COUNT') → (total, inclusive Counter, own Counter); frames shortened to
    their path below site-packages / the stdlib."""
    total, incl, own = 0, collections.Counter(), collections.Counter()
    for line in raw_lines:
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not stack or not n.isdigit():
            continue
        n = int(n)
        total += n
        frames = [_short(f) for f in stack.split(";")[1:]]  # [0] is the process
        for f in set(frames):
            incl[f] += n
        if frames:
            own[frames[-1]] += n
    return total, incl, own


def bucket_counts(raw_lines):
    """{label: samples whose stack holds the bucket's frame} for BUCKETS."""
    out = collections.Counter()
    for line in raw_lines:
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")[1:]
        for label, pred in BUCKETS:
            if pred(frames):
                out[label] += int(n)
    return out


def _py_spy():
    site = os.environ.get("GPUFLEET_BENCH_SITE") or os.path.join(ROOT, ".cache", "bench-site")
    for cand in (os.path.join(site, "bin", "py-spy"), shutil.which("py-spy")):
        if cand and os.access(cand, os.X_OK):
            return cand
    sys.exit("py-spy not found: .venv/bin/python -m pip install --target .cache/bench-site -r requirements/bench.txt")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lab-dir", default=os.path.join(ROOT, ".lab-profile"))
    ap.add_argument("--rate", type=int, default=50, help="py-spy samples per second (default 50)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--keep-lab", action="store_true")
    opts = ap.parse_args()
    spy = _py_spy()
    lab_py = os.path.join(ROOT, "tests", "lab", "lab.py")
    if not os.path.exists(os.path.join(opts.lab_dir, "inventory")):
        subprocess.run([sys.executable, lab_py, "up", "--hosts", "2", "--lab-dir", opts.lab_dir], check=True)
    bindir = os.path.dirname(sys.executable)
    env = dict(os.environ, ANSIBLE_CONFIG=os.path.join(ROOT, "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               PATH=bindir + ":" + os.environ.get("PATH", "/usr/bin:/bin"))
    play = [sys.executable, os.path.join(bindir, "ansible-playbook"), "-i", os.path.join(opts.lab_dir, "inventory"),
            "playbooks/restart.yml", "-e", "target=" + HOST]
    try:
        warm = subprocess.run(play, cwd=ROOT, env=env, capture_output=True, text=True)
        print("warm-up restart (not measured): rc %d" % warm.returncode)
        out = os.path.join(tempfile.mkdtemp(prefix="gpufleet-spy-"), "raw.txt")
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.time()
        run = subprocess.run([spy, "record", "--subprocesses", "-r", str(opts.rate), "-f", "raw", "-o", out, "--"]
                             + play, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.time() - t
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        tail = [ln for ln in run.stdout.splitlines() if ln.strip()][-3:]
        print("profiled restart: rc %d, wall %.1f s, controller CPU %.1f s user + %.1f s sys (py-spy included), "
              "load %s" % (run.returncode, wall, r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime,
                           " ".join(open("/proc/loadavg").read().split()[:3])))
        print("\n".join("  " + ln for ln in tail))
        lines = open(out).read().splitlines()
        total, incl, own = fold(lines)
        print("\n%d samples at %d/s (%.1f s on a CPU)" % (total, opts.rate, total / opts.rate))
        buckets = bucket_counts(lines)
        for label, _ in BUCKETS:
            print("  %5d  %4.0f%%  %s" % (buckets[label], 100.0 * buckets[label] / max(total, 1), label))
        print("\ntop %d inclusive:" % opts.top)
        for f, n in incl.most_common(opts.top):
            print("  %5d  %4.0f%%  %s" % (n, 100.0 * n / total, f[:140]))
        print("\ntop %d own:" % opts.top)
        for f, n in own.most_common(opts.top):
            print("  %5d  %4.0f%%  %s" % (n, 100.0 * n / total, f[:140]))
    finally:
        if not opts.keep_lab:
            subprocess.run([sys.executable, lab_py, "down", "--lab-dir", opts.lab_dir], capture_output=True)


if __name__ == "__main__":
    main()
