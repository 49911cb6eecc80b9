#!/usr/bin/env python3
"""Rolling restart under load behind the real router: ``make roll-under-load [ROUTER=sglang-router|smg]``.

    roll_under_load.py [--router sglang-router|smg] [--hosts 4] [--lab-dir .lab-roll] [--modes off,on]
                       [--concurrency 8] [--report docs/reliability.md] [--keep]

1. brings up a lab of ``--hosts`` hosts (lab.py up) and starts a server on each (restart.yml, all at once);
2. starts the real router (lab_router.py: ``--router``, sglang-router 0.3.2 or smg, both pinned from PyPI, on the
   lab bridge, every host a worker; smg with a control-plane key on its worker routes, which the ``on`` mode gets
   as ``gpufleet_router_control_plane_key`` from a 0600 extra-vars file, never on a command line);
3. per mode (before each mode after the first, until the router serves 20 requests in a row: ``settle``), runs
   ``playbooks/restart.yml`` over every host one at a time (gpufleet_serial 1) while loadgen.py
   sends continuous streaming and plain ``/generate`` requests through the router, from the playbook's start
   to its end: ``off`` = the router is in front but restart.yml does not talk to it (baseline), ``on`` =
   ``-e gpufleet_router_url=<router> -e gpufleet_router_metrics_url=<its Prometheus port>`` (each host leaves the
   pool, once enough other workers take traffic in the router's view, and drains before its stop, comes back
   after verify once the router routes to it);
4. prints ``failed_requests=N total_requests=M`` per mode and writes the table into ``--report`` (between the
   ``roll-under-load`` markers of that router; the rest of the file is kept);
5. stops the router and takes the lab down (``--keep`` leaves both up).

Exit status 0 when every mode's playbook succeeded and the ``on`` mode had no failed request.
"""
import argparse
import binascii
import datetime
import json
import os
import re
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import lab_router  # noqa: E402
import loadgen  # noqa: E402

FAST = ["-e", "sglang_stop_grace_s=10"]


def markers(router):
    """The report's markers for ``router`` (sglang-router keeps the markers from before smg was supported)."""
    tag = "roll-under-load" if router == "sglang-router" else "roll-under-load %s" % router
    return "<!-- %s: begin -->" % tag, "<!-- %s: end -->" % tag


