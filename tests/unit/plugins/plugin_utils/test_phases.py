"""plugins/plugin_utils/phases.py: the phase table (names, order, role and task file → phase), the advice for a host
lost in a phase, and the restart lock's lease plan."""
import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ansible_collections.gpufleet.fleet.plugins.filter import gpufleet_run
from ansible_collections.gpufleet.fleet.plugins.plugin_utils import phases


def test_the_restart_phases_come_in_the_order_a_host_goes_through_them():
    assert phases.RESTART_PHASES == ("preflight", "prefetch", "lock", "patch", "stop", "wait", "launch", "verify")
    assert set(phases.PHASE_OF_ROLE.values()) <= set(phases.PHASES)
    assert set(phases.CUT_SHORT_IN) == set(phases.PHASES)


@pytest.mark.parametrize("kwargs,phase", [
    (dict(role="sglang_stop"), "stop"),
    (dict(role="gpufleet.fleet.gpu_memory_wait"), "wait"),
    (dict(role="sglang_launch", task_path="/x/roles/sglang_launch/tasks/main.yml:3"), "launch"),
    (dict(role="sglang_launch", task_path="/x/roles/sglang_launch/tasks/rollback.yml:40"), "rollback"),
    # the argument validation of include_role tasks_from: rollback (its path is no task file of the role)
    (dict(role="sglang_launch", entry_point="rollback"), "rollback"),
    # the launch record (after verify) and the argv rendered in the stop phase: the host stays in its phase
    (dict(role="sglang_launch", task_path="/x/roles/sglang_launch/tasks/record.yml:3", default="verify"), "verify"),
    # the launch history entry (after the record; tune.yml calls entry point history after measuring): no launch
    (dict(role="sglang_launch", task_path="/x/roles/sglang_launch/tasks/history.yml:7", default="verify"), "verify"),
    (dict(role="sglang_launch", entry_point="history", default="verify"), "verify"),
    (dict(role="sglang_launch", task_path="/x/roles/sglang_launch/tasks/prepare.yml:3", default="stop"), "stop"),
    (dict(role="sglang_launch", task_path="/x/roles/sglang_launch/tasks/checks.yml:8"), None),
    (dict(role="sglang_launch", entry_point="prepare", default="stop"), "stop"),
    (dict(task_path="/coll/ansible_collections/gpufleet/fleet/playbooks/tasks/restart_lock_take.yml:9"), "lock"),
    (dict(task_path="/repo/playbooks/tasks/restart_lock_release.yml:5", phase_var="verify"), None),
    # restart_phase.yml and restart_lock_renew.yml: the phase they were imported with
    (dict(task_path="/repo/playbooks/tasks/restart_lock_renew.yml:8", phase_var="wait"), "wait"),
    (dict(task_path="/repo/playbooks/tasks/restart_phase.yml:9", phase_var="patch"), "patch"),
    (dict(task_path="/repo/playbooks/restart.yml:300", phase_var="bogus", default="launch"), "launch"),
    (dict(role="some_other_role"), None),
])
def test_a_task_is_placed_in_its_phase_from_structured_data_only(kwargs, phase):
    assert phases.phase_of_task(**kwargs) == phase


def test_the_phase_mark_publishes_the_phase_of_its_host_only():
    res = {"ansible_stats": {"data": {"gpufleet_restart": {"gpu-01": {"phase": "wait"}}}}}
    assert phases.phase_of_row(res, "gpu-01") == "wait"
    assert phases.phase_of_row(res, "gpu-02") is None
    assert phases.phase_of_row({"ansible_stats": {"data": {"gpufleet_restart": {"gpu-01": {"phase": "x"}}}}},
                               "gpu-01") is None
    assert phases.phase_of_row({"changed": False}, "gpu-01") is None and phases.phase_of_row(None, "h") is None


# -- a host lost in a phase ---------------------------------------------------------------------------------

