"""Decode speed of the lab stand-in: a documented table over what the server's workers received.

The figure follows the NCCL values found in a TP worker's environment (the stand-in reads
``/proc/<worker pid>/environ``) and the speculative flags on the stand-in's command line; nothing else counts.
Shaped on the seed's figures (issue 34; a Kimi-K2.5 EAGLE-3 server on 8 H200s): 94 tok/s with the seed's NCCL
set and 2-step speculation, 82-83 tok/s in the stable baseline (the seed's NCCL set, 3-step EAGLE-3: the lab
inventory's launch), 59-61 tok/s when the NCCL variables did not reach the workers.

The model is additive (docs/lab.md, "Decode speed", shows the same tables):

    tok/s per stream = NCCL_NONE_TOK_S + NCCL_PER_VALUE_TOK_S * (seed values found)  +  speculation delta

- NCCL part: 60.0, plus 3.75 for each of the six seed values (``SEED_NCCL``) found with that exact value in the
  worker's environment: 60.0 (none) ... 82.5 (all six). Any other NCCL_* name or value adds nothing.
- Speculation: the first row of ``SPEC_ROWS`` whose condition holds adds its delta.

Noise: one factor per server start, uniform in [1 - perf_noise, 1 + perf_noise] (fault knob, default 0.05),
drawn from ``random.Random("<perf_seed>:<start number>")``, the start number counted in a file of the host dir.
"""
import os
import random

try:
    import fcntl
except ImportError:  # pragma: no cover (Linux only, like the lab)
    fcntl = None

# The seed's NCCL set (issue 34; the lab inventory's sglang_nccl_env).
SEED_NCCL = {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring", "NCCL_P2P_LEVEL": "SYS", "NCCL_MAX_NCHANNELS": "16",
             "NCCL_BUFFSIZE": "16777216", "NCCL_NTHREADS": "512"}
NCCL_NONE_TOK_S = 60.0       # no seed value in the workers: the seed's 59-61 tok/s
NCCL_PER_VALUE_TOK_S = 3.75  # each seed value found adds this; all six: 82.5, the seed's stable baseline

EAGLE_FAMILY = ("EAGLE", "EAGLE3", "NEXTN")  # NEXTN runs as EAGLE in SGLang's server_args
DEFAULT_STEPS = 3  # speculative-num-steps not given: the FIELD-NOTES EAGLE-3 example's 3 (and topk 1)
DEFAULT_TOPK = 1

# Speculation rows, first match wins: (name, condition text as in docs/lab.md, delta tok/s, predicate).
# The predicate takes (algorithm upper-cased or None, steps, topk).
SPEC_ROWS = (
    ("no-speculation", "no speculative-algorithm", -22.5, lambda a, s, k: a is None),
    ("other-algorithm", "speculative-algorithm not EAGLE, EAGLE3 or NEXTN", -10.0,
     lambda a, s, k: a not in EAGLE_FAMILY),
    ("eagle-tree", "speculative-eagle-topk > 1 (any steps)", -3.0, lambda a, s, k: k > 1),
    ("eagle-1-step", "speculative-num-steps 1", +5.5, lambda a, s, k: s <= 1),
    ("eagle-2-steps", "speculative-num-steps 2", +11.5, lambda a, s, k: s == 2),
    ("eagle-3-steps", "speculative-num-steps 3 (also when not given)", 0.0, lambda a, s, k: s == 3),
    ("eagle-4-steps", "speculative-num-steps 4", -6.0, lambda a, s, k: s == 4),
    ("eagle-5+-steps", "speculative-num-steps 5 or more", -12.0, lambda a, s, k: True),
)
SPEC_FLAGS = ("speculative-algorithm", "speculative-num-steps", "speculative-eagle-topk",
              "speculative-num-draft-tokens")

# Named rows a reader can look up directly (each equals decode_tok_s of its env and flags; the unit tests check).
TABLE = {
    "seed-nccl/eagle-2-steps": 94.0,    # the seed's fastest launch
    "seed-nccl/eagle-1-step": 88.0,     # the close second: 6.4 % below 94
    "seed-nccl/eagle-3-steps": 82.5,    # the stable baseline (the lab inventory's launch)
    "seed-nccl/eagle-4-steps": 76.5,
    "seed-nccl/eagle-tree": 79.5,
    "seed-nccl/no-speculation": 60.0,
    "no-nccl/eagle-2-steps": 71.5,
    "no-nccl/eagle-3-steps": 60.0,      # values did not reach the workers: the seed's 59-61
}

DEFAULT_NOISE = 0.05
DEFAULT_SEED = 0
MIN_TOK_S = 1.0
# Several requests in flight share the decode step: each stream runs at tok_s / (1 + CONCURRENCY_COST * (n - 1)),
# n = requests in flight, so 8 streams give 8 / 1.7 = 4.7 times one stream's throughput (sub-linear).
CONCURRENCY_COST = 0.1
STARTS_FILE = "perf_starts"


