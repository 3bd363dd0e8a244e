"""A run owns its directory: fresh names, a lock while it lives, and no silent reuse of another run's files.

``train.run_dir`` may hold ``{config}`` (the config's name: ``default``, ``tiny``, a file's stem)
and ``{time}`` (the start, ``YYYYmmdd-HHMMSS``); the default ``runs/{config}-{time}`` gives every
run a directory of its own and points ``runs/latest`` at the newest, which ``isthmus generate``
and ``isthmus export`` read by default. A named directory (no placeholder) is used as given.

Before any rank starts, the launching process claims the directory (`claim_run_dir`):

- it takes an exclusive ``flock`` on ``<run_dir>/.lock`` (and on ``<checkpoint.dir>/.lock`` when the
  checkpoints live elsewhere) and holds it until it exits; a second run on the same directory gets
  one line naming the holder. The kernel drops the lock when the holder dies, even by SIGKILL, so
  a crashed run never blocks the next one.
- files of an earlier run there (config, metrics, logs, checkpoints, final model) are never
  truncated or adopted: ``checkpoint.resume = auto`` continues that run (the checkpointer then
  refuses a checkpoint saved with other settings), ``train.overwrite = true`` removes them first,
  and anything else is refused in one line.
- with a templated run_dir, ``checkpoint.resume = auto`` continues the newest run of the same
  config that has a checkpoint, instead of starting a new directory.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from isthmus.checkpoint.manifest import committed_checkpoints, read_manifest
from isthmus.config import RUN_DIR_PLACEHOLDERS, JobConfig, settings_that_differ
from isthmus.errors import CheckpointError, ConfigError, IsthmusError, full_disk_as
from isthmus.log import get_logger
from isthmus.models.resolve import expected_vocab, resolve_model_args

LOCK_FILE = ".lock"
LATEST = "latest"
"""The link next to templated run directories that names the newest one."""
RUN_FILES = ("config.toml", "metrics.jsonl", "tokenizer_meta.json", "tokenizer.json")
RUN_DIRS = ("logs", "checkpoints", "final", "tb")
CLAIMED_ENV = "ISTHMUS_RUN_DIR_CLAIMED"
"""Set for the ranks by a launcher that claimed the run directory (they must not claim it again)."""
JOB_MARKER = ".job"
"""Written by rank 0 of a job on several hosts in the run directory it claimed, for the other hosts to
look for: a host that finds this job's token there shares the directory (a cluster file system)."""


@dataclass
class RunDirClaim:
    """A claimed run directory; the locks last as long as this process (or until `release`)."""

    run_dir: Path
    continued: bool
    """True when the run continues an earlier run's files there (checkpoint.resume)."""
    _locks: list[IO[str]] = field(default_factory=list, repr=False)

    def absorb(self, other: RunDirClaim) -> RunDirClaim:
        """This claim, holding ``other``'s locks too (released with it)."""
        self._locks += other._locks
        other._locks = []
        return self

    def release(self) -> None:
        for f in self._locks:
            f.close()  # closing the file drops its flock
        self._locks.clear()


def is_templated(run_dir: str) -> bool:
    return any(p in run_dir for p in RUN_DIR_PLACEHOLDERS)


def expand(run_dir: str, config_name: str, stamp: str) -> str:
    return run_dir.replace("{config}", config_name).replace("{time}", stamp)


def _checkpoint_root(cfg: JobConfig, run_dir: Path) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"


def _metrics_file(cfg: JobConfig) -> Path | None:
    """An explicitly named metrics file (metrics.jsonl), which may live outside the run directory."""
    return Path(cfg.metrics.jsonl) if cfg.metrics.jsonl else None


def earlier_run_files(run_dir: Path) -> list[Path]:
    """What an earlier run left in ``run_dir`` (the lock file aside)."""
    if not run_dir.is_dir():
        return []
    found = [run_dir / name for name in RUN_FILES if (run_dir / name).exists()]
    found += [run_dir / name for name in RUN_DIRS if (run_dir / name).exists()]
    found += sorted(p for p in run_dir.glob("dc[0-9]*") if p.is_dir())  # fault-tolerant jobs' own directories
    return found


