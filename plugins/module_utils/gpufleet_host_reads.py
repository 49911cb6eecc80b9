# -*- coding: utf-8 -*-
# gpufleet: the reads the one-call info modules share (sglang_fleet_check_info, sglang_preflight_info).
"""Parts of a host read, each returning its result or a failure shaped as the failed module's result, so one
part that fails does not stop the others:

* :func:`failed` -- a part's failure (``failed``, ``msg`` and the failing module's other keys);
* :func:`locate` -- the SGLang package of the interpreter ``python``, found once per call and handed to the
  launch-args and NCCL reads (in this process when the module runs on that interpreter);
* :func:`read_args` -- the inventory's launch args resolved against the installed SGLang
  (sglang_server_args_info's answer);
* :func:`read_gpu` -- nvidia_gpu_info's read of every GPU.
"""
from __future__ import absolute_import, division, print_function

__metaclass__ = type

from ansible.module_utils.basic import missing_required_lib
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_gpu import (
    PYNVML_IMPORT_ERROR,
    GpuError,
    MissingLibraryError,
    failure_kwargs,
)
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_gpu_info import read_gpu_info, xid_on_fail
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_server_args_info import (
    C_ENV,
    ArgsInfoError,
    resolve_server_args,
)
from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_sglang import (
    SGLangLocateError,
    locate_package,
)

PYTHON_NOT_SET = "sglang_python is not set"


def failed(msg, **kwargs):
    """A part's result when its read failed (shaped as the failed module's result)."""
    out = dict(kwargs)
    out.update(failed=True, msg=msg)
    return out


def runner(module, **environ):
    """``run(argv) -> (rc, stdout, stderr)`` through ``module.run_command`` with ``LC_ALL=C`` (and ``environ``)."""
    env = dict(LC_ALL="C")
    env.update(environ)
    return lambda argv: module.run_command(argv, environ_update=env, cwd="/")


def locate(module, python):
    """:func:`locate_package`'s answer for ``python`` (the module's own interpreter is asked in this process), or
    None when ``python`` is not set or SGLang cannot be found there: the reads that need it then find it
    themselves and report why they cannot, in their own words."""
    if not python:
        return None
    try:
        return locate_package(python, run=runner(module, **C_ENV), here=True)
    except SGLangLocateError:
        return None


def read_args(module, python, launch_args, host, port, mode="auto", help_timeout_s=300,
              extra_speculative_algorithms=(), extra_choices=None, package=None):
    """The launch args resolved against the SGLang of ``python`` (:func:`resolve_server_args`'s result, without
    ``changed``), or :func:`failed`. ``package``: :func:`locate`'s answer, when the caller has it."""
    if not python:
        return failed("one of the following is required: python, package_dir (%s)" % PYTHON_NOT_SET)
    options = dict(python=python, package_dir=package["package_dir"] if package else None,
                   launch_args=launch_args, host=host, port=port, mode=mode, help_timeout_s=help_timeout_s,
                   extra_speculative_algorithms=list(extra_speculative_algorithms or []),
                   extra_choices=dict(extra_choices or {}))
    try:
        out = resolve_server_args(module, options)
    except ArgsInfoError as exc:
        return failed(exc.msg, **exc.kwargs)
    out.pop("changed", None)
    return out


def read_gpu(module, backend, timeout_s, nvlink=True, xid_window_min=0, kmsg_path=None, expected_count=None):
    """nvidia_gpu_info's read of every GPU with its processes (``xid_window_min`` 0: no Xid report), or
    :func:`failed` (``error_class`` says why: missing_library, timeout, ...)."""
    try:
        return read_gpu_info(backend, module.get_bin_path("nvidia-smi"), (), True, nvlink, xid_window_min,
                             kmsg_path, None, timeout_s, expected_count)
    except MissingLibraryError as exc:
        return failed(missing_required_lib(exc.library), exception=str(exc.exc or PYNVML_IMPORT_ERROR),
                      error_class="missing_library")
    except GpuError as exc:
        kw = failure_kwargs(exc, xid_on_fail(xid_window_min, kmsg_path))
        kw.update(failed=True)
        return kw
