"""tests/launcher.py: a rank forked from the pre-imported server behaves as ``python script.py`` would."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import launcher
from pipeline_runs import rank_env, run_ranks

pytestmark = pytest.mark.multiprocess

SCRIPT = textwrap.dedent("""
    import atexit, json, os, sys, warnings
    what = sys.argv[1]
    rank = int(os.environ["LOCAL_RANK"])
    atexit.register(lambda: open(f"atexit{rank}", "w").write("ran"))
    print(json.dumps(dict(argv=sys.argv, cwd=os.getcwd(), path0=sys.path[0], main=__name__, rank=rank,
                          torch="torch" in sys.modules,
                          lightning="lightning" in sys.modules, path=[p for p in sys.path if p != sys.path[0]],
                          parent=__import__("multiprocessing").parent_process() is not None,
                          random=__import__("random").random())))
    print("to stderr", file=sys.stderr)
    if what == "exit":
        sys.exit(3 + rank)
    if what == "message":
        sys.exit("a message")
    if what == "raise":
        raise RuntimeError("boom")
    if what == "hang":
        import time
        time.sleep(600)
""")


def _run(tmp_path: Path, what: str, fork: bool, timeout: float = 120):
    script = tmp_path / "scripts" / "probe.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(SCRIPT)
    cwd = tmp_path / f"cwd-{what}-{fork}"
    cwd.mkdir()
    saved = os.environ.get(launcher.OPT_OUT_ENV)
    os.environ[launcher.OPT_OUT_ENV] = "1" if fork else "0"
    try:
        proc = run_ranks([sys.executable, str(script), what], 2, cwd, rank_env(), timeout)
    finally:
        if saved is None:
            os.environ.pop(launcher.OPT_OUT_ENV)
        else:
            os.environ[launcher.OPT_OUT_ENV] = saved
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc, lines, cwd


@pytest.mark.traffic_unchecked("the probe script uses no torch.distributed")
@pytest.mark.parametrize("what", ["ok", "exit", "message", "raise"])
def test_a_forked_rank_behaves_as_a_fresh_interpreter(tmp_path, what):
    forked, seen, cwd = _run(tmp_path, what, fork=True)
    fresh, expected, fresh_cwd = _run(tmp_path, what, fork=False)
    assert launcher._server and launcher._server.usable, "the server was not used"
    assert forked.returncode == fresh.returncode == {"ok": 0, "exit": 3, "message": 1, "raise": 1}[what]
    assert seen[0]["random"] != seen[1]["random"]  # each rank seeded afresh, not the server's state
    for got, want in zip(seen, expected, strict=True):
        assert got.pop("torch") and not want.pop("torch")  # forked: torch already imported; nothing else differs
        assert got.pop("cwd") == str(cwd) and want.pop("cwd") == str(fresh_cwd)
        got.pop("random"), want.pop("random")
        assert got == want
    assert [line for line in forked.stderr.splitlines() if "File " not in line] \
        == [line for line in fresh.stderr.splitlines() if "File " not in line]
    assert not seen[0]["lightning"] and not seen[0]["parent"]
    for rank in range(2):  # atexit handlers ran in both
        assert (cwd / f"atexit{rank}").read_text() == (fresh_cwd / f"atexit{rank}").read_text() == "ran"


@pytest.mark.traffic_unchecked("the probe script uses no torch.distributed")
def test_a_timed_out_forked_rank_is_killed(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        _run(tmp_path, "hang", fork=True, timeout=5)


@pytest.mark.traffic_unchecked("the probe script uses no torch.distributed")
@pytest.mark.parametrize("fork", [True, False], ids=["forked", "fresh"])
@pytest.mark.parametrize("other", ["", "other-environment", "set-while-testing"])
def test_a_killed_rank_has_the_signals_negative_return_code(tmp_path, monkeypatch, fork, other):
    """As ``subprocess.Popen``; a launch whose import-time environment differs from the server's gets a plain
    process, one that differs in variables tests, torch and Lightning set in the test process while tests run (read
    when used, not at import) does not: the whole suite's first runs fell back to plain processes after the first
    test that set one."""
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    monkeypatch.setenv(launcher.OPT_OUT_ENV, "1" if fork else "0")
    extra = {"": {}, "other-environment": {"OMP_WAIT_POLICY": "passive"},  # read as the OpenMP runtime loads
             "set-while-testing": {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
                                   "PYTORCH_NVML_BASED_CUDA_CHECK": "1", "SOMETHING_ELSE": "1"}}[other]
    env = rank_env(LOCAL_RANK="0", **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the other environment's warning is the point, not a failure
        proc = launcher.start([sys.executable, str(script), "hang"], tmp_path, env, str(tmp_path / "out"),
                              str(tmp_path / "err"))
    assert isinstance(proc, launcher.Rank) == (fork and other != "other-environment")
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.5)
    assert proc.returncode is None
    proc.kill()
    assert proc.wait(timeout=60) == proc.returncode == -signal.SIGKILL


DIST_SCRIPT = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    print(torch.initial_seed())
    dist.init_process_group("gloo", rank=int(os.environ["LOCAL_RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    t = torch.ones(3) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    if dist.get_rank() == 0:
        dist.send(t, 1)
    else:
        dist.recv(t, 0)
    dist.destroy_process_group()
""")


def test_a_forked_rank_records_its_traffic(tmp_path):
    """The server imported torch.distributed without the recorder: each rank installs it."""
    script = tmp_path / "dist.py"
    script.write_text(DIST_SCRIPT)
    proc = run_ranks([sys.executable, str(script)], 2, tmp_path, rank_env(), 120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seeds = proc.stdout.split()
    assert len(set(seeds)) == 2, seeds  # torch seeded afresh in each rank, as at a fresh interpreter's start
    recorded = sorted(Path(os.environ["LIGHTNING_ASYNC_PP_TRAFFIC"]).glob("traffic-*.jsonl"))
    assert len(recorded) == 2, recorded
    events = [json.loads(line) for path in recorded for line in path.read_text().splitlines()]
    assert sorted(e["rank"] for e in events if e["e"] == "job") == [0, 1]
    assert sum(e["e"] == "exit" and e["clean"] for e in events) == 2
    assert any("all_reduce" in json.dumps(e) for e in events) and any("send" in json.dumps(e) for e in events)
