# -*- coding: utf-8 -*-
# gpufleet: the options of one server start (gpufleet_spawn module_utils START_OPTIONS), documented for
# gpufleet.fleet.sglang_process (top-level options: DOCUMENTATION) and gpufleet.fleet.sglang_stop (the suboptions of
# its start_after option: START_AFTER). ansible-test's yamllint reads a fragment's texts as literals, so the two
# are written out; tests/unit/test_sglang_start_options.py holds them to each other and to START_OPTIONS.
from __future__ import annotations


class ModuleDocFragment(object):

    # sglang_process: the start options are top-level options (required per state, see its argument_spec).
    DOCUMENTATION = r"""
options:

  argv:
    description:
      - Command and arguments of the server, one element each, never through a shell (C(sglang_launcher) and the
        rendered flags), without the API key. Required to start a server.
    type: list
    elements: str
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
      - Environment variables laid over the inherited environment (see O(inherit_env)), e.g. the NCCL set; a
        null value removes one, a boolean becomes C(1)/C(0).
    type: dict
    default: {}
  inherit_env:
    description:
      - Start from this module's environment (PATH, HOME, ...; without C(ANSIBLE_MODULE_*)); false starts from
        O(env) alone.
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
    type: path
  pid_file:
    description:
      - File that receives the server's pid once it started (written atomically through a temporary file and
        rename). Required to start a server.
      - A later O(gpufleet.fleet.sglang_process#module:state=ready) or O(gpufleet.fleet.sglang_process#module:state=verified) call can name the server by it.
    type: path
  exit_file:
    description:
      - File where the reaper writes the server's exit status as JSON (C(pid), C(returncode), C(started_at),
        C(ended_at); epoch seconds).
      - Default O(pid_file) with C(.exit) appended.
    type: path
  port:
    description:
      - The server's TCP port (SGLang C(--port)). Right before the start, nothing may listen on it at an address
        overlapping O(host).
    type: int
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

    # sglang_stop: the same options as the suboptions of start_after (argv, log_file, pid_file, port required).
    START_AFTER = r"""
options:
  start_after:
    suboptions:

      argv:
        description:
          - Command and arguments of the server, one element each, never through a shell (C(sglang_launcher) and the
            rendered flags), without the API key. Required to start a server.
        type: list
        elements: str
        required: true
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
          - Environment variables laid over the inherited environment (see O(start_after.inherit_env)), e.g. the NCCL set; a
            null value removes one, a boolean becomes C(1)/C(0).
        type: dict
        default: {}
      inherit_env:
        description:
          - Start from this module's environment (PATH, HOME, ...; without C(ANSIBLE_MODULE_*)); false starts from
            O(start_after.env) alone.
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
        type: path
        required: true
      pid_file:
        description:
          - File that receives the server's pid once it started (written atomically through a temporary file and
            rename). Required to start a server.
          - A later O(gpufleet.fleet.sglang_process#module:state=ready) or
            O(gpufleet.fleet.sglang_process#module:state=verified) call can name the server by it.
        type: path
        required: true
      exit_file:
        description:
          - File where the reaper writes the server's exit status as JSON (C(pid), C(returncode), C(started_at),
            C(ended_at); epoch seconds).
          - Default O(start_after.pid_file) with C(.exit) appended.
        type: path
      port:
        description:
          - The server's TCP port (SGLang C(--port)). Right before the start, nothing may listen on it at an address
            overlapping O(start_after.host).
        type: int
        required: true
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
