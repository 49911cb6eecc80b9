"""SGLang's own serving benchmark, run on the host: the command line, its environment, and reading its result.

The client is ``sglang.benchmark.serving`` (SGLang 0.5.23; ``sglang.bench_serving`` is a deprecated alias there
that only re-exports it and warns), or ``sglang.bench_serving`` in releases without the ``benchmark`` package.
Facts from 0.5.23's ``sglang/benchmark/serving.py`` (docs/tune.md, "SGLang's benchmark client"):

- it reads the key from the environment, never argv: ``OPENAI_API_KEY`` is sent as ``Authorization: Bearer K``
  (what ``--api-key`` servers check); ``API_KEY`` would be sent bare, which SGLang refuses;
- ``--output-file`` gets one JSON line appended per run, keys ``output_throughput``, ``total_throughput``,
  ``request_throughput``, ``median_ttft_ms``, ``median_itl_ms``, ``median_e2e_latency_ms``, ``completed``,
  ``duration``, ``max_concurrency`` among others; with ``--output-details`` also ``errors`` (one per request);
- failed requests do not fail the run: ``completed`` counts the ones that succeeded (and it exits 0).
"""
from __future__ import annotations

import json
import re

from ansible_collections.gpufleet.fleet.plugins.module_utils.gpufleet_redact import redact_text

NEW_MODULE = "sglang.benchmark.serving"
OLD_MODULE = "sglang.bench_serving"

# Where a release keeps the client, read without importing sglang (its __init__ pulls in torch: seconds).
LOCATE_CODE = (
    "import importlib.util, json, os\n"
    "spec = importlib.util.find_spec('sglang')\n"
    "dirs = list(spec.submodule_search_locations or []) if spec else []\n"
    "print(json.dumps({'dirs': dirs, 'new': any(os.path.isfile(os.path.join(d, 'benchmark', 'serving.py'))"
    " for d in dirs)}))\n"
)

# result key of this module -> key in the client's JSON line
RESULT_KEYS = {
    "output_tok_s": "output_throughput",
    "total_tok_s": "total_throughput",
    "request_throughput": "request_throughput",
    "median_ttft_ms": "median_ttft_ms",
    "median_itl_ms": "median_itl_ms",
    "median_e2e_latency_ms": "median_e2e_latency_ms",
    "duration_s": "duration",
}

# Lines of the client's output that say why it could not run, most telling first.
_IMPORT_ERROR = re.compile(r"^(?:ModuleNotFoundError|ImportError): .*$", re.M)


def client_module(locate):
    """The module to run from the parsed LOCATE_CODE output (dict), or None when sglang is not installed."""
    if not locate.get("dirs"):
        return None
    return NEW_MODULE if locate.get("new") else OLD_MODULE


def build_argv(python, module, url, output_file, tokenizer=None, num_prompts=8, max_concurrency=1, input_len=128,
               output_len=128, seed=1, warmup_requests=1, dataset_path=None):
    """argv (list) of one run. Fixed lengths (``--random-range-ratio 1``) and a fixed seed make runs comparable;
    ``random-ids`` draws prompt tokens from the tokenizer's vocabulary, so no data set is downloaded (``random``
    fetches ShareGPT from the hub unless ``--dataset-path`` names a copy on the host). No secret: the key goes
    through the environment (:func:`client_env`)."""
    argv = [python, "-m", module, "--backend", "sglang", "--base-url", url.rstrip("/"),
            "--dataset-name", "random" if dataset_path else "random-ids",
            "--num-prompts", str(num_prompts), "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--random-range-ratio", "1", "--seed", str(seed),
            "--max-concurrency", str(max_concurrency), "--warmup-requests", str(warmup_requests),
            "--output-file", output_file, "--output-details", "--disable-tqdm"]
    if dataset_path:
        argv += ["--dataset-path", dataset_path]
    if tokenizer:
        argv += ["--tokenizer", tokenizer]
    return argv


def client_env(base_env, api_key=None, extra=None):
    """The client's environment: ``base_env`` plus ``extra`` (str values), ``OPENAI_API_KEY`` = the key when given
    (sent as a bearer), ``API_KEY`` dropped (it would be sent without ``Bearer``), C locale, unbuffered output."""
    env = dict(base_env)
    env.pop("API_KEY", None)
    env.pop("OPENAI_API_KEY", None)
    for key, value in (extra or {}).items():
        env[str(key)] = "" if value is None else str(value)
    if api_key:
        env["OPENAI_API_KEY"] = api_key
    env.update({"LC_ALL": "C", "PYTHONUNBUFFERED": "1"})
    return env


