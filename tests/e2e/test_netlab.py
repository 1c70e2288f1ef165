"""The emulated-cluster tooling (launch/netlab): shaping works, traffic stays inside, it always cleans up.

Brings up 2-host labs under a prefix of its own (never the benchmarks' ``zenb-``), runs a 2-rank
``TorchCommunicator.exchange_v`` over a 100 Mbit/s link and checks values, bytes and a time lower
bound that only a shaped link can produce (loopback would take ~1 ms), then that the namespaces are
gone — also after a failing rank and after a timeout. Needs root and ``ip netns`` with tbf; skipped
otherwise, with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NETLAB = os.path.join(ROOT, "launch", "netlab", "netlab.sh")
LAUNCH = os.path.join(ROOT, "launch", "netlab", "launch.sh")
PREFIX = f"zt{os.getpid() % 100000}-"
ENV = {**os.environ, "NETLAB_PREFIX": PREFIX, "NETLAB_SUBNET": "10.78.0", "NETLAB_PYTHON": sys.executable}
RATE_BPS = 100e6
PAYLOAD_BYTES = 1 << 20  # per peer, fp32


def _lab_support() -> str | None:
    """Why the lab cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "needs iproute2 (ip, tc)"
    probe = f"{PREFIX}probe"
    try:
        r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=20)
        if r.returncode:
            return f"`ip netns add` failed: {r.stderr.strip()}"
        subprocess.run(["ip", "-n", probe, "link", "set", "lo", "up"], check=True, timeout=20)
        r = subprocess.run(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1mbit",
                            "burst", "32k", "limit", "64k"], capture_output=True, text=True, timeout=20)
        if r.returncode:
            return f"no tbf qdisc: {r.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=20)
    return None


_REASON = _lab_support()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"netlab: {_REASON}")


def _our_namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


@pytest.fixture(autouse=True)
def _always_down():
    yield
    subprocess.run(["bash", NETLAB, "down"], env=ENV, capture_output=True, timeout=60)


def _launch(tmp_path, program: str, *opts: str, timeout_s: int = 240) -> subprocess.CompletedProcess:
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(program))
    return subprocess.run(["bash", LAUNCH, "-n", "2", "-r", "100mbit", "--logdir", str(tmp_path / "logs"), *opts,
                           "--", str(script), str(tmp_path / "result.json")],
                          env=ENV, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)


EXCHANGE = f"""
    import json, os, sys, socket
    sys.path.insert(0, os.path.join({ROOT!r}, "benchmarks", "cluster"))
    import torch, torch.distributed as dist
    from cluster_common import Lab, SpanProbe, finish_process, init_from_env
    from zen_ext.comm.torch_dist import TorchCommunicator

    rank, n = init_from_env()
    lab = Lab.from_env()
    comm = TorchCommunicator(exchange_impl="p2p")
    k = {PAYLOAD_BYTES} // 4
    send = [torch.full((k,), float(1000 * rank + j)) for j in range(n)]
    comm.exchange_v(send)  # warm-up: connections
    dist.barrier()
    before = comm.stats.snapshot()
    probe = SpanProbe(lab)
    recv = comm.exchange_v(send)
    d = comm.stats - before
    rec = probe.finish(extra=[d.bytes_sent])
    ok = all(bool((recv[j] == float(1000 * j + rank)).all()) and recv[j].numel() == k for j in range(n))
    # no route leaves the lab: any outside address is unreachable from a host namespace
    s = socket.socket()
    try:
        s.connect(("192.0.2.1", 9))
        outside = "connected"
    except OSError as exc:
        outside = exc.errno
    oks = [None] * n
    dist.all_gather_object(oks, (ok, outside))
    if rank == 0:
        json.dump(dict(rec, oks=oks, rate=lab.rate, goodput=lab.goodput, logical_sent=rec["extra"]),
                  open(sys.argv[1], "w"))
    finish_process(0)
"""


def test_shaped_exchange_values_bytes_time_and_teardown(tmp_path):
    r = _launch(tmp_path, EXCHANGE)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _our_namespaces() == []
    assert not os.path.exists(f"/run/netlab-{PREFIX[:-1]}")
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["rate"] == "100mbit"
    for ok, outside in res["oks"]:
        assert ok, "exchanged values differ"
        assert outside == 101, f"an outside address must be unreachable (ENETUNREACH), got {outside}"
    # Logical bytes: one int64 count and one payload to the single peer.
    assert [int(x[0]) for x in res["logical_sent"]] == [8 + PAYLOAD_BYTES] * 2
    # Wire bytes: the payload plus TCP/IP framing (< 5 %) and gloo's small messages.
    for tx in res["wire_tx"]:
        assert PAYLOAD_BYTES <= tx <= 1.06 * PAYLOAD_BYTES + 65536, tx
    # Time: the shaped link's goodput bounds it from below; only tbf's first burst (128 KiB) may pass
    # unshaped. Unshaped veths would finish in ~1 ms.
    goodput = RATE_BPS / 8 * (1500 - 52) / (1500 + 14)
    assert res["goodput"] == pytest.approx(goodput)
    assert res["span"] >= (PAYLOAD_BYTES - 131072) / goodput * 0.95, res["span"]


