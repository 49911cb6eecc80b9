#!/bin/bash
# tune.yml on a machine with a real NVIDIA GPU (the lent H200 machine), end to end (issue 34):
#   1. restart.yml starts the lab stand-in (tests/lab/standin) in its real-GPU mode: each TP worker holds MIB MiB
#      of real GPU memory (torch) and decodes at the stand-in's documented table speed (tests/lab/standin/perf.py,
#      docs/lab.md "Decode speed") for the NCCL values it finds in its workers' environment - the figures are the
#      STAND-IN's, not a model's: real SGLang cannot be carried there (no weights, no network, 64 MiB carry);
#   2. tune.yml with two candidates against that baseline, measured with SGLang 0.5.23's own benchmark client
#      (`sglang.bench_serving`, its import chain from the image plus .whl/bench), repeats TUNE_REPEATS (3);
#   3. restart.yml -e gpufleet_profile=<the winner's profile> (the roll to "the fleet": this one host);
#   4. history.yml: every launch of the run in the host's history.
# Usage, from the repository root, as root on the GPU machine (.whl/ holds ansible-core, resolvelib, setproctitle
# and the sglang 0.5.23 cp312 wheel, .whl/bench/ the benchmark client's imports the image lacks):
#   tests/gpu/tune_h200.sh OUT_DIR [MIB_PER_GPU]
set -uo pipefail
OUT=${1:?usage: tune_h200.sh OUT_DIR [MIB_PER_GPU]}
MIB=${2:-20480}
REPO=$(pwd)
SGLENV=${RR_SGLENV:-/tmp/sglenv}
STATE=${RR_STATE_DIR:-/var/lib/gpufleet-h200}  # not under /tmp: preflight refuses a state dir others could write above
MODELS=${RR_MODELS:-/tmp/gpufleet-models}
PROFILES=${RR_PROFILES:-/root/gpufleet-profiles}
# The settings are the canary's HOST VARIABLES (an inventory written here), not -e extra vars: extra vars win over
# everything, so tune.yml could not put a candidate's values over them.
INV=${RR_INVENTORY:-/root/gpufleet-inv}
VARS=$INV/host_vars/localhost.yml
mkdir -p "$OUT" "$PROFILES" "$INV/host_vars"
cp inventory/local/hosts.yml "$INV/hosts.yml"
export PYTHONUNBUFFERED=1 ANSIBLE_NOCOLOR=1 ANSIBLE_FORCE_COLOR=0 LC_ALL=C.UTF-8 LANG=C.UTF-8
export ANSIBLE_CONFIG=$REPO/ansible.cfg
stamp() { echo "=== $(date -u +%H:%M:%S.%N | cut -c1-12) $*"; }

