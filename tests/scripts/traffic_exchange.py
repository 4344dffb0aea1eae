"""Two processes (RANK 0 and 1, env:// rendezvous) exchange tensors over gloo on CPU with every kind of call the
traffic recorder wraps; each writes {"ok": whether it received what was sent} to the path it is given.

Run by tests/test_traffic_rules.py with the recorder installed through tests/traffic_hook/sitecustomize.py.
"""
from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist


def main(out: str) -> None:
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    ok = True
    x1, x2 = torch.arange(32, dtype=torch.float32).reshape(4, 8), torch.tensor([1.0, 2.0, 3.0])
    y, z, w, v = torch.full((2, 3), 4.0), torch.full((5,), 6.0, dtype=torch.float64), torch.ones(3), torch.zeros(2)
    if rank == 0:
        works = [dist.isend(x1, 1, tag=5), dist.isend(x2, 1, tag=7)]  # two messages on distinct tags, in order
        loss = torch.empty(1, dtype=torch.float64)
        works.append(dist.irecv(loss, 1, tag=9))
        for work in works:
            work.wait()
        ok &= loss[0].item() == 2.5  # a host read of a received tensor
        got_z = torch.empty_like(z)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, y, 1), dist.P2POp(dist.irecv, got_z, 1)]):
            work.wait()
        ok &= torch.equal(got_z, z)
        dist.send(w, 1)
        got_v = torch.empty_like(v)
        dist.recv(got_v, 1)
        ok &= torch.equal(got_v, v)
    else:
        got_x1, got_x2 = torch.empty_like(x1), torch.empty_like(x2)
        works = [dist.irecv(got_x1, 0, tag=5), dist.irecv(got_x2, 0, tag=7)]
        works.append(dist.isend(torch.tensor([2.5], dtype=torch.float64), 0, tag=9))
        for work in works:
            work.wait()
        ok &= torch.equal(got_x1, x1) and torch.equal(got_x2, x2)
        got_y = torch.empty_like(y)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, got_y, 0), dist.P2POp(dist.isend, z, 0)]):
            work.wait()
        ok &= torch.equal(got_y, y)
        got_w = torch.empty_like(w)
        dist.recv(got_w, 0)
        ok &= torch.equal(got_w, w)
        dist.send(v, 0)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    ok &= torch.equal(total, torch.tensor([3.0]))
    gathered = [None, None]
    dist.all_gather_object(gathered, {"rank": rank})
    ok &= gathered == [{"rank": 0}, {"rank": 1}]
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"ok": bool(ok)}, f)


if __name__ == "__main__":
    main(sys.argv[1])
