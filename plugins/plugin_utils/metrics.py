"""The fleet check's node_exporter textfile (controller side): one host's verdict as Prometheus metrics.

Written with ``prometheus_client`` (a registry of metric families rendered by ``generate_latest``), so the text
format, escaping and ordering are the client library's, not ours. The text is rendered on the controller and
copied to the host (roles/fleet_check/tasks/textfile.yml): ``prometheus_client`` is a controller requirement
(requirements.txt at the collection root), never a target one.

GPU series carry the labels dcgm-exporter gives the same GPU (``gpu`` index, ``UUID``, ``pci_bus_id``,
``device`` nvidiaN, ``modelName``, ``Hostname``), so PromQL joins them without ``label_replace``::

    gpufleet_gpu_healthy * on(UUID) group_left DCGM_FI_DEV_FB_USED

Host series carry ``Hostname``. What DCGM exports already (temperature, memory used) is not exported again.
The metric names, types, help texts and labels are in :data:`METRICS` (docs/metrics.md describes each).
"""
from __future__ import annotations

try:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import GaugeMetricFamily
    HAS_PROMETHEUS_CLIENT = True
except ImportError:  # reported by gpufleet_check_prom, which alone needs it
    HAS_PROMETHEUS_CLIENT = False

from ansible_collections.gpufleet.fleet.plugins.plugin_utils.check import SEVERITY_RANK

# dcgm-exporter's GPU labels, in its spelling (pkg/exporter: gpu = DCGM's GPU id, which is NVML's index;
# device = "nvidia" + that id; pci_bus_id as NVML's busId, 00000000:19:00.0; modelName as NVML's name).
GPU_LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname")
HOST_LABELS = ("Hostname",)

# name -> (help, labels). Every family the textfile can hold; a family without samples is left out.
METRICS = {
    "gpufleet_check_verdict": ("gpufleet check verdict of this host: 1 for the current verdict, 0 for the others.",
                               HOST_LABELS + ("verdict",)),
    "gpufleet_check_severity": ("gpufleet check verdict as a number: 0 OK, 1 WARN, 2 CRIT.", HOST_LABELS),
    "gpufleet_check_reasons": ("One sample (1) per reason the gpufleet check found; gpu and UUID are empty for "
                               "host-wide reasons.", HOST_LABELS + ("code", "severity", "gpu", "UUID")),
    "gpufleet_gpus_ok": ("GPUs without any finding.", HOST_LABELS),
    "gpufleet_gpus": ("GPUs present (or expected when none could be read).", HOST_LABELS),
    "gpufleet_gpu_healthy": ("1 when the gpufleet check found nothing on this GPU, else 0.", GPU_LABELS),
    "gpufleet_gpu_severity": ("Worst finding of the gpufleet check on this GPU: 0 OK, 1 WARN, 2 CRIT.",
                              GPU_LABELS),
    "gpufleet_sglang_serving": ("1 when SGLang answered a generation (/health_generate 200), else 0.", HOST_LABELS),
    "gpufleet_nccl_block_present": ("1 when the installed engine.py holds the NCCL block with the inventory's "
                                    "values, else 0.", HOST_LABELS),
    "gpufleet_check_timestamp_seconds": ("When the gpufleet check ran (Unix time).", HOST_LABELS),
}


def gpu_labels(gpu, hostname):
    """dcgm-exporter's labels for one GPU of the verdict's ``gpus`` (index, uuid, name, pci_bus_id); '' where
    the check could not read a value (Prometheus drops an empty label)."""
    index = gpu.get("index")
    return {
        "gpu": "" if index is None else str(index),
        "UUID": gpu.get("uuid") or "",
        "pci_bus_id": gpu.get("pci_bus_id") or "",
        "device": "" if index is None else "nvidia%s" % index,
        "modelName": gpu.get("name") or "",
        "Hostname": hostname,
    }


