"""Stand-in for ``python -m sglang.launch_server`` on a lab host (stdlib + setproctitle; never imports sglang).

Launched as ``<host venv python> sglang_standin.py <sglang.launch_server flags>`` (the lab inventory's
``sglang_launcher``). What it reproduces, in order (facts: ../../../shared/FIELD-NOTES.md):

1. Flags: parsed with argparse using the option names, ``type=int/float``, ``store_true`` and literal
   ``choices`` found (with ``ast``) in the installed release's ``srt/server_args.py``, so unknown flags, bad
   ints and abbreviations behave like that release (``--tp`` works only as an abbreviation of
   ``--tp-size``). argparse errors exit 2, like SGLang.
2. Title: ``<python> -m sglang.launch_server <args>`` (setproctitle), which SGLang's own clean-up pattern
   ``sglang\\.launch_server`` matches.
3. Locates the installed sglang with ``importlib.util.find_spec`` (no import) and executes the release's real
   ``_set_envs_and_config`` against ``os.environ`` (tests/support/set_envs_exec.py): a patched engine.py changes
   what the workers inherit; an unpatched one does not. With ``SGLANG_PRESPAWN_WORKERS=1`` in its environment it
   runs the copy in ``srt/entrypoints/worker_launch.py`` instead, where the package has one (SGLang's
   development branch after 0.5.23; ``prespawn.maybe_prespawn()``).
4. Spawns ``--tp-size`` workers with the multiprocessing ``spawn`` context, titled ``sglang::scheduler_TP{n}``,
   each with PDEATHSIG=SIGKILL, /dev/nvidia{n} open and ``worker_mib`` MiB registered with gpusimd on GPU n;
   plus ``sglang::detokenizer``.
5. Loads the weights, when the model dirs hold any (``lab.py weights`` writes them; the default lab's hold only
   ``config.json`` and skip this): every ``*.safetensors`` of ``--model-path`` and a local
   ``--speculative-draft-model-path``, as SGLang's loader does (``load_weights``: ``safe_open`` over each shard
   where ``safetensors`` and torch import, then every page read through a read-only mmap that the server keeps
   for its life, like tensors backed by the file). Logs ``loaded N GiB of weights from K files in X s (resident
   before: Y %)``; ``/get_server_info`` adds ``weights_load_s``, ``weights_bytes``, ``weights_files``,
   ``weights_reader``, ``weights_resident_before_pct``. A file that is not safetensors fails the start (exit 1).
   Then "loads" for ``slow_load_s`` more (default 1 s); connection refused all along. Then binds HTTP on
   --host/--port (a held port fails the start only now, as in SGLang), warms up (0.3 s) and serves
   ``/health`` and ``/health_generate`` (503 until warm and while shutting down), ``/get_model_info``,
   ``/get_server_info`` (``version`` = installed release), ``/model_info``, ``/server_info``, ``/v1/models``,
   ``POST /generate`` at this start's decode speed (7.), ``POST /flush_cache``.
6. SIGTERM: /health → 503, drains in-flight requests (new ones are still served: the drain never ends under
   constant traffic), SIGKILLs its workers, then SIGKILLs itself (exit 137) up to 0.5.18, exits 0 after.
   A worker that dies unexpectedly makes it kill its tree (SGLang's SIGQUIT path).
7. Decode speed (perf.py, docs/lab.md "Decode speed"): once its workers run, it reads a TP worker's
   environment from ``/proc/<pid>/environ`` (readable with SPT_NOENV=1, as gpufleet launches; otherwise the
   server's own environment, which the workers inherited, and the log says so), looks up the NCCL values and
   its speculative flags in perf's table, applies this start's noise factor and logs row, base, factor and
   effective tok/s. ``/generate`` then decodes at that speed per stream, one token at a time (streaming: one
   SSE event per token; several when it fell behind), each stream slower with more requests in flight
   (perf.per_stream_tok_s). The ``tokens_per_s`` knob, when set, replaces all of this (fixed speed, read per
   request, eight stream chunks).

Fault knobs (HOST_DIR/faults.json, set with ``lab.py fault``): slow_load_s, crash_on_start, crash_with_arg,
worker_ignores_sigterm, orphan_worker (that TP rank double-forks away to the host's PID 1, new session),
zombie_worker (that TP rank detaches like an orphan, then its main thread exits while a thread holding the
worker's GPU memory and fds lives on: ``<defunct>``, state Z, memory held until the last thread dies),
tokens_per_s (read per request; overrides the decode speed model), perf_noise and perf_seed (the start's
noise factor: uniform in +-perf_noise, default 0.05, seeded by perf_seed and the start number), worker_mib,
hang_after_requests (after N answered generations, a generation is accepted and never answered; int N, or {"n": N, "with_arg": TEXT} for a start whose argv holds TEXT
only; read once at the start, so a relaunch after the knob was cleared serves normally).

Real-GPU mode (opt-in, for tests/gpu/real_restart.sh on a machine with NVIDIA GPUs and torch): with
``GPUFLEET_STANDIN_CUDA_MIB=N`` in the server's environment each TP worker allocates N MiB with torch on
CUDA device ``rank % 8`` and holds it until it dies, instead of registering with the lab's gpusimd. Unset (the
lab), nothing changes. The decode speed follows the same table there; without a lab host dir its start counter
lives in ``$GPUFLEET_STANDIN_PERF_DIR`` (default ``<tmp>/gpufleet-standin-perf-<uid>``) and the knobs are the
defaults.

Weights on a device (opt-in, for tests/gpu/prefetch_h200.sh): with ``GPUFLEET_STANDIN_WEIGHTS_DEVICE`` = ``cpu``,
``cuda`` or ``cuda:N`` in the server's environment, step 5 reads every tensor of every shard with ``safe_open(...,
framework="pt", device="cpu")`` / ``get_tensor`` and copies it onto that device, as SGLang 0.5.23 does
(``safetensors_weights_iterator``, then the model's ``weight_loader``), and keeps the copies, which hold the
device's memory as a loader's parameters do; the shards are not kept mapped. Like SGLang, which copies the weights
into its parameters and closes its files, the serving process then pins no page of the shards, so
``posix_fadvise(DONTNEED)`` can evict them while it serves. The CUDA context is made before the clock starts.
``/get_server_info`` adds ``weights_device``, ``weights_device_init_s`` and ``weights_file_maps`` (this process's
mappings of the shards after the load: 0), ``weights_reader`` reads ``safetensors->DEVICE``. It needs safetensors
and torch in the server's interpreter; without them, or with another value, the start fails (exit 1) saying so.
Unset, nothing changes (the lab's tests rely on the mapped shards).
"""
import json
import mmap
import os
import re
import secrets
import signal
import socket
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import gpusim  # noqa: E402
import perf  # noqa: E402
import weights  # noqa: E402