PER_HOST = f"""
    import json, os, sys
    sys.path.insert(0, os.path.join({ROOT!r}, "benchmarks", "cluster"))
    import torch, torch.distributed as dist
    from cluster_common import iface_bytes, finish_process, init_from_env
    from zen_ext.reduction.hierarchy import decide_hierarchy, local_host_facts

    rank, n = init_from_env()
    env = {{k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE",
                                           "ZEN_EXT_HOST", "NETLAB_NHOSTS", "NETLAB_PROCS_PER_HOST")}}
    print("env", env, flush=True)
    x = torch.full((1000,), float(rank + 1))
    dist.all_reduce(x)
    # One payload to the other process of the same host, then one to a process of the other host; the
    # bytes host 0's shaped interface sent during each.
    k = {PAYLOAD_BYTES} // 4
    wire = []
    for peer in (1, 2):
        dist.barrier()
        tx0 = iface_bytes("zeth")[0]
        if rank == 0:
            dist.send(torch.ones(k), peer)
        elif rank == peer:
            buf = torch.empty(k)
            dist.recv(buf, 0)
            assert bool((buf == 1).all())
        dist.barrier()
        wire.append(iface_bytes("zeth")[0] - tx0)
    facts = [None] * n
    dist.all_gather_object(facts, local_host_facts())
    layouts, why = decide_hierarchy(True, [h for h, _ in facts], [list(range(n))], [lr for _, lr in facts])
    got = [None] * n
    dist.all_gather_object(got, (env, float(x[0]), bool((x == x[0]).all()), wire, why))
    if rank == 0:
        json.dump(got, open(sys.argv[1], "w"))
    finish_process(0)
"""


def test_procs_per_host_env_loopback_inside_a_host_and_hierarchy(tmp_path):
    r = _launch(tmp_path, PER_HOST, "-p", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "all 4 ranks (2 hosts × 2) finished OK" in r.stderr
    assert _our_namespaces() == []
    got = json.loads((tmp_path / "result.json").read_text())
    assert len(got) == 4
    for rank, (env, total, same, wire, why) in enumerate(got):
        host, local = divmod(rank, 2)
        assert env == {"RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": "2",
                        "LOCAL_SIZE": "2", "ZEN_EXT_HOST": f"{PREFIX}h{host}", "NETLAB_NHOSTS": "2",
                        "NETLAB_PROCS_PER_HOST": "2"}
        assert total == 1 + 2 + 3 + 4 and same
        assert why == "2 nodes of 2 ranks per data-parallel group"
    # Host 0's shaped interface: nearly nothing while rank 0 sends to rank 1 (same namespace: loopback),
    # the payload while it sends to rank 2 (the other host).
    wire_same, wire_other = got[0][3]
    assert wire_same < 65536, wire_same
    assert PAYLOAD_BYTES <= wire_other <= 1.06 * PAYLOAD_BYTES + 65536, wire_other


def test_one_proc_per_host_env_is_unchanged(tmp_path):
    prog = """
        import json, os, sys
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "ZEN_EXT_HOST",
                "NETLAB_PROCS_PER_HOST")
        json.dump({k: os.environ.get(k) for k in keys}, open(sys.argv[1] + os.environ["RANK"], "w"))
    """
    r = _launch(tmp_path, prog, "-p", "1", timeout_s=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "all 2 ranks finished OK" in r.stderr
    for rank in range(2):
        env = json.loads((tmp_path / f"result.json{rank}").read_text())
        assert env == {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                        "LOCAL_SIZE": os.environ.get("LOCAL_SIZE"), "ZEN_EXT_HOST": os.environ.get("ZEN_EXT_HOST"),
                        "NETLAB_PROCS_PER_HOST": None}


def test_failing_rank_stops_the_others_and_tears_down(tmp_path):
    prog = """
        import os, sys, time
        if os.environ["RANK"] == "1":
            sys.exit(3)
        time.sleep(120)
    """
    r = _launch(tmp_path, prog, timeout_s=120)
    assert r.returncode == 3
    assert "rank 1 exited with 3" in r.stderr
    assert _our_namespaces() == []


def test_timeout_kills_ranks_and_tears_down(tmp_path):
    prog = """
        import time
        time.sleep(120)
    """
    r = _launch(tmp_path, prog, "--timeout", "2", timeout_s=120)
    assert r.returncode == 124  # timeout(1)'s status, passed on by the launcher
    assert _our_namespaces() == []


def test_down_removes_only_its_own_prefix():
    other = {**ENV, "NETLAB_PREFIX": PREFIX[:-1] + "x-"}
    try:
        subprocess.run(["bash", NETLAB, "up", "-n", "1", "-r", "none"], env=other, check=True, capture_output=True,
                       timeout=60)
        subprocess.run(["bash", NETLAB, "up", "-n", "2", "-r", "10mbit"], env=ENV, check=True, capture_output=True,
                       timeout=60)
        assert sorted(_our_namespaces()) == [f"{PREFIX}h0", f"{PREFIX}h1", f"{PREFIX}sw"]
        subprocess.run(["bash", NETLAB, "down"], env=ENV, check=True, capture_output=True, timeout=60)
        assert _our_namespaces() == []
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
        assert f"{PREFIX[:-1]}x-h0" in out  # the other lab is untouched
    finally:
        subprocess.run(["bash", NETLAB, "down"], env=other, capture_output=True, timeout=60)


def test_rejects_public_subnet_and_bad_prefix():
    r = subprocess.run(["bash", NETLAB, "up", "-n", "2", "-r", "1gbit"], env={**ENV, "NETLAB_SUBNET": "8.8.8"},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "must be a private range" in r.stderr
    r = subprocess.run(["bash", NETLAB, "down"], env={**ENV, "NETLAB_PREFIX": "bad/prefix"}, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode != 0 and "NETLAB_PREFIX" in r.stderr
