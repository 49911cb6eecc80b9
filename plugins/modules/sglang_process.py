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
version_added: "1.0.0"
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
import json
import os
import re
import socket
import time
import traceback

from ansible.module_utils.basic import AnsibleModule, missing_required_lib

try:
    import psutil
    HAS_PSUTIL = True
    PSUTIL_ERROR = None
except ImportError:
    HAS_PSUTIL = False
    PSUTIL_ERROR = traceback.format_exc()

from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_burst
from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_lock
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_environ import (
    worker_env_options, candidate_pids, inspect_workers, worker_report)
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_pid_file import (
    MISSING, UNREADABLE, read_pid_file)
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_redact import redact_module, redact_text
# The start and the port check are shared with sglang_stop's start_after (module_utils gpufleet_spawn).
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_spawn import (
    WILDCARDS, describe_listeners, log_size, port_listeners, start_options, start_server, write_file_atomic)

PID_REUSE_SLACK_S = 5.0


def running_pid(pid_file):
    """Pid named by ``pid_file`` if that process is alive and not a reused pid, else None.

    Liveness: /proc/<pid> exists and is not a zombie; its start time (field 22 of /proc/<pid>/stat, in clock
    ticks since boot, proc(5)) is no later than the pid file's mtime plus a few seconds.
    A missing, empty or garbage file names no process; an unreadable one raises OSError.
    """
    read = read_pid_file(pid_file)
    if read.problem == UNREADABLE:
        raise OSError(read.error)
    if not read.ok:
        return None
    started = process_start_epoch(read.pid)
    if started is None or started > read.mtime + PID_REUSE_SLACK_S:
        return None
    return read.pid


def process_start_epoch(pid):
    """Start time of ``pid`` in seconds since the epoch, None if gone or a zombie (from /proc/<pid>/stat)."""
    try:
        with open("/proc/%d/stat" % pid) as handle:
            stat = handle.read()
        with open("/proc/stat") as handle:
            btime = next(int(line.split()[1]) for line in handle if line.startswith("btime "))
    except (OSError, StopIteration):
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None
    return btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def log_tail(path, lines, offset=0):
    """Last ``lines`` lines of ``path`` after byte ``offset`` (this launch's part), undecodable bytes replaced.

    Reads at most the last 64 KiB; "" if unreadable. An offset past the end (the log was truncated or
    rotated since) reads from the start. Secrets are redacted (SGLang logs its API keys in ``server_args``);
    a line the 64 KiB window cuts is left out, so no key is shown without the name that marks it.
    """
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            if offset > size:
                offset = 0
            start = max(offset, size - 64 * 1024)
            handle.seek(start)
            data = handle.read()
    except OSError:
        return ""
    if start > offset:
        data = data.partition(b"\n")[2]
    return redact_text("\n".join(data.decode("utf-8", "replace").splitlines()[-lines:]))


def read_exit_record(exit_file, pid):
    """The reaper's record for ``pid`` in ``exit_file``: {"pid", "returncode", "started_at", "ended_at"} (epoch s).

    None when the file is absent, unreadable or about another pid.
    """
    try:
        with open(exit_file) as handle:
            record = json.load(handle)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("pid") == pid else None


def read_exit_file(exit_file, pid):
    """Exit status (int, negative = killed by that signal) the reaper recorded for ``pid``; None when unknown."""
    record = read_exit_record(exit_file, pid)
    return record.get("returncode") if record else None


def await_exit_file(exit_file, pid, timeout_s=2.0, poll_s=0.05):
    """:func:`read_exit_file` for a ``pid`` already seen dead: the reaper writes the record right after its
    ``wait()`` returns, which on a loaded host can come a moment after the pid is gone. None after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        rc = read_exit_file(exit_file, pid)
        if rc is not None or time.monotonic() >= deadline:
            return rc
        time.sleep(poll_s)


UNIT_PROPS = ("MainPID", "ExecMainPID", "ExecMainStatus", "ExecMainCode", "ExecMainStartTimestampMonotonic",
              "ExecMainExitTimestampMonotonic", "ActiveState")


def unit_show(run_command, unit):
    """``systemctl show`` of ``unit``'s UNIT_PROPS as a dict of str (timestamps in µs of CLOCK_MONOTONIC)."""
    argv = ["systemctl", "show"]
    for name in UNIT_PROPS:
        argv += ["-p", name]
    rc, out, dummy = run_command(argv + [unit], environ_update={"LC_ALL": "C"})
    props = {}
    for line in out.splitlines():
        key, dummy, value = line.partition("=")
        props[key] = value
    return props


