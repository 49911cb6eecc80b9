"""gpufleet filter that hides API keys in what a task shows (module_utils/gpufleet_redact.py does the work).

- ``gpufleet_redact(value, known=None)`` -> the same shape: a log tail, journal lines or a result with every API key
  form (``--api-key K``, ``--api-key=K``, ``--admin-api-key``, SGLang's ``server_args`` ``api_key='K'``, JSON,
  ``Bearer K``) replaced by ``********``.
"""
from __future__ import annotations

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_redact import redact_data


def gpufleet_redact(value, known=None):
    """``value`` (str, list of lines, dict) with every secret replaced by ``********`` (gpufleet_redact.redact_data);
    ``known``: a secret (str) or a list of them to hide wherever they appear too (optional: the forms are found
    without it)."""
    if isinstance(known, str):
        known = [known]
    return redact_data(value, [k for k in (known or []) if isinstance(k, str)])


class FilterModule(object):
    """gpufleet redaction filter."""

    def filters(self):
        return {"gpufleet_redact": gpufleet_redact}