DEFAULT_WORKER_MIB = 120000
PERF_DIR_ENV = "GPUFLEET_STANDIN_PERF_DIR"  # where the start counter lives without a lab host dir (real-GPU mode)
DEFAULT_LOAD_S = 1.0
WARMUP_S = 0.3
DRAIN_POLL_S = 0.2
SHM_NEEDED_MIB = 64  # below this much free /dev/shm the stand-in dies like SGLang on a full /dev/shm
CUDA_MIB_ENV = "GPUFLEET_STANDIN_CUDA_MIB"  # real-GPU mode: MiB of real GPU memory each TP worker holds
WEIGHTS_DEVICE_ENV = "GPUFLEET_STANDIN_WEIGHTS_DEVICE"  # opt-in: weights loaded onto this torch device, no shard kept mapped


def log(msg):
    """One log line, SGLang's ``[YYYY-MM-DD HH:MM:SS]`` prefix with milliseconds added (local time)."""
    now = time.time()
    sys.stderr.write("[%s.%03d] %s\n" % (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)),
                                         int(now % 1 * 1000), msg))
    sys.stderr.flush()


def exec_epoch():
    """Unix time (s) this process was exec'd: /proc/self/stat starttime (clock ticks since boot) placed on the
    wall clock through /proc/uptime (10 ms resolution; /proc/stat's btime is whole seconds). None off Linux."""
    try:
        with open("/proc/self/stat") as fh:
            starttime_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime_s = float(fh.read().split()[0])
        now = time.time()
    except (OSError, ValueError, IndexError):
        return None
    return now - (uptime_s - starttime_ticks / os.sysconf("SC_CLK_TCK"))


def log_exec_time():
    """First log line: the exec time and the wall clock now, both Unix s, so a reader converts this log's
    local-time prefixes to Unix time without knowing the host's zone (tests/bench/bench.py parses it)."""
    started = exec_epoch()
    log("lab stand-in: process exec at unix %s; now unix %.3f" % ("%.3f" % started if started else "unknown",
                                                                 time.time()))


def faults():
    host_dir = gpusim.find_host_dir()
    return gpusim.read_json(os.path.join(host_dir, "faults.json"), {}) if host_dir else {}


def _title(text):
    try:
        from setproctitle import setproctitle
        setproctitle(text)
    except ImportError:
        pass


def version_tuple(version):
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


# ---------------------------------------------------------------------------------------------------
# installed release
# ---------------------------------------------------------------------------------------------------
def installed_sglang():
    """(package dir, version) of the sglang this interpreter would import, found without importing it."""
    import importlib.util
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("ModuleNotFoundError: No module named 'sglang' (interpreter %s)" % sys.executable)
    pkg = list(spec.submodule_search_locations)[0]
    # The dist-info directory names the installed release (version.py says 0.0.0.dev0 in some wheels).
    version = None
    site = os.path.dirname(pkg)
    for entry in sorted(os.listdir(site)):
        m = re.match(r"^sglang-(.+)\.dist-info$", entry)
        if m:
            version = m.group(1)
    if version is None:
        try:
            with open(os.path.join(pkg, "version.py")) as fh:
                m = re.search(r"__version__\s*=\s*[\"']([^\"']+)", fh.read())
                version = m.group(1) if m else "0"
        except OSError:
            version = "0"
    return pkg, version