def unit_exit(props, dead_pid):
    """How ``dead_pid``, the unit's main process, ended, from unit_show() ``props``: a dict with ``rc`` (exit status,
    -signal for a kill or core dump, None when not known), ``elapsed_s`` (its run time, s, or None) and ``note``.

    systemd keeps ExecMainStatus/ExecMainCode of the last main process only (ExecMainPID): after Restart= ran the
    unit again they describe a later process, so they count only while ExecMainPID is ``dead_pid``.
    """
    exec_pid = int(props.get("ExecMainPID") or 0)
    exited = int(props.get("ExecMainExitTimestampMonotonic") or 0) > 0
    if exec_pid == dead_pid and not exited:
        # systemd has not processed the exit yet: ExecMainStatus still reads 0.
        return {"rc": None, "elapsed_s": None, "note": ""}
    if exec_pid != dead_pid:
        return {"rc": None, "elapsed_s": None,
                "note": ("systemd has run the unit again since, as pid %d (Restart= after a crash)" % exec_pid)
                if exec_pid > 0 else ""}
    status = props.get("ExecMainStatus", "")
    rc = int(status) if status.lstrip("-").isdigit() else None
    if rc is not None and props.get("ExecMainCode") in ("2", "3"):  # CLD_KILLED, CLD_DUMPED: status is the signal
        rc = -rc
    start, end = (int(props.get(name) or 0) for name in ("ExecMainStartTimestampMonotonic",
                                                         "ExecMainExitTimestampMonotonic"))
    return {"rc": rc, "elapsed_s": (end - start) / 1e6 if start > 0 and end >= start else None, "note": ""}


def tree_listens(pid, port):
    """True when ``pid`` or a descendant has a LISTEN socket on TCP ``port``; None when that cannot be read.

    Source: psutil.Process.net_connections / connections (per process, so only the server's tree is scanned).
    """
    try:
        root = psutil.Process(pid)
        procs = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return False
    denied = False
    for proc in procs:
        try:
            conns = proc.net_connections(kind="tcp") if hasattr(proc, "net_connections") else proc.connections(kind="tcp")
        except psutil.NoSuchProcess:
            continue
        except psutil.AccessDenied:
            denied = True
            continue
        for conn in conns:
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
                return True
    return None if denied else False


def pid_alive(pid):
    """True while ``pid`` runs (a zombie counts as dead: it only waits for its parent)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def probe_port(host, port, timeout_s=1.0):
    """"open" when ``host:port`` accepts a TCP connection, else the error text (e.g. "connection refused")."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return "open"
    except ConnectionRefusedError:
        return "connection refused"
    except OSError as exc:
        return str(exc.strerror or exc)


def probe_url(url, timeout_s):
    """(status int or None, text): 200 when GET ``url`` answered 200, else the status or error text."""
    # Imported where HTTP is spoken: ansible.module_utils.urls (with the cryptography it pulls in) costs about
    # 0.1 s of every module start, and state=recorded and port_free never use it.
    from ansible.module_utils.urls import open_url
    try:
        # The server is on this host: never through an http_proxy from the environment.
        resp = open_url(url, method="GET", timeout=timeout_s, validate_certs=True, use_proxy=False)
        return resp.getcode(), "HTTP %s" % resp.getcode()
    except Exception as exc:  # urllib HTTPError carries a code (503 while warming up); others are text
        code = getattr(exc, "code", None)
        return code, ("HTTP %s" % code) if code else str(getattr(exc, "reason", None) or exc)


