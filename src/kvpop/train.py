"""Train a KVpop scorer with the LLM frozen (method.md sections 3-6).

Each step: a batch of packed training sequences -> one no-grad forward of the LLM that
captures every layer's keys/values and future-attention targets (``kvpop.capture``) ->
teacher labels at every exit step (``kvpop.teacher``) -> the scorer's parallel form over the
sequence -> the boundary loss (or MSE on the log target, for ablation). Runs on one process
or many under ``torchrun`` (DistributedDataParallel; gloo on CPU, NCCL on GPU); each rank
takes its own slice of the batch. Checkpoints are atomic and a killed run resumes from the
last one with the same data order.

    kvpop train --scorer mlstm --out runs/mlstm --steps 200
    torchrun --nproc_per_node 2 -m kvpop.train --scorer mlp --out runs/mlp
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm.auto import tqdm

from .capture import collect
from .checkpoint import atomic_write, model_fingerprint, save_scorer
from .config import EvictionConfig, attention_shape
from .scorers import ScorerConfig, ScorerStack, build_scorer
from .targets import loss_mask
from .teacher import teacher_labels

IN_DOMAIN = ("shakespeare", "paul_graham", "wikipedia")


@dataclass
class TrainConfig:
    scorer: str = "mlstm"  # "mlp" | "mlstm"
    out: str = "runs/scorer"
    model: str | None = None
    corpora: tuple[str, ...] = IN_DOMAIN
    docs_from: str | None = None  # a folder of .txt / a .jsonl of the user's own texts instead of corpora
    seq_len: int = 1024
    batch_size: int = 1  # sequences per step, over all ranks
    budget: int = 256
    window: int = 32
    sinks: int = 4
    lam: float = 0.0
    loss: str = "boundary"  # "boundary" | "mse"
    tau: float = 1.0
    steps: int = 100
    lr: float = 3e-3
    weight_decay: float = 0.0
    seed: int = 0
    pool: int = 0  # >0: cycle over the first `pool` sequences (captures kept in memory)
    val_sequences: int = 2
    eval_every: int = 25
    ckpt_every: int = 25
    hidden: int = 64
    dk: int = 32
    dv: int = 32
    stop_after: int | None = None  # end this process after that many total steps (as if killed); rerun resumes
    check_sync: bool = False  # DDP test aid: assert identical weights on all ranks after each step
    progress: bool = True

    def eviction(self) -> EvictionConfig:
        return EvictionConfig.from_budget(self.budget, window=self.window, sinks=self.sinks, lam=self.lam)

    def validate(self) -> None:
        if self.scorer not in ("mlp", "mlstm"):
            raise ValueError(f"scorer must be 'mlp' or 'mlstm', got {self.scorer!r}")
        if self.loss not in ("boundary", "mse"):
            raise ValueError(f"loss must be 'boundary' or 'mse', got {self.loss!r}")
        ev = self.eviction()
        if self.seq_len < ev.sinks + 2 * ev.window + 2:
            raise ValueError(f"seq_len={self.seq_len} too short for window={ev.window}: need > sinks + 2 * window")
        for name in ("steps", "batch_size", "eval_every", "ckpt_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or self.tau <= 0:
            raise ValueError("lr and tau must be > 0")


# --- data -------------------------------------------------------------------------------
def _documents(cfg: TrainConfig, split: str):
    from . import data

    if cfg.docs_from:
        docs = data.read_user_documents(cfg.docs_from)
        return data.split_documents(docs, split) or docs
    out = []
    for name in cfg.corpora:
        out.extend(data.load_documents(name, split))
    return out


def sequence_stream(cfg: TrainConfig, tokenizer, split: str = "train"):
    """Deterministic endless stream of packed sequences (reshuffled each epoch from ``seed``)."""
    from . import data

    docs = _documents(cfg, split)
    for epoch in itertools.count():
        n = 0
        for ids in data.iter_packed(tokenizer, docs, cfg.seq_len, seed=cfg.seed + epoch):
            n += 1
            yield ids
        if n == 0:
            raise ValueError(f"no {split} sequence of {cfg.seq_len} tokens in the training documents")


# --- examples and loss ------------------------------------------------------------------
@dataclass
class Example:
    keys: list[torch.Tensor]  # per layer [b, h, S, d]
    values: list[torch.Tensor]
    targets: torch.Tensor  # [L, b, h, S]
    t_new: torch.Tensor  # [L, b, h, Q]
    t_bnd: torch.Tensor
    y: torch.Tensor
    valid: torch.Tensor


@torch.no_grad()
def make_example(model, ids: torch.Tensor, ev: EvictionConfig) -> Example:
    caps = collect(model, ids, window=ev.window)
    targets = torch.stack([c.target.float() for c in caps])  # [L, b, h, S]
    L, b, h, S = targets.shape
    lab = teacher_labels(targets.reshape(L * b, h, S), ev.window, ev.k, ev.sinks, lam=ev.lam, min_future=ev.window)
    shape = (L, b, h, -1)
    return Example(
        keys=[c.keys.float() for c in caps],
        values=[c.values.float() for c in caps],
        targets=targets,
        t_new=lab.t_new.reshape(shape),
        t_bnd=lab.t_bnd.reshape(shape),
        y=lab.y.reshape(shape),
        valid=lab.valid.reshape(shape),
    )


def layer_scores(scorer, ex: Example, layer: int, window: int) -> torch.Tensor:
    return scorer.forward_layer(layer, ex.keys[layer], ex.values[layer], window)


def boundary_terms(scores: torch.Tensor, ex: Example, layer: int):
    """``(margin, y, valid)`` of the teacher's boundary decisions for one layer."""
    t_new, t_bnd = ex.t_new[layer], ex.t_bnd[layer]
    r_new = scores.gather(2, t_new)
    r_bnd = scores.gather(2, t_bnd.clamp(min=0))
    return r_new - r_bnd, ex.y[layer], ex.valid[layer]


