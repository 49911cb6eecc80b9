"""One lab host: namespaces, /dev, sshd, the GPU simulator daemon (gpusimd) and the GPU monitor.

Started by ``lab.py up`` once per host as ``python host_init.py HOST_DIR``. It reads ``HOST_DIR/host.json``,
joins the host's network namespace (made by ``ip netns add``), unshares mount, PID, UTS and IPC namespaces
and forks: the child is PID 1 of the host. The parent prints the child's PID (as the root namespace sees it)
once the host is ready, then exits; ``lab.py`` records it and ``lab.py down`` kills it, which makes the
kernel kill every process of the host (a PID namespace dies with its init).

PID 1 of the host:
- mounts a fresh /proc (so processes of other hosts are invisible), a tmpfs /dev with null, zero, full,
  random, urandom, tty bound in, a private devpts, a per-host tmpfs /dev/shm, and plain files
  /dev/nvidia0..7, /dev/nvidiactl, /dev/nvidia-uvm (opened by simulated GPU users, found by /proc/*/fd scans);
- configures eth0 and lo, sets the hostname; hides the lab machine's /root/.bashrc and .profile behind empty
  files (bash would run them for every SSH command);
- forks the monitor (titled ``nvidia-persistenced``; keeps /dev/nvidiactl and /dev/nvidia0 open; gpufleet
  must never kill it);
- starts the real OpenSSH sshd (``-D``) with the host's config;
- serves gpusimd on the abstract unix socket ``gpusim.GPUSIMD_SOCKET`` (per network namespace): holders
  register memory; EOF on a holder's connection releases it ``release_delay_ms`` later (fault knobs
  ``release_delay_ms``, ``memory_never_released``); writes HOST_DIR/gpu/state.json atomically;
- reaps orphans (it is PID 1), applies live fault knobs on SIGHUP (``port_held``, ``stale_shm``,
  memory release) and kills the host's processes on SIGTERM.
"""
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpusim  # noqa: E402
import nsutil  # noqa: E402

try:
    from setproctitle import setproctitle
except ImportError:  # titles are cosmetic for the init itself
    def setproctitle(_title):
        pass

DEV_FILES = ("null", "zero", "full", "random", "urandom", "tty")
NVIDIA_FILES = ["nvidia%d" % i for i in range(gpusim.GPU_COUNT)] + ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]


def log(msg):
    sys.stderr.write("%s host_init[%d]: %s\n" % (time.strftime("%H:%M:%S"), os.getpid(), msg))
    sys.stderr.flush()


def load_faults(host_dir):
    return gpusim.read_json(os.path.join(host_dir, "faults.json"), {})


# ---------------------------------------------------------------------------------------------------
# set-up inside the namespaces
# ---------------------------------------------------------------------------------------------------
def setup_dev(host_dir, shm_mib):
    stage = os.path.join(host_dir, "run", "dev")
    os.makedirs(stage, exist_ok=True)
    nsutil.mount("tmpfs", stage, "tmpfs", nsutil.MS_NOSUID, "mode=755,size=1024k")
    for name in DEV_FILES:
        target = os.path.join(stage, name)
        open(target, "w").close()
        nsutil.mount("/dev/" + name, target, None, nsutil.MS_BIND)
    os.mkdir(os.path.join(stage, "pts"))
    nsutil.mount("devpts", os.path.join(stage, "pts"), "devpts", nsutil.MS_NOSUID | nsutil.MS_NOEXEC,
                 "newinstance,ptmxmode=0666,mode=620,gid=5")
    os.symlink("pts/ptmx", os.path.join(stage, "ptmx"))
    os.mkdir(os.path.join(stage, "shm"))
    nsutil.mount("tmpfs", os.path.join(stage, "shm"), "tmpfs", nsutil.MS_NOSUID | nsutil.MS_NODEV,
                 "mode=1777,size=%dm" % shm_mib)
    for link, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, os.path.join(stage, link))
    for name in NVIDIA_FILES:
        path = os.path.join(stage, name)
        open(path, "w").close()
        os.chmod(path, 0o666)
    with open(os.path.join(stage, ".gpufleet-lab-host"), "w") as fh:
        fh.write(host_dir + "\n")
    nsutil.mount(stage, "/dev", None, nsutil.MS_MOVE)