def last_log_line(path, offset, width=100):
    """The last non-empty line of this launch's log, shortened to ``width`` characters ("" if none)."""
    for line in reversed(log_tail(path, 5, offset).splitlines()) if path else []:
        line = line.strip()
        if line:
            return line if len(line) <= width else line[:width - 3] + "..."
    return ""


def renew_lock(lock_dir, lock_owner):
    """Renew the restart lock's lease (gpufleet_lock.renew_lease); None when ``lock_dir`` is not set.

    Returns True when renewed. Raises gpufleet_lock.LockLost when the lock is gone or another run holds it
    (the wait must stop: another run may be restarting this host), gpufleet_lock.LockError on I/O errors.
    """
    if not lock_dir:
        return None
    gpufleet_lock.renew_lease(lock_dir, lock_owner)
    return True


class Waiter(object):
    """One readiness slice for the server ``pid``; see the module's state=ready."""

    def __init__(self, params, pid, exit_info_of, now=time.time, monotonic=time.monotonic, sleep=time.sleep):
        self.p = params
        self.pid = pid
        self.exit_info_of = exit_info_of
        self.now, self.monotonic, self.sleep = now, monotonic, sleep
        host = params["host"] or "127.0.0.1"
        self.probe_host = "127.0.0.1" if host in WILDCARDS else host.strip("[]")
        self.what = "%s on %s:%d" % (self._path(), self.probe_host, params["port"])
        self.last = "not probed yet"

    def _path(self):
        if not self.p["url"]:
            return "port"
        rest = self.p["url"].split("://", 1)[-1]
        return "/" + rest.split("/", 1)[1] if "/" in rest else "/"

    def progress(self, elapsed_s):
        line = last_log_line(self.p["log_file"], self.p["log_offset"])
        return "waiting for %s (pid %d): %.0f s of %.0f s, last: %s%s" % (
            self.what, self.pid, elapsed_s, self.p["timeout_s"], self.last,
            ("; log: '%s'" % line) if line else "")

    def died(self, elapsed_s):
        """(msg, extra result) for a server that is gone; ``elapsed_s`` None: it was gone at the first look.

        ``exit_info_of(pid)`` gives a dict: ``rc`` (exit status, -signal, None when not known), optionally
        ``elapsed_s`` (its run time, s) and ``note`` (text after the status).
        """
        info = self.exit_info_of(self.pid)
        rc = info.get("rc")
        record = read_exit_record(self.p["exit_file"], self.pid) if self.p["exit_file"] else None
        if record and record.get("started_at") and record.get("ended_at"):
            elapsed_s = record["ended_at"] - record["started_at"]  # it may have died before this call began
        elif info.get("elapsed_s") is not None:
            elapsed_s = info["elapsed_s"]
        when = (" %.1f s after it started" % elapsed_s) if elapsed_s is not None else ""
        tail = log_tail(self.p["log_file"], self.p["log_tail_lines"], self.p["log_offset"]) if self.p["log_file"] else ""
        listeners = [item for item in port_listeners(self.p["port"], self.p["host"]) if item["pid"] != self.pid]
        holder = (" Port %d is held by %s: that is why it could not serve (SGLang exits on EADDRINUSE)."
                  % (self.p["port"], describe_listeners(listeners))) if listeners else ""
        status = ("with status %d" % rc) if rc is not None and rc >= 0 else (
            "killed by signal %d" % -rc if rc is not None else "(exit status unknown%s)" % (
                ": " + info["note"] if info.get("note") else ""))
        # The first line stands alone (callers quote only it: the launch role's failure, restart.yml's summary
        # row), so it carries the log's last line; the lines after it are for a person reading the whole message.
        last = last_log_line(self.p["log_file"], self.p["log_offset"], width=160) if self.p["log_file"] else ""
        ends = (" Its log ends: '%s'." % last) if last else (" Its log is empty." if self.p["log_file"] else "")
        msg = ("the server (pid %d) exited %s%s, before %s answered.%s%s\nLast lines of this "
               "launch's log:\n%s\nFull log: %s" % (self.pid, status, when, self.what, holder, ends,
                                                    tail or "(empty)", self.p["log_file"] or "-"))
        return msg, dict(rc=rc, log_tail=tail, listeners=listeners,
                         elapsed_s=None if elapsed_s is None else round(elapsed_s, 1))

    def run(self):
        """Returns (state, elapsed_s, extra): state in ready, waiting, died, stranger, timeout."""
        created = process_start_epoch(self.pid)
        if created is None:
            return "died", None, {}
        p = self.p
        slice_end = self.monotonic() + max(p["slice_s"], 0)
        interval = max(p["poll_interval_ms"], 10) / 1000.0
        while True:
            elapsed = self.now() - created
            if not pid_alive(self.pid):
                return "died", elapsed, {}
            port_state = probe_port(self.probe_host, p["port"], timeout_s=min(1.0, interval * 5))
            if port_state != "open":
                self.last = port_state
            else:
                ours = tree_listens(self.pid, p["port"])
                if ours is False and pid_alive(self.pid):
                    listeners = port_listeners(p["port"], p["host"])
                    return "stranger", elapsed, {"listeners": listeners}
                if ours is None:
                    return "unknown_owner", elapsed, {}
                if not p["url"]:
                    return "ready", elapsed, {"ready_epoch": self.now()}
                code, text = probe_url(p["url"], max(1.0, min(p["request_timeout_s"], p["timeout_s"] - elapsed)))
                self.last = text
                if code == 200:
                    # The answer counts only if the socket is still ours and the server still runs.
                    if tree_listens(self.pid, p["port"]) and pid_alive(self.pid):
                        ready_at = self.now()
                        return "ready", ready_at - created, {"ready_epoch": ready_at}
            elapsed = self.now() - created
            if elapsed >= p["timeout_s"]:
                return "timeout", elapsed, {}
            if self.monotonic() + interval > slice_end:
                return "waiting", elapsed, {}
            self.sleep(interval)


