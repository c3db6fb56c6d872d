"""``kvpop adapt``: argument parsing over :class:`AdaptConfig` (also ``python -m kvpop.adapt`` under torchrun)."""

from __future__ import annotations

import argparse

from ..adapt.config import DEFAULT_LORA_TARGETS, KL_POSITIONS, KL_TAILS, MASKS, AdaptConfig
from ..train.config import TRAIN_CORPORA
from .options import add_run_arguments, config_kwargs, run_training_command


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(
        prog="kvpop adapt",
        description="Adapt the LLM to the bounded cache: LoRA (or full fine-tuning) with KL(dense base || model under "
        "the eviction mask), the scorer fixed (or --joint: trained too). Resumes if --out holds a checkpoint of the "
        "same run; runs under torchrun too (python -m kvpop.adapt; one process per core: OMP_NUM_THREADS=1 each).",
    )
    d = AdaptConfig()
    p.add_argument("--out", required=True, help="output folder (adapter/, best/, train_state.pt, summary.json)")
    p.add_argument(
        "--mask",
        choices=MASKS,
        default=d.mask,
        help="kvpop: the learned scorer's eviction mask; streaming: the StreamingLLM+ control "
        "(sinks + window = B - sinks, no scorer)",
    )
    p.add_argument(
        "--scorer", default=None, help="scorer checkpoint to start from (kvpop train); needed for --mask kvpop"
    )
    joint = p.add_mutually_exclusive_group()
    joint.add_argument(
        "--joint",
        dest="joint",
        action="store_true",
        help="also train the scorer (boundary loss on the adapted model's keys); on a trained scorer "
        "this step lowers retention even with the LLM frozen, see docs/adaptation.md",
    )
    joint.add_argument("--no-joint", dest="joint", action="store_false", help="keep the scorer fixed (the default)")
    p.set_defaults(joint=d.joint)
    add_run_arguments(
        p,
        d,
        texts="adapt on",
        corpora=TRAIN_CORPORA,
        range_help="(window: the scorer's trained fraction of B)",
        int_fields=("lora_r", "top_k", "logit_chunk", "query_block"),
        float_fields=("lr", "scorer_lr", "weight_decay", "temperature", "tau"),
    )
    p.add_argument(
        "--window",
        type=int,
        default=None,
        help="protected window (default: the scorer's trained fraction of B, else B / 2; streaming: B - sinks)",
    )
    p.add_argument("--window-fraction", type=float, default=None)
    p.add_argument("--lam", type=float, default=None, help="recency tilt (default: the scorer's trained lam, else 0)")
    p.add_argument("--lora-targets", default=",".join(DEFAULT_LORA_TARGETS), help="modules that get LoRA adapters")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default 2 * r)")
    p.add_argument(
        "--full-finetune",
        action="store_true",
        help="train every decoder weight (not embeddings / LM head) instead of LoRA; writes a model folder",
    )
    p.add_argument(
        "--kl-positions",
        choices=KL_POSITIONS,
        default=d.kl_positions,
        help="average the KL over all positions (default) or only those >= B, where eviction happened",
    )
    p.add_argument(
        "--kl-tail",
        choices=KL_TAILS,
        default=d.kl_tail,
        help="bucket (default): the teacher's mass outside its top-k is one more outcome of the KL (a true "
        "KL over k + 1 outcomes); renormalize: the teacher renormalised over its top-k",
    )
    p.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute layer activations in backward (CPU only): SmolLM2 at --seq-len 4096 peaks near "
        "6 GB per process instead of ~11 GB, for ~20%% more time per step",
    )
    p.add_argument("--scorer-loss", choices=["boundary", "mse"], default=d.scorer_loss)
    p.add_argument(
        "--from-bundle",
        default=None,
        metavar="DIR",
        help="continue this run from a bundle it wrote (e.g. its adapter/ or a shipped copy) when --out "
        "has no train_state.pt: the bundle's LoRA weights and step, fresh optimizer moments; the "
        "other settings must be the run's own",
    )
    return p


def config_from_args(args) -> AdaptConfig:
    kw = config_kwargs(args, AdaptConfig)
    kw["lora_targets"] = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
    return AdaptConfig(**kw)


def main(argv: list[str] | None = None) -> int:
    return run_training_command(
        "kvpop adapt",
        argv,
        build_parser(),
        config_from_args,
        _adapt,
        _report,
        config_errors=(TypeError, ValueError, FileNotFoundError),
    )


def _adapt(cfg: AdaptConfig) -> dict:
    """The loop, imported once a checked run starts: it loads the model code, which parsing does not need."""
    from ..adapt.loop import adapt

    return adapt(cfg)


def _report(summary: dict) -> dict:
    from ..adapt.loop import strip_per_doc

    last_val = next((h["val"] for h in reversed(summary["history"]) if "val" in h), None)
    return {
        "best": summary["best"],
        "tokens_seen": summary["tokens_seen"],
        "seconds": summary["seconds_this_process"],
        "peak_rss_mib": summary["peak_rss_mib"],
        "baseline": strip_per_doc(summary.get("baseline")),
        "last_validation": strip_per_doc(last_val),
    }
