#!/bin/bash
# Paired A/B of the single-host restart figures (batch_overhead, downtime_overhead, start_to_ready) between an
# older commit and this checkout, alternating so that the machine's drift (it moved by 30 % within an hour on
# the 2-core VM) hits both sides alike. Each side runs tests/bench/bench.py --only single in its own tree with
# its own lab; the older tree is a git worktree sharing this checkout's .venv and bench site.
#
#   tests/bench/ab_single.sh OLD_REV [ROUNDS (3)] [RUNS per side and round (3)]
#
# Prints one line per side and round (the samples of each key, s) and the pooled medians. Writes this
# checkout's docs/benchmarks.{json,md} like make bench does (the last "new" round).
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
old_rev=${1:?usage: $0 OLD_REV [ROUNDS] [RUNS]}
rounds=${2:-3}
runs=${3:-3}
old=$(mktemp -d /tmp/gpufleet-ab-XXXXXX)
out=$old.txt
cleanup() { git -C "$here" worktree remove --force "$old" >/dev/null 2>&1 || true; }
trap cleanup EXIT
git -C "$here" worktree add -q --detach "$old" "$old_rev"
ln -s "$here/.venv" "$old/.venv"
one() { # tree tag
  (cd "$1" && PATH="$here/.venv/bin:$PATH" ANSIBLE_CONFIG="$1/ansible.cfg" GPUFLEET_BENCH_SITE="$here/.cache/bench-site" \
     PYTHONUNBUFFERED=1 "$here/.venv/bin/python" tests/bench/bench.py --only single --runs "$runs" > "$out.$2.log" 2>&1)
  "$here/.venv/bin/python" - "$1/docs/benchmarks.json" "$2" >> "$out" <<'PY'
import json, sys
keys = json.load(open(sys.argv[1]))["keys"]
print(sys.argv[2], json.dumps({k: keys[k]["samples"] for k in
      ("batch_overhead_s_median", "downtime_overhead_s_median", "start_to_ready_s_1")}))
PY
  tail -n 1 "$out"
}
for r in $(seq 1 "$rounds"); do
  one "$old" "old$r"
  one "$here" "new$r"
done
"$here/.venv/bin/python" - "$out" <<'PY'
import json, statistics, sys
pooled = {}
for line in open(sys.argv[1]):
    tag, data = line.split(" ", 1)
    for key, samples in json.loads(data).items():
        pooled.setdefault((tag.rstrip("0123456789"), key), []).extend(samples)
for (side, key), samples in sorted(pooled.items()):
    print("%s %s: median %.3f s (%.3f-%.3f, n=%d)" % (side, key, statistics.median(samples), min(samples),
                                                     max(samples), len(samples)))
PY