def resolve_pid(module, p):
    """The server pid for state=ready (see find_pid); fails the task clearly when there is none."""
    try:
        return find_pid(p, module.run_command)
    except PidError as exc:
        module.fail_json(msg=str(exc), **({"rc": exc.rc} if exc.rc is not None else {}))


def exit_info_reader(module, p):
    """The Waiter's ``exit_info_of(pid)`` for this call: the unit's exit status (O(unit)), else the reaper's exit
    file (O(exit_file)), else an unknown status."""
    def exit_info_of(dead_pid):
        if p["unit"]:
            return unit_exit(unit_show(module.run_command, p["unit"]), dead_pid)
        return {"rc": await_exit_file(p["exit_file"], dead_pid) if p["exit_file"] else None}
    return exit_info_of


def run_ready(module, p, result):
    pid = resolve_pid(module, p)
    exit_info_of = exit_info_reader(module, p)
    result.update(pid=pid, ready=False, ready_epoch=None, ready_wait_ms=None, lock_renewed=None,
                  lock_renewed_at_ready=None)
    try:
        result["lock_renewed"] = renew_lock(p["lock_dir"], p["lock_owner"])
    except gpufleet_lock.LockError as exc:
        module.fail_json(msg="stopped waiting for the server (pid %d, left running): %s" % (pid, exc), **result)
    waiter = Waiter(p, pid, exit_info_of)
    state, elapsed, extra = waiter.run()
    result.update(elapsed_s=None if elapsed is None else round(elapsed, 1), last=waiter.last)
    if elapsed is not None:  # None: the server was gone before the first look (state died)
        result["progress"] = waiter.progress(elapsed)
    if state == "ready":
        ready_result(result, waiter, pid, elapsed, extra)
        if p["lock_dir"]:
            # A whole lease from here: the next phase needs no renewal of its own. The server serves either way,
            # so a lost lock here is the caller's to see (its own renewal fails and says so), not a failed wait.
            try:
                result["lock_renewed_at_ready"] = bool(renew_lock(p["lock_dir"], p["lock_owner"]))
            except gpufleet_lock.LockError as exc:
                result.update(lock_renewed_at_ready=False, lock_renewed_at_ready_error=str(exc))
        module.exit_json(msg=result["progress"], **result)
    if state == "waiting":
        module.exit_json(msg=result["progress"], running=True, **result)
    if state == "died":
        msg, more = waiter.died(elapsed)
        result.update(more)
        module.fail_json(msg=msg, **result)
    fail_not_ready(module, p, result, waiter, pid, state, extra)


