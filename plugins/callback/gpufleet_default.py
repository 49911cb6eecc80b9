# gpufleet: Ansible's default stdout callback, quiet at verbosity 0 (a 4-host restart reads in about one screen).
from __future__ import annotations

DOCUMENTATION = r"""
name: gpufleet_default
type: stdout
short_description: Ansible's default output, without ok/skipped noise at verbosity 0
description:
  - "For playbooks, the C(default) stdout callback with one change at verbosity 0: results that are C(ok) or C(skipped),
    C(include_tasks)/C(include_role) results, C(included:) lines and loop items that changed nothing are not
    printed. A task's banner is printed only before its first shown result, a play's only before its first
    shown task, so a restart of 4 hosts reads in
    about one screen (what changed, what failed, the messages the playbooks write for people, the recap and
    gpufleet's summary table)."
  - "Messages of C(debug) tasks (C(msg)) stay, as one line per host: C(  <host>: <message>) under the task
    banner (a list message is joined with C(; ), whitespace folded, cut after 240 characters). A looped
    C(debug) prints nothing at verbosity 0 (its items changed nothing)."
  - "Warnings and deprecation notices of hidden results are still printed."
  - "A play that matched no host prints nothing (C(skipping: no hosts matched) from C(-v) on)."
  - "A retry of a gpufleet wait slice (a result with C(progress)) prints only the task banner; the progress line
    comes from the gpufleet_summary callback, instead of C(FAILED - RETRYING ... (N retries left))."
  - "A failed C(fail) or C(assert) task (a message the playbooks write for people) prints as
    C(fatal: [<host>]: <message>), the message as text (a list one item per line, indented), without the JSON dump and
    without ansible-core's C([ERROR]) block that repeats the same message with the task's file and line."
  - "With C(-v) or more a playbook prints exactly what C(default) prints. The options are those of C(default);
    C(display_ok_hosts) and C(display_skipped_hosts) apply from C(-v) on."
  - "Ad hoc (C(ansible HOSTS -m MODULE), C(ansible-console); ansible.cfg C(bin_ansible_callbacks = True) lets
    them use this callback): prints what C(minimal), Ansible's ad-hoc output, prints (C(<host> | SUCCESS => {...}),
    no banners, no recap), with one change at verbosity 0: a string of 60 characters or more (a top-level value of
    the result, or one in a dict in it) that an earlier host printed under the same key is printed as
    C((same as <that host>)). An C(nvidia_gpu_info) over a fleet says its C(backend_fallback_reason) and
    C(xid_reason) once. The raw output of C(command), C(shell) and C(raw) is printed whole. With C(-v) or more
    every value is printed whole."
  - "Nothing is lost for AWX or ansible-runner: job events carry every result whatever the stdout callback
    shows, and under ansible-runner the stdout base is the callback named by C(ORIGINAL_STDOUT_CALLBACK)
    (C(default) unless set)."
extends_documentation_fragment:
  - default_callback
  - result_format_callback
requirements:
  - set as stdout in configuration (ansible.cfg C(stdout_callback = gpufleet.fleet.gpufleet_default))
"""

from ansible import constants as C
from ansible.plugins.callback.default import CallbackModule as DefaultCallbackModule
from ansible.plugins.callback.minimal import CallbackModule as MinimalCallbackModule
from ansible.playbook.task_include import TaskInclude

# The controller-side decision, imported by its collection path (the checkout's collections_path or the installed
# collection).
from ansible_collections.gpufleet.fleet.plugins.plugin_utils.adhoc import shorten_repeats


# Longest debug message printed at verbosity 0 (characters); -v prints it whole.
MAX_MESSAGE_CHARS = 240
# Actions whose failure message is written for people: printed as text at verbosity 0.
MESSAGE_ACTIONS = frozenset("%s%s" % (prefix, name) for prefix in ("", "ansible.builtin.", "ansible.legacy.")
                            for name in ("fail", "assert"))


