"""What the checkpoints' checksums cost: a save and a load of ``--mib`` MiB of tensors, with and without them.

- Sharded (``torch.distributed.checkpoint``, one process): ``FileSystemWriter`` against the ``ChecksummedWriter``
  every save uses (it reads each shard back and hashes it, and writes ``checksums.json``); a read of every key
  through ``ShardedSource`` with its checksums checked first, and with the check switched off.
- Single file (``torch.save``, whose CRC-32s are written anyway): ``torch.load`` against ``check_file`` (which
  reads every zip record through :mod:`zipfile`, checking its CRC-32) then ``torch.load``.
- The hash alone on the largest shard's bytes in memory: ``zlib.crc32`` (what the checkpoints use) against
  ``hashlib.blake2b`` and ``hashlib.sha256``.

Each round times every alternative once, in an order that rotates from round to round, after waiting for an idle
machine; printed are the medians over ``--rounds``, their ratios, and the share of the CPUs others used. Files
are written under ``--dir`` (default: a temporary folder) and are in the page cache when read back, so a load
measures the hash and a copy from memory, not the disk.

    .venv/bin/python benchmarks/checkpoint_checksum.py                 # 384 MiB, 5 rounds
    .venv/bin/python benchmarks/checkpoint_checksum.py --mib 1024 --rounds 3
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=384, help="size of the checkpoint's tensors")
    parser.add_argument("--tensor-mib", type=int, default=16, help="size of each tensor")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--wait-idle", type=float, default=20.0, help="seconds to wait for an idle machine")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    harness.one_thread_env()
    started = time.perf_counter()
    import hashlib
    import zlib

    import torch
    import torch.distributed.checkpoint as dcp

    from lightning_async_pp import checkpoint as ckpt

    warnings.filterwarnings("ignore")  # DCP's "no process group: one process" on every call
    count = max(1, args.mib // args.tensor_mib)
    gen = torch.Generator().manual_seed(0)
    flat = {f"model.layer{i}.weight": torch.randn(args.tensor_mib << 18, generator=gen) for i in range(count)}
    total_mib = sum(t.numel() * t.element_size() for t in flat.values()) / 2**20
    root = tempfile.mkdtemp(dir=args.dir, prefix="checksum-bench-")
    plain_dir, checked_dir, one = (os.path.join(root, n) for n in ("plain", "checked", "one.ckpt"))
    torch.save({"state_dict": flat}, one)

    def save(writer_class, path):
        def go():
            shutil.rmtree(path, ignore_errors=True)
            os.makedirs(path)
            torch.save({}, os.path.join(path, ckpt.META_FILE))  # as save_sharded writes it, before the shards
            dcp.save(dict(flat), storage_writer=writer_class(path), no_dist=True)
        return go

    def load(path, checked):
        def go():
            source = ckpt.ShardedSource(path)
            if not checked:
                source.checksums = None
            source.read(source.shapes)
        return go

    def load_file(checked):
        def go():
            if checked:
                ckpt.check_file(one)
            torch.load(one, weights_only=True, map_location="cpu")
        return go

    # Write both once so that every load finds its files; the timed saves rewrite them.
    save(dcp.FileSystemWriter, plain_dir)()
    save(ckpt.ChecksummedWriter, checked_dir)()
    shard = open(os.path.join(checked_dir, "__0_0.distcp"), "rb").read()
    cases = {
        "save, sharded": save(dcp.FileSystemWriter, plain_dir),
        "save, sharded + checksums": save(ckpt.ChecksummedWriter, checked_dir),
        "load, sharded": load(checked_dir, False),
        "load, sharded + checksums": load(checked_dir, True),
        "load, one file": load_file(False),
        "load, one file + CRC check": load_file(True),
        "hash, zlib.crc32": lambda: zlib.crc32(shard),
        "hash, blake2b": lambda: hashlib.blake2b(shard).digest(),
        "hash, sha256": lambda: hashlib.sha256(shard).digest(),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    others: list[float] = []
    quiet = harness.Quiet(args.wait_idle, 0)
    for turn in range(args.rounds):
        quiet.wait()
        busy, own, t0 = harness.system_busy_seconds(), harness.own_cpu_seconds(), time.perf_counter()
        for name in harness.in_turn(list(cases), turn):
            start = time.perf_counter()
            cases[name]()
            times[name].append(time.perf_counter() - start)
        wall = time.perf_counter() - t0
        others.append(max(0.0, (harness.system_busy_seconds() - busy) - (harness.own_cpu_seconds() - own))
                      / ((os.cpu_count() or 1) * wall))
    shutil.rmtree(root, ignore_errors=True)

    median = {name: statistics.median(v) for name, v in times.items()}
    print(f"{total_mib:.0f} MiB in {count} tensors, one process, {args.rounds} rounds (medians); "
          f"others' CPU {100 * max(others):.0f}% at most")
    print(f"{'':30s} {'seconds':>8s} {'MiB/s':>8s}")
    for name, seconds in median.items():
        size = len(shard) / 2**20 if name.startswith("hash") else total_mib
        print(f"{name:30s} {seconds:8.3f} {size / seconds:8.0f}")
    pairs = [("save, sharded + checksums", "save, sharded"), ("load, sharded + checksums", "load, sharded"),
             ("load, one file + CRC check", "load, one file"), ("hash, blake2b", "hash, zlib.crc32")]
    for a, b in pairs:
        print(f"{a} / {b}: {median[a] / median[b]:.2f}x")
    harness.write_json(args.json, {"mib": total_mib, "times": times, "others_cpu": others})
    print(harness.wall_time_line(started))


if __name__ == "__main__":
    main()
