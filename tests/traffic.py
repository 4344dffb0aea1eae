"""Recording the traffic of multi-process tests and replaying it under NCCL's rules.

### What is recorded

Every multi-process test runs with gloo on CPU, where tags match messages and every transfer progresses on its
own; NCCL ignores tags and runs each stream's ops in issue order. To prove on CPU that the pipeline is right under
NCCL, each process of a multi-process test records its ``torch.distributed`` traffic (``install``; the
``sitecustomize`` in ``tests/traffic_hook/`` installs it in every subprocess when ``LIGHTNING_ASYNC_PP_TRAFFIC``
names a directory, and ``tests/conftest.py`` does that for every test marked ``multiprocess``):

- every point-to-point op (``isend``, ``irecv``, ``send``, ``recv``; a ``batch_isend_irecv`` as one unit holding
  its ops) and every collective (``all_reduce``, ``broadcast``, ``all_gather*``, ``reduce*``, ``gather``,
  ``scatter``, ``barrier``, the ``*_object`` ones, ``all_to_all*``, ``monitored_barrier``; only the outermost
  call, so ``all_gather_object`` is one collective, not the ``all_gather`` it makes), and the functional
  collectives of ``torch.distributed._functional_collectives`` that DTensor's redistributions issue (tensor
  parallelism: ``funcol.all_reduce``, ``all_gather_single``, ``reduce_scatter_single``, ...; each taken as waited
  at once, as the stream that uses its result waits for it), in issue order: kind, peer
  (global rank), tag, shape, dtype, process group (its name, equal on all ranks, and its ranks), an op id, the
  issuing thread and the caller (the innermost frames in ``lightning_async_pp`` or ``tests``);
- every wait on an op (``Work.wait()``, ``Work.is_completed()`` returning True, the implicit wait of a blocking
  call), and every host read (``Tensor.item()``, ``Tensor.tolist()``) of a tensor that shares storage with a
  receive buffer: on CUDA such a read blocks the host until that receive completed.

Each process writes JSON lines to its own file, line-buffered (a killed rank leaves what it issued), starting
with its job (``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``, world size, rank, pid) and ending
with whether it exited cleanly (no uncaught exception, no nonzero ``sys.exit``; a killed process writes no end).
With ``strict_tags`` (``LIGHTNING_ASYNC_PP_STRICT_TAGS=1``) each message's tag is replaced by its sequence number
per (group, sender, receiver): gloo then pairs the k-th send with the k-th receive, as NCCL does, so an order
mismatch fails on gloo too (a size mismatch or a hang) instead of being sorted out by tags.

### The rules checked (``check``)

For each job whose ranks all exited cleanly:

1. **Matching.** Per process group and ordered pair of ranks, the k-th send meets the k-th receive (tags
   ignored by NCCL), with equal shape and dtype, and with equal tags (else gloo paired other messages than NCCL
   would); no message is left unmatched.
2. **Collective order.** Every member of a group issues the same collectives (kind, shape, dtype, root) in the
   same order. An ``all_to_all_single`` with split sizes (uneven: the experts' tokens) may differ in its first
   dimension between members; what member ``i`` sends to member ``j`` must be what ``j`` receives from ``i``.
3. **No deadlock** when every rank's ops run in issue order, in two stream models: one CUDA stream per
   (group, pair of ranks) for point-to-point plus one per group for collectives (NCCL without ``device_id``),
   and one stream per group for everything (NCCL with ``device_id``, as Lightning's ``DDPStrategy`` passes on
   CUDA). A send completes only together with its receive (rendezvous); a ``batch_isend_irecv``'s ops start
   together (when the unit heads every stream it uses); a collective completes once every member started it; an
   op does not start before the ops its thread waited on (``wait``, host read) before issuing it completed.
   On a deadlock the report gives each rank's blocked op and what it waits for.
4. **Host reads** of received tensors are counted per caller (``analyze``), for the no-host-sync-per-message
   budget.
"""
from __future__ import annotations

import atexit
import functools
import importlib.abc
import inspect
import json
import os
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

TRAFFIC_ENV = "LIGHTNING_ASYNC_PP_TRAFFIC"
STRICT_TAGS_ENV = "LIGHTNING_ASYNC_PP_STRICT_TAGS"

_P2P = {"isend": "send", "irecv": "recv", "send": "send", "recv": "recv"}
_BLOCKING_P2P = ("send", "recv")
# The collectives: the argument whose shape and dtype must agree across members (None: pickled objects, whose
# sizes may differ), and the arguments naming the root (global, group-local), if any.
_COLLECTIVES = {
    "all_reduce": ("tensor", None, None),
    "broadcast": ("tensor", "src", "group_src"),
    "all_gather": ("tensor", None, None),
    "all_gather_into_tensor": ("input_tensor", None, None),
    "reduce_scatter": ("output", None, None),
    "reduce_scatter_tensor": ("input", None, None),
    "reduce": ("tensor", "dst", "group_dst"),
    "gather": ("tensor", "dst", "group_dst"),
    "scatter": ("tensor", "src", "group_src"),
    "barrier": (None, None, None),
    "monitored_barrier": (None, None, None),
    "all_gather_object": (None, None, None),
    "broadcast_object_list": (None, "src", "group_src"),
    "gather_object": (None, "dst", "group_dst"),
    "scatter_object_list": (None, "src", "group_src"),
    "all_to_all": (None, None, None),
    "all_to_all_single": ("input", None, None),
}
#: The functional collectives (``torch.distributed._functional_collectives``) recorded: DTensor's redistributions
#: call them, not the c10d functions above. Each takes its tensor first and its group as ``group``.
_FUNCTIONAL = ("all_reduce", "all_gather_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single",
               "all_to_all_single", "broadcast", "all_gather_inplace", "all_reduce_coalesced",
               "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced")