def build_parser(pkg_dir):
    """argparse parser with the option names of the installed release's server_args.py."""
    import argparse
    import ast
    parser = argparse.ArgumentParser(prog="launch_server.py", conflict_handler="resolve")
    src_path = os.path.join(pkg_dir, "srt", "server_args.py")
    seen = set()
    try:
        with open(src_path) as fh:
            tree = ast.parse(fh.read())
    except (OSError, SyntaxError):
        tree = None
    for node in ast.walk(tree) if tree else []:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            continue
        flags = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                 and a.value.startswith("-")]
        if not flags or any(f in seen for f in flags):
            continue
        seen.update(flags)
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        opts = {}
        action = kw.get("action")
        if isinstance(action, ast.Constant) and action.value in ("store_true", "store_false"):
            opts["action"] = action.value
        else:
            t = kw.get("type")
            if isinstance(t, ast.Name) and t.id in ("int", "float"):
                opts["type"] = {"int": int, "float": float}[t.id]
            nargs = kw.get("nargs")
            opts["nargs"] = nargs.value if isinstance(nargs, ast.Constant) else None
            if opts["nargs"] is None:
                del opts["nargs"]
            ch = kw.get("choices")
            if isinstance(ch, (ast.List, ast.Tuple)) and all(isinstance(e, ast.Constant) for e in ch.elts):
                opts["choices"] = [e.value for e in ch.elts]
            if isinstance(action, ast.Constant) and action.value in ("append", "store"):
                opts["action"] = action.value
            elif action is not None:
                opts["nargs"] = "*"  # custom actions: accept what follows
        req = kw.get("required")
        if isinstance(req, ast.Constant) and req.value is True:
            opts["required"] = True
        dest = None
        longs = [f for f in flags if f.startswith("--")]
        if isinstance(kw.get("dest"), ast.Constant):
            dest = kw["dest"].value
        elif longs:
            dest = longs[0][2:].replace("-", "_")
        try:
            parser.add_argument(*flags, dest=dest, **opts)
        except (TypeError, ValueError):
            parser.add_argument(*flags, dest=dest, nargs="*")
    # 0.5.2x generate most flags from annotated config fields (srt/arg_groups/arg_utils.py:
    # add_cli_args_from_dataclass): ``name: A[T, "help" | Arg(...)] = default``.
    fields_dir = os.path.join(pkg_dir, "srt", "arg_groups", "fields")
    field_files = [src_path] + sorted(os.path.join(fields_dir, f) for f in (
        os.listdir(fields_dir) if os.path.isdir(fields_dir) else []) if f.endswith(".py"))
    for path in field_files:
        try:
            with open(path) as fh:
                ftree = ast.parse(fh.read())
        except (OSError, SyntaxError):
            continue
        for node in ast.walk(ftree):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                _add_field_flag(parser, node, seen)
    # The flags gpufleet renders, whatever the release's file looked like.
    base = {"--model-path": {"required": True}, "--host": {"default": "127.0.0.1"},
            "--port": {"type": int, "default": 30000}, "--tp-size": {"type": int, "default": 1},
            "--dp-size": {"type": int, "default": 1}}
    for flag, opts in base.items():
        if flag not in seen:
            parser.add_argument(flag, **opts)
    parser.set_defaults(host="127.0.0.1", port=30000, tp_size=1, dp_size=1)
    return parser


def _type_of(node):
    """(kind, choices) of an annotation: kind in int, float, bool, str, list; Optional unwrapped."""
    import ast
    if isinstance(node, ast.Subscript):
        base = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", "")
        inner = node.slice
        if base == "Optional":
            return _type_of(inner)
        if base in ("List", "list", "Tuple", "tuple"):
            return "list", None
        if base == "Literal":
            elts = inner.elts if isinstance(inner, ast.Tuple) else [inner]
            vals = [e.value for e in elts if isinstance(e, ast.Constant)]
            return (type(vals[0]).__name__ if vals else "str"), vals
        if base == "Union":
            elts = inner.elts if isinstance(inner, ast.Tuple) else [inner]
            kinds = [_type_of(e)[0] for e in elts if not (isinstance(e, ast.Constant) and e.value is None)]
            return (kinds[0] if len(kinds) == 1 else "str"), None
        return "str", None
    if isinstance(node, ast.Name) and node.id in ("int", "float", "bool", "str"):
        return node.id, None
    return "str", None


def _add_field_flag(parser, node, seen):
    import ast
    ann = node.annotation
    if not (isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "A"
            and isinstance(ann.slice, ast.Tuple) and len(ann.slice.elts) >= 2):
        return
    typ, meta = ann.slice.elts[0], ann.slice.elts[1]
    kw = {}
    if isinstance(meta, ast.Call):
        kw = {k.arg: k.value for k in meta.keywords if k.arg}
    elif not isinstance(meta, ast.Constant):
        return
    if isinstance(kw.get("no_cli"), ast.Constant) and kw["no_cli"].value:
        return
    name = node.target.id
    cli = kw["cli_name"].value if isinstance(kw.get("cli_name"), ast.Constant) else "--" + name.replace("_", "-")
    aliases = [e.value for e in kw["aliases"].elts] if isinstance(kw.get("aliases"), ast.List) else []
    flags = [cli] + aliases
    if any(f in seen for f in flags):
        return
    seen.update(flags)
    kind, choices = _type_of(typ)
    opts = {"dest": name}
    if "action" in kw or "type_parser" in kw:
        opts["nargs"] = "?" if "action" in kw else None
    elif kind == "bool":
        opts["action"] = "store_true"
    elif kind == "list":
        opts["nargs"] = "+"
    else:
        if kind in ("int", "float"):
            opts["type"] = int if kind == "int" else float
        if choices:
            opts["choices"] = choices
    if isinstance(kw.get("choices"), ast.List) and all(isinstance(e, ast.Constant) for e in kw["choices"].elts):
        opts["choices"] = [e.value for e in kw["choices"].elts]
    if node.value is None and kind != "bool":
        opts["required"] = True
    opts = {k: v for k, v in opts.items() if v is not None}
    try:
        parser.add_argument(*flags, **opts)
    except (TypeError, ValueError):
        parser.add_argument(*flags, dest=name, nargs="*")


# ---------------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------------
def _safetensors_open():
    """safetensors' ``safe_open`` where it can open a file here, else None. Every framework it offers needs torch
    or numpy before it opens a file (safetensors 0.8.0: ModuleNotFoundError); numpy has no bfloat16, so only
    torch ("pt", SGLang's framework) will do. The lab hosts' venvs have neither: they take the page walk alone."""
    try:
        from safetensors import safe_open
        import torch  # noqa: F401  (imported before the clock starts: SGLang's process has it loaded already)
    except ImportError:
        return None
    return safe_open


_DEVICE_RE = re.compile(r"cpu|cuda(:\d+)?")


class WeightsDeviceError(weights.WeightsError):
    """GPUFLEET_STANDIN_WEIGHTS_DEVICE cannot be honoured: not a device, or safetensors or torch missing."""


