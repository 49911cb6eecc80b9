#!/usr/bin/python
# -*- coding: utf-8 -*-
# gpufleet: the per-host restart lock (a lease on the host's clock): take, renew, release, show, remove.
from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpufleet_lock
short_description: Take, renew, release, show or remove gpufleet's per-host restart lock (a renewable lease)
description:
  - "The restart lock keeps two runs (an AWX schedule and an operator, two AWX jobs) from restarting the same
    host at once. It is a directory O(path) (default C(<sglang_state_dir>/restart.lock)) holding C(owner.json):
    run id, controller hostname, controller pid, user, when it was started and last renewed, the lease length
    and when it expires."
  - "The lock is a lease: it stays valid for O(lease_s) seconds after its last renewal, measured on the
    host's own clock (the expiry is written by the host, never compared with a controller's clock). The
    holding run renews it at each restart phase (O(state=renewed)) and inside long waits (modules call
    C(renew_lease) of module_utils C(gpufleet_lock)). A run that was killed or cancelled (an AWX job cancel
    runs no C(always:) section) stops renewing, so any controller may take the lock over once it expired."
  - "O(state=present) takes the lock, or renews it when the C(run_id) of this O(owner) holds it already; it fails
    naming the holder when another run holds an unexpired lease."
  - O(state=renewed) pushes the lease forward and fails when this run no longer holds the lock.
  - "O(state=absent) releases the lock the C(run_id) of this O(owner) holds (a lock another run took over is left
    alone); with O(force=true) it removes the lock whoever holds it (C(playbooks/unlock.yml))."
  - O(state=query) only reports the holder.
  - "Concurrent calls on one host are serialised with C(flock(2)) on C(<path>.guard), which the kernel drops
    when the process ends: nothing outlives the module."
version_added: "0.1.0"
author: gpufleet maintainers (!UNKNOWN)
options:
  path:
    description: The lock directory; its parent (the state directory) is created (0755) when missing.
    type: path
    required: true
  state:
    description: What to do with the lock.
    type: str
    choices: [present, renewed, absent, query]
    default: present
  owner:
    description:
      - Who takes the lock. C(run_id) (required for O(state=present), O(state=renewed) and O(state=absent)
        without O(force)) identifies the run; C(controller), C(pid), C(user) describe it for people (the
        filter C(gpufleet_lock_owner) builds this mapping on the controller).
    type: dict
  lease_s:
    description:
      - Lease length in seconds. The lock expires this long after its last renewal unless renewed again.
      - "For O(state=renewed), O(lease_s) replaces the length recorded at take time."
      - "A lock without lease fields (written by an earlier gpufleet release, or by hand) counts as held for
        O(lease_s) after its last modification (without the O(min_lease_s) floor)."
    type: int
    default: 300
  min_lease_s:
    description:
      - "Floor for the effective lease (seconds): C(max(lease_s, min_lease_s)). C(restart.yml) passes the
        longest wait between two renewals plus a margin, so that a slow phase never lets the lease lapse."
    type: int
    default: 0
  take_over_run_id:
    description:
      - "O(state=present): take the lock even before its lease expired when its holder's run id is exactly this
        (the caller proved that run dead, e.g. its pid is gone on this controller). A lock that changed hands
        meanwhile is not touched."
    type: str
  force:
    description: O(state=absent) removes the lock whoever holds it.
    type: bool
    default: false
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: Reports what it would do (C(result)) and writes nothing.
  diff_mode:
    support: full
    details: C(owner.json) before and after (empty when absent).
  platform:
    support: full
    platforms: posix
notes:
  - "Errors: fails when another run holds an unexpired lease (O(state=present); the message names run id,
    controller, pid, user, started, renewed, expires), when this run lost the lock (O(state=renewed)), or
    when the lock directory cannot be read or written (permissions: the lock is created by the user the
    restart runs as, root for the systemd method)."
"""

EXAMPLES = r"""
- name: Take the restart lock for this run
  gpufleet.fleet.gpufleet_lock:
    path: /var/lib/gpufleet/restart.lock
    owner: "{{ gpufleet_run_id | gpufleet_lock_owner }}"
    lease_s: 300