def layer_loss(scores, ex: Example, layer: int, cfg: TrainConfig) -> torch.Tensor:
    if cfg.loss == "mse":
        target = ex.targets[layer]
        m = loss_mask(target.shape[-1], cfg.window, device=target.device).expand_as(target) & torch.isfinite(target)
        return ((scores - target)[m] ** 2).mean() if m.any() else scores.sum() * 0
    margin, y, valid = boundary_terms(scores, ex, layer)
    if not valid.any():
        return scores.sum() * 0
    return F.softplus(-y * margin / cfg.tau)[valid].mean()


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = a.argsort().argsort().double()
    rb = b.argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = (ra.norm() * rb.norm()).item()
    return float((ra * rb).sum().item() / den) if den > 0 else 0.0


@torch.no_grad()
def decision_metrics(score_fn, examples: list[Example], window: int) -> dict[str, float]:
    """Boundary decision accuracy and Spearman rank correlation with the teacher's targets.

    ``score_fn(ex, layer) -> [b, h, S]`` scores; averaged over layers, heads and sequences.
    """
    correct = total = 0
    rhos = []
    for ex in examples:
        L, b, h, S = ex.targets.shape
        m = loss_mask(S, window)
        for layer in range(L):
            scores = score_fn(ex, layer).float()
            margin, y, valid = boundary_terms(scores, ex, layer)
            pred = torch.where(margin > 0, 1.0, -1.0)
            correct += int(((pred == y) & valid).sum())
            total += int(valid.sum())
            for bi in range(b):
                for hi in range(h):
                    t = ex.targets[layer, bi, hi]
                    keep = m & torch.isfinite(t)
                    if keep.sum() > 2:
                        rhos.append(_spearman(scores[bi, hi][keep], t[keep]))
    return {
        "decision_accuracy": correct / max(1, total),
        "rank_correlation": sum(rhos) / max(1, len(rhos)),
        "decisions": total,
    }


def baseline_score_fn(name: str):
    """Scores of the heuristic baselines on captured keys, for the same metrics."""
    if name == "knorm":
        return lambda ex, layer: -ex.keys[layer].norm(dim=-1)
    if name == "random":

        def rnd(ex, layer):
            g = torch.Generator().manual_seed(1000 + layer)
            return torch.rand(ex.targets.shape[1:], generator=g)

        return rnd
    raise ValueError(f"unknown baseline {name!r}")


class AllLayers(torch.nn.Module):
    """Every layer's scores in one forward, so DistributedDataParallel can wrap the stack."""

    def __init__(self, scorer: ScorerStack):
        super().__init__()
        self.scorer = scorer

    def forward(self, keys: list[torch.Tensor], values: list[torch.Tensor], window: int) -> list[torch.Tensor]:
        return [self.scorer.forward_layer(i, k, v, window) for i, (k, v) in enumerate(zip(keys, values))]


