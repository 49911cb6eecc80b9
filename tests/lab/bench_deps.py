"""SGLang's own benchmark client on a lab host: its dependencies and a tokenizer built locally.

The lab hosts' venvs carry the real SGLang release without its dependencies (lab.py: the overlay lower is the
extracted wheel, the shared lab-deps dir adds psutil, nvidia-ml-py, setproctitle). ``python -m
sglang.bench_serving`` of 0.5.23 (``sglang/benchmark/serving.py``) needs far more, because importing anything
under ``sglang`` runs ``sglang/__init__.py`` -> ``sglang.srt.utils.common`` (torch, triton, zmq, PIL, starlette,
orjson, pybase64) and serving.py itself imports ``sglang.srt.disaggregation.utils`` (the server's config and
layer modules: torchvision, tvm_ffi, sentencepiece, compressed_tensors, gguf, loguru), ``sglang.lang`` (IPython)
and ``sglang.benchmark.datasets.mmmu`` (datasets). Found by importing it in an empty venv, one missing module at a
time (docs/tune.md). torch cannot be left out, and its CPU wheel cannot be used: PyPI's torchvision for Linux
x86_64 is a CUDA build whose ``_C.so`` needs ``libtorch_cuda.so``; so torch is 0.5.23's own pin, 2.14.1, with the
CUDA libraries it pulls (they import without a GPU).

Only labs that ask for it pay: ``ensure()`` installs once into a shared cache dir (``pip install --target``,
marker file), ``enable(host)`` adds that dir to one host's venv by a ``.pth`` and copies the tokenizer into the
host's target model dir (where SGLang's ``/model_info`` points the client), ``disable(host)`` undoes both.
"""
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CACHE = os.environ.get("GPUFLEET_CACHE", os.path.join(ROOT, ".cache"))
TAG = "py%d%d" % sys.version_info[:2]
# SGLang 0.5.23's pins (its METADATA) where it has one; the rest as PyPI serves them.
BENCH_DEPS = (
    "torch==2.14.1", "torchvision==0.29.1", "transformers==5.19.0", "tokenizers==0.23.2", "sentencepiece==0.2.1",
    "compressed-tensors==0.18.0", "apache-tvm-ffi==0.1.11", "numpy", "aiohttp", "requests", "tqdm", "orjson",
    "msgspec", "pybase64", "pillow", "starlette", "pyzmq", "ipython", "datasets", "loguru", "gguf",
)
PTH_NAME = "gpufleet-lab-bench-deps.pth"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# a WordLevel vocabulary: the stand-in's answers ("lab" words) and random token ids decode to plain words
VOCAB_SIZE = 2000


def deps_dir():
    return os.path.join(CACHE, "lab-deps", "bench-" + TAG)


def tokenizer_dir():
    return os.path.join(CACHE, "lab-deps", "bench-tokenizer")


def ensure(log=print):
    """The shared dir with the client's dependencies and the tokenizer (built once; later calls only check the
    markers). Returns ``{"deps": dir, "tokenizer": dir, "seconds": float, "cached": bool}``."""
    t0 = time.time()
    dest = deps_dir()
    marker = os.path.join(dest, ".complete")
    cached = os.path.exists(marker) and os.path.exists(os.path.join(tokenizer_dir(), "tokenizer.json"))
    if not cached:
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with open(dest + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.exists(marker):
                shutil.rmtree(dest, ignore_errors=True)
                argv = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        "--target", dest] + list(BENCH_DEPS)
                log("bench deps: %s" % " ".join(argv))
                proc = subprocess.run(argv, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise RuntimeError("could not install SGLang's benchmark client dependencies: %s\n%s"
                                       % (" ".join(argv), proc.stderr[-3000:]))
                with open(marker, "w") as fh:
                    fh.write(" ".join(BENCH_DEPS) + "\n")
            if not os.path.exists(os.path.join(tokenizer_dir(), "tokenizer.json")):
                build_tokenizer(tokenizer_dir())
    return {"deps": dest, "tokenizer": tokenizer_dir(), "seconds": round(time.time() - t0, 1), "cached": cached}


def build_tokenizer(dest):
    """A WordLevel tokenizer made with the ``tokenizers`` library (no hub), saved with tokenizer_config.json so
    ``transformers.AutoTokenizer.from_pretrained(dir)`` loads it as a PreTrainedTokenizerFast. Runs in a child
    python that sees the deps dir (this process may be the controller's venv with other versions)."""
    code = r"""
import json, os, sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
dest, size = sys.argv[1], int(sys.argv[2])
vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "lab": 3}
for i in range(len(vocab), size):
    vocab["w%d" % i] = i
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.decoder = decoders.WordPiece(prefix="##")  # joins words with single spaces
tmp = dest + ".tmp"
os.makedirs(tmp, exist_ok=True)
tok.save(os.path.join(tmp, "tokenizer.json"))
json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 131072, "unk_token": "<unk>",
           "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False, "add_eos_token": False,
           "clean_up_tokenization_spaces": False}, open(os.path.join(tmp, "tokenizer_config.json"), "w"))
json.dump({"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},
          open(os.path.join(tmp, "special_tokens_map.json"), "w"))
from transformers import AutoTokenizer
t = AutoTokenizer.from_pretrained(tmp)
assert t.decode(t.encode("lab lab", add_special_tokens=False)) == "lab lab", "tokenizer does not round-trip"
os.replace(tmp, dest)
"""
    env = dict(os.environ, PYTHONPATH=deps_dir(), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    shutil.rmtree(dest + ".tmp", ignore_errors=True)
    proc = subprocess.run([sys.executable, "-c", code, dest, str(VOCAB_SIZE)], capture_output=True, text=True,
                          env=env)
    if proc.returncode != 0:
        raise RuntimeError("could not build the lab tokenizer:\n%s" % proc.stderr[-3000:])


def _model_dir(host):
    with open(os.path.join(host["dir"], "host.json")) as fh:
        json.load(fh)  # the host exists
    return os.path.join(host["dir"], "models", "Llama-3.3-70B-Instruct")


def enable(host, log=print):
    """Give one lab host (a lab.json host entry) the client's dependencies and the tokenizer."""
    got = ensure(log)
    with open(os.path.join(host["site_packages"], PTH_NAME), "w") as fh:
        fh.write(got["deps"] + "\n")
    mdir = _model_dir(host)
    for name in TOKENIZER_FILES:
        shutil.copyfile(os.path.join(got["tokenizer"], name), os.path.join(mdir, name))
    return got


def disable(host):
    for path in [os.path.join(host["site_packages"], PTH_NAME)] + [
            os.path.join(_model_dir(host), name) for name in TOKENIZER_FILES]:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