- name: Renew at the start of a long phase
  gpufleet.fleet.gpufleet_lock:
    path: /var/lib/gpufleet/restart.lock
    state: renewed
    owner: {run_id: "{{ gpufleet_run_id }}"}

- name: Show who holds the lock
  gpufleet.fleet.gpufleet_lock:
    path: /var/lib/gpufleet/restart.lock
    state: query
  register: lock

- name: Remove the lock whoever holds it
  gpufleet.fleet.gpufleet_lock:
    path: /var/lib/gpufleet/restart.lock
    state: absent
    force: true
"""

RETURN = r"""
result:
  description:
    - "What happened: C(taken) (free, or ours: renewed), C(taken_over) (previous holder's lease expired or
      O(take_over_run_id) matched), C(refused), C(renewed), C(released), C(not_owner) (another run holds it;
      left alone), C(removed), C(absent) (there was no lock), C(held) / C(free) (O(state=query))."
  type: str
  returned: always
  sample: taken_over
acquired:
  description: This run holds the lock after the call (O(state=present) and O(state=renewed)).
  type: bool
  returned: always
lock:
  description:
    - "The owner record after the call (O(state=present), O(state=renewed)), or the holder found
      (O(state=query), O(state=absent): the one removed); null when there is no lock."
  type: dict
  returned: always
  sample: {run_id: "4711", controller: awx-job-4711-x2f, pid: 12, user: runner, started: "2026-11-30T19:20:00Z",
           renewed: "2026-11-30T19:21:40Z", lease_s: 300, expires: "2026-11-30T19:26:40Z", expires_at: 1796066800.0}
  contains:
    run_id:
      description: The run that holds it (O(owner)).
      type: str
    controller:
      description: The controller the run started from.
      type: str
    pid:
      description: The controller process of the run.
      type: int
    user:
      description: The user the run started as.
      type: str
    started:
      description: When the lock was taken (ISO 8601 UTC).
      type: str
    started_epoch:
      description: When the lock was taken (epoch s).
      type: float
    renewed:
      description: When the lease was last renewed (ISO 8601 UTC).
      type: str
    renewed_at:
      description: When the lease was last renewed (epoch s).
      type: float
    lease_s:
      description: The lease length, s.
      type: int
    expires:
      description: When the lease ends (ISO 8601 UTC).
      type: str
    expires_at:
      description: When the lease ends (host epoch s).
      type: float
    expired:
      description: Whether the lease has ended (when read).
      type: bool
    remaining_s:
      description: Seconds left on the lease, negative once expired (when read).
      type: float
    legacy:
      description: A lock of an earlier release without lease fields; its expiry is its mtime plus O(lease_s) (when read).
      type: bool
previous_holder:
  description: The owner record of a lock that was taken over or refused us (same keys as RV(lock)).
  type: dict
  returned: when there was another holder
lease_s:
  description: Effective lease length in seconds, C(max(lease_s, min_lease_s)).
  type: int
  returned: always
msg:
  description: One line for people.
  type: str
  returned: always