def _message_text(msg):
    """One line for a debug task's ``msg`` (str, list of str, or anything else as its str()), cut at
    MAX_MESSAGE_CHARS characters with a pointer to -v."""
    if isinstance(msg, (list, tuple)):
        text = "; ".join(str(m) for m in msg)
    else:
        text = str(msg)
    text = " ".join(text.split())
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[:MAX_MESSAGE_CHARS] + " ... (-v for all)"
    return text


# The name ansible (ad hoc) gives the playbook it wraps its one task in.
ADHOC_PLAYBOOK = "__adhoc_playbook__"
# The events minimal prints; in an ad-hoc run every other event of default prints nothing (see _ad_hoc_like_minimal).
MINIMAL_EVENTS = frozenset(("v2_runner_on_ok", "v2_runner_on_failed", "v2_runner_on_skipped",
                            "v2_runner_on_unreachable", "v2_on_file_diff", "v2_playbook_on_start"))


def _ad_hoc_like_minimal(cls):
    """Each event that default prints and minimal does not (play and task banners, the recap, async polls, "NO MORE
    HOSTS LEFT", ...) prints nothing in an ad-hoc run: ad hoc reads as minimal reads."""
    for name in dir(DefaultCallbackModule):
        method = getattr(cls, name)
        if not name.startswith("v2_") or name in MINIMAL_EVENTS or method is getattr(MinimalCallbackModule, name):
            continue

        def event(self, *args, _method=method, **kwargs):
            if self._adhoc:
                return None
            return _method(self, *args, **kwargs)

        event.__name__ = event.__qualname__ = name
        event.__doc__ = method.__doc__
        setattr(cls, name, event)
    return cls


