"""The adaptation loop: KL(dense base || masked student) for the LLM, the boundary loss for the scorer.

One step on a window of ``seq_len`` tokens (method.md section 5, "Adapting the LLM"):

1. **teacher** -- the frozen base model (adapter off: :func:`kvpop.bundle.teacher_mode`),
   dense, no grad: its top-``k`` next-token logits per position (only those are kept);
2. **scorer inputs** -- (joint runs) the *adapted* model, dense, no grad, adapter on: keys,
   values, future-attention targets and observed attention of every layer
   (:func:`kvpop.train.data.capture_example`): the targets are the adapted model's own future
   attention, the inputs are detached;
3. **student** -- the adapted model under the exact eviction mask
   (:func:`kvpop.mask.masked_eviction`) with the current scorer's priorities (no grad,
   detached), with grad: the KL of the teacher's next-token distribution from the student's,
   known from the teacher's top-``k`` only (:func:`topk_kl`: by default over ``k + 1``
   outcomes, the top-``k`` tokens and "any other"; or ``sum_k p_T log(p_T / p_S)`` with the
   teacher renormalised over its top-``k``), averaged over all positions (or,
   ``kl_positions="evicted"``, over positions ``q >= B`` only, where the mask differs from
   dense). The LM head runs ``logit_chunk`` positions at a time, so the ``S x vocab`` logits
   never exist at once; the gradient reaches the LoRA weights only;
4. **scorer** -- the boundary loss (:mod:`kvpop.train.labels`) on the captures of step 2,
   with its own optimizer.

Both updates use the same weights (the state before the step). Under ``torchrun`` each rank
takes its own sequences; the gradients of the LoRA weights and of the scorer are averaged over
ranks (one all-reduce each), so all ranks hold the same weights. Checkpoints: the adapter bundle
(:func:`kvpop.adapt.lora.save_adapter_bundle`, scorer and metadata inside) in ``out/adapter``
every ``ckpt_every`` steps, the best one by validation retention in ``out/best``, and
``out/train_state.pt`` (trainable weights, scorer, both optimizers and schedulers, step,
history) for resume; all written atomically. ``--mask streaming`` is the StreamingLLM+ control:
the same fine-tune under a sinks + window mask (``k = 0``, ``window = B - sinks``), no scorer.
"""

from __future__ import annotations

import copy
import json
import resource
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import models
from ..bundle import SCORER_FILE
from ..checkpoint import load_scorer, model_fingerprint, save_scorer
from ..compat import enable_checkpointing
from ..files import atomic_dir, atomic_write
from ..mask import learned_priority_fn, masked_eviction
from ..train.data import Example, SequenceSource, capture_example
from ..train.labels import labels_for, layer_loss
from ..train.runs import Run, cosine_schedule, write_state
from .config import AdaptConfig
from .lora import add_lora, base_model, lora_config, save_adapter_bundle
from .quality import AdaptProbe
from .restart import BundleStart, bundle_start, load_bundle_weights

FULL_META_FILE = "kvpop_full.json"


# --------------------------------------------------------------------------------------------
# the model: LoRA student + base teacher (or a frozen copy for full fine-tuning)
# --------------------------------------------------------------------------------------------


def prepare_model(cfg: AdaptConfig, model):
    """``(student, frozen_teacher)``: a peft model with a fresh LoRA adapter and ``None`` (the
    teacher is the same model with the adapter off), or, with ``full_finetune``, the model with
    every weight but the embeddings and LM head trainable and a frozen copy as the teacher."""
    torch.manual_seed(cfg.seed)  # the same LoRA initialisation on every rank and on resume
    model.requires_grad_(False)
    if not cfg.full_finetune:
        return add_lora(model, lora_config(cfg.lora_r, cfg.lora_alpha, cfg.lora_targets)), None
    frozen = copy.deepcopy(model).eval()
    skip = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    for p in model.parameters():
        if id(p) not in skip:
            p.requires_grad_(True)
    return model, frozen


def trainable(model) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _decoder_head(model):
    dec, head = model.get_decoder(), model.get_output_embeddings()
    if dec is None or head is None:
        raise RuntimeError("model has no get_decoder()/get_output_embeddings(); cannot adapt it")
    return dec, head