_HERE = os.path.dirname(os.path.abspath(__file__))
_PACKAGE_PART = os.sep + "lightning_async_pp" + os.sep
_OWN_FILES = (os.path.abspath(__file__), os.path.join(_HERE, "traffic_hook"))


# ---------------------------------------------------------------------------------------------------------------
# The recorder
# ---------------------------------------------------------------------------------------------------------------
def _caller(depth: int = 3) -> str:
    """The innermost frames of the project (package or tests) that led to this call, innermost first."""
    frames = []
    f = sys._getframe(2)
    while f is not None and len(frames) < depth:
        name = f.f_code.co_filename
        if not name.startswith(_OWN_FILES):
            if _PACKAGE_PART in name:
                rel = name[name.rindex(_PACKAGE_PART) + 1:]
            elif name.startswith(_HERE + os.sep):
                rel = "tests" + name[len(_HERE):]
            else:
                rel = None
            if rel is not None:
                frames.append(f"{rel}:{f.f_lineno} {f.f_code.co_name}")
        f = f.f_back
    return " < ".join(frames) or "?"


class _RecordedWork:
    """A ``Work`` whose waits are recorded; everything else goes to the real one."""

    __slots__ = ("_work", "_ids", "_recorder")

    def __init__(self, work: Any, ids: list[int], recorder: "_Recorder") -> None:
        self._work, self._ids, self._recorder = work, ids, recorder

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._recorder.waited(self._ids, "wait")
        return self._work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        done = self._work.is_completed()
        if done:
            self._recorder.waited(self._ids, "is_completed")
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class _Recorder:
    def __init__(self, directory: str, strict_tags: bool) -> None:
        self.directory, self.strict_tags = directory, strict_tags
        self._lock = threading.RLock()
        self._local = threading.local()
        self._file = None
        self._next_op = 0
        self._next_unit = 0
        self._seq: dict[tuple[str, int, int], int] = defaultdict(int)
        self._groups: dict[str, list[int]] = {}
        self._recv_buffers: dict[int, tuple[Any, int]] = {}  # storage address -> (weak ref to it, receive op id)
        self._purge_at = 1024
        self._exit: Optional[str] = None  # why the process did not exit cleanly
        self.dist: Any = None
        self.originals: dict[str, Any] = {}
        self.wrappers: dict[str, Any] = {}

    # ---- output --------------------------------------------------------------------------------------------
    def _emit(self, event: dict) -> None:
        with self._lock:
            if self._file is None:
                self._open()
            self._file.write(json.dumps(event, separators=(",", ":")) + "\n")

    def _open(self) -> None:
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"traffic-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl")
        self._file = open(path, "w", buffering=1)  # line-buffered: a killed process leaves every line it wrote
        dist = self.dist
        self._file.write(json.dumps(dict(
            e="job", addr=os.environ.get("MASTER_ADDR"), port=os.environ.get("MASTER_PORT"),
            restart=os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), world=dist.get_world_size(),
            rank=dist.get_rank(), pid=os.getpid(), t0=time.time(),
        )) + "\n")
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        with self._lock:
            if self._file is not None and not self._file.closed:
                self._file.write(json.dumps(dict(e="exit", clean=self._exit is None, why=self._exit)) + "\n")
                self._file.close()

    def _excepthook(self, original: Any) -> Any:
        def hook(kind, value, tb):  # an uncaught exception: the process does not exit cleanly
            self._exit = f"{kind.__name__}: {value}"[:500]
            return original(kind, value, tb)
        return hook

    def _sys_exit(self, original: Any) -> Any:
        def exit_(code: Any = None) -> Any:
            if code not in (None, 0):
                self._exit = f"sys.exit({code!r})"[:500]
            return original(code)
        return exit_

    # ---- nesting: only the outermost call is recorded -------------------------------------------------------
    def _depth(self) -> int:
        return getattr(self._local, "depth", 0)

    def _call_nested(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self._local.depth = self._depth() + 1
        try:
            return fn(*args, **kwargs)
        finally:
            self._local.depth -= 1

    # ---- what an op is ---------------------------------------------------------------------------------------
    def _group(self, group: Any) -> Optional[str]:
        """The group's name (written once with its ranks), or None where this rank is not a member."""
        dist = self.dist
        if group is None:
            group = dist.group.WORLD
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            return None
        name = str(group.group_name)
        if name not in self._groups:
            ranks = list(dist.get_process_group_ranks(group))
            self._groups[name] = ranks
            self._emit(dict(e="group", g=name, ranks=ranks))
        return name

    def _global(self, group: Any, rank: Optional[int], group_rank: Optional[int]) -> Optional[int]:
        if rank is not None or group_rank is None:
            return rank
        return self.dist.get_global_rank(group if group is not None else self.dist.group.WORLD, group_rank)

    def _op(self, kind: str, group: str, tensor: Any = None, unit: Optional[int] = None, **extra: Any) -> int:
        with self._lock:
            op_id = self._next_op
            self._next_op += 1
        event = dict(e="op", id=op_id, k=kind, g=group, u=unit, at=_caller(), **extra)
        if tensor is not None:
            event.update(shape=list(tensor.shape), dtype=str(tensor.dtype).replace("torch.", ""))
        thread = threading.current_thread()
        if thread is not threading.main_thread():
            event["th"] = thread.name
        self._emit(event)
        return op_id

    def _p2p_tag(self, group: str, src: Optional[int], dst: Optional[int], tag: int) -> int:
        if not self.strict_tags or src is None or dst is None:
            return tag
        with self._lock:
            key = (group, src, dst)
            seq = self._seq[key]
            self._seq[key] = seq + 1
        return seq

    def _received_into(self, tensor: Any, op_id: int) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        storage = tensor.untyped_storage()
        with self._lock:
            self._recv_buffers[storage.data_ptr()] = (StorageWeakRef(storage), op_id)
            if len(self._recv_buffers) > self._purge_at:  # drop the buffers that were freed
                for ptr in [p for p, (ref, _) in self._recv_buffers.items() if ref.expired()]:
                    del self._recv_buffers[ptr]
                self._purge_at = 2 * len(self._recv_buffers) + 1024

    def waited(self, ids: list[int], how: str) -> None:
        self._emit(dict(e="wait", ops=ids, how=how, **self._thread()))

    def _thread(self) -> dict:
        thread = threading.current_thread()
        return {} if thread is threading.main_thread() else {"th": thread.name}

    def host_read(self, tensor: Any, how: str) -> None:
        try:
            ptr = tensor.untyped_storage().data_ptr()
        except Exception:  # a tensor without storage (meta, a subclass): not a receive buffer
            return
        entry = self._recv_buffers.get(ptr)
        if entry is not None and not entry[0].expired():
            self._emit(dict(e="read", ops=[entry[1]], how=how, at=_caller(), **self._thread()))

    def _wrap_work(self, work: Any, ids: list[int]) -> Any:
        return None if work is None else _RecordedWork(work, ids, self)

    # ---- the wrappers ----------------------------------------------------------------------------------------
    def p2p(self, name: str, original: Any) -> Any:
        signature = inspect.signature(original)
        direction = _P2P[name]

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._depth() > 0:
                return original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            group = self._group(a["group"])
            if group is None:
                return original(*args, **kwargs)
            me = self.dist.get_rank()
            peer_arg, group_peer_arg = ("dst", "group_dst") if direction == "send" else ("src", "group_src")
            peer = self._global(a["group"], a[peer_arg], a[group_peer_arg])
            src, dst = (me, peer) if direction == "send" else (peer, me)
            tag = a["tag"]
            a["tag"] = self._p2p_tag(group, src, dst, tag)
            op_id = self._op(direction, group, a["tensor"], call=name, peer=peer, tag=tag)
            if direction == "recv":
                self._received_into(a["tensor"], op_id)
            if name in _BLOCKING_P2P:
                self.waited([op_id], "blocking")
                return self._call_nested(original, *bound.args, **bound.kwargs)
            return self._wrap_work(self._call_nested(original, *bound.args, **bound.kwargs), [op_id])

        return wrapper

    def batch(self, original: Any) -> Any:
        @functools.wraps(original)
        def wrapper(p2p_op_list: list) -> Any:
            if self._depth() > 0 or not p2p_op_list:
                return original(p2p_op_list)
            sends = (self.originals.get("isend"), self.wrappers.get("isend"))
            with self._lock:
                unit = self._next_unit
                self._next_unit += 1
            me, ids = self.dist.get_rank(), []
            for p in p2p_op_list:
                group = self._group(p.group)
                direction = "send" if p.op in sends else "recv"
                src, dst = (me, p.peer) if direction == "send" else (p.peer, me)
                tag = p.tag
                p.tag = self._p2p_tag(group, src, dst, tag)  # rewritten on the P2POp: gloo reads it there
                op_id = self._op(direction, group, p.tensor, unit=unit, call="batch_isend_irecv", peer=p.peer, tag=tag)
                if direction == "recv":
                    self._received_into(p.tensor, op_id)
                ids.append(op_id)
            works = self._call_nested(original, p2p_op_list)
            if len(works) == len(ids):
                return [self._wrap_work(w, [i]) for w, i in zip(works, ids)]
            return [self._wrap_work(w, ids) for w in works]  # coalesced: one work completes the whole unit

        return wrapper

    def collective(self, name: str, original: Any) -> Any:
        signature = inspect.signature(original)
        tensor_arg, root_arg, group_root_arg = _COLLECTIVES[name]

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._depth() > 0:
                return original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            group = self._group(a.get("group"))
            if group is None:
                return original(*args, **kwargs)
            extra = {}
            if root_arg is not None:
                extra["root"] = self._global(a.get("group"), a.get(root_arg), a.get(group_root_arg))
            if name == "all_to_all_single" and (a.get("input_split_sizes") or a.get("output_split_sizes")):
                extra["splits"] = [list(a.get("output_split_sizes") or []), list(a.get("input_split_sizes") or [])]
            op_id = self._op("coll", group, a[tensor_arg] if tensor_arg else None, call=name, **extra)
            result = self._call_nested(original, *args, **kwargs)
            if a.get("async_op"):
                return self._wrap_work(result, [op_id])
            self.waited([op_id], "blocking")  # NCCL: the current stream waits for it; gloo: the host does
            return result

        return wrapper

    def functional(self, name: str, original: Any, funcol: Any) -> Any:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._depth() > 0 or _tracing(args):
                return original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            a = bound.arguments
            pg = self.dist._resolve_process_group(funcol._resolve_group_name(a["group"], a.get("tag", "")))
            group = self._group(pg)
            if group is None:
                return original(*args, **kwargs)
            first = next(iter(a.values()))
            op_id = self._op("coll", group, first if hasattr(first, "shape") else None, call=f"funcol.{name}")
            result = self._call_nested(original, *args, **kwargs)
            self.waited([op_id], "blocking")
            return result

        return wrapper

    def init_process_group(self, original: Any) -> Any:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            self._emit(dict(e="init"))  # opens this process's record with its job, also if it sends nothing
            return result

        return wrapper

    def tensor_read(self, how: str, original: Any) -> Any:
        import torch

        @functools.wraps(original)
        def read(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if self._recv_buffers and not torch.compiler.is_compiling():
                self.host_read(tensor, how)
            return original(tensor, *args, **kwargs)

        return read


_RECORDER: Optional[_Recorder] = None


def install(directory: str, strict_tags: bool) -> None:
    """Record this process's ``torch.distributed`` traffic into ``directory`` (idempotent).

    Install it before any code takes ``isend``/``irecv`` out of the module (``from torch.distributed import
    isend``): ``P2POp`` accepts only the functions the module holds now."""
    global _RECORDER
    if _RECORDER is not None:
        return
    import torch
    import torch.distributed.distributed_c10d as c10d

    recorder = _RECORDER = _Recorder(directory, strict_tags)
    recorder.dist = c10d
    for name in (*_P2P, *_COLLECTIVES, "batch_isend_irecv", "init_process_group"):
        original = getattr(c10d, name, None)
        if original is None:
            continue
        if name in _P2P:
            wrapper = recorder.p2p(name, original)
        elif name == "batch_isend_irecv":
            wrapper = recorder.batch(original)
        elif name == "init_process_group":
            wrapper = recorder.init_process_group(original)
        else:
            wrapper = recorder.collective(name, original)
        recorder.originals[name], recorder.wrappers[name] = original, wrapper
        setattr(c10d, name, wrapper)
    _patch_package()
    if "torch.distributed._functional_collectives" in sys.modules:
        install_functional(sys.modules["torch.distributed._functional_collectives"])
    else:
        sys.meta_path.insert(0, _AfterImport({"torch.distributed._functional_collectives": install_functional}))
    torch.Tensor.item = recorder.tensor_read("item", torch.Tensor.item)
    torch.Tensor.tolist = recorder.tensor_read("tolist", torch.Tensor.tolist)
    sys.excepthook = recorder._excepthook(sys.excepthook)
    sys.exit = recorder._sys_exit(sys.exit)


def _patch_package() -> None:
    """``torch.distributed`` re-exports the module's functions: point its names at the wrappers too."""
    package = sys.modules.get("torch.distributed")
    if package is None or _RECORDER is None:
        return
    for name, original in _RECORDER.originals.items():
        if getattr(package, name, None) is original:
            setattr(package, name, _RECORDER.wrappers[name])


def rebind_imported() -> None:
    """Point every imported module's global that holds an original function at its wrapper: where torch was
    imported before :func:`install` (tests/launcher.py's server), modules such as ``torch.distributed.device_mesh``
    took the originals (``from .distributed_c10d import ...``), which they take the wrappers of when the recorder
    is installed at c10d's import."""
    if _RECORDER is None:
        return
    by_id = {id(original): _RECORDER.wrappers[name] for name, original in _RECORDER.originals.items()}
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)
        if not isinstance(names, dict) or module is _RECORDER.dist:
            continue
        for name, value in list(names.items()):
            wrapper = by_id.get(id(value))
            if wrapper is not None and value is not wrapper:
                names[name] = wrapper


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a callback right after a module was executed (a post-import hook that imports nothing itself)."""

    def __init__(self, callbacks: dict[str, Any]) -> None:
        self.callbacks = callbacks

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        callback = self.callbacks.get(fullname)
        if callback is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_call(module: Any) -> None:
            exec_module(module)
            callback(module)

        loader.exec_module = exec_then_call  # type: ignore[method-assign]
        return spec


def install_when_imported(directory: str, strict_tags: bool) -> None:
    """Install the recorder as soon as ``torch.distributed.distributed_c10d`` is imported, importing nothing now."""
    if "torch.distributed.distributed_c10d" in sys.modules:
        install(directory, strict_tags)
        return
    sys.meta_path.insert(0, _AfterImport({
        "torch.distributed.distributed_c10d": lambda module: install(directory, strict_tags),
        "torch.distributed": lambda module: _patch_package(),
    }))


def _tracing(args: tuple) -> bool:
    """Whether a functional collective is being traced by ``torch.compile`` (dynamo, or its fake tensors) rather than
    run: nothing is sent then. The compiled graph later calls the collective ops directly, past this recorder, so a
    compiled layer's collectives are not in the record (docs/design/stages.md, "Compiled layers")."""
    import torch
    from torch._subclasses.fake_tensor import is_fake

    return torch.compiler.is_compiling() or any(isinstance(a, torch.Tensor) and is_fake(a) for a in args)


def install_functional(funcol: Any) -> None:
    """Record the functional collectives of ``funcol`` (``torch.distributed._functional_collectives``, imported by
    DTensor): its callers use them as the module's attributes, so the attributes are replaced."""
    if _RECORDER is None or getattr(funcol, "_recorded", False):
        return
    for name in _FUNCTIONAL:
        original = getattr(funcol, name, None)
        if original is not None:
            setattr(funcol, name, _RECORDER.functional(name, original, funcol))
    funcol._recorded = True


# ---------------------------------------------------------------------------------------------------------------
# Reading records
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Op:
    rank: int
    id: int
    kind: str  # "send", "recv" or "coll"
    call: str
    group: str
    peer: Optional[int] = None
    tag: Optional[int] = None
    shape: Optional[list] = None
    dtype: Optional[str] = None
    root: Optional[int] = None
    unit: Optional[int] = None
    thread: str = "main"
    caller: str = "?"
    waits_before: int = 0  # waits its thread issued before it
    splits: Optional[list] = None  # an all_to_all_single's [output split sizes, input split sizes]

    def describe(self) -> str:
        what = f"rank {self.rank} op {self.id} {self.call}"
        if self.peer is not None:
            what += f" {'to' if self.kind == 'send' else 'from'} {self.peer}"
        if self.dtype is not None:
            what += f" {self.shape} {self.dtype}"
        if self.root is not None:
            what += f" root {self.root}"
        if self.tag is not None:
            what += f" tag {self.tag}"
        return what + f" (group {self.group}) at {self.caller}"


@dataclass
class Process:
    path: Path
    rank: int
    world: int
    job: tuple
    pid: int
    t0: float
    clean: bool = False
    why: Optional[str] = None
    groups: dict[str, list[int]] = field(default_factory=dict)
    ops: list[Op] = field(default_factory=list)
    waits: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))  # per thread, in order
    reads: Counter = field(default_factory=Counter)  # host reads of received tensors, per caller