def test_unreachable_advice_with_what_restart_yml_knows_names_the_host_and_the_facts():
    advice = phases.unreachable_advice
    assert advice("patch", "gpu-01", state_dir="/srv/gf") == (
        "the old server still serves; engine.py may be patched (its previous bytes are in "
        "/srv/gf/nccl-patch-prev): rerun restart.yml -e target=gpu-01 once the lock's lease ended")
    assert advice("stop", "gpu-01", lease_s=300, start_with_stop=True) == (
        "the old server may be stopped or still draining, the new one may have been started by the stop, engine.py "
        "patched: run playbooks/check.yml -e target=gpu-01; rerun restart.yml for it once the lock's lease ended "
        "(300 s or more)")
    assert "the new one may have been started" not in advice("stop", "gpu-01", lease_s="300", start_with_stop=False)
    assert advice("wait", "gpu-01", stop_result={"start": {"started": True, "pid": 4242}}) == (
        "the old server is stopped and the stop started the new one (pid 4242): run playbooks/check.yml "
        "-e target=gpu-01")
    # the stop ran and started nothing (systemd method, or start_after off)
    assert advice("wait", "gpu-01", stop_result={"start": {"started": False}}) == advice("wait", "gpu-01",
                                                                                           stop_result={}) == (
        "the old server is stopped and no new one was started: rerun restart.yml -e target=gpu-01 once the lock's "
        "lease ended")
    assert advice("launch", "gpu-01").endswith("-e target=gpu-01 (the lock frees itself when its lease ends)")
    assert advice("verify", "gpu-01") == ("the new server was up when the connection was lost: run "
                                          "playbooks/check.yml -e target=gpu-01")


def test_unreachable_advice_without_facts_says_only_what_holds_either_way():
    advice = phases.unreachable_advice
    assert advice("preflight") == "nothing was changed on this host: check ssh, then rerun"
    assert advice("lock").startswith("nothing was stopped; a lock taken frees itself")
    assert "<sglang_state_dir>/nccl-patch-prev" in advice("patch") and "for this host" in advice("patch")
    # not known whether the stop starts the new server, nor whether it did
    assert "the new one may have been started by the stop (process method)" in advice("stop")
    assert "the stop may have started the new one (process method)" in advice("wait")
    assert advice("launch") == ("ssh lost during launch: the server may have come up; run playbooks/check.yml for "
                                "this host")
    assert advice(None) == advice("rollback") == "run playbooks/check.yml for this host"


def test_the_filter_is_the_core_function():
    filters = gpufleet_run.FilterModule().filters()
    assert filters["gpufleet_unreachable_advice"]("wait", host="h", stop_result={}) == \
        phases.unreachable_advice("wait", host="h", stop_result={})


# -- the restart lock's lease --------------------------------------------------------------------------------

# restart.yml's defaults: the stop 2*60+15+10, the wait 120, a readiness slice 30, verify 2*120, margin 60.
DEFAULTS = dict(stop_s=145, wait_s=120, slice_s=30, verify_s=240, margin_s=60)


@pytest.mark.parametrize("lease_s,renew", [
    (300, ["wait", "verify"]),  # budget 240: stop+wait 265 > 240; wait+slice 150 fits; slice+verify 270 > 240
    (10, ["wait", "verify"]),  # a short lease is raised to the least lease (300)
    (325, ["launch", "verify"]),  # stop+wait 265 fits in 265: the launch's stretch counts the stop too (295)
    (355, []),  # budget 295: every stretch fits
])
def test_a_phase_renews_the_lease_only_where_its_stretch_would_not_fit(lease_s, renew):
    plan = phases.lock_plan(lease_s=lease_s, **DEFAULTS)
    assert plan["min_lease_s"] == 300
    assert plan["renew_phases"] == renew
    assert plan["budget_s"] == max(lease_s, 300) - 60


def test_the_least_lease_outlasts_the_longest_stretch_plus_the_margin_rounded_up():
    plan = phases.lock_plan(stop_s="10.2", wait_s=5, slice_s=1, verify_s=2, margin_s=0, lease_s=1)
    assert plan["min_lease_s"] == 11 and isinstance(plan["min_lease_s"], int)
    assert plan["budget_s"] == 11.0