def weights_device(environ=None):
    """The device of ``GPUFLEET_STANDIN_WEIGHTS_DEVICE`` (``cpu``, ``cuda``, ``cuda:N``), or None when it is unset or
    empty (the default: shards mapped for the server's life). Raises WeightsDeviceError for any other value."""
    value = ((os.environ if environ is None else environ).get(WEIGHTS_DEVICE_ENV) or "").strip()
    if not value:
        return None
    if not _DEVICE_RE.fullmatch(value):
        raise WeightsDeviceError("%s=%s is not a device: give cpu, cuda or cuda:N (unset: the shards stay mapped)"
                                 % (WEIGHTS_DEVICE_ENV, value))
    return value


def shard_mappings(files, maps_path="/proc/self/maps"):
    """How many of this process's memory mappings are of ``files`` (/proc/self/maps; a path with a space in it is
    matched whole at the end of the line)."""
    wanted = set(os.path.realpath(f) for f in files)
    count = 0
    with open(maps_path) as fh:
        for line in fh:
            fields = line.rstrip("\n").split(None, 5)
            if len(fields) == 6 and fields[5] in wanted:
                count += 1
    return count


def _load_onto_device(files, device, safe_open):
    """Every tensor of ``files`` on ``device`` (torch), kept; see the module docstring. Returns
    ``(tensors, seconds, init_s)``: ``init_s`` is the CUDA context's creation, before the clock starts."""
    import gc
    import torch
    dev = torch.device(device)
    t_init = time.monotonic()
    if dev.type == "cuda":
        # SGLang's worker has its CUDA context before it loads (init_torch_distributed): not part of the read
        torch.empty(0, device=dev)
        torch.cuda.synchronize(dev)
    init_s = time.monotonic() - t_init
    t0 = time.monotonic()
    tensors = []
    for path in files:
        weights.read_header(path)
        # As SGLang 0.5.23 does (model_loader/weight_utils.py safetensors_weights_iterator: safe_open on "cpu", then
        # each model's weight_loader copies the tensor into its parameter on the GPU). On the CPU get_tensor maps
        # the file copy-on-write and pages in lazily: the copy reads every byte, into memory the file does not back.
        with safe_open(path, framework="pt", device="cpu") as st:
            for name in st.keys():
                tensor = st.get_tensor(name)
                tensors.append(tensor.to(dev, copy=True))
                del tensor
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.monotonic() - t0
    gc.collect()  # the file-backed temporaries go now, not at some later collection
    return tensors, seconds, init_s


def load_weights(model_dirs, device=None):
    """Read every ``*.safetensors`` of ``model_dirs`` as a loader whose tensors stay backed by the file; with
    ``device`` (weights_device), onto that device, keeping the tensors and no mapping of the shards.

    Per shard: the header checked (weights.read_header; a bad file raises weights.WeightsError), ``safe_open`` +
    ``get_tensor`` of each tensor where safetensors and torch import (SGLang 0.5.23 model_loader/weight_utils.py
    ``safetensors_weights_iterator``), then a read-only ``mmap`` of the whole file with one byte read per page, so
    the kernel reads from disk whatever the page cache lacks, whether or not ``get_tensor`` copied. The maps are
    returned: the caller keeps them for its life (its smaps then shows the shards resident).

    Returns None when no dir holds a shard, else ``{"maps", "files", "bytes", "seconds", "reader",
    "resident_before_pct"}`` (``resident_before_pct`` None where fincore cannot tell); with ``device`` also
    ``tensors``, ``device``, ``device_init_s`` and ``file_maps`` (shard_mappings after the load), ``maps`` empty.
    Raises WeightsDeviceError when ``device`` is given and safetensors or torch does not import.
    """
    files = []
    for d in model_dirs:
        files += [f for f in weights.weight_files(d) if f not in files]
    if not files:
        return None
    try:
        got = weights.residency(files)
        total = sum(t for _, t in got.values())
        before = round(100.0 * sum(r for r, _ in got.values()) / total, 1) if total else 0.0
    except (weights.WeightsError, OSError):
        before = None
    safe_open = _safetensors_open()
    if device:
        if safe_open is None:
            raise WeightsDeviceError("%s=%s needs safetensors and torch in the server's interpreter (%s); install "
                                     "them there or unset it" % (WEIGHTS_DEVICE_ENV, device, sys.executable))
        tensors, seconds, init_s = _load_onto_device(files, device, safe_open)
        return {"maps": [], "tensors": tensors, "files": files, "bytes": sum(os.path.getsize(f) for f in files),
                "seconds": seconds, "reader": "safetensors->%s" % device, "resident_before_pct": before,
                "device": device, "device_init_s": init_s, "file_maps": shard_mappings(files)}
    t0 = time.monotonic()
    maps, size = [], 0
    for path in files:
        weights.read_header(path)
        if safe_open is not None:
            with safe_open(path, framework="pt", device="cpu") as st:
                for name in st.keys():
                    st.get_tensor(name)  # SGLang copies each into its GPU parameter and drops it
        with open(path, "rb") as fh:
            m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        for offset in range(0, len(m), mmap.PAGESIZE):
            m[offset]
        maps.append(m)
        size += len(m)
    return {"maps": maps, "files": files, "bytes": size, "seconds": time.monotonic() - t0,
            "reader": "safetensors+mmap" if safe_open else "mmap", "resident_before_pct": before}


# ---------------------------------------------------------------------------------------------------
# workers
# ---------------------------------------------------------------------------------------------------
def hold_cuda(gpu, mib):
    """Allocate ``mib`` MiB on CUDA device ``gpu`` with torch and return the tensor (keep it to hold the memory).

    cudaMalloc through torch's caching allocator, like SGLang's workers; the GPU then shows the worker as a
    compute process with its MiB plus the CUDA context (about 520 MiB, docs/benchmarks.md).
    """
    import torch
    torch.cuda.set_device(gpu)
    held = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    return held


def _hold_forever(keep):
    """Body of a defunct worker's surviving thread: keeps ``keep`` (memory, fds) referenced forever."""
    import threading
    threading.Event().wait()
    del keep  # noqa


