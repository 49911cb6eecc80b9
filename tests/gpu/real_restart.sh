#!/bin/bash
# restart.yml with inventory/local on a machine with real NVIDIA GPUs (the lent H200 machine), end to end:
#   1. restart.yml run0 starts the lab stand-in (tests/lab/standin) in its real-GPU mode: tp = number of GPUs,
#      each TP worker holds MIB MiB of real GPU memory (torch), the NCCL set in the server's environment;
#   2. `ansible -m nvidia_gpu_info` with backend=nvml and backend=nvidia-smi, compared (tests/gpu/real_restart.py);
#   3. restart.yml run1 and run2: stop -> NVML wait -> patch the real SGLang 0.5.23 engine.py -> relaunch -> verify;
#   3b. with RR_HELD_WAIT_REPS=N: N times --tags wait while the workers still hold memory (SIGKILL after 5 s),
#      then --tags launch,verify;
#   4. an independent NVML poller (10 ms) runs throughout; per-phase times and per-GPU release latency are
#      derived from it and the gpufleet_task_times callback (tests/gpu/callback_plugins).
# Usage, from the repository root, as root on the GPU machine (.whl/ holds ansible-core, resolvelib,
# setproctitle and the sglang 0.5.23 cp312 wheel; see docs/benchmarks.md):
#   tests/gpu/real_restart.sh OUT_DIR [MIB_PER_GPU]
# Environment: RR_SKIP_SETUP=1 reuses an existing $RR_SGLENV (local dry runs); RR_ANSIBLE_BIN: directory of
# ansible/ansible-playbook (default /tmp/site/bin after installing the carried wheels).
set -uo pipefail
OUT=${1:?usage: real_restart.sh OUT_DIR [MIB_PER_GPU]}
MIB=${2:-20480}
REPO=$(pwd)
SGLENV=${RR_SGLENV:-/tmp/sglenv}
STATE=${RR_STATE_DIR:-/tmp/gpufleet-state}
MODELS=${RR_MODELS:-/tmp/gpufleet-models}
VARS=$OUT/vars.yml
mkdir -p "$OUT"
# ansible-core refuses a non-UTF-8 locale; ANSIBLE_CONFIG because Ansible ignores ./ansible.cfg in a
# world-writable directory (a copied tree may be one).
export PYTHONUNBUFFERED=1 ANSIBLE_NOCOLOR=1 ANSIBLE_FORCE_COLOR=0 LC_ALL=C.UTF-8 LANG=C.UTF-8
export ANSIBLE_CONFIG=$REPO/ansible.cfg
stamp() { echo "=== $(date -u +%H:%M:%S.%N | cut -c1-12) $*"; }

