"""Starting the multi-process tests' ranks from a pre-imported server instead of a fresh interpreter each.

Why: a rank's ``python script.py`` spends most of its start importing third-party modules: about 12 s of CPU
for ``import lightning_async_pp`` here, of which torch takes ~3.7 s and torchmetrics (which Lightning imports;
it pulls torchvision and transformers) ~8 s, while Lightning and this package add ~1 s after them. Every rank
of every multi-process test paid this, on two cores.

How: one ``multiprocessing`` fork server per pytest session, started with the launch's environment less the
per-run variables (:data:`PER_RUN`), has imported :data:`PRELOAD` (modules that read no rank variable at import:
Lightning, whose ``rank_zero_only.rank`` comes from ``LOCAL_RANK``, is left to each rank). Each rank is a fork
of it that makes itself what ``python script.py args`` would be (:func:`_run_script`): the given environment,
working directory, ``sys.argv``, ``sys.path``, stdout/stderr files, ``__main__``, freshly seeded ``random``,
numpy and torch generators; exit code, atexit handlers and the traffic recorder (tests/traffic_hook) as in a fresh
interpreter. What stays the server's: the modules already imported and the string hash seed (``PYTHONHASHSEED``).
A launch whose import-time environment differs from the server's (:func:`_key`), a server that could not start or
runs threads, or ``LIGHTNING_ASYNC_PP_TEST_FORK=0``: plain subprocesses.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import multiprocessing
import multiprocessing.process
import os
import random
import runpy
import subprocess
import sys
import threading
import traceback
import warnings
from pathlib import Path
from typing import Optional

OPT_OUT_ENV = "LIGHTNING_ASYNC_PP_TEST_FORK"
PRELOAD = ("torch", "torch.distributed.distributed_c10d", "torchmetrics", "torchmetrics.functional",
           "torchvision", "transformers")
#: Variables each launch sets for itself, read after the imports (rendezvous, seeds, traffic recording): not part
#: of the server's environment nor of the key.
PER_RUN = frozenset({"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK",
                     "LOCAL_WORLD_SIZE", "GROUP_RANK", "PL_GLOBAL_SEED", "PL_SEED_WORKERS", "PYTEST_CURRENT_TEST",
                     "LIGHTNING_ASYNC_PP_TRAFFIC", "LIGHTNING_ASYNC_PP_STRICT_TAGS", OPT_OUT_ENV})
#: Variables torch and Lightning set in the pytest process itself while tests run (the inductor's cache folder,
#: Lightning's CUDA check) and read only when used: a launch's own value reaches its ranks with the rest of its
#: environment, so they are not part of the key (else every launch after the first test that set them would start
#: plain processes, as the whole suite's run showed).
SET_WHILE_TESTING = frozenset({"TORCHINDUCTOR_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK", "TOKENIZERS_PARALLELISM",
                               # set by the inductor as it compiles (its worker pool, cache, OpenMP probe)
                               "TORCH_WARM_POOL", "TRITON_CACHE_DIR", "KMP_DUPLICATE_LIB_OK"})
_HOOK = Path(__file__).parent / "traffic_hook"


class Rank:
    """A started rank: ``pid``, ``wait(timeout)`` (raises ``subprocess.TimeoutExpired``), ``kill()``,
    ``returncode`` (negative: killed by that signal), as ``subprocess.Popen``."""

    def __init__(self, process: multiprocessing.Process, cmd: list[str]) -> None:
        self._process, self._cmd = process, cmd
        self.pid = process.pid

    @property
    def returncode(self) -> Optional[int]:
        return self._process.exitcode

    def poll(self) -> Optional[int]:
        return self._process.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self._cmd, timeout)
        return self._process.exitcode

    def kill(self) -> None:
        if self._process.exitcode is None:
            self._process.kill()


def start(cmd: list[str], cwd: Path, env: dict, stdout: str, stderr: str):
    """``cmd`` (``[python, script.py, *args]``) started like ``subprocess.Popen`` writing to the files named
    ``stdout``/``stderr``: forked from the server where it can be, else a plain subprocess."""
    server = _server_for(cmd, env)
    if server is None:
        with open(stdout, "w") as out, open(stderr, "w") as err:
            return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
    process = server.context.Process(target=_run_script, daemon=False, args=(
        cmd[1], cmd[2:], dict(env), str(cwd), stdout, stderr, server.sys_path))
    with _environ(server.env):  # should multiprocessing restart a dead server, with the server's environment
        process.start()
    return Rank(process, cmd)


class _Server:
    """The session's fork server, for launches whose :func:`_key` is ``key``; ``usable`` once it has imported
    :data:`PRELOAD` with no thread but the main one."""

    def __init__(self, key: tuple, env: dict) -> None:
        self.key, self.env = key, env
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload([__name__, *PRELOAD])
        # What ``python script.py`` has on sys.path after the script's folder, under this environment (the
        # server itself runs with pytest's).
        self.sys_path = json.loads(subprocess.run(
            [sys.executable, "-c", "import sys, json; print(json.dumps(sys.path[1:]))"], env=env,
            capture_output=True, text=True, check=True).stdout)
        from multiprocessing import forkserver
        with _environ(env):  # the server (and multiprocessing's resource tracker) inherit this environment
            forkserver.ensure_running()
            probe = self.context.Process(target=os._exit, args=(0,))  # returns once the server has imported
            probe.start()
            probe.join()
        # Forking a process with other threads running can deadlock the child (a lock held by a thread that
        # is not copied): the server must have one thread after the imports (OMP_NUM_THREADS=1 keeps OpenBLAS's
        # pool from starting).
        threads = len(os.listdir(f"/proc/{forkserver._forkserver._forkserver_pid}/task"))
        self.usable = probe.exitcode == 0 and threads == 1
        if not self.usable:
            warnings.warn(f"tests/launcher.py: the fork server has {threads} threads; ranks start as processes")


_server = None  # the _Server, or False where it could not start


@contextlib.contextmanager
def _environ(env: dict):
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


#: The variables a preloaded import can read: the interpreter's, the thread runtimes', torch's and Hugging Face's.
#: Only these make up the key: tests and the libraries they run set others in the pytest process as they go (the
#: whole suite's run fell back to plain processes after the first such test), which a rank reads, if at all, from
#: its own environment when it runs.
IMPORT_TIME_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "GOTO", "TORCH", "PYTORCH", "CUDA", "NCCL",
                        "NVIDIA", "HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "TRITON", "LD_")


def _server_env(env: dict) -> dict:
    """The launch's environment less its per-run variables, the path deduplicated (as ``site`` does)."""
    rest = {k: v for k, v in env.items() if k not in PER_RUN}
    rest["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(filter(None, rest.get("PYTHONPATH", "").split(os.pathsep))))
    return rest


def _key(cmd: list[str], env: dict) -> tuple:
    """What a preloaded import could have read: the interpreter and the import-time variables."""
    rest = {k: v for k, v in _server_env(env).items()
            if k.startswith(IMPORT_TIME_PREFIXES) and k not in SET_WHILE_TESTING}
    # The traffic hook's folder: each rank installs the recorder from its own environment (_run_script).
    rest["PYTHONPATH"] = os.pathsep.join(p for p in rest["PYTHONPATH"].split(os.pathsep) if p != str(_HOOK))
    return (cmd[0], tuple(sorted(rest.items())))


def _server_for(cmd: list[str], env: dict) -> Optional[_Server]:
    global _server
    if os.environ.get(OPT_OUT_ENV, "1") == "0" or cmd[0] != sys.executable or len(cmd) < 2 \
            or cmd[1].startswith("-") or sys.platform != "linux":
        return None
    key = _key(cmd, env)
    if _server is None:  # one server per session, for the first launch's environment
        try:
            _server = _Server(key, _server_env(env))
        except Exception as e:  # no server: every launch a plain process
            warnings.warn(f"tests/launcher.py: no fork server ({e!r}); ranks start as processes")
            _server = False
    if not (_server and _server.usable):
        return None
    if _server.key != key:
        _warn_environment_differs(_server.key, key)
        return None
    return _server


_differences_warned: set = set()


def _warn_environment_differs(server_key: tuple, key: tuple) -> None:
    """Once per set of variables: a launch whose environment differs from the server's is correct (a plain
    process) but pays the imports again; the warning names the variables so the suite's speed cannot leak away
    unnoticed."""
    server, launch = dict(server_key[1]), dict(key[1])
    names = tuple(sorted(k for k in server.keys() | launch.keys() if server.get(k) != launch.get(k)))
    if server_key[0] != key[0]:
        names = ("<interpreter>", *names)
    if names not in _differences_warned:
        _differences_warned.add(names)
        warnings.warn(f"tests/launcher.py: this launch's environment differs from the fork server's in {names}; "
                      "its ranks start as plain processes")


def _exit_code(code) -> int:
    """The exit status ``python`` gives ``SystemExit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _run_script(script: str, args: list[str], env: dict, cwd: str, stdout: str, stderr: str,
                sys_path: list[str]) -> None:
    """In the forked child: become ``python script *args`` and exit as it would."""
    multiprocessing.process._parent_process = None  # not a multiprocessing child, as far as the script can tell
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, stdout), (2, stderr)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    # A fresh interpreter seeds these (torch too) from the OS; forks would all share the server's state.
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    sys.argv = [script, *args]
    sys.path[:] = [os.path.dirname(os.path.abspath(script)), *sys_path]
    _install_traffic_recorder(env)
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException as e:
        tb = e.__traceback__  # from the script's own frame on, as python prints it (not runpy's and ours)
        while tb is not None and tb.tb_frame.f_code.co_filename != script:
            tb = tb.tb_next
        e.with_traceback(tb or e.__traceback__)
        sys.excepthook(type(e), e, e.__traceback__)  # the recorder's hook notes the unclean exit
        code = 1
    # What the interpreter does at exit: wait for non-daemon threads, run atexit handlers, flush stdio.
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def _install_traffic_recorder(env: dict) -> None:
    """What tests/traffic_hook/sitecustomize does at a fresh interpreter's start, for a process whose
    ``torch.distributed`` was imported by the server before the recorder could hook its import."""
    directory = env.get("LIGHTNING_ASYNC_PP_TRAFFIC")
    if not directory or str(_HOOK) not in env.get("PYTHONPATH", "").split(os.pathsep):
        return
    import importlib.util
    spec = importlib.util.spec_from_file_location("_lightning_async_pp_traffic", _HOOK.parent / "traffic.py")
    traffic = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = traffic
    spec.loader.exec_module(traffic)
    traffic.install(directory, env.get("LIGHTNING_ASYNC_PP_STRICT_TAGS", "0") == "1")
    traffic.rebind_imported()
