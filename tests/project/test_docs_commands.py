"""Every command the README and the manual (every page under docs/) show runs as written, so they cannot
drift from the code.

The commands of each ```bash block, and each ``$ command`` line with the output under it, run in the
order each document gives them, as its reader would run them. Two readers, each in a fresh copy of
the working tree with a HOME and an isthmus cache of their own (at the same path every session, so
that torch's compiled kernels are as warm as a returning user's: see `_reader_home`):

- the README's reader runs every command as written, from the first quickstart command on, which
  makes the copy's virtual environment and installs the project; the shell stays in it (its
  ``bin`` first on PATH) for every later command. That environment already holds the packages the
  first command's ``pip install -e .`` adds (torch & co., hard-linked from the environment running
  this test: see `_preinstall`), so pip finds them satisfied and installs the project alone; the
  later extras (``.[hf]``) it installs for real. The install from nothing (downloading, unpacking
  and compiling torch) is what .ci/run does before it runs the suite: it removes ``.venv`` and runs
  the README's second quickstart command verbatim, which the first test below checks;
- the reader of docs/ has followed the README: that copy's virtual environment gets the project
  with every extra the README installs along the way (hard-linked the same way), then each
  document's commands run in turn.

The two readers run side by side (a command mostly waits on its ranks' start-up or on an emulated
WAN, so they share the two cores well; separate copies, homes, caches and virtual environments keep
them from touching the other's files, and the emulator names its namespaces per run). The reader of
docs/ reads the benchmarks page beside the other pages, in the same copy: its scripts write only to
temporary folders and to names of their own (``docs/img/``, ``runs.json``, ``runs/geo_sync_bench``),
and none of the other pages' commands reads what they write. The only override is the documented
short run, ``ISTHMUS_MAX_STEPS=2``; pip keeps this machine's configuration and cache.

A few commands cannot run here; NOT_HERE lists each with the reason, and the test fails when one of
them is no longer in the docs (the list cannot rot) or when .ci/run stops running the suite command.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHORT_RUN = {"ISTHMUS_MAX_STEPS": "2"}
TIMEOUT_S = 900

SUITE = "python3 -m venv .venv && . .venv/bin/activate && pip install -q -c constraints.txt -e '.[test]' && python -m pytest -q"
NOT_HERE = {
    SUITE: "the test suite itself (this test is in it); .ci/run runs exactly this line, checked below",
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128": "the CUDA wheel: this machine has no GPU and no route to download.pytorch.org",
    "python benchmarks/gpu_calibrate.py --out calibration": "needs a GPU; tests/profile/test_gpu_calibrate.py runs the same code with --device cpu --quick",
    "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint NODE0:29500 "
    "-m isthmus train --parallel.dp_replicate 2 --parallel.dp_shard 4 --parallel.tp 2": "a second node: NODE0 names another machine (the one-node torchrun command runs)",
}


@dataclass
class Command:
    doc: str
    line: int
    text: str
    expected: list[str] | None = None  # a `$` command: the lines it prints


def documents() -> list[Path]:
    """The README, then every page of the manual (docs/ and its folders), in name order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def document_name(path: Path) -> str:
    """``README.md``, or a page's path under docs/ (``getting-started.md``)."""
    return path.name if path.parent == ROOT else str(path.relative_to(ROOT / "docs"))


def commands(path: Path) -> list[Command]:
    """The commands of ```bash blocks (continuation lines joined, comments dropped) and ``$`` lines, in order."""
    found: list[Command] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        body, start = lines[i + 1 : end], i + 2
        if fence.group(1) == "bash":
            found += _bash_commands(path.name, body, start)
        else:
            found += _dollar_commands(path.name, body, start)
        i = end + 1
    return found


def _bash_commands(doc: str, body: list[str], start: int) -> list[Command]:
    found, pending, first = [], "", 0
    for n, raw in enumerate(body, start):
        line = raw.rstrip()
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if not pending:
            first = n
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        found.append(Command(doc, first, re.sub(r"\s+", " ", pending + line.strip())))
        pending = ""
    return found