def metric_samples(result, hostname, now_epoch=None):
    """{metric name: [(labels dict, value)]} for one host's verdict (see :data:`METRICS`); families without
    samples are absent."""
    r = result or {}
    host = {"Hostname": hostname}
    verdict = r.get("verdict") or "CRIT"
    gpus = [g for g in r.get("gpus") or [] if isinstance(g, dict)]
    uuid_of = {g.get("index"): g.get("uuid") or "" for g in gpus}
    out = {
        "gpufleet_check_verdict": [(dict(host, verdict=v), 1 if v == verdict else 0) for v in SEVERITY_RANK],
        "gpufleet_check_severity": [(host, SEVERITY_RANK.get(verdict, 2))],
        "gpufleet_check_reasons": [
            (dict(host, code=x.get("code") or "", severity=x.get("severity") or "",
                  gpu="" if x.get("gpu") is None else str(x["gpu"]),
                  UUID="" if x.get("gpu") is None else uuid_of.get(x["gpu"], "")), 1)
            for x in r.get("reasons") or []],
        "gpufleet_gpus_ok": [(host, r.get("gpus_ok") or 0)],
        "gpufleet_gpus": [(host, r.get("gpus_total") or 0)],
        "gpufleet_gpu_healthy": [(gpu_labels(g, hostname), 1 if g.get("verdict") == "OK" else 0) for g in gpus],
        "gpufleet_gpu_severity": [(gpu_labels(g, hostname), SEVERITY_RANK.get(g.get("verdict"), 2)) for g in gpus],
    }
    sg = r.get("sglang") or {}
    if "serving" in sg:
        out["gpufleet_sglang_serving"] = [(host, 1 if sg.get("serving") else 0)]
    if sg.get("nccl_block") in ("present", "missing", "differs"):
        out["gpufleet_nccl_block_present"] = [(host, 1 if sg["nccl_block"] == "present" else 0)]
    if now_epoch is not None:
        out["gpufleet_check_timestamp_seconds"] = [(host, int(float(now_epoch)))]
    return {name: samples for name, samples in out.items() if samples}


class _Families(object):
    """A prometheus_client collector of fixed samples (one host's verdict)."""

    def __init__(self, samples):
        self._samples = samples

    def collect(self):
        for name, (help_text, labels) in METRICS.items():
            if name not in self._samples:
                continue
            family = GaugeMetricFamily(name, help_text, labels=list(labels))
            for values, value in self._samples[name]:
                family.add_metric([values.get(k, "") for k in labels], value)
            yield family


def textfile_requirement(verdict, pending):
    """(verdict, pending) of one judged host, where a textfile is to be written (``pending["textfile"]``) but
    prometheus_client is missing on the controller: nothing to write, and the WARN reason textfile_write_failed
    (the code of a failed write, roles/fleet_check/tasks/textfile.yml) that says what to install. Unchanged
    otherwise."""
    if HAS_PROMETHEUS_CLIENT or not (pending or {}).get("textfile"):
        return verdict, pending
    reason = {"severity": "WARN", "gpu": None, "code": "textfile_write_failed",
              "text": "%s/gpufleet.prom not written: the Python package prometheus-client is missing on the "
                      "controller (pip install -r requirements.txt of the gpufleet.fleet collection; an "
                      "execution environment built from it has it)" % pending["textfile"]}
    worse = max([verdict.get("verdict") or "OK", "WARN"], key=SEVERITY_RANK.get)
    return dict(verdict, verdict=worse, reasons=list(verdict.get("reasons") or []) + [reason]), \
        dict(pending, textfile="")


def gpufleet_check_prom(result, host, now_epoch=None):
    """node_exporter textfile (Prometheus text format 0.0.4, from prometheus_client) for one host's verdict;
    ``host`` is the ``Hostname`` label's value. The metrics and labels are :data:`METRICS`."""
    if not HAS_PROMETHEUS_CLIENT:
        raise ImportError("the Python package prometheus-client is needed on the controller to write the "
                          "textfile (pip install -r requirements.txt of the gpufleet.fleet collection)")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(metric_samples(result, str(host), now_epoch)))
    return generate_latest(registry).decode("utf-8")
