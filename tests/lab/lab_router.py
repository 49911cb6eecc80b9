#!/usr/bin/env python3
"""The real router (PyPI ``sglang-router`` 0.3.2, or its successor ``smg``) in front of a lab fleet, on the controller side.

    lab_router.py start --lab-dir DIR [--router sglang-router|smg] [--port 38000] [--python PY] [-- EXTRA ROUTER FLAGS...]
    lab_router.py stop  --lab-dir DIR

``start`` runs ``python -m sglang_router.launch_router`` (``--router smg``: ``python -m smg.launch_router``, both
pinned in requirements/controller.txt) in the root network namespace, bound to the lab bridge's
address (``10.213.K.254``: the hosts' stand-ins, which bind their lab IP, are reachable from there and the
controller reaches the router there), with every lab host's server as a worker (``http://<host ip>:<sglang_port>``),
round-robin policy, its Prometheus exporter on the bridge at port+1, the router's defaults otherwise (retries, circuit breaker, health checks). It waits until
``GET /workers`` lists every worker healthy, records the pid in ``<lab dir>/router.json`` and prints the URL.
``stop`` ends that pid (checked by its command line) and removes the record; ``lab.py down`` calls it too.
Library use: ``start(lab_dir, ..., router="smg", control_plane_key=KEY)`` → ``{"url", "metrics_url", "pid", "log",
"workers", "router", "version"}``, ``stop(lab_dir)``. ``control_plane_key`` (smg only) guards the worker routes with
``--control-plane-api-keys gpufleet:gpufleet:admin:KEY``.
"""
import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

ROUTERS = {"sglang-router": "sglang_router.launch_router", "smg": "smg.launch_router"}
ROUTER_MODULE = ROUTERS["sglang-router"]


def _record(lab_dir, name="router"):
    """<lab dir>/<name>.json: a lab may run several routers, each under its own name (router, router-smg, ...)."""
    return os.path.join(os.path.realpath(lab_dir), "%s.json" % name)


def _lab_state(lab_dir):
    with open(os.path.join(os.path.realpath(lab_dir), "lab.json")) as fh:
        return json.load(fh)


def bridge_ip(state):
    """The lab bridge's address, 10.213.K.254 (lab.py up gives the bridge .254 of the lab's /24)."""
    return state["subnet"].split("/")[0].rsplit(".", 1)[0] + ".254"


def worker_urls(state, port=30000, hosts=None):
    """Worker URLs of the lab's hosts (or of the host names in ``hosts``), in lab order."""
    return ["http://%s:%d" % (h["ip"], port) for h in state["hosts"] if hosts is None or h["name"] in hosts]


def get_json(url, timeout=5, key=None):
    req = urllib.request.Request(url, headers={"Authorization": "Bearer " + key} if key else {})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read().decode())


def healthy_workers(url, key=None):
    """Worker URLs the router lists with is_healthy true ([] when it does not answer)."""
    try:
        return sorted(w["url"] for w in get_json(url + "/workers", key=key).get("workers", []) if w.get("is_healthy"))
    except (OSError, ValueError):
        return []


def version(router):
    from importlib.metadata import version as dist_version
    return dist_version(router)


# sglang-router retitles its process once it runs: /proc/PID/cmdline then reads "sglang::router" (padded), no
# longer the module it was started as. Matching only the module let stop() miss it and leave the router running.
ROUTER_TITLES = (b"sglang::router", b"smg::router")


def _alive_router(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as fh:
            cmdline = fh.read()
        with open("/proc/%d/stat" % pid, "rb") as fh:
            state = fh.read().rsplit(b") ", 1)[1][:1]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X") and (any(m.encode() in cmdline for m in ROUTERS.values())
                                          or cmdline.startswith(ROUTER_TITLES))


def stop_all(lab_dir):
    """Stop every router started for this lab (lab.py down)."""
    for path in glob.glob(os.path.join(os.path.realpath(lab_dir), "router*.json")):
        stop(lab_dir, os.path.basename(path)[:-len(".json")])


