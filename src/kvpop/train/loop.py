"""The training loop: capture -> teacher labels -> scorer forward -> boundary loss, with the LLM frozen.

Runs on one process or several under ``torchrun`` (DistributedDataParallel; gloo on CPU, NCCL
on CUDA with ``--device cuda``): each rank takes its own sequences of a step. Checkpoints are
atomic; a killed run resumes from its last checkpoint with the same data order, and refuses to
resume with settings that would make it a different run. Every ``val_every`` steps, rank 0
measures retention under the real cache on validation windows and keeps the best checkpoint.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ..checkpoint import fingerprint_diff, model_fingerprint, read_header, save_scorer, scorer_writer
from ..config import attention_shape
from ..files import atomic_writes, check_writable_dir, clean_leftovers, write_json
from ..rope import RopeSpec
from ..scorers import ScorerConfig, ScorerStack, build_scorer
from .config import TrainConfig
from .data import CaptureStore, Example, SequenceSource, capture_example, example_for
from .labels import decision_metrics, labels_for, layer_loss


class AllLayers(torch.nn.Module):
    """Every layer's scores in one forward, so DistributedDataParallel can wrap the stack."""

    def __init__(self, scorer: ScorerStack):
        super().__init__()
        self.scorer = scorer

    def forward(self, keys, values, window: int, observed) -> list[torch.Tensor]:
        return [
            self.scorer.forward_layer(i, keys[i], values[i], window, observed=None if observed is None else observed[i])
            for i in range(keys.shape[0])
        ]


def _dist_setup(device: str) -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _weights_digest(module: torch.nn.Module) -> torch.Tensor:
    return torch.stack([p.detach().double().sum() for p in module.parameters()]).sum().view(1)


def build_run_scorer(cfg: TrainConfig, model) -> ScorerStack:
    shape = attention_shape(model.config)
    scfg = ScorerConfig(
        kind=cfg.scorer, num_layers=shape.num_layers, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
        hidden=cfg.hidden, dk=cfg.dk, dv=cfg.dv, seed=cfg.seed, position_free=cfg.position_free,
        observed=cfg.observed, tilt=cfg.tilt,
    )  # fmt: skip
    scorer = build_scorer(scfg)
    if cfg.position_free:
        scorer.set_rope(RopeSpec.from_config(model.config))
    return scorer


def _state_path(out: Path) -> Path:
    return out / "train_state.pt"


def trained_for(cfg: TrainConfig) -> dict:
    """What the checkpoint's metadata says the scorer was trained for; caches default to it
    (``kvpop.config.TrainedSettings.from_meta`` reads it, ``resolve_eviction`` applies it)."""
    return cfg.trained_settings()


def _resume_mismatch(saved: dict, cfg: TrainConfig) -> list[str]:
    now = cfg.resume_view()
    return [f"{k}: checkpoint {saved.get(k)!r} vs now {now[k]!r}" for k in now if saved.get(k) != now[k]]


