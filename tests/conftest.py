"""Every test marked ``multiprocess`` records its processes' traffic and fails where it breaks NCCL's rules.

The processes a test starts inherit ``LIGHTNING_ASYNC_PP_TRAFFIC`` (a fresh directory per test) and ``PYTHONPATH``
with ``tests/traffic_hook`` first, whose ``sitecustomize`` installs the recorder (tests/traffic.py) in each of
them (a rank forked from tests/launcher.py's server, whose torch was imported before, installs it itself;
``LIGHTNING_ASYNC_PP_TEST_FORK=0`` starts fresh interpreters instead); ``LIGHTNING_ASYNC_PP_STRICT_TAGS=1``
(unless set otherwise) replaces tags by per-pair sequence numbers, so gloo pairs messages by position as NCCL
does. After the test, every job whose ranks all exited cleanly is replayed
under NCCL's rules (``traffic.check``).

``LIGHTNING_ASYNC_PP_TRAFFIC_CHECK``: ``fail`` (default) fails the test with the violations, ``report`` prints
them at the end of the session instead, ``off`` records nothing. A test whose runs all end in deliberate failures
(no job with every rank exiting cleanly) needs ``@pytest.mark.traffic_unchecked("why")``.

Processes started by a module-scoped fixture (one run shared by several tests) record into the module's own
directory, set up before any fixture of that scope; a test that started no process of its own is checked against
what its module's fixtures recorded.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

import traffic

CHECK_ENV = "LIGHTNING_ASYNC_PP_TRAFFIC_CHECK"
_MODES = ("fail", "report", "off")
_HOOK = Path(__file__).parent / "traffic_hook"
_DIRECTORY = pytest.StashKey[Path]()
_MODULE_DIRECTORY = pytest.StashKey[Path]()
_ANALYSES = pytest.StashKey[dict]()
_REPORTS = pytest.StashKey[list]()


def _mode() -> str:
    mode = os.environ.get(CHECK_ENV, "fail")
    if mode not in _MODES:
        raise pytest.UsageError(f"{CHECK_ENV}={mode!r}; use one of {', '.join(_MODES)}")
    return mode


def pytest_configure(config: pytest.Config) -> None:
    _mode()
    config.stash[_REPORTS] = []
    config.stash[_ANALYSES] = {}


def _recording_env(monkeypatch: pytest.MonkeyPatch, directory: Path) -> None:
    monkeypatch.setenv(traffic.TRAFFIC_ENV, str(directory))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(_HOOK), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv(traffic.STRICT_TAGS_ENV, os.environ.get(traffic.STRICT_TAGS_ENV, "1"))


@pytest.fixture(scope="module", autouse=True)
def _record_module_traffic(request: pytest.FixtureRequest, tmp_path_factory) -> None:
    # Autouse fixtures come first within their scope, so a module fixture's processes find this set.
    items = [i for i in request.session.items if i.module is request.module]
    if _mode() == "off" or not any(i.get_closest_marker("multiprocess") for i in items):
        yield
        return
    directory = tmp_path_factory.mktemp("traffic-module")
    with pytest.MonkeyPatch.context() as monkeypatch:
        _recording_env(monkeypatch, directory)
        for item in items:
            item.stash[_MODULE_DIRECTORY] = directory
        yield


@pytest.fixture(autouse=True)
def _record_traffic(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path_factory) -> None:
    if request.node.get_closest_marker("multiprocess") is None or _mode() == "off":
        yield
        return
    directory = tmp_path_factory.mktemp("traffic")
    _recording_env(monkeypatch, directory)
    request.node.stash[_DIRECTORY] = directory
    yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    directory = item.stash.get(_DIRECTORY, None)
    try:
        result = yield
    except BaseException:  # the test failed by itself: what its traffic shows goes beside its own error
        if directory is not None:
            _explain(item, directory)
        raise
    if directory is not None:
        _check(item, directory)
    return result


def _explain(item: pytest.Item, directory: Path) -> None:
    lines = []
    for job in traffic.load(directory):
        if job.complete:
            found = traffic.check_job(job)
        else:
            found = traffic.check_prefix(job)
            lines.append(f"{job.describe()} did not end cleanly ({job.why_incomplete()}); what its ranks issued:")
        lines += [f"- {v}" for v in found]
    if lines:
        item.add_report_section("call", "traffic under NCCL's rules", "\n".join(lines))


def _analyze(item: pytest.Item, directory: Path) -> traffic.Analysis:
    """What the test's own processes recorded; where it started none, what its module's fixtures recorded (each
    set of files replayed once, however many tests share it)."""
    if not any(directory.glob("traffic-*.jsonl")) and _MODULE_DIRECTORY in item.stash:
        directory = item.stash[_MODULE_DIRECTORY]
    key = (directory, tuple(sorted(p.name for p in directory.glob("traffic-*.jsonl"))))
    cache = item.config.stash[_ANALYSES]
    if key not in cache:
        cache[key] = traffic.analyze(directory)
    return cache[key]


def _check(item: pytest.Item, directory: Path) -> None:
    analysis = _analyze(item, directory)
    problems = list(analysis.violations)
    unchecked = item.get_closest_marker("traffic_unchecked")
    if not analysis.complete_jobs and unchecked is None:
        seen = "; ".join(f"{j.describe()}: {j.why_incomplete()}" for j in analysis.jobs) or "no process recorded"
        problems.append(f"no complete job recorded ({seen}); a test whose runs all fail on purpose needs "
                        f"@pytest.mark.traffic_unchecked(\"why\")")
    text = (f"{len(problems)} problem(s) in the recorded traffic under NCCL's rules ({directory}):\n"
            + "\n".join(f"- {p}" for p in problems))
    if _mode() == "report" and (problems or analysis.host_reads):
        reads = ", ".join(f"{n} at {at}" for at, n in analysis.host_reads.most_common(5))
        item.config.stash[_REPORTS].append((item.nodeid, text + (
            f"\nhost reads of received tensors ({sum(analysis.host_reads.values())}): {reads}" if reads else "")))
    elif problems:
        pytest.fail(text, pytrace=False)


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    reports = config.stash.get(_REPORTS, [])
    if reports:
        terminalreporter.section("traffic under NCCL's rules (LIGHTNING_ASYNC_PP_TRAFFIC_CHECK=report)")
        for nodeid, text in reports:
            terminalreporter.write_line(f"{nodeid}: {text}")