def setup_proc_driver(host_name):
    """/proc/driver/nvidia as the driver shows it (version, gpus/<bus id>/information with "Device Minor"),
    on a tmpfs over the fresh procfs's /proc/driver of this host: tools map GPUs to /dev/nvidiaN with it."""
    root = "/proc/driver"
    nsutil.mount("tmpfs", root, "tmpfs", nsutil.MS_NOSUID | nsutil.MS_NODEV | nsutil.MS_NOEXEC, "mode=555,size=256k")
    os.makedirs(os.path.join(root, "nvidia", "gpus"))
    with open(os.path.join(root, "nvidia", "version"), "w") as fh:
        fh.write("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  %s  Release Build  (gpufleet lab)\n"
                 "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n" % gpusim.DRIVER_VERSION)
    for g in gpusim.gpu_identities(host_name):
        bus = "%04x:%s" % (int(g["pci_bus_id"][:8], 16), g["pci_bus_id"][9:].lower())
        d = os.path.join(root, "nvidia", "gpus", bus)
        os.makedirs(d)
        with open(os.path.join(d, "information"), "w") as fh:
            fh.write("Model: \t\t %s\nIRQ:   \t\t %d\nGPU UUID: \t %s\nVideo BIOS: \t 96.00.a5.00.1a\n"
                     "Bus Type: \t PCIe\nDMA Size: \t 52 bits\nDMA Mask: \t 0xfffffffffffff\n"
                     "Bus Location: \t %s\nDevice Minor: \t %d\nGPU Firmware: \t %s\nGPU Excluded:\t No\n"
                     % (gpusim.GPU_NAME, 100 + g["index"], g["uuid"], bus, g["minor_number"], gpusim.DRIVER_VERSION))


def setup_home(host_dir):
    """Hide the lab machine's shell start-up files in root's home: empty files from HOST_DIR/home-root are bound
    over /root/.bashrc, .profile, .bash_profile and .bash_login where they exist (the rest of /root stays: the
    hosts' Python may live there, e.g. under pyenv).

    sshd runs every command through the login shell, and bash sources ~/.bashrc for each SSH command; a builder's
    /root/.bashrc (pyenv init, for one) costs ~0.15 s of CPU per task, which a GPU host's root does not pay.
    """
    empty_dir = os.path.join(host_dir, "home-root")
    os.makedirs(empty_dir, mode=0o700, exist_ok=True)
    for name in (".bashrc", ".profile", ".bash_profile", ".bash_login"):
        target = os.path.join("/root", name)
        if os.path.isfile(target):
            empty = os.path.join(empty_dir, name)
            open(empty, "w").close()
            nsutil.mount(empty, target, None, nsutil.MS_BIND)


def setup_net(ip_cidr):
    script = "link set lo up\naddr add %s dev eth0\nlink set eth0 up\n" % ip_cidr
    subprocess.run(["ip", "-batch", "-"], input=script.encode(), check=True)


def write_sshd_config(host, host_dir):
    ssh_dir = os.path.join(host_dir, "ssh")
    path_env = os.path.join(host_dir, "bin") + ":/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    cfg = [
        "# written by tests/lab/host_init.py for lab host %s" % host["name"],
        "Port 22",
        "ListenAddress 0.0.0.0",
        "HostKey %s" % os.path.join(ssh_dir, "ssh_host_ed25519_key"),
        "PidFile %s" % os.path.join(ssh_dir, "sshd.pid"),
        "AuthorizedKeysFile %s" % host["authorized_keys"],
        # root login with the lab key only
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "PubkeyAcceptedAlgorithms ssh-ed25519",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        # the lab dir may sit below world-writable /tmp, which StrictModes refuses for key files
        "StrictModes no",
        "UseDNS no",
        "PrintMotd no",
        "PrintLastLog no",
        "MaxStartups 200:30:400",
        "MaxSessions 200",
        "Subsystem sftp internal-sftp",
        "AcceptEnv LANG LC_*",
        # SetEnv overrides sshd's default PATH (sshd_config(5)): SSH sessions find the simulated nvidia-smi.
        "SetEnv PATH=%s %s=%s" % (path_env, gpusim.HOST_DIR_ENV, host_dir),
    ]
    cfg_path = os.path.join(ssh_dir, "sshd_config")
    with open(cfg_path, "w") as fh:
        fh.write("\n".join(cfg) + "\n")
    return cfg_path


