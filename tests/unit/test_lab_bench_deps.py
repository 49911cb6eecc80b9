"""tests/lab/bench_deps.py: a lab host gets SGLang's benchmark client (deps dir on its path, the tokenizer in its
target model dir) only when asked, and gives it back."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "lab"))
import bench_deps  # noqa: E402


def _host(tmp_path):
    hdir = tmp_path / "hosts" / "gpu-lab-01"
    (hdir / "models" / "Llama-3.3-70B-Instruct").mkdir(parents=True)
    (hdir / "models" / "Llama-3.3-70B-Instruct" / "config.json").write_text("{}")
    site = tmp_path / "site-packages"
    site.mkdir()
    host = {"name": "gpu-lab-01", "dir": str(hdir), "site_packages": str(site)}
    (hdir / "host.json").write_text(json.dumps(host))
    return host


def test_enable_puts_the_deps_on_the_host_path_and_the_tokenizer_beside_the_model_and_disable_undoes_it(
        tmp_path, monkeypatch):
    deps, tok = tmp_path / "cache" / "deps", tmp_path / "cache" / "tok"
    tok.mkdir(parents=True)
    for name in bench_deps.TOKENIZER_FILES:
        (tok / name).write_text(name)
    monkeypatch.setattr(bench_deps, "ensure", lambda log=print: {"deps": str(deps), "tokenizer": str(tok),
                                                                  "seconds": 0.0, "cached": True})
    host = _host(tmp_path)
    mdir = os.path.join(host["dir"], "models", "Llama-3.3-70B-Instruct")
    bench_deps.enable(host)
    with open(os.path.join(host["site_packages"], bench_deps.PTH_NAME)) as fh:
        assert fh.read().splitlines() == [str(deps)]
    for name in bench_deps.TOKENIZER_FILES:
        with open(os.path.join(mdir, name)) as fh:
            assert fh.read() == name
    bench_deps.disable(host)
    assert sorted(os.listdir(host["site_packages"])) == []
    assert sorted(os.listdir(mdir)) == ["config.json"]  # the model dir as lab.py made it
    bench_deps.disable(host)  # twice is fine


def test_the_deps_are_sglang_0_5_23_pins_where_it_pins():
    pins = dict(d.split("==") for d in bench_deps.BENCH_DEPS if "==" in d)
    assert pins["torch"] == "2.14.1" and pins["transformers"] == "5.19.0" and pins["tokenizers"] == "0.23.2"