@torch.no_grad()
def teacher_topk(model, ids: torch.Tensor, k: int, chunk: int, temperature: float = 1.0):
    """The dense model's top-``k`` next-token logits ``[b, S, k]`` (float32, divided by
    ``temperature``), their token ids, and the log-sum-exp over the whole vocabulary ``[b, S]``
    (so the mass outside the top-``k`` is known); no grad."""
    dec, head = _decoder_head(model)
    h = dec(input_ids=ids, use_cache=False).last_hidden_state
    vals, idx, lse = [], [], []
    for a in range(0, h.shape[1], chunk):
        logits = head(h[:, a : a + chunk]).float() / temperature
        v, i = logits.topk(k, dim=-1)
        vals.append(v)
        idx.append(i)
        lse.append(torch.logsumexp(logits, -1))
    return torch.cat(vals, 1), torch.cat(idx, 1), torch.cat(lse, 1)


def _log_rest(lse_all: torch.Tensor, lse_top: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(lse_top - lse_all))``: the log-probability outside the top-k."""
    return torch.log(-torch.expm1((lse_top - lse_all).clamp(max=-1e-7)))


def topk_kl(
    student_logits: torch.Tensor,
    t_vals: torch.Tensor,
    t_idx: torch.Tensor,
    t_lse: torch.Tensor | None = None,
    temperature: float = 1.0,
    tail: str = "bucket",
) -> torch.Tensor:
    """Per-position KL of the teacher's next-token distribution from the student's, from the
    teacher's top-``k`` logits only (``t_vals`` already divided by ``temperature``).

    ``tail="bucket"``: over ``k + 1`` outcomes, the top-``k`` tokens and "any other token" (the
    teacher's tail mass from ``t_lse``): a true KL, zero iff the student gives every top-``k``
    token and the tail the teacher's probability. ``tail="renormalize"``: ``sum_k p_T log(p_T /
    p_S)`` with the teacher renormalised over its top-``k`` and the student's log-probabilities
    over the full vocabulary: >= 0, but minimal when the student puts no mass outside the top-``k``
    (it sharpens the model as well).
    """
    logp_full = F.log_softmax(student_logits.float() / temperature, -1)
    logp_s = logp_full.gather(-1, t_idx)
    if tail == "renormalize":
        logp_t = F.log_softmax(t_vals, -1)
        return (logp_t.exp() * (logp_t - logp_s)).sum(-1)
    if tail != "bucket":
        raise ValueError(f"tail must be 'bucket' or 'renormalize', got {tail!r}")
    logp_t = t_vals - t_lse.unsqueeze(-1)
    rest_t = _log_rest(torch.zeros_like(t_lse), torch.logsumexp(logp_t, -1))
    rest_s = _log_rest(torch.zeros_like(t_lse), torch.logsumexp(logp_s, -1))
    return (logp_t.exp() * (logp_t - logp_s)).sum(-1) + rest_t.exp() * (rest_t - rest_s)


def position_weights(S: int, budget: int, kl_positions: str, batch: int, device) -> torch.Tensor:
    """``[b, S]`` 0/1: which positions the KL averages over (all, or ``q >= B``)."""
    w = torch.ones(batch, S, device=device)
    if kl_positions == "evicted":
        w[:, : min(S, budget)] = 0
    return w


def student_step(model, ids, t_vals, t_idx, t_lse, *, priority_fn, ev, cfg: AdaptConfig, budget: int) -> dict:
    """Forward under the eviction mask and backward of the top-k KL (gradients accumulate on the
    trainable weights). Returns the loss and the mean KL over evicted / dense-equal positions."""
    dec, head = _decoder_head(model)
    b, S = ids.shape
    w = position_weights(S, budget, cfg.kl_positions, b, ids.device)
    denom = w.sum().clamp(min=1)
    scale = cfg.temperature**2
    kls = []
    model.train()  # (no dropout in the supported models; needed for gradient checkpointing)
    try:
        with masked_eviction(model, priority_fn, sinks=ev.sinks, window=ev.window, k=ev.k, query_block=cfg.query_block):
            hidden = dec(input_ids=ids, use_cache=False).last_hidden_state
            h = hidden.detach().requires_grad_(True)
            for a in range(0, S, cfg.logit_chunk):
                sl = slice(a, a + cfg.logit_chunk)
                kl = topk_kl(head(h[:, sl]), t_vals[:, sl], t_idx[:, sl], t_lse[:, sl], cfg.temperature, cfg.kl_tail)
                ((kl * w[:, sl]).sum() * scale / denom).backward()
                kls.append(kl.detach())
            # inside the context: gradient checkpointing recomputes the layers under the same mask
            hidden.backward(h.grad)
    finally:
        model.eval()
    kl = torch.cat(kls, 1)
    loss = float((kl * w).sum() / denom) * scale
    ev_mask = torch.zeros_like(kl, dtype=torch.bool)
    ev_mask[:, min(S, budget) :] = True
    return {
        "kl": loss,
        "kl_evicted": float(kl[ev_mask].mean()) if bool(ev_mask.any()) else float("nan"),
        "kl_before_budget": float(kl[~ev_mask].mean()) if bool((~ev_mask).any()) else float("nan"),
    }


def scorer_step(scorer, ex: Example, ev, cfg: AdaptConfig) -> float:
    """Boundary (or MSE) loss of every layer on detached captures; gradients accumulate on the scorer."""
    w = ev.window
    device = ex.keys.device
    lab = labels_for(ex.targets[w].cpu(), w, ev.k, ev.sinks, ev.lam)
    if device.type != "cpu":
        lab = type(lab)(*(t.to(device) for t in (lab.t_new, lab.t_bnd, lab.y, lab.valid)))
    obs = ex.observed.get(w)
    scorer.train()
    losses = []
    for i in range(ex.keys.shape[0]):
        sc = scorer.forward_layer(i, ex.keys[i], ex.values[i], w, observed=None if obs is None else obs[i])
        losses.append(
            layer_loss(
                sc,
                ex.targets[w],
                lab,
                i,
                loss=cfg.scorer_loss,
                lam=ev.lam,
                tau=cfg.tau,
                weighting=cfg.weighting,
                window=w,
            )
        )
    loss = torch.stack(losses).mean()
    loss.backward()
    scorer.eval()
    return float(loss.detach())


# --------------------------------------------------------------------------------------------
# distributed helpers
# --------------------------------------------------------------------------------------------


def _average_grads(params: list[torch.nn.Parameter], world: int) -> None:
    """Average the gradients over ranks in one all-reduce (a parameter without a gradient counts as 0)."""
    if world <= 1 or not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    for p, g in zip(params, flat.split([g.numel() for g in grads]), strict=True):
        p.grad = g.view_as(p).clone()


def _broadcast(params: list[torch.Tensor]) -> None:
    for p in params:
        dist.broadcast(p.data, 0)


def peak_rss_mib() -> float:
    """This process's peak resident set size (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --------------------------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------------------------


