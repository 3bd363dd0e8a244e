"""Input a run cannot survive, refused before work in one line with exit 2: memory, vocabularies, paths, TOML.

Also: torch's warnings stay out of the console (they go to each rank's log file).
"""

from __future__ import annotations

import logging
import os
import tomllib
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import isthmus
from isthmus.cli import main
from isthmus.cli.train import shipped_configs_dir
from isthmus.config import JobConfig, apply_toml, build_config, parse_overrides, toml_string
from isthmus.launch.preflight import preflight
from isthmus.log import get_logger, route_library_warnings, setup_logging
from mounts import tmpfs
from procs import run_isthmus

REPO = Path(__file__).resolve().parents[2]


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1, out.err
    return lines[0]


# --- memory and vocabulary --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args,key",
    [
        (["--train.seq_len", "100000"], "train.seq_len = 100000: needs about "),
        (["--train.batch_size", "100000"], "train.batch_size = 100000: needs about "),
    ],
)
def test_activations_that_cannot_fit_are_refused(args: list[str], key: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", *args, "--print-config"]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"isthmus: error: {key}") and "of activations for" in line, line
    assert line.endswith(
        "lower train.seq_len or train.batch_size, raise train.grad_accum, or set parallel.activation_checkpoint = full"
    )


@pytest.mark.slow
def test_compile_without_a_cpp_compiler_is_one_line(tmp_path: Path) -> None:
    # inductor reads CXX when it is first imported (and caches its search), so in a fresh process:
    # a CXX that does not exist is a machine without its compiler.
    proc = run_isthmus(
        "train",
        "--model.flavor",
        "tiny",
        "--train.compile",
        "true",
        "--print-config",
        env={"CXX": "/nonexistent/c++"},
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "isthmus: error: train.compile = True: needs a C++ compiler on CPU (inductor builds its kernels with one): "
        "install g++ or set CXX"
    )


def test_ids_of_a_bin_file_must_fit_the_vocabulary_and_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = np.arange(4000, dtype=np.uint32) % 200
    ids[1234] = 4_000_000_000  # e.g. a file written as uint32 and read as such, with one bad id
    path = tmp_path / "ids.bin"
    ids.tofile(path)
    base = ["train", "--data.path", str(path), "--data.bin_dtype", "uint32", "--print-config"]
    assert main(base) == 2
    line = _one_line(capsys)
    assert line.startswith(
        f"isthmus: error: data.path {str(path)!r}: largest id 4,000,000,000 makes a vocabulary of "
        "4,000,000,001 tokens; the model would need about "
    ), line
    assert line.endswith("set model.vocab_size, or check data.bin_dtype (uint32)")
    assert main([*base, "--model.vocab_size", "50000"]) == 2
    assert _one_line(capsys) == (
        f"isthmus: error: data.path {str(path)!r}: largest id 4,000,000,000 is not below "
        "model.vocab_size = 50,000; check data.bin_dtype (uint32) or raise model.vocab_size"
    )


SHIPPED = sorted(shipped_configs_dir().glob("*.toml")) + sorted((REPO / "configs").glob("*.toml"))
# Layouts the README shows; what runs today must not be refused.
README_LAYOUTS = [
    ["--parallel.nproc", "2", "--parallel.dp_shard", "2", "--parallel.zero_stage", "3"],
    [
        "--config",
        "tiny",
        "--parallel.nproc",
        "4",
        "--parallel.tp",
        "2",
        "--parallel.sequence_parallel",
        "true",
        "--parallel.dp_shard",
        "2",
    ],
    ["--config", "tiny", "--parallel.nproc", "2", "--parallel.cp", "2", "--parallel.cp_impl", "ulysses"],
    [
        "--config",
        "tiny",
        "--parallel.nproc",
        "2",
        "--parallel.pp",
        "2",
        "--parallel.pp_schedule",
        "interleaved_1f1b",
        "--parallel.pp_virtual_stages",
        "2",
        "--parallel.microbatches",
        "4",
    ],
]


@pytest.mark.parametrize("config", SHIPPED, ids=[f"{p.parent.name}/{p.name}" for p in SHIPPED])
def test_shipped_configs_pass_preflight(config: Path) -> None:
    preflight(build_config(config, []))


@pytest.mark.parametrize("args", README_LAYOUTS, ids=[" ".join(a) for a in README_LAYOUTS])
def test_readme_layouts_pass_preflight(args: list[str]) -> None:
    pairs = parse_overrides([a for a in args if a != "--config" and a != "tiny"])
    preflight(build_config(shipped_configs_dir() / ("tiny.toml" if "tiny" in args else "default.toml"), pairs))


# --- paths ----------------------------------------------------------------------------------------
def test_a_path_that_is_not_utf8_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # What Python makes of the byte 0xff in argv (surrogateescape): a lone surrogate.
    bad = os.fsdecode(b"/tmp/run-\xff")
    for key in ("train.run_dir", "data.path", "metrics.jsonl"):
        assert main(["train", f"--{key}", bad, "--print-config"]) == 2
        assert (
            _one_line(capsys) == f"isthmus: error: {key} = '/tmp/run-\\udcff': is not valid UTF-8; use a name that is"
        )


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Path]:
    """A read-only file system (root cannot write there either, unlike a folder without permission bits)."""
    with tmpfs(tmp_path / "ro", "ro,size=64k") as mnt:
        yield mnt


