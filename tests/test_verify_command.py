"""`vllm-hotfix verify` as a command a script can trust: its exit codes (0 PASS, 1 FAIL, 2 not
everything checked, 3 the command or vLLM failed, 4 usage error), this run's records only, every
expected rank counted, the ranks' records combined after the run, engine arguments through vLLM's
own parser, --json, --timeout, and `vllm-hotfix status`'s line on the check.

The verdict logic runs on report dicts (what outcome.py makes of the ranks' records; with and
without the fields other parts of the check add: per_id, errors); the combining runs on records
made by the ranks' own function (checks.record) on small tensors. The command's failures run the
real command on the real vLLM of the test environment; one of them starts the engine (a checkpoint
without its weights, so that vLLM fails while starting). The passing and failing engine runs are in
tests/test_verify.py.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from harness.testenv import TestEnv
from harness.ways_in import install_plugin
from vllm_hotfix.check import outcome, records
from vllm_hotfix.check.checks import StepCheck
from vllm_hotfix.check.outcome import World, verdict_of_run
from vllm_hotfix.commands import cli, session
from vllm_hotfix.commands import verify as command
from vllm_hotfix.commands.output import SCHEMAS
from vllm_hotfix.commands.parser import DEFAULT_TIMEOUT, aux_ids
from vllm_hotfix.commands.status import format_text
from vllm_hotfix.judging.engine_facts import in_vllm_order

RUN = "this-run"


def worker(rank: int = 0, world: int = 1, verdict: str = "PASS", run_id: str | None = RUN, **more: Any):
    """A rank's report as outcome.py makes it (the keys the verdict reads)."""
    found = {
        "verdict": verdict,
        "run_id": run_id,
        "pid": 100 + rank,
        "host": "node",
        "rank": rank,
        "world": world,
        "steps": 8,
        "note": None,
        "coverage": {"ok": True, "ids": 2, "compared": [1, 2], "not_compared": []},
    }
    found.update(more)
    return found


def test_every_rank_passing_every_forward_is_a_pass() -> None:
    done = verdict_of_run([worker(0, 2), worker(1, 2)], RUN, World(2))
    assert (done.verdict, done.exit_code, done.problems) == ("PASS", 0, [])


def test_a_stale_report_never_counts() -> None:
    stale = worker(run_id="an-earlier-run")
    alone = verdict_of_run([stale], RUN, World(1))
    assert (alone.verdict, alone.exit_code, alone.ignored, alone.reports) == ("UNKNOWN", 2, 1, [])
    assert "1 report(s) of other runs ignored" in alone.reason
    unset = verdict_of_run([worker(run_id=None)], RUN, World(1))  # a report of a server, not of this command
    assert unset.exit_code == 2 and unset.ignored == 1
    # the case this guards: a stale PASS left in --report-dir and an engine that failed at start
    failed = verdict_of_run([stale], RUN, World(1), error="vLLM failed while starting vLLM: RuntimeError: x")
    assert (failed.verdict, failed.exit_code) == ("UNKNOWN", 3) and failed.reason.startswith("vLLM failed")
    assert failed.problems == []  # no "0 of the 1 worker process(es) reported" beside vLLM's own error


def test_a_missing_rank_is_not_a_pass() -> None:
    done = verdict_of_run([worker(0, 2)], RUN, World(2))
    assert (done.verdict, done.exit_code) == ("UNKNOWN", 2)
    assert done.problems[0].startswith("1 of the 2 worker process(es) that 2 tensor x 1 data parallel")
    assert "no report from tensor-parallel rank(s) [1]" in done.problems
    # pipeline parallel: only the last stage holds aux states, so its TP ranks are the ones counted
    assert World(2, 2).processes == 2 and World(2, 1, 2).processes == 4
    assert verdict_of_run([worker(0, 2), worker(1, 2)], RUN, World(2, 2)).exit_code == 0
    staged = verdict_of_run([worker(0, 2)], RUN, World(2, 4))
    assert staged.problems[0] == (
        "1 of the 2 worker process(es) that 2 tensor x 1 data parallel imply (the last of 4 pipeline"
        " stage(s)) reported"
    )
    assert verdict_of_run([worker(0, 2), worker(1, 2)], RUN, World(1)).exit_code == 2  # a group of 2, not 1


