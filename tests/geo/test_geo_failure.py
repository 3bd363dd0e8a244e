"""A datacenter dies under fault-tolerant diloco: the other trains on; restarted, it rejoins.

Two datacenters, each its own torch.distributed job in its own processes (one rank each; two for
one rejoin run), joined by a torchft Lighthouse in this process on 127.0.0.1. The real Trainer
runs in every process; the test only pauses a datacenter at a chosen point (a file it waits for)
so that the SIGKILL, sent from here, and the restart land at known places. Outer rounds follow
steps 3, 6, 9, 12 and 15 (diloco, H = 3), or every step (streaming, 3 fragments).

- kill: dc1 is SIGKILLed waiting to run step 5; dc0 finishes its 15 steps alone from round 6 on.
- kill_in_round: dc1 dies inside round 6, after sending its pseudo-gradient, before its weight:
  dc0's all-reduce fails, round 6 is dropped, and dc0 goes on alone from round 9.
- rejoin (1 and 2 ranks per datacenter, diloco and streaming): killed as in `kill`, dc1 is
  started again; dc0 waits before step 8 until the new dc1 is asking for a quorum, so it joins
  dc0's round 9: it receives the global model, adds nothing to that round, and both contribute
  to every round after it.

The five runs go side by side (each has its own lighthouse): most of their time is waiting.
"""

from __future__ import annotations

import importlib.util
import math
import multiprocessing as mp
import os
import pickle
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import torch

from isthmus.config import GeoConfig, JobConfig, build_config, parse_overrides
from isthmus.errors import ConfigError, IsthmusError
from isthmus.geo.fault import RoundRecord, check_config, job_from_env, layout_world, start_lighthouse
from isthmus.parallel.rendezvous import LOOPBACK, loopback_store_server, served_store_environ

STEPS, H = 15, 3
KILL_BEFORE = 5  # dc1 is killed while waiting to run step 5 (rounds after steps 3, 6, 9, 12, 15)
REJOIN_BEFORE = 8  # dc0 waits here until the restarted dc1 asks for a quorum: it joins at step 9
WAIT_S = 60.0


def _config(root: Path, ranks: int, streaming: bool) -> JobConfig:
    # streaming: a fragment syncs after every step (3 fragments of H = 3), its result applied at once.
    geo = (
        [
            "--geo.sync",
            "streaming_diloco",
            "--geo.fragments",
            "3",
            "--geo.overlap_steps",
            "0",
            "--geo.outer_dtype",
            "fp32",
        ]
        if streaming
        else ["--geo.sync", "diloco"]
    )
    cfg = build_config(
        None,
        parse_overrides(
            [
                *geo,
                "--model.flavor",
                "tiny",
                "--train.steps",
                str(STEPS),
                "--train.warmup_steps",
                "3",
                "--train.batch_size",
                "8",
                "--train.seq_len",
                "32",
                "--train.val_every",
                "0",
                "--train.threads",
                "1",
                "--data.max_bytes",
                "60000",
                "--data.cache_dir",
                str(root / "cache"),
                "--metrics.progress",
                "false",
                "--train.run_dir",
                str(root / "run"),
                "--parallel.dp_replicate",
                str(ranks),
                "--geo.datacenters",
                "2",
                "--geo.inner_steps",
                str(H),
            ]
        ),
    )
    cfg.geo.fault_tolerant = True
    return cfg


def _wait_for(path: Path, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} did not appear within {timeout:.0f} s")
        time.sleep(0.02)


def _flat(params: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params]).clone()


