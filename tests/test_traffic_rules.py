"""The replay checker of tests/traffic.py on records written here, and the recorder on one real 2-process run.

The synthetic records are what the recorder writes (one JSON-lines file per process); each exchange below is
either right under NCCL's rules or breaks exactly one of them.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import traffic
import launcher
from pipeline_runs import free_port, rank_env

SCRIPT = Path(__file__).parent / "scripts" / "traffic_exchange.py"


class Rank:
    """One process's record, op by op, in issue order."""

    def __init__(self, rank: int, world: int, groups: dict[str, list[int]] | None = None) -> None:
        self.rank, self.world = rank, world
        self.events: list[dict] = [dict(e="job", addr="127.0.0.1", port="29500", restart="0", world=world, rank=rank,
                                        pid=1000 + rank, t0=0.0)]
        for name, ranks in (groups or {"0": list(range(world))}).items():
            self.events.append(dict(e="group", g=name, ranks=ranks))
        self.next_id, self.next_unit = 0, 0

    def _op(self, kind: str, call: str, group: str = "0", shape=(4, 8), dtype="float32", unit=None, **extra) -> int:
        op_id, self.next_id = self.next_id, self.next_id + 1
        self.events.append(dict(e="op", id=op_id, k=kind, call=call, g=group, u=unit, shape=list(shape), dtype=dtype,
                                at=f"tests/test_traffic_rules.py:{len(self.events)} rank{self.rank}", **extra))
        return op_id

    def isend(self, peer: int, shape=(4, 8), dtype="float32", tag: int = 0, group: str = "0") -> int:
        return self._op("send", "isend", group, shape, dtype, peer=peer, tag=tag)

    def irecv(self, peer: int, shape=(4, 8), dtype="float32", tag: int = 0, group: str = "0") -> int:
        return self._op("recv", "irecv", group, shape, dtype, peer=peer, tag=tag)

    def batch(self, *ops: tuple) -> list[int]:
        """``("send" | "recv", peer, shape)`` each, as one ``batch_isend_irecv``."""
        unit, self.next_unit = self.next_unit, self.next_unit + 1
        return [self._op(kind, "batch_isend_irecv", "0", shape, "float32", unit=unit, peer=peer, tag=0)
                for kind, peer, shape in ops]

    def all_reduce(self, shape=(1,), dtype="float32", group: str = "0") -> int:
        return self._op("coll", "all_reduce", group, shape, dtype)

    def broadcast(self, shape=(4,), root: int = 0) -> int:
        return self._op("coll", "broadcast", "0", shape, "float32", root=root)

    def wait(self, *ids: int) -> None:
        self.events.append(dict(e="wait", ops=list(ids), how="wait"))

    def read(self, op_id: int) -> None:
        self.events.append(dict(e="read", ops=[op_id], how="item", at="tests/test_traffic_rules.py:1 read"))

    def write(self, directory: Path, clean: bool = True) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        events = self.events + ([dict(e="exit", clean=True, why=None)] if clean else [])
        with open(directory / f"traffic-{1000 + self.rank}-0.jsonl", "w") as f:
            f.writelines(json.dumps(e) + "\n" for e in events)


def violations(tmp_path: Path, *ranks: Rank) -> list[str]:
    for r in ranks:
        r.write(tmp_path)
    return traffic.check(tmp_path)


def deadlocks(found: list[str]) -> dict[str, str]:
    return {model: v for v in found for model in ("without device_id", "with device_id") if model in v}


def test_messages_a_pair_exchanges_in_different_orders_are_paired_by_position(tmp_path):
    """Sends an activation then a loss; the receiver posts the loss first, with the tags gloo would match."""
    a, b = Rank(0, 2), Rank(1, 2)
    a.wait(a.isend(1, (4, 8), "float32", tag=2048), a.isend(1, (1,), "float64", tag=3072))
    b.wait(b.irecv(0, (1,), "float64", tag=3072), b.irecv(0, (4, 8), "float32", tag=2048))
    found = violations(tmp_path, a, b)
    assert found, "a swapped exchange passed"
    first = found[0]
    assert "message 0 from rank 0 to rank 1" in first and "[4, 8] float32" in first and "[1] float64" in first, first
    assert "rank 0 op 0 isend" in first and "rank 1 op 0 irecv" in first and "rank0" in first and "rank1" in first


def test_equal_shapes_with_swapped_tags_are_a_violation(tmp_path):
    """Same shapes: NCCL would silently pair the wrong tensors, which gloo's tags had kept apart."""
    a, b = Rank(0, 2), Rank(1, 2)
    a.wait(a.isend(1, tag=1), a.isend(1, tag=2))
    b.wait(b.irecv(0, tag=2), b.irecv(0, tag=1))
    found = violations(tmp_path, a, b)
    assert len(found) == 1 and "sent with tag 1 but the receive in its place has tag 2" in found[0], found