def ready_result(result, waiter, pid, elapsed, extra):
    """Fill ``result`` for a server seen ready (Waiter state ``ready``)."""
    result.update(ready=True, ready_wait_ms=int(elapsed * 1000), ready_epoch=round(extra["ready_epoch"], 3),
                  progress="%s answered on pid %d's socket after %.1f s" % (waiter.what, pid, elapsed))


def not_ready_message(p, waiter, pid, state, extra):
    """(msg, extra result) for the Waiter states ``stranger``, ``unknown_owner`` and ``timeout``."""
    if state == "stranger":
        return ("port %d is answered by %s, not by the launched server (pid %d, still loading): "
                "that process took the port, so the server cannot bind it; stop it, then rerun"
                % (p["port"], describe_listeners(extra["listeners"]) or "another process", pid),
                {"listeners": extra["listeners"]})
    if state == "unknown_owner":
        return ("port %d answers, but this user cannot see whether pid %d owns the listening socket "
                "(another user's process): run this task as root (become)" % (p["port"], pid), {})
    tail = log_tail(p["log_file"], p["log_tail_lines"], p["log_offset"]) if p["log_file"] else ""
    # Only here: the server may still come up (restart.yml's rollback says "still loading" from this).
    # Past tense: by the time a summary quotes this line, the rollback may have stopped that pid.
    return ("the server (pid %d) was running but did not answer %s within %.0f s of starting (last: %s). "
            "The model may still be loading: raise sglang_launch_ready_timeout_s, or read the log "
            "%s.\nLast lines of this launch's log:\n%s" % (pid, waiter.what, p["timeout_s"], waiter.last,
                                                           p["log_file"] or "-", tail or "(empty)"),
            {"running": pid_alive(pid), "log_tail": tail})


def fail_not_ready(module, p, result, waiter, pid, state, extra):
    """fail_json for the Waiter states ``stranger``, ``unknown_owner`` and ``timeout``."""
    msg, more = not_ready_message(p, waiter, pid, state, extra)
    result.update(more)
    module.fail_json(msg=msg, **result)