def _dollar_commands(doc: str, body: list[str], start: int) -> list[Command]:
    found: list[Command] = []
    for n, line in enumerate(body, start):
        if line.startswith("$ "):
            found.append(Command(doc, n, line[2:].strip(), []))
        elif found:
            found[-1].expected.append(line)  # type: ignore[union-attr]
    return found


def _without_comment(text: str) -> str:
    return re.sub(r"\s+#\s.*$", "", text).strip()


def test_the_docs_show_commands_and_every_exception_is_still_there() -> None:
    every = [c for doc in documents() for c in commands(doc)]
    texts = {_without_comment(c.text) for c in every}
    assert len(every) > 30, [c.text for c in every]
    for text in NOT_HERE:
        assert text in texts, f"NOT_HERE lists a command no document shows any more: {text}"
    ci = (ROOT / ".ci" / "run").read_text()
    assert SUITE in ci, "CI must run the README's test command"
    # ...in an environment made from nothing, the install the README's reader no longer does.
    fresh = re.search(r"^rm -rf \.venv$", ci, re.MULTILINE)
    assert fresh and fresh.start() < ci.index(SUITE), "CI must remove .venv before the README's install"


def _user(tmp: Path) -> dict[str, object]:
    """A fresh copy of the working tree (what git tracks or would track) in ``tmp``, and the environment a user has."""
    copy, home = tmp / "isthmus", tmp / "home"
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, check=True
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        source = ROOT / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the working tree, not yet in git
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, copy / name, follow_symlinks=False)
    # `--data.path ~/my-texts/`: the user's own text files; here, some of the standard library's docs.
    texts = home / "my-texts"
    texts.mkdir(parents=True)
    for source in sorted(Path(os.__file__).parent.glob("[a-h]*.py"))[:40]:
        shutil.copy(source, texts / (source.stem + ".txt"))
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "ISTHMUS_CHECKPOINT_KEY_FILE")}
    real_home = Path.home()
    venv_bin = copy / ".venv" / "bin"
    outer = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if Path(p) != Path(sys.executable).parent)
    env.update(SHORT_RUN)
    env.update(
        HOME=str(home),
        ISTHMUS_CACHE=str(tmp / "cache"),
        # The shell the first quickstart command leaves in its virtual environment.
        PATH=f"{venv_bin}{os.pathsep}{outer}",
        VIRTUAL_ENV=str(copy / ".venv"),
        # pip as configured on this machine (indexes, wheels on disk) and its cache, not a new HOME's.
        XDG_CONFIG_HOME=env.get("XDG_CONFIG_HOME", str(real_home / ".config")),
        PIP_CACHE_DIR=env.get("PIP_CACHE_DIR", str(real_home / ".cache" / "pip")),
    )
    return {"copy": copy, "env": env}


def readme_install() -> Command:
    """What the reader of docs/ did first: the README's install, with every extra the README installs later."""
    readme = commands(ROOT / "README.md")
    shown = [c.text for c in readme if _without_comment(c.text) not in NOT_HERE]  # not the suite's [test]
    extras = sorted(
        {m for text in shown for m in re.findall(r"pip install -c constraints\.txt -e '\.\[(\w+)\]'", text)}
    )
    first = readme[0].text.split(" && isthmus")[0]  # the venv and the project, without its training run
    return Command("README.md", readme[0].line, first.replace("-e .", f"-e '.[{','.join(extras)}]'"))


VENV = "python3 -m venv .venv && . .venv/bin/activate && "