@dataclass
class Job:
    key: tuple  # (MASTER_ADDR, MASTER_PORT, restart count, world size, instance)
    world: int
    ranks: dict[int, Process]

    @property
    def complete(self) -> bool:
        return len(self.ranks) == self.world and all(p.clean for p in self.ranks.values())

    def describe(self) -> str:
        addr, port, restart, world, instance = self.key
        return f"job {addr}:{port} restart {restart} (world {world}{f', run {instance + 1}' if instance else ''})"

    def why_incomplete(self) -> str:
        missing = sorted(set(range(self.world)) - set(self.ranks))
        unclean = [f"rank {r}: {p.why or 'killed (no exit recorded)'}" for r, p in sorted(self.ranks.items())
                   if not p.clean]
        return "; ".join(([f"ranks {missing} not recorded"] if missing else []) + unclean)


def read_process(path: Path) -> Optional[Process]:
    """One process's record, or None where it never joined a process group."""
    proc: Optional[Process] = None
    with open(path) as f:
        lines = f.readlines()
    for line in lines:
        try:
            e = json.loads(line)
        except json.JSONDecodeError:  # the last line of a killed process may be cut short
            break
        kind = e["e"]
        if kind == "job":
            proc = Process(path, e["rank"], e["world"], (e["addr"], e["port"], e["restart"], e["world"]), e["pid"],
                           e.get("t0", 0.0))
        elif proc is None:
            continue
        elif kind == "group":
            proc.groups[e["g"]] = e["ranks"]
        elif kind == "op":
            thread = e.get("th", "main")
            proc.ops.append(Op(proc.rank, e["id"], e["k"], e.get("call", e["k"]), e["g"], e.get("peer"), e.get("tag"),
                               e.get("shape"), e.get("dtype"), e.get("root"), e.get("u"), thread, e.get("at", "?"),
                               len(proc.waits[thread]), e.get("splits")))
        elif kind in ("wait", "read"):
            proc.waits[e.get("th", "main")].extend(e["ops"])
            if kind == "read":
                proc.reads[e.get("at", "?")] += 1
        elif kind == "exit":
            proc.clean, proc.why = e["clean"], e.get("why")
    return proc


