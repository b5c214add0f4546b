"""Grids of runs (experiments/sweep.py): windows partition the workload, a windowed compare
equals separate simulations of each window, bad grids fail clearly, and a Ray run (local
Ray, and a real `ray start --head` cluster by address) gives the same table as the local run.
The Ray tests skip with a message when the `ray` extra is not installed."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvsched.runner.simulate import simulate
from kvsched.envs.sim.errors import ConfigError
from kvsched.experiments.compare import aggregate, run_compare
from kvsched.runner.scenario import Scenario
from kvsched.runner.sweep import Cell, cell_workload, run_cells

SC = Scenario(name="tiny", trace=None, synthetic={"rate_per_s": 8.0, "duration_s": 12, "long_fraction": 0.1,
                                                   "long_min_tokens": 8192, "long_max_tokens": 16384},
              seed=3)


def test_windows_partition_the_workload_in_time_order():
    whole = SC.workload()
    parts = [cell_workload(Cell(SC, "fcfs", window=k, windows=3)) for k in range(3)]
    assert sum(len(p) for p in parts) == len(whole)
    ids = np.concatenate([p.request_id for p in parts])
    assert np.array_equal(ids, whole.request_id)
    for p in parts:  # rebased: each window starts at (or just after) 0
        assert p.arrival_s[0] >= 0 and p.arrival_s[0] < 12 / 3


def test_windowed_compare_equals_separate_simulations_of_each_window():
    res = run_compare(SC, ["fcfs", "lars"], seeds=1, windows=2)
    assert len(res.runs[res.runs["class"] == "all"]) == 4
    for k in range(2):
        w = cell_workload(Cell(SC, "fcfs", window=k, windows=2))
        direct = simulate(w, SC.instance_spec(), "lars", SC.metrics_config()).summary["classes"]["all"]
        row = res.runs[(res.runs.policy == "lars") & (res.runs.window == k) & (res.runs["class"] == "all")]
        assert row.ttft_p99_s.item() == direct["ttft_s"]["p99"]
        assert row.n.item() == len(w)
    agg = aggregate(res.runs).set_index(["policy", "class"])
    assert agg.loc[("fcfs", "all"), "seeds"] == 2  # runs averaged: 1 seed x 2 windows


@pytest.mark.parametrize("kw, msg", [
    ({"windows": 0}, "windows=0"),
    ({"windows": 2, "window": 2}, "window=2"),
    ({"windows": True}, "windows=True"),
])
def test_bad_cells_are_rejected(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        Cell(SC, "fcfs", **kw)


def test_bad_backend_and_address_are_rejected():
    cells = [Cell(SC, "fcfs")]
    with pytest.raises(ConfigError, match="backend='spark'"):
        run_cells(cells, backend="spark")
    with pytest.raises(ConfigError, match="only used with backend 'ray'"):
        run_cells(cells, address="127.0.0.1:6379")
    with pytest.raises(ConfigError, match="windows=0"):
        run_compare(SC, ["fcfs"], windows=0)


def test_too_many_windows_name_the_empty_window():
    tiny = SC.with_overrides(max_requests=2)
    with pytest.raises(ConfigError, match="window 1 of 50"):
        run_compare(tiny, ["fcfs"], windows=50)




def _need_ray():
    try:
        import ray  # noqa: F401
    except ImportError:
        pytest.skip("Ray is not installed (pip install -e '.[ray]'); skipping the Ray backend tests")


def _grid(**kw):
    return run_compare(SC, ["fcfs", "sarathi"], seeds=2, windows=2, **kw)


def test_ray_local_backend_gives_the_local_table():
    _need_ray()
    local = _grid()
    remote = _grid(backend="ray")
    pd.testing.assert_frame_equal(local.runs, remote.runs)
    assert list(local.records) == list(remote.records)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_cluster(temp_dir: str) -> None:
    """Stop the processes of the Ray cluster whose files are under ``temp_dir`` (its own
    --temp-dir), not every Ray cluster on the machine as `ray stop` would."""
    import psutil  # a Ray dependency

    procs = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in a for a in (p.info["cmdline"] or [])):
                procs.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=30)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


def test_an_address_nothing_answers_at_is_refused_at_once(capsys):
    """`ray.init(address=HOST:PORT)` with nothing listening retries for as long as one waits (a
    new user's compare ran for ten minutes); kvsched refuses the address after a TCP check."""
    import time

    from kvsched.experiments.cli import main
    from kvsched.runner.ray_connect import host_port

    _need_ray()
    port = _free_port()  # bound and closed again: nothing listens there
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=rf"--address='127.0.0.1:{port}': no Ray cluster answers there"):
        run_cells([Cell(SC, "fcfs")], backend="ray", address=f"127.0.0.1:{port}")
    scenario = Path(__file__).parents[2] / "experiments" / "scenarios" / "mixed-long-short.yaml"
    assert main(["compare", "--scenario", str(scenario), "--policies", "fcfs", "--max-requests", "20",
                 "--no-progress", "--backend", "ray", "--address", f"127.0.0.1:{port}"]) == 2
    assert "no Ray cluster answers there" in capsys.readouterr().err
    assert time.monotonic() - t0 < 60  # refused, not retried (a connection refused takes milliseconds)
    import ray
    assert not ray.is_initialized()
    assert host_port("ray://head.example:10001") == ("head.example", 10001)
    assert host_port("[::1]:6379") == ("::1", 6379) and host_port("auto") is None
    for bad in ("6379", "host:", "host:0", "host:70000", "host:port"):
        with pytest.raises(ConfigError, match="expected HOST:PORT"):
            host_port(bad)