"""

import gc
import json

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_lock import (
    LockError, LockLost, describe, read_holder, release_lease, remove_lock, renew_lease, take_lease)


def _public(record):
    if record is None:
        return None
    return dict((k, v) for k, v in record.items())


def _owner_text(record):
    if not record:
        return ""
    keep = dict((k, v) for k, v in record.items() if k not in ("expired", "remaining_s"))
    return json.dumps(keep, indent=2, sort_keys=True) + "\n"


def run(params, check_mode):
    """The module's work without Ansible: returns (failed: bool, result dict)."""
    path = params["path"].rstrip("/")
    state = params["state"]
    owner = dict(params.get("owner") or {})
    # A lock of an earlier release (no lease fields) is judged by the lease asked for, without the floor: that
    # is what gpufleet_lock_stale_s meant for it ("age after which a lock left by a dead run is taken over").
    legacy_lease_s = max(int(params["lease_s"]), 1)
    lease_s = max(int(params["lease_s"]), int(params["min_lease_s"] or 0))
    out = {"changed": False, "acquired": False, "lock": None, "lease_s": lease_s}
    if lease_s < 1:
        return True, dict(out, result="refused", msg="gpufleet_lock: lease_s must be at least 1 s (got %d); "
                                                     "set gpufleet_lock_lease_s to a positive number" % lease_s)
    needs_owner = state in ("present", "renewed") or (state == "absent" and not params["force"])
    if needs_owner and not str(owner.get("run_id") or "").strip():
        return True, dict(out, result="refused", msg="gpufleet_lock: state=%s needs owner.run_id" % state)
    run_id = str(owner.get("run_id", ""))
    before = read_holder(path, legacy_lease_s)

    if state == "query":
        return False, dict(out, result="held" if before else "free", lock=before,
                           msg="%s: %s" % (path, ("held by " + describe(before)) if before else "no lock"))

    if state == "present":
        result, holder = take_lease(path, owner, lease_s, params.get("take_over_run_id"), check_mode,
                                    legacy_lease_s=legacy_lease_s)
        if result == "refused":
            return True, dict(out, result=result, previous_holder=holder, lock=holder,
                              msg="locked by another restart: %s. Nothing was changed. Wait for that run to "
                                  "finish or for its lease to expire; if it is certainly gone, run "
                                  "playbooks/unlock.yml for this host" % describe(holder))
        after = read_holder(path, legacy_lease_s) if not check_mode else None
        msg = "lock %s %s" % (path, "would be taken" if check_mode else "taken")
        if result == "taken_over":
            msg += " over from %s" % describe(holder)
        res = dict(out, changed=True, acquired=not check_mode, result=result, lock=after, msg=msg)
        if holder is not None and holder.get("run_id") != run_id:
            res["previous_holder"] = holder
        res["diff"] = {"before": _owner_text(before), "after": _owner_text(after) if after else "(lock taken)\n"}
        return False, res

    if state == "renewed":
        if check_mode:
            held = before is not None and before.get("run_id") == run_id
            return (not held), dict(out, result="renewed" if held else "refused", acquired=held, lock=before,
                                    msg="would renew" if held else "this run does not hold %s" % path)
        try:
            after = renew_lease(path, run_id, lease_s)
        except LockLost as exc:
            return True, dict(out, result="refused", lock=exc.holder, msg=str(exc))
        return False, dict(out, changed=True, acquired=True, result="renewed", lock=after,
                           msg="lease renewed until %s (host clock)" % after["expires"],
                           diff={"before": _owner_text(before), "after": _owner_text(after)})

    # absent
    if params["force"]:
        removed, holder = remove_lock(path, check_mode)
        result = "absent" if holder is None else "removed"
        return False, dict(out, changed=holder is not None, result=result, lock=holder,
                           msg=("no lock at %s" % path) if holder is None else
                           "%s lock of %s" % ("would remove the" if check_mode else "removed the", describe(holder)),
                           diff={"before": _owner_text(before), "after": ""})
    result, holder = release_lease(path, run_id, check_mode)
    msg = {"released": "lock released", "absent": "no lock to release",
           "not_owner": "lock left alone: it is held by %s" % describe(holder)}[result]
    return False, dict(out, changed=result == "released", result=result, lock=holder, msg=msg,
                       diff={"before": _owner_text(before), "after": "" if result == "released" else _owner_text(before)})


def main():
    module = AnsibleModule(
        argument_spec=dict(
            path=dict(type="path", required=True),
            state=dict(type="str", default="present", choices=["present", "renewed", "absent", "query"]),
            owner=dict(type="dict"),
            lease_s=dict(type="int", default=300),
            min_lease_s=dict(type="int", default=0),
            take_over_run_id=dict(type="str"),
            force=dict(type="bool", default=False),
        ),
        supports_check_mode=True,
    )
    try:
        failed, result = run(module.params, module.check_mode)
    except LockError as exc:
        module.fail_json(msg="%s. Check that the state directory is writable by the user the restart runs as "
                             "(root for the systemd method)" % exc, result="error", acquired=False)
    if not module._diff:
        result.pop("diff", None)
    if failed:
        module.fail_json(**result)
    module.exit_json(**result)


if __name__ == "__main__":
    # Imports and constants to the permanent GC generation: the exit skips walking them (about 20 ms less per
    # call; docs/benchmarks.md, module exit)
    gc.freeze()
    main()