@_ad_hoc_like_minimal
class CallbackModule(DefaultCallbackModule, MinimalCallbackModule):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "stdout"
    CALLBACK_NAME = "gpufleet_default"

    # True for ansible (ad hoc) and ansible-console, which run one task outside any playbook: ansible-console
    # sends no v2_playbook_on_start, ad hoc sends it with ADHOC_PLAYBOOK; ansible-playbook with its playbook.
    _adhoc = True
    # Ad hoc: the long strings printed whole so far (plugin_utils.adhoc.shorten_repeats).
    _shown = {}

    def _quiet(self):
        """True at verbosity 0: ok/skipped results are summarised away."""
        return self._display.verbosity < 1

    def v2_playbook_on_start(self, playbook):
        self._adhoc = getattr(playbook, "_file_name", None) == ADHOC_PLAYBOOK
        if not self._adhoc:
            super().v2_playbook_on_start(playbook)

    def _say_once(self, result):
        """Ad hoc at verbosity 0: ``result`` with the long strings an earlier host printed as pointers to it."""
        if self._quiet() and result.task.action not in C.MODULE_NO_JSON:
            printed, self._shown = shorten_repeats(result.result, result.host.get_name(), self._shown)
            if printed is not result.result:
                # this callback's own copy of the result (ansible-core hands each callback one)
                result.result.clear()
                result.result.update(printed)

    def set_options(self, *args, **kwargs):
        super().set_options(*args, **kwargs)
        if self._quiet():
            # lazy task banners (default prints one only before a shown result) and no ok/skipped lines
            self.set_option("display_ok_hosts", False)
            self.set_option("display_skipped_hosts", False)

    def v2_playbook_on_play_start(self, play):
        if not self._quiet():
            return super().v2_playbook_on_play_start(play)
        # the play's banner waits for its first shown task (a play that only checked prints nothing)
        self._play = play
        self._pending_play = play
        return None

    def v2_playbook_on_no_hosts_matched(self):
        # A play whose hosts are computed (check.yml's become and textfile plays, on the hosts that still need
        # them) has none on most runs: "skipping: no hosts matched" is noise at verbosity 0. A --limit that
        # matches nothing is still said by Ansible's own warning ("Could not match supplied host pattern").
        if not self._quiet():
            super().v2_playbook_on_no_hosts_matched()

    def _print_task_banner(self, task):
        pending = getattr(self, "_pending_play", None)
        if pending is not None:
            self._pending_play = None
            super().v2_playbook_on_play_start(pending)
        super()._print_task_banner(task)

    def _print_debug_message(self, result):
        """True when ``result`` is a debug task's ok result whose message was printed in one line."""
        action = result.task.action
        if action not in ("debug", "ansible.builtin.debug", "ansible.legacy.debug") or "msg" not in result.result:
            return False
        if result.task.loop and "results" in result.result:  # the items were hidden; "All items completed"
            return False
        if self._last_task_banner != result.task._uuid:
            self._print_task_banner(result.task)
        self._handle_warnings_and_exception(result)
        self._display.display("  %s: %s" % (self.host_label(result), _message_text(result.result["msg"])))
        return True

    def v2_runner_on_ok(self, result):
        if self._adhoc:
            self._say_once(result)
            return MinimalCallbackModule.v2_runner_on_ok(self, result)
        if self._quiet() and (isinstance(result.task, TaskInclude) or not result.result.get("changed", False)):
            if isinstance(result.task, TaskInclude) or not self._print_debug_message(result):
                self._handle_warnings_and_exception(result)
            return
        super().v2_runner_on_ok(result)

    def v2_runner_on_failed(self, result, ignore_errors=False):
        if self._adhoc:
            self._say_once(result)
            return MinimalCallbackModule.v2_runner_on_failed(self, result, ignore_errors)
        if not self._quiet() or result.task.action not in MESSAGE_ACTIONS or "msg" not in result.result \
                or (result.task.loop and "results" in result.result):
            return super().v2_runner_on_failed(result, ignore_errors)
        if self._last_task_banner != result.task._uuid:
            self._print_task_banner(result.task)
        # ansible-core 2.19+ would print the same message again as an [ERROR] block with the task's origin.
        result.result.pop("exception", None)
        self._handle_warnings_and_exception(result)
        msg = result.result["msg"]
        text = "\n    ".join(str(m) for m in msg) if isinstance(msg, (list, tuple)) else str(msg)
        self._display.display("fatal: [%s]: %s" % (self.host_label(result), text), color=C.COLOR_ERROR,
                              stderr=self.get_option("display_failed_stderr"))
        if ignore_errors:
            self._display.display("...ignoring", color=C.COLOR_SKIP)
        return None

    def v2_runner_retry(self, result):
        # A gpufleet wait slice (its result carries "progress"): the summary callback prints that progress line;
        # "FAILED - RETRYING ... (N retries left)" would call a wait that goes on a failure, with a count that is
        # only an upper bound (the module itself ends at its timeout).
        if self._quiet() and result.result.get("progress"):
            if self._last_task_banner != result.task._uuid:
                self._print_task_banner(result.task)
            return None
        return super().v2_runner_retry(result)

    def v2_runner_on_skipped(self, result):
        if self._adhoc:
            return MinimalCallbackModule.v2_runner_on_skipped(self, result)
        if self._quiet():
            self._handle_warnings_and_exception(result)
            return
        super().v2_runner_on_skipped(result)

    def v2_runner_item_on_skipped(self, result):
        if self._quiet():
            return
        super().v2_runner_item_on_skipped(result)

    def v2_playbook_on_include(self, included_file):
        if self._quiet():
            return
        super().v2_playbook_on_include(included_file)

    def v2_runner_on_unreachable(self, result):
        if self._adhoc:
            self._say_once(result)
            return MinimalCallbackModule.v2_runner_on_unreachable(self, result)
        return super().v2_runner_on_unreachable(result)

    def v2_on_file_diff(self, result):
        if self._adhoc:
            return MinimalCallbackModule.v2_on_file_diff(self, result)
        return super().v2_on_file_diff(result)