def _rank(
    dc: int,
    rank: int,
    ranks: int,
    port: int,
    lighthouse: str,
    root: Path,
    tag: str,
    pause_before: int | None,
    pause_in_round: int | None,
    streaming: bool,
) -> None:
    """One rank of one datacenter (its own torch.distributed job): the real Trainer, plus records."""
    os.environ.update(
        ISTHMUS_DC_INDEX=str(dc),
        TORCHFT_LIGHTHOUSE=lighthouse,
        TORCHFT_TIMEOUT_SEC="20",
        TORCHFT_QUORUM_TIMEOUT_SEC=str(int(WAIT_S)),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(ranks),
        LOCAL_WORLD_SIZE=str(ranks),
        MASTER_ADDR=LOOPBACK,
        MASTER_PORT=str(port),
        **served_store_environ(port),
    )
    torch.set_num_threads(1)
    control, me = root / "control", f"{tag}.{rank}"
    out: dict[str, Any] = {"after_round": {}}
    try:
        from isthmus.train.trainer import Trainer

        trainer = Trainer(_config(root, ranks, streaming))
        sync = trainer.geo_run.sync
        step_fn, after_fn, join_fn = trainer.train_step, sync.after_optimizer_step, sync.join
        round_fn, all_reduce_fn = sync._start_round, sync._ft_all_reduce

        def train_step() -> Any:
            if trainer.step == pause_before:
                (control / f"{me}-at-{trainer.step}").touch()
                _wait_for(control / f"{tag}-go-{trainer.step}")
            return step_fn()

        def after_optimizer_step(step: int, ps: list[torch.nn.Parameter]) -> None:
            after_fn(step, ps)
            if sync.history and sync.history[-1].step == step + 1:  # a round ended here
                out["after_round"][step + 1] = sync.global_snapshot()

        def join(ps: list[torch.nn.Parameter]) -> int:
            (control / f"{me}-joining").touch()
            start = join_fn(ps)
            out["joined_at"], out["params_after_join"] = start, _flat(ps)
            return start

        def start_round(f: int, t: int, ps: list[torch.nn.Parameter], contribute: bool) -> Any:
            if not contribute:  # healed: the snapshot is what another datacenter sent
                out["healed_snapshot"] = sync.global_snapshot()
            return round_fn(f, t, ps, contribute)

        def ft_all_reduce(t: torch.Tensor, n: int) -> Any:
            # The contribution weight goes last: its gradient shards are on the wire already.
            if t.numel() == 1 and sync._round_step == pause_in_round:
                (control / f"{me}-in-round-{pause_in_round}").touch()
                _wait_for(control / "never")
            return all_reduce_fn(t, n)

        trainer.train_step, sync.after_optimizer_step, sync.join = train_step, after_optimizer_step, join
        sync._start_round, sync._ft_all_reduce = start_round, ft_all_reduce
        (control / f"{me}-ready").touch()
        _wait_for(control / "start")  # every first-generation datacenter is heartbeating by now
        result = trainer.fit()
        out.update(losses=result.losses, history=sync.history, final_step=trainer.step)
        status: tuple[str, Any] = ("ok", out)
    except BaseException:  # noqa: BLE001 - reported to the test with its traceback
        status = ("error", traceback.format_exc())
    (root / f"{me}.pkl").write_bytes(pickle.dumps(status))


def _context() -> Any:
    # Forked from one server that imported torch and the trainer once: a datacenter (re)starts in
    # well under a second instead of re-importing everything.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["isthmus.train.trainer", __name__])
    return ctx


def _start(
    stores: ExitStack,
    dc: int,
    ranks: int,
    lighthouse: str,
    root: Path,
    tag: str,
    pause_before: int | None,
    pause_in_round: int | None = None,
    streaming: bool = False,
) -> list[Any]:
    """Every rank of datacenter ``dc``, joined by their own gloo group (their own store, served here
    while ``stores`` is open)."""
    port = stores.enter_context(loopback_store_server())
    args = (dc, ranks, port, lighthouse, root, tag, pause_before, pause_in_round, streaming)
    procs = [_context().Process(target=_rank, args=(args[0], j, *args[1:]), daemon=True) for j in range(ranks)]
    for p in procs:
        p.start()
    return procs


def _results(root: Path, tag: str, ranks: int) -> list[dict[str, Any]]:
    values = []
    for j in range(ranks):
        status, value = pickle.loads((root / f"{tag}.{j}.pkl").read_bytes())
        assert status == "ok", f"{tag} rank {j} failed:\n{value}"
        values.append(value)
    return values