stamp setup
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/ansible_core-*.whl .whl/resolvelib-*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m venv --without-pip "$SGLENV" || exit 1
SP=$("$SGLENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SP" \
    .whl/sglang-*.whl .whl/setproctitle-*.whl .whl/bench/*.whl || exit 1
python3 -c 'import site; print(site.getsitepackages()[0])' > "$SP/gpufleet-image-site.pth"
ANSIBLE_BIN=/tmp/site/bin
"$ANSIBLE_BIN/ansible-playbook" --version 2>&1 | sed -n 1,3p
nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,memory.used --format=csv
# The benchmark client runs with no GPU visible (gpufleet_tune_bench_env below): on a CUDA machine SGLang's import
# chain wants sgl_kernel (a real SGLang install has it; its wheel is too large to carry here), and an HTTP client
# needs no GPU.
# The model dirs the stand-in names; the tokenizer is built here (tests/lab/bench_deps.py), no hub access.
M=$MODELS/Llama-3.1-8B-Instruct
mkdir -p "$M" "$MODELS/EAGLE3-LLaMA3.1-Instruct-8B"
echo '{"architectures": ["LlamaForCausalLM"]}' > "$M/config.json"
echo '{"architectures": ["LlamaForCausalLMEagle3"]}' > "$MODELS/EAGLE3-LLaMA3.1-Instruct-8B/config.json"
rm -rf "$MODELS/tokenizer"
"$SGLENV/bin/python" -c 'import sys; sys.path.insert(0, "tests/lab"); import bench_deps; bench_deps.build_tokenizer(sys.argv[1])' \
    "$MODELS/tokenizer" || exit 1
cp "$MODELS"/tokenizer/* "$M"/
NGPU=${RR_TP:-$(nvidia-smi -L | grep -c '^GPU ')}
cat > "$VARS" <<VARS
# Host vars of localhost for tests/gpu/tune_h200.sh (written by it).
sglang_python: $SGLENV/bin/python
ansible_python_interpreter: $SGLENV/bin/python
sglang_launcher: [$SGLENV/bin/python, $REPO/tests/lab/standin/sglang_standin.py]
sglang_launch_method: process
sglang_state_dir: $STATE
sglang_service_user: root
sglang_launch_args:
  model-path: $M
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
gpufleet_profile_dir: $PROFILES
gpufleet_tune_bench_env:
  HF_HUB_OFFLINE: "1"
  TOKENIZERS_PARALLELISM: "false"
  CUDA_VISIBLE_DEVICES: ""
VARS
cat > "$OUT/candidates.yml" <<'CANDS'
# Two candidates against the baseline (3-step EAGLE-3 with the seed's NCCL set).
gpufleet_tune_candidates:
  - name: eagle-2-steps
    sglang_launch_args: {speculative-num-steps: 2, speculative-num-draft-tokens: 3}
  - name: eagle-1-step
    sglang_launch_args: {speculative-num-steps: 1, speculative-num-draft-tokens: 2}
CANDS
cp "$VARS" "$OUT/vars.yml"; cat "$VARS" "$OUT/candidates.yml"
rc=0
run() { local name=$1; shift; stamp "$name"; local t0=$(date +%s.%N)
        "$@"; local r=$?; stamp "$name rc=$r $(python3 -c "import sys,time; print('%.1f s' % (time.time()-float(sys.argv[1])))" "$t0")"
        [ $r -eq 0 ] || rc=1; }
run "restart.yml (baseline)" "$ANSIBLE_BIN/ansible-playbook" -i "$INV" playbooks/restart.yml
run "tune.yml" "$ANSIBLE_BIN/ansible-playbook" -i "$INV" playbooks/tune.yml \
    -e target=localhost -e "@$OUT/candidates.yml" -e "gpufleet_tune_repeats=${TUNE_REPEATS:-3}" \
    -e "gpufleet_tune_report=$OUT/report.json" -e gpufleet_tune_profile=h200-tuned ${TUNE_EXTRA:-}
stamp "workers after tune (NCCL and argv)"
for p in $(pgrep -f '^sglang::scheduler_TP' || true); do
    echo "pid $p $(tr '\0' '\n' < /proc/$p/environ | grep '^NCCL' | sort | tr '\n' ' ')"
done
pgrep -af 'sglang.launch_server' | head -3
run "restart.yml -e gpufleet_profile=h200-tuned" "$ANSIBLE_BIN/ansible-playbook" -i "$INV" \
    playbooks/restart.yml -e gpufleet_profile=h200-tuned
pgrep -af 'sglang.launch_server' | head -3
run "history.yml" "$ANSIBLE_BIN/ansible-playbook" -i "$INV" playbooks/history.yml -e target=localhost
cp "$STATE/history.jsonl" "$OUT/history.jsonl" 2>/dev/null
cp "$PROFILES"/*.yml "$OUT/" 2>/dev/null
grep -h "lab stand-in: decode speed\|decode" "$STATE/sglang.log" | tail -3
nvidia-smi --query-compute-apps=pid,process_name,used_gpu_memory --format=csv
[ -f "$STATE/sglang.pid" ] && kill "$(cat "$STATE/sglang.pid")" 2>/dev/null
cp "$STATE/sglang.log" "$OUT/sglang.log" 2>/dev/null
stamp "done rc=$rc"
exit $rc
