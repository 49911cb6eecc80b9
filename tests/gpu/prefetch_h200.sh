#!/bin/bash
# Issue 35 on the lent GPU machine: restart.yml's downtime with the weight prefetch against without it, with the lab
# stand-in (tests/lab/standin) loading a real safetensors checkpoint onto the GPU as SGLang's loader does
# (GPUFLEET_STANDIN_WEIGHTS_DEVICE=cuda:0: safe_open + get_tensor, copied to the GPU, no shard kept mapped).
#   1. runtime (kernel, Python, torch, safetensors, fincore), the memory the prefetch may use, the filesystem;
#   2. a GIB GiB checkpoint (tests/lab/weights.py, shards of PF_SHARD_GIB, one writing process per shard), timed;
#   3. FIRST: does posix_fadvise(DONTNEED) empty the page cache there? (a shard read whole, measured, evicted,
#      measured; fincore, else mincore) - if not, a cold run cannot be told from a warm one and the script stops;
#   4. restart.yml run0 (inventory/local + a vars file written here): the first launch, prefetch off (the first
#      read since the write: not counted);
#   5. PF_PAIRS pairs, in turn cold (-e sglang_prefetch_enabled=false) and prefetched (the default), each after
#      evicting the checkpoint (the serving stand-in maps none of it) and checking that it is cold; per run the
#      summary row (set_stats through tests/gpu/callback_plugins), the stand-in's start-to-ready (its log) and
#      /get_server_info (weights_load_s);
#   6. OUT/prefetch_h200.json (tests/gpu/prefetch_h200.py report) and a short summary.
# Usage, from the repository root, as root on the GPU machine (.whl/ holds ansible-core, resolvelib, setproctitle
# and the sglang 0.5.23 cp312 wheel, as for tests/gpu/real_restart.sh; docs/benchmarks.md):
#   tests/gpu/prefetch_h200.sh OUT_DIR [GIB]            GIB: checkpoint size, default 24
#   tests/gpu/prefetch_h200.sh --detach OUT_DIR [GIB]   the same in a new session (setsid nohup), output in
#                                                      OUT_DIR/log; OUT_DIR/DONE holds "rc=N" when it has ended
# OUT_DIR ends with: log (detached), prefetch_h200.json (every sample and the ratios; rewritten after each run),
# sglang.log, work.tgz (the vars file, runtime, checks, samples, set_stats and task times of every run, kept in
# PF_WORK, default OUT_DIR.work, while it runs).
# Environment: PF_PAIRS (3), PF_SHARD_GIB (4), PF_MODELS (model dir parent, /root/gpufleet-prefetch-models: the
# local disk, not a tmpfs), PF_STATE_DIR (/var/lib/gpufleet-prefetch), PF_PORT (30000), PF_WEIGHTS_DEVICE (cuda:0;
# cpu for a machine without a GPU), PF_WORKER_MIB (GPU MiB each TP worker holds, 1024; empty: the lab's gpusimd),
# PF_TP (1), PF_GROW (1: touch memory once when the prefetch's headroom is short), PF_REMOVE_CHECKPOINT (0),
# PF_DEADLINE_S (570: no pair is started that would end past this many seconds since the start, at the pace of the
# one before; 0: no deadline; a device call is cut at 600 s),
# PF_SKIP_SETUP=1 reuses $PF_SGLENV (default /tmp/sglenv) and $PF_ANSIBLE_BIN (default /tmp/site/bin).
# Inside a lab host (GPUFLEET_LAB_HOST_DIR set: a dry run) the stand-in reads that host's faults.json, so set
# `lab.py fault HOST slow_load_s=0` first; elsewhere the script gives it a host dir of its own with slow_load_s 0.
set -uo pipefail
if [ "${1:-}" = "--detach" ]; then
    shift
    OUT=${1:?usage: prefetch_h200.sh --detach OUT_DIR [GIB]}
    mkdir -p "$OUT" && rm -f "$OUT/DONE"
    setsid nohup bash "$0" "$@" > "$OUT/log" 2>&1 < /dev/null &
    echo "prefetch_h200.sh runs detached (pid $!): tail $OUT/log; $OUT/DONE appears at the end"
    exit 0