def _scenario(root: Path, ranks: int, rejoin: bool, in_round: bool = False, streaming: bool = False) -> dict[str, Any]:
    from isthmus.data.corpus import prepare_data

    cfg = _config(root, ranks, streaming)
    prepare_data(cfg.data, cfg.train.seq_len)  # fill the token cache once, before the datacenters start
    control = root / "control"
    control.mkdir(parents=True)
    # 1 s of silence drops a datacenter: the survivor's next round waits about that long.
    lighthouse = start_lighthouse(heartbeat_timeout_ms=1000, join_timeout_ms=5000)
    dcs: dict[str, list[Any]] = {}
    stores = ExitStack()
    try:
        dcs["dc0"] = _start(
            stores, 0, ranks, lighthouse.address, root, "dc0", REJOIN_BEFORE if rejoin else None, streaming=streaming
        )
        # dc1 dies between outer rounds (waiting to run step 5), or inside the round at step 6.
        dcs["dc1"] = _start(
            stores,
            1,
            ranks,
            lighthouse.address,
            root,
            "dc1",
            None if in_round else KILL_BEFORE,
            2 * H if in_round else None,
            streaming,
        )
        for tag in ("dc0", "dc1"):
            for j in range(ranks):
                _wait_for(control / f"{tag}.{j}-ready")
        (control / "start").touch()
        for j in range(ranks):
            _wait_for(control / (f"dc1.{j}-in-round-{2 * H}" if in_round else f"dc1.{j}-at-{KILL_BEFORE}"))
        for p in dcs["dc1"]:
            p.kill()  # SIGKILL every rank of dc1: no handler runs, nothing says goodbye to the lighthouse
        for p in dcs["dc1"]:
            p.join(10)
        out: dict[str, Any] = {"killed_exitcodes": [p.exitcode for p in dcs["dc1"]]}
        if rejoin:
            # After dc0's round at step 6 (alone), so the restart cannot slip into that one.
            _wait_for(control / f"dc0.0-at-{REJOIN_BEFORE}")
            dcs["dc1b"] = _start(stores, 1, ranks, lighthouse.address, root, "dc1b", None, streaming=streaming)
            for j in range(ranks):
                _wait_for(control / f"dc1b.{j}-joining")
            time.sleep(1.0)  # its quorum request reaches the lighthouse before dc0's
            (control / f"dc0-go-{REJOIN_BEFORE}").touch()
        for tag in ("dc0", "dc1b"):
            for p in dcs.get(tag, []):
                p.join(WAIT_S)
            if tag in dcs:
                out[tag] = _results(root, tag, ranks)
        return out
    finally:
        for procs in dcs.values():
            for p in procs:
                if p.is_alive():
                    p.kill()
        lighthouse.shutdown()
        stores.close()


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    # The test extra installs torchft; without it this fails rather than skips. Found, not imported:
    # its Rust logging reads RUST_LOG once, in the rank processes.
    assert importlib.util.find_spec("torchft") is not None, "torchft is missing: pip install -e '.[test]'"
    plans = {
        "kill": (1, False, False),
        "kill_in_round": (1, False, True),
        "rejoin": (1, True, False),
        "rejoin_2ranks": (2, True, False),
        "rejoin_streaming": (1, True, False, True),
    }
    with ThreadPoolExecutor(len(plans)) as pool:
        runs = {
            name: pool.submit(_scenario, tmp_path_factory.mktemp(f"geo_{name}"), *plan) for name, plan in plans.items()
        }
        return {name: run.result() for name, run in runs.items()}


def _rounds(history: list[RoundRecord]) -> dict[int, tuple[int, int, bool, bool]]:
    return {r.step: (r.participants, r.contributors, r.committed, r.healed) for r in history}


def _assert_finite_and_falling(losses: list[float]) -> None:
    assert all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses


@pytest.mark.slow
def test_survivor_completes_its_steps_alone_with_a_falling_loss(scenarios: dict[str, Any]) -> None:
    run = scenarios["kill"]
    assert run["killed_exitcodes"] == [-9]
    dc0 = run["dc0"][0]
    assert dc0["final_step"] == STEPS and len(dc0["losses"]) == STEPS
    _assert_finite_and_falling(dc0["losses"])
    rounds = _rounds(dc0["history"])
    assert rounds[0] == (2, 0, True, False)  # both met at the start
    assert rounds[3] == (2, 2, True, False)  # both contributed before the kill
    for t in range(6, STEPS + 1, H):  # dc1 dropped from the quorum; dc0's outer steps go on alone
        assert rounds[t] == (1, 1, True, False), (t, rounds[t])