def test_an_id_not_compared_is_not_a_pass() -> None:
    """Count, shape and finiteness alone never PASS. A rank whose forwards compared every id but
    one says UNKNOWN (outcome.py); the run is UNKNOWN, exit 2, naming the id and why."""
    why = "id 1 is not tapped on this rank (its layers' boundaries 2..3)"
    partly = {"ok": False, "ids": 2, "compared": [2], "not_compared": [{"id": 1, "why": why}]}
    reports = [worker(r, 2, "UNKNOWN", coverage=partly) for r in (0, 1)]
    done = verdict_of_run(reports, RUN, World(2))
    assert (done.verdict, done.exit_code) == ("UNKNOWN", 2)
    assert done.reason == "rank 0 (pid 100): UNKNOWN (id 1 not compared on any forward)"
    assert f"rank 1 (pid 101): id 1 not compared on any forward: {why}" in done.problems
    assert outcome.coverage(reports) == {
        "ok": False,
        "not_compared": [{"id": 1, "ranks": [0, 1], "why": why}],
        "partly_compared": [],
    }
    # a PASS that does not say what it compared (a report of another version, a harness) is no PASS
    bare = worker()
    del bare["coverage"]
    done = verdict_of_run([bare], RUN, World(1))
    assert done.exit_code == 2 and "does not say that every requested id was compared" in done.reason
    assert outcome.coverage([worker(), bare])["ok"] is False and outcome.coverage([])["ok"] is False
    assert outcome.coverage([worker(0, 2), worker(1, 2)]) == {
        "ok": True,
        "not_compared": [],
        "partly_compared": [],
    }


def _step(tokens: int, *statuses: str) -> StepCheck:
    """A forward of `tokens` tokens whose ids (1, 2, ...) were judged `statuses`."""
    step = StepCheck(tokens, True, "ok")
    step.per_id = [
        {"id": i, "status": s, "max_rel_diff": 0.0 if s == "ok" else None, "tolerance": 1e-4, "reference": ""}
        | ({} if s == "ok" else {"why": f"id {i} not tapped here"})
        for i, s in enumerate(statuses, 1)
    ]
    return step


def _summary(facts: dict[str, Any], checks: list[StepCheck]) -> dict[str, Any]:
    """One rank's report from its forwards' checks, folded as records.py folds them."""
    tally = outcome.Tally(list(facts.get("ids") or []))
    for check in checks:
        tally.add(check)
    return tally.report(facts)


def _read_run(report_dir: str, run_id: str) -> tuple[list[dict[str, Any]], int]:
    """Every rank's report of the run, and the other runs' directories, as the session's end reads them."""
    found = records.RunRecords(report_dir, run_id)
    found.consume(final=True)
    return found.reports(), found.other_runs()