# --- distributed ------------------------------------------------------------------------
def _dist_setup() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _weights_digest(module: torch.nn.Module) -> torch.Tensor:
    return torch.stack([p.detach().double().sum() for p in module.parameters()]).sum().view(1)


# --- the loop ---------------------------------------------------------------------------
def _state_path(out: Path) -> Path:
    return out / "train_state.pt"


def train(cfg: TrainConfig, model=None, tokenizer=None) -> dict:
    """Run training; returns a summary dict (also written to ``out/summary.json``)."""
    cfg.validate()
    ev = cfg.eviction()
    rank, world = _dist_setup()
    if cfg.batch_size % world:
        raise ValueError(f"batch_size={cfg.batch_size} must be a multiple of the number of processes ({world})")
    out = Path(cfg.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    if model is None:
        from .models import load_model

        model, tokenizer = load_model(cfg.model, progress=rank == 0 and cfg.progress)
    model.eval().requires_grad_(False)
    shape = attention_shape(model.config)
    scfg = ScorerConfig(
        kind=cfg.scorer,
        num_layers=shape.num_layers,
        kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        hidden=cfg.hidden,
        dk=cfg.dk,
        dv=cfg.dv,
        seed=cfg.seed,
    )
    scorer: ScorerStack = build_scorer(scfg)
    opt = torch.optim.AdamW(scorer.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps)))
    step = 0
    history: list[dict] = []
    state_file = _state_path(out)
    if state_file.exists():
        blob = torch.load(state_file, map_location="cpu", weights_only=False)
        if blob["config"]["scorer"] != cfg.scorer or blob["config"]["seq_len"] != cfg.seq_len:
            raise ValueError(f"{state_file} belongs to a different run (scorer/seq_len differ); use another --out")
        scorer.load_state_dict(blob["scorer"])
        opt.load_state_dict(blob["optimizer"])
        sched.load_state_dict(blob["scheduler"])
        step, history = blob["step"], blob["history"]
        if rank == 0 and cfg.progress:
            print(f"[kvpop train] resuming from step {step} ({state_file})", file=sys.stderr)
    all_layers = AllLayers(scorer)
    net = torch.nn.parallel.DistributedDataParallel(all_layers) if world > 1 else all_layers

    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    per_rank = cfg.batch_size // world
    # validation sequences: fixed, from the validation split (rank 0 evaluates)
    val_examples = []
    if rank == 0:
        val_stream = sequence_stream(TrainConfig(**{**asdict(cfg), "seed": 12345}), tokenizer, "validation")
        val_examples = [make_example(model, next(val_stream).unsqueeze(0), ev) for _ in range(cfg.val_sequences)]

    stream = sequence_stream(cfg, tokenizer, "train")
    pool_ids = [next(stream) for _ in range(cfg.pool)] if cfg.pool else []
    pool_examples: dict[tuple[int, ...], Example] = {}
    if not cfg.pool:
        for _ in range(step * cfg.batch_size):  # resume: same data order
            next(stream)

    def batch_for(s: int) -> Example:
        if cfg.pool:
            idx = tuple((s * cfg.batch_size + j) % cfg.pool for j in range(rank * per_rank, (rank + 1) * per_rank))
            if idx not in pool_examples:
                pool_examples[idx] = make_example(model, torch.stack([pool_ids[i] for i in idx]), ev)
            return pool_examples[idx]
        seqs = [next(stream) for _ in range(cfg.batch_size)]
        return make_example(model, torch.stack(seqs[rank * per_rank : (rank + 1) * per_rank]), ev)

    bar = tqdm(total=cfg.steps, initial=step, disable=not (cfg.progress and rank == 0), desc=f"train {cfg.scorer}")
    t_start = time.perf_counter()
    tokens = 0
    while step < cfg.steps:
        ex = batch_for(step)
        scorer.train()
        opt.zero_grad(set_to_none=True)
        all_scores = net(ex.keys, ex.values, ev.window)
        loss = torch.stack([layer_loss(sc, ex, layer, cfg) for layer, sc in enumerate(all_scores)]).mean()
        loss.backward()  # DDP averages gradients over ranks here
        torch.nn.utils.clip_grad_norm_(scorer.parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1
        tokens += cfg.batch_size * cfg.seq_len
        if cfg.check_sync and world > 1:
            d = _weights_digest(scorer)
            all_d = [torch.zeros_like(d) for _ in range(world)]
            dist.all_gather(all_d, d)
            if not all(torch.equal(all_d[0], x) for x in all_d):
                raise RuntimeError(f"ranks diverged at step {step}: {[float(x) for x in all_d]}")
        record = {"step": step, "loss": loss.item(), "lr": sched.get_last_lr()[0]}
        if rank == 0 and (step % cfg.eval_every == 0 or step == cfg.steps) and val_examples:
            scorer.eval()
            with torch.no_grad():
                record.update({f"val_{k}": v for k, v in decision_metrics(lambda e, l: layer_scores(scorer, e, l, ev.window), val_examples, ev.window).items()})
        history.append(record)
        bar.set_postfix(loss=f"{loss.item():.4f}", tok_s=f"{tokens / (time.perf_counter() - t_start):.0f}")
        bar.update(1)
        if rank == 0 and (step % cfg.ckpt_every == 0 or step == cfg.steps):
            _checkpoint(cfg, out, scorer, opt, sched, step, history, model, ev)
        if world > 1:
            dist.barrier()
        if cfg.stop_after is not None and step >= cfg.stop_after:
            break
    bar.close()
    summary = {"steps": step, "history": history, "seconds": time.perf_counter() - t_start, "config": asdict(cfg)}
    if rank == 0:
        if val_examples:
            summary["validation"] = {
                cfg.scorer: decision_metrics(lambda e, l: layer_scores(scorer.eval(), e, l, ev.window), val_examples, ev.window),
                **{b: decision_metrics(baseline_score_fn(b), val_examples, ev.window) for b in ("knorm", "random")},
            }
        atomic_write(out / "summary.json", lambda tmp: Path(tmp).write_text(json.dumps(summary, indent=2, default=str)))
    return summary


def _checkpoint(cfg, out, scorer, opt, sched, step, history, model, ev) -> None:
    meta = {
        "trained_for": {"budget": ev.budget, "window": ev.window, "sinks": ev.sinks, "k": ev.k, "lam": ev.lam},
        "seq_len": cfg.seq_len,
        "corpora": list(cfg.corpora) if not cfg.docs_from else ["user:" + str(cfg.docs_from)],
        "loss": cfg.loss,
        "steps": step,
        "fingerprint": model_fingerprint(model),
    }
    save_scorer(scorer, out / "scorer.safetensors", meta)
    blob = {
        "scorer": scorer.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "step": step,
        "history": history,
        "config": asdict(cfg),
    }
    atomic_write(_state_path(out), lambda tmp: torch.save(blob, tmp))


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="kvpop train", description="Train a KVpop scorer (LLM frozen).")
    d = TrainConfig()
    p.add_argument("--kind", dest="scorer", choices=["mlp", "mlstm"], default=d.scorer, help="scorer kind (default %(default)s)")
    p.add_argument("--out", required=True, help="output folder (checkpoints, summary.json); an existing run resumes")
    p.add_argument("--model", default=None, help="local HF folder or .gguf (default: embedded SmolLM2)")
    p.add_argument("--corpora", default=",".join(d.corpora), help="comma-separated corpus names (kvpop.data)")
    p.add_argument("--docs-from", default=None, help="train on your own texts: a folder of .txt or a .jsonl")
    for name in ("seq_len", "batch_size", "budget", "window", "sinks", "steps", "seed", "pool", "val_sequences", "eval_every", "ckpt_every", "hidden", "dk", "dv"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("lam", "tau", "lr", "weight_decay"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    p.add_argument("--loss", choices=["boundary", "mse"], default=d.loss)
    p.add_argument("--check-sync", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-progress", action="store_true")
    return p


def config_from_args(args) -> TrainConfig:
    kw = {k: v for k, v in vars(args).items() if k in TrainConfig.__dataclass_fields__}
    kw["corpora"] = tuple(c for c in args.corpora.split(",") if c)
    kw["progress"] = not args.no_progress
    return TrainConfig(**kw)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    cfg.validate()  # bad input fails before the model loads
    summary = train(cfg)
    if int(os.environ.get("RANK", "0")) == 0 and "validation" in summary:
        print(json.dumps(summary["validation"], indent=2))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