def bundle_meta(cfg: AdaptConfig, step: int, quality: dict | None = None) -> dict:
    meta = {
        "kind": "kvpop-adapt",
        "mask": cfg.mask,
        "joint": bool(cfg.joint and cfg.mask == "kvpop"),
        "trained_for": cfg.trained_for(),
        "steps": step,
        "tokens_seen": step * cfg.batch_size * cfg.seq_len,
        "corpora": list(cfg.corpora) if not cfg.docs_from else ["user:" + str(cfg.docs_from)],
        "adapter": {"full_finetune": True}
        if cfg.full_finetune
        else {
            "lora_r": cfg.lora_r,
            "lora_alpha": cfg.lora_alpha if cfg.lora_alpha is not None else 2 * cfg.lora_r,
            "lora_targets": list(cfg.lora_targets),
        },
        "loss": {
            "kl": "top-k",
            "kl_tail": cfg.kl_tail,
            "top_k": cfg.top_k,
            "temperature": cfg.temperature,
            "kl_positions": cfg.kl_positions,
            "scorer_loss": cfg.scorer_loss,
            "weighting": cfg.weighting,
        },
        "trained_from": {
            "scorer": cfg.scorer,
            "scorer_sha256": cfg.scorer_sha256(),
            "scorer_steps": cfg.scorer_header().get("meta", {}).get("steps"),
        },
    }
    if quality is not None:
        meta["validation"] = strip_per_doc(quality)
    return meta