fi
OUT=${1:?usage: prefetch_h200.sh [--detach] OUT_DIR [GIB]}
GIB=${2:-24}
PAIRS=${PF_PAIRS:-3}
REPO=$(pwd)
SGLENV=${PF_SGLENV:-/tmp/sglenv}
STATE=${PF_STATE_DIR:-/var/lib/gpufleet-prefetch}  # not under a directory others may write: preflight refuses that
MODELS=${PF_MODELS:-/root/gpufleet-prefetch-models}
PORT=${PF_PORT:-30000}
DEVICE=${PF_WEIGHTS_DEVICE-cuda:0}
WORKER_MIB=${PF_WORKER_MIB-1024}
M=$MODELS/Llama-3.1-8B-Instruct
# Beside OUT, not in it: the device tool brings back at most 8 files of OUT, also from a run cut at its time limit,
# so OUT holds only the log, prefetch_h200.json (rewritten after every run), sglang.log and work.tgz (at the end).
WORK=${PF_WORK:-${OUT%/}.work}
VARS=$WORK/vars.yml
mkdir -p "$OUT" "$WORK" "$M" "$STATE" && chmod 755 "$STATE" && rm -f "$OUT/DONE" "$WORK"/*.jsonl "$WORK"/*.json
rc=0
trap 'echo "rc=$rc" > "$OUT/DONE"' EXIT
export PYTHONUNBUFFERED=1 ANSIBLE_NOCOLOR=1 ANSIBLE_FORCE_COLOR=0 LC_ALL=C.UTF-8 LANG=C.UTF-8
export ANSIBLE_CONFIG=$REPO/ansible.cfg
T_START=$(date +%s.%N)
stamp() { echo "=== $(date -u +%H:%M:%S.%N | cut -c1-12) $*"; }
since() { python3 -c "import sys,time; print('%.1f' % (time.time()-float(sys.argv[1])))" "$1"; }

if [ -z "${PF_SKIP_SETUP:-}" ]; then
    stamp setup
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/ansible_core-*.whl .whl/resolvelib-*.whl || exit 1
    export PYTHONPATH=/tmp/site
    # The "SGLang virtualenv" as in real_restart.sh: the real sglang 0.5.23 wheel (the stand-in reads its flags and
    # runs its _set_envs_and_config) and setproctitle; torch, safetensors, psutil and nvidia-ml-py from the image.
    python3 -m venv --without-pip "$SGLENV" || exit 1
    SP=$("$SGLENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SP" \
        .whl/sglang-*.whl .whl/setproctitle-*.whl || exit 1
    python3 -c 'import site; print(site.getsitepackages()[0])' > "$SP/gpufleet-image-site.pth"
fi
ANSIBLE_BIN=${PF_ANSIBLE_BIN:-/tmp/site/bin}
PY=$SGLENV/bin/python
H="$PY tests/gpu/prefetch_h200.py"
"$ANSIBLE_BIN/ansible-playbook" --version 2>&1 | sed -n 1p
nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv 2>&1 | head -3
stamp "runtime"
$H runtime "$WORK/runtime.json" || rc=1
stamp "filesystem of $MODELS"
df -T "$MODELS"
lsblk -d -o NAME,TYPE,ROTA,SIZE,MODEL 2>/dev/null | head -5
# the checkpoint's GiB in the page cache, and 4 GiB for what else runs meanwhile (ansible, the stand-in, its workers)
$H mem "$(python3 -c 'import sys; print(float(sys.argv[1]) + 4)' "$GIB")" "$WORK/mem.json" \
    $([ "${PF_GROW:-1}" = 1 ] && echo --grow) || rc=1

stamp "write the checkpoint: $GIB GiB"
echo '{"architectures": ["LlamaForCausalLM"]}' > "$M/config.json"
$H write "$M" "$GIB" "$WORK/write.json" --shard-gib "${PF_SHARD_GIB:-4}" || { rc=1; exit 1; }
ls -la "$M"
stamp "FIRST: does DONTNEED empty the page cache here?"
if ! $H dontneed-check "$M" "$WORK/dontneed.json"; then
    rc=1
    $H report "$WORK"; cp "$WORK/prefetch_h200.json" "$OUT/"
    stamp "stopped: DONTNEED does not empty the page cache on $(df --output=fstype "$MODELS" | tail -1); try PF_MODELS on another filesystem"
    exit 1
fi

# The stand-in's fault knobs come from a lab host dir's faults.json: outside a lab, one of our own with slow_load_s 0,
# so a start is the stand-in's own work plus reading the weights.
ENV_LINES=()
[ -n "$WORKER_MIB" ] && ENV_LINES+=("  GPUFLEET_STANDIN_CUDA_MIB: \"$WORKER_MIB\"")
if [ -z "${GPUFLEET_LAB_HOST_DIR:-}" ]; then
    mkdir -p "$WORK/standin" && echo '{"slow_load_s": 0}' > "$WORK/standin/faults.json"
    ENV_LINES+=("  GPUFLEET_LAB_HOST_DIR: $WORK/standin")
else
    python3 -c 'import json, sys; sys.exit(json.load(open(sys.argv[1])).get("slow_load_s") != 0)' \
        "$GPUFLEET_LAB_HOST_DIR/faults.json" 2>/dev/null ||
        echo "WARNING: $GPUFLEET_LAB_HOST_DIR/faults.json does not set slow_load_s 0: each start sleeps 1 s more (lab.py fault HOST slow_load_s=0)"
fi
cat > "$VARS" <<VARS
# Extra vars over inventory/local for tests/gpu/prefetch_h200.sh (written by it).
sglang_python: $PY
ansible_python_interpreter: $PY
sglang_launcher: [$PY, $REPO/tests/lab/standin/sglang_standin.py]
sglang_launch_method: process
sglang_state_dir: $STATE
sglang_service_user: root
sglang_port: $PORT
sglang_launch_args:
  model-path: $M
  tp-size: ${PF_TP:-1}
sglang_nccl_env:
  NCCL_PROTO: LL
  NCCL_ALGO: Ring
  NCCL_NVLS_ENABLE: "0"
sglang_launch_extra_env:
  SPT_NOENV: "1"
  GPUFLEET_STANDIN_WEIGHTS_DEVICE: "$DEVICE"
$(printf '%s\n' "${ENV_LINES[@]}")
sglang_launch_ready_timeout_s: 300
sglang_launch_ready_delay_s: 1
VARS
cat "$VARS"

export ANSIBLE_CALLBACK_PLUGINS=$REPO/plugins/callback:$REPO/tests/gpu/callback_plugins
export GPUFLEET_TASK_TIMES_FILE=$WORK/task-times.jsonl GPUFLEET_RUN_STATS_FILE=$WORK/stats.jsonl
# restart.yml as run NAME (MODE, PAIR) with extra arguments; then its sample
restart() {
    local name=$1 mode=$2 pair=$3; shift 3
    stamp "restart.yml $name ($mode) $*"
    local t0; t0=$(date +%s.%N)
    GPUFLEET_TASK_TIMES_RUN=$name "$ANSIBLE_BIN/ansible-playbook" -i inventory/local playbooks/restart.yml \
        -e "@$VARS" "$@"
    local r=$?
    stamp "restart.yml $name rc=$r ($(since "$t0") s)"
    [ $r -eq 0 ] || rc=1
    $H sample "$WORK/samples.jsonl" --run "$name" --mode "$mode" --pair "$pair" --stats "$WORK/stats.jsonl" \
        --log "$STATE/sglang.log" --after "$t0" --wall "$(since "$t0")" --port "$PORT" --rc $r \
        --cold-json "$WORK/cold-$name.json"
    # what has been measured so far, in OUT, should the call end before the script does
    $H report "$WORK" > /dev/null; cp "$WORK/prefetch_h200.json" "$OUT/"
}
evict() {
    stamp "evict the checkpoint before $1"
    $H cold "$M" "$WORK/cold-$1.json"
    grep -h "MemFree\|^Cached" /proc/meminfo | tr -s ' ' | tr '\n' ' '; echo
}

# The first launch reads the files cold for the first time since they were written (not counted: on a virtual disk
# the host may cache what was read once, so later cold reads can be faster).
evict run0
restart run0 first 0 -e sglang_prefetch_enabled=false
DEADLINE=${PF_DEADLINE_S:-570}
for i in $(seq 1 "$PAIRS"); do
    # A device call ends at 600 s: start a pair only if it ends before the deadline at the last pair's pace.
    elapsed=$(since "$T_START")
    if [ "$DEADLINE" != 0 ] && [ -n "${PAIR_S:-}" ] &&
        python3 -c 'import sys; sys.exit(float(sys.argv[1]) + float(sys.argv[2]) <= float(sys.argv[3]))' \
            "$elapsed" "$PAIR_S" "$DEADLINE"; then
        stamp "pairs $i-$PAIRS left out: $elapsed s gone, a pair takes $PAIR_S s, PF_DEADLINE_S=$DEADLINE"
        break
    fi
    T_PAIR=$(date +%s.%N)
    evict "cold$i"
    restart "cold$i" cold "$i" -e sglang_prefetch_enabled=false
    evict "prefetched$i"
    restart "prefetched$i" prefetched "$i"
    PAIR_S=$(since "$T_PAIR")
done

stamp "stop the server this script launched"
if [ -f "$STATE/sglang.pid" ]; then
    PID=$(cat "$STATE/sglang.pid")
    kill "$PID" 2>/dev/null
    for _ in $(seq 1 60); do kill -0 "$PID" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$PID" 2>/dev/null && echo "WARNING: pid $PID still runs"
fi
nvidia-smi --query-compute-apps=pid,process_name,used_gpu_memory --format=csv 2>/dev/null
cp "$STATE/sglang.log" "$OUT/sglang.log" 2>/dev/null
[ "${PF_REMOVE_CHECKPOINT:-0}" = 1 ] && "$PY" -c 'import sys; sys.path.insert(0, "tests/lab"); import weights; print("removed", weights.remove_checkpoint(sys.argv[1]))' "$M"
stamp "report"
$H report "$WORK" || rc=1
cp "$WORK/prefetch_h200.json" "$OUT/"
tar czf "$OUT/work.tgz" -C "$(dirname "$WORK")" "$(basename "$WORK")" && rm -rf "$WORK"
stamp "done rc=$rc, $(since "$T_START") s in all"
exit $rc