def _describe(root: Path, files: list[Path]) -> str:
    ckpts = committed_checkpoints(root)
    what = ", ".join(p.name for p in files[:4]) + (", ..." if len(files) > 4 else "")
    return f"checkpoints up to step {ckpts[0][0]}" if ckpts else what


def _newest_resumable(template: str, config_name: str, cfg: JobConfig) -> Path | None:
    """The newest directory the template names (any {time}) that holds a committed checkpoint."""
    pattern = expand(template, config_name, "*")
    parent = Path(pattern).parent
    if not parent.is_dir() or "*" in str(parent):
        return None
    candidates = sorted(parent.glob(Path(pattern).name), key=lambda p: p.stat().st_mtime, reverse=True)
    for candidate in candidates:
        if (
            candidate.is_dir()
            and not candidate.is_symlink()
            and committed_checkpoints(_checkpoint_root(cfg, candidate))
        ):
            return candidate
    return None


def _fresh_dir(template: str, config_name: str) -> Path:
    """A new directory for the template; made here, so two runs starting in the same second differ."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = expand(template, config_name, stamp)
    for n in range(1, 1000):
        path = Path(base if n == 1 else f"{base}-{n}")
        try:
            path.mkdir(parents=True, exist_ok=False)
            return path
        except FileExistsError:
            continue
        except OSError as e:
            raise ConfigError("train.run_dir", str(path), f"cannot be created ({e.strerror})") from None
    raise ConfigError("train.run_dir", base, "every numbered variant of this name exists already")


def _lock(directory: Path, key: str) -> IO[str]:
    """An exclusive lock on ``directory/.lock``, or one line naming the live run that holds it."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        f = open(directory / LOCK_FILE, "a+")
    except OSError as e:
        raise ConfigError(key, str(directory), f"cannot be used ({e.strerror})") from None
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise ConfigError(
            key, str(directory), f"is in use by a live run ({holder}); wait for it, or choose another directory"
        ) from None
    f.seek(0)
    f.truncate()
    command = " ".join(["isthmus", *sys.argv[1:]])[:200]
    note = f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}: {command}\n"
    try:  # unbuffered: on a full disk nothing stays behind to fail again at close
        os.write(f.fileno(), note.encode())
    except OSError:
        pass  # the lock holds without the note of who holds it; the run's own writes report a full disk
    return f


def mark_job(run_dir: Path, token: str) -> None:
    """Leave this job's token in ``run_dir`` (rank 0, after claiming it; replaced in one step)."""
    tmp = run_dir / f"{JOB_MARKER}.{os.getpid()}.tmp"
    with full_disk_as("run directory", tmp, "train.run_dir"):
        tmp.write_text(token)
        tmp.replace(run_dir / JOB_MARKER)


def shares_job_dir(run_dir: Path, token: str) -> bool:
    """Whether ``run_dir`` here is the directory rank 0 marked with ``token`` (:func:`mark_job`)."""
    try:
        return (run_dir / JOB_MARKER).read_text() == token
    except OSError:
        return False


def lock_host_dir(run_dir: Path, key: str = "train.run_dir") -> RunDirClaim:
    """Lock ``run_dir`` (the folder ``key`` names) on a host of a job whose rank 0 claimed its own folder
    of that name elsewhere (a folder local to each host): a second job on this host is refused there."""
    return RunDirClaim(run_dir, continued=False, _locks=[_lock(run_dir, key)])


def _remove(paths: list[Path]) -> None:
    for p in paths:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)


def _point_latest(run_dir: Path) -> None:
    """``<parent>/latest`` -> ``run_dir`` (replaced atomically: a reader never sees it missing)."""
    link = run_dir.parent / LATEST
    tmp = run_dir.parent / f".{LATEST}.{os.getpid()}"
    try:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(run_dir.name)
        os.replace(tmp, link)
    except OSError as e:  # a file system without links still trains; only the shortcut is missing
        get_logger().warning("could not point %s at %s (%s)", link, run_dir, e.strerror)