def read_result(path):
    """The last JSON line of the client's ``--output-file`` (dict), or None when there is none."""
    try:
        with open(path) as fh:
            lines = [line for line in fh.read().splitlines() if line.strip()]
    except OSError:
        return None
    if not lines:
        return None
    try:
        data = json.loads(lines[-1])
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _number(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return round(float(value), 3)


def summarize(line, num_prompts):
    """This module's figures from one result line (dict): RESULT_KEYS' values (float, None when absent),
    ``completed`` (int), ``max_concurrency``, ``num_prompts``."""
    out = {ours: _number(line.get(theirs)) for ours, theirs in RESULT_KEYS.items()}
    out["completed"] = int(line.get("completed") or 0)
    out["num_prompts"] = num_prompts
    out["max_concurrency"] = line.get("max_concurrency")
    return out


def first_errors(line, limit=3):
    """Distinct non-empty request errors of a ``--output-details`` line (list of str, at most ``limit``), each
    cut to its last line (the client keeps whole tracebacks)."""
    seen = []
    for err in line.get("errors") or []:
        text = str(err or "").strip()
        if not text:
            continue
        text = text.splitlines()[-1][:300]
        if text not in seen:
            seen.append(text)
        if len(seen) >= limit:
            break
    return seen


# An environment variable whose name says it holds a credential (HF_TOKEN, HUGGING_FACE_HUB_TOKEN,
# AWS_SECRET_ACCESS_KEY, OPENAI_API_KEY, a *_PASSWORD): its value is hidden wherever the module's output would show it.
_SECRET_ENV_NAME = re.compile(r"(?i)(TOKEN|KEY|SECRET|PASS|CREDENTIAL|AUTH)")


def secret_env_values(extra):
    """The non-empty values (str) of ``extra`` (the ``env`` option) under a name that says it holds a credential."""
    return [str(value) for name, value in (extra or {}).items()
            if _SECRET_ENV_NAME.search(str(name)) and value is not None and str(value)]


def shown_env(extra):
    """``extra`` (the ``env`` option) as the module's invocation shows it: the names, every value ``********``."""
    return dict((str(name), "********") for name in (extra or {}))


def tail(text, lines=25, known=()):
    """The last ``lines`` lines of the client's output, secrets redacted (the server's info it prints may hold
    ``api_key``; ``known`` are values to hide wherever they appear)."""
    kept = "\n".join((text or "").splitlines()[-lines:])
    return redact_text(kept, known=tuple(k for k in known if k))


def failure(rc, output, line, num_prompts, url, module, known=()):
    """A message (str) saying why a run did not measure, or None when it did: the client could not import a
    dependency, exited non-zero (the server refused, could not be reached, ...), wrote no result, or fewer than
    ``num_prompts`` requests completed."""
    missing = _IMPORT_ERROR.findall(output or "")
    if missing:
        return ("%s could not start on this host: %s. Install SGLang's dependencies in this interpreter (the client "
                "needs numpy, aiohttp, transformers and what sglang imports)." % (module, missing[-1].strip()))
    if rc != 0:
        return "%s against %s exited %s: %s" % (module, url, rc, _last_line(output, known))
    if line is None:
        return "%s against %s wrote no result line: %s" % (module, url, _last_line(output, known))
    completed = int(line.get("completed") or 0)
    if completed < num_prompts:
        errors = first_errors(line)
        why = "; ".join(redact_text(e, known=tuple(k for k in known if k)) for e in errors) or \
            _last_line(output, known)
        return "%s against %s: only %d of %d requests completed: %s" % (module, url, completed, num_prompts, why)
    return None


def _last_line(output, known=()):
    lines = [x for x in (output or "").splitlines() if x.strip()]
    return redact_text(lines[-1], known=tuple(k for k in known if k)) if lines else "no output"


def auth_headers(api_key=None):
    """The header SGLang's ``--api-key`` checks (srt/utils/auth.py), as the client sends it for OPENAI_API_KEY."""
    return {"Authorization": "Bearer " + api_key} if api_key else {}


def refusal(url, status, with_key):
    """Message for a server that answered the readiness probe with an HTTP error ``status``."""
    if status in (401, 403):
        if with_key:
            return ("the server at %s refused the benchmark (HTTP %d): api_key is not the server's --api-key"
                    % (url, status))
        return ("the server at %s refused the benchmark (HTTP %d): it was started with --api-key; pass the same "
                "key as api_key" % (url, status))
    return "the server at %s answered GET /v1/models with HTTP %d; it cannot be measured" % (url, status)


def model_info_url(url):
    """The server's model info route: ``/model_info`` (0.5.6 on), ``/get_model_info`` before."""
    base = url.rstrip("/")
    return [base + "/model_info", base + "/get_model_info"]


def tokenizer_from_model_info(info):
    """``tokenizer_path`` or ``model_path`` of a model info answer (dict), as the client itself picks it."""
    if not isinstance(info, dict):
        return None
    return info.get("tokenizer_path") or info.get("model_path") or None
