"""Lab hosts whose PID 1 is Debian's systemd (``lab.py up --init systemd``, ``make lab-up LAB_INIT=systemd``).

Each host boots the machine's own ``/usr/lib/systemd/systemd`` under ``systemd-nspawn --boot`` (Debian package
systemd-container) in the host's network namespace (``--network-namespace-path=/run/netns/<ns>``). Its root is
an overlayfs per host: lower ``/`` (the machine's installed OS: systemd, OpenSSH, sudo, Python), upper
``HOST_DIR/root/upper`` (the host's own ``/etc``, ``/home``, ``/var``; ``/run`` and ``/dev`` are nspawn's
tmpfs). Nothing is written to the machine's ``/etc``: users, sudoers, sshd drop-in, machine-id and units go to
the upper dir. The repository and the lab dir are bound in read-write (the host venvs, the stand-in, the
simulated ``nvidia-smi`` and ``faults.json`` stay live).

Inside a host:
- ``gpufleet-lab.target`` is the boot target (``systemd.unit=`` on the init's command line): basic.target,
  journald, ``gpufleet-lab-gpusim.service`` and ``ssh.service``; the machine's other enabled services
  (databases, timers) do not start;
- ``gpufleet-lab-gpusim.service`` (Type=notify) runs ``host_init.py --unit HOST_DIR``: the GPU simulator
  daemon, the ``nvidia-persistenced`` look-alike monitor, ``/dev/nvidia*`` and ``/proc/driver/nvidia``, and the
  live fault knobs (``lab.py fault`` SIGHUPs this service's main process, not PID 1);
- users: ``sglang`` (system user, the service user) and ``LOGIN_USER`` (``gpufleet``, the lab key, passwordless
  sudo via ``/etc/sudoers.d/gpufleet-lab``); root may log in with the lab key too (the inventory uses
  ``LOGIN_USER``; tests log in as root to check that no sudo runs then);
- ``/usr/local/bin/nvidia-smi`` is the host's simulated ``nvidia-smi`` and the manager's
  ``DefaultEnvironment=`` carries ``GPUFLEET_LAB_HOST_DIR``, so sudo sessions and units find the simulated GPUs.

Needs root, ``systemd-nspawn`` and ``sudo`` on the machine (``make system-packages LAB_INIT=systemd``).
"""
import json
import os
import shutil
import signal
import subprocess
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
LOGIN_USER = "gpufleet"
SERVICE_USER = "sglang"
TARGET = "gpufleet-lab.target"
GPUSIM_UNIT = "gpufleet-lab-gpusim.service"
NSPAWN = "/usr/bin/systemd-nspawn"
SUDO = "/usr/bin/sudo"
# Units of the machine that the overlay root would otherwise start on its own (timers pull apt, man-db...).
MASKED = ("timers.target", "systemd-networkd.service", "systemd-resolved.service", "getty.target",
          "console-getty.service", "systemd-logind.service")


class SystemdHostError(Exception):
    pass


def require_tools():
    missing = [p for p in (NSPAWN, SUDO, "/usr/lib/systemd/systemd", "/usr/sbin/sshd", "/usr/sbin/useradd")
               if not os.path.exists(p)]
    if missing:
        raise SystemdHostError("--init systemd needs %s: run `make system-packages LAB_INIT=systemd` "
                               "(installs systemd-container, sudo)" % ", ".join(missing))


def _write(path, text, mode=0o644):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        fh.write(text)
    os.chmod(path, mode)


def _mask(etc_systemd, unit):
    link = os.path.join(etc_systemd, unit)
    if not os.path.lexists(link):
        os.symlink("/dev/null", link)