def test_a_pass_counts_the_forwards_an_id_was_not_compared_on() -> None:
    """An id compared on some forwards and not others: the PASS reason and the JSON count them; an
    id compared on no forward of some size is a problem (that size is unproven for it)."""
    facts = {"run_id": RUN, "pid": 100, "host": "node", "tp": 0, "tp_world": 1, "ids": [1, 2]}
    every = _summary(facts, [_step(16, "ok", "ok"), _step(16, "ok", "ok")])
    assert every["coverage"]["partly_compared"] == [] and every["verdict"] == "PASS"
    assert verdict_of_run([every], RUN, World(1)).reason.startswith("every forward of the 1 worker")
    partly = _summary(facts, [_step(16, "ok", "ok"), _step(16, "ok", "n/a"), _step(40, "ok", "ok")])
    assert partly["verdict"] == "PASS" and partly["coverage"]["ok"]
    assert partly["coverage"]["partly_compared"] == [
        {"id": 2, "checked": 3, "not_compared": 1, "why": "id 2 not tapped here"}
    ]
    done = verdict_of_run([partly], RUN, World(1))
    assert (done.verdict, done.exit_code) == ("PASS", 0)
    assert "not every id was compared on every forward: id 2 on 1 of 3 forwards (id 2 not tapped here)" in (
        done.reason
    )
    assert outcome.coverage([partly])["partly_compared"][0]["ranks"] == [0]
    gap = _summary(facts, [_step(16, "ok", "ok"), _step(40, "ok", "n/a")])
    assert gap["verdict"] == "UNKNOWN" and not gap["coverage"]["ok"]
    assert gap["coverage"]["not_compared"] == [{"id": 2, "why": "id 2 not tapped here", "tokens": [40]}]
    done = verdict_of_run([gap], RUN, World(1))
    assert done.exit_code == 2
    assert done.reason == "rank 0 (pid 100): UNKNOWN (id 2 not compared on any forward of [40] tokens)"
    assert "rank 0 (pid 100): id 2 not compared on any forward of [40] tokens: id 2 not tapped here" in (
        done.problems
    )


def test_a_rank_error_is_not_a_pass() -> None:
    note = "the check could not complete: rank 1 at projection: RuntimeError: planted"
    done = verdict_of_run(
        [worker(0, 2, "UNKNOWN", note=note), worker(1, 2, "UNKNOWN", note=note)], RUN, World(2)
    )
    assert done.exit_code == 2 and "at projection: RuntimeError: planted" in done.reason
    assert verdict_of_run([worker(errors=[], per_id=[])], RUN, World(1)).exit_code == 0


def _records(ids: list[int], plant: Any = None) -> list[dict[str, Any]]:
    """A rank's records of two forwards of 5 and 1 tokens (no taps: every id n/a), as hook.py
    writes them; `plant` changes the aux states first."""
    import torch

    from vllm_hotfix.check.checks import record

    generator = torch.Generator().manual_seed(0)
    found = []
    for tokens in (5, 1):
        hidden = torch.randn(tokens, 16, generator=generator)
        aux = [hidden + i for i in range(len(ids))]
        found.append(record(plant(aux) if plant else aux, hidden, ids, 16, 64))
    return found


def _write_rank(run_dir: Path, tp: int, records: list[dict[str, Any]], ids: list[int]) -> None:
    import torch

    where = run_dir / f"dp0-pp0-tp{tp}-node-{100 + tp}"
    where.mkdir(parents=True)
    facts = {"run_id": run_dir.name, "pid": 100 + tp, "host": "node", "tp": tp, "tp_world": 2, "ids": ids}
    (where / "facts.json").write_text(json.dumps(facts | {"pp": 0, "pp_world": 1, "dp": 0, "dp_world": 1}))
    for n, found in enumerate(records, 1):
        torch.save(found, where / f"step-{n:06d}.pt")


def test_the_ranks_records_are_combined_after_the_run(tmp_path: Path) -> None:
    """outcome.py reads this run's directory only, judges forward n of every rank together, and
    names a rank whose record of a forward is missing; a rank's planted fault makes both reports
    FAIL with the ranks disagreeing (no exchange: the command compares the ranks' records)."""
    pytest.importorskip("torch")
    ids = [1, 2]
    (tmp_path / "an-earlier-run").mkdir()
    _write_rank(tmp_path / RUN, 0, _records(ids), ids)
    _write_rank(tmp_path / RUN, 1, _records(ids)[:1], ids)  # rank 1 recorded the first forward only
    reports, ignored = _read_run(str(tmp_path), RUN)
    assert ignored == 1 and [r["rank"] for r in reports] == [0, 1] and [r["steps"] for r in reports] == [2, 2]
    assert all(r["verdict"] == "UNKNOWN" and "from rank(s) [1]" in r["note"] for r in reports), reports
    shutil.rmtree(tmp_path / RUN)
    _write_rank(tmp_path / RUN, 0, _records(ids), ids)
    _write_rank(tmp_path / RUN, 1, _records(ids, lambda aux: [aux[0] * 1.5, aux[1]]), ids)
    reports, _ = _read_run(str(tmp_path), RUN)
    for found in reports:
        assert found["verdict"] == "FAIL" and not found["ranks_agree"]["ok"], found
        assert found["ranks_agree"]["worst_id"] == 1 and found["count"]["ok"]
    done = verdict_of_run(reports, RUN, World(2))
    assert (done.verdict, done.exit_code) == ("FAIL", 1)