def train(cfg: TrainConfig, model=None, tokenizer=None) -> dict:
    """Run training (or, with ``capture_only``, fill the capture store); returns the summary dict."""
    cfg.validate()
    rank, world = _dist_setup(cfg.device)
    if cfg.batch_size % world:
        raise ValueError(f"batch_size={cfg.batch_size} must be a multiple of the number of processes ({world})")
    out = Path(cfg.out)
    state_file = _state_path(out)
    blob = None
    if state_file.exists() and not cfg.capture_only:
        blob = torch.load(state_file, map_location="cpu", weights_only=False)
        diff = _resume_mismatch(blob.get("resume", {}), cfg)
        if diff:
            raise ValueError(f"{out} holds a run with other settings; use another --out or the same settings ("
                             + "; ".join(diff) + ")")  # fmt: skip
    if rank == 0:
        check_writable_dir(out)  # before the model loads: an unwritable --out is an error, not a traceback later
        clean_leftovers(out)  # temporary files of a killed run (the folder itself is made by the first write)
    if model is None:
        from ..models import load_model

        model, tokenizer = load_model(cfg.model, progress=False)
    device = torch.device(cfg.device)
    model = model.to(device).eval().requires_grad_(False)
    fingerprint = model_fingerprint(model)
    if blob is not None:
        saved = blob.get("fingerprint") or _checkpoint_fingerprint(out)
        diff = fingerprint_diff(saved or {}, fingerprint)
        if diff:  # a run trained on two models would record only the second one
            raise ValueError(f"{out} holds a run on a different model ({', '.join(sorted(diff))} differ); use another "
                             "--out, or the model it was started with")  # fmt: skip
    store = CaptureStore(cfg.store, cfg, model) if cfg.store else None
    source = SequenceSource(cfg, tokenizer, "train")
    per_rank = cfg.batch_size // world
    if cfg.capture_only:
        return _capture_only(cfg, model, source, store, rank, world, per_rank)

    scorer = build_run_scorer(cfg, model).to(device)
    opt = torch.optim.AdamW(scorer.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    warmup = max(1, min(20, cfg.steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps))
    )
    step, history, best = 0, [], {"mean_retention": float("-inf"), "step": 0}
    if blob is not None:
        scorer.load_state_dict(blob["scorer"])
        opt.load_state_dict(blob["optimizer"])
        sched.load_state_dict(blob["scheduler"])
        step, history, best = blob["step"], blob["history"], blob.get("best", best)
        if rank == 0 and cfg.progress:
            print(f"[kvpop train] resuming from step {step} ({state_file})", file=sys.stderr)
    net = AllLayers(scorer)
    if world > 1:
        net = torch.nn.parallel.DistributedDataParallel(net)

    probe = val_examples = None
    if rank == 0 and cfg.val_docs:
        from .quality import VALIDATION_SEED, RetentionProbe

        probe = RetentionProbe(model, tokenizer, cfg, cache_dir=cfg.val_cache)
        vsrc = SequenceSource(cfg, tokenizer, "validation", seed=VALIDATION_SEED, seq_len=cfg.val_seq_len)
        val_examples = [capture_example(model, ids.view(1, -1), cfg.windows(), cfg.sinks, cfg.observed, [c])
                        for c, ids in (vsrc.get(j) for j in range(min(2, cfg.val_docs)))]  # fmt: skip

    bar = tqdm(total=cfg.steps, initial=step, disable=not (cfg.progress and rank == 0), desc=f"train {cfg.scorer}")
    t_start, tokens = time.perf_counter(), 0
    t_capture = 0.0
    while step < cfg.steps:
        j0 = step * cfg.batch_size + rank * per_rank
        t0 = time.perf_counter()
        seqs = [j % cfg.cycle if cfg.cycle else j for j in range(j0, j0 + per_rank)]
        parts = [example_for(j, source, store, model, cfg) for j in seqs]
        t_capture += time.perf_counter() - t0
        # a budget whose window this rank's sequences carry (every window, unless --windows-per-sequence)
        ev = cfg.step_eviction(step, set.intersection(*(set(p.targets) for p in parts)))
        budget, w = ev.budget, ev.window
        ex = Example.cat([p.only([w], observed=bool(cfg.observed)) for p in parts]).float(device)
        lab = labels_for(ex.targets[w].cpu(), w, ev.k, ev.sinks, ev.lam)
        if device.type != "cpu":
            lab = type(lab)(*(t.to(device) for t in (lab.t_new, lab.t_bnd, lab.y, lab.valid)))
        scorer.train()
        opt.zero_grad(set_to_none=True)
        scores = net(ex.keys, ex.values, w, ex.observed.get(w))
        loss = torch.stack([
            layer_loss(sc, ex.targets[w], lab, i, loss=cfg.loss, lam=ev.lam, tau=cfg.tau, weighting=cfg.weighting,
                       window=w)
            for i, sc in enumerate(scores)
        ]).mean()  # fmt: skip
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
        record = {"step": step, "loss": loss.item(), "lr": sched.get_last_lr()[0], "budget": budget,
                  "corpora": ex.corpora}  # fmt: skip
        if rank == 0 and probe is not None and (step % cfg.val_every == 0 or step == cfg.steps):
            q = probe(scorer, cfg.validation_budgets())
            record["val"] = q
            if q["mean_retention"] > best["mean_retention"]:
                best = {"mean_retention": q["mean_retention"], "step": step}
                _save(scorer, out / "best.safetensors", cfg, step, fingerprint, q)
            bar.write(f"[kvpop train] step {step}: validation retention " + ", ".join(
                f"B={b} {q[str(b)]['retention']:.4f} (streaming {q[str(b)]['streaming']:.4f}, "
                f"wins {q[str(b)]['wins_vs_streaming']}/{q[str(b)]['docs']})" for b in cfg.validation_budgets()))  # fmt: skip
        history.append(record)
        bar.set_postfix(loss=f"{loss.item():.4f}", tok_s=f"{tokens / (time.perf_counter() - t_start):.0f}")
        bar.update(1)
        if rank == 0 and (step % cfg.ckpt_every == 0 or step == cfg.steps):
            _checkpoint(cfg, out, scorer, opt, sched, step, history, best, fingerprint)
        if world > 1:
            dist.barrier()
        if cfg.stop_after is not None and step >= cfg.stop_after:
            break
    bar.close()
    wall = time.perf_counter() - t_start
    summary = {
        "steps": step, "tokens_seen": step * cfg.batch_size * cfg.seq_len, "seconds_this_process": wall,
        "capture_seconds": t_capture, "history": history, "best": best, "config": asdict(cfg),
        "trained_for": trained_for(cfg),
    }  # fmt: skip
    if rank == 0:
        if val_examples:
            summary["validation_decisions"] = _decisions(scorer, val_examples, cfg)
        write_json(out / "summary.json", summary)  # strict JSON: no best retention yet is null, not -Infinity
    return summary