def claim_run_dir(cfg: JobConfig, config_name: str) -> RunDirClaim:
    """Resolve ``train.run_dir`` (placeholders), lock it, and check what an earlier run left there.

    Sets ``cfg.train.run_dir`` to the concrete directory. Raises ConfigError (one line) when the
    directory is in use, or holds an earlier run that this one would overwrite or silently adopt.
    """
    t, c = cfg.train, cfg.checkpoint
    templated = is_templated(t.run_dir)
    continued_dir = _newest_resumable(t.run_dir, config_name, cfg) if templated and c.resume == "auto" else None
    if continued_dir is not None:
        run_dir = continued_dir
    elif templated:
        run_dir = _fresh_dir(t.run_dir, config_name)
    else:
        run_dir = Path(t.run_dir)
    claim = RunDirClaim(run_dir, continued=False)
    try:
        claim._locks.append(_lock(run_dir, "train.run_dir"))
        root = _checkpoint_root(cfg, run_dir)
        outside = c.dir and not _inside(root, run_dir)
        if outside:
            claim._locks.append(_lock(root, "checkpoint.dir"))
        claim.continued = _check_earlier_run(cfg, run_dir, root, bool(outside))
    except BaseException:
        claim.release()
        raise
    t.run_dir = str(run_dir)
    if templated:
        _point_latest(run_dir)
    return claim


def _inside(path: Path, directory: Path) -> bool:
    try:
        path.resolve().relative_to(directory.resolve())
        return True
    except ValueError:
        return False


def _check_earlier_run(cfg: JobConfig, run_dir: Path, root: Path, root_outside: bool) -> bool:
    """Whether this run continues the files there; refuses (or, with train.overwrite, removes) the rest."""
    c = cfg.checkpoint
    leftovers = earlier_run_files(run_dir)
    checkpoints = committed_checkpoints(root)
    metrics = _metrics_file(cfg)
    if metrics is not None and metrics.exists() and not _inside(metrics, run_dir):
        leftovers.append(metrics)
    if root_outside and checkpoints:
        leftovers += [path for _, path in checkpoints]
    if not leftovers:
        return False
    continuing = (
        c.resume == "auto" and bool(checkpoints) or (c.resume not in ("none", "auto") and _inside(Path(c.resume), root))
    )
    if continuing and not cfg.train.overwrite:
        if c.resume == "auto":
            _check_same_settings(checkpoints[0][1], cfg)
        return True
    if cfg.train.overwrite:
        get_logger().info("train.overwrite: removing the earlier run's %s", ", ".join(str(p) for p in leftovers))
        _remove(leftovers)
        return False
    where = "checkpoint.dir" if root_outside and checkpoints and not earlier_run_files(run_dir) else "train.run_dir"
    shown = str(root) if where == "checkpoint.dir" else str(run_dir)
    earlier = _describe(root, leftovers)
    if c.resume == "auto":
        rule = (
            f"holds an earlier run ({earlier}) but no checkpoint to continue from; "
            f"pass --train.overwrite true to replace it, or choose another {where}"
        )
    else:
        rule = (
            f"holds an earlier run ({earlier}); pass --checkpoint.resume auto to continue it, "
            f"--train.overwrite true to replace it, or choose another {where}"
        )
    raise ConfigError(where, shown, rule)


def _check_same_settings(checkpoint: Path, cfg: JobConfig) -> None:
    """``resume = auto`` continues only the run that saved the checkpoint: refuse other settings up front.

    Reads the newest checkpoint's manifest only (the trainer verifies the files, falls back to an
    older good one, and checks again); a manifest that does not read is left to it.
    """
    try:
        manifest = read_manifest(checkpoint)
    except CheckpointError:
        return
    try:
        current_model: dict[str, Any] | None = resolve_model_args(cfg.model, expected_vocab(cfg.data)).__dict__
    except IsthmusError:
        current_model = None  # a shape that does not resolve is refused later, in its own line
    differ = settings_that_differ(
        manifest.config, cfg.to_toml(), saved_model=manifest.model, current_model=current_model
    )
    if differ:
        raise ConfigError(
            "checkpoint.resume",
            "auto",
            f"{checkpoint} was saved by a run with other settings ({'; '.join(differ)}); auto continues only the same "
            "run: name the checkpoint (--checkpoint.resume PATH) to start from it anyway, or choose another train.run_dir",
        )