def strip_per_doc(q):
    if isinstance(q, dict):
        return {k: strip_per_doc(v) for k, v in q.items() if k != "per_doc"}
    return q


def save_bundle(model, scorer, path: Path, cfg: AdaptConfig, step: int, tokenizer=None, quality=None) -> Path:
    """The run's output at ``step``: an adapter bundle, or (full fine-tune) a model folder with the scorer."""
    meta = bundle_meta(cfg, step, quality)
    if not cfg.full_finetune:
        return save_adapter_bundle(model, scorer, path, meta)
    fingerprint = model_fingerprint(model)  # the scorer serves this fine-tuned model

    def write(tmp: Path) -> None:
        model.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        if scorer is not None:
            save_scorer(scorer, tmp / SCORER_FILE, meta={**meta, "fingerprint": fingerprint})
        (tmp / FULL_META_FILE).write_text(json.dumps({"format": "kvpop-full-v1", "meta": meta}, indent=2) + "\n")

    if path.exists() and any(path.iterdir()) and not (path / FULL_META_FILE).is_file():
        raise FileExistsError(f"{path} exists and is not a kvpop fine-tuned model folder; refusing to replace it")
    atomic_dir(path, write)
    return path


# --------------------------------------------------------------------------------------------
# the loop
# --------------------------------------------------------------------------------------------


