"""The loss spike of 2BW near update 150 at lr 3e-3 (docs/delay-study.md, "The spike near update 150").

Trains study cells (configs/study/) on one CPU device with a recorder that writes, for every update k: the batch's
training loss as the pipeline computed it (at ``W_{k-d}``), the same batch's loss at ``W_k`` (fresh), the lr, the
gradient norm before clipping, the update norm ``||W_{k+1} - W_k||``, and every few updates AdamW's
preconditioned sharpness ``lambda_max(P H)`` (``P = lr / (sqrt(v_hat) + eps)``, Hessian ``H`` of the batch loss at
``W_k``, power iteration on Hessian-vector products). ``report`` compares that sharpness with the linear stability
bound of AdamW's momentum under delay d (with and without the correction), draws docs/delay-spike.png and
rewrites the marked block of docs/delay-study.md.

    .venv/bin/python studies/delay/spike.py run       # 8 runs of 240 updates, one at a time, into runs/spike/
    .venv/bin/python studies/delay/spike.py report    # the table and the figure
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch
from lightning.pytorch import Callback
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs" / "study"


# ---- the stability bound (pure numbers; tests call this) -------------------------------------------------------
def spectral_radius(a: float, beta1: float, delay: int, c: float = 0.0) -> float:
    """Spectral radius of AdamW's linearized update on one eigen-direction of preconditioned curvature ``a``
    (``P H`` has eigenvalue ``a``), the gradient taken ``delay`` updates late, with the correction ``c``:

        m_k = beta1 m_{k-1} + (1 - beta1) a x_{k-d},   u_k = m_k,   x_{k+1} = x_k - u_k - c (u_k - u_{k-1})

    State ``[x_k, ..., x_{k-d}, m_{k-1}, u_{k-1}]``; bias correction and weight decay left out."""
    n = delay + 3
    M = np.zeros((n, n))
    im, iu = delay + 1, delay + 2
    # m_k in terms of the state
    m_row = np.zeros(n)
    m_row[im] = beta1
    m_row[delay] += (1 - beta1) * a
    M[0] = -(1 + c) * m_row
    M[0, 0] += 1.0
    M[0, iu] += c
    for i in range(1, delay + 1):  # shift the history
        M[i, i - 1] = 1.0
    M[im] = m_row
    M[iu] = m_row
    return float(max(abs(np.linalg.eigvals(M))))


def stability_bound(beta1: float, delay: int, c: float = 0.0, hi: float = 200.0) -> float:
    """The largest preconditioned curvature ``a`` below which the recurrence above is stable (by bisection on
    the first crossing of radius 1 from a small ``a``)."""
    lo_a, hi_a = 1e-6, 1e-6
    step = 0.01
    while hi_a < hi and spectral_radius(hi_a, beta1, delay, c) <= 1 + 1e-9:
        lo_a, hi_a = hi_a, hi_a + step
        step *= 1.05
    if hi_a >= hi:
        return math.inf
    for _ in range(60):
        mid = (lo_a + hi_a) / 2
        if spectral_radius(mid, beta1, delay, c) <= 1 + 1e-9:
            lo_a = mid
        else:
            hi_a = mid
    return lo_a


# ---- the recorder ----------------------------------------------------------------------------------------------
class SpikeRecorder(Callback):
    """Per-update figures into ``rows`` (see the module docstring); never changes training (no ``.grad`` written,
    no random numbers drawn)."""

    def __init__(self, sharpness_every: int = 0, power_iters: int = 15) -> None:
        self.sharpness_every, self.power_iters = sharpness_every, power_iters
        self.rows: list[dict[str, Any]] = []
        self._batch: Any = None
        self._row: dict[str, Any] = {}
        self._before: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._batch = batch

    @torch.no_grad()
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        k = trainer.global_step
        params = [p for p in pl_module.parameters() if p.requires_grad]
        grad_norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params if p.grad is not None))
        fresh = float(pl_module.pipeline_loss(pl_module.pipeline_forward(self._batch), self._batch))
        self._row = {"k": k, "lr": optimizer.param_groups[0]["lr"], "grad_norm": grad_norm, "fresh_loss": fresh,
                     "batch_sum": int(self._batch.sum())}
        if self.sharpness_every and k > 0 and k % self.sharpness_every == 0:
            self._row["sharpness"] = self._sharpness(pl_module, optimizer, params)
        self._before = [p.detach().clone() for p in params]  # W_k (the strategy already re-pointed the slots)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        params = [p for p in pl_module.parameters() if p.requires_grad]
        update = math.sqrt(sum(float((p.detach() - b).double().pow(2).sum()) for p, b in zip(params, self._before)))
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.rows.append(dict(self._row, loss=float(loss), update_norm=update))

    def _sharpness(self, pl_module, optimizer, params) -> Optional[float]:
        opt = getattr(optimizer, "optimizer", optimizer)
        opt = getattr(opt, "wrapped", opt)  # ErrorFeedback
        group = opt.param_groups[0]
        beta2, eps, lr = group["betas"][1], group["eps"], group["lr"]
        scale = []
        for p in params:
            state = opt.state.get(p, {})
            if "exp_avg_sq" not in state:
                return None
            v_hat = state["exp_avg_sq"] / (1 - beta2 ** float(state["step"]))
            scale.append((lr / (v_hat.sqrt() + eps)).sqrt())  # P^{1/2}
        # the math attention kernel: the fused CPU kernels have no double backward
        with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
            loss = pl_module.pipeline_loss(pl_module.pipeline_forward(self._batch), self._batch)
            grads = torch.autograd.grad(loss, params, create_graph=True)
            gen = torch.Generator().manual_seed(0)
            v = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]
            eig = 0.0
            for _ in range(self.power_iters):
                norm = math.sqrt(sum(float(x.pow(2).sum()) for x in v))
                v = [x / norm for x in v]
                hv = torch.autograd.grad(grads, params, grad_outputs=[s * x for s, x in zip(scale, v)],
                                         retain_graph=True)
                w = [s * h for s, h in zip(scale, hv)]  # P^{1/2} H P^{1/2} v
                eig = sum(float((x * y).sum()) for x, y in zip(v, w))
                v = [y.detach() for y in w]
        return eig


# ---- the runs --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SpikeRun:
    name: str
    cell: str
    lr: float = 3e-3
    seed: int = 0
    data_seed: int = 0
    sharpness_every: int = 0


RUNS = (
    SpikeRun("adamw_sync", "adamw_sync", sharpness_every=10),
    SpikeRun("adamw_2bw", "adamw_2bw", sharpness_every=10),
    SpikeRun("adamw_2bw_data1", "adamw_2bw", data_seed=1),  # same initialization, another data order
    SpikeRun("adamw_sync_data1", "adamw_sync", data_seed=1),
    SpikeRun("adamw_2bw_init1", "adamw_2bw", seed=1),  # another initialization, same batches
    SpikeRun("adamw_2bw_ef", "adamw_2bw_ef", sharpness_every=10),
    SpikeRun("adamw_2bw_lr1e-3", "adamw_2bw", lr=1e-3, sharpness_every=10),
    SpikeRun("muon_2bw", "muon_2bw"),
)
#: The runs stop at update 240 of the 300-update schedule (the lr schedule is unchanged): the spike is near 150.
STOP = 240


def train(run: SpikeRun, out: Path, extra: Sequence[str] = ()) -> None:
    from lightning_async_pp.cli import AsyncPipelineCLI

    torch.set_num_threads(1)
    lr_key = "optimizer.init_args.optimizer.init_args.lr" if run.cell.endswith("_ef") else "optimizer.init_args.lr"
    args = ["--config", str(CONFIGS / "base.yaml"), "--config", str(CONFIGS / f"{run.cell}.yaml"),
            f"--{lr_key}={run.lr}", f"--seed_everything={run.seed}", f"--data.seed={run.data_seed}",
            f"--trainer.logger.init_args.save_dir={out}", "--trainer.logger.init_args.name=tb",
            f"--trainer.logger.init_args.version={run.name}", f"--trainer.max_steps={STOP}", *extra]
    cli = AsyncPipelineCLI(args=args, run=False)
    recorder = SpikeRecorder(sharpness_every=run.sharpness_every)
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    (out / f"{run.name}.json").write_text(json.dumps({"run": run.__dict__, "rows": recorder.rows}))


# ---- the report ------------------------------------------------------------------------------------------------
def load(out: Path) -> dict[str, list[dict]]:
    return {p.stem: json.loads(p.read_text())["rows"] for p in sorted(out.glob("*.json"))}


def spike_window(rows: Sequence[dict], lo: int = 60, hi: int = 300, width: int = 10) -> tuple[int, float]:
    """The update in ``[lo, hi)`` where the training loss rises most above its own running mean of the previous
    ``width`` updates, and that rise."""
    losses = [r["loss"] for r in rows]
    lo = min(lo, len(losses) // 5)
    best = (lo, -math.inf)
    for k in range(max(lo, width), min(hi, len(losses))):
        rise = losses[k] - sum(losses[k - width:k]) / width
        if rise > best[1]:
            best = (k, rise)
    return best


def report(out: Path, figure: Path) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = load(out)
    lines = ["| run | biggest rise (update, loss above its previous-10 mean) | lr there | grad norm there (median over run) "
             "| update norm there (median) | loss(W_k) - loss(W_{k-1}) there | largest grad norm after update 10 (at) |",
             "|---|---|---|---|---|---|---|"]
    for name, rows in runs.items():
        k, rise = spike_window(rows)
        r = rows[k]
        med_g = float(np.median([x["grad_norm"] for x in rows]))
        med_u = float(np.median([x["update_norm"] for x in rows]))
        lines.append(f"| {name} | {k}: +{rise:.3f} | {r['lr']:.2e} | {r['grad_norm']:.2f} ({med_g:.2f}) "
                     f"| {r['update_norm']:.3f} ({med_u:.3f}) | {r['fresh_loss'] - r['loss']:+.3f} "
                     f"| {max(x['grad_norm'] for x in rows[10:]):.1f} ({max(rows[10:], key=lambda x: x['grad_norm'])['k']}) |")
    bounds = {"sync (d=0)": stability_bound(0.9, 0), "2BW (d=1)": stability_bound(0.9, 1),
              "2BW + correction (d=1, c=1)": stability_bound(0.9, 1, 1.0)}
    lines += ["", "Linear stability bound on AdamW's preconditioned sharpness (beta1 = 0.9): "
              + ", ".join(f"{k} {v:.1f}" for k, v in bounds.items())]
    sharp_lines = []
    for name, rows in runs.items():
        pts = [(r["k"], r["sharpness"]) for r in rows if r.get("sharpness") is not None]
        if pts:
            first = next((k for k, s in pts if s > bounds["2BW (d=1)"]), None)
            sharp_lines.append(f"| {name} | {max(s for _, s in pts):.1f} | {first if first is not None else 'never'} "
                               f"| {float(np.median([s for k, s in pts if 100 <= k < 200])):.1f} |")
    if sharp_lines:
        lines += ["", "| run | max preconditioned sharpness | first update above the d=1 bound | median over updates 100-199 |",
                  "|---|---|---|---|", *sharp_lines]

    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    colors = {"adamw_sync": "tab:blue", "adamw_2bw": "tab:red", "adamw_2bw_ef": "tab:green",
              "adamw_2bw_init1": "tab:orange", "adamw_2bw_data1": "tab:purple", "adamw_sync_data1": "tab:cyan",
              "muon_2bw": "tab:brown", "adamw_2bw_lr1e-3": "tab:gray"}

    def smooth(xs: Sequence[float], w: int = 5) -> list[float]:
        return [sum(xs[max(0, i - w + 1):i + 1]) / (i + 1 - max(0, i - w + 1)) for i in range(len(xs))]

    ax = axes[0, 0]
    for name in ("adamw_sync", "adamw_2bw", "adamw_2bw_ef", "muon_2bw", "adamw_2bw_lr1e-3"):
        if name in runs:
            ax.plot([r["k"] for r in runs[name]], smooth([r["loss"] for r in runs[name]]), color=colors[name], label=name, lw=1)
    ax.set(title="training loss per update (5-update mean), same batches", xlabel="update", ylabel="loss", ylim=(2.2, 3.6))
    ax.legend(fontsize=8)
    ax = axes[0, 1]
    for name, ref in (("adamw_2bw", "adamw_sync"), ("adamw_2bw_init1", "adamw_sync"), ("adamw_2bw_data1", "adamw_sync_data1"),
                      ("adamw_2bw_ef", "adamw_sync")):
        if name in runs and ref in runs:
            diff = [a["loss"] - b["loss"] for a, b in zip(runs[name], runs[ref])]
            ax.plot(range(len(diff)), smooth(diff), color=colors[name], label=f"{name} - {ref}", lw=1)
    ax.axhline(0, color="k", lw=0.8)
    ax.set(title="per-batch loss difference to sync (5-update mean)", xlabel="update", ylabel="loss difference")
    ax.legend(fontsize=8)
    ax = axes[1, 0]
    for name in ("adamw_sync", "adamw_2bw", "adamw_2bw_ef"):
        if name in runs:
            ax.plot([r["k"] for r in runs[name]], [r["grad_norm"] for r in runs[name]], color=colors[name], lw=1,
                    label=f"{name}: grad norm (pre-clip)")
            ax.plot([r["k"] for r in runs[name]], [100 * r["update_norm"] for r in runs[name]], color=colors[name], lw=1,
                    ls=":", label=f"{name}: 100 x update norm")
    ax.set(title="gradient norm before clipping (clip at 1.0) and update norm", xlabel="update", yscale="log")
    ax.legend(fontsize=7)
    ax = axes[1, 1]
    for name, rows in runs.items():
        pts = [(r["k"], r["sharpness"]) for r in rows if r.get("sharpness") is not None]
        if pts:
            ax.plot(*zip(*pts), color=colors.get(name), marker=".", lw=1, label=name)
    for (label, b), ls in zip(bounds.items(), ("-", "--", ":")):
        ax.axhline(b, color="k", ls=ls, lw=0.9, label=f"bound {label}: {b:.1f}")
    ax.set(title="AdamW preconditioned sharpness lambda_max(P H) on the batch", xlabel="update", yscale="log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(figure, dpi=100)
    plt.close(fig)
    return "\n".join(lines)


BEGIN, END = "<!-- spike.py results: begin -->", "<!-- spike.py results: end -->"


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("run", "report"))
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "spike")
    parser.add_argument("--only", nargs="*", help="run only these names")
    parser.add_argument("--extra", nargs="*", default=[], help="more CLI overrides for every run (smoke tests)")
    parser.add_argument("--figure", type=Path, default=ROOT / "docs" / "delay-spike.png")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.what == "run":
        for run in RUNS:
            if (args.out / f"{run.name}.json").exists() or (args.only and run.name not in args.only):
                continue
            print(f"training {run.name}", flush=True)
            train(run, args.out, args.extra)
    text = report(args.out, args.figure)
    (args.out / "results.md").write_text(text)
    doc = ROOT / "docs" / "delay-study.md"
    body = doc.read_text() if doc.exists() else ""
    start, stop = body.find(BEGIN), body.find(END)
    if 0 <= start < stop:  # the marked block of docs/delay-study.md
        doc.write_text(f"{body[:start + len(BEGIN)]}\n{text}\n{body[stop:]}")
    print(text)


if __name__ == "__main__":
    sys.exit(main())