def _checkpoint_fingerprint(out: Path) -> dict | None:
    """The model fingerprint of the run in ``out`` from its scorer checkpoint (a ``train_state.pt``
    from before it recorded its own)."""
    try:
        return read_header(out / "scorer.safetensors").get("meta", {}).get("fingerprint")
    except (FileNotFoundError, ValueError):
        return None


@torch.no_grad()
def _decisions(scorer: ScorerStack, examples: list[Example], cfg: TrainConfig) -> dict:
    """Decision diagnostics on validation captures, per training budget (see ``labels.decision_metrics``)."""
    scorer.eval()
    out = {}
    for b in cfg.validation_budgets():
        ev = cfg.grid_eviction(b)
        w = ev.window
        ex = Example.cat([e.float() for e in examples])
        lab = labels_for(ex.targets[w], w, ev.k, ev.sinks, ev.lam)
        obs = ex.observed.get(w)

        def score_layer(i, ex=ex, w=w, obs=obs):
            return scorer.forward_layer(i, ex.keys[i], ex.values[i], w, observed=None if obs is None else obs[i])

        out[str(b)] = decision_metrics(score_layer, ex.targets[w], lab, w, ev.lam, keys=ex.keys)
    return out


def _capture_only(cfg, model, source, store, rank, world, per_rank) -> dict:
    n = cfg.steps * cfg.batch_size
    mine = [j for s in range(cfg.steps) for j in range(s * cfg.batch_size + rank * per_rank,
                                                        s * cfg.batch_size + (rank + 1) * per_rank)]  # fmt: skip
    todo = [j for j in mine if not store.has(j)]
    bar = tqdm(total=len(mine), initial=len(mine) - len(todo), disable=not (cfg.progress and rank == 0),
               desc=f"capture (rank {rank})")  # fmt: skip
    t0 = time.perf_counter()
    for j in todo:
        corpus, ids = source.get(j)
        store.save(j, capture_example(model, ids.view(1, -1), store.sequence_windows(j), cfg.sinks, cfg.observed,
                                      [corpus]))  # fmt: skip
        bar.update(1)
    bar.close()
    if world > 1:
        dist.barrier()
    return {"captured": len(todo), "sequences": n, "seconds_this_process": time.perf_counter() - t0,
            "store": str(store.folder)}  # fmt: skip


def _save(scorer, path, cfg, step, fingerprint, quality=None) -> None:
    save_scorer(scorer, path, _meta(cfg, step, fingerprint, quality))


def _meta(cfg, step, fingerprint, quality=None) -> dict:
    meta = {
        "trained_for": trained_for(cfg),
        "corpora": list(cfg.corpora) if not cfg.docs_from else ["user:" + str(cfg.docs_from)],
        "loss": cfg.loss,
        "weighting": cfg.weighting,
        "steps": step,
        "tokens_seen": step * cfg.batch_size * cfg.seq_len,
        "fingerprint": fingerprint,
    }
    if quality is not None:
        meta["validation_retention"] = {
            k: ({kk: vv for kk, vv in v.items() if kk != "per_doc"} if isinstance(v, dict) else v)
            for k, v in quality.items()
        }
    return meta


def _checkpoint(cfg, out, scorer, opt, sched, step, history, best, fingerprint) -> None:
    """``train_state.pt`` (what a resume reads) and ``scorer.safetensors`` as one checkpoint: both are
    written before either replaces its previous version, so a failed write (a full disk) keeps the
    previous checkpoint whole."""
    blob = {
        "scorer": scorer.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
        "step": step, "history": history, "best": best, "config": asdict(cfg), "resume": cfg.resume_view(),
        "fingerprint": fingerprint,
    }  # fmt: skip
    try:
        atomic_writes([(_state_path(out), lambda tmp: torch.save(blob, tmp)),
                       (out / "scorer.safetensors", scorer_writer(scorer, _meta(cfg, step, fingerprint)))])  # fmt: skip
    except OSError as exc:
        raise OSError(exc.errno, f"writing the step-{step} checkpoint to {out} failed ({exc.strerror or exc}); the "
                      "previous checkpoint there is whole") from exc  # fmt: skip
