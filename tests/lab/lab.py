#!/usr/bin/env python3
"""The gpufleet lab: N simulated 8×H200 hosts on this machine, reachable by Ansible over real SSH.

    lab.py up     --hosts N --sglang-version V --lab-dir DIR [--inventory-dir D]
    lab.py down   --lab-dir DIR
    lab.py status --lab-dir DIR
    lab.py exec   --lab-dir DIR HOST -- ARGV...
    lab.py fault  --lab-dir DIR HOST|all KNOB=VALUE... [--clear]
    lab.py bench-deps --lab-dir DIR HOST|all [--off]
    lab.py weights  --lab-dir DIR [--host NAME ...] --size-mib N [--model target|draft] [--shards K]
    lab.py evict    --lab-dir DIR [--host NAME ...]
    lab.py resident --lab-dir DIR [--host NAME ...]

``--lab-dir`` may also follow HOST (``exec HOST --lab-dir DIR -- ARGV``), or any argument before a ``--``.

Needs root, iproute2, util-linux (nsenter) and OpenSSH's sshd. Everything the lab makes is named after a tag
derived from the absolute lab dir (bridge ``gfl<tag>``, network namespaces ``gfl-<tag>-NN``, subnet
10.213.K.0/24 with K chosen free), so labs with different ``--lab-dir`` coexist. See tests/lab/README.md.
"""
import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import venv

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(HERE, "standin"))
import bench_deps  # noqa: E402
import dcgmi_standin  # noqa: E402
import gpusim  # noqa: E402
import nsutil  # noqa: E402
import systemd_host  # noqa: E402
import weights  # noqa: E402

DEFAULT_LAB_DIR = os.path.join(ROOT, ".lab")
DEFAULT_INVENTORY_DIR = os.path.join(ROOT, "inventory", "lab")
CACHE = os.environ.get("GPUFLEET_CACHE", os.path.join(ROOT, ".cache"))
GLOBAL_LOCK = "/run/gpufleet-lab.lock"
SUBNET_PREFIX = "10.213"
STANDIN = os.path.join(HERE, "standin", "sglang_standin.py")
TARGET_MODEL = "Llama-3.3-70B-Instruct"
DRAFT_MODEL = "EAGLE3-LLaMA3.3-Instruct-70B"
NCCL_ENV = {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring", "NCCL_P2P_LEVEL": "SYS", "NCCL_MAX_NCHANNELS": "16",
            "NCCL_BUFFSIZE": "16777216", "NCCL_NTHREADS": "512"}
DEP_NAMES = ("psutil", "nvidia-ml-py", "setproctitle")
FAULT_KNOBS = {
    "worker_ignores_sigterm": "stand-in TP workers ignore SIGTERM (bool)",
    "memory_never_released": "gpusimd keeps memory of dead holders until cleared (bool)",
    "release_delay_ms": "ms between a holder's death and its memory being free (int, default 150)",
    "slow_load_s": "seconds the stand-in 'loads' before HTTP comes up (float, default 1)",
    "crash_on_start": "stand-in exits 1 after loading, before HTTP (bool)",
    "crash_with_arg": "like crash_on_start, only for a start whose argv holds this text (str, e.g. a flag)",
    "orphan_worker": "TP rank whose worker detaches to PID 1 of the host, outside the process group (int|true=7)",
    "zombie_worker": "TP rank whose worker detaches like orphan_worker, then its main thread exits while another "
                     "thread keeps its GPU memory: <defunct> (state Z) yet holding (int|true=7)",
    "port_held": "a stray listener holds this port on the host (int|true=30000)",
    "stale_shm": "stale /dev/shm segments nccl-*, sgl_shm_1, cuda.shm.0 (bool|MiB per file)",
    "tokens_per_s": "stand-in /generate speed, fixed, overriding the decode speed table (float)",
    "perf_noise": "stand-in decode speed noise: one factor per start, uniform in +-this (float, default 0.05)",
    "perf_seed": "seed of the stand-in's per-start noise, with the host's start counter (int, default 0)",
    "worker_mib": "MiB each stand-in TP worker holds (int, default 120000)",
    "hang_after_requests": "after N answered /generate requests the stand-in accepts generations and never answers "
                           "(health still answers); int N, or {\"n\": N, \"with_arg\": TEXT}: only a start whose argv "
                           "holds TEXT; read at the server's start",
    # GPU and driver faults of the simulated nvidia-smi (gpusim.SMI_FAULT_KNOBS); "GPU 1" = gpusim.FAULT_GPU
    "smi_rc": "nvidia-smi exits 6|9|15|18|255 with the real driver's text (255: GPU 1's row is the error line)",
    "smi_hang_s": "every nvidia-smi call sleeps this long before answering (float)",
    "smi_cost_ms": "least age of an nvidia-smi process, ms (float, default 28: with the caller's fork/exec about the real H200 median; 0 = none)",
    "smi_field_values": "{field: raw} printed for every GPU, e.g. {\"memory.used\": \"[N/A]\"} (dict)",
    "smi_field_values_when_free": "smi_field_values only on GPUs with no memory in use: unreadable once a stop freed them (bool)",
    "ecc_errors": "GPU 1 reports N corrected and N uncorrected ECC errors, volatile and aggregate (int)",
    "remap_pending": "GPU 1 has a pending row remap, 1 uncorrectable row (bool)",
    "throttle": "GPU 1's active clock event reasons, e.g. hw_slowdown (str|list)",
    "mig_on": "every GPU reports MIG mode Enabled (bool)",
    "nvlink_down": "NVLink link N of GPU 1 is <inactive> (int)",
    "gpus_visible": "nvidia-smi lists only the first N GPUs (int)",
    "xid": "Xid line(s) for GPU 1 in the simulated kernel log <host dir>/kmsg (int|list)",
    # A container's process: holds GPU memory, but nvidia-smi --query-compute-apps lists it not (another PID
    # namespace); it has only /dev/nvidiactl and /dev/nvidia-uvm open. Cleared faults end it.
    "hidden_holder": "a process nvidia-smi does not list holds MiB on a GPU, e.g. {\"gpu\": 3, \"mib\": 20000} (dict)",
    "hidden_holder_after_stop": "as hidden_holder, but it starts when a holder of that GPU goes (the server's stop) (dict)",
    # NVIDIA DCGM's dcgmi, installed on the host only while this knob is set (standin/dcgmi_standin.py)
    "dcgmi": "a stand-in `dcgmi health -c -j`: pass|warn|fail|no_watches|hostengine_down|malformed|hang, or "
             "{\"state\": S, \"gpu\": N} (warn and fail hit GPU 3 by default)",
}