def test_a_fail_is_a_fail_even_when_vllm_then_stops() -> None:
    reports = [worker(0, 2, "FAIL"), worker(1, 2, "FAIL"), worker(0, 2, run_id="old")]
    done = verdict_of_run(reports, RUN, World(2), error="vLLM failed: EngineDeadError")
    assert (done.verdict, done.exit_code, done.ignored) == ("FAIL", 1, 1)
    assert "then vLLM stopped: vLLM failed: EngineDeadError" in done.reason
    assert verdict_of_run([worker(0, 2, "FAIL")], RUN, World(2)).exit_code == 1  # even with a rank missing


def test_a_rank_that_recorded_nothing_is_nothing_checked() -> None:
    none = verdict_of_run(
        [worker(verdict="UNKNOWN", steps=0, note="no forward with aux states was recorded")], RUN, World(1)
    )
    assert none.exit_code == 2 and "no forward with aux states was recorded" in none.reason


def test_per_id_figures_over_ranks() -> None:
    def entry(i: int, status: str, figure: float | None, why: str | None = None) -> dict[str, Any]:
        return {
            "id": i,
            "status": status,
            "max_rel_diff": figure,
            "tolerance": 2e-2,
            "reference": "r",
            "why": why,
        }

    rank0 = worker(0, 2, per_id=[entry(2, "ok", 0.001), entry(4, "n/a", None, "no norm")])
    rank1 = worker(1, 2, per_id=[entry(2, "wrong", 0.9, "partial sum"), entry(4, "n/a", None, "no norm")])
    merged = outcome.per_id([rank0, rank1])
    assert [(row["id"], row["status"], row["max_rel_diff"]) for row in merged] == [
        (2, "wrong", 0.9),
        (4, "n/a", None),
    ]
    assert merged[0]["ranks"] == {"0": "ok", "1": "wrong"} and merged[0]["why"] == "partial sum"
    assert outcome.per_id([worker()]) == []  # reports without per-id figures
    text = command.format_reports([rank1])
    assert "id 2: wrong (max rel diff 0.9 vs r): partial sum" in text


def test_engine_arguments_pass_through_and_status_takes_none() -> None:
    args = cli.parse(["verify", "M", "--ids", "4", "--", "--tensor-parallel-size", "2", "--ids", "x"])
    assert (args.model, args.ids, args.engine_args) == (
        "M",
        [4],
        ["--tensor-parallel-size", "2", "--ids", "x"],
    )
    args = cli.parse(["verify", "M", "-tp", "2", "--load-format", "dummy", "--json", "--ids", "1,2"])
    assert args.engine_args == ["-tp", "2", "--load-format", "dummy"] and args.json and args.ids == [1, 2]
    with pytest.raises(SystemExit) as stop:
        cli.parse(["status", "--tensor-parallel-size", "2"])
    assert stop.value.code == 4  # a usage error, never a verdict
    for bad in (["verify", "M", "--ids", "1,x"], ["verify", "M", "--batch-sizes", "0"], ["verify"]):
        with pytest.raises(SystemExit) as stop:
            cli.parse(bad)
        assert stop.value.code == 4, bad  # a usage error, not "nothing could be checked"