def test_an_address_that_accepts_tcp_but_is_not_ray_and_a_bad_ray_address_are_refused(monkeypatch):
    """A port that accepts TCP but is not Ray (the dashboard's 8265, a web server) passed the TCP
    check and Ray then waited for its GCS forever (ray:// gave a ConnectionError traceback after
    30 s); RAY_ADDRESS, which Ray reads when no --address is given, was not checked at all."""
    import threading
    import time

    from kvsched.runner import ray_connect

    _need_ray()
    import ray

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.extend(server.accept() for _ in range(4)), daemon=True).start()
    try:
        t0 = time.monotonic()
        for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
            with pytest.raises(ConfigError, match=rf"--address='{address}': something accepts TCP connections "
                                                  "there but it is not a Ray cluster"):
                ray_connect.check_reachable(address, timeout_s=1.0)
        assert time.monotonic() - t0 < 20
    finally:
        server.close()
    free = _free_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{free}")
    with pytest.raises(ConfigError, match=rf"RAY_ADDRESS='127.0.0.1:{free}': no Ray cluster answers there.*unset "
                                          "RAY_ADDRESS"):
        ray_connect.init_ray(ray, None)
    assert not ray.is_initialized()


def test_a_real_ray_cluster_by_address_gives_the_local_table():
    _need_ray()
    temp_dir = tempfile.mkdtemp(prefix="kvray-", dir="/tmp")  # Ray's socket paths must stay < 108 bytes
    ray_bin = Path(sys.executable).with_name("ray")
    if not ray_bin.exists():
        ray_bin = shutil.which("ray")
        if ray_bin is None:
            pytest.skip("the `ray` command is not on PATH")
    port = _free_port()
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")  # loopback test cluster
    start = subprocess.run([str(ray_bin), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
                            "--num-cpus=2", "--include-dashboard=false", "--disable-usage-stats",
                            f"--temp-dir={temp_dir}"],
                           capture_output=True, text=True, env=env, timeout=180)
    if start.returncode != 0:
        pytest.skip(f"`ray start --head` failed here: {start.stderr[-500:]}")
    try:
        import ray
        remote = _grid(backend="ray", address=f"127.0.0.1:{port}")
        assert not ray.is_initialized()  # the driver disconnected again
    finally:
        _stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    local = _grid()
    pd.testing.assert_frame_equal(local.runs, remote.runs)


def test_address_auto_without_a_cluster_is_a_config_error():
    """`--address auto` with no Ray cluster on the machine: Ray's ConnectionError becomes a
    ConfigError naming the address (it was a traceback). A stand-in for Ray, so that a cluster
    another process runs on this machine cannot change the outcome."""
    from kvsched.runner.ray_connect import init_ray

    class NoCluster:
        @staticmethod
        def is_initialized():
            return False

        @staticmethod
        def init(**kw):
            raise ConnectionError("Could not find any running Ray instance. Please specify ...")

    with pytest.raises(ConfigError, match=r"--address='auto': Could not find any running Ray instance"):
        init_ray(NoCluster, "auto")