class LabError(Exception):
    pass


def die(msg):
    sys.stderr.write("lab: %s\n" % msg)
    sys.exit(1)


def log(msg):
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


def run(argv, **kw):
    kw.setdefault("check", True)
    env = dict(os.environ, LC_ALL="C")
    try:
        return subprocess.run(argv, env=env, **kw)
    except subprocess.CalledProcessError as exc:
        raise LabError("command failed (rc %s): %s\n%s" % (exc.returncode, " ".join(argv),
                                                          (exc.stderr or b"").decode(errors="replace")))


# ---------------------------------------------------------------------------------------------------
# naming
# ---------------------------------------------------------------------------------------------------
class Names:
    def __init__(self, lab_dir):
        self.lab_dir = os.path.realpath(lab_dir)
        self.tag = hashlib.sha1(self.lab_dir.encode()).hexdigest()[:5]
        self.bridge = "gfl" + self.tag
        self.netns_prefix = "gfl-%s-" % self.tag
        self.run_dir = "/run/gpufleet-lab-%s" % self.tag

    def netns(self, i):
        return "%s%02d" % (self.netns_prefix, i)

    def veth(self, i):
        return "gfl%sv%02d" % (self.tag, i)

    @staticmethod
    def host(i):
        return "gpu-lab-%02d" % i

    def host_dir(self, i):
        return os.path.join(self.lab_dir, "hosts", self.host(i))

    @property
    def state_file(self):
        return os.path.join(self.lab_dir, "lab.json")


def load_state(names):
    try:
        with open(names.state_file) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def save_state(names, state):
    gpusim.write_json_atomic(names.state_file, state)


def host_entry(state, host):
    want = "gpu-lab-%02d" % int(host) if str(host).isdigit() else host
    for h in state["hosts"]:
        if h["name"] == want:
            return h
    raise LabError("no host %r in this lab (hosts: %s)" % (host, ", ".join(h["name"] for h in state["hosts"])))


# ---------------------------------------------------------------------------------------------------
# up
# ---------------------------------------------------------------------------------------------------
def used_subnets():
    out = run(["ip", "-o", "-4", "addr", "show"], capture_output=True).stdout.decode()
    found = set()
    for m in re.finditer(r"inet (\d+)\.(\d+)\.(\d+)\.\d+/", out):
        if "%s.%s" % (m.group(1), m.group(2)) == SUBNET_PREFIX:
            found.add(int(m.group(3)))
    return found


def pick_subnet(tag):
    used = used_subnets()
    start = int(tag, 16) % 200 + 20
    for k in list(range(start, 251)) + list(range(20, start)):
        if k not in used:
            return k
    raise LabError("no free %s.K.0/24 subnet left (all of 20..250 in use by other labs)" % SUBNET_PREFIX)


def pinned_deps():
    pins = {}
    try:
        with open(os.path.join(ROOT, "requirements", "controller.txt")) as fh:
            for line in fh:
                m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line.strip())
                if m:
                    pins[m.group(1).lower()] = m.group(2)
    except OSError:
        pass
    return ["%s==%s" % (n, pins[n]) if n in pins else n for n in DEP_NAMES]


def ensure_deps():
    """Shared dir with psutil, nvidia-ml-py, setproctitle for every host venv (pip --target, once)."""
    tag = "py%d%d" % sys.version_info[:2]
    dest = os.path.join(CACHE, "lab-deps", tag)
    marker = os.path.join(dest, ".complete")
    if os.path.exists(marker):
        return dest
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with open(dest + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(marker):
            shutil.rmtree(dest, ignore_errors=True)
            argv = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "--target", dest] + pinned_deps()
            proc = subprocess.run(argv, capture_output=True, text=True)
            if proc.returncode != 0:
                raise LabError("could not install the lab's host packages: %s\n%s" % (" ".join(argv),
                                                                                       proc.stderr[-2000:]))
            with open(marker, "w") as fh:
                fh.write(" ".join(pinned_deps()) + "\n")
    return dest


def sglang_release_dir(version):
    """Directory holding the extracted ``sglang/`` and its dist-info of a real release (overlay lower)."""
    from support.sglang_wheels import sglang_package_dir
    return os.path.dirname(str(sglang_package_dir(version)))