@pytest.mark.parametrize("lease_s,start_wait_s,startup_check_s,renews", [
    (300, 3, 3, False),  # budget 240: the stop 145 + the start's window 3 + a slice 30 fit
    (300, 70, 3, True),  # 145 + 70 + 30 = 245 > 240
    (300, 3, 70, True),  # the longer of the two windows counts
    (400, 70, 70, False),  # budget 340
])
def test_the_wait_renews_after_a_stop_that_saw_the_memory_free_only_when_the_start_would_outrun_the_lease(
        lease_s, start_wait_s, startup_check_s, renews):
    plan = phases.lock_plan(lease_s=lease_s, start_wait_s=start_wait_s, startup_check_s=startup_check_s, **DEFAULTS)
    assert plan["wait_renews_when_memory_free"] is renews


def test_the_lock_plan_filter_takes_restart_yml_s_mapping():
    plan = gpufleet_run.FilterModule().filters()["gpufleet_lock_plan"](dict(DEFAULTS, lease_s="300"))
    assert plan == phases.lock_plan(lease_s=300, **DEFAULTS)
    plan = gpufleet_run.FilterModule().filters()["gpufleet_lock_plan"](dict(DEFAULTS, lease_s=300, start_wait_s="70",
                                                                            startup_check_s=3))
    assert plan["wait_renews_when_memory_free"] is True


# The Jinja restart.yml (main 36d90d5, restart.yml:152-164) and tasks/restart_lock_renew.yml worked the plan out
# with before it moved here: the function must give what they gave, for any stretches.
_OLD_MIN_LEASE = ("{{ ([stop | float, wait | float, slice | float, verify | float] | max + (margin | float))"
                  " | round(0, 'ceil') | int }}")
_OLD_BUDGET = "([lease | float, min_lease | float] | max) - (margin | float)"
_OLD_RENEW = (
    "{{ (['wait'] if (stop | float) + (wait | float) > (B) else [])"
    " + (['launch'] if ((wait | float) + (0 if (stop | float) + (wait | float) > (B) else (stop | float))"
    " + (slice | float)) > (B) else [])"
    " + (['verify'] if (slice | float) + (verify | float) > (B) else []) }}").replace("B", _OLD_BUDGET)
_OLD_WAIT_WHEN_FREE = "{{ (stop | float) + ([start_wait | float, startup_check | float] | max) + (slice | float) > (B) }}".replace(
    "B", _OLD_BUDGET)
_ENV = jinja2.Environment()
_seconds = st.integers(min_value=0, max_value=4000) | st.floats(min_value=0, max_value=4000, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(stop=_seconds, wait=_seconds, slice_=_seconds, verify=_seconds, margin=_seconds, lease=_seconds,
       start_wait=_seconds, startup_check=_seconds)
def test_property_the_plan_is_what_restart_yml_s_jinja_gave(stop, wait, slice_, verify, margin, lease, start_wait,
                                                            startup_check):
    values = dict(stop=stop, wait=wait, slice=slice_, verify=verify, margin=margin, lease=lease,
                  start_wait=start_wait, startup_check=startup_check)
    min_lease = int(_ENV.from_string(_OLD_MIN_LEASE).render(**values))
    renew = _ENV.from_string(_OLD_RENEW).render(min_lease=min_lease, **values)
    when_free = _ENV.from_string(_OLD_WAIT_WHEN_FREE).render(min_lease=min_lease, **values)
    plan = phases.lock_plan(stop_s=stop, wait_s=wait, slice_s=slice_, verify_s=verify, margin_s=margin,
                            lease_s=lease, start_wait_s=start_wait, startup_check_s=startup_check)
    assert plan["min_lease_s"] == min_lease
    assert str(plan["renew_phases"]) == renew
    assert str(plan["wait_renews_when_memory_free"]) == when_free


def test_the_prefetch_is_a_phase_before_the_lock_that_changes_nothing():
    assert phases.phase_of_task(role="gpufleet.fleet.sglang_prefetch",
                                task_path="/x/roles/sglang_prefetch/tasks/main.yml:9") == "prefetch"
    assert phases.RESTART_PHASES.index("prefetch") < phases.RESTART_PHASES.index("lock")
    assert "prefetch" not in phases.OUTAGE_PHASES
    assert phases.unreachable_advice("prefetch", host="h1").startswith("nothing was changed on this host")
    assert phases.CUT_SHORT_IN["prefetch"].format(word="cancelled", host="h1").startswith(
        "cancelled in the weight prefetch, before the lock: nothing was changed on this host (untouched")