def test_status_shows_the_check_and_the_retired_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm_hotfix

    for name in ("VLLMHOTFIX_VERIFY_REPORT", "VLLMHOTFIX_VERIFY_RUN_ID", "VLLMHOTFIX_VERIFY_MODEL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLMHOTFIX_VERIFY", "1")
    status = vllm_hotfix.status()
    assert status["verify"] == {
        "run_id": None,
        "report_dir": None,
        "model": None,
        "retired_switch": "1",
        "problem": None,
    }
    text = format_text(status)
    assert "verify: `vllm-hotfix verify MODEL -- <engine flags>` checks the aux states" in text
    assert "verify: VLLMHOTFIX_VERIFY is set but retired: it installs nothing" in text


def test_the_retired_switch_installs_nothing_and_says_how_to_check(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """VLLMHOTFIX_VERIFY in a server: one line that says what to run instead; no hook is armed
    (the check's hooks need the three switches only the command sets)."""
    import vllm_hotfix
    from vllm_hotfix.check import hook

    monkeypatch.setenv("VLLMHOTFIX_VERIFY", "1")
    monkeypatch.setattr(hook, "arm", lambda: pytest.fail("armed by the retired switch"))
    monkeypatch.setattr("vllm_hotfix.runtime.arming.arm", lambda: None)
    vllm_hotfix._arm_engine()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "VLLMHOTFIX_VERIFY is retired and installs nothing" in err
    assert "vllm-hotfix verify MODEL -- <this server's engine flags>" in err


# -- the real command, on the real vLLM ----------------------------------------------------------


@pytest.fixture(scope="module")
def plugin(testenv: TestEnv, tmp_path_factory: pytest.TempPathFactory) -> str:
    return install_plugin(testenv, tmp_path_factory.mktemp("verify-command-plugin"))


def _verify(testenv: TestEnv, plugin: str, work: Path, *args: str, timeout: float = 600) -> Any:
    done = testenv.run(
        ["-m", "vllm_hotfix", "verify", *args],
        paths=(plugin,),
        timeout=timeout,
        VLLM_CACHE_ROOT=str(work / "vllm-cache"),
    )
    return done


def _stale_pass(directory: Path) -> None:
    """An earlier run's records and verdict, PASS, left in the report directory."""
    earlier = directory / "an-earlier-run"
    earlier.mkdir(parents=True, exist_ok=True)
    (earlier / "verdict.json").write_text(json.dumps({"verdict": "PASS", "exit_code": 0}))


@pytest.mark.vllm
def test_bad_options_exit_4_and_refused_engine_flags_3_in_one_line(
    testenv, plugin, tiny_checkpoint, tmp_path
) -> None:
    done = _verify(testenv, plugin, tmp_path, str(tiny_checkpoint), "--ids", "1,x")
    assert done.returncode == 4 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "argument --ids: '1,x': aux layer ids must be whole numbers" in done.stderr
    done = _verify(testenv, plugin, tmp_path, str(tiny_checkpoint), "--json", "--", "--no-such-flag", "2")
    assert done.returncode == 3 and "Traceback" not in done.stderr, done.stderr[-2000:]
    found = json.loads(done.stdout)  # the whole of stdout: one JSON document, vLLM's log elsewhere
    assert found["verdict"] == "UNKNOWN" and found["exit_code"] == 3 and found["ranks"] == []
    assert (
        "vLLM refused the engine arguments ['--no-such-flag', '2']: unrecognized arguments" in found["error"]
    )
    assert found["engine_args"] == ["--no-such-flag", "2"] and found["run_id"]
    # a speculative config of the user's is kept: its ids are checked, so --ids is refused
    own = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'
    done = _verify(
        testenv, plugin, tmp_path, str(tiny_checkpoint), "--ids", "1", "--", "--speculative-config", own
    )
    assert done.returncode == 3 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "--ids sets extract_hidden_states' layer ids; with your own --speculative-config" in done.stdout


@pytest.mark.vllm
def test_dummy_weights_say_what_they_cannot_show(testenv, plugin, tiny_checkpoint, tmp_path) -> None:
    """--load-format dummy reaches vLLM's parser and the output says what dummy weights cannot show;
    vLLM then refuses a tokenizer that does not exist: exit 3, a stale PASS in the directory ignored."""
    _stale_pass(tmp_path / "reports")
    args = [str(tiny_checkpoint), "--report-dir", str(tmp_path / "reports"), "--json", "--"]
    done = _verify(testenv, plugin, tmp_path, *args, "--load-format", "dummy", "--tokenizer", "/no/such/dir")
    assert done.returncode == 3, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert found["load_format"] == "dummy" and found["caveats"] == [session.DUMMY_CAVEAT]
    assert "cannot show that their values are right" in session.DUMMY_CAVEAT
    assert found["ignored_reports"] == 1 and found["ranks"] == [] and "/no/such/dir" in found["error"]
    assert found["error"].startswith(f"vLLM refused MODEL {tiny_checkpoint} or the engine arguments [")
    assert "Traceback" not in done.stderr


@pytest.mark.vllm
def test_timeout_exits_3_with_the_reason(testenv, plugin, tiny_checkpoint, tmp_path) -> None:
    args = [str(tiny_checkpoint), "--timeout", "2", "--", "--max-model-len", "128"]
    done = _verify(testenv, plugin, tmp_path, *args, timeout=300)
    assert done.returncode == 3, done.stdout + done.stderr[-3000:]
    assert "--timeout 2 s expired while" in done.stdout and "the engine was shut down" in done.stdout
    assert "exit 3" in done.stdout.splitlines()[-1]


@pytest.mark.vllm
@pytest.mark.engine
def test_a_stale_pass_and_an_engine_that_fails_at_start_exit_3(
    testenv, plugin, tiny_checkpoint, tmp_path
) -> None:
    """A PASS report of an earlier run in --report-dir and vLLM failing while it starts (here: the
    checkpoint's weights are missing) once gave `verdict: PASS` and exit 0; it is exit 3."""
    model = tmp_path / "no-weights"
    model.mkdir()
    for path in tiny_checkpoint.glob("*.json"):
        shutil.copy(path, model)
    _stale_pass(tmp_path / "reports")
    args = [
        str(model),
        "--report-dir",
        str(tmp_path / "reports"),
        "--",
        "--max-model-len",
        "128",
    ]
    done = _verify(testenv, plugin, tmp_path, *args)
    assert done.returncode == 3, done.stdout + done.stderr[-3000:]
    last = done.stdout.splitlines()[-1]
    assert last.startswith("verdict: UNKNOWN (vLLM failed while starting vLLM: ") and last.endswith("exit 3")
    assert "ignored 1 report(s) of other runs" in done.stdout and "PASS" not in last
    assert "Traceback" not in done.stdout


# -- the command in pipelines: no engine, vLLM's parser stood in ---------------------------------
class _Ended(Exception):
    """os._exit, stood in: the code the command would have exited with."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _end_early(monkeypatch: pytest.MonkeyPatch, argv: list[str], stop: BaseException) -> tuple[int, str, str]:
    """Run the command until vLLM's parser (stood in) raises `stop`: exit code, stdout, report dir."""
    import io

    def parse_engine_args(model: str, engine_args: list[str]) -> Any:
        raise stop

    def exit_(code: int) -> None:
        raise _Ended(code)

    made: list[str] = []
    enter = session.Session.__enter__

    def entered(self: session.Session) -> session.Session:
        made.append(enter(self).facts.report_dir)
        return self

    out = io.StringIO()
    monkeypatch.setattr(session, "parse_engine_args", parse_engine_args)
    monkeypatch.setattr(session.os, "_exit", exit_)
    monkeypatch.setattr(session, "stop", lambda llm, forced: None)
    monkeypatch.setattr(session, "keep_stdout", lambda: out)
    monkeypatch.setattr(session.Session, "__enter__", entered)
    with pytest.raises(_Ended) as ended:
        command.run(cli.parse(["verify", "M", *argv]))
    (report_dir,) = made
    return ended.value.code, out.getvalue(), report_dir


@pytest.mark.parametrize(
    "stop", [session.CommandError("refused"), KeyboardInterrupt(), RuntimeError("boom")], ids=str
)
def test_the_temporary_report_directory_is_removed_at_every_end(
    monkeypatch: pytest.MonkeyPatch, stop: BaseException
) -> None:
    code, out, made = _end_early(monkeypatch, ["--json"], stop)
    found = json.loads(out)
    assert code == 3 and found["exit_code"] == 3 and found["schema"] == SCHEMAS["verify"] == 5
    assert made and "vllm-hotfix-verify-" in made and not Path(made).exists()


def test_a_report_directory_the_user_gave_is_kept(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    mine = tmp_path / "reports"
    mine.mkdir()
    (mine / "keep.txt").write_text("x")
    code, _, _ = _end_early(monkeypatch, ["--report-dir", str(mine)], KeyboardInterrupt())
    assert code == 3 and (mine / "keep.txt").exists()


def test_usage_errors_print_a_json_document_with_json(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, wanted in ((["--json", "--ids", "1,x"], "whole numbers"), (["--json", "--ids", "-1"], ">= 0")):
        with pytest.raises(SystemExit) as stop:
            cli.parse(["verify", "M", *argv])
        found = json.loads(capsys.readouterr().out)
        assert stop.value.code == 4 and found["exit_code"] == 4 and found["schema"] == SCHEMAS["verify"] == 5
        assert found["verdict"] == "UNKNOWN" and wanted in found["error"]
    with pytest.raises(SystemExit):  # without --json stdout stays empty
        cli.parse(["verify", "M", "--ids", "1,x"])
    assert capsys.readouterr().out == ""


def test_an_unwritable_report_directory_is_refused_before_vllm(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 4, one JSON document under --json, before vLLM's parser (stood in to fail the test)."""
    blocked = tmp_path / "a-file"
    blocked.write_text("x")
    monkeypatch.setattr(session, "parse_engine_args", lambda *a: pytest.fail("vLLM reached"))
    with pytest.raises(SystemExit) as stop:
        cli.main(["verify", "M", "--json", "--report-dir", str(blocked / "r")])
    found = json.loads(capsys.readouterr().out)
    assert stop.value.code == 4 and found["exit_code"] == 4 and "not writable" in found["error"]


def test_ids_beyond_the_models_layers_are_a_usage_error() -> None:
    session.check_ids([0, 2, 61], 61)
    with pytest.raises(session.CommandError, match="valid ids are 0 to 61"):
        session.check_ids([2, 62], 61)
    with pytest.raises(session.CommandError, match=r"\[-1\]"):
        session.check_ids([-1], 61)


def test_ids_in_any_order_are_worked_in_vllms_order_and_said() -> None:
    # vLLM captures by membership inside the layer loop: slot i is the i-th smallest id
    assert in_vllm_order([2, 5, 10]) == ([2, 5, 10], None)
    ordered, note = in_vllm_order([5, 2, 10])
    assert ordered == [2, 5, 10]
    assert note and "--ids 5,2,10 read in vLLM's order 2,5,10" in note and "ascending layer order" in note
    assert aux_ids("10,2") == [10, 2]  # any order is accepted
    with pytest.raises(argparse.ArgumentTypeError, match=r"aux layer ids \[2\] repeated"):
        aux_ids("2,5,2")


def test_the_timeout_has_a_default_that_can_be_changed() -> None:
    assert cli.parse(["verify", "M"]).timeout == DEFAULT_TIMEOUT > 0
    assert cli.parse(["verify", "M", "--timeout", "60"]).timeout == 60