def make_host_files(names, i, k, version, lower, deps, base_python, release_delay_ms, shm_mib):
    name = names.host(i)
    hdir = names.host_dir(i)
    for sub in ("ssh", "bin", "gpu", "run", "state", "overlay/upper", "overlay/work", "models"):
        os.makedirs(os.path.join(hdir, sub), exist_ok=True)
    ip = "%s.%d.%d" % (SUBNET_PREFIX, k, i)
    host = {"name": name, "index": i, "ip": ip, "ip_cidr": ip + "/24", "netns": names.netns(i),
            "veth": names.veth(i), "dir": hdir, "authorized_keys": os.path.join(names.lab_dir, "ssh",
                                                                               "authorized_keys"),
            "release_delay_ms": release_delay_ms, "shm_mib": shm_mib, "sglang_version": version}
    # venv without pip; sglang comes in through the overlay, the shared deps through a .pth
    vdir = os.path.join(hdir, "venv")
    venv.EnvBuilder(symlinks=True, with_pip=False, clear=True).create(vdir)
    pyver = "python%d.%d" % sys.version_info[:2]
    site = os.path.join(vdir, "lib", pyver, "site-packages")
    with open(os.path.join(hdir, "overlay", "upper", "gpufleet-lab-deps.pth"), "w") as fh:
        fh.write(deps + "\n")
    nsutil.mount("overlay", site, "overlay", 0, "lowerdir=%s,upperdir=%s,workdir=%s" % (
        lower, os.path.join(hdir, "overlay", "upper"), os.path.join(hdir, "overlay", "work")))
    host["python"] = os.path.join(vdir, "bin", "python")
    host["site_packages"] = site
    smi = os.path.join(hdir, "bin", "nvidia-smi")
    with open(smi, "w") as fh:
        # -IS (isolated, no site): gpusim needs only the standard library, and its query paths import no more
        # than os, sys, time, _json and _sha256 (gpusim's docstring); a call costs about what the real
        # nvidia-smi's does (~32 ms, issue 14; docs/benchmarks.md), so the lab measures gpufleet, not the
        # simulator. tests/lab/smi_cost.py measures it.
        fh.write("#!%s -IS\n# gpufleet lab: simulated nvidia-smi of %s\nimport sys\nsys.path.insert(0, %r)\n"
                 "import gpusim\nsys.exit(gpusim.main(host_dir=%r))\n" % (base_python, name, HERE, hdir))
    os.chmod(smi, 0o755)
    for model in (TARGET_MODEL, DRAFT_MODEL):
        mdir = os.path.join(hdir, "models", model)
        os.makedirs(mdir, exist_ok=True)
        with open(os.path.join(mdir, "config.json"), "w") as fh:
            json.dump({"architectures": ["LlamaForCausalLM" if model == TARGET_MODEL else "LlamaForCausalLMEagle3"],
                       "model_type": "llama", "_gpufleet_lab": "fake model directory"}, fh)
    with open(os.path.join(hdir, "faults.json"), "w") as fh:
        fh.write("{}\n")
    gpusim.sync_kmsg(hdir, {})
    with open(os.path.join(hdir, "host.json"), "w") as fh:
        json.dump(host, fh, indent=1)
    return host


def wait_ssh(hosts, timeout_s=30):
    deadline = time.time() + timeout_s
    pending = list(hosts)
    while pending:
        still = []
        for h in pending:
            try:
                with socket.create_connection((h["ip"], 22), timeout=1) as s:
                    s.settimeout(2)
                    if not s.recv(64).startswith(b"SSH-"):
                        still.append(h)
            except OSError:
                still.append(h)
        pending = still
        if pending:
            if time.time() > deadline:
                raise LabError("sshd did not answer on %s (see <host dir>/ssh/sshd.log)" % ", ".join(
                    h["name"] for h in pending))
            time.sleep(0.1)


def inventory_docs(names, state, inventory_dirs):
    hosts = {}
    for h in state["hosts"]:
        mdir = os.path.join(h["dir"], "models")
        hosts[h["name"]] = {
            "ansible_host": h["ip"],
            "ansible_python_interpreter": h["python"],
            "sglang_python": h["python"],
            "sglang_launcher": [h["python"], STANDIN],
            "sglang_state_dir": os.path.join(h["dir"], "state"),
            # The server binds the host's lab address, so a router on the bridge (lab_router.py) reaches it;
            # gpufleet's own probes (preflight, launch readiness, verify, check) use sglang_host too.
            "sglang_host": h["ip"],
            "sglang_launch_args": {
                "model-path": os.path.join(mdir, TARGET_MODEL),
                "speculative-draft-model-path": os.path.join(mdir, DRAFT_MODEL),
                "tp-size": 8,
                "speculative-algorithm": "EAGLE3",
                "speculative-num-steps": 3,
                "speculative-eagle-topk": 1,
                "speculative-num-draft-tokens": 4,
                "trust-remote-code": True,
            },
            "lab_host_dir": h["dir"],
            # lab hosts have no /dev/kmsg of their own: check.yml reads the simulator's kernel log for Xid events
            "fleet_check_kmsg_path": os.path.join(h["dir"], "kmsg"),
        }
    group_vars = {
        "ansible_user": "root",
        "ansible_ssh_private_key_file": os.path.join(names.lab_dir, "ssh", "id_ed25519"),
        # host key checking stays on: the lab's own known_hosts holds every host's key
        "ansible_ssh_common_args": "-o UserKnownHostsFile=%s -o StrictHostKeyChecking=yes -o IdentitiesOnly=yes"
                                   % os.path.join(names.lab_dir, "ssh", "known_hosts"),
        # per-lab ControlMaster sockets: a torn-down lab's masters are never reused by the next one
        "ansible_control_path_dir": os.path.join(names.run_dir, "cp"),
        "sglang_launch_method": "process",
        "sglang_port": 30000,
        "sglang_nccl_env": dict(NCCL_ENV),
        "lab_dir": names.lab_dir,
        "lab_sglang_version": state["sglang_version"],
        "lab_init": state.get("init", "process"),
    }
    if state.get("init") == "systemd":
        # an operator's login: a non-root user with sudo; the server runs as the unit's service user
        group_vars.update({"ansible_user": systemd_host.LOGIN_USER, "sglang_launch_method": "systemd",
                           "sglang_service_user": systemd_host.SERVICE_USER,
                           # the venv belongs to root, as an installed SGLang does: the patch needs sudo
                           "sglang_nccl_patch_become": True})
    hosts_doc = {"all": {"children": {"gpu_hosts": {"hosts": hosts}}}}
    header = "# Generated by tests/lab/lab.py up (lab dir %s); rewritten on every lab up.\n" % names.lab_dir
    for d in inventory_dirs:
        os.makedirs(os.path.join(d, "group_vars"), exist_ok=True)
        _write_yaml(os.path.join(d, "hosts.yml"), hosts_doc, header)
        _write_yaml(os.path.join(d, "group_vars", "gpu_hosts.yml"), group_vars, header)