if [ -z "${RR_SKIP_SETUP:-}" ]; then
    stamp setup
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/ansible_core-*.whl .whl/resolvelib-*.whl || exit 1
    export PYTHONPATH=/tmp/site
    # The "SGLang virtualenv": the real sglang 0.5.23 wheel (--no-deps: engine.py is the real file that gets
    # patched) plus setproctitle; torch, psutil and nvidia-ml-py come from the image's interpreter via a .pth.
    python3 -m venv --without-pip "$SGLENV" || exit 1
    SP=$("$SGLENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SP" \
        .whl/sglang-*.whl .whl/setproctitle-*.whl || exit 1
    python3 -c 'import site; print(site.getsitepackages()[0])' > "$SP/gpufleet-image-site.pth"
fi
ANSIBLE_BIN=${RR_ANSIBLE_BIN:-/tmp/site/bin}
"$ANSIBLE_BIN/ansible-playbook" --version 2>&1 | sed -n 1,3p
python3 -c 'import sys, torch, pynvml, psutil; print(sys.version.split()[0], "torch", torch.__version__, "psutil", psutil.__version__)'
nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,memory.used --format=csv
"$SGLENV/bin/python" -c 'import importlib.util as u, psutil, pynvml, setproctitle; print("sglang at", u.find_spec("sglang").submodule_search_locations[0])' || exit 1
mkdir -p "$MODELS/Llama-3.1-8B-Instruct" "$MODELS/EAGLE3-LLaMA3.1-Instruct-8B"
echo '{"architectures": ["LlamaForCausalLM"]}' > "$MODELS/Llama-3.1-8B-Instruct/config.json"
echo '{"architectures": ["LlamaForCausalLMEagle3"]}' > "$MODELS/EAGLE3-LLaMA3.1-Instruct-8B/config.json"
NGPU=${RR_TP:-$(nvidia-smi -L | grep -c '^GPU ')}
cat > "$VARS" <<VARS
# Extra vars over inventory/local for tests/gpu/real_restart.sh (written by it).
sglang_python: $SGLENV/bin/python
ansible_python_interpreter: $SGLENV/bin/python
sglang_launcher: [$SGLENV/bin/python, $REPO/tests/lab/standin/sglang_standin.py]
sglang_launch_method: process
sglang_state_dir: $STATE
sglang_service_user: root
sglang_launch_args:
  model-path: $MODELS/Llama-3.1-8B-Instruct
  speculative-algorithm: EAGLE3
  speculative-draft-model-path: $MODELS/EAGLE3-LLaMA3.1-Instruct-8B
  speculative-num-steps: 3
  speculative-eagle-topk: 1
  speculative-num-draft-tokens: 4
  tp-size: $NGPU
  trust-remote-code: true
sglang_nccl_env:
  NCCL_PROTO: LL
  NCCL_ALGO: Ring
  NCCL_P2P_LEVEL: SYS
  NCCL_MAX_NCHANNELS: "16"
  NCCL_BUFFSIZE: "16777216"
  NCCL_NTHREADS: "512"
  NCCL_NVLS_ENABLE: "0"
sglang_launch_extra_env:
  SPT_NOENV: "1"
  GPUFLEET_STANDIN_CUDA_MIB: "$MIB"
sglang_launch_ready_timeout_s: 240
sglang_launch_ready_delay_s: 1
VARS
[ -n "${RR_PORT:-}" ] && echo "sglang_port: $RR_PORT" >> "$VARS"
cat "$VARS"

export ANSIBLE_CALLBACK_PLUGINS=$REPO/plugins/callback:$REPO/tests/gpu/callback_plugins
export GPUFLEET_TASK_TIMES_FILE=$OUT/task-times.jsonl
rc=0
stamp "NVML poller (10 ms)"
python3 tests/gpu/real_restart.py poll "$OUT/poll.jsonl" --period-ms 10 &
POLLER=$!

playbook() {
    stamp "restart.yml $1"
    GPUFLEET_TASK_TIMES_RUN=$1 "$ANSIBLE_BIN/ansible-playbook" -i inventory/local playbooks/restart.yml -e "@$VARS"
    local r=$?; stamp "restart.yml $1 rc=$r"; [ $r -eq 0 ] || rc=1
}

playbook run0
stamp "nvidia_gpu_info, both backends"
: > "$OUT/gpuinfo.txt"
for b in nvml nvidia-smi; do
    "$ANSIBLE_BIN/ansible" -i inventory/local gpu_hosts -m nvidia_gpu_info -a "backend=$b detail=full" -e "@$VARS" \
        > "$OUT/gpuinfo-$b.txt" || rc=1
    { echo "# backend=$b"; cat "$OUT/gpuinfo-$b.txt"; } >> "$OUT/gpuinfo.txt"
done
python3 tests/gpu/real_restart.py compare "$OUT/gpuinfo-nvml.txt" "$OUT/gpuinfo-nvidia-smi.txt" "$OUT/compare.json" || rc=1
rm -f "$OUT/gpuinfo-nvml.txt" "$OUT/gpuinfo-nvidia-smi.txt"
playbook run1
playbook run2
# Release detection while the wait is already polling (in run1/run2 the stop module returns after the memory is
# free, so the wait finds it on its first poll): restart.yml --tags wait starts while the workers hold their
# memory, the workers get SIGKILL 5 s after the playbook started, then --tags launch brings the server back.
for i in $(seq 1 "${RR_HELD_WAIT_REPS:-0}"); do
    ( sleep 5; pids=$(pgrep -f '^sglang::scheduler_TP' | tr '\n' ' '); stamp "SIGKILL workers $pids"; kill -KILL $pids ) &
    KILLER=$!
    stamp "restart.yml --tags wait held$i (workers hold their memory when the wait starts)"
    GPUFLEET_TASK_TIMES_RUN=held$i "$ANSIBLE_BIN/ansible-playbook" -i inventory/local playbooks/restart.yml -e "@$VARS" \
        --tags wait || rc=1
    wait $KILLER
    stamp "restart.yml --tags launch relaunch$i"
    GPUFLEET_TASK_TIMES_RUN=relaunch$i "$ANSIBLE_BIN/ansible-playbook" -i inventory/local playbooks/restart.yml \
        -e "@$VARS" --tags launch,verify || rc=1
done
stamp "patched engine.py block"
ENGINE=$("$SGLENV/bin/python" -c 'import importlib.util as u; print(u.find_spec("sglang").submodule_search_locations[0])')/srt/entrypoints/engine.py
grep -n -B2 -A14 'gpufleet' "$ENGINE" | head -40
stamp "worker environ (NCCL*) and GPU processes"
for p in $(pgrep -f '^sglang::scheduler_TP' || true); do
    echo "pid $p $(tr '\0' '\n' < /proc/$p/environ | grep '^NCCL' | sort | tr '\n' ' ')"
done
nvidia-smi --query-compute-apps=pid,process_name,used_gpu_memory,gpu_uuid --format=csv
sleep 0.2
kill "$POLLER"; wait "$POLLER"
stamp report
python3 tests/gpu/real_restart.py report "$OUT/task-times.jsonl" "$OUT/poll.jsonl" "$OUT/report.json" || rc=1
# Leave the GPUs free: SIGTERM the server this run launched (pid file of the process method).
[ -f "$STATE/sglang.pid" ] && kill "$(cat "$STATE/sglang.pid")" 2>/dev/null
cp "$STATE/sglang.log" "$OUT/sglang.log" 2>/dev/null
stamp "done rc=$rc"
exit $rc
