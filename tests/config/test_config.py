"""Job config: precedence, types, and one-line errors with exit code 2 for every kind of bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from isthmus.cli import main
from isthmus.config import JobConfig, build_config, parse_overrides
from isthmus.errors import ConfigError
from procs import run_isthmus


def test_precedence_defaults_file_cli(tmp_path: Path) -> None:
    f = tmp_path / "job.toml"
    f.write_text('[train]\nsteps = 7\nlr = 0.01\n[model]\nflavor = "tiny"\n')
    cfg = build_config(f, parse_overrides(["--train.steps", "9", "--train.dtype=bf16"]))
    assert cfg.train.steps == 9  # CLI beats file
    assert cfg.train.lr == 0.01  # file beats default
    assert cfg.train.dtype == "bf16"
    assert cfg.train.batch_size == JobConfig().train.batch_size  # default kept


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    cfg = build_config(None, parse_overrides(["--model.n_layers", "3", "--data.path", str(tmp_path)]))
    f = tmp_path / "resolved.toml"
    f.write_text(cfg.to_toml())
    assert build_config(f, []) == cfg


def test_negative_number_is_a_value() -> None:
    with pytest.raises(ConfigError, match="train.lr"):
        build_config(None, parse_overrides(["--train.lr", "-1"]))


def test_every_field_has_a_docstring() -> None:
    import inspect

    import isthmus.config as c

    for section in (c.ModelConfig, c.DataConfig, c.TrainConfig, c.ParallelConfig, c.CheckpointConfig, c.MetricsConfig):
        src = inspect.getsource(section)
        for name in section.__dataclass_fields__:
            after = src.split(f"    {name}:", 1)[1].splitlines()[1].strip()
            assert after.startswith('"""'), f"{section.__name__}.{name} has no docstring"


BAD_CLI = [
    (["--foo.bar", "1"], "unknown section"),
    (["--train.stepz", "1"], "unknown key"),
    (["--train.steps", "ten"], "must be an integer"),
    (["--train.lr", "fast"], "must be a number"),
    (["--metrics.tensorboard", "maybe"], "must be true or false"),
    (["--data.tokenizer", "wordpiece"], "must be one of"),
    (["--train.steps", "0"], "must be at least 1"),
    (["--train.lr", "-0.1"], "must be positive"),
    (["--train.steps"], "missing value"),
    (["--config", "no-such-file.toml"], "file not found"),
    (["--model.flavor", "huge"], "unknown flavor"),
    (["--model.n_kv_heads", "3"], "must divide model.n_heads"),
    (["--train.batch_size", "10", "--train.grad_accum", "3"], "must divide train.batch_size"),
    # One name per meaning: microbatches are a pipeline's; accumulation without one is grad_accum.
    (
        ["--parallel.microbatches", "4"],
        "parallel.microbatches = 4: counts a pipeline's microbatches and parallel.pp = 1",
    ),
    (["--data.path", "/no/such/corpus"], "no such file or folder"),
    (["--data.val_fraction", "0.9"], "must be in (0, 0.5)"),
    (["--model.vocab_size", "100"], "must be at least the tokenizer's vocabulary"),
    (["--parallel.zero_stage", "4"], "must be 1, 2 or 3"),
    (["--model.flavor", "llama3-405b"], "GiB"),
    (["stray"], "expected an option"),
    (["--train.lr", "nan"], "finite"),
]


@pytest.mark.parametrize("args,needle", BAD_CLI, ids=[" ".join(a) for a, _ in BAD_CLI])
def test_bad_cli_input_is_one_line_exit_2(args: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", *args]) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1, out.err
    assert lines[0].startswith("isthmus: error:")
    assert needle in lines[0]
    assert out.out == ""


BAD_TOML = [
    ("[train\nsteps = 1", "not valid TOML"),
    ('[train]\nsteps = "ten"', "train.steps"),
    ("steps = 3", "sections"),
    ("[train]\nbatch_size = 2.5", "must be an integer"),
    ("[model]\nflavor = 3", "must be a string"),
]


@pytest.mark.parametrize("text,needle", BAD_TOML)
def test_bad_toml_is_one_line_exit_2(
    text: str, needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(text)
    assert main(["train", "--config", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_error_through_real_process_has_no_traceback() -> None:
    proc = run_isthmus("train", "--train.seq_len", "-5", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["isthmus: error: train.seq_len = -5: must be at least 1"]
    assert "Traceback" not in proc.stderr


def test_bad_generate_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--run", str(tmp_path / "nope")]) == 2
    assert "no such run directory" in capsys.readouterr().err
    assert main(["generate"]) == 2
    assert "--run" in capsys.readouterr().err


def test_print_config_shows_resolved_values(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--print-config", "--train.steps", "11"]) == 0
    assert "steps = 11" in capsys.readouterr().out