def _write_yaml(path, doc, header):
    try:
        import yaml
        text = yaml.safe_dump(doc, default_flow_style=False, sort_keys=False)
    except ImportError:  # JSON is YAML
        text = json.dumps(doc, indent=2) + "\n"
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(header + text)
    os.replace(tmp, path)


def mem_used_mib():
    info = {}
    with open("/proc/meminfo") as fh:
        for line in fh:
            k, v = line.split(":", 1)
            info[k] = int(v.split()[0])
    return (info["MemTotal"] - info["MemAvailable"]) // 1024


def cmd_up(args):
    if os.geteuid() != 0:
        raise LabError("the lab needs root (network namespaces, mounts, sshd); run as root")
    for tool in ("/usr/sbin/sshd", shutil.which("ip"), shutil.which("ssh-keygen"), shutil.which("nsenter")):
        if not tool or not os.path.exists(tool):
            raise LabError("missing %s: run `make setup` (installs openssh-server, iproute2)" % (tool or "a tool"))
    if not 1 <= args.hosts <= 250:
        raise LabError("--hosts must be 1..250")
    names = Names(args.lab_dir)
    if load_state(names) or os.path.isdir(os.path.join(names.lab_dir, "hosts")):
        log("lab: tearing down the existing lab in %s first" % names.lab_dir)
        cmd_down(args)
    t0 = time.time()
    mem0 = mem_used_mib()
    os.makedirs(names.lab_dir, exist_ok=True)
    os.makedirs(os.path.join(names.lab_dir, "ssh"), exist_ok=True)
    os.makedirs(names.run_dir, exist_ok=True)
    os.makedirs(os.path.join(names.run_dir, "cp"), exist_ok=True)
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    deps = ensure_deps()
    lower = sglang_release_dir(args.sglang_version)
    t_cache = time.time()
    inventory_dirs = [os.path.join(names.lab_dir, "inventory")]
    if args.inventory_dir:
        inventory_dirs.append(os.path.abspath(args.inventory_dir))
    elif names.lab_dir == os.path.realpath(DEFAULT_LAB_DIR):
        inventory_dirs.append(DEFAULT_INVENTORY_DIR)
    with open(GLOBAL_LOCK, "w") as lock:
        # two labs coming up at once must not pick the same subnet
        fcntl.flock(lock, fcntl.LOCK_EX)
        k = pick_subnet(names.tag)
        state = {"lab_dir": names.lab_dir, "tag": names.tag, "bridge": names.bridge, "subnet": "%s.%d.0/24" % (
            SUBNET_PREFIX, k), "k": k, "sglang_version": args.sglang_version, "hosts": [],
            "inventory_dirs": inventory_dirs, "created": time.time(), "complete": False, "init": args.init}
        save_state(names, state)
        batch = ["link add %s type bridge" % names.bridge,
                 "addr add %s.%d.254/24 dev %s" % (SUBNET_PREFIX, k, names.bridge),
                 "link set %s up" % names.bridge]
        for i in range(1, args.hosts + 1):
            batch += ["netns add %s" % names.netns(i),
                      "link add %s type veth peer name eth0 netns %s" % (names.veth(i), names.netns(i)),
                      "link set %s master %s up" % (names.veth(i), names.bridge)]
        run(["ip", "-batch", "-"], input="\n".join(batch).encode() + b"\n", capture_output=True)
    t_net = time.time()
    key = os.path.join(names.lab_dir, "ssh", "id_ed25519")
    if not os.path.exists(key):
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "gpufleet-lab", "-f", key], capture_output=True)
    shutil.copyfile(key + ".pub", os.path.join(names.lab_dir, "ssh", "authorized_keys"))
    base_python = getattr(sys, "_base_executable", sys.executable)
    keygens = []
    for i in range(1, args.hosts + 1):
        hkey = os.path.join(names.host_dir(i), "ssh", "ssh_host_ed25519_key")
        os.makedirs(os.path.dirname(hkey), exist_ok=True)
        keygens.append(subprocess.Popen(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", names.host(i),
                                         "-f", hkey], stdout=subprocess.DEVNULL))
    hosts = []
    for i in range(1, args.hosts + 1):
        hosts.append(make_host_files(names, i, k, args.sglang_version, lower, deps, base_python,
                                     args.release_delay_ms, args.shm_mib))
        state["hosts"] = hosts
    save_state(names, state)
    for p in keygens:
        if p.wait() != 0:
            raise LabError("ssh-keygen failed for a host key")
    t_files = time.time()
    if args.init == "systemd":
        _up_systemd(names, state, hosts, k)
    else:
        _up_process(hosts)
    save_state(names, state)
    with open(os.path.join(names.lab_dir, "ssh", "known_hosts"), "w") as fh:
        for h in hosts:
            with open(os.path.join(h["dir"], "ssh", "ssh_host_ed25519_key.pub")) as pub:
                kt, kb = pub.read().split()[:2]
            fh.write("%s %s %s\n" % (h["ip"], kt, kb))
    wait_ssh(hosts, timeout_s=120 if args.init == "systemd" else 30)
    t_ssh = time.time()
    inventory_docs(names, state, inventory_dirs)
    state["complete"] = True
    state["up_seconds"] = round(time.time() - t0, 2)
    save_state(names, state)
    log("lab up: %d hosts (init %s) in %.1f s (caches %.1f s, network %.1f s, host files+venvs %.1f s, "
        "namespaces+sshd %.1f s); memory in use %+d MiB; subnet %s, bridge %s"
        % (args.hosts, args.init, time.time() - t0, t_cache - t0, t_net - t_cache, t_files - t_net, t_ssh - t_files,
           mem_used_mib() - mem0, state["subnet"], names.bridge))
    log("inventory: %s" % ", ".join(os.path.join(d, "hosts.yml") for d in inventory_dirs))
    return 0