class Adaptation:
    """The program :class:`kvpop.train.runs.Run` drives: one step of the top-k KL into the trainable weights
    (and, ``joint``, the boundary loss into the scorer), validation against the base model's dense
    outputs, adapter bundles as checkpoints."""

    def __init__(
        self, run: Run, cfg: AdaptConfig, model, tokenizer, scorer, blob: dict | None, start: BundleStart | None = None
    ) -> None:
        self.run, self.cfg, self.tokenizer, self.scorer = run, cfg, tokenizer, scorer
        self.device = torch.device(cfg.device)
        if run.rank == 0:
            run.out.mkdir(parents=True, exist_ok=True)
        self.model, self.frozen = prepare_model(cfg, model)
        self.params = [p for _, p in trainable(self.model)]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.sched = cosine_schedule(self.opt, cfg.steps)
        self.train_scorer = scorer is not None and cfg.joint
        self.s_opt = self.s_sched = None
        if self.train_scorer:
            self.s_opt = torch.optim.AdamW(scorer.parameters(), lr=cfg.scorer_lr, weight_decay=cfg.weight_decay)
            self.s_sched = cosine_schedule(self.s_opt, cfg.steps)
        if cfg.gradient_checkpointing:
            enable_checkpointing(self.model)
        self.restarts: list[dict] = list(blob.get("restarts") or []) if blob is not None else []
        if blob is None and start is not None:
            self._start_from(start)
        self.probe, self.baseline = None, None
        if run.rank == 0 and cfg.val_docs:
            self.probe = AdaptProbe(self.model, tokenizer, cfg, frozen=self.frozen)
            # where the run starts from: the base model under the mask's policy with the scorer as loaded
            stored = blob.get("baseline") if blob is not None else start.baseline if start is not None else None
            self.baseline = (
                stored
                if stored
                else self.probe.baseline(scorer)
                if start is None
                else self._baseline_without_adapter(scorer)
            )
        self.validates = self.probe is not None
        if blob is not None:
            self._restore(blob)
        if run.world > 1:  # identical starting weights on every rank
            _broadcast(self.synced())
        self.source = SequenceSource(cfg, tokenizer, "train")
        self.per_rank = cfg.batch_size // run.world
        self.obs = tuple(scorer.config.observed) if scorer is not None else ()
        self.seconds = {"teacher": 0.0, "capture": 0.0, "student": 0.0, "scorer": 0.0}
        self.last_quality = None

    def _restore(self, blob: dict) -> None:
        named = dict(trainable(self.model))
        missing = set(blob["trainable"]) ^ set(named)
        if missing:
            raise ValueError(
                f"{self.run.state_file} does not match this model's trainable weights ({sorted(missing)[:3]} ...)"
            )
        with torch.no_grad():
            for n, t in blob["trainable"].items():
                named[n].copy_(t)
        self.opt.load_state_dict(blob["optimizer"])
        self.sched.load_state_dict(blob["scheduler"])
        if self.scorer is not None:
            self.scorer.load_state_dict(blob["scorer"])
        if self.train_scorer:
            self.s_opt.load_state_dict(blob["scorer_optimizer"])
            self.s_sched.load_state_dict(blob["scorer_scheduler"])
        self.run.restore(blob)

    def _start_from(self, start: BundleStart) -> None:
        """The bundle's LoRA weights (and, joint, its scorer), the schedule and step at ``start.step``;
        the optimizer moments stay fresh (see :mod:`kvpop.adapt.restart`)."""
        load_bundle_weights(self.model, start)
        if self.train_scorer:
            bundled, _ = load_scorer(start.path / SCORER_FILE)
            self.scorer.load_state_dict(bundled.state_dict())
        with warnings.catch_warnings():  # the schedule advances without optimizer steps, on purpose
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(start.step):
                self.sched.step()
                if self.s_sched is not None:
                    self.s_sched.step()
        self.run.step = start.step
        self.restarts.append(start.record())
        if self.run.rank == 0 and self.cfg.progress:
            print(
                f"[kvpop adapt] continuing from step {start.step} of {start.path} (its LoRA weights; the optimizer "
                "moments start from zero)",
                file=sys.stderr,
            )

    def _baseline_without_adapter(self, scorer) -> dict:
        """The un-adapted baseline of a run that starts from a bundle: measured with the adapter off."""
        with base_model(self.model, self.frozen):
            return self.probe.baseline(scorer)

    def synced(self) -> list[torch.Tensor]:
        return self.params + (list(self.scorer.parameters()) if self.scorer is not None else [])

    def step(self, step: int) -> dict:
        cfg, model, scorer = self.cfg, self.model, self.scorer
        j0 = step * cfg.batch_size + self.run.rank * self.per_rank
        seqs = [self.source.get(j) for j in range(j0, j0 + self.per_rank)]
        corpora = [c for c, _ in seqs]
        ids = torch.stack([x.view(-1) for _, x in seqs]).to(self.device)
        ev = cfg.step_eviction(step)
        budget = ev.budget
        self.opt.zero_grad(set_to_none=True)
        if self.train_scorer:
            self.s_opt.zero_grad(set_to_none=True)

        t0 = time.perf_counter()
        with base_model(model, self.frozen) as teacher:
            t_vals, t_idx, t_lse = teacher_topk(teacher, ids, cfg.top_k, cfg.logit_chunk, cfg.temperature)
        t1 = time.perf_counter()
        rss = {"teacher": peak_rss_mib()}
        ex = None
        if self.train_scorer:
            ex = capture_example(model, ids, [ev.window], ev.sinks, self.obs, corpora).float(self.device)
        t2 = time.perf_counter()
        rss["capture"] = peak_rss_mib()
        fn = None if cfg.mask == "streaming" else learned_priority_fn(scorer, ev.window, ev.lam, sinks=ev.sinks)
        rec = student_step(model, ids, t_vals, t_idx, t_lse, priority_fn=fn, ev=ev, cfg=cfg, budget=budget)
        t3 = time.perf_counter()
        rss["student"] = peak_rss_mib()
        s_loss = scorer_step(scorer, ex, ev, cfg) if self.train_scorer else None
        del ex
        t4 = time.perf_counter()
        rss["scorer"] = peak_rss_mib()

        world = self.run.world
        _average_grads(self.params, world)
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.sched.step()
        if self.train_scorer:
            _average_grads(list(scorer.parameters()), world)
            torch.nn.utils.clip_grad_norm_(scorer.parameters(), 1.0)
            self.s_opt.step()
            self.s_sched.step()
        if world > 1:  # the logged losses are the whole batch's (all ranks)
            logged = torch.tensor(
                [rec["kl"], rec["kl_evicted"], rec["kl_before_budget"], s_loss or 0.0],
                dtype=torch.float64,
                device=self.device,
            )
            dist.all_reduce(logged)
            logged = (logged / world).tolist()
            rec = {"kl": logged[0], "kl_evicted": logged[1], "kl_before_budget": logged[2]}
            s_loss = logged[3] if s_loss is not None else None
        for key, dt in zip(self.seconds, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            self.seconds[key] += dt
        return {
            "step": step + 1,
            **rec,
            "scorer_loss": s_loss,
            "lr": self.sched.get_last_lr()[0],
            "budget": budget,
            "corpora": corpora,
            "seconds": t4 - t0,
            "peak_rss_mib_after": {k: round(v, 1) for k, v in rss.items()},
        }

    def validate(self, step: int) -> dict:
        self.last_quality = {"step": step, **self.probe(self.scorer)}
        return self.last_quality

    def describe(self, q: dict) -> str:
        return self.probe.describe(q)

    def save_best(self, step: int, q: dict) -> None:
        save_bundle(self.model, self.scorer, self.run.out / "best", self.cfg, step, self.tokenizer, q)

    def postfix(self, record: dict) -> dict[str, str]:
        s_loss = record["scorer_loss"]
        return {"kl": f"{record['kl']:.4f}", "s_loss": "-" if s_loss is None else f"{s_loss:.3f}"}

    def checkpoint(self, step: int) -> None:
        """``train_state.pt`` first (what a resume reads), then the bundle in ``adapter/``: a failed write
        of either leaves a resumable run."""
        run, train_scorer = self.run, self.train_scorer
        state = run.state(
            trainable={n: p.detach().cpu().clone() for n, p in trainable(self.model)},
            optimizer=self.opt.state_dict(),
            scheduler=self.sched.state_dict(),
            scorer=self.scorer.state_dict() if self.scorer is not None else None,
            scorer_optimizer=self.s_opt.state_dict() if train_scorer else None,
            scorer_scheduler=self.s_sched.state_dict() if train_scorer else None,
            baseline=self.baseline,
            restarts=self.restarts,
        )
        try:
            atomic_write(run.state_file, lambda tmp: write_state(tmp, state))
            save_bundle(self.model, self.scorer, run.out / "adapter", self.cfg, step, self.tokenizer, self.last_quality)
        except OSError as exc:
            raise run.write_failed(
                exc, step, f"{run.state_file.name} and adapter/ there are each whole (resume reads the former)"
            ) from exc


def adapt(cfg: AdaptConfig, model=None, tokenizer=None) -> dict:
    """Run the adaptation; returns the summary dict (also written to ``out/summary.json``).

    ``model``/``tokenizer``: the plain base model (default: ``kvpop.load_model(cfg.model)``);
    it is modified in place (LoRA layers injected).
    """
    cfg.validate()
    run = Run("adapt", cfg, cfg.out)
    blob = run.saved_state()
    # a bundle to continue from is checked before the model loads; a run with its own state resumes from that
    start = bundle_start(cfg) if cfg.from_bundle and blob is None else None
    if cfg.from_bundle and blob is not None and run.rank == 0 and cfg.progress:
        print(f"[kvpop adapt] {run.state_file} exists: resuming from it, not from --from-bundle", file=sys.stderr)
    run.prepare_folder()  # before the model loads: an unwritable --out is an error, not a traceback later
    if model is None:
        model, tokenizer = models.load_model(cfg.model, progress=False)
    vocab = model.get_output_embeddings().weight.shape[0]
    if cfg.top_k > vocab:
        raise ValueError(f"top_k={cfg.top_k} exceeds the vocabulary ({vocab})")
    model = model.to(torch.device(cfg.device)).eval()
    fingerprint = model_fingerprint(model)
    run.check_model(fingerprint, None if blob is None else blob.get("fingerprint") or {})
    scorer = None
    if cfg.mask == "kvpop":
        scorer, _ = load_scorer(cfg.scorer, model=model)  # refuses a scorer trained for another model
        scorer = scorer.to(cfg.device).eval()
    program = Adaptation(run, cfg, model, tokenizer, scorer, blob, start)
    run.loop(program, desc=f"adapt ({cfg.mask})")
    extra = {"base_fingerprint": fingerprint}
    if program.restarts:
        extra["restarts"] = program.restarts
    if program.baseline is not None:
        extra["baseline"] = program.baseline
    return run.summary({"seconds_by_part": program.seconds, "peak_rss_mib": peak_rss_mib()}, cfg.trained_for(), extra)