def test_folders_a_run_cannot_write_are_refused(
    tmp_path: Path, read_only: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = [
        (
            ["--train.run_dir", str(a_file / "run")],
            f"train.run_dir = '{a_file / 'run'}': {a_file} is a file, not a folder",
        ),
        (
            ["--train.run_dir", str(read_only / "run")],
            f"train.run_dir = '{read_only / 'run'}': {read_only} is not writable (the folder would be made there)",
        ),
        (["--checkpoint.dir", str(read_only)], f"checkpoint.dir = '{read_only}': {read_only} is not writable"),
        (
            ["--data.cache_dir", str(read_only / "c")],
            f"data.cache_dir = '{read_only / 'c'}': {read_only} is not writable (the folder would be made there)",
        ),
        (
            ["--metrics.jsonl", str(read_only / "m.jsonl")],
            f"metrics.jsonl = '{read_only / 'm.jsonl'}': {read_only} is not writable",
        ),
        (["--metrics.jsonl", str(tmp_path)], f"metrics.jsonl = '{tmp_path}': is a folder; name a file"),
    ]
    for args, expected in cases:
        assert main(["train", "--config", "tiny", *args, "--print-config"]) == 2
        assert _one_line(capsys) == f"isthmus: error: {expected}"


def test_a_data_folder_without_text_files_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "weights.bin.dat").write_bytes(b"\0\1\2" * 100)
    code = main(
        [
            "train",
            "--config",
            "tiny",
            "--parallel.nproc",
            "1",
            "--data.path",
            str(data),
            "--train.run_dir",
            str(tmp_path / "run"),
            "--data.cache_dir",
            str(tmp_path / "cache"),
        ]
    )
    assert code == 2
    assert _one_line(capsys) == f"isthmus: error: data.path {str(data)!r}: the folder has no text files"


# --- TOML ----------------------------------------------------------------------------------------
ODD = [
    "a\nb",
    "tab\there",
    'say "hi"',
    "back\\slash\\",
    "nul\0",
    "bell\a esc\x1b del\x7f",
    "\r\n",
    "uni\u2028code é 漢 🙂",
    "",
]


@pytest.mark.parametrize("text", ODD, ids=[repr(t) for t in ODD])
def test_toml_strings_round_trip(text: str) -> None:
    assert tomllib.loads(f"v = {toml_string(text)}")["v"] == text


def test_a_config_with_odd_paths_round_trips_through_its_toml(tmp_path: Path) -> None:
    cfg = build_config(
        None,
        parse_overrides(
            [
                "--train.run_dir",
                str(tmp_path / 'a\nb\t"c"\\d'),
                "--metrics.jsonl",
                str(tmp_path / "m\x7f.jsonl"),
            ]
        ),
    )
    again = JobConfig()
    apply_toml(again, tomllib.loads(cfg.to_toml()))
    assert again == cfg


# --- warnings --------------------------------------------------------------------------------------
def test_torch_warnings_go_to_the_log_file_and_ours_to_the_console(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    log = tmp_path / "rank0.log"
    loggers = [
        lg
        for n, lg in logging.root.manager.loggerDict.items()
        if isinstance(lg, logging.Logger) and n.startswith("torch")
    ]
    saved = (warnings.showwarning, {lg.name: lg.handlers[:] for lg in loggers})
    try:
        setup_logging(log_file=str(log))
        route_library_warnings()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            torch_file = str(Path(torch.__file__).parent / "distributed" / "tensor" / "_random.py")
            warnings.warn_explicit(
                "DTensor random operators may not have complete support", UserWarning, torch_file, 48
            )
            logging.getLogger("torch.distributed.tensor._redistribute").warning("2 sequential all_reduce operations")
            ours = str(Path(isthmus.__file__).parent / "train" / "trainer.py")
            warnings.warn_explicit("something the user can fix", UserWarning, ours, 1)
        err = capsys.readouterr().err
        assert "DTensor" not in err and "sequential" not in err
        assert "something the user can fix" in err
        text = log.read_text()
        assert "DTensor random operators" in text and "2 sequential all_reduce" in text
    finally:
        warnings.showwarning = saved[0]
        for lg in loggers:
            lg.handlers[:] = saved[1][lg.name]
        for h in get_logger().handlers[:]:
            get_logger().removeHandler(h)
            h.close()