def _up_process(hosts):
    """Hosts whose PID 1 is host_init.py (the default lab)."""
    inits = [(h, subprocess.Popen([sys.executable, os.path.join(HERE, "host_init.py"), h["dir"]],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True))
             for h in hosts]
    errors = []
    for h, p in inits:
        out, err = p.communicate()
        if p.returncode != 0:
            errors.append("%s: %s" % (h["name"], err.decode(errors="replace").strip()))
        else:
            h["init_pid"] = int(out.decode().split()[-1])
    if errors:
        raise LabError("hosts failed to start:\n  " + "\n  ".join(errors))


def _up_systemd(names, state, hosts, k):
    """Hosts whose PID 1 is systemd under systemd-nspawn (systemd_host.py), booted in parallel."""
    try:
        systemd_host.require_tools()
        for h in hosts:
            batch = "link set lo up\naddr add %s dev eth0\nlink set eth0 up\n" % h["ip_cidr"]
            run(["ip", "-n", h["netns"], "-batch", "-"], input=batch.encode(), capture_output=True)
        binds = [ROOT] + ([names.lab_dir] if not names.lab_dir.startswith(ROOT + "/") else [])
        if not CACHE.startswith(ROOT + "/"):
            binds.append(CACHE)
        procs = []
        for h in hosts:
            h["init"] = "systemd"
            merged = systemd_host.prepare_root(h, h["python"], names.lab_dir)
            procs.append((h, systemd_host.start(h, merged, binds)))
        for h, p in procs:
            h["nspawn_pid"] = p.pid
            h["init_pid"] = systemd_host.container_init(p.pid)
        save_state(names, state)
        for h in hosts:
            systemd_host.wait_running(h)
    except systemd_host.SystemdHostError as exc:
        save_state(names, state)
        raise LabError(str(exc))


# ---------------------------------------------------------------------------------------------------
# down
# ---------------------------------------------------------------------------------------------------
def _cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


def lab_init_pids(names):
    """Root-namespace pids of this lab's host init processes (found by their command line)."""
    pids = []
    marker = os.path.join(names.lab_dir, "hosts") + "/"
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            cl = _cmdline(int(entry))
            if cl and _is_lab_init(cl) and marker in cl:
                pids.append(int(entry))
    return pids


def _is_lab_init(cmdline):
    return any(m in cmdline for m in ("host_init.py", "gpufleet-lab-init", "gpufleet.lab_host_dir=", "systemd-nspawn"))


def _lab_init_of(names, pid):
    cl = _cmdline(pid)
    return bool(cl and _is_lab_init(cl)
                and (os.path.join(names.lab_dir, "hosts") + "/") in cl)


def lab_netns_pids(names):
    """Pids of every process inside one of this lab's network namespaces (matched by namespace inode)."""
    inodes = set()
    try:
        for entry in os.listdir("/run/netns"):
            if entry.startswith(names.netns_prefix):
                try:
                    inodes.add(os.stat(os.path.join("/run/netns", entry)).st_ino)
                except OSError:
                    pass
    except OSError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat("/proc/%s/ns/net" % entry).st_ino in inodes:
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