def load(directory: str | os.PathLike) -> list[Job]:
    """The jobs recorded in ``directory``. Processes of one job share its address, port, restart count and world
    size; a port reused by a later run of the same test makes a second instance (each rank's processes in start
    order)."""
    by_key: dict[tuple, dict[int, list[Process]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(Path(directory).glob("traffic-*.jsonl")):
        proc = read_process(path)
        if proc is not None:
            by_key[proc.job][proc.rank].append(proc)
    jobs = []
    for key, ranks in by_key.items():
        for procs in ranks.values():
            procs.sort(key=lambda p: p.t0)
        for instance in range(max(len(p) for p in ranks.values())):
            members = {r: procs[instance] for r, procs in ranks.items() if instance < len(procs)}
            jobs.append(Job((*key, instance), key[3], members))
    return jobs


# ---------------------------------------------------------------------------------------------------------------
# The rules
# ---------------------------------------------------------------------------------------------------------------
def _signature(op: Op) -> tuple:
    if op.splits is not None and op.shape:  # uneven all-to-all: each member's own number of rows
        return (op.call, op.shape[1:], op.dtype, op.root)
    return (op.call, op.shape, op.dtype, op.root)


def _split_mismatch(ops: list[Op], ranks: list[int]) -> Optional[str]:
    """For one uneven ``all_to_all_single`` (``ops``: each member's, in group order): what member ``i`` sends to
    member ``j`` must be what ``j`` expects from ``i`` (else NCCL moves other bytes than gloo)."""
    n = len(ops)
    for i, a in enumerate(ops):
        for j, b in enumerate(ops):
            sends = _splits(a, 1, n)[j]
            expects = _splits(b, 0, n)[i]
            if sends != expects:
                return (f"rank {ranks[i]} sends {sends} rows to rank {ranks[j]}, which expects {expects}: "
                        f"{a.describe()}; {b.describe()}")
    return None


def _splits(op: Op, which: int, n: int) -> list[int]:
    given = (op.splits or [[], []])[which]
    return list(given) if given else [(op.shape or [0])[0] // n] * n


def _pairs(job: Job, prefix: bool = False) -> tuple[dict[tuple, Optional[tuple]], list[str]]:
    """Rule 1: per group and ordered pair of ranks, the k-th send meets the k-th receive. Returns each P2P op's
    partner (None: unmatched) and the violations; ``prefix``: only of the messages both sides issued."""
    sends: dict[tuple, list[Op]] = defaultdict(list)
    recvs: dict[tuple, list[Op]] = defaultdict(list)
    violations = []
    for proc in job.ranks.values():
        for op in proc.ops:
            if op.kind == "send":
                sends[(op.group, op.rank, op.peer)].append(op)
            elif op.kind == "recv":
                if op.peer is None:
                    violations.append(f"a receive from any source, which NCCL cannot do: {op.describe()}")
                recvs[(op.group, op.peer, op.rank)].append(op)
    partner: dict[tuple, Optional[tuple]] = {}
    for key in sorted(set(sends) | set(recvs), key=str):
        group, src, dst = key
        s, r = sends.get(key, []), recvs.get(key, [])
        for a, b in zip(s, r):
            partner[(a.rank, a.id)], partner[(b.rank, b.id)] = (b.rank, b.id), (a.rank, a.id)
        for k, (a, b) in enumerate(zip(s, r)):
            if (a.shape, a.dtype) != (b.shape, b.dtype):
                violations.append(
                    f"message {k} from rank {src} to rank {dst} (group {group}) is sent as {a.shape} {a.dtype} but "
                    f"received as {b.shape} {b.dtype}: send {a.describe()}; receive {b.describe()}")
                break
            if a.tag != b.tag:  # gloo paired them by tag, NCCL pairs by position: not the same pairs
                violations.append(
                    f"message {k} from rank {src} to rank {dst} (group {group}) is sent with tag {a.tag} but the "
                    f"receive in its place has tag {b.tag}; NCCL ignores tags and pairs them: send {a.describe()}; "
                    f"receive {b.describe()}")
                break
        if len(s) != len(r) and not prefix:
            more, fewer = (s, "sends") if len(s) > len(r) else (r, "receives")
            extra = more[min(len(s), len(r))]
            violations.append(
                f"rank {src} sends {len(s)} messages to rank {dst} (group {group}) but rank {dst} posts {len(r)} "
                f"receives; the first unmatched one: {extra.describe()}")
        for op in (s if len(s) > len(r) else r)[min(len(s), len(r)):]:
            partner[(op.rank, op.id)] = None
    return partner, violations


def _collectives(job: Job, prefix: bool = False) -> tuple[dict[tuple, tuple], dict[tuple, int], list[str]]:
    """Rule 2: every member issues the same collectives in the same order. Returns each collective's instance
    (group, k), how many members it needs, and the violations; ``prefix``: only of those both members issued."""
    per_group: dict[str, dict[int, list[Op]]] = defaultdict(lambda: defaultdict(list))
    members: dict[str, list[int]] = {}
    for proc in job.ranks.values():
        members.update(proc.groups)
        for op in proc.ops:
            if op.kind == "coll":
                per_group[op.group][op.rank].append(op)
    instance: dict[tuple, tuple] = {}
    needed: dict[tuple, int] = {}
    violations = []
    for group, by_rank in sorted(per_group.items()):
        ranks = members.get(group, sorted(by_rank))
        for r in ranks:
            for k, op in enumerate(by_rank.get(r, [])):
                instance[(op.rank, op.id)] = (group, k)
                needed[(group, k)] = len(ranks)
        first = ranks[0]
        for r in ranks[1:]:
            a, b = by_rank.get(first, []), by_rank.get(r, [])
            for k, (x, y) in enumerate(zip(a, b)):
                if _signature(x) != _signature(y):
                    violations.append(f"collective {k} of group {group} differs between ranks {first} and {r}: "
                                      f"{x.describe()}; {y.describe()}")
                    break
            else:
                if len(a) != len(b) and not prefix:
                    longer = a if len(a) > len(b) else b
                    violations.append(
                        f"group {group}: rank {first} issues {len(a)} collectives, rank {r} {len(b)}; the first "
                        f"without a counterpart: {longer[min(len(a), len(b))].describe()}")
        uneven = [k for k, op in enumerate(by_rank.get(first, [])) if op.splits is not None]
        for k in uneven:
            ops = [by_rank[r][k] for r in ranks if k < len(by_rank.get(r, []))]
            problem = _split_mismatch(ops, ranks) if len(ops) == len(ranks) else None
            if problem is not None:
                violations.append(f"all_to_all_single {k} of group {group}: {problem}")
                break
    return instance, needed, violations


def _stream(op: Op, model: str) -> tuple:
    if model == "group":  # NCCL with device_id: one stream per process group
        return (op.rank, op.group)
    if op.kind == "coll":  # NCCL without device_id: one per group for collectives, one per pair for P2P
        return (op.rank, op.group, "collectives")
    return (op.rank, op.group, frozenset((op.rank, op.peer)))


_MODELS = {"pair": "without device_id (a stream per pair of ranks, one for collectives)",
           "group": "with device_id (one stream per process group)"}


class _Replay:
    """Rule 3: every rank's ops run in issue order on the streams of a model (ops and units as integers: records
    hold tens of thousands of ops)."""

    def __init__(self, job: Job, model: str, partner: dict, instance: dict, needed: dict) -> None:
        self.ops = [op for proc in sorted(job.ranks.values(), key=lambda p: p.rank) for op in proc.ops]
        index = {(op.rank, op.id): i for i, op in enumerate(self.ops)}
        self.partner = [index[partner[k]] if partner.get(k) is not None else -1
                        for k in ((op.rank, op.id) for op in self.ops)]
        instances: dict[tuple, int] = {}
        self.instance, self.inst_needed, self.inst_ops = [], [], []
        for op in self.ops:
            inst = instance.get((op.rank, op.id))
            if inst is None:
                self.instance.append(-1)
                continue
            if inst not in instances:
                instances[inst] = len(self.inst_needed)
                self.inst_needed.append(needed[inst])
                self.inst_ops.append([])
            self.instance.append(instances[inst])
            self.inst_ops[instances[inst]].append(len(self.instance) - 1)
        self.inst_started = [0] * len(self.inst_needed)
        # units (a batch_isend_irecv, or a single op), the streams they occupy, the waits they come after
        unit_ids: dict[tuple, int] = {}
        stream_ids: dict[tuple, int] = {}
        thread_ids: dict[tuple, int] = {}
        self.unit_of, self.units, self.unit_streams, self.unit_thread, self.unit_need = [], [], [], [], []
        self.queues: list[list[int]] = []
        for i, op in enumerate(self.ops):
            key = (op.rank, "unit", op.unit) if op.unit is not None else (op.rank, op.id)
            u = unit_ids.setdefault(key, len(unit_ids))
            if u == len(self.units):
                tk = thread_ids.setdefault((op.rank, op.thread), len(thread_ids))
                self.units.append([]), self.unit_streams.append([]), self.unit_thread.append(tk)
                self.unit_need.append(op.waits_before)
            self.unit_of.append(u)
            self.units[u].append(i)
            s = stream_ids.setdefault(_stream(op, model), len(stream_ids))
            if s == len(self.queues):
                self.queues.append([])
            if s not in self.unit_streams[u]:
                self.unit_streams[u].append(s)
                self.queues[s].append(u)
        self.head = [0] * len(self.queues)
        self.threads = list(thread_ids)
        self.waits = [[index.get((rank, w), -1) for w in job.ranks[rank].waits.get(th, [])] for rank, th in self.threads]
        self.rank_threads: dict[int, list[int]] = defaultdict(list)
        for tk, (rank, _) in enumerate(self.threads):
            self.rank_threads[rank].append(tk)
        self.frontier = [0] * len(self.threads)  # per thread: how many of its waits completed, in order
        self.blocked: list[list[int]] = [[] for _ in self.threads]  # units waiting for the frontier
        self.started = bytearray(len(self.units))
        self.remaining = [len(u) for u in self.units]  # ops of the unit not done yet
        self.done = bytearray(len(self.ops))

    def run(self) -> bool:
        """Whether every op completes."""
        queues, head, work = self.queues, self.head, deque(q[0] for q in self.queues)
        completed = 0
        while work:
            u = work.popleft()
            if self.started[u] or any(queues[s][head[s]] != u for s in self.unit_streams[u]):
                continue
            tk = self.unit_thread[u]
            if self.frontier[tk] < self.unit_need[u]:
                self.blocked[tk].append(u)
                continue
            self.started[u] = 1
            newly_done = []
            for i in self.units[u]:
                inst = self.instance[i]
                if inst >= 0:
                    self.inst_started[inst] += 1
                    if self.inst_started[inst] == self.inst_needed[inst]:
                        newly_done += self.inst_ops[inst]
                else:
                    other = self.partner[i]
                    if other >= 0 and self.started[self.unit_of[other]]:
                        newly_done += (i, other)
            for i in newly_done:
                self.done[i] = 1
                v = self.unit_of[i]
                self.remaining[v] -= 1
                if self.remaining[v]:
                    continue
                completed += 1
                for s in self.unit_streams[v]:
                    head[s] += 1
                    if head[s] < len(queues[s]):
                        work.append(queues[s][head[s]])
                for t in self.rank_threads[self.ops[i].rank]:  # any thread of the rank may have waited on it
                    w, f = self.waits[t], self.frontier[t]
                    while f < len(w) and (w[f] < 0 or self.done[w[f]]):
                        f += 1
                    if f != self.frontier[t]:
                        self.frontier[t] = f
                        work.extend(self.blocked[t])
                        self.blocked[t] = []
        return completed == len(self.units)

    def blocked_heads(self) -> list[str]:
        """Each rank's first op that did not complete, and what it waits for."""
        lines, seen = [], set()
        for i, op in enumerate(self.ops):
            if op.rank in seen or not self.remaining[self.unit_of[i]]:
                continue
            seen.add(op.rank)
            lines.append(f"rank {op.rank}: {op.describe()}: {self.why(i)}")
        return lines

    def why(self, i: int, depth: int = 0) -> str:
        op, u = self.ops[i], self.unit_of[i]
        if self.started[u]:
            if op.kind == "coll":
                inst = self.instance[i]
                if inst < 0:
                    return "started; no other member issues it"
                return f"started; waits for {self.inst_needed[inst] - self.inst_started[inst]} more members of group {op.group}"
            pending = [k for k in self.units[u] if not self.done[k]]
            if not pending:
                return "started"
            k = pending[0]
            other = self.partner[k]
            if other < 0:
                return f"started; {self.ops[k].describe()} has no matching op on its peer"
            why = "" if depth else f" ({self.why(other, 1)})"
            return f"started; waits for its peer's {self.ops[other].describe()}, which has not started{why}"
        for s in self.unit_streams[u]:
            h = self.queues[s][self.head[s]]
            if h != u:
                return f"not started: behind {self.ops[self.units[h][0]].describe()} on the same stream"
        t = self.unit_thread[u]
        w = self.waits[t][self.frontier[t]]
        return f"not started: its rank waited before issuing it for {self.ops[w].describe()}"


def _deadlock(job: Job, model: str, partner: dict, instance: dict, needed: dict) -> Optional[str]:
    """Rule 3 in one stream model: None, or each rank's blocked op."""
    replay = _Replay(job, model, partner, instance, needed)
    if replay.run():
        return None
    return f"deadlock under NCCL {_MODELS[model]}:\n    " + "\n    ".join(replay.blocked_heads())


def check_job(job: Job) -> list[str]:
    """The violations of NCCL's rules in one complete job's records."""
    partner, violations = _pairs(job)
    instance, needed, collective_violations = _collectives(job)
    violations += collective_violations
    for model in _MODELS:
        stuck = _deadlock(job, model, partner, instance, needed)
        if stuck:
            violations.append(stuck)
    return violations


def check_prefix(job: Job) -> list[str]:
    """Rules 1 and 2 on what every rank issued before it stopped: for a job that failed or was killed, the first
    mismatch often is why (with strict tags, gloo fails where NCCL would pair the wrong tensors)."""
    return _pairs(job, prefix=True)[1] + _collectives(job, prefix=True)[2]


@dataclass
class Analysis:
    jobs: list[Job]
    violations: list[str]
    host_reads: Counter  # host reads of received tensors, per caller, over the complete jobs

    @property
    def complete_jobs(self) -> list[Job]:
        return [j for j in self.jobs if j.complete]


def analyze(directory: str | os.PathLike) -> Analysis:
    jobs = load(directory)
    violations: list[str] = []
    reads: Counter = Counter()
    for job in jobs:
        if job.complete:
            violations += [f"{job.describe()}: {v}" for v in check_job(job)]
            for proc in job.ranks.values():
                reads.update(proc.reads)
    return Analysis(jobs, violations, reads)


def check(directory: str | os.PathLike) -> list[str]:
    """The violations of NCCL's rules in every complete job recorded in ``directory``."""
    return analyze(directory).violations