def playbook(inventory, extra, log):
    argv = ["ansible-playbook", "-i", inventory, os.path.join(ROOT, "playbooks", "restart.yml")] + FAST + extra
    env = dict(os.environ, ANSIBLE_CONFIG=os.path.join(ROOT, "ansible.cfg"),
               PATH=os.path.dirname(sys.executable) + ":" + os.environ.get("PATH", ""))
    with open(log, "w") as out:
        return subprocess.call(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def roll(router, inventory, mode, concurrency, log, secrets=None, max_new_tokens=16):
    extra = ["-e", "gpufleet_serial=1"]
    if mode == "on":
        extra += ["-e", "gpufleet_router_url=%s" % router["url"], "-e", "gpufleet_router_metrics_url=%s" % router["metrics_url"]]
        if secrets:
            extra += ["-e", "@" + secrets]
    gen = loadgen.LoadGen(router["url"], concurrency=concurrency, max_s=1800, max_new_tokens=max_new_tokens).start()
    time.sleep(1)  # traffic flows before the first host is touched
    t0 = time.time()
    rc = playbook(inventory, extra, log)
    res = gen.stop()
    res.update(mode=mode, playbook_rc=rc, playbook_s=round(time.time() - t0, 1), log=log, pool_waits=pool_waits(log))
    return res


def settle(url, need=20, timeout_s=300):
    """Between two modes: one plain ``/generate`` at a time through the router until ``need`` in a row answer 200,
    so that the next mode starts on a router that serves. After the baseline's outages the router can answer 503
    ``no_available_workers`` to every request (all circuit breakers open) until ``--cb-timeout-duration-secs`` (60 s
    by default) has passed and requests find the circuits half-open; those failures belong to the baseline, not to
    the next roll. Returns {"seconds", "probes", "failed"}."""
    t0, probes, failed, streak = time.time(), 0, 0, 0
    body = json.dumps({"text": "settle", "sampling_params": {"max_new_tokens": 1}}).encode()
    while streak < need and time.time() - t0 < timeout_s:
        probes += 1
        try:
            req = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json"})
            ok = urllib.request.urlopen(req, timeout=30).status == 200
        except (OSError, ValueError):
            ok = False
        streak = streak + 1 if ok else 0
        if not ok:
            failed += 1
            time.sleep(0.5)
    return {"seconds": round(time.time() - t0, 1), "probes": probes, "failed": failed}


def pool_waits(log):
    """The removals that waited for other workers to take traffic in the router's view (restart.yml's
    "Router - say that enough other workers take traffic" lines: "HOST: after N look(s): ..."), as
    ["HOST: N looks"]."""
    try:
        text = open(log).read()
    except OSError:
        return []
    return ["%s: %s looks" % m for m in re.findall(r"^\s+(\S+): after (\d+) look\(s\): ", text, flags=re.M)]


def table(results, hosts, concurrency, router, router_version, settled=()):
    begin, end = markers(router)
    lines = [begin, "",
             "Measured %s UTC by `make roll-under-load ROUTER=%s` (tests/lab/roll_under_load.py): %d lab hosts, %s %s "
             "(round_robin, its default retries/circuit breaker/health checks) on the lab bridge, %d concurrent clients "
             "sending `/generate` through the router (every other request `\"stream\": true`, 16 tokens at 120 tokens/s), "
             "`restart.yml -e gpufleet_serial=1` over every host while they run."
             % (datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"), router, hosts, router,
                router_version, concurrency), "",
             "| router integration | failed requests | total requests | streamed | failure causes | playbook | roll time |",
             "|---|---|---|---|---|---|---|"]
    names = {"on": "on (`gpufleet_router_url`, `gpufleet_router_metrics_url` set)",
             "off": "off (baseline: router in front, not told)"}
    for r in results:
        causes = ", ".join("%s %d" % kv for kv in sorted(r["errors"].items())) or "-"
        lines.append("| %s | %d | %d | %d | %s | %s | %.0f s |" % (
            names[r["mode"]], r["failed_requests"], r["total_requests"], r["streamed"], causes,
            "ok" if r["playbook_rc"] == 0 else "rc %d" % r["playbook_rc"], r["playbook_s"]))
    waits = ["%s (%s)" % (r["mode"], ", ".join(r["pool_waits"])) for r in results if r.get("pool_waits")]
    lines += ["", "Removals that first waited until enough other workers took traffic in the router's view: "
              + ("; ".join(waits) if waits else "none (every removal found another worker taking traffic)") + "."]
    if settled:
        lines += ["", "Between the modes the router was probed (one `/generate` at a time) until 20 in a row answered "
                  "200: " + "; ".join("%.0f s, %d of %d probes failed" % (st["seconds"], st["failed"], st["probes"])
                                      for st in settled) + " (the baseline's open circuit breakers)."]
    lines += ["", end]
    return "\n".join(lines)


def write_report(path, block, router="sglang-router"):
    begin, end = markers(router)
    text = open(path).read() if os.path.exists(path) else "# Reliability\n\n"
    if begin in text and end in text:
        text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n## Rolling restart under load behind %s\n\n" % router + block + "\n"
    with open(path, "w") as fh:
        fh.write(text)


def main(argv=None):
    p = argparse.ArgumentParser(prog="roll_under_load.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--router", choices=sorted(lab_router.ROUTERS), default="sglang-router")
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--lab-dir", default=os.path.join(ROOT, ".lab-roll"))
    p.add_argument("--modes", default="off,on")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--report", default=os.path.join(ROOT, "docs", "reliability.md"))
    p.add_argument("--router-port", type=int, default=38000)
    p.add_argument("--keep", action="store_true", help="leave the lab and the router up")
    a = p.parse_args(argv)
    if a.hosts < 4:
        p.error("--hosts must be 4 or more")
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"on", "off"}:
        p.error("--modes is a comma list of on, off")
    lab = [sys.executable, os.path.join(HERE, "lab.py")]
    subprocess.check_call(lab + ["up", "--hosts", str(a.hosts), "--lab-dir", a.lab_dir])
    inventory = os.path.join(os.path.realpath(a.lab_dir), "inventory")
    results = []
    try:
        rc = playbook(inventory, ["-e", "gpufleet_serial=%d" % a.hosts], os.path.join(a.lab_dir, "start.log"))
        if rc != 0:
            raise SystemExit("starting the servers failed (rc %d): see %s/start.log" % (rc, a.lab_dir))
        key, secrets = None, None
        if a.router == "smg":  # its worker routes behind a control-plane key, handed over in a 0600 file
            key = binascii.hexlify(os.urandom(16)).decode()
            secrets = os.path.join(os.path.realpath(a.lab_dir), "router-secrets.json")
            fd = os.open(secrets, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                json.dump({"gpufleet_router_control_plane_key": key}, fh)
        router = lab_router.start(a.lab_dir, port=a.router_port, router=a.router, control_plane_key=key)
        print("%s %s %s (pid %d), metrics %s, workers: %s" % (
            router["router"], router["version"], router["url"], router["pid"], router["metrics_url"],
            ", ".join(router["workers"])))
        settled = []
        for n, mode in enumerate(modes):
            if n:
                st = settle(router["url"])
                settled.append(st)
                print("before %s: the router served 20 requests in a row after %.0f s (%d of %d probes failed)" % (
                    mode, st["seconds"], st["failed"], st["probes"]))
            res = roll(router, inventory, mode, a.concurrency, os.path.join(a.lab_dir, "restart-%s.log" % mode),
                       secrets=secrets)
            results.append(res)
            print("integration %s: failed_requests=%d total_requests=%d (playbook rc %d, %.0f s; causes %s; pool waits %s; "
                  "failures from %s s to %s s; log %s)" % (
                      mode, res["failed_requests"], res["total_requests"], res["playbook_rc"], res["playbook_s"],
                      json.dumps(res["errors"]), ", ".join(res["pool_waits"]) or "none", res["first_failure_s"],
                      res["last_failure_s"], res["log"]))
            for sample in res["samples"][:5]:  # the first failures, as the clients saw them
                print("  failed: %s" % sample)
            healthy = lab_router.healthy_workers(router["url"], key)
            if healthy != sorted(router["workers"]):
                # the baseline can leave a restarted worker marked unhealthy for a while: wait before the next mode
                # (its circuit breakers may stay open: the integrated roll reads them and waits itself)
                deadline = time.time() + 120
                while lab_router.healthy_workers(router["url"], key) != sorted(router["workers"]) and time.time() < deadline:
                    time.sleep(1)
        write_report(a.report, table(results, a.hosts, a.concurrency, a.router, router["version"], settled), a.router)
        print("report: %s" % a.report)
        for r in results:
            print("failed_requests=%d total_requests=%d" % (r["failed_requests"], r["total_requests"])
                  + "  (router integration %s)" % r["mode"])
    finally:
        if not a.keep:
            lab_router.stop_all(a.lab_dir)
            subprocess.call(lab + ["down", "--lab-dir", a.lab_dir])
    ok = all(r["playbook_rc"] == 0 for r in results) and all(r["failed_requests"] == 0 for r in results
                                                              if r["mode"] == "on")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
