#!/usr/bin/python
# -*- coding: utf-8 -*-
# gpufleet: start SGLang as a detached process (own session, pid file, log file) and wait, in short slices that
# report progress, until the server this run launched answers readiness on its own listening socket.
from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_process
short_description: Start SGLang as a detached process, check its port, and wait in short slices until it serves
description:
  - "O(state=started): checks that nothing listens on O(port) (when given) and fails naming the holder (pid,
    user, command line) before starting anything; then starts O(argv) (a list, never through a shell) in its
    own session (C(setsid)), stdin from C(/dev/null), stdout and stderr appended to O(log_file), writes its
    pid to O(pid_file) atomically and returns RV(pid) and RV(log_offset) (the log's size before this start, so
    later failures show this launch's lines only)."
  - "The server's parent is a small reaper process (comm C(gpufleet-reaper), own session) that waits for it and
    writes its exit status to O(exit_file), so a later O(state=ready) call can name the exit code of a
    server that died while loading. The reaper holds no port, GPU or file of the server and ends with it."
  - "With O(wait_ready=true), O(state=started) then probes readiness itself (the same test as O(state=ready),
    below) every O(poll_interval_ms) (at most 100 ms) during O(startup_check_s) and returns as soon as the
    server serves, with RV(ready)=true and RV(ready_epoch) (the target's clock), so the caller's readiness wait
    can be skipped. A server still loading when the window ends is returned as today (RV(ready)=false); one
    that died fails as today; a stranger on the port or a socket it cannot attribute fails as O(state=ready) does."
  - "O(create_dirs=true) creates the missing parent directories of O(log_file) and O(pid_file) (mode 0755)
    before the start, instead of a separate task."
  - "O(state=ready): waits at most O(slice_s) seconds for the server to answer: O(port) accepts a connection, the
    listening socket belongs to the launched process (O(pid), O(pid_file) or the systemd O(unit)'s MainPID)
    or one of its descendants, and O(url) (when given) answers 200. It polls every O(poll_interval_ms). It
    returns RV(ready)=false and a RV(progress) line when the slice ends first: call it with C(until)/C(retries)
    so Ansible prints a line per slice. It fails at once when the server died (exit code, this launch's log
    tail, the port's holder if any), when a process outside the server's tree listens on O(port), or when
    O(timeout_s) passed since the server's start (its process creation time)."
  - "O(state=verified): what proves a launched server serves as configured, in one module call (each call costs
    0.5-1 s of round trip and module start): one generation (O(generate): C(POST /generate), RV(generate)),
    a short concurrent burst of generations (O(burst), RV(burst)), the environment of every GPU worker among the
    server's descendants (O(worker_env): RV(workers), as the
    C(sglang_worker_env_info) module reads it), then one look (O(owner)) that the server still runs and the
    LISTEN socket on O(port) belongs to it or a descendant and O(url) answers 200 (the test of O(state=ready),
    without waiting: RV(owner)). The look comes last, so the answers before it are known to come from that
    server. Changes nothing and never fails for what it finds (a refused generation, a worker without a
    variable, a server gone): the caller asserts on the results, with its own messages. Fails only for bad
    input."
  - "O(state=port_free): only checks that nothing listens on O(port) (the check the C(sglang_launch) role runs
    right before a systemd start); changes nothing."
  - "O(state=recorded): writes O(record) (a mapping: what a rollback needs to start this server again, the
    C(sglang_launch) role's launch record) as JSON (4-space indent, sorted keys) to O(record_file) atomically
    (a temporary file in the same directory, fsync, rename; mode 0640), in one module call where
    C(ansible.builtin.copy) makes three round trips (stat, file transfer, copy). C(changed) when the file's
    text differs or the lock below was released. Fails, changing nothing, when the directory is missing or not
    writable. With O(lock_dir), the restart lock O(lock_owner) holds is released right after the record is
    written (the caller's last step, without a module call of its own); see RV(lock_release)."
  - The process outlives the Ansible task and the SSH session; stop it with the C(sglang_stop) module, which
    signals the session recorded here.
  - Idempotent; when O(pid_file) names a live process started before the file was written, nothing is
    started and C(changed) is false.
  - Requires psutil on the target for O(port) and the C(ready)/C(port_free) states (the SGLang virtualenv has
    it).
version_added: "0.1.0"
author: gpufleet maintainers (!UNKNOWN)
options:
  state:
    description:
      - V(started) starts the server; V(ready) waits one slice for readiness; V(verified) generates once, reads
        the workers' environment and looks at the server's socket; V(port_free) checks O(port); V(recorded)
        writes the launch record O(record) to O(record_file).
      - Stopping is the C(sglang_stop) module's job.
      - "The start options (O(argv), O(log_file), O(pid_file), O(port), O(host), ...) are shared with
        M(gpufleet.fleet.sglang_stop)'s O(gpufleet.fleet.sglang_stop#module:start_after). V(started) needs O(argv),
        O(log_file) and O(pid_file); V(ready), V(verified) and V(port_free) need O(port). V(ready) and V(verified)
        name the server by O(pid), else O(pid_file), else O(unit), and connect to O(host) (V(0.0.0.0) and V(::) are
        probed on 127.0.0.1); pass O(api_key) to V(ready) too when the server has a key (so no log line shows it),
        and V(verified) sends it as the bearer token of the O(generate) request (header C(Authorization))."
    type: str
    choices: [started, ready, verified, port_free, recorded]
    default: started
  log_offset:
    description: With V(ready), byte offset in O(log_file) where this launch's lines begin (RV(log_offset) of the start).
    type: int
    default: 0
  pid:
    description: With V(ready), the launched server's pid.
    type: int
  unit:
    description:
      - With V(ready), a systemd unit whose C(MainPID) is the server (C(systemctl show)); its C(ExecMainStatus)
        is the exit code when it died.
    type: str
  url:
    description:
      - With V(ready), a URL that must answer 200 (GET), e.g. SGLang's generate-based C(/health_generate).
        Without it, an open port owned by the server's tree is enough.
    type: str
  timeout_s:
    description:
      - With V(ready), seconds from the server's start (its process creation time) after which the wait fails
        (the server is left running).
    type: float
    default: 900
  slice_s:
    description:
      - With V(ready), seconds one call waits before it returns RV(ready)=false with RV(progress) (0 = look once).
        Keep it at most 10 so a progress line comes at least every 15 s.
    type: float
    default: 10
  poll_interval_ms:
    description: With V(ready), milliseconds between readiness probes inside a slice; with V(started) and O(wait_ready), the same, at most 100.
    type: int
    default: 200
  request_timeout_s:
    description: With V(ready), seconds one GET of O(url) may take (a generate-based readiness URL runs a generation).
    type: float
    default: 30
  startup_check_s:
    description:
      - With V(started), seconds to watch the new process; if it exits within them the task fails with the log tail.
      - With O(wait_ready), the window in which readiness is probed; the call returns as soon as the server serves.
    type: float
    default: 2
  wait_ready:
    description:
      - With V(started), probe readiness during O(startup_check_s) exactly as V(ready) does (O(port) accepts, the
        listening socket belongs to the started process or a descendant, O(url) answers 200) every
        O(poll_interval_ms) but at most 100 ms apart, and return at the first success with RV(ready)=true.
      - Requires O(port). Not used in check mode, nor when the server was already running (nothing started).
    type: bool
    default: false
  create_dirs:
    description:
      - With V(started), create the missing parent directories of O(log_file) and O(pid_file) (and O(exit_file))
        with mode 0755; without it a missing directory fails the task. Check mode creates nothing.
    type: bool
    default: false
  log_tail_lines:
    description: Lines of this launch's log included in a failure message.
    type: int
    default: 40
  lock_dir:
    description:
      - With V(ready), the restart lock directory this run holds; its lease is renewed at the start of each slice
        (C(gpufleet_lock) module_utils C(renew_lease)), so a long model load never lets the lease run out. When
        the lock is gone or another run holds it the task fails at once (that run may be restarting the host).
      - "It is renewed once more when the slice sees the server ready (RV(lock_renewed_at_ready)): the caller's
        next phase (restart.yml's verify) then starts with a whole lease and needs no renewal round trip of its
        own. A failure of that last renewal is reported in RV(lock_renewed_at_ready_error), not as a failed wait
        (the server serves; the caller renews the usual way)."
      - "With V(recorded), the restart lock to release once the record is written (C(gpufleet_lock) module_utils
        C(release_lease), what C(gpufleet_lock state=absent) does): a lock another run took over after this run's
        lease ended is left alone. Nothing is released when the record could not be written (the task fails) or
        in check mode. A release that fails does not fail the task: RV(lock_release_error) says why and the lock
        stays for the caller to release."
    type: path
  lock_owner:
    description:
      - With V(ready) and V(recorded), the run id that owns O(lock_dir) (renewal and release refuse to touch
        another run's lock). Required with O(lock_dir).
    type: str
  record:
    description:
      - "With V(recorded), the mapping to write (JSON-serialisable). It is echoed in the task's arguments, so
        never put a secret in it (the launch record holds only whether an API key was set)."
    type: dict
  record_file:
    description: With V(recorded), the file to write (its directory must exist). Required for V(recorded).
    type: path
  check_mode_keep:
    description:
      - With V(recorded) in check mode, top-level keys of O(record) known only once the launch really ran (the
        new server's pid, the time of the record). They keep the values of the record already in O(record_file),
        so that C(--check --diff) shows only the launch configuration that would change (argv, environment, ...).
      - Ignored outside check mode and when there is no readable record yet.
    type: list
    elements: str
    default: []
  generate:
    description:
      - "With V(verified), the generation to ask for (omit it for none). Sent with O(api_key) as
        C(Authorization: Bearer) when that is set; never through an http_proxy."
    type: dict
    suboptions:
      url:
        description: The server's C(/generate) URL, e.g. C(http://127.0.0.1:30000/generate).
        type: str
        required: true
      text:
        description: The prompt.
        type: str
        default: The capital of France is
      max_new_tokens:
        description: Tokens to generate (greedy, C(temperature) 0).
        type: int
        default: 8
      timeout_s:
        description: Seconds the generation may take.
        type: float
        default: 120
  burst:
    description:
      - "With V(verified), a short concurrent burst of C(POST /generate) right after the single O(generate) (omit
        it, or O(burst.requests=0), for none): O(burst.requests) small generations, O(burst.concurrency) at a
        time, each allowed O(burst.timeout_s). It catches a server that answers one request and then hangs
        (sgl-project/sglang#22779). Sent with O(api_key) as C(Authorization: Bearer) when that is set; never
        through an http_proxy. Skipped when the single generation got no 200 answer. See RV(burst)."
      - "Counting (module_utils C(gpufleet_burst)): answered = 200 with generated text; an HTTP error is an answer
        and the burst goes on; no answer within the timeout, or a refused/reset connection, stops new requests
        (each would only wait its timeout out), so a hung server costs about one O(burst.timeout_s)."
    type: dict
    suboptions:
      url:
        description: The server's C(/generate) URL.
        type: str
        required: true
      text:
        description: The prompt.
        type: str
        default: The capital of France is
      requests:
        description: Generations in the burst (0 = none, at most 1000).
        type: int
        default: 32
      concurrency:
        description: Generations in flight at once (1 to 64).
        type: int
        default: 8
      max_new_tokens:
        description: Tokens per generation (greedy).
        type: int
        default: 8
      timeout_s:
        description: Seconds one generation of the burst may take.
        type: float
        default: 10
  worker_env:
    description:
      - With V(verified), the variables every GPU worker must carry (omit it to read no worker).
    type: dict
    suboptions:
      expected:
        description: Variable name → expected value (compared as strings; booleans as C(1)/C(0)).
        type: dict
        default: {}
      names:
        description: Extra variable names to report (no comparison).
        type: list
        elements: str
        default: []
      title_pattern:
        description: Regular expression (C(re.search)) for worker titles/command lines.
        type: str
        default: '^sglang::scheduler(_DP\d+)?_TP\d+'
  owner:
    description: With V(verified), end with the look at the server and its socket (RV(owner)).
    type: bool
    default: true
extends_documentation_fragment:
  - gpufleet.fleet.sglang_start
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: V(started) reports whether it would start the process and the argv and starts nothing (a listener on
      O(port) is a warning then, not a failure, because nothing was stopped); V(ready), V(verified) and V(port_free) only look;
      V(recorded) reports whether the record file would change and writes nothing (see O(check_mode_keep)).
  diff_mode:
    support: partial
    details: V(recorded) returns the record file's text before and after; the other states return no diff.
  platform:
    support: full
    platforms: linux
notes:
  - "Why a new session: the process must not receive the SIGHUP of the closing SSH session, and its process
    group id equals its pid, so C(sglang_stop) can signal the whole tree SGLang spawns."
  - "Why slices: a module cannot print while it runs; short calls repeated with C(until) let the callback show
    what is awaited, how long it has been and the last log line at least every 15 s, and still notice a dead
    server within O(poll_interval_ms)."
  - "Whose listener: SGLang opens its HTTP port in the main process after the model loaded (FIELD-NOTES); another
    service that binds the port meanwhile answers C(/health_generate) too, so an answer counts only when
    psutil shows the LISTEN socket in the launched process or a descendant. Seeing another user's sockets
    needs root (C(become)) — the systemd method's server runs as the service user."
"""

EXAMPLES = r"""
- name: Start SGLang detached (fails naming the holder if port 30000 is taken)
  gpufleet.fleet.sglang_process:
    argv: ["/opt/sglang/bin/python", "-m", "sglang.launch_server", "--model-path", "/models/m", "--port", "30000"]
    env: {NCCL_PROTO: LL, NCCL_ALGO: Ring}
    log_file: /var/lib/gpufleet/sglang.log
    pid_file: /var/lib/gpufleet/sglang.pid
    port: 30000
  register: started

- name: Start it and return as soon as it serves (or after 5 s, still loading), creating the state dir
  gpufleet.fleet.sglang_process:
    argv: ["/opt/sglang/bin/python", "-m", "sglang.launch_server", "--model-path", "/models/m", "--port", "30000"]
    log_file: /var/lib/gpufleet/sglang.log
    pid_file: /var/lib/gpufleet/sglang.pid
    create_dirs: true
    port: 30000
    wait_ready: true
    url: http://127.0.0.1:30000/health_generate
    startup_check_s: 5
    poll_interval_ms: 100
  register: started

- name: Wait until it answers /health_generate (a progress line every 10 s)
  gpufleet.fleet.sglang_process:
    state: ready
    pid: "{{ started.pid }}"
    pid_file: /var/lib/gpufleet/sglang.pid
    log_file: /var/lib/gpufleet/sglang.log
    log_offset: "{{ started.log_offset }}"
    port: 30000
    url: http://127.0.0.1:30000/health_generate
    timeout_s: 900
  register: ready
  until: ready.ready | default(false) or ready is failed
  retries: 100
  delay: 0
  when: not started.ready | default(false)

- name: Prove it serves as configured (one call), then assert each part with its own message
  gpufleet.fleet.sglang_process:
    state: verified
    pid_file: /var/lib/gpufleet/sglang.pid
    port: 30000
    url: http://127.0.0.1:30000/health_generate
    generate: {url: "http://127.0.0.1:30000/generate", max_new_tokens: 8}
    worker_env: {expected: {NCCL_PROTO: LL, NCCL_ALGO: Ring}}
  register: verified

- ansible.builtin.assert:
    that:
      - verified.generate.json.text is defined
      - verified.workers.all_match
      - verified.owner.ready

- name: Record how to start this server again (what a rollback reads)
  gpufleet.fleet.sglang_process:
    state: recorded
    record_file: /var/lib/gpufleet/launch.json
    record:
      argv: "{{ started.argv }}"
      pid: "{{ started.pid }}"
      log_file: /var/lib/gpufleet/sglang.log
"""

RETURN = r"""
record_file:
  description: With O(state=recorded), the file written (or, in check mode, that would be).
  returned: state is recorded
  type: str
  sample: /var/lib/gpufleet/launch.json
pid:
  description: Pid of the started (or already running, or awaited) server; null in check mode when it would start.
  returned: always
  type: int
  sample: 31337
started:
  description: Whether a new process was started (or, in check mode, would be).
  returned: always
  type: bool
started_at:
  description: Start time, seconds since the epoch (target clock); null when nothing was started.
  returned: always
  type: float
argv:
  description: The argv started, without O(api_key).
  returned: state is started
  type: list
  elements: str
log_file:
  description: Path of the log file.
  returned: always
  type: str
log_offset:
  description: Size of O(log_file) in bytes before this start; this launch's lines follow it.
  returned: state is started
  type: int
pid_file:
  description: Path of the pid file.
  returned: always
  type: str
exit_file:
  description: Path where the reaper writes the exit status.
  returned: always
  type: str
ready:
  description:
    - With V(ready), whether the server answered on its own socket within this slice.
    - With V(started) and O(wait_ready), whether it answered within O(startup_check_s) (false when it did not yet,
      or nothing was started).
  returned: state is ready, or state is started with wait_ready
  type: bool
ready_epoch:
  description: When the server was first seen ready, seconds since the epoch on the target's clock; null until then.
  returned: state is ready, or state is started with wait_ready
  type: float
  sample: 1796000012.41
created_dirs:
  description: Directories O(create_dirs) created (or would create, in check mode).
  returned: state is started
  type: list
  elements: str
progress:
  description:
    - "One line saying what is awaited, since when and the last state, e.g. C(waiting for /health_generate on
      127.0.0.1:30000 (pid 4242): 45 s of 900 s, last: connection refused; log: 'Load weight end')."
  returned: state is ready
  type: str
elapsed_s:
  description:
    - Seconds since the server's process was created (target clock); for a server that died, how long it ran
      (from its exit record, or the unit's ExecMainStartTimestamp/ExecMainExitTimestamp).
    - Null when the server was already gone at the wait's first look and its run time is not known (for a
      unit, systemd keeps the status of its last main process only, which after Restart= is another process).
  returned: state is ready
  type: float
ready_wait_ms:
  description: Milliseconds from the server's start (its process creation time) until it answered; null until then.
  returned: state is ready, or state is started with wait_ready
  type: int
last:
  description: Last readiness probe outcome (C(connection refused), C(HTTP 503), C(200)).
  returned: state is ready
  type: str
listeners:
  description: Processes listening on O(port) (V(port_free), or a failure naming the holder); each C(pid), C(user), C(cmdline), C(address).
  returned: when port was checked
  type: list
  elements: dict
rc:
  description: Exit code of a server that died (negative = killed by that signal); null when unknown.
  returned: failure
  type: int
log_tail:
  description: Last lines of this launch's log (from O(log_offset)), on failure.
  returned: failure
  type: str
running:
  description:
    - "For O(state=ready) that gave up because O(timeout_s) passed since the server's start: whether the server
      process still ran then (true: it may still come up, e.g. a slow model load). Absent on success and on
      every other failure (the server exited: RV(rc) and RV(log_tail) say how; another process on the port;
      a socket this user cannot attribute)."
    - "For a slice that ended before the server answered (RV(ready) false, no failure): true, the server runs
      and may still come up."
  returned: failure of state=ready by timeout; state=ready whose slice ended before an answer
  type: bool
  sample: true
generate:
  description: With O(state=verified) and O(generate), the generation's outcome.
  returned: state is verified and generate is set
  type: dict
  contains:
    status:
      description: >-
        HTTP status; null when the server gave no HTTP answer (refused, timed out).
      type: int
    json:
      description: >-
        The parsed answer; SGLang puts the generated text in C(text). Null when not JSON.
      type: dict
    msg:
      description: >-
        C(OK (N bytes)), or the HTTP error or connection error.
      type: str
    elapsed_ms:
      description: >-
        Milliseconds the request took.
      type: int
  sample: {status: 200, json: {text: " Paris.", meta_info: {completion_tokens: 8}}, msg: "OK (312 bytes)", elapsed_ms: 48}
burst:
  description:
    - "With O(state=verified) and O(burst): C(ok) (every request answered), C(requests), C(concurrency),
      C(answered) (200 with generated text), C(timed_out) (no answer within C(timeout_s)), C(connection_errors),
      C(http_errors) (status → count), C(not_sent) (not started after the first request without an answer),
      C(wall_s), C(slowest_ms) (slowest answered request, ms), C(first_error), C(timeout_s) and C(msg) (one line,
      e.g. C(5 of 32 answered in 3.1 s (8 at a time); 8 got no answer within 3 s; 19 not sent ...)). With
      C(skipped) true and C(msg) saying why when the single generation failed first."
  returned: state is verified and burst is set with requests above 0
  type: dict
  sample: {ok: true, requests: 32, concurrency: 8, answered: 32, timed_out: 0, connection_errors: 0, http_errors: {},
           not_sent: 0, wall_s: 0.61, slowest_ms: 140, first_error: null, timeout_s: 10.0,
           msg: "32 of 32 answered in 0.6 s (8 at a time)"}
workers:
  description:
    - With O(state=verified) and O(worker_env), the GPU workers found among the server's descendants, with the
      shape the C(sglang_worker_env_info) module returns (C(workers), C(worker_count), C(all_match),
      C(server_pid)), and C(msg) when the server was not found or not running (no worker read then).
  returned: state is verified and worker_env is set
  type: dict
owner:
  description:
    - With O(state=verified) and O(owner), the last look. C(ready) true when the server runs, the LISTEN socket
      on O(port) is its own or a descendant's and O(url) answered 200; C(msg) says what was seen (the exit status
      and log tail of a server that died, the holder of the port); C(pid) the server looked at; C(listeners) the
      port's holders when another process holds it.
  returned: state is verified and owner is true
  type: dict
  sample: {ready: true, pid: 4242, msg: "pid 4242 runs and answered /health_generate on 127.0.0.1:30000 on its own socket"}
lock_renewed:
  description: Whether the restart lock's lease was renewed by this call (null without O(lock_dir)).
  returned: state is ready
  type: bool
lock_renewed_at_ready:
  description: True when the lease was renewed again right after the server was seen ready (null without O(lock_dir)
    or when it was not seen ready; false when that renewal failed).
  returned: state is ready
  type: bool
lock_renewed_at_ready_error:
  description: Why the renewal at readiness failed (the lock was lost, or an I/O error); only when it did.
  returned: when that renewal failed
  type: str
lock_release:
  description:
    - "With O(state=recorded) and O(lock_dir), what releasing the restart lock after the record found
      (C(gpufleet_lock) module_utils C(release_lease)): V(released), V(absent) (no lock was there) or V(not_owner)
      (another run holds it, left alone). Null without O(lock_dir), in check mode, and when the release failed."
  returned: state is recorded (not from a check-mode run whose directory does not exist yet)
  type: str
  sample: released
lock_holder:
  description: With RV(lock_release=not_owner), the lock's holder record (run_id, controller, pid, user, lease); a
    warning names it too.
  returned: when the lock was held by another run
  type: dict
lock_release_error:
  description: Why the release after the record failed (an I/O error on the lock directory); only when it did.
  returned: when that release failed
  type: str
"""

import gc

from ansible.module_utils.basic import AnsibleModule, missing_required_lib

from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_burst
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_environ import worker_env_options
# Each state's body: module_utils gpufleet_process_states (run_<state>, STATES).
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_process_states import (
    HAS_PSUTIL, PSUTIL_ERROR, STATES, run_recorded)
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_redact import redact_module
# The start options are shared with sglang_stop's start_after (module_utils gpufleet_spawn).
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_spawn import start_options


def main():
    module = AnsibleModule(
        argument_spec=dict(
            state=dict(type="str", default="started", choices=["started", "ready", "verified", "port_free", "recorded"]),
            log_offset=dict(type="int", default=0),
            pid=dict(type="int"),
            unit=dict(type="str"),
            url=dict(type="str"),
            timeout_s=dict(type="float", default=900),
            slice_s=dict(type="float", default=10),
            poll_interval_ms=dict(type="int", default=200),
            request_timeout_s=dict(type="float", default=30),
            startup_check_s=dict(type="float", default=2),
            wait_ready=dict(type="bool", default=False),
            create_dirs=dict(type="bool", default=False),
            log_tail_lines=dict(type="int", default=40),
            lock_dir=dict(type="path"),
            lock_owner=dict(type="str"),
            record=dict(type="dict"),
            record_file=dict(type="path"),
            check_mode_keep=dict(type="list", elements="str", default=[], no_log=False),
            generate=dict(type="dict", options=dict(
                url=dict(type="str", required=True),
                text=dict(type="str", default="The capital of France is"),
                max_new_tokens=dict(type="int", default=8, no_log=False),
                timeout_s=dict(type="float", default=120),
            )),
            burst=dict(type="dict", options=dict(
                url=dict(type="str", required=True),
                text=dict(type="str", default="The capital of France is"),
                requests=dict(type="int", default=gpufleet_burst.DEFAULT_REQUESTS),
                concurrency=dict(type="int", default=gpufleet_burst.DEFAULT_CONCURRENCY),
                max_new_tokens=dict(type="int", default=gpufleet_burst.DEFAULT_MAX_NEW_TOKENS, no_log=False),
                timeout_s=dict(type="float", default=gpufleet_burst.DEFAULT_TIMEOUT_S),
            )),
            worker_env=dict(type="dict", options=worker_env_options()),
            owner=dict(type="bool", default=True),
            **start_options()  # argv, api_key, env, ..., port, host: shared with sglang_stop's start_after
        ),
        required_together=[("lock_dir", "lock_owner")],
        required_if=[("state", "started", ["argv", "log_file", "pid_file"]),
                     ("wait_ready", True, ["port"]),
                     ("state", "ready", ["port"]),
                     ("state", "ready", ["pid", "pid_file", "unit"], True),
                     ("state", "verified", ["port"]),
                     ("state", "verified", ["pid", "pid_file", "unit"], True),
                     ("state", "port_free", ["port"]),
                     ("state", "recorded", ["record", "record_file"])],
        supports_check_mode=True,
    )
    redact_module(module)  # no API key in any result, message or warning (issue 31)
    p = module.params
    if p["exit_file"] is None and p["pid_file"]:
        p["exit_file"] = p["pid_file"] + ".exit"
    result = dict(changed=False, started=False, pid=None, started_at=None, log_file=p["log_file"],
                  pid_file=p["pid_file"], exit_file=p["exit_file"])
    if p["state"] == "recorded":
        run_recorded(module, p)
    if not HAS_PSUTIL and (p["port"] or p["state"] != "started"):
        module.fail_json(msg=missing_required_lib("psutil"), exception=PSUTIL_ERROR, **result)
    if p["port"] is not None and not 0 < p["port"] < 65536:
        module.fail_json(msg="port must be 1-65535, got %d" % p["port"], **result)
    STATES[p["state"]](module, p, result)


if __name__ == "__main__":
    # Imports and constants to the permanent GC generation: the exit skips walking them (about 20 ms less per
    # call; docs/benchmarks.md, module exit)
    gc.freeze()
    main()