def worker_main(rank, gpu, mib, title, ready_name, ignore_sigterm, orphan, defunct=False):
    """Body of a spawned worker: title, PDEATHSIG, GPU device open, memory held, then wait forever.

    ``defunct``: after registering, the main thread exits (libc ``pthread_exit``; Python's own exit paths would
    end the process or join the thread first) while a non-daemon thread holds everything: the process shows as
    ``<defunct>`` with an empty /proc/<pid>/cmdline and fd dir, its thread keeps the gpusimd connection (shared fd
    table) and so the memory (FIELD-NOTES 2026-11-30).
    """
    import nsutil
    if orphan:
        # Leave the server's process tree: double fork, new session; the grandchild is re-parented to the
        # host's PID 1 and survives the server's kill of its children (SGLang's orphan reports).
        if os.fork() > 0:
            os._exit(0)
        os.setsid()
        if os.fork() > 0:
            os._exit(0)
    else:
        nsutil.set_pdeathsig(signal.SIGKILL)
    # SGLang's scheduler and detokenizer call setproctitle too (srt/managers/scheduler.py, 0.5.23). setproctitle
    # overwrites the environ area, so /proc/<pid>/environ of a real worker no longer shows its
    # environment unless SPT_NOENV is set in it (setproctitle README); the lab reproduces that.
    _title(title)
    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    devs = []
    held = None
    if gpu is not None and os.environ.get(CUDA_MIB_ENV):
        held = hold_cuda(gpu, mib)
    elif gpu is not None:
        for path in ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia%d" % gpu):
            try:
                devs.append(os.open(path, os.O_RDWR))
            except OSError:
                pass
        try:
            held = gpusim.hold(gpu, mib, name=title)
        except OSError as exc:
            # As a scheduler that runs out of CUDA memory at start: tell the server, which exits, and die.
            ready = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            ready.connect(ready_name)
            ready.sendall((json.dumps({"rank": rank, "pid": os.getpid(), "error": str(exc)}) + "\n").encode())
            os._exit(1)
    ready = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ready.connect(ready_name)
    ready.sendall((json.dumps({"rank": rank, "pid": os.getpid(), "orphan": bool(orphan)}) + "\n").encode())
    if defunct:
        import ctypes
        import threading
        threading.Thread(target=_hold_forever, args=((held, devs, ready),), name="holder", daemon=False).start()
        ctypes.CDLL(None).pthread_exit(None)  # releases the GIL first (ctypes), so the holder thread runs on
    while True:
        signal.pause()
    del held, devs  # noqa  (kept referenced until death)


