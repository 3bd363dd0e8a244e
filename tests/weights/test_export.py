"""`isthmus export`: a sharded run's model as one safetensors file; `isthmus generate` reads both forms.

The source run is tensor-parallel over 2 ranks with a tied head, so its checkpoint holds DTensor
shards and one tensor under two names; the export must be the whole model, the head stored once.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from isthmus.cli import main
from isthmus.log import setup_logging
from isthmus.models.llama import build_model
from isthmus.weights.export import load_exported
from isthmus.weights.final_model import load_final_state, load_model_args
from procs import run_isthmus, tiny_run

STEPS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("export")
    run_dir = tmp / "tp2"
    proc = run_isthmus(
        "train",
        *tiny_run(STEPS, batch_size=4),
        "--parallel.nproc",
        "2",
        "--parallel.tp",
        "2",
        "--model.tie_embeddings",
        "true",
        "--checkpoint.every",
        str(STEPS),
        "--train.run_dir",
        str(run_dir),
        "--data.cache_dir",
        str(tmp / "cache"),
        env={"ISTHMUS_CACHE": str(tmp / "cache")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Iterator[pytest.CaptureFixture[str]]:
    """main() in this process; the logger it points at the captured stderr is detached afterwards."""
    yield capsys
    setup_logging(console=False)


def _final_model(run: Path) -> torch.nn.Module:
    model = build_model(load_model_args(run / "final"), device="cpu")
    model.load_state_dict(load_final_state(run / "final"))
    return model.eval()


def _error_line(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("isthmus: error:")]
    assert len(errors) == 1 and stderr.rstrip().endswith(errors[0]) and "Traceback" not in stderr, stderr
    return errors[0]


@pytest.mark.slow
def test_export_of_a_tp_checkpoint_gives_the_final_models_logits(
    run: Path, tmp_path: Path, cli: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model.safetensors"
    assert main(["export", "--run", str(run), "--out", str(out), "--checkpoint"]) == 0
    assert f"step-{STEPS:06d} (step {STEPS})" in cli.readouterr().out

    exported = load_exported(out)
    assert exported.args == load_model_args(run / "final")
    assert exported.config["parallel"]["tp"] == 2 and exported.config["train"]["steps"] == STEPS
    tokens = torch.randint(0, exported.args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(exported.build()(tokens), _final_model(run)(tokens))

    from safetensors import safe_open

    with safe_open(str(out), framework="pt") as f:
        names, metadata = set(f.keys()), f.metadata()
    assert "output.weight" not in names and "tok_embeddings.weight" in names  # the tied head once
    assert json.loads(metadata["isthmus.tied"]) == {"output.weight": "tok_embeddings.weight"}
    assert json.loads(metadata["isthmus.model_args"])["tie_embeddings"] is True


@pytest.mark.slow
def test_generate_reads_both_forms_alike(run: Path, tmp_path: Path, cli: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "final.safetensors"
    assert main(["export", "--run", str(run), "--out", str(out)]) == 0  # a finished run: its final model
    assert "final model" in cli.readouterr().out
    args = ["--prompt", "def ", "--max-new-tokens", "20", "--seed", "3"]
    assert main(["generate", "--model", str(out), *args]) == 0
    from_file = cli.readouterr().out
    assert main(["generate", "--run", str(run), *args]) == 0
    assert from_file == cli.readouterr().out and from_file.startswith("def ") and len(from_file) > len("def ") + 5


@pytest.mark.slow
def test_a_run_without_final_model_exports_its_newest_good_checkpoint(
    run: Path, tmp_path: Path, cli: pytest.CaptureFixture[str]
) -> None:
    crashed = tmp_path / "crashed"
    shutil.copytree(run, crashed, ignore=shutil.ignore_patterns("final"))
    out = tmp_path / "c.safetensors"
    assert main(["export", "--run", str(crashed), "--out", str(out)]) == 0
    assert "checkpoint" in cli.readouterr().out
    reference = load_final_state(run / "final")
    state = load_exported(out).state
    assert state.keys() == reference.keys() and all(torch.equal(state[k], reference[k]) for k in reference)


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:1000])


@pytest.mark.slow
def test_bad_input_is_one_line(run: Path, tmp_path: Path, cli: pytest.CaptureFixture[str]) -> None:
    def fails(*argv: str) -> str:
        assert main(list(argv)) == 2
        return _error_line(cli.readouterr().err)

    out = str(tmp_path / "m.safetensors")
    assert "no such run directory" in fails("export", "--run", str(tmp_path / "nope"), "--out", out)
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(run / "config.toml", empty / "config.toml")
    assert "no final model and no good checkpoint" in fails("export", "--run", str(empty), "--out", out)
    assert "must end in .safetensors" in fails("export", "--run", str(run), "--out", str(tmp_path / "m.pt"))
    (tmp_path / "taken.safetensors").mkdir()
    assert "cannot be written" in fails("export", "--run", str(run), "--out", str(tmp_path / "taken.safetensors"))
    assert "no such directory" in fails("export", "--run", str(run), "--out", str(tmp_path / "no" / "m.safetensors"))

    assert main(["export", "--run", str(run), "--out", out]) == 0
    cli.readouterr()
    for damage, message in ((_flip_last_byte, "checksum mismatch"), (_truncate, "not a readable safetensors file")):
        bad = tmp_path / f"{damage.__name__}.safetensors"
        shutil.copy(out, bad)
        damage(bad)
        line = fails("generate", "--model", str(bad))
        assert message in line and str(bad) in line, line
    assert "no such file" in fails("generate", "--model", str(tmp_path / "missing.safetensors"))