def prepare_root(host, python, lab_dir):
    """Mount HOST_DIR/root/merged (overlay over /) and write the host's /etc there. Returns the merged dir."""
    from nsutil import mount  # same dir
    rdir = os.path.join(host["dir"], "root")
    upper, work, merged = (os.path.join(rdir, d) for d in ("upper", "work", "merged"))
    for d in (upper, work, merged):
        os.makedirs(d, exist_ok=True)
    mount("overlay", merged, "overlay", 0, "lowerdir=/,upperdir=%s,workdir=%s" % (upper, work))
    etc = os.path.join(merged, "etc")
    _write(os.path.join(etc, "hostname"), host["name"] + "\n")
    _write(os.path.join(etc, "hosts"), "127.0.0.1 localhost\n%s %s\n" % (host["ip"], host["name"]))
    _write(os.path.join(etc, "machine-id"), uuid.uuid4().hex + "\n", 0o444)
    for user, args in ((SERVICE_USER, ["--system", "--no-create-home", "--home-dir", "/nonexistent",
                                       "--shell", "/usr/sbin/nologin"]),
                       (LOGIN_USER, ["--create-home", "--shell", "/bin/bash"])):
        if subprocess.run(["getent", "passwd", user], capture_output=True).returncode == 0:
            raise SystemdHostError("user %s exists on the machine itself: the lab host would inherit it" % user)
        res = subprocess.run(["/usr/sbin/useradd", "--root", merged] + args + [user], capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemdHostError("useradd %s in %s failed: %s" % (user, merged, res.stderr.strip()))
    home = os.path.join(merged, "home", LOGIN_USER)
    pw = _passwd_ids(os.path.join(etc, "passwd"), LOGIN_USER)
    os.makedirs(os.path.join(home, ".ssh"), exist_ok=True)
    shutil.copyfile(host["authorized_keys"], os.path.join(home, ".ssh", "authorized_keys"))
    for p in (home, os.path.join(home, ".ssh"), os.path.join(home, ".ssh", "authorized_keys")):
        os.chown(p, pw[0], pw[1])
    os.chmod(os.path.join(home, ".ssh"), 0o700)
    # root's own dotfiles on the host: the machine's (pyenv init, rehash locks) would run in every SSH command
    for name in (".bashrc", ".profile"):
        _write(os.path.join(merged, "root", name),
               "# gpufleet lab host %s: root's shell start-up, empty\n" % host["name"])
    root_ssh = os.path.join(merged, "root", ".ssh")
    os.makedirs(root_ssh, mode=0o700, exist_ok=True)
    shutil.copyfile(host["authorized_keys"], os.path.join(root_ssh, "authorized_keys"))
    _write(os.path.join(etc, "sudoers.d", "gpufleet-lab"),
           "# gpufleet lab: the login user may become root without a password (like an operator with sudo)\n"
           "%s ALL=(ALL:ALL) NOPASSWD: ALL\n" % LOGIN_USER, 0o440)
    path_env = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    ssh_key = os.path.join(host["dir"], "ssh", "ssh_host_ed25519_key")
    _write(os.path.join(etc, "ssh", "sshd_config.d", "gpufleet-lab.conf"), "\n".join([
        "# gpufleet lab host %s: first value wins, so these override /etc/ssh/sshd_config" % host["name"],
        "HostKey %s" % ssh_key,
        # root too, with the lab key only: tests check that a root login runs without sudo
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "PubkeyAcceptedAlgorithms ssh-ed25519",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UseDNS no",
        "PrintMotd no",
        "MaxStartups 200:30:400",
        "MaxSessions 200",
        "SetEnv %s=%s" % ("GPUFLEET_LAB_HOST_DIR", host["dir"]),
        ""]))
    # The host venvs' python is a symlink into the controller's Python install, which may live below /root
    # (pyenv): let the login and service users traverse it, on this host's copy of /root only.
    if os.path.isdir(os.path.join(merged, "root")):
        os.chmod(os.path.join(merged, "root"), 0o711)
    smi = os.path.join(merged, "usr", "local", "bin", "nvidia-smi")
    if os.path.lexists(smi):
        os.unlink(smi)
    os.symlink(os.path.join(host["dir"], "bin", "nvidia-smi"), smi)
    sysd = os.path.join(etc, "systemd", "system")
    _write(os.path.join(etc, "systemd", "system.conf.d", "gpufleet-lab.conf"),
           "[Manager]\nDefaultEnvironment=PATH=%s GPUFLEET_LAB_HOST_DIR=%s\n" % (path_env, host["dir"]))
    _write(os.path.join(sysd, TARGET), "\n".join([
        "[Unit]", "Description=gpufleet lab host %s" % host["name"],
        "Requires=basic.target",
        "Wants=systemd-journald.service systemd-user-sessions.service %s ssh.service" % GPUSIM_UNIT,
        "After=basic.target systemd-user-sessions.service %s ssh.service" % GPUSIM_UNIT, "AllowIsolate=yes", ""]))
    _write(os.path.join(sysd, GPUSIM_UNIT), "\n".join([
        "[Unit]", "Description=gpufleet lab: simulated GPUs (gpusimd), GPU monitor, fault knobs",
        "Before=ssh.service", "",
        "[Service]", "Type=notify", "NotifyAccess=main",
        "ExecStart=%s %s --unit %s" % (python, os.path.join(HERE, "host_init.py"), host["dir"]),
        # the stand-ins and the monitor must not die with a restart of the simulator
        "KillMode=mixed", "Restart=on-failure", "",
        "[Install]", "WantedBy=%s" % TARGET, ""]))
    for unit in MASKED:
        _mask(sysd, unit)
    # ssh.service is enabled on the machine through multi-user.target; the lab target pulls it in itself.
    return merged


def _passwd_ids(passwd, user):
    with open(passwd) as fh:
        for line in fh:
            f = line.split(":")
            if f[0] == user:
                return int(f[2]), int(f[3])
    raise SystemdHostError("user %s missing from %s" % (user, passwd))


def machine_name(host):
    return "gfl-%s" % host["netns"].split("-", 1)[1]


def propagate_dir(host):
    """Directory nspawn creates per machine on the machine (/run, not /etc) and does not remove when killed."""
    return os.path.join("/run/systemd/nspawn/propagate", machine_name(host))


def start(host, merged, binds):
    """Boot the host: systemd-nspawn in the host's netns. Returns the Popen of nspawn (its own session)."""
    log = open(os.path.join(host["dir"], "console.log"), "ab")
    argv = [NSPAWN, "--quiet", "--boot", "--directory", merged, "--register=no", "--keep-unit",
            "--machine", machine_name(host), "--hostname", host["name"],
            "--network-namespace-path", os.path.join("/run/netns", host["netns"]),
            "--console=read-only", "--resolv-conf=off", "--timezone=off", "--link-journal=no"]
    argv += ["--bind=%s" % b for b in binds]
    argv += ["--", "systemd.unit=%s" % TARGET, "gpufleet.lab_host_dir=%s" % host["dir"]]
    try:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    finally:
        log.close()


def container_init(nspawn_pid, timeout_s=30):
    """Root-namespace pid of the host's systemd (PID 1 inside): nspawn → its child → systemd."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        for pid in _descendants(nspawn_pid):
            try:
                with open("/proc/%d/status" % pid) as fh:
                    nspid = [ln for ln in fh if ln.startswith("NSpid:")]
            except OSError:
                continue
            if nspid and nspid[0].split()[-1] == "1" and len(nspid[0].split()) > 2:
                return pid
        time.sleep(0.05)
    raise SystemdHostError("systemd-nspawn (pid %d) started no init within %d s" % (nspawn_pid, timeout_s))


def _descendants(pid):
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open("/proc/%d/task/%d/children" % (p, p)) as fh:
                kids = [int(x) for x in fh.read().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def wait_running(host, timeout_s=90, retries=1):
    """Wait until the host's systemd reports running; raises with the failed units otherwise.

    A unit of the boot that failed (seen once under CI load: systemd-user-sessions.service on a 2-core machine
    running two labs) is started once more, ``retries`` times, before the host counts as broken; the error then
    quotes the unit's journal."""
    deadline = time.time() + timeout_s
    state = ""
    while time.time() < deadline:
        res = subprocess.run(enter(host, ["systemctl", "is-system-running"]), capture_output=True, text=True)
        state = res.stdout.strip()
        if state in ("running", "degraded"):
            if state == "degraded":
                failed = subprocess.run(enter(host, ["systemctl", "--failed", "--no-legend", "--plain"]),
                                        capture_output=True, text=True).stdout.strip()
                units = [line.split()[0] for line in failed.splitlines() if line.split()]
                if retries > 0 and units:
                    subprocess.run(enter(host, ["systemctl", "reset-failed"] + units), capture_output=True)
                    subprocess.run(enter(host, ["systemctl", "start"] + units), capture_output=True, timeout=60)
                    retries -= 1
                    continue
                journal = subprocess.run(enter(host, ["journalctl", "--no-pager", "-n", "20", "-o", "cat"]
                                               + ["--unit=%s" % u for u in units]),
                                         capture_output=True, text=True).stdout.strip()
                raise SystemdHostError("host %s: systemd is degraded, failed units: %s; their journal:\n%s"
                                       % (host["name"], failed, journal))
            return
        time.sleep(0.2)
    raise SystemdHostError("host %s: systemd did not reach running in %d s (last state %r; see %s/console.log)"
                           % (host["name"], timeout_s, state, host["dir"]))


def enter(host, argv):
    """nsenter argv running ``argv`` as root inside the host (all its namespaces)."""
    return ["nsenter", "-t", str(host["init_pid"]), "-a", "--"] + list(argv)


def gpusim_pid(host):
    """Root-namespace pid of the host's gpusim service (the target of fault SIGHUPs), or None."""
    marker = "--unit %s" % host["dir"]
    for pid in _descendants(host.get("init_pid") or 0):
        try:
            with open("/proc/%d/cmdline" % pid, "rb") as fh:
                cl = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "host_init.py" in cl and cl.rstrip().endswith(marker):
            return pid
    return None


def notify_ready():
    """sd_notify(READY=1) without libsystemd (Type=notify units)."""
    import socket
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(b"READY=1", addr)


def stop(host):
    """SIGKILL the host's init (the kernel then kills everything in its PID namespace); nspawn exits."""
    for key in ("init_pid", "nspawn_pid"):
        pid = host.get(key)
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def describe(host):
    return json.dumps({k: host.get(k) for k in ("name", "init_pid", "nspawn_pid")})