def test_both_sides_receiving_first_deadlocks_in_both_stream_models(tmp_path):
    a, b = Rank(0, 2), Rank(1, 2)
    for me, peer in ((a, 1), (b, 0)):
        me.wait(me.irecv(peer), me.isend(peer))
    found = deadlocks(violations(tmp_path, a, b))
    assert set(found) == {"without device_id", "with device_id"}, found
    stuck = found["without device_id"]
    assert "rank 0: rank 0 op 0 irecv from 1" in stuck and "waits for its peer's rank 1 op 1 isend to 0" in stuck, stuck
    assert "rank 1: rank 1 op 0 irecv from 0" in stuck, stuck


def test_the_same_exchange_as_one_batch_isend_irecv_passes(tmp_path):
    a, b = Rank(0, 2), Rank(1, 2)
    for me, peer in ((a, 1), (b, 0)):
        me.wait(*me.batch(("recv", peer, (4, 8)), ("send", peer, (4, 8))))
    assert violations(tmp_path, a, b) == []


def test_collectives_issued_in_different_orders_are_a_violation(tmp_path):
    a, b = Rank(0, 2), Rank(1, 2)
    a.all_reduce(), a.broadcast()
    b.broadcast(), b.all_reduce()
    found = violations(tmp_path, a, b)
    assert any("collective 0 of group 0 differs between ranks 0 and 1" in v and "all_reduce" in v and "broadcast" in v
               for v in found), found


def test_an_uneven_all_to_all_passes_where_the_splits_pair_up_and_is_a_violation_where_they_do_not(tmp_path):
    """The experts' all-to-all: each member sends its own number of rows (dim 0 differs), split per receiver; what
    rank i sends to rank j must be what j expects from i."""
    def exchange(directory: Path, expected_from_0: int) -> list[str]:
        a, b = Rank(0, 2), Rank(1, 2)
        # rank 0 sends 1 row to itself, 2 to rank 1; rank 1 sends 4 to rank 0, none to itself ([output, input] splits)
        a._op("coll", "all_to_all_single", shape=(3, 8), splits=[[1, 4], [1, 2]])
        b._op("coll", "all_to_all_single", shape=(4, 8), splits=[[expected_from_0, 0], [4, 0]])
        return violations(directory, a, b)

    assert exchange(tmp_path / "paired", 2) == []
    found = exchange(tmp_path / "unpaired", 1)
    assert any("rank 0 sends 2 rows to rank 1, which expects 1" in v for v in found), found


def ring(tmp_path: Path, wait: str | None) -> list[str]:
    """Rank r receives from r-1 and sends to r+1 (3 ranks); ``wait``: waits on (or reads) the receive first."""
    ranks = [Rank(r, 3) for r in range(3)]
    for r, me in enumerate(ranks):
        received = me.irecv((r - 1) % 3)
        if wait == "wait":
            me.wait(received)
        elif wait == "read":
            me.read(received)
        me.wait(me.isend((r + 1) % 3), received)
    return violations(tmp_path, *ranks)


def test_a_ring_runs_with_a_stream_per_pair_but_deadlocks_on_one_stream_per_group(tmp_path):
    found = deadlocks(ring(tmp_path, wait=None))
    assert set(found) == {"with device_id"}, found
    stuck = found["with device_id"]  # each rank's send is queued behind its own receive on the group's stream
    assert "rank 1: rank 1 op 0 irecv from 0" in stuck and "waits for its peer's rank 0 op 1 isend to 1" in stuck
    assert "(not started: behind rank 0 op 0 irecv from 2" in stuck, stuck


@pytest.mark.parametrize("how", ["wait", "read"])
def test_waiting_on_a_receive_before_issuing_the_send_the_peer_needs_deadlocks(tmp_path, how):
    found = deadlocks(ring(tmp_path, wait=how))
    assert set(found) == {"without device_id", "with device_id"}, found
    stuck = found["without device_id"]
    # rank 0's receive waits for rank 2's send, which rank 2 issued after waiting for its own receive
    assert "rank 0: rank 0 op 0 irecv from 2" in stuck and "waits for its peer's rank 2 op 1 isend to 0" in stuck
    assert "(not started: its rank waited before issuing it for rank 2 op 0 irecv from 1" in stuck, stuck


def one_f_one_b(batched: bool, microbatches: int = 4) -> tuple[Rank, Rank]:
    """Two stages, 1F1B: activations [4, 8] forward, gradients back, then the loss all-reduced. ``batched``:
    each steady-state send goes out with the opposite receive as one batch_isend_irecv (Megatron's
    send_forward_recv_backward), else as separate isend/irecv."""
    first, last = Rank(0, 2), Rank(1, 2)
    act, grad = (4, 8), (4, 8)
    first.wait(first.isend(1, act))  # warm-up: one forward
    for m in range(microbatches - 1):
        if batched:
            first.wait(*first.batch(("send", 1, act), ("recv", 1, grad)))
        else:
            first.wait(first.isend(1, act), first.irecv(1, grad))
    first.wait(first.irecv(1, grad))
    received = last.irecv(0, act)
    last.wait(received)
    for m in range(microbatches - 1):
        if batched:
            last.wait(*last.batch(("send", 0, grad), ("recv", 0, act)))
        else:
            last.wait(last.isend(0, grad), last.irecv(0, act))
    last.wait(last.isend(0, grad))
    for me in (first, last):
        me.wait(me.all_reduce((1,), "float64"))
    return first, last


