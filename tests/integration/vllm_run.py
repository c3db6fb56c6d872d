"""Run one vLLM engine over token prompts and write what it did (a helper of test_serving_vllm.py).

Usage: ``python tests/integration/vllm_run.py SPEC.json OUT.json``. SPEC: ``model`` (a folder), ``prompts``
(token id lists), ``batches`` (lists of prompt indices: each one ``generate`` call), ``max_tokens``,
``engine`` (extra ``vllm.LLM`` keyword arguments, e.g. ``additional_config``). OUT: ``tokens`` (one
list per batch, one token list per prompt) and the engine's own KV cache accounting.

It runs in its own process because vLLM spawns engine processes and holds its KV cache space
until it exits; a test starts one such process per engine configuration.
"""

import json
import sys


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(spec_path) as f:
        spec = json.load(f)
    engine = {"enforce_eager": True, **spec.get("engine", {})}
    llm = LLM(model=spec["model"], dtype="float32", seed=0, **engine)
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
    tokens = []
    for batch in spec["batches"]:
        outs = llm.generate([TokensPrompt(prompt_token_ids=spec["prompts"][i]) for i in batch], params, use_tqdm=False)
        tokens.append([list(o.outputs[0].token_ids) for o in outs])
    cache = llm.llm_engine.vllm_config.cache_config
    out = {
        "tokens": tokens,
        "num_blocks": cache.num_gpu_blocks,
        "max_concurrency": cache.kv_cache_max_concurrency,
        "kv_cache_bytes": cache.kv_cache_memory_bytes,
        "prefix_caching": cache.enable_prefix_caching,
    }
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