def cmd_down(args):
    names = Names(args.lab_dir)
    import lab_router  # the router lab_router.py started for this lab runs outside the lab's namespaces
    lab_router.stop_all(names.lab_dir)
    state = load_state(names) or {}
    pids = {h.get(key) for h in state.get("hosts", []) for key in ("init_pid", "nspawn_pid") if h.get(key)}
    pids = {p for p in pids if _lab_init_of(names, p)} | set(lab_init_pids(names))
    # plus anything else living in the lab's network namespaces (all of it is the lab's)
    pids |= set(lab_netns_pids(names)) - {os.getpid()}
    # Each host's processes live in a PID namespace whose init we started: killing that init makes the
    # kernel kill everything in the namespace (and nothing else).
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.time() + 10
    while set(lab_netns_pids(names)) and time.time() < deadline:
        time.sleep(0.05)
    # systemd hosts: nspawn (outside the netns) exits once its container is gone; it must have let go of the
    # overlay root before that is unmounted, and leaves /run/systemd/nspawn/propagate/<machine> behind.
    while any(_lab_init_of(names, p) for p in pids if p > 0) and time.time() < deadline:
        time.sleep(0.05)
    for h in state.get("hosts", []):
        if h.get("init") == "systemd":
            shutil.rmtree(systemd_host.propagate_dir(h), ignore_errors=True)
    for mp in nsutil.mounts_under(names.lab_dir):
        try:
            nsutil.umount(mp, nsutil.MNT_DETACH)
        except OSError as exc:
            log("lab: could not unmount %s: %s" % (mp, exc))
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    netns = [line.split()[0] for line in out.splitlines() if line.startswith(names.netns_prefix)]
    batch = ["netns del %s" % n for n in netns]
    batch += ["link del %s" % os.path.basename(p) for p in
              sorted(__import__("glob").glob("/sys/class/net/gfl%sv*" % names.tag))]
    if os.path.exists("/sys/class/net/%s" % names.bridge):
        batch.append("link del %s" % names.bridge)
    if batch:
        subprocess.run(["ip", "-force", "-batch", "-"], input="\n".join(batch).encode() + b"\n",
                       capture_output=True)
    if os.path.isdir(names.lab_dir):
        for entry in os.listdir(names.lab_dir):
            if entry == "cache":
                continue
            path = os.path.join(names.lab_dir, entry)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except FileNotFoundError:  # a second `down` at the same time
                    pass
    shutil.rmtree(names.run_dir, ignore_errors=True)
    inv_dirs = state.get("inventory_dirs") or ([DEFAULT_INVENTORY_DIR]
                                               if names.lab_dir == os.path.realpath(DEFAULT_LAB_DIR) else [])
    for d in inv_dirs:
        for rel in ("hosts.yml", os.path.join("group_vars", "gpu_hosts.yml")):
            try:
                os.unlink(os.path.join(d, rel))
            except FileNotFoundError:
                pass
        try:
            os.rmdir(os.path.join(d, "group_vars"))
        except OSError:
            pass
    log("lab down: %s (%d processes stopped, %d network namespaces removed)" % (names.lab_dir, len(pids), len(netns)))
    return 0


# ---------------------------------------------------------------------------------------------------
# exec, status, fault
# ---------------------------------------------------------------------------------------------------
def require_state(names):
    state = load_state(names)
    if not state or not state.get("hosts"):
        raise LabError("no lab in %s: run `lab.py up --lab-dir %s` first" % (names.lab_dir, names.lab_dir))
    return state