def test_a_one_f_one_b_exchange_with_batched_opposite_transfers_passes(tmp_path):
    assert violations(tmp_path, *one_f_one_b(batched=True)) == []


def test_a_one_f_one_b_exchange_with_separate_sends_deadlocks_on_the_shared_stream(tmp_path):
    found = deadlocks(violations(tmp_path, *one_f_one_b(batched=False)))
    assert set(found) == {"without device_id", "with device_id"}, found


def test_unmatched_messages_and_incomplete_jobs(tmp_path):
    a, b = Rank(0, 2), Rank(1, 2)
    a.wait(a.isend(1), a.isend(1))
    b.wait(b.irecv(0))
    found = violations(tmp_path / "unmatched", a, b)
    assert any("rank 0 sends 2 messages to rank 1 (group 0) but rank 1 posts 1 receives" in v for v in found), found
    a.write(tmp_path / "killed")
    b.write(tmp_path / "killed", clean=False)  # killed: its record has no end, the job is not checked
    analysis = traffic.analyze(tmp_path / "killed")
    assert analysis.violations == [] and analysis.complete_jobs == []
    assert "rank 1: killed" in analysis.jobs[0].why_incomplete()
    assert traffic.check_prefix(analysis.jobs[0]) == []  # what both sides issued matches
    c, d = Rank(0, 2), Rank(1, 2)
    c.isend(1, (4, 8)), c.isend(1, (1,), "float64")
    d.irecv(0, (1,), "float64")  # then killed: the first message already pairs the wrong tensors
    c.write(tmp_path / "mismatch", clean=False)
    d.write(tmp_path / "mismatch", clean=False)
    found = traffic.check_prefix(traffic.load(tmp_path / "mismatch")[0])
    assert len(found) == 1 and "sent as [4, 8] float32 but received as [1] float64" in found[0], found


@pytest.mark.multiprocess
@pytest.mark.parametrize("forked", [False, True], ids=["fresh", "forked"])
def test_recording_a_real_gloo_exchange_with_strict_tags(tmp_path, monkeypatch, forked):
    """Two processes exchange over gloo with the recorder installed by tests/traffic_hook/sitecustomize.py (fresh
    interpreters) or by tests/launcher.py (ranks forked from its server, which imported torch.distributed before)
    and strict tags: the exchange still delivers the right tensors, and the record holds every op, wait and host
    read."""
    directory = Path(os.environ.get(traffic.TRAFFIC_ENV) or tmp_path / "traffic")
    hook = str(Path(__file__).parent / "traffic_hook")
    env = {k: v for k, v in rank_env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [hook, os.environ.get("PYTHONPATH")])),
               **{traffic.TRAFFIC_ENV: str(directory), traffic.STRICT_TAGS_ENV: "1"})
    monkeypatch.setenv(launcher.OPT_OUT_ENV, "1" if forked else "0")
    logs = [(str(tmp_path / f"rank{r}.out"), str(tmp_path / f"rank{r}.err")) for r in range(2)]
    procs = [launcher.start([sys.executable, str(SCRIPT), str(tmp_path / f"rank{r}.json")], tmp_path,
                            {**env, "RANK": str(r)}, *logs[r]) for r in range(2)]
    assert all(isinstance(p, launcher.Rank) == forked for p in procs), procs
    try:
        for p in procs:
            p.wait(timeout=300)
    finally:
        for p in procs:
            p.kill()  # a no-op when it has exited
    outputs = [Path(out).read_text() + Path(err).read_text() for out, err in logs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    for r in range(2):
        assert json.loads((tmp_path / f"rank{r}.json").read_text())["ok"], outputs[r]
    analysis = traffic.analyze(directory)
    assert analysis.violations == [] and len(analysis.complete_jobs) == 1
    job = analysis.complete_jobs[0]
    first = job.ranks[0]
    calls = [op.call for op in first.ops]
    assert calls == ["isend", "isend", "irecv", "batch_isend_irecv", "batch_isend_irecv", "send", "recv",
                     "all_reduce", "all_gather_object"], calls
    assert all(op.caller.startswith("tests/scripts/traffic_exchange.py:") for op in first.ops), first.ops
    batch = [op for op in first.ops if op.call == "batch_isend_irecv"]
    assert batch[0].unit == batch[1].unit is not None and batch[0].kind == "send" and batch[1].kind == "recv"
    # the original tags are recorded (gloo saw sequence numbers); the host read of the received loss is counted
    assert [op.tag for op in first.ops if op.kind == "send"] == [5, 7, 0, 0]
    assert sum(first.reads.values()) == 1 and sum(job.ranks[1].reads.values()) == 0
    assert first.waits["main"][:3] == [0, 1, 2]
