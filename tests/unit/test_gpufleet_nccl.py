"""module_utils/gpufleet_nccl.py: which NCCL tuning values gpufleet refuses before they reach a worker.

The expectations come from NCCL's own parsers (parseList in src/graph/tuning.cc, ncclGetLevel in
src/graph/paths.cc, ncclLoadParam's strtoll in src/misc/param.cc, getNthreads, NCCL_DEBUG's options).
"""
import pytest

from ansible_collections.gpufleet.fleet.plugins.module_utils import gpufleet_nccl as N


@pytest.mark.parametrize("name, value", [
    ("NCCL_PROTO", "LL"),
    ("NCCL_PROTO", "ll,LL128"),            # names are case-insensitive (strcasecmp)
    ("NCCL_PROTO", "^LL128"),
    ("NCCL_PROTO", "Simple,"),             # strtok skips the empty token
    ("NCCL_PROTO", "AllReduce:LL;Broadcast:^Simple"),
    ("NCCL_PROTO", "LL;AllGather:Simple"),  # only the first entry may leave out the collective
    ("NCCL_PROTO", ""),                    # an empty value leaves NCCL's defaults
    ("NCCL_ALGO", "Ring"),
    ("NCCL_ALGO", "nvlstree,ring,PAT"),
    ("NCCL_ALGO", "allreduce:CollNetDirect,CollNetChain"),
    ("NCCL_P2P_LEVEL", "SYS"),
    ("NCCL_P2P_LEVEL", "NVL"),
    ("NCCL_P2P_LEVEL", "3"),               # old-style number
    ("NCCL_NET_GDR_LEVEL", "PHB"),
    ("NCCL_NTHREADS", "512"),
    ("NCCL_NTHREADS", "64"),
    ("NCCL_NTHREADS", "0x100"),
    ("NCCL_DEBUG", "info"),
    ("NCCL_MAX_NCHANNELS", "16"),
    ("NCCL_MAX_NCHANNELS", "0x10"),
    ("NCCL_BUFFSIZE", "16777216"),
    ("NCCL_NVLS_ENABLE", "0"),
    ("NCCL_CUMEM_ENABLE", "1"),
    ("NCCL_P2P_DISABLE", "-1"),            # a switch: any integer
    ("NCCL_IB_HCA", "=mlx5_0:1"),          # free text: not checked
    ("NCCL_SOCKET_IFNAME", "^lo,docker"),
    ("CUDA_DEVICE_MAX_CONNECTIONS", "anything"),
])
def test_values_nccl_takes_as_meant_pass(name, value):
    assert N.value_problem(name, value) is None


@pytest.mark.parametrize("name, value, words", [
    ("NCCL_PROTO", "5", ["'5' not known to NCCL", "LL, LL128, Simple", "ncclInvalidUsage"]),
    ("NCCL_PROTO", "LL,LL256", ["'LL256' not known"]),
    ("NCCL_PROTO", "^", ["names no protocol"]),
    ("NCCL_PROTO", "AllReduce:LL;Simple", ["only the first ';' entry may leave out the collective"]),
    ("NCCL_PROTO", "AllReduc:LL", ["'AllReduc' not known"]),
    ("NCCL_ALGO", "Ring,CollNet", ["'CollNet' not known", "CollNetDirect"]),
    ("NCCL_ALGO", "AllReduce:", ["names no algorithm"]),
    ("NCCL_P2P_LEVEL", "nvl", ["in capitals", "without a warning"]),
    ("NCCL_P2P_LEVEL", "NVLINK", ["LOC, NVL"]),
    ("NCCL_NTHREADS", "500", ["multiple of 32 from 64 to 512"]),
    ("NCCL_NTHREADS", "1024", ["multiple of 32"]),
    ("NCCL_NTHREADS", "32", ["multiple of 32"]),
    ("NCCL_DEBUG", "verbose", ["VERSION, WARN, INFO, ABORT, TRACE"]),
    ("NCCL_MAX_NCHANNELS", "abc", ["leading number", "'abc' is 0"]),
    ("NCCL_MAX_NCHANNELS", "0", ["must be 1 or more"]),
    ("NCCL_BUFFSIZE", "4M", ["leading number", "'4M' is 4"]),
    ("NCCL_BUFFSIZE", "09", ["leading number"]),    # octal to strtoll: reads 0, leaves "9"
    ("NCCL_BUFFSIZE", "16 ", ["leading number"]),       # strtoll stops at the space: text left over
    ("NCCL_CUMEM_ENABLE", "true", ["leading number"]),
])
def test_values_nccl_refuses_or_misreads_are_named_with_what_it_takes(name, value, words):
    problem = N.value_problem(name, value)
    assert problem and problem.startswith("%s=%r: " % (name, value))
    for word in words:
        assert word in problem


@pytest.mark.parametrize("text, number", [
    ("16", 16), ("+16", 16), ("-2", -2), ("0x1F", 31), ("010", 8), ("0", 0), ("00", 0),
    (" 16", 16), ("\t0x10", 16),                      # strtoll skips leading white space
    ("09", None), ("1e3", None), ("16 ", None), ("", None), ("0x", None), ("abc", None),
])
def test_strtoll_reads_what_c_reads_whole(text, number):
    assert N.strtoll(text) == number


def test_env_value_problems_lists_each_bad_value_and_skips_unchecked_names():
    items = [("NCCL_ALGO", "MyNewAlgo"), ("NCCL_PROTO", "5"), ("NCCL_P2P_LEVEL", "SYS"), ("NCCL_DEBUG", "x")]
    problems = N.env_value_problems(items)
    assert [p.split("=")[0] for p in problems] == ["NCCL_ALGO", "NCCL_PROTO", "NCCL_DEBUG"]
    assert [p.split("=")[0] for p in N.env_value_problems(items, unchecked=["NCCL_ALGO", "NCCL_DEBUG"])] == ["NCCL_PROTO"]


def test_an_nccl_name_in_lower_case_is_named_because_nccl_never_reads_it():
    names = ["nccl_proto", "Nccl_Algo", "NCCL_PROTO", "my_var"]
    assert [N.name_problem(n) for n in names] == [
        "nccl_proto: NCCL reads NCCL_PROTO (capitals) and never looks at nccl_proto",
        "Nccl_Algo: NCCL reads NCCL_ALGO (capitals) and never looks at Nccl_Algo", None, None]
    assert N.env_value_problems([("nccl_proto", "5")]) == []  # its value is nobody's: the name is the problem