def post_generate(url, text, max_new_tokens, api_key, timeout_s):
    """One generation through SGLang's native API: POST ``url`` (``.../generate``) with
    ``{"text": text, "sampling_params": {"max_new_tokens": N, "temperature": 0}}`` and, with ``api_key``, the
    header ``Authorization: Bearer <key>`` (SGLang's --api-key). Never through an http_proxy (the server is on
    this host). Never raises.

    Returns ``{"status": int or None (no HTTP answer), "json": the parsed body or None, "msg": str,
    "elapsed_ms": int}``; the generated text is ``json["text"]`` on success (SGLang, all releases).
    """
    from ansible.module_utils.urls import open_url  # see probe_url
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = "Bearer " + api_key
    body = json.dumps({"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}})
    started = time.monotonic()
    status, raw, msg = None, b"", ""
    try:
        resp = open_url(url, data=body, method="POST", headers=headers, timeout=timeout_s, validate_certs=True,
                        use_proxy=False)
        status, raw = resp.getcode(), resp.read()
        msg = "OK (%d bytes)" % len(raw)
    except Exception as exc:  # urllib HTTPError carries a code and a body (401 without the key); others are text
        status = getattr(exc, "code", None)
        msg = ("HTTP Error %s: %s" % (status, getattr(exc, "reason", "") or exc)) if status else (
            "Request failed: %s" % (getattr(exc, "reason", None) or exc))
        try:
            raw = exc.read() if status else b""
        except Exception:
            raw = b""
    try:
        parsed = json.loads(raw.decode("utf-8", "replace")) if raw else None
    except ValueError:
        parsed = None
        if raw:
            msg = "%s; the body is not JSON: %r" % (msg, raw[:200])
    return {"status": status, "json": parsed, "msg": msg, "elapsed_ms": int((time.monotonic() - started) * 1000)}


def find_pid(p, run_command):
    """The server pid: O(pid), else O(pid_file), else the unit's MainPID. Raises PidError saying why not."""
    if p["pid"]:
        return p["pid"]
    if p["pid_file"]:
        read = read_pid_file(p["pid_file"])
        if read.problem in (MISSING, UNREADABLE):
            raise PidError("cannot read the pid file %s (%s): was the server started?" % (p["pid_file"], read.error))
        if not read.ok:
            raise PidError(read.error)
        return read.pid
    props = unit_show(run_command, p["unit"])
    main_pid = int(props.get("MainPID") or 0)
    if main_pid <= 0:
        raise PidError("systemd unit %s has no main process (ActiveState=%s, ExecMainStatus=%s): the server "
                       "is not running; see journalctl -u %s and %s" % (
                           p["unit"], props.get("ActiveState", "?"), props.get("ExecMainStatus", "?"), p["unit"],
                           p["log_file"] or "the server log"),
                       rc=int(props.get("ExecMainStatus") or 0) or None)
    return main_pid


class PidError(Exception):
    """The server pid cannot be found (message says why; ``rc`` the unit's exit status when known)."""

    def __init__(self, msg, rc=None):
        Exception.__init__(self, msg)
        self.rc = rc


def run_verified(module, p, result):
    """O(state=verified): one generation, every worker's environment, then one look at the server and its socket.

    Never fails for what it finds (the caller asserts, with its own messages); fails only for bad input.
    """
    try:
        pid, pid_error = find_pid(p, module.run_command), None
    except PidError as exc:
        pid, pid_error = None, str(exc)
    result.update(pid=pid)
    if p["generate"] is not None:
        g = p["generate"]
        result["generate"] = post_generate(g["url"], g["text"], g["max_new_tokens"], p["api_key"], g["timeout_s"])
    b = p["burst"]
    if b is not None and b["requests"] > 0:
        problems = gpufleet_burst.burst_errors(b["requests"], b["concurrency"], b["max_new_tokens"], b["timeout_s"])
        if problems:
            module.fail_json(msg="; ".join(problems), **result)
        if p["generate"] is not None and result["generate"]["status"] != 200:
            result["burst"] = {"skipped": True, "ok": None, "msg": "not sent: the single generation failed first"}
        else:
            result["burst"] = gpufleet_burst.run_burst(b["url"], b["requests"], b["concurrency"], b["max_new_tokens"],
                                                       b["timeout_s"], p["api_key"], b["text"])
    if p["worker_env"] is not None:
        w = p["worker_env"]
        try:
            title_re = re.compile(w["title_pattern"])
        except re.error as exc:
            module.fail_json(msg="invalid worker_env.title_pattern: %s" % exc, **result)
        if pid is None:
            result["workers"] = dict(worker_report([]), server_pid=None, msg=pid_error)
        elif not psutil.pid_exists(pid):
            result["workers"] = dict(worker_report([]), server_pid=pid, msg="server pid %d is not running" % pid)
        else:
            result["workers"] = dict(worker_report(inspect_workers(candidate_pids(pid), title_re, w["expected"],
                                                                   w["names"])), server_pid=pid)
    if p["owner"]:
        owner = {"ready": False, "pid": pid}
        if pid is None:
            owner["msg"] = pid_error
        else:
            # One look (slice 0); the server's age does not matter here.
            look = dict(p, slice_s=0, timeout_s=31536000.0)
            waiter = Waiter(look, pid, exit_info_reader(module, p))
            state, elapsed, extra = waiter.run()
            if state == "ready":
                owner.update(ready=True, msg="pid %d runs and answered %s on its own socket" % (pid, waiter.what))
            elif state == "waiting":
                owner["msg"] = "pid %d runs but %s did not answer (last: %s)" % (pid, waiter.what, waiter.last)
            elif state == "died":
                owner["msg"], more = waiter.died(elapsed)
                owner.update(rc=more["rc"], listeners=more["listeners"])
            else:
                owner["msg"], more = not_ready_message(look, waiter, pid, state, extra)
                owner.update((k, v) for k, v in more.items() if k == "listeners")
        result["owner"] = owner
    module.exit_json(**result)


def run_started(module, p, result):
    argv = p["argv"]
    if not argv or not argv[0]:
        module.fail_json(msg="argv must name a command as its first element", **result)
    result["argv"] = argv
    result["created_dirs"] = []
    if p["wait_ready"]:
        result.update(ready=False, ready_epoch=None, ready_wait_ms=None)
    for path_key in ("log_file", "pid_file", "exit_file"):
        parent = os.path.dirname(os.path.abspath(p[path_key]))
        if os.path.isdir(parent) or parent in result["created_dirs"]:
            continue
        if not p["create_dirs"]:
            module.fail_json(msg="directory %s for %s does not exist (create sglang_state_dir first, or set "
                             "create_dirs)" % (parent, path_key), **result)
        result["created_dirs"].append(parent)
        if not module.check_mode:
            try:
                os.makedirs(parent, mode=0o755, exist_ok=True)
            except OSError as exc:
                module.fail_json(msg="could not create directory %s for %s: %s" % (parent, path_key, exc), **result)
    if result["created_dirs"]:
        result["changed"] = True

    try:
        existing = running_pid(p["pid_file"])
    except OSError as exc:
        module.fail_json(msg="cannot read the pid file %s (%s): nothing was started; check its owner and mode"
                         % (p["pid_file"], exc), **result)
    if existing is not None:
        result["pid"] = existing
        module.exit_json(msg="already running (pid %d from %s)" % (existing, p["pid_file"]), **result)
    if p["port"]:
        listeners = port_listeners(p["port"], p["host"])
        if listeners and module.check_mode:
            # In check mode nothing was stopped: the server about to be replaced may well hold the port.
            result["listeners"] = listeners
            module.warn("port %d is held now by %s; a real run stops the old server first"
                        % (p["port"], describe_listeners(listeners)))
        elif listeners:
            result["listeners"] = listeners
            module.fail_json(msg="port %d taken by %s before launch: nothing was started; stop that process or "
                             "set another sglang_port" % (p["port"], describe_listeners(listeners)), **result)
    if module.check_mode:
        result.update(changed=True, started=True)
        module.exit_json(msg="would start %s" % argv[0], **result)

    result["log_offset"] = log_size(p["log_file"])
    try:
        started = start_server(argv, p["env"], p["inherit_env"], p["chdir"], p["log_file"], p["pid_file"],
                               p["exit_file"], api_key=p["api_key"])
    except OSError as exc:
        module.fail_json(msg="could not start %s: %s" % (argv[0], exc), **result)
    pid, started_at, offset = started["pid"], started["started_at"], started["log_offset"]
    result.update(changed=True, started=True, pid=pid, started_at=started_at, log_offset=offset)

    def died():
        rc = await_exit_file(p["exit_file"], pid)
        os.unlink(p["pid_file"])
        module.fail_json(msg="%s exited with status %s %.1f s after it started; full log: %s"
                         % (argv[0], "?" if rc is None else rc, time.time() - started_at, p["log_file"]),
                         rc=rc, log_tail=log_tail(p["log_file"], p["log_tail_lines"], offset), **result)

    if p["wait_ready"]:
        # The readiness test of state=ready, in a slice as long as the startup window, probing at least every
        # 100 ms: the caller skips its own readiness wait when this one saw the server serve.
        params = dict(p, log_offset=offset, slice_s=max(p["startup_check_s"], 0),
                      poll_interval_ms=min(p["poll_interval_ms"], 100))
        waiter = Waiter(params, pid, lambda dead: {"rc": await_exit_file(p["exit_file"], dead)})
        state, elapsed, extra = waiter.run()
        result.update(elapsed_s=None if elapsed is None else round(elapsed, 1), last=waiter.last)
        if state == "died":
            died()
        if state == "ready":
            ready_result(result, waiter, pid, elapsed, extra)
            module.exit_json(msg="started pid %d; %s" % (pid, result["progress"]), **result)
        if state in ("stranger", "unknown_owner"):
            result["progress"] = waiter.progress(elapsed)
            fail_not_ready(module, params, result, waiter, pid, state, extra)
        result["progress"] = waiter.progress(elapsed)
        module.exit_json(msg="started pid %d; %s" % (pid, result["progress"]), **result)

    deadline = time.monotonic() + max(p["startup_check_s"], 0)
    while time.monotonic() < deadline:
        if process_start_epoch(pid) is None:
            died()
        time.sleep(0.1)
    module.exit_json(msg="started pid %d" % pid, **result)


def run_port_free(module, p, result):
    listeners = port_listeners(p["port"], p["host"])
    result["listeners"] = listeners
    if listeners:
        module.fail_json(msg="port %d taken by %s before launch: nothing was started; stop that process or set "
                         "another sglang_port" % (p["port"], describe_listeners(listeners)), **result)
    module.exit_json(msg="nothing listens on port %d" % p["port"], **result)


def run_recorded(module, p):
    """state=recorded: O(record) as JSON to O(record_file), atomically; changed when the text differs."""
    path = p["record_file"]
    try:
        with open(path) as handle:
            before = handle.read()
    except FileNotFoundError:
        before = None
    except (OSError, UnicodeDecodeError) as exc:
        module.fail_json(msg="cannot read the launch record %s (%s): fix its permissions or remove it" % (path, exc),
                         record_file=path)
    record = dict(p["record"])
    if module.check_mode and before and p["check_mode_keep"]:
        try:
            old = json.loads(before)
        except ValueError:
            old = None
        if isinstance(old, dict):
            record.update((key, old[key]) for key in p["check_mode_keep"] if key in old)
    text = json.dumps(record, indent=4, sort_keys=True) + "\n"
    result = dict(changed=before != text, record_file=path)
    if module._diff:
        result["diff"] = dict(before=before or "", after=text, before_header=path, after_header=path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        if module.check_mode:
            # A first restart in check mode: the real run creates the state directory (the start's create_dirs)
            # before it gets here.
            module.warn("directory %s for record_file does not exist yet: a real run creates it before it writes "
                        "the record" % directory)
            module.exit_json(**result)
        module.fail_json(msg="directory %s for record_file does not exist (create sglang_state_dir first)" % directory,
                         **result)
    if result["changed"] and not module.check_mode:
        try:
            write_file_atomic(path, text)
        except OSError as exc:
            module.fail_json(msg="could not write the launch record %s: %s (the previous record, if any, is "
                             "unchanged)" % (path, exc), **result)
    result["lock_release"] = None
    if p["lock_dir"] and not module.check_mode:
        # The record was written (or was already right): release the restart lock in the same call. A failure
        # here is not the record's: the server serves and is recorded; the caller's own release runs instead.
        try:
            released, holder = gpufleet_lock.release_lease(p["lock_dir"], p["lock_owner"])
        except (gpufleet_lock.LockError, OSError) as exc:
            result["lock_release_error"] = "could not release the restart lock %s: %s" % (p["lock_dir"], exc)
        else:
            result["lock_release"] = released
            result["changed"] = result["changed"] or released == "released"
            if released == "not_owner":
                # What gpufleet_lock state=absent says: another run took the lock over after this run's lease
                # ended (it may be restarting this host now).
                result["lock_holder"] = holder
                module.warn("restart lock %s left alone: it is held by %s (taken over after this run's lease "
                            "ended)" % (p["lock_dir"], gpufleet_lock.describe(holder)))
    module.exit_json(**result)


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
    if p["state"] == "started":
        run_started(module, p, result)
    elif p["state"] == "ready":
        run_ready(module, p, result)
    elif p["state"] == "verified":
        run_verified(module, p, result)
    else:
        run_port_free(module, p, result)


if __name__ == "__main__":
    # Imports and constants to the permanent GC generation: the exit skips walking them (about 20 ms less per
    # call; docs/benchmarks.md, module exit)
    gc.freeze()
    main()