@pytest.mark.slow
@pytest.mark.parametrize("name, ranks", [("rejoin", 1), ("rejoin_2ranks", 2), ("rejoin_streaming", 1)])
def test_restarted_datacenter_rejoins_from_the_global_model(scenarios: dict[str, Any], name: str, ranks: int) -> None:
    run = scenarios[name]
    assert run["killed_exitcodes"] == [-9] * ranks
    dc0, dc1 = run["dc0"], run["dc1b"]
    join = 3 * H
    before = max(t for t in dc0[0]["after_round"] if t < join)  # the survivor's last round before the rejoin
    for j in range(ranks):  # rank j of each datacenter holds shard j of the outer state
        assert dc1[j]["joined_at"] == join
        # It received the global model as of the round it joined, then took that round's outer
        # step with the others: right after joining it holds the survivor's new snapshot exactly.
        assert torch.equal(dc1[j]["healed_snapshot"], dc0[j]["after_round"][before])
    snapshot = torch.cat([dc0[j]["after_round"][join] for j in range(ranks)])
    for j in range(ranks):
        params = dc1[j]["params_after_join"]
        assert torch.equal(params, snapshot[: params.numel()])
    assert not torch.equal(dc0[0]["after_round"][join], dc0[0]["after_round"][before])

    for j in range(ranks):
        rounds0, rounds1 = _rounds(dc0[j]["history"]), _rounds(dc1[j]["history"])
        assert rounds0[2 * H] == (1, 1, True, False)  # alone after the kill
        assert rounds0[join] == (2, 1, True, False)  # dc1 in the quorum but healing: it adds nothing yet
        assert rounds1[join] == (2, 1, True, True)
        later = [t for t in rounds0 if t > join]
        assert later and later == [t for t in rounds1 if t > join]
        for t in later:  # from the next round on, both contribute again
            assert rounds0[t] == rounds1[t] == (2, 2, True, False), (t, rounds0[t], rounds1[t])
            assert torch.equal(dc0[j]["after_round"][t], dc1[j]["after_round"][t])
        assert dc0[j]["final_step"] == dc1[j]["final_step"] == STEPS
        assert len(dc1[j]["losses"]) == STEPS - join  # it continued at the survivor's step
        _assert_finite_and_falling(dc0[j]["losses"])
        assert all(math.isfinite(x) for x in dc1[j]["losses"])


@pytest.mark.slow
def test_a_round_broken_by_the_death_is_dropped_and_the_next_goes_on_alone(scenarios: dict[str, Any]) -> None:
    run = scenarios["kill_in_round"]
    assert run["killed_exitcodes"] == [-9]
    dc0 = run["dc0"][0]
    rounds = _rounds(dc0["history"])
    # dc1 sent its pseudo-gradient for the round at step 6 and died before its weight: dc0's
    # all-reduce fails, the round is not committed and the snapshot stays where it was.
    assert rounds[2 * H] == (2, 0, False, False)
    assert torch.equal(dc0["after_round"][2 * H], dc0["after_round"][H])
    for t in range(3 * H, STEPS + 1, H):
        assert rounds[t] == (1, 1, True, False), (t, rounds[t])
    assert dc0["final_step"] == STEPS
    _assert_finite_and_falling(dc0["losses"])


def _geo(**kw: Any) -> GeoConfig:
    cfg = GeoConfig(**{"sync": "diloco", "datacenters": 2, **kw})
    cfg.fault_tolerant = True
    return cfg


@pytest.mark.parametrize(
    "kw, key",
    [
        ({"sync": "hierarchical"}, "geo.fault_tolerant"),
        ({"datacenters": 1}, "geo.datacenters"),
        ({"sync": "streaming_diloco"}, "geo.outer_dtype"),  # auto is int4 for streaming
        ({"outer_dtype": "bf16"}, "geo.outer_dtype"),
        (
            {"sync": "streaming_diloco", "outer_dtype": "fp32", "inner_steps": 8, "fragments": 4, "overlap_steps": 2},
            "geo.overlap_steps",
        ),
    ],
)
def test_fault_tolerant_settings_it_cannot_run_are_refused(kw: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as e:
        check_config(_geo(**kw))
    assert e.value.key == key


def test_job_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert job_from_env(GeoConfig(sync="diloco", datacenters=2)) is None
    assert layout_world(_geo(), 3) == 6 and layout_world(GeoConfig(datacenters=2), 3) == 3
    monkeypatch.delenv("ISTHMUS_DC_INDEX", raising=False)
    with pytest.raises(IsthmusError, match="ISTHMUS_DC_INDEX"):
        job_from_env(_geo())
    monkeypatch.setenv("ISTHMUS_DC_INDEX", "2")
    with pytest.raises(IsthmusError, match="0 .. 1"):
        job_from_env(_geo())
    monkeypatch.setenv("ISTHMUS_DC_INDEX", "1")
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(IsthmusError, match="TORCHFT_LIGHTHOUSE"):
        job_from_env(_geo())
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:29510")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    job = job_from_env(_geo())
    assert job is not None and (job.dc_index, job.n_dc, job.address) == (1, 2, "10.0.0.7")