# ---------------------------------------------------------------------------------------------------
# gpusimd
# ---------------------------------------------------------------------------------------------------
class Gpusimd:
    """Memory bookkeeping for the host's simulated GPUs (see module docstring)."""

    def __init__(self, host_dir, default_delay_ms):
        self.host_dir = host_dir
        self.default_delay_ms = default_delay_ms
        self.allocs = []  # dicts: id, gpu, mib, pid, name, released_at (None | epoch s | "never"), conn
        self.util = {}  # conn fd -> {gpu: pct}
        self.next_id = 1
        self.state_path = os.path.join(host_dir, "gpu", "state.json")
        self.on_release = None  # callable(set of GPU indices) when a holder's connection closes
        os.makedirs(os.path.dirname(self.state_path), exist_ok=True)
        self.write()

    def delay_s(self):
        faults = load_faults(self.host_dir)
        if faults.get("memory_never_released"):
            return None
        return float(faults.get("release_delay_ms", self.default_delay_ms)) / 1000.0

    def hold(self, conn_fd, peer_pid, msg):
        gpu = int(msg["gpu"])
        mib = int(msg["mib"])
        if not 0 <= gpu < gpusim.GPU_COUNT or mib < 0:
            raise ValueError("gpu must be 0..%d and mib >= 0" % (gpusim.GPU_COUNT - 1))
        # Like CUDA: an allocation that does not fit beside what is held (or not yet released) fails; a real H200
        # has 143771 MiB, 616 of them reserved by the driver, and a rollback onto memory still held runs out.
        now = time.time()
        in_use = sum(a["mib"] + gpusim.CONTEXT_OVERHEAD_MIB for a in self.allocs if a["gpu"] == gpu and (
            a["released_at"] in (None, "never") or (isinstance(a["released_at"], (int, float)) and a["released_at"] > now)))
        capacity = gpusim.MEMORY_TOTAL_MIB - gpusim.MEMORY_RESERVED_MIB
        if in_use + mib + gpusim.CONTEXT_OVERHEAD_MIB > capacity:
            raise ValueError("CUDA out of memory. Tried to allocate %d MiB on GPU %d, which has %d MiB in use of %d MiB "
                             "(lab gpusimd)" % (mib, gpu, in_use, capacity))
        self.allocs.append({"id": self.next_id, "gpu": gpu, "mib": mib, "pid": int(msg.get("pid") or peer_pid),
                            "name": msg.get("name"), "released_at": None, "conn": conn_fd,
                            "hidden": bool(msg.get("hidden"))})
        self.next_id += 1
        self.write()

    def set_util(self, conn_fd, msg):
        self.util[conn_fd] = {int(g): int(msg["pct"]) for g in msg["gpus"]}
        self.write()

    def closed(self, conn_fd):
        delay = self.delay_s()
        now = time.time()
        gpus = set()
        for a in self.allocs:
            if a["conn"] == conn_fd and a["released_at"] is None:
                a["released_at"] = "never" if delay is None else now + delay
                a["conn"] = None
                gpus.add(a["gpu"])
        self.util.pop(conn_fd, None)
        self.write()
        if gpus and self.on_release is not None:
            self.on_release(gpus)

    def reconsider(self):
        """After a fault change: memory kept 'never' gets released after the current delay."""
        delay = self.delay_s()
        if delay is None:
            return
        now = time.time()
        for a in self.allocs:
            if a["released_at"] == "never":
                a["released_at"] = now + delay
        self.write()

    def timeout(self):
        now = time.time()
        pending = [a["released_at"] for a in self.allocs if isinstance(a["released_at"], float)]
        expired = [t for t in pending if t <= now]
        if expired:
            self.allocs = [a for a in self.allocs
                           if not (isinstance(a["released_at"], float) and a["released_at"] <= now)]
            self.write()
            pending = [t for t in pending if t > now]
        return (min(pending) - now + 0.001) if pending else None

    def write(self):
        util = {}
        for per in self.util.values():
            for g, pct in per.items():
                util[str(g)] = max(util.get(str(g), 0), pct)
        gpusim.write_json_atomic(self.state_path, {
            "allocs": [{k: v for k, v in a.items() if k != "conn"} for a in self.allocs],
            "util": util,
            "written": time.time(),
        })


