"""The training loop: capture -> teacher labels -> scorer forward -> boundary loss, with the LLM frozen.

Runs on one process or several under ``torchrun`` (DistributedDataParallel; gloo on CPU, NCCL
on CUDA with ``--device cuda``): each rank takes its own sequences of a step. The run around the
steps (resume check, schedule, validation-best, checkpoints, summary) is :class:`kvpop.train.runs.Run`:
a killed run resumes from its last checkpoint with the same data order, and refuses to resume
with settings that would make it a different run. Every ``val_every`` steps, rank 0 measures
retention under the real cache on validation windows and keeps the best checkpoint.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from .. import models
from ..checkpoint import model_fingerprint, read_header, save_scorer, scorer_writer
from ..config import attention_shape
from ..files import atomic_writes
from ..rope import RopeSpec
from ..scorers import ScorerConfig, ScorerStack, build_scorer
from .config import TrainConfig
from .data import CaptureStore, Example, SequenceSource, capture_example, example_for
from .labels import decision_metrics, labels_for, layer_loss
from .quality import VALIDATION_SEED, RetentionProbe
from .runs import Run, cosine_schedule, write_state


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


def build_run_scorer(cfg: TrainConfig, model) -> ScorerStack:
    shape = attention_shape(model.config)
    scfg = ScorerConfig(
        kind=cfg.scorer,
        num_layers=len(shape.bounded),
        kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        hidden=cfg.hidden,
        dk=cfg.dk,
        dv=cfg.dv,
        seed=cfg.seed,
        position_free=cfg.position_free,
        observed=cfg.observed,
        tilt=cfg.tilt,
        cross_heads=cfg.cross_heads,
    )
    scorer = build_scorer(scfg)
    if cfg.position_free:
        scorer.set_rope(RopeSpec.from_config(model.config))
    return scorer


def trained_for(cfg: TrainConfig) -> dict:
    """What the checkpoint's metadata says the scorer was trained for; caches default to it
    (``kvpop.config.TrainedSettings.from_meta`` reads it, ``resolve_eviction`` applies it)."""
    return cfg.trained_settings()


class ScorerTraining:
    """The program :class:`kvpop.train.runs.Run` drives: one step of the boundary (or MSE) loss on a batch of
    captured sequences, validation under the real cache, the scorer's checkpoints."""

    def __init__(
        self,
        run: Run,
        cfg: TrainConfig,
        model,
        tokenizer,
        source: SequenceSource,
        store: CaptureStore | None,
        blob: dict | None,
    ) -> None:
        self.run, self.cfg, self.model, self.source, self.store = run, cfg, model, source, store
        self.device = torch.device(cfg.device)
        self.per_rank = cfg.batch_size // run.world
        self.scorer = build_run_scorer(cfg, model).to(self.device)
        self.opt = torch.optim.AdamW(self.scorer.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.sched = cosine_schedule(self.opt, cfg.steps)
        if blob is not None:
            self.scorer.load_state_dict(blob["scorer"])
            self.opt.load_state_dict(blob["optimizer"])
            self.sched.load_state_dict(blob["scheduler"])
            run.restore(blob)
        self.net = AllLayers(self.scorer)
        if run.world > 1:
            self.net = torch.nn.parallel.DistributedDataParallel(self.net)
        self.probe = self.val_examples = None
        if run.rank == 0 and cfg.val_docs:
            self.probe = RetentionProbe(model, tokenizer, cfg, cache_dir=cfg.val_cache)
            vsrc = SequenceSource(cfg, tokenizer, "validation", seed=VALIDATION_SEED, seq_len=cfg.val_seq_len)
            self.val_examples = [
                capture_example(
                    model, ids.view(1, -1), cfg.windows(), cfg.sinks, cfg.observed, [c], cfg.target_power
                ).spread(cfg.target_span)
                for c, ids in (vsrc.get(j) for j in range(min(2, cfg.val_docs)))
            ]
        self.validates = self.probe is not None
        self.t_start, self.tokens, self.t_capture = time.perf_counter(), 0, 0.0

    def step(self, step: int) -> dict:
        cfg, run, scorer = self.cfg, self.run, self.scorer
        j0 = step * cfg.batch_size + run.rank * self.per_rank
        t0 = time.perf_counter()
        seqs = [j % cfg.cycle if cfg.cycle else j for j in range(j0, j0 + self.per_rank)]
        parts = [example_for(j, self.source, self.store, self.model, cfg) for j in seqs]
        self.t_capture += time.perf_counter() - t0
        # a budget whose window this rank's sequences carry (every window, unless --windows-per-sequence)
        ev = cfg.step_eviction(step, set.intersection(*(set(p.targets) for p in parts)))
        budget, w = ev.budget, ev.window
        ex = Example.cat([p.only([w], observed=bool(cfg.observed)) for p in parts]).float(self.device)
        lab = labels_for(ex.targets[w].cpu(), w, ev.k, ev.sinks, ev.lam)
        if self.device.type != "cpu":
            lab = type(lab)(*(t.to(self.device) for t in (lab.t_new, lab.t_bnd, lab.y, lab.valid)))
        scorer.train()
        self.opt.zero_grad(set_to_none=True)
        scores = self.net(ex.keys, ex.values, w, ex.observed.get(w))
        loss = torch.stack(
            [
                layer_loss(
                    sc, ex.targets[w], lab, i, loss=cfg.loss, lam=ev.lam, tau=cfg.tau, weighting=cfg.weighting, window=w
                )
                for i, sc in enumerate(scores)
            ]
        ).mean()
        loss.backward()  # DDP averages gradients over ranks here
        torch.nn.utils.clip_grad_norm_(scorer.parameters(), 1.0)
        self.opt.step()
        self.sched.step()
        self.tokens += cfg.batch_size * cfg.seq_len
        return {
            "step": step + 1,
            "loss": loss.item(),
            "lr": self.sched.get_last_lr()[0],
            "budget": budget,
            "corpora": ex.corpora,
        }

    def synced(self) -> list[torch.Tensor]:
        return list(self.scorer.parameters())

    def validate(self, step: int) -> dict:
        return self.probe(self.scorer, self.cfg.validation_budgets())

    def describe(self, q: dict) -> str:
        return "validation retention " + ", ".join(
            f"B={b} {q[str(b)]['retention']:.4f} (streaming {q[str(b)]['streaming']:.4f}, "
            f"wins {q[str(b)]['wins_vs_streaming']}/{q[str(b)]['docs']})"
            for b in self.cfg.validation_budgets()
        )

    def save_best(self, step: int, q: dict) -> None:
        save_scorer(self.scorer, self.run.out / "best.safetensors", _meta(self.cfg, step, self.run.fingerprint, q))

    def postfix(self, record: dict) -> dict[str, str]:
        return {"loss": f"{record['loss']:.4f}", "tok_s": f"{self.tokens / (time.perf_counter() - self.t_start):.0f}"}

    def checkpoint(self, step: int) -> None:
        """``train_state.pt`` (what a resume reads) and ``scorer.safetensors`` as one checkpoint: both are
        written before either replaces its previous version, so a failed write (a full disk) keeps the
        previous checkpoint whole."""
        run = self.run
        blob = run.state(
            scorer=self.scorer.state_dict(), optimizer=self.opt.state_dict(), scheduler=self.sched.state_dict()
        )
        try:
            atomic_writes(
                [
                    (run.state_file, lambda tmp: write_state(tmp, blob)),
                    (
                        run.out / "scorer.safetensors",
                        scorer_writer(self.scorer, _meta(self.cfg, step, run.fingerprint)),
                    ),
                ]
            )
        except OSError as exc:
            raise run.write_failed(exc, step, "the previous checkpoint there is whole") from exc


def train(cfg: TrainConfig, model=None, tokenizer=None) -> dict:
    """Run training (or, with ``capture_only``, fill the capture store); returns the summary dict."""
    cfg.validate()
    run = Run("train", cfg, cfg.out)
    blob = None if cfg.capture_only else run.saved_state()
    run.prepare_folder()  # before the model loads: an unwritable --out is an error, not a traceback later
    if model is None:
        model, tokenizer = models.load_model(cfg.model, progress=False)
    model = model.to(torch.device(cfg.device)).eval().requires_grad_(False)
    run.check_model(
        model_fingerprint(model),
        None if blob is None else blob.get("fingerprint") or _checkpoint_fingerprint(run.out) or {},
    )
    store = CaptureStore(cfg.store, cfg, model) if cfg.store else None
    source = SequenceSource(cfg, tokenizer, "train")
    if cfg.capture_only:
        return _capture_only(cfg, model, source, store, run.rank, run.world, cfg.batch_size // run.world)
    program = ScorerTraining(run, cfg, model, tokenizer, source, store, blob)
    run.loop(program, desc=f"train {cfg.scorer}")
    extra = {}
    if run.rank == 0 and program.val_examples:
        extra["validation_decisions"] = _decisions(program.scorer, program.val_examples, cfg)
    return run.summary({"capture_seconds": program.t_capture}, trained_for(cfg), extra)


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
    mine = [
        j
        for s in range(cfg.steps)
        for j in range(s * cfg.batch_size + rank * per_rank, s * cfg.batch_size + (rank + 1) * per_rank)
    ]
    todo = [j for j in mine if not store.has(j)]
    bar = tqdm(
        total=len(mine),
        initial=len(mine) - len(todo),
        disable=not (cfg.progress and rank == 0),
        desc=f"capture (rank {rank})",
    )
    t0 = time.perf_counter()
    for j in todo:
        corpus, ids = source.get(j)
        windows = store.sequence_windows(j)
        store.save(
            j, capture_example(model, ids.view(1, -1), windows, cfg.sinks, cfg.observed, [corpus], cfg.target_power)
        )
        bar.update(1)
    bar.close()
    if world > 1:
        dist.barrier()
    return {
        "captured": len(todo),
        "sequences": n,
        "seconds_this_process": time.perf_counter() - t0,
        "store": str(store.folder),
    }


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