def _preinstall(user: dict[str, object], extras: list[str]) -> None:
    """Make the copy's virtual environment and put in it, as hard links, the installed files of pip
    and of every distribution ``pip install -e '.[<extras>]'`` would add, from the environment
    running this test (copies where a link cannot cross file systems).

    That environment installed them from the same constraints and package indexes (its pip is the
    one ``python3 -m venv`` bundles), so a reader's ``pip install`` finds them all satisfied and
    installs only the project: minutes of unpacking and compiling torch fewer on a loaded machine.
    Console scripts (``torchrun``) are copied with their first line naming the copy's python."""
    from importlib.metadata import Distribution, PackageNotFoundError, distribution

    from packaging.requirements import Requirement

    copy = Path(user["copy"])  # type: ignore[arg-type]
    prefix = os.path.normpath(Path(distribution("pip").locate_file("")).parents[2])  # lib/python3.X/site-packages
    venv = copy / ".venv"
    make = VENV.split(" && ")[0] + " --without-pip"
    subprocess.run(["bash", "-c", make], cwd=copy, env=user["env"], check=True)  # type: ignore[call-overload]
    wanted: dict[str, Distribution] = {}
    todo = [("pip", "")] + [(r, e) for r in distribution("isthmus").requires or [] for e in ["", *extras]]
    while todo:
        text, extra = todo.pop()
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            continue  # not here: the setup's pip installs it
        key = f"{dist.metadata['Name'].lower()}[{','.join(sorted(req.extras))}]"
        if key not in wanted:
            wanted[key] = dist
            todo += [(r, e) for r in dist.requires or [] for e in ["", *req.extras]]
    python = f"#!{venv / 'bin' / 'python'}\n".encode()
    made: set[str] = set()
    for dist in wanted.values():
        for file in dist.files or []:
            source = os.path.normpath(dist.locate_file(file))
            if not source.startswith(prefix + os.sep):
                continue
            target = str(venv) + source[len(prefix) :]
            if (folder := os.path.dirname(target)) not in made:
                os.makedirs(folder, exist_ok=True)
                made.add(folder)
            if os.path.dirname(source) == os.path.join(prefix, "bin"):
                head, _, rest = Path(source).read_bytes().partition(b"\n")
                Path(target).write_bytes(python + rest if head.startswith(b"#!") else head + b"\n" + rest)
                os.chmod(target, os.stat(source).st_mode)
                continue
            try:
                os.link(source, target)
            except FileExistsError:
                pass  # listed by two distributions' extras
            except OSError:  # another file system (a tmpfs /tmp): a copy, still without unpacking or compiling
                shutil.copy2(source, target)


Outcome = tuple[list[str], int]  # what went wrong, and how many commands ran


ON_THEIR_OWN = ("benchmarks.md",)
"""Pages whose commands write nothing another page reads: read beside the others, after the setup."""


def _follow(
    docs: list[str], user: dict[str, object], extras: list[str], setup: Command | None
) -> dict[str, Future[Outcome]]:
    """Preinstall the project's dependencies with ``extras`` (`_preinstall`), run the setup, then each
    document's commands in turn (the pages of ON_THEIR_OWN each in a thread of their own, beside the
    rest); one future per document."""
    futures: dict[str, Future[Outcome]] = {doc: Future() for doc in docs}
    apart = [doc for doc in docs if doc in ON_THEIR_OWN]
    lines = [[doc for doc in docs if doc not in ON_THEIR_OWN], *[[doc] for doc in apart]]

    def read(line: list[str]) -> None:
        try:
            for doc in line:
                futures[doc].set_result(_commands_of(doc, user))
        except BaseException as e:  # noqa: BLE001 - handed to the tests that wait on it
            for doc in line:
                if not futures[doc].done():
                    futures[doc].set_exception(e)

    def reader() -> None:
        try:
            _preinstall(user, extras)
            if setup is not None:
                problem = _run(
                    Command(setup.doc, setup.line, setup.text.replace(VENV, ". .venv/bin/activate && ")), user
                )
                assert problem is None, f"the setup of docs/'s reader failed: {problem}"
        except BaseException as e:  # noqa: BLE001 - handed to the tests that wait on it
            for future in futures.values():
                future.set_exception(e)
            return
        others = [threading.Thread(target=read, args=(line,), daemon=True) for line in lines[1:]]
        for thread in others:
            thread.start()
        read(lines[0])
        for thread in others:
            thread.join()

    threading.Thread(target=reader, name=f"reader of {', '.join(docs)}", daemon=True).start()
    return futures


