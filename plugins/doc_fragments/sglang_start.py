# -*- coding: utf-8 -*-
# gpufleet: the options of one server start (gpufleet_spawn module_utils START_OPTIONS), documented once for
# gpufleet.fleet.sglang_process (top-level options: DOCUMENTATION) and gpufleet.fleet.sglang_stop (the suboptions of
# its start_after option: START_AFTER). Both texts are made from _OPTIONS below; the tests compare them.
from __future__ import annotations

import re

_PROCESS = "gpufleet.fleet.sglang_process#module:"

# {o} is O( for sglang_process and O(start_after. for sglang_stop; {req} the start_after variant's "required: true".
_OPTIONS = r"""
argv:
  description:
    - Command and arguments of the server, one element each, never through a shell (C(sglang_launcher) and the
      rendered flags), without the API key. Required to start a server.
  type: list
  elements: str{req}
api_key:
  description:
    - SGLang's C(--api-key), appended to the started command line as C(--api-key KEY) only when the process is
      started. A no_log option, so Ansible masks the value in this task's arguments and result (the returned argv
      never holds it; a log tail or progress line quoting it shows C(********)).
    - It still is in the server's command line, which C(ps) shows to every user of the host (SGLang 0.5.23 reads
      the key only from its arguments).
  type: str
env:
  description:
    - Environment variables laid over the inherited environment (see {o}inherit_env)), e.g. the NCCL set; a
      null value removes one, a boolean becomes C(1)/C(0).
  type: dict
  default: {{}}
inherit_env:
  description:
    - Start from this module's environment (PATH, HOME, ...; without C(ANSIBLE_MODULE_*)); false starts from
      {o}env) alone.
  type: bool
  default: true
chdir:
  description: Working directory of the server.
  type: path
log_file:
  description:
    - File that receives the server's stdout and stderr (appended). Required to start a server.
    - "Created with mode 0640; an existing one loses its group-write and other bits (SGLang logs its API key
      there)."
  type: path{req}
pid_file:
  description:
    - File that receives the server's pid once it started (written atomically through a temporary file and
      rename). Required to start a server.
    - A later O({process}state=ready) or O({process}state=verified) call can name the server by it.
  type: path{req}
exit_file:
  description:
    - File where the reaper writes the server's exit status as JSON (C(pid), C(returncode), C(started_at),
      C(ended_at); epoch seconds).
    - Default {o}pid_file) with C(.exit) appended.
  type: path
port:
  description:
    - The server's TCP port (SGLang C(--port)). Right before the start, nothing may listen on it at an address
      overlapping {o}host).
  type: int{req}
host:
  description:
    - Address the server binds (SGLang C(--host)).
    - "A listener on the same port at an overlapping address holds the port: the same address; V(0.0.0.0) for
      every IPv4 address; V(::) for every address, IPv4 too (taken as dual-stack: a listener's IPV6_V6ONLY cannot
      be read); an IPv4-mapped V(::ffff:a.b.c.d) as its IPv4 address. V(::1) and V(127.0.0.1) are different
      addresses; a host name stands for the addresses it resolves to."
  type: str
  default: 127.0.0.1
"""


def _indent(text, spaces):
    return re.sub(r"(?m)^(?=.)", " " * spaces, text)


def _options(option_prefix, required):
    return _OPTIONS.format(o="O(" + option_prefix, req="\n  required: true" if required else "",
                           process=_PROCESS)


class ModuleDocFragment(object):

    # sglang_process: the start options are top-level options (required per state, see its argument_spec).
    DOCUMENTATION = "options:\n" + _indent(_options("", False), 2)

    # sglang_stop: the same options as the suboptions of start_after (argv, log_file, pid_file, port required).
    START_AFTER = "options:\n  start_after:\n    suboptions:\n" + _indent(_options("start_after.", True), 6)