def exec_argv(host, argv, env=None):
    """nsenter argv that runs ``argv`` inside a host (its net, mount, PID, UTS and IPC namespaces)."""
    if not host.get("init_pid"):
        raise LabError("host %s has no running init" % host["name"])
    envs = {"PATH": os.path.join(host["dir"], "bin") + ":/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            gpusim.HOST_DIR_ENV: host["dir"], "HOME": "/root", "LC_ALL": "C"}
    envs.update(env or {})
    return (["nsenter", "-t", str(host["init_pid"]), "-n", "-m", "-p", "-u", "-i", "--", "env", "-i"]
            + ["%s=%s" % kv for kv in envs.items()] + list(argv))


def cmd_exec(args):
    names = Names(args.lab_dir)
    state = require_state(names)
    host = host_entry(state, args.host)
    argv = args.argv[1:] if args.argv and args.argv[0] == "--" else args.argv
    if not argv:
        raise LabError("nothing to run: lab.py exec HOST -- ARGV...")
    return subprocess.call(exec_argv(host, argv))


def _pidns(pid):
    try:
        return os.readlink("/proc/%d/ns/pid" % pid)
    except OSError:
        return None


def cmd_status(args):
    names = Names(args.lab_dir)
    state = require_state(names)
    ns_of = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            ns_of.setdefault(_pidns(int(entry)), []).append(int(entry))
    log("lab %s: %d hosts, subnet %s, bridge %s, sglang %s" % (names.lab_dir, len(state["hosts"]), state["subnet"],
                                                                names.bridge, state["sglang_version"]))
    for h in state["hosts"]:
        pid = h.get("init_pid")
        alive = bool(pid and _lab_init_of(names, pid))
        procs = len(ns_of.get(_pidns(pid), [])) if alive else 0
        gpus = gpusim.gpu_snapshot(h["dir"])
        used = sum(g["used_mib"] for g in gpus)
        faults = gpusim.read_json(os.path.join(h["dir"], "faults.json"), {})
        log("  %-11s %-15s %-5s procs=%-3d gpu_used=%7d MiB  faults=%s" % (
            h["name"], h["ip"], "up" if alive else "DOWN", procs, used, json.dumps(faults, sort_keys=True)))
    return 0


def parse_knob(text):
    if "=" not in text:
        raise LabError("fault knobs are KNOB=VALUE (known: %s)" % ", ".join(sorted(FAULT_KNOBS)))
    k, v = text.split("=", 1)
    if k not in FAULT_KNOBS:
        raise LabError("unknown fault knob %r; known knobs:\n  %s" % (k, "\n  ".join(
            "%s: %s" % kv for kv in sorted(FAULT_KNOBS.items()))))
    if v == "":
        return k, None
    try:
        return k, json.loads(v)
    except ValueError:
        return k, v


def set_faults(host, knobs, clear=False):
    """Merge ``knobs`` into HOST_DIR/faults.json (None removes a knob) and tell the host's init (SIGHUP)."""
    try:
        dcgmi_standin.check_knob(knobs.get("dcgmi"))
    except ValueError as exc:
        raise LabError(str(exc))
    path = os.path.join(host["dir"], "faults.json")
    faults = {} if clear else gpusim.read_json(path, {})
    for k, v in knobs.items():
        if v is None or v is False:
            faults.pop(k, None)
        else:
            faults[k] = v
    gpusim.write_json_atomic(path, faults)
    gpusim.sync_kmsg(host["dir"], faults)  # the simulated kernel log holds the xid knob's lines
    # dcgmi exists on the host only while its knob is set: hosts without it keep having no DCGM
    dcgmi_standin.sync_dcgmi(host["dir"], faults, host.get("python") or sys.executable)
    # SIGHUP to a systemd PID 1 would be a daemon-reload: there the gpusim service applies the knobs
    target = systemd_host.gpusim_pid(host) if host.get("init") == "systemd" else host.get("init_pid")
    if target:
        try:
            os.kill(target, signal.SIGHUP)
        except ProcessLookupError:
            pass
    return faults


def cmd_fault(args):
    names = Names(args.lab_dir)
    state = require_state(names)
    knobs = dict(parse_knob(t) for t in args.knobs)
    targets = state["hosts"] if args.host == "all" else [host_entry(state, args.host)]
    for h in targets:
        faults = set_faults(h, knobs, clear=args.clear)
        log("%s faults: %s" % (h["name"], json.dumps(faults, sort_keys=True)))
    return 0


def cmd_bench_deps(args):
    """SGLang's benchmark client on hosts: its dependencies and the lab tokenizer (bench_deps.py), or --off."""
    names = Names(args.lab_dir)
    state = require_state(names)
    targets = state["hosts"] if args.host == "all" else [host_entry(state, args.host)]
    for h in targets:
        if args.off:
            bench_deps.disable(h)
            continue
        try:
            got = bench_deps.enable(h, log=log)
        except RuntimeError as exc:
            raise LabError(str(exc))
        log("%s: benchmark client dependencies on (%s, %s in %.1f s)" % (
            h["name"], got["deps"], "cached" if got["cached"] else "installed", got["seconds"]))
    return 0


def _weight_hosts(state, names):
    return [host_entry(state, n) for n in names] if names else state["hosts"]


def model_dirs(host):
    """{model name: dir} of a lab host's two models (the inventory's model-path and speculative-draft-model-path)."""
    return {m: os.path.join(host["dir"], "models", m) for m in (TARGET_MODEL, DRAFT_MODEL)}


def cmd_weights(args):
    """A real safetensors checkpoint of --size-mib MiB in each host's target (or draft) model dir, cold in the
    page cache (weights.write_checkpoint); the same size and shards again keep the files; --size-mib 0 removes it."""
    names = Names(args.lab_dir)
    state = require_state(names)
    model = TARGET_MODEL if args.model == "target" else DRAFT_MODEL
    try:
        for h in _weight_hosts(state, args.host):
            got = weights.write_checkpoint(model_dirs(h)[model], args.size_mib, args.shards)
            if args.size_mib == 0:
                log("%s %s: %s" % (h["name"], model, "checkpoint removed" if got["changed"] else "no checkpoint"))
            else:
                log("%s %s: %d MiB in %d shard(s) %s (%d bytes of files, %.1f s)" % (
                    h["name"], model, args.size_mib, args.shards, "written, cold" if got["changed"] else "kept",
                    got["file_bytes"], got["seconds"]))
    except (weights.WeightsError, OSError) as exc:
        raise LabError(str(exc))
    return 0


def cmd_evict(args):
    """posix_fadvise(DONTNEED) on every file of the hosts' model dirs (weights.evict): the page cache is shared
    with every other lab and process on this machine, so never a machine-wide drop_caches."""
    names = Names(args.lab_dir)
    state = require_state(names)
    for h in _weight_hosts(state, args.host):
        files = weights.evict(list(model_dirs(h).values()))
        log("%s: %d file(s) evicted from the page cache" % (h["name"], len(files)))
    return 0


def cmd_resident(args):
    """JSON: per host and model dir, bytes in the page cache and bytes in all (util-linux fincore)."""
    names = Names(args.lab_dir)
    state = require_state(names)
    out = {}
    try:
        for h in _weight_hosts(state, args.host):
            out[h["name"]] = {}
            for model, mdir in model_dirs(h).items():
                got = weights.residency([mdir])
                out[h["name"]][model] = {"path": mdir, "files": len(got),
                                         "weight_files": len(weights.weight_files(mdir)),
                                         "resident_bytes": sum(r for r, _ in got.values()),
                                         "total_bytes": sum(t for _, t in got.values())}
    except weights.WeightsError as exc:
        raise LabError(str(exc))
    sys.stdout.write(json.dumps(out, indent=1, sort_keys=True) + "\n")
    return 0


def lab_dir_first(argv):
    """``argv`` with every ``--lab-dir DIR`` / ``--lab-dir=DIR`` moved right after the subcommand.

    Each subcommand takes ``--lab-dir``, but argparse hands exec's ARGV (REMAINDER) everything after HOST and ends
    fault's KNOB=VALUE list at the first option: ``exec HOST --lab-dir DIR -- ARGV`` ran ``--lab-dir DIR -- ARGV``
    in the default lab and ``fault HOST --lab-dir DIR KNOB=VALUE`` was refused. exec's command is left alone: all
    after a ``--``, or without one all from the first argument after HOST that is not ``--lab-dir``."""
    argv = list(argv)
    if not argv or argv[0].startswith("-"):
        return argv
    moved, rest, positionals, i = [], [], 0, 1
    while i < len(argv) and argv[i] != "--":
        arg = argv[i]
        if arg == "--lab-dir" and i + 1 < len(argv) and argv[i + 1] != "--":
            moved += argv[i:i + 2]
            i += 2
            continue
        if arg.startswith("--lab-dir="):
            moved.append(arg)
        else:
            if argv[0] == "exec" and not arg.startswith("-"):
                positionals += 1
                if positionals == 2:  # exec HOST ARGV... without "--": the command starts here
                    break
            rest.append(arg)
        i += 1
    return argv[:1] + moved + rest + argv[i:]


def main(argv=None):
    argv = lab_dir_first(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="lab.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp):
        sp.add_argument("--lab-dir", default=DEFAULT_LAB_DIR, help="lab state directory (default .lab)")
        return sp

    up = common(sub.add_parser("up", help="bring up N hosts (an existing lab in the dir is torn down first)"))
    up.add_argument("--hosts", type=int, default=8)
    up.add_argument("--sglang-version", default="0.5.23")
    up.add_argument("--inventory-dir", help="also write the inventory here (default: inventory/lab for .lab)")
    up.add_argument("--release-delay-ms", type=int, default=150,
                    help="default delay between a GPU holder's death and its memory being free")
    up.add_argument("--init", choices=("process", "systemd"), default="process",
                    help="PID 1 of each host: host_init.py (default) or Debian's systemd under systemd-nspawn")
    up.add_argument("--shm-mib", type=int, default=1024, help="size of each host's /dev/shm tmpfs")
    common(sub.add_parser("down", help="stop and remove everything the lab made"))
    common(sub.add_parser("status", help="one line per host"))
    ex = common(sub.add_parser("exec", help="run a command inside a host: exec HOST -- ARGV..."))
    ex.add_argument("host")
    ex.add_argument("argv", nargs=argparse.REMAINDER)
    fault_help = "set fault knobs: fault HOST|all KNOB=VALUE ... (VALUE empty clears)"
    fa = common(sub.add_parser("fault", help=fault_help, description=fault_help,
                               epilog="knobs:\n" + "\n".join("  %s: %s" % kv for kv in sorted(FAULT_KNOBS.items())),
                               formatter_class=argparse.RawDescriptionHelpFormatter))
    fa.add_argument("host", help="a lab host name, or all")
    fa.add_argument("knobs", nargs="*", metavar="KNOB=VALUE")
    fa.add_argument("--clear", action="store_true", help="drop all knobs before applying these")
    bd = common(sub.add_parser("bench-deps", help="give hosts SGLang's benchmark client (its dependencies, a "
                                                  "local tokenizer): bench-deps HOST|all [--off]"))
    bd.add_argument("host", help="a lab host name, or all")
    bd.add_argument("--off", action="store_true", help="take them away again")
    host_help = "a lab host name or number (repeat for several; default: every host)"
    we = common(sub.add_parser("weights", help="write a real safetensors checkpoint into hosts' model dirs, cold "
                                                "in the page cache (--size-mib 0 removes it)"))
    we.add_argument("--host", action="append", help=host_help)
    we.add_argument("--size-mib", type=int, required=True, help="MiB of tensor data in all (0: remove)")
    we.add_argument("--model", choices=("target", "draft"), default="target",
                    help="target: %s (model-path); draft: %s (speculative-draft-model-path)" % (
                        TARGET_MODEL, DRAFT_MODEL))
    we.add_argument("--shards", type=int, default=1, help="number of model-0000i-of-0000K.safetensors files")
    ev = common(sub.add_parser("evict", help="drop the hosts' model files from the page cache "
                                             "(posix_fadvise DONTNEED; pages a process maps stay)"))
    ev.add_argument("--host", action="append", help=host_help)
    rs = common(sub.add_parser("resident", help="JSON: bytes of each model dir in the page cache (fincore)"))
    rs.add_argument("--host", action="append", help=host_help)
    args, extra = p.parse_known_args(argv)
    # argparse stops taking KNOB=VALUE after an option (fault HOST --clear slow_load_s=40): take them still.
    if extra and args.cmd == "fault" and all("=" in e and not e.startswith("-") for e in extra):
        args.knobs += extra
    elif extra:
        p.error("unrecognized arguments: %s" % " ".join(extra))
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `lab.py status | head` ends quietly
    try:
        return {"up": cmd_up, "down": cmd_down, "status": cmd_status, "exec": cmd_exec, "fault": cmd_fault,
                "bench-deps": cmd_bench_deps, "weights": cmd_weights, "evict": cmd_evict,
                "resident": cmd_resident}[args.cmd](args)
    except LabError as exc:
        die(str(exc))


if __name__ == "__main__":
    sys.exit(main())