def _commands_of(doc: str, user: dict[str, object]) -> Outcome:
    path = ROOT / doc if doc == "README.md" else ROOT / "docs" / doc
    failures, ran = [], 0
    for command in commands(path):
        if _without_comment(command.text) in NOT_HERE:
            continue
        ran += 1
        problem = _run(command, user)
        if problem is not None:
            failures.append(problem)
    return failures, ran


def _reader_home(name: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, IO[str] | None]:
    """Where a reader's copy, HOME and cache live: the same path every session, emptied first.

    A returning user's compiled kernels are warm; a fresh path would not be, since torch keys each
    C++ kernel it compiles by its compiler command, which names the include folders of the virtual
    environment's torch, so every compiled run would compile again. Another session holding the
    path (a lock on it) gets a numbered folder of its own instead. Returns the folder and the lock's
    open file."""
    base = Path(tempfile.gettempdir()) / f"isthmus-docs-{name}"
    lock = open(f"{base}.lock", "w")  # noqa: SIM115 - held for the session, closed by the fixture
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return tmp_path_factory.mktemp(name), None
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir()
    return base, lock


@pytest.fixture(scope="module")
def outcomes(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Future[Outcome]]]:
    """The two readers, started side by side for the documents this session selected."""
    selected = [
        item.callspec.params["doc"]
        for item in request.session.items
        if item.originalname == "test_every_command_runs_as_written" and hasattr(item, "callspec")
    ]
    others = [doc for doc in selected if doc != "README.md"]
    futures: dict[str, Future[Outcome]] = {}
    locks: list[IO[str] | None] = []
    if "README.md" in selected:
        where, lock = _reader_home("readme_reader", tmp_path_factory)
        locks.append(lock)
        futures |= _follow(["README.md"], _user(where), extras=[], setup=None)
    if others:
        where, lock = _reader_home("docs_reader", tmp_path_factory)
        locks.append(lock)
        setup = readme_install()
        extras = re.findall(r"-e '\.\[([\w,]+)\]'", setup.text)[0].split(",")
        futures |= _follow(others, _user(where), extras=extras, setup=setup)
    yield futures
    for lock in filter(None, locks):
        lock.close()


def _run(command: Command, user: dict[str, object]) -> str | None:
    """Run one command; None if it did what the docs say, else what went wrong."""
    began = time.monotonic()
    proc = subprocess.run(
        ["bash", "-c", command.text],
        cwd=user["copy"],
        env=user["env"],  # type: ignore[arg-type]
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TIMEOUT_S,
    )
    print(f"{time.monotonic() - began:6.1f} s  {command.doc}:{command.line}: {command.text}")  # shown with -s
    where = f"{command.doc}:{command.line}: {command.text}"
    tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
    if command.expected is None:
        if proc.returncode != 0:
            return f"{where}\n  exit code {proc.returncode}\n{tail}"
        if "Traceback (most recent call last)" in proc.stdout:
            return f"{where}\n  printed a traceback, yet exited 0\n{tail}"
        return None
    expected = [line for line in command.expected if line.strip()]
    printed = proc.stdout.strip().splitlines()[-len(expected) :] if expected else []
    if printed != expected:
        return f"{where}\n  printed:  {printed}\n  docs say: {expected}"
    if expected and expected[-1].startswith("isthmus: error:") and proc.returncode != 2:
        return f"{where}\n  exit code {proc.returncode}, not 2"
    return None


@pytest.mark.parametrize("doc", [document_name(p) for p in documents()])
@pytest.mark.slow
def test_every_command_runs_as_written(doc: str, outcomes: dict[str, Future[Outcome]]) -> None:
    failures, ran = outcomes[doc].result(timeout=3 * 3600)
    assert not failures, f"{len(failures)} of {ran} command(s) in {doc} did not do what it says:\n" + "\n".join(
        failures
    )