class HostInit:
    def __init__(self, host_dir):
        self.host_dir = host_dir
        with open(os.path.join(host_dir, "host.json")) as fh:
            self.host = json.load(fh)
        self.sel = selectors.DefaultSelector()
        self.conns = {}
        self.children = {}  # pid -> role
        self.stray_pid = None
        self.hidden_pid = None
        self.stopping = False
        self.reload = False

    # children -----------------------------------------------------------------------------------
    def _fork_child(self, role, title, body):
        pid = os.fork()
        if pid == 0:
            try:
                signal.set_wakeup_fd(-1)
                for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGINT):
                    signal.signal(sig, signal.SIG_DFL)
                os.closerange(3, 4096)
                setproctitle(title)
                body()
            except BaseException as exc:  # noqa: B902 - a forked child must never return into the loop
                log("%s failed: %r" % (role, exc))
            finally:
                os._exit(0)
        self.children[pid] = role
        return pid

    def start_monitor(self):
        def body():
            # Like nvidia-persistenced/dcgm: keeps the control node and a GPU node open.
            nsutil.set_comm("nvidia-persistenced")
            fds = [os.open("/dev/nvidiactl", os.O_RDWR), os.open("/dev/nvidia0", os.O_RDWR)]  # noqa: F841
            while True:
                signal.pause()
        self._fork_child("monitor", "/usr/bin/nvidia-persistenced --user nvidia-persistenced --verbose", body)

    def start_sshd(self):
        cfg = write_sshd_config(self.host, self.host_dir)
        log_path = os.path.join(self.host_dir, "ssh", "sshd.log")
        proc = subprocess.Popen(["/usr/sbin/sshd", "-D", "-f", cfg, "-E", log_path],
                                stdin=subprocess.DEVNULL, close_fds=True)
        self.children[proc.pid] = "sshd"
        # subprocess keeps a handle; we reap ourselves as PID 1.
        proc.returncode = 0

    def apply_faults(self):
        faults = load_faults(self.host_dir)
        port = faults.get("port_held")
        if port and self.stray_pid is None:
            port = 30000 if port is True else int(port)

            def body():
                s = socket.socket()
                # like any server, ignore TIME_WAIT leftovers; a live listener still blocks the port
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("0.0.0.0", port))
                s.listen(8)
                while True:
                    signal.pause()
            self.stray_pid = self._fork_child("stray", "stray-listener :%d" % port, body)
        elif not port and self.stray_pid is not None:
            try:
                os.kill(self.stray_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.stray_pid = None
        # hidden_holder_after_stop: the holder starts when a holder of that GPU goes (on_holder_released); until
        # then, and once the knob is cleared, hidden_holder alone decides.
        if not (faults.get("hidden_holder_after_stop") and self.hidden_pid is not None):
            self.apply_hidden_holder(faults.get("hidden_holder"))
        shm = faults.get("stale_shm")
        if shm:
            size = (int(shm) if not isinstance(shm, bool) and int(shm) > 1 else 1) << 20
            for name in ("nccl-lab%04d" % os.getpid(), "sgl_shm_1", "cuda.shm.0"):
                path = os.path.join("/dev/shm", name)
                if not os.path.exists(path):
                    # Allocated, not truncated: a sparse file takes no tmpfs space, and stale_shm=<MiB> is
                    # documented as the way to fill /dev/shm. A full tmpfs keeps what fitted.
                    with open(path, "wb") as fh:
                        try:
                            os.posix_fallocate(fh.fileno(), 0, size)
                        except OSError:
                            pass
        self.gpusimd.reconsider()

    def apply_hidden_holder(self, knob):
        """Knob ``hidden_holder`` ({"gpu": N, "mib": M}): a process holding M MiB on GPU N that nvidia-smi does not
        list (a container's process: its pid is in another PID namespace), with only /dev/nvidiactl and
        /dev/nvidia-uvm open; titled like an inference job of someone else, never like SGLang. Ends when the knob
        goes (lab.py fault HOST hidden_holder=, or cleared faults)."""
        if knob and self.hidden_pid is None:
            gpu, mib = int(knob.get("gpu", 3)), int(knob.get("mib", 20000))

            def body():
                fds = [os.open("/dev/nvidiactl", os.O_RDWR), os.open("/dev/nvidia-uvm", os.O_RDWR)]  # noqa: F841
                sock = gpusim.hold(gpu, mib, name="python3", hidden=True)  # noqa: F841 - held while open
                while True:
                    signal.pause()
            self.hidden_pid = self._fork_child("hidden holder", "python3 /srv/batch/embed_worker.py --device cuda:%d"
                                               % gpu, body)
        elif not knob and self.hidden_pid is not None:
            try:
                os.kill(self.hidden_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.hidden_pid = None

    def on_holder_released(self, gpus):
        """Knob ``hidden_holder_after_stop`` ({"gpu": N, "mib": M}): the hidden holder of ``hidden_holder`` starts
        the moment a holder of GPU N goes (the server's worker, at its stop), before that memory is released: another
        job that takes GPU memory while the host is between servers, after preflight read it."""
        knob = load_faults(self.host_dir).get("hidden_holder_after_stop")
        if knob and self.hidden_pid is None and int(knob.get("gpu", 3)) in gpus:
            self.apply_hidden_holder(knob)

    # signals ------------------------------------------------------------------------------------
    def _on_sigchld(self, *_):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            role = self.children.pop(pid, None)
            if pid == self.stray_pid:
                self.stray_pid = None
            if pid == self.hidden_pid:
                self.hidden_pid = None
            if role and not self.stopping:
                log("%s (pid %d) exited with status %d" % (role, pid, status))

    def _on_sighup(self, *_):
        self.reload = True

    def _on_sigterm(self, *_):
        self.stopping = True

    # main ---------------------------------------------------------------------------------------
    def run(self, ready_fd, unit=False):
        """Serve the host. ``unit``: run as a systemd service of a host whose PID 1 is systemd (--unit):
        no /proc, /dev, hostname, network or sshd set-up (systemd-nspawn and the host's units do that);
        only the /dev/nvidia* files, /proc/driver/nvidia, the monitor, gpusimd and the fault knobs."""
        h = self.host
        if unit:
            setproctitle("gpufleet-lab-gpusim %s --unit %s" % (h["name"], self.host_dir))
            for name in NVIDIA_FILES:
                path = os.path.join("/dev", name)
                open(path, "a").close()
                os.chmod(path, 0o666)
            try:
                setup_proc_driver(h["name"])
            except OSError as exc:  # nspawn may forbid mounts below /proc; tools then see no /proc/driver
                log("no /proc/driver/nvidia: %s" % exc)
        else:
            setproctitle("gpufleet-lab-init %s (gpusimd) %s" % (h["name"], self.host_dir))
            nsutil.mount("proc", "/proc", "proc", nsutil.MS_NOSUID | nsutil.MS_NODEV | nsutil.MS_NOEXEC)
            setup_dev(self.host_dir, int(h.get("shm_mib", 1024)))
            setup_proc_driver(h["name"])
            socket.sethostname(h["name"])
            setup_net(h["ip_cidr"])
            setup_home(self.host_dir)
        self.gpusimd = Gpusimd(self.host_dir, float(h.get("release_delay_ms", 150)))
        self.gpusimd.on_release = self.on_holder_released
        signal.signal(signal.SIGCHLD, self._on_sigchld)
        signal.signal(signal.SIGHUP, self._on_sighup)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        signal.signal(signal.SIGINT, self._on_sigterm)
        self.start_monitor()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(gpusim.GPUSIMD_SOCKET)
        listener.listen(256)
        listener.setblocking(False)
        self.sel.register(listener, selectors.EVENT_READ, "listener")
        if not unit:
            self.start_sshd()
        self.apply_faults()
        wakeup_r, wakeup_w = os.pipe()
        os.set_blocking(wakeup_w, False)
        os.set_blocking(wakeup_r, False)
        signal.set_wakeup_fd(wakeup_w)
        self.sel.register(wakeup_r, selectors.EVENT_READ, "wakeup")
        if ready_fd is None:
            import systemd_host
            systemd_host.notify_ready()
        else:
            os.write(ready_fd, b"ok\n")
            os.close(ready_fd)
        log("host %s ready" % h["name"])
        while not self.stopping:
            if self.reload:
                self.reload = False
                self.apply_faults()
            for key, _ in self.sel.select(self.gpusimd.timeout()):
                if key.data == "listener":
                    self._accept(listener)
                elif key.data == "wakeup":
                    try:
                        os.read(wakeup_r, 4096)
                    except BlockingIOError:
                        pass
                else:
                    self._read(key.fileobj)
        self.shutdown()

    def _accept(self, listener):
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        peer_pid = int.from_bytes(creds[0:4], sys.byteorder)
        conn.setblocking(False)
        self.conns[conn.fileno()] = {"sock": conn, "buf": b"", "pid": peer_pid}
        self.sel.register(conn, selectors.EVENT_READ, "conn")

    def _read(self, conn):
        fd = conn.fileno()
        state = self.conns[fd]
        try:
            data = conn.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.sel.unregister(conn)
            del self.conns[fd]
            self.gpusimd.closed(fd)
            conn.close()
            return
        state["buf"] += data
        while b"\n" in state["buf"]:
            line, state["buf"] = state["buf"].split(b"\n", 1)
            try:
                msg = json.loads(line)
                if msg.get("op") == "hold":
                    self.gpusimd.hold(fd, state["pid"], msg)
                elif msg.get("op") == "util":
                    self.gpusimd.set_util(fd, msg)
                else:
                    raise ValueError("unknown op %r" % msg.get("op"))
                reply = {"ok": True}
            except (ValueError, KeyError, TypeError) as exc:
                reply = {"ok": False, "error": str(exc)}
            try:
                conn.sendall((json.dumps(reply) + "\n").encode())
            except OSError:
                pass

    def shutdown(self):
        log("stopping host %s" % self.host["name"])
        # Exiting PID 1 makes the kernel SIGKILL everything left in this PID namespace.
        for pid in list(self.children):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os._exit(0)


def main():
    if sys.argv[1] == "--unit":  # gpufleet-lab-gpusim.service inside a systemd lab host (systemd_host.py)
        HostInit(os.path.abspath(sys.argv[2])).run(None, unit=True)
        return 0
    host_dir = os.path.abspath(sys.argv[1])
    with open(os.path.join(host_dir, "host.json")) as fh:
        host = json.load(fh)
    netns_fd = os.open(os.path.join("/run/netns", host["netns"]), os.O_RDONLY)
    nsutil.setns(netns_fd, nsutil.CLONE_NEWNET)
    os.close(netns_fd)
    nsutil.unshare(nsutil.CLONE_NEWNS | nsutil.CLONE_NEWPID | nsutil.CLONE_NEWUTS | nsutil.CLONE_NEWIPC)
    nsutil.mount(None, "/", None, nsutil.MS_REC | nsutil.MS_PRIVATE)
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        os.setsid()
        logf = os.open(os.path.join(host_dir, "init.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        devnull = os.open("/dev/null", os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(logf, 1)
        os.dup2(logf, 2)
        try:
            HostInit(host_dir).run(ready_w)
        except BaseException as exc:  # report set-up failures to lab.py, then die (takes the ns with it)
            try:
                os.write(ready_w, ("error: %s: %s\n" % (type(exc).__name__, exc)).encode())
            except OSError:
                pass
            log("failed: %r" % (exc,))
            os._exit(1)
        os._exit(0)
    os.close(ready_w)
    with os.fdopen(ready_r) as fh:
        answer = fh.readline().strip()
    if answer != "ok":
        sys.stderr.write("lab host %s did not come up: %s (see %s/init.log)\n" % (
            host["name"], answer or "init died", host_dir))
        return 1
    print(pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