def stop(lab_dir, name="router"):
    """Stop the router started for this lab under ``name`` (its recorded pid, checked by command line). True if
    one ran."""
    path = _record(lab_dir, name)
    try:
        with open(path) as fh:
            pid = int(json.load(fh)["pid"])
    except (OSError, ValueError, KeyError):
        return False
    ran = _alive_router(pid)
    if ran:
        os.kill(pid, signal.SIGTERM)
        deadline = time.time() + 10
        while _alive_router(pid) and time.time() < deadline:
            time.sleep(0.1)
        if _alive_router(pid):
            os.kill(pid, signal.SIGKILL)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return ran


def start(lab_dir, port=38000, python=None, extra=(), sglang_port=30000, timeout_s=60, wait_healthy=True, hosts=None,
          router="sglang-router", control_plane_key=None, name="router"):
    """Start the router (``router``: sglang-router or smg) for the lab in ``lab_dir`` (stops one started before) with
    every host, or the host names in ``hosts``, as a worker. Returns {url, metrics_url, pid, log, workers, router,
    version}; ``name`` tells routers of one lab apart (its record and log). Raises RuntimeError naming the log when it does not list every worker healthy within ``timeout_s``."""
    if router not in ROUTERS:
        raise ValueError("router must be one of %s (got %r)" % (", ".join(ROUTERS), router))
    if control_plane_key and router != "smg":
        raise ValueError("a control-plane key needs router smg")
    stop(lab_dir, name)
    state = _lab_state(lab_dir)
    host = bridge_ip(state)
    workers = worker_urls(state, sglang_port, hosts)
    log = os.path.join(os.path.realpath(lab_dir), "%s.log" % name)
    argv = [python or sys.executable, "-m", ROUTERS[router], "--host", host, "--port", str(port),
            "--policy", "round_robin", "--log-level", "warn",
            # its Prometheus exporter binds 0.0.0.0:29000 by default: one per machine; keep it on the lab's bridge
            "--prometheus-host", host, "--prometheus-port", str(port + 1),
            "--worker-urls"] + workers + list(extra)
    if control_plane_key:
        argv += ["--control-plane-api-keys", "gpufleet:gpufleet:admin:%s" % control_plane_key]
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    url = "http://%s:%d" % (host, port)
    with open(_record(lab_dir, name), "w") as fh:
        json.dump({"pid": proc.pid, "url": url, "router": router, "log": log}, fh)
    deadline = time.time() + timeout_s
    while wait_healthy:
        if proc.poll() is not None:
            raise RuntimeError("%s exited with %s: see %s" % (router, proc.returncode, log))
        if healthy_workers(url, control_plane_key) == sorted(workers):
            break
        if time.time() > deadline:
            raise RuntimeError("%s at %s does not list all of %s healthy after %d s (listed healthy: %s); "
                               "see %s" % (router, url, ", ".join(workers), timeout_s,
                                           healthy_workers(url, control_plane_key), log))
        time.sleep(0.5)
    return {"url": url, "metrics_url": "http://%s:%d/metrics" % (host, port + 1), "pid": proc.pid, "log": log,
            "workers": workers, "router": router, "version": version(router)}


def main(argv=None):
    p = argparse.ArgumentParser(prog="lab_router.py", description=__doc__.split("\n\n")[0])
    p.add_argument("cmd", choices=["start", "stop"])
    p.add_argument("--lab-dir", default=os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), ".lab"))
    p.add_argument("--port", type=int, default=38000)
    p.add_argument("--router", choices=sorted(ROUTERS), default="sglang-router")
    p.add_argument("--python", help="interpreter with the router installed (default: this one)")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.cmd == "stop":
        print("router stopped" if stop(args.lab_dir) else "no router was running")
        return 0
    info = start(args.lab_dir, port=args.port, python=args.python, extra=extra, router=args.router)
    print(info["url"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
