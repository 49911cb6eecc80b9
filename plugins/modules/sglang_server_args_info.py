#!/usr/bin/python
# -*- coding: utf-8 -*-
# gpufleet: check SGLang launch flags against the installed release, without importing sglang.
from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
---
module: sglang_server_args_info
short_description: Check SGLang launch flags against the installed release's own argument definitions
description:
  - Finds the C(sglang) package of O(python) without importing it (importing pulls torch and CUDA), reads the
    release's launch options and checks O(launch_args) with the rules of Python's C(argparse), which
    C(sglang.launch_server) uses.
  - Static reading (O(mode=static)) parses C(sglang/srt/server_args.py) with Python's C(ast) in both styles
    found in real releases, C(parser.add_argument) calls in C(ServerArgs.add_cli_args) (0.4.x, 0.5.x before the
    dataclass style) and annotated dataclass fields such as C(tp_size = A[int, Arg]) read the way
    C(add_cli_args_from_dataclass) reads them (0.5.14 and later; from 0.5.20 the fields live in
    C(sglang/srt/arg_groups/fields/*.py)).
  - "Rules applied: exact option strings win; a prefix of exactly one long option is accepted as an
    abbreviation (C(allow_abbrev), so C(tp) means C(--tp-size)); a prefix of several is an error listing them
    (C(cuda-graph-max-bs) from 0.5.20); unknown flags are errors suggesting close spellings; C(int)/C(float)
    values and C(choices) are checked; switches (C(store_true)) must be given V(true); required options
    (C(--model-path)) must be present. From 0.5.12 C(--speculative-algorithm) is a free string in argparse,
    so its value is checked against the release's C(SpeculativeAlgorithm) names and the aliases it maps
    onto them (C(NEXTN)) plus O(extra_speculative_algorithms)."
  - Choices that a release computes from another module are read there too, for example
    C(--tool-call-parser) and C(--reasoning-parser) (the keys of C(FunctionCallParser.ToolCallParserEnum) and
    C(ReasoningParser.DetectorMap) up to 0.5.20, the lists in C(function_call/parser_names.py) and
    C(parser/reasoning_parser_names.py) in 0.5.23), quantization methods, attention, grammar and MoE
    backends and load formats (module-level lists in C(srt/server_args.py) or C(srt/arg_groups/choices.py)).
  - "A value outside the choices is refused in argparse's words, followed by the close spellings, for example
    C(argument --tool-call-parser: invalid choice: 'kimi_k25') with the list to choose from and
    C(did you mean 'kimi_k2'?)."
  - The flags given whose value could not be checked (the release converts it with its own function such as
    C(human_readable_int), or computes the choices at run time) are listed in RV(given_unchecked), each with
    the reason.
  - Invalid flags do not fail the module; they are returned in RV(errors) with RV(valid=false). The module
    fails only when sglang cannot be found or its files cannot be read.
  - Never changes anything.
version_added: "0.1.0"
author: gpufleet maintainers (!UNKNOWN)
options:
  python:
    description:
      - Interpreter whose C(sglang) is checked (inventory C(sglang_python)); the module runs it with C(-c) and a
        short script calling C(importlib.util.find_spec("sglang")).
      - One of O(python) and O(package_dir) is required; O(mode=help) needs O(python).
    type: path
  package_dir:
    description:
      - The C(sglang) package directory to read instead of asking O(python), for example an editable checkout
        C(/sgl-workspace/sglang/python/sglang).
    type: path
  launch_args:
    description:
      - SGLang flag names without leading dashes mapped to values (inventory C(sglang_launch_args)).
      - V(true) renders a bare flag (only for options that take no value); V(false) and V(null) leave the flag
        out; a list gives several values (C(nargs)) or repeats the flag (C(append) options); a mapping is
        rendered as compact JSON.
    type: dict
    default: {}
  host:
    description:
      - Bind address, rendered as C(--host) (inventory C(sglang_host)). Must then not be in O(launch_args).
    type: str
  port:
    description:
      - HTTP port, rendered as C(--port) (inventory C(sglang_port)). Must then not be in O(launch_args).
    type: int
  mode:
    description:
      - V(static) reads the source files.
      - V(help) runs C(<python> -m sglang.launch_server --help) (authoritative, but imports sglang, which needs the
        GPU software stack and can take a minute) and reads the option list; values are then checked only
        for arity and choices.
      - V(auto) reads the source and falls back to V(help) when no argument definitions are recognised or
        C(srt/server_args.py) cannot be read.
    type: str
    choices: [static, help, auto]
    default: auto
  help_timeout_s:
    description: Seconds allowed for the C(--help) run (O(mode=help) or the V(auto) fallback).
    type: int
    default: 300
  extra_speculative_algorithms:
    description:
      - Names registered by plugins with C(SpeculativeAlgorithm.register) that O(launch_args) may use as
        C(speculative-algorithm) in addition to the release's built-in ones.
    type: list
    elements: str
    default: []
  extra_choices:
    description:
      - Values to accept for a flag beyond the choices read from the release's source, keyed by the flag name
        without leading dashes, for example C(tool-call-parser) mapped to C([my_parser]).
      - For names a plugin adds at run time, with C(add_attention_backend_choices) or by registering a
        parser; the error for a value outside the choices says when the release has such a hook.
    type: dict
    default: {}
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: Reads files and, for O(mode=help), runs C(--help); changes nothing in either mode.
  diff_mode:
    support: none
    details: Nothing is changed, so there is no diff.
  platform:
    support: full
    platforms: posix
notes:
  - A release may extend choice lists at run time (plugins registering quantization methods, parsers); those
    choices are taken as written in the source, and a value outside them is refused with a note saying how
    the release could add it (O(extra_choices) accepts such names). RV(given_unchecked) lists the flags
    given whose values could not be checked statically.
  - "Errors returned (RV(errors)) use argparse's wording where argparse would fail, for example
    C(ambiguous option: --cuda-graph-max-bs could match --cuda-graph-max-bs-decode, --cuda-graph-max-bs-prefill)."
seealso:
  - name: SGLang server arguments
    description: The flags this module checks.
    link: https://docs.sglang.ai/advanced_features/server_arguments.html
  - name: argparse allow_abbrev
    description: Prefix matching of long options.
    link: https://docs.python.org/3/library/argparse.html#allow-abbrev
"""

EXAMPLES = r"""
- name: Check the launch flags against the installed SGLang
  gpufleet.fleet.sglang_server_args_info:
    python: /opt/sglang/.venv/bin/python
    launch_args:
      model-path: /models/Llama-3.1-70B-Instruct
      speculative-algorithm: EAGLE3
      speculative-draft-model-path: /models/EAGLE3-Llama-3.1-70B
      speculative-num-steps: 3
      speculative-eagle-topk: 1
      speculative-num-draft-tokens: 4
      tp: 8
      trust-remote-code: true
    host: 127.0.0.1
    port: 30000
  register: sglang_args

- name: Stop here when a flag is wrong
  ansible.builtin.assert:
    that: sglang_args.valid
    fail_msg: "{{ sglang_args.errors | map(attribute='message') | list }}"
"""

RETURN = r"""
sglang_version:
  description: Release of the sglang found, read from C(_version.py), C(version.py) or the dist-info METADATA.
  returned: always
  type: str
  sample: 0.5.23
sglang_path:
  description: The C(sglang) package directory read.
  returned: always
  type: str
  sample: /opt/sglang/.venv/lib/python3.12/site-packages/sglang
source_files:
  description: Files whose definitions were read (static mode), or the C(--help) command line (help mode).
  returned: always
  type: list
  elements: str
style:
  description: V(add_argument) or V(dataclass) (static mode), V(help) when the option list came from C(--help).
  returned: always
  type: str
  sample: dataclass
mode_used:
  description: V(static) or V(help).
  returned: always
  type: str
option_count:
  description: Number of options the release defines (argparse's C(--help) included).
  returned: always
  type: int
  sample: 532
valid:
  description: True when every flag is accepted by the release.
  returned: always
  type: bool
errors:
  description: One entry per problem; RV(valid) is false when this is not empty.
  returned: always
  type: list
  elements: dict
  contains:
    flag:
      description: The flag as given, with C(--).
      type: str
      sample: --cuda-graph-max-bs
    message:
      description: What is wrong and, where possible, the spelling the release accepts.
      type: str
      sample: "ambiguous option: --cuda-graph-max-bs could match --cuda-graph-max-bs-decode, --cuda-graph-max-bs-prefill"
flag_warnings:
  description: Flags the release accepts but marks as deprecated (same shape as RV(errors)).
  returned: always
  type: list
  elements: dict
resolved:
  description: Each flag given (without dashes) mapped to the release's canonical option string.
  returned: always
  type: dict
  sample: {"tp": "--tp-size", "model-path": "--model-path"}
values:
  description: Canonical option string mapped to the value given (V(true) for switches).
  returned: always
  type: dict
  sample: {"--model-path": "/models/m", "--tp-size": 8}
dest_values:
  description:
    - The values given keyed by the option's argparse destination (the C(ServerArgs) field, for example
      C(model_path) whether the flag was given as C(model-path), C(model) or an abbreviation).
  returned: always
  type: dict
  sample: {"model_path": "/models/m", "tp_size": 8}
argv:
  description:
    - The flags rendered as an argument list to follow the launcher prefix (C(sglang_launcher)), with
      canonical option strings and C(--host)/C(--port) last. Empty when RV(valid) is false.
  returned: always
  type: list
  elements: str
  sample: ["--model-path", "/models/m", "--tp-size", "8", "--trust-remote-code", "--host", "127.0.0.1", "--port", "30000"]
options_unchecked:
  description:
    - Canonical options given whose values could not be fully checked (converter functions such as
      C(human_readable_int), or choices computed at run time); the same flags as RV(given_unchecked).
  returned: always
  type: list
  elements: str
given_unchecked:
  description:
    - One entry per flag given (in O(launch_args)) whose value was accepted without a check, with the
      reason; empty when every value given was checked. Flags with errors are in RV(errors) instead.
  returned: always
  type: list
  elements: dict
  contains:
    flag:
      description: The flag as given, with C(--).
      type: str
      sample: --context-length
    option:
      description: The release's canonical option string for it.
      type: str
      sample: --context-length
    why:
      description: Why the value could not be checked.
      type: str
      sample: SGLang converts the value with human_readable_int, which preflight does not run
    message:
      description: The flag and the reason in one line, as preflight prints it.
      type: str
      sample: --context-length (SGLang converts the value with human_readable_int, which preflight does not run)
"""

import gc

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_redact import redact_module
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_server_args_info import (  # noqa: F401 pylint: disable=unused-import
    C_ENV,
    ArgsInfoError,
    find_package,
    read_help,
    resolve_server_args,
)


def main():
    module = AnsibleModule(
        argument_spec=dict(
            python=dict(type="path"),
            package_dir=dict(type="path"),
            launch_args=dict(type="dict", default={}),
            host=dict(type="str"),
            port=dict(type="int"),
            mode=dict(type="str", choices=["static", "help", "auto"], default="auto"),
            help_timeout_s=dict(type="int", default=300),
            extra_speculative_algorithms=dict(type="list", elements="str", default=[]),
            extra_choices=dict(type="dict", default={}),
        ),
        required_one_of=[["python", "package_dir"]],
        required_if=[["mode", "help", ["python"]]],
        supports_check_mode=True,
    )
    redact_module(module)  # no API key in any result, message or warning (issue 31)
    try:
        result = resolve_server_args(module, module.params)
    except ArgsInfoError as exc:
        module.fail_json(msg=exc.msg, **exc.kwargs)
    module.exit_json(**result)


if __name__ == "__main__":
    # Imports and constants to the permanent GC generation: the exit skips walking them (about 20 ms less per
    # call; docs/benchmarks.md, module exit)
    gc.freeze()
    main()