def _flag(flags, name):
    """Value of a dash-less flag in ``flags`` (argparse dests with underscores are accepted too)."""
    for key, value in (flags or {}).items():
        if str(key).lstrip("-").replace("_", "-") == name:
            return value
    return None


def _int(value, default):
    if value is None or value is False:
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def nccl_part(env):
    """(seed values found, tok/s) from a worker's environment; only the six SEED_NCCL names count."""
    env = env or {}
    found = sum(1 for k, v in SEED_NCCL.items() if k in env and str(env[k]) == v)
    return found, NCCL_NONE_TOK_S + NCCL_PER_VALUE_TOK_S * found


def spec_row(flags):
    """(row name, delta tok/s) of the speculative flags (first match in SPEC_ROWS)."""
    algo = _flag(flags, "speculative-algorithm")
    algo = str(algo).upper() if algo not in (None, False, "", "None") else None
    steps = _int(_flag(flags, "speculative-num-steps"), DEFAULT_STEPS)
    topk = _int(_flag(flags, "speculative-eagle-topk"), DEFAULT_TOPK)
    for name, _text, delta, pred in SPEC_ROWS:
        if pred(algo, steps, topk):
            return name, delta
    raise AssertionError("SPEC_ROWS ends with a row that always matches")


def decode_tok_s(env, flags):
    """(row name, decode tok/s per stream) for a worker environment and the server's flags.

    Row name: ``seed-nccl`` (all six seed values), ``no-nccl`` (none) or ``nccl-<found>of6``, then ``/`` and the
    speculation row, e.g. ``seed-nccl/eagle-2-steps`` -> 94.0.
    """
    found, base = nccl_part(env)
    nccl_name = {len(SEED_NCCL): "seed-nccl", 0: "no-nccl"}.get(found, "nccl-%dof%d" % (found, len(SEED_NCCL)))
    spec_name, delta = spec_row(flags)
    return "%s/%s" % (nccl_name, spec_name), round(max(MIN_TOK_S, base + delta), 2)


def noise_factor(seed, start, noise):
    """The factor of one server start: uniform in [1 - noise, 1 + noise], the same for the same seed and start."""
    noise = abs(float(noise))
    u = random.Random("gpufleet-perf:%s:%s" % (seed, start)).random()
    return 1.0 + noise * (2.0 * u - 1.0)


def next_start(state_dir):
    """Count this server start in ``<state_dir>/perf_starts`` (locked) and return its number, 1 for the first."""
    os.makedirs(state_dir, exist_ok=True)
    path = os.path.join(state_dir, STARTS_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if fcntl:
            fcntl.flock(fd, fcntl.LOCK_EX)
        raw = os.read(fd, 64).decode("ascii", "replace").strip()
        start = (int(raw) if raw.isdigit() else 0) + 1
        os.lseek(fd, 0, os.SEEK_SET)
        os.ftruncate(fd, 0)
        os.write(fd, b"%d\n" % start)
        return start
    finally:
        os.close(fd)


def per_stream_tok_s(tok_s, in_flight):
    """Speed of each stream with ``in_flight`` requests decoding (>= 1)."""
    return tok_s / (1.0 + CONCURRENCY_COST * (max(1, int(in_flight)) - 1))


def start_speed(env, flags, knobs, state_dirs):
    """Everything the stand-in logs and uses at a start: row, base, noise factor, effective tok/s, seed, start.

    ``state_dirs``: where the start counter may live, first writable wins (a systemd lab's service user cannot
    write the host dir); start 0 when none is.
    """
    row, base = decode_tok_s(env, flags)
    knobs = knobs or {}
    noise = knobs.get("perf_noise", DEFAULT_NOISE)
    seed = knobs.get("perf_seed", DEFAULT_SEED)
    start = 0
    for state_dir in [d for d in state_dirs if d]:
        try:
            start = next_start(state_dir)
            break
        except OSError:
            continue
    factor = noise_factor(seed, start, noise)
    return {"row": row, "base": base, "factor": factor, "effective": base * factor, "seed": seed,
            "start": start, "noise": float(noise)}


def parse_environ(raw):
    """{name: value} of a /proc/<pid>/environ read (bytes), None when it holds no NAME=VALUE entry (setproctitle
    overwrote the area: the worker was started without SPT_NOENV)."""
    env = {}
    for item in raw.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep and name and not name.startswith(b" "):
            env[name.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return env or None


def read_environ(pid):
    """parse_environ of /proc/<pid>/environ; None when unreadable."""
    try:
        with open("/proc/%d/environ" % int(pid), "rb") as fh:
            return parse_environ(fh.read())
    except (OSError, TypeError, ValueError):
        return None