class Server:
    def __init__(self, args, argv, pkg_dir, version):
        import threading
        self.args = args
        self.argv = argv
        self.pkg_dir = pkg_dir
        self.version = version
        self.warm = False
        self.shutting_down = False
        self.inflight = 0
        self.lock = threading.Lock()
        self.procs = []
        self.worker_pids = {}
        self.util_sock = None
        self.expected_exit = False
        self.hang_after = None  # lab fault hang_after_requests, decided once at the start (hang_after_of)
        self.speed = None  # perf.start_speed of this start, decided once the workers run
        self.weights = None  # load_weights' result; its maps stay referenced for the life of the server
        self.answered = 0

    @staticmethod
    def hang_after_of(knob, argv):
        """Answers before the hang for the fault knob ``hang_after_requests`` (int N, or {"n": N, "with_arg": TEXT}
        for a start whose argv holds TEXT only), None when it does not apply to this start. Read once at the
        start: a server relaunched after the knob was cleared, or with other flags, answers forever."""
        if knob is None or knob is False:
            return None
        if isinstance(knob, dict):
            if knob.get("with_arg") and not any(str(knob["with_arg"]) in a for a in argv):
                return None
            knob = knob.get("n")
        return max(0, int(knob))

    def hang_now(self):
        """True once this server answered its hang_after_requests generations: from then on a generation is
        accepted and never answered (a hung scheduler, sgl-project/sglang#22779). It is not counted in flight,
        so SIGTERM still ends the server; /health and /health_generate keep answering."""
        if self.hang_after is None:
            return False
        with self.lock:
            if self.answered < self.hang_after:
                self.answered += 1
                return False
            first = self.answered == self.hang_after
            self.answered += 1
        if first:
            log("lab fault hang_after_requests: %d generation(s) answered; accepting and never answering from now"
                % self.hang_after)
        return True

    # -- lifecycle --------------------------------------------------------------------------------
    def spawn_workers(self, f):
        import multiprocessing as mp
        import threading
        ctx = mp.get_context("spawn")
        ready_name = "\0sglang-standin-%d-ready" % os.getpid()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(ready_name)
        listener.listen(64)
        tp = int(self.args.tp_size)
        mib = int(os.environ.get(CUDA_MIB_ENV) or f.get("worker_mib", DEFAULT_WORKER_MIB))
        orphan_rank = f.get("orphan_worker")
        if orphan_rank is True:
            orphan_rank = tp - 1
        defunct_rank = f.get("zombie_worker")
        if defunct_rank is True:
            defunct_rank = tp - 1
        jobs = [(r, r % gpusim.GPU_COUNT, mib, "sglang::scheduler_TP%d" % r, orphan_rank is not None
                 and orphan_rank is not False and int(orphan_rank) == r,
                 defunct_rank is not None and defunct_rank is not False and int(defunct_rank) == r)
                for r in range(tp)]
        jobs.append((-1, None, 0, "sglang::detokenizer", False, False))
        for rank, gpu, m, title, orphan, defunct in jobs:
            # A defunct worker detaches like an orphan: the server's kill of its children (SGLang's
            # kill_process_tree walks its children) would otherwise end it.
            orphan = orphan or defunct
            p = ctx.Process(target=worker_main, name=title,
                            args=(rank, gpu, m, title, ready_name, bool(f.get("worker_ignores_sigterm")), orphan,
                                  defunct))
            p.daemon = False
            p.start()
            if not orphan:
                self.procs.append(p)
        conns = []
        listener.settimeout(60)
        for _ in jobs:
            conn, _ = listener.accept()
            line = b""
            while not line.endswith(b"\n"):
                chunk = conn.recv(4096)
                if not chunk:
                    break
                line += chunk
            info = json.loads(line or b"{}")
            if info.get("error"):
                log("Scheduler hit an exception: torch.OutOfMemoryError: %s (TP%s)" % (info["error"], info.get("rank")))
                self.kill_tree_and_exit(1)
            self.worker_pids[info.get("rank")] = info.get("pid")
            if not info.get("orphan"):
                conns.append(conn)
        listener.close()
        threading.Thread(target=self._watch_workers, args=(conns,), daemon=True).start()

    def _watch_workers(self, conns):
        import selectors
        sel = selectors.DefaultSelector()
        for c in conns:
            sel.register(c, selectors.EVENT_READ)
        while True:
            for key, _ in sel.select():
                if not key.fileobj.recv(1):
                    if not self.expected_exit:
                        log("Received sigquit from a child process. It usually means the child failed.")
                        self.kill_tree_and_exit(1)
                    sel.unregister(key.fileobj)

    def kill_workers(self):
        self.expected_exit = True
        for p in self.procs:
            if p.pid:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            p.join(timeout=5)

    def kill_tree_and_exit(self, rc):
        self.kill_workers()
        sys.stderr.flush()
        if rc == 137:
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(rc)

    def set_util(self, busy):
        try:
            if self.util_sock is None:
                self.util_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.util_sock.connect(gpusim.GPUSIMD_SOCKET)
            gpusim.report_util(self.util_sock, range(min(int(self.args.tp_size), gpusim.GPU_COUNT)),
                               87 if busy else 0)
        except OSError:
            self.util_sock = None

    # -- HTTP ---------------------------------------------------------------------------------------
    def server_info(self):
        info = {k: v for k, v in vars(self.args).items()}
        info.update({"version": self.version, "status": "ready" if self.warm else "starting"})
        if self.weights:
            info.update({"weights_load_s": round(self.weights["seconds"], 3), "weights_bytes": self.weights["bytes"],
                         "weights_files": len(self.weights["files"]), "weights_reader": self.weights["reader"],
                         "weights_resident_before_pct": self.weights["resident_before_pct"]})
            if self.weights.get("device"):
                info.update({"weights_device": self.weights["device"],
                             "weights_device_init_s": round(self.weights["device_init_s"], 3),
                             "weights_file_maps": self.weights["file_maps"]})
        return info

    def model_info(self):
        return {"model_path": self.args.model_path,
                "tokenizer_path": getattr(self.args, "tokenizer_path", None) or self.args.model_path,
                "is_generation": True, "preferred_sampling_params": None, "weight_version": "default",
                "has_image_understanding": False, "has_audio_understanding": False}

    def _enter(self):
        with self.lock:
            self.inflight += 1
            if self.inflight == 1:
                self.set_util(True)

    def _leave(self):
        with self.lock:
            self.inflight -= 1
            if self.inflight == 0:
                self.set_util(False)

    def _meta(self, t0, prompt_tokens, n, done):
        return {"id": "%x" % int(t0 * 1e6),
                "finish_reason": {"type": "length", "length": n} if done else None,
                "prompt_tokens": prompt_tokens, "completion_tokens": n, "cached_tokens": 0,
                "e2e_latency": round(time.time() - t0, 4)}

    @staticmethod
    def _request(body):
        params = body.get("sampling_params") or {}
        n = int(params.get("max_new_tokens", 16))
        text = body.get("text") or ""
        return n, max(1, len(str(text).split()))

    def start_speed(self, f):
        """This start's decode speed (perf.start_speed) from a TP worker's environment as read from
        /proc/<pid>/environ, and the speculative flags of the command line; logged once."""
        source, env = None, None
        for rank in sorted(r for r in self.worker_pids if r is not None and r >= 0):
            env = perf.read_environ(self.worker_pids[rank])
            if env is not None:
                source = "/proc/%s/environ of sglang::scheduler_TP%d" % (self.worker_pids[rank], rank)
                break
        if env is None:
            # setproctitle overwrote the workers' environ (no SPT_NOENV): they inherited this process's
            env = dict(os.environ)
            source = "the server's environment (the workers' /proc/<pid>/environ is overwritten: SPT_NOENV unset)"
        import tempfile
        state_dirs = [gpusim.find_host_dir(), os.environ.get(PERF_DIR_ENV),
                      os.path.join(tempfile.gettempdir(), "gpufleet-standin-perf-%d" % os.getuid())]
        speed = perf.start_speed(env, vars(self.args), f, state_dirs)
        nccl = ", ".join("%s=%s" % (k, env[k]) for k in sorted(env) if k.startswith("NCCL_")) or "none"
        log("lab stand-in decode speed: row %s, base %.2f tok/s, factor %.4f (perf_seed %s, start %d, noise +-%g), "
            "effective %.2f tok/s per stream; NCCL values from %s: %s" % (
                speed["row"], speed["base"], speed["factor"], speed["seed"], speed["start"], speed["noise"],
                speed["effective"], source, nccl))
        return speed

    def decode(self, n, emit):
        """Decode ``n`` tokens for one request, calling ``emit(done)`` as tokens come out; returns whether the
        fixed ``tokens_per_s`` knob paced it. With the knob (read per request, existing tests): ``n / tps``
        seconds in eight chunks. Without: this start's speed (self.speed), one token at a time, each stream at
        perf.per_stream_tok_s of the requests in flight; time overslept is credited (several tokens per emit), so
        the rate holds on a busy machine."""
        fixed = faults().get("tokens_per_s")
        if fixed is not None:
            tps = float(fixed)
            step = max(1, n // 8)
            done = 0
            while done < n:
                k = min(step, n - done)
                time.sleep(k / tps if tps > 0 else 0)
                done += k
                emit(done)
            return True
        base = self.speed["effective"] if self.speed else perf.NCCL_NONE_TOK_S
        done, credit, last = 0, 0.0, time.monotonic()
        while done < n:
            time.sleep(max(0.0, (1.0 - credit) / perf.per_stream_tok_s(base, self.inflight)))
            now = time.monotonic()
            credit += (now - last) * perf.per_stream_tok_s(base, self.inflight)
            last = now
            k = min(n - done, int(credit))
            if k:
                credit -= k
                done += k
                emit(done)
        return False

    def generate(self, body):
        n, prompt_tokens = self._request(body)
        t0 = time.time()
        self._enter()
        try:
            fixed = faults().get("tokens_per_s")
            if fixed is not None:  # the knob's one sleep, as before the speed model
                time.sleep(n / float(fixed) if float(fixed) > 0 else 0)
            else:
                self.decode(n, lambda done: None)
        finally:
            self._leave()
        return {"text": " ".join(["lab"] * n), "meta_info": self._meta(t0, prompt_tokens, n, True)}

    def generate_stream(self, body, write):
        """``"stream": true``: like SGLang, one SSE event per decoded token (or chunk), ``data: {text
        (cumulative), meta_info}``, then ``data: [DONE]``; ``write(bytes)`` sends one chunk (raises OSError when
        the client is gone, which ends the request)."""
        n, prompt_tokens = self._request(body)
        t0 = time.time()
        self._enter()
        try:
            def emit(done):
                event = {"text": " ".join(["lab"] * done), "meta_info": self._meta(t0, prompt_tokens, done, done >= n)}
                write(b"data: " + json.dumps(event).encode() + b"\n\n")
            self.decode(n, emit)
            write(b"data: [DONE]\n\n")
        finally:
            self._leave()

    def loads(self):
        """``GET /v1/loads`` (SGLang 0.5.23 srt/entrypoints/v1_loads.py): one entry per DP rank; the stand-in
        has one, whose ``num_running_reqs`` is the number of ``/generate`` requests in flight."""
        with self.lock:
            running = self.inflight
        return {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "version": self.version,
                "accelerator": "NVIDIA H200", "num_accelerators": int(self.args.tp_size),
                "loads": [{"timestamp": time.time(), "dp_rank": 0, "num_running_reqs": running,
                           "num_waiting_reqs": 0, "num_used_tokens": 0, "num_total_tokens": 0,
                           "utilization": 0.87 if running else 0.0}]}

    def make_handler(self):
        from http.server import BaseHTTPRequestHandler
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt, *a):
                pass

            def _send(self, code, obj=None):
                data = b"" if obj is None else json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _stream(self, body):
                # Server-sent events over chunked transfer encoding (HTTP/1.1 keeps the connection).
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()

                def write(data):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                try:
                    server.generate_stream(body, write)
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                except OSError:
                    self.close_connection = True

            def _denied(self, path):
                # SGLang 0.5.23 srt/utils/auth.py decide_request_auth: with --api-key every path except the
                # /health*, /ready*, /metrics* prefixes needs "Authorization: Bearer <key>", else 401.
                key = getattr(server.args, "api_key", None)
                if not key or path.startswith(("/health", "/ready", "/metrics")):
                    return False
                scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
                if scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key.encode()):
                    return False
                self._send(401, {"error": "Unauthorized"})
                return True

            def do_GET(self):
                path = self.path.split("?", 1)[0]
                if self._denied(path):
                    return None
                if path == "/health" and version_tuple(server.version) < (0, 5, 0):
                    # up to 0.4.10 /health answers 200 as soon as HTTP is up (FIELD-NOTES)
                    return self._send(200)
                if path in ("/health", "/health_generate"):
                    ok = server.warm and not server.shutting_down
                    return self._send(200 if ok else 503)
                new_names = version_tuple(server.version) >= (0, 5, 6)  # /model_info, /server_info from 0.5.6
                if path == "/get_model_info" or (new_names and path == "/model_info"):
                    return self._send(200, server.model_info())
                if path == "/get_server_info" or (new_names and path == "/server_info"):
                    return self._send(200, server.server_info())
                if path == "/v1/loads" and version_tuple(server.version) >= (0, 5, 23):
                    return self._send(200, server.loads())
                if path == "/v1/models":
                    name = getattr(server.args, "served_model_name", None) or server.args.model_path
                    return self._send(200, {"object": "list", "data": [
                        {"id": name, "object": "model", "created": int(time.time()), "owned_by": "sglang",
                         "root": name}]})
                self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                path = self.path.split("?", 1)[0]
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)  # read first: the connection may carry another request
                if self._denied(path):
                    return None
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    return self._send(400, {"error": {"message": "invalid JSON body"}})
                if path == "/generate" and server.hang_now():
                    import threading
                    threading.Event().wait()  # the client's timeout ends it; the daemon thread dies with us
                    return None
                if path == "/generate" and body.get("stream"):
                    return self._stream(body)
                if path == "/generate":
                    return self._send(200, server.generate(body))
                if path == "/flush_cache":
                    # sglang.benchmark.serving --flush-cache (or SGLANG_IS_IN_CI) posts it after the warm-up
                    return self._send(200, {"message": "Cache flushed."})
                self._send(404, {"detail": "Not Found"})

        return Handler

    def load_weights(self):
        dirs = [self.args.model_path, getattr(self.args, "speculative_draft_model_path", None)]
        try:
            self.weights = load_weights([d for d in dirs if d and os.path.isdir(d)], device=weights_device())
        except WeightsDeviceError as exc:
            log("RuntimeError: lab stand-in: %s" % exc)
            self.kill_tree_and_exit(1)
        except (weights.WeightsError, OSError) as exc:
            log("safetensors_rust.SafetensorError: Error while deserializing header: %s" % exc)
            self.kill_tree_and_exit(1)
        if self.weights:
            before = self.weights["resident_before_pct"]
            log("loaded %.2f GiB of weights from %d files in %.2f s (resident before: %s %%)" % (
                self.weights["bytes"] / float(1 << 30), len(self.weights["files"]), self.weights["seconds"],
                "unknown" if before is None else "%.1f" % before))
            if self.weights.get("device"):
                log("weights on %s (%s; context %.2f s before the read), %d mapping(s) of the shards left" % (
                    self.weights["device"], self.weights["reader"], self.weights["device_init_s"],
                    self.weights["file_maps"]))

    def on_sigterm(self, *_):
        self.shutting_down = True

    def run(self):
        import threading
        from http.server import ThreadingHTTPServer
        f = faults()
        self.hang_after = self.hang_after_of(f.get("hang_after_requests"), self.argv)
        log("server_args=ServerArgs(%s)" % ", ".join("%s=%r" % kv for kv in sorted(vars(self.args).items())
                                                     if kv[1] not in (None, False)))
        # NCCL and SGLang map segments in /dev/shm; when it is full the first write faults: SIGBUS (FIELD-NOTES).
        try:
            st = os.statvfs("/dev/shm")
            if st.f_bavail * st.f_frsize < SHM_NEEDED_MIB << 20:
                log("Fatal Python error: Bus error (/dev/shm has %d MiB free)" % (st.f_bavail * st.f_frsize >> 20))
                signal.signal(signal.SIGBUS, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGBUS)
        except OSError:
            pass
        self.spawn_workers(f)
        self.speed = self.start_speed(f)
        log("Load weight begin. (lab stand-in; sglang %s from %s)" % (self.version, self.pkg_dir))
        self.load_weights()
        time.sleep(float(f.get("slow_load_s", DEFAULT_LOAD_S)))
        if f.get("crash_on_start"):
            log("RuntimeError: lab fault crash_on_start: scheduler failed while loading the model")
            self.kill_tree_and_exit(1)
        if f.get("crash_with_arg") and any(str(f["crash_with_arg"]) in a for a in self.argv):
            log("RuntimeError: lab fault crash_with_arg %s: scheduler failed while loading the model" % f["crash_with_arg"])
            self.kill_tree_and_exit(1)
        try:
            ThreadingHTTPServer.daemon_threads = True
            # uvicorn's listen backlog (2048), not socketserver's 5: a burst of 8 connects would otherwise lose SYNs
            # and wait 1 s for their retransmission.
            ThreadingHTTPServer.request_queue_size = 2048
            httpd = ThreadingHTTPServer((self.args.host, int(self.args.port)), self.make_handler())
        except OSError as exc:
            log("ERROR: [Errno %s] error while attempting to bind on address (%r, %d): %s" % (
                exc.errno, self.args.host, int(self.args.port), exc.strerror))
            self.kill_tree_and_exit(1)
        threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
        time.sleep(WARMUP_S)
        self.warm = True
        log("The server is fired up and ready to roll!")
        while not self.shutting_down:
            signal.pause()
        log("Received SIGTERM; draining %d in-flight request(s)" % self.inflight)
        while self.inflight > 0:
            time.sleep(DRAIN_POLL_S)
        log("Graceful shutdown complete; killing the process tree")
        self.kill_tree_and_exit(137 if version_tuple(self.version) <= (0, 5, 18) else 0)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    log_exec_time()
    pkg_dir, version = installed_sglang()
    args = build_parser(pkg_dir).parse_args(argv)
    # Up to 0.5.1x the flag is declared "--tensor-parallel-size", "--tp-size": argparse stores it under the
    # first name and ServerArgs.from_cli_args copies it to tp_size (same for dp).
    for long_name, short in (("tensor_parallel_size", "tp_size"), ("data_parallel_size", "dp_size")):
        if getattr(args, long_name, None) is not None:
            setattr(args, short, getattr(args, long_name))
    if not os.path.isdir(args.model_path):
        log("OSError: model path %s is not a directory (lab stand-in needs the lab's fake model dirs)"
            % args.model_path)
        return 1
    # The real main process is not retitled, so its /proc/<pid>/environ stays readable: retitle ours
    # with SPT_NOENV (setproctitle then leaves environ alone) and drop the variable again before the
    # workers are spawned, so they behave like SGLang's (see worker_main).
    user_noenv = "SPT_NOENV" in os.environ
    os.environ["SPT_NOENV"] = "1"
    _title("%s -m sglang.launch_server %s" % (sys.executable, " ".join(argv)))
    if not user_noenv:
        del os.environ["SPT_NOENV"]
    import nsutil
    nsutil.set_comm(os.path.basename(sys.executable))  # the real main process's comm is its interpreter's
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # tests/, for support.set_envs_exec
    from support import set_envs_exec
    before = dict(os.environ)
    # Flags not given stay None in the stand-in's parser: SGLang's own defaults (tp/nnodes 1, ...) apply.
    given = {k: v for k, v in vars(args).items() if v is not None}
    # SGLang after 0.5.23 runs worker_launch.py's copy instead when SGLANG_PRESPAWN_WORKERS=1 (set_envs_source).
    source = set_envs_exec.set_envs_source(pkg_dir)
    set_envs_exec.execute_set_envs_and_config(source, os.environ, server_args=given)
    changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
    log("_set_envs_and_config (%s, %s) set: %s" % (version, os.path.relpath(source, pkg_dir), ", ".join(changed)))
    server = Server(args, argv, pkg_dir, version)
    signal.signal(signal.SIGTERM, server.on_sigterm)
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
