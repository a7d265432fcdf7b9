"""`vllm-hotfix verify` as a command a script can trust: its exit codes (0 PASS, 1 FAIL, 2 nothing
checked, 3 the command or vLLM failed), this run's reports only, every expected rank counted, a
window cut short not a PASS, engine arguments through vLLM's own parser, --json, --timeout, and
`vllm-hotfix status`'s line on the check.

The verdict logic runs on report dicts (what the workers write; with and without the fields other
parts of the check add: per_id, errors, exchange). The command's failures run the real command on
the real vLLM of the test environment; one of them starts the engine (a checkpoint without its
weights, so that vLLM fails while starting). The passing and failing engine runs are in
tests/test_verify.py.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest

from harness.testenv import TestEnv
from harness.ways_in import install_plugin
from vllm_hotfix import cli, report
from vllm_hotfix.verify import command, outcome
from vllm_hotfix.verify.outcome import World, judge

RUN = "this-run"


def worker(rank: int = 0, world: int = 1, verdict: str = "PASS", run_id: str | None = RUN, **more: Any):
    """A worker report as window.py writes it (the keys the verdict reads)."""
    found = {
        "verdict": verdict,
        "run_id": run_id,
        "pid": 100 + rank,
        "host": "node",
        "rank": rank,
        "world": world,
        "steps": 8,
        "steps_wanted": 8,
        "note": None,
        "coverage": {"ok": True, "ids": 2, "compared": [1, 2], "not_compared": []},
    }
    found.update(more)
    return found


def test_every_rank_passing_its_whole_window_is_a_pass() -> None:
    done = judge([worker(0, 2), worker(1, 2)], RUN, World(2))
    assert (done.verdict, done.exit_code, done.problems) == ("PASS", 0, [])


def test_a_stale_report_never_counts() -> None:
    stale = worker(run_id="an-earlier-run")
    alone = judge([stale], RUN, World(1))
    assert (alone.verdict, alone.exit_code, alone.ignored, alone.reports) == ("UNKNOWN", 2, 1, [])
    assert "1 report(s) of other runs ignored" in alone.reason
    unset = judge([worker(run_id=None)], RUN, World(1))  # a report of a server, not of this command
    assert unset.exit_code == 2 and unset.ignored == 1
    # the case of the issue: a stale PASS left in --report-dir and an engine that failed at start
    failed = judge([stale], RUN, World(1), error="vLLM failed while starting vLLM: RuntimeError: x")
    assert (failed.verdict, failed.exit_code) == ("UNKNOWN", 3) and failed.reason.startswith("vLLM failed")


def test_a_missing_rank_is_not_a_pass() -> None:
    done = judge([worker(0, 2)], RUN, World(2))
    assert (done.verdict, done.exit_code) == ("UNKNOWN", 2)
    assert done.problems[0].startswith("1 of the 2 worker process(es) that 2 tensor x 1 data parallel")
    assert "no report from tensor-parallel rank(s) [1]" in done.problems
    # pipeline parallel: only the last stage holds aux states, so its TP ranks are the ones counted
    assert World(2, 2).processes == 2 and World(2, 1, 2).processes == 4
    assert judge([worker(0, 2), worker(1, 2)], RUN, World(2, 2)).exit_code == 0
    staged = judge([worker(0, 2)], RUN, World(2, 4))
    assert staged.problems[0] == (
        "1 of the 2 worker process(es) that 2 tensor x 1 data parallel imply (the last of 4 pipeline"
        " stage(s)) reported"
    )
    assert judge([worker(0, 2), worker(1, 2)], RUN, World(1)).exit_code == 2  # a group of 2, not 1


def test_a_window_cut_short_is_not_a_pass() -> None:
    short = worker(steps=3, note="the run ended after 3 of 8 steps")  # window.py: still "PASS"
    done = judge([short], RUN, World(1))
    assert (done.verdict, done.exit_code) == ("UNKNOWN", 2)
    assert "the window was cut short, 3 of 8 steps checked" in done.reason


def test_an_id_not_compared_is_not_a_pass() -> None:
    """Issue 34: count, shape and finiteness alone never PASS. A worker whose window compared every
    id but one says UNKNOWN (window.py); the run is UNKNOWN, exit 2, naming the id and why."""
    why = "id 1 is not tapped on this rank (its layers' boundaries 2..3)"
    partly = {"ok": False, "ids": 2, "compared": [2], "not_compared": [{"id": 1, "why": why}]}
    reports = [worker(r, 2, "UNKNOWN", coverage=partly) for r in (0, 1)]
    done = judge(reports, RUN, World(2))
    assert (done.verdict, done.exit_code) == ("UNKNOWN", 2)
    assert done.reason == "rank 0 (pid 100): UNKNOWN (ids 1 not compared on any checked step)"
    assert f"rank 1 (pid 101): id 1 not compared on any checked step: {why}" in done.problems
    assert outcome.coverage(reports) == {
        "ok": False,
        "not_compared": [{"id": 1, "ranks": [0, 1], "why": why}],
    }
    assert "  coverage: 1 of 2 ids compared; not compared: 1 (per-id says why)" in command.format_reports(
        reports
    )
    # a PASS that does not say what it compared (a report of another version, a harness) is no PASS
    bare = worker()
    del bare["coverage"]
    done = judge([bare], RUN, World(1))
    assert done.exit_code == 2 and "does not say that every requested id was compared" in done.reason
    assert outcome.coverage([worker(), bare])["ok"] is False and outcome.coverage([])["ok"] is False
    assert outcome.coverage([worker(0, 2), worker(1, 2)]) == {"ok": True, "not_compared": []}


def test_a_rank_error_or_a_failed_exchange_is_not_a_pass() -> None:
    errors = [{"rank": 1, "stage": "projection", "message": "RuntimeError: planted"}]
    done = judge([worker(0, 2, errors=errors), worker(1, 2)], RUN, World(2))
    assert done.exit_code == 2 and "at projection: RuntimeError: planted" in done.reason
    exchange = {"ok": False, "note": "deadline of 30 s hit"}
    done = judge([worker(0, 2, exchange=exchange), worker(1, 2)], RUN, World(2))
    assert done.exit_code == 2 and "exchange between ranks failed: deadline of 30 s hit" in done.reason
    fine = {"ok": True, "note": None}
    assert judge([worker(exchange=fine, errors=[], per_id=[])], RUN, World(1)).exit_code == 0


def test_a_fail_is_a_fail_even_when_vllm_then_stops() -> None:
    reports = [worker(0, 2, "FAIL"), worker(1, 2, "FAIL"), worker(0, 2, run_id="old")]
    done = judge(reports, RUN, World(2), error="vLLM failed: EngineDeadError")
    assert (done.verdict, done.exit_code, done.ignored) == ("FAIL", 1, 1)
    assert "then vLLM stopped: vLLM failed: EngineDeadError" in done.reason
    assert judge([worker(0, 2, "FAIL")], RUN, World(2)).exit_code == 1  # even with a rank missing


def test_an_unknown_that_strict_mode_stopped_on_stays_unknown() -> None:
    """Strict mode ends vLLM after an incomplete check: exit 2 (the check's verdict), not 3."""
    note = "the check could not complete: rank 1 at projection: RuntimeError: planted"
    reports = [worker(r, 2, "UNKNOWN", steps=2, note=note, stops_run=True) for r in (0, 1)]
    error = "vLLM failed while generating: EngineDeadError: engine core died"
    done = judge(reports, RUN, World(2), error=error)
    assert (done.verdict, done.exit_code, done.error) == ("UNKNOWN", 2, error)
    assert done.reason.startswith("rank 0 (pid 100): UNKNOWN (the check could not complete: rank 1")
    assert done.reason.endswith(f"; then strict mode stopped vLLM: {error}")
    # without the workers' word that they stopped it, vLLM's error is vLLM's: exit 3
    unflagged = [worker(r, 2, "UNKNOWN", steps=2, note=note) for r in (0, 1)]
    assert judge(unflagged, RUN, World(2), error=error).exit_code == 3


def test_unknown_and_skipped_workers_are_nothing_checked() -> None:
    assert judge([worker(verdict="UNKNOWN", steps=0)], RUN, World(1)).exit_code == 2
    skipped = judge([worker(verdict="SKIPPED", steps=0, note="skipped: no aux states")], RUN, World(1))
    assert skipped.exit_code == 2 and "SKIPPED (skipped: no aux states)" in skipped.reason


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
    rank1 = worker(1, 2, per_id=[entry(2, "FAIL", 0.9, "partial sum"), entry(4, "n/a", None, "no norm")])
    merged = outcome.per_id([rank0, rank1])
    assert [(row["id"], row["status"], row["max_rel_diff"]) for row in merged] == [
        (2, "FAIL", 0.9),
        (4, "n/a", None),
    ]
    assert merged[0]["ranks"] == {"0": "ok", "1": "FAIL"} and merged[0]["why"] == "partial sum"
    assert outcome.per_id([worker()]) == []  # reports without per-id figures
    text = command.format_reports([rank1])
    assert "id 2: FAIL (max rel diff 0.9 vs r): partial sum" in text


def test_the_window_covers_the_workload() -> None:
    assert command.window_steps([16, 40], [2]) == 8  # two prefills of two prompts, two decodes each
    assert command.window_steps([16, 64, 512, 2048], [1, 4]) == 76  # the defaults, chunks of 256
    assert command.window_steps([1], [1]) == 3


def test_engine_arguments_pass_through_and_status_takes_none() -> None:
    args = cli.parse(["verify", "M", "--steps", "4", "--", "--tensor-parallel-size", "2", "--steps", "x"])
    assert (args.model, args.steps, args.engine_args) == (
        "M",
        4,
        ["--tensor-parallel-size", "2", "--steps", "x"],
    )
    args = cli.parse(["verify", "M", "-tp", "2", "--load-format", "dummy", "--json", "--ids", "1,2"])
    assert args.engine_args == ["-tp", "2", "--load-format", "dummy"] and args.json and args.ids == [1, 2]
    with pytest.raises(SystemExit) as stop:
        cli.parse(["status", "--tensor-parallel-size", "2"])
    assert stop.value.code == 2
    for bad in (["verify", "M", "--ids", "1,x"], ["verify", "M", "--batch-sizes", "0"], ["verify"]):
        with pytest.raises(SystemExit) as stop:
            cli.parse(bad)
        assert stop.value.code == 3, bad  # the command's own failure, not "nothing could be checked"


def test_status_shows_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm_hotfix

    monkeypatch.delenv("VLLMHOTFIX_VERIFY_REPORT", raising=False)
    monkeypatch.setenv("VLLMHOTFIX_VERIFY", "12")
    status = vllm_hotfix.status()
    assert status["verify"] == {
        "on": True,
        "VLLMHOTFIX_VERIFY": "12",
        "steps": 12,
        "report_dir": None,
        "run_id": None,
        "tokens": 4096,
        "problem": None,
    }
    text = report.format_text(status)
    assert "verify: on, the first 12 steps that carry aux states (each on its first 4096 tokens" in text
    monkeypatch.setenv("VLLMHOTFIX_VERIFY", "sometimes")
    status = vllm_hotfix.status()
    assert status["verify"]["on"] is False and "'sometimes' is not valid" in status["verify"]["problem"]
    text = report.format_text(status)
    assert "verify: off" in text and "settings problem: VLLMHOTFIX_VERIFY='sometimes' is not valid" in text


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
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "verify-node-1.json").write_text(json.dumps(worker(run_id="an-earlier-run")))


@pytest.mark.vllm
def test_bad_options_exit_3_in_one_line(testenv, plugin, tiny_checkpoint, tmp_path) -> None:
    done = _verify(testenv, plugin, tmp_path, str(tiny_checkpoint), "--ids", "1,x")
    assert done.returncode == 3 and "Traceback" not in done.stderr, done.stderr[-2000:]
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
    assert found["load_format"] == "dummy" and found["caveats"] == [command.DUMMY_CAVEAT]
    assert "cannot show that their values are right" in command.DUMMY_CAVEAT
    assert found["ignored_reports"] == 1 and found["ranks"] == [] and "/no/such/dir" in found["error"]
    assert found["error"].startswith("vLLM refused the engine arguments [")
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
    """The issue's case: a PASS report of an earlier run in --report-dir and vLLM failing while it
    starts (here: the checkpoint's weights are missing) gave `verdict: PASS` and exit 0."""
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


class _Engine:
    """vLLM's LLM as the top-up sees it: each generate call runs a prefill step, then decode steps
    of `per_step` tokens each (a drafter whose tokens are accepted); the worker writes its report
    when its window is full, as window.py does."""

    def __init__(self, plan: command.Plan, per_step: int, armed: bool = True) -> None:
        self.plan, self.per_step, self.armed, self.steps, self.calls = plan, per_step, armed, 0, 0

    def generate(self, prompts: list[Any], params: dict[str, Any], use_tqdm: bool = False) -> None:
        self.calls += 1
        self.steps += 1 + -(-params["max_tokens"] // self.per_step)
        if self.armed and self.steps >= self.plan.steps:
            path = Path(self.plan.report_dir) / "verify-node-100.json"
            path.write_text(
                json.dumps(worker(steps=self.plan.steps, steps_wanted=self.plan.steps, model="M"))
            )


def _top_up(tmp_path: Path, per_step: int, armed: bool = True, steps: int = 76) -> tuple[Any, Any]:
    tmp_path.mkdir(exist_ok=True)
    plan = command.Plan("M", [], RUN, str(tmp_path), steps, [16], [1])
    plan.method = "extract_hidden_states"
    runner = command._Run(cli.parse(["verify", "M"]), stdout=None)  # type: ignore[arg-type]
    runner.plan = plan
    runner.engine = type("Args", (), {"speculative_config": {"num_speculative_tokens": 1}})()
    runner.llm = _Engine(plan, per_step, armed)
    runner.top_up(plan, vocab=1000, max_len=4096, counter=0, sampling=lambda **kw: kw)
    return plan, runner.llm


def test_the_window_fills_whatever_the_draft_acceptance(tmp_path: Path) -> None:
    """Issue 34: with extract_hidden_states' draft accepted, a step carries 2 tokens, and one round
    of steps + 2 decode tokens left a correct model's window short (UNKNOWN, exit 2). The top-up
    keeps going until every expected report is in."""
    plan, engine = _top_up(tmp_path / "one", per_step=1)
    assert engine.calls == 1 and plan.top_up_rounds == 1 and not plan.notes
    plan, engine = _top_up(tmp_path / "two", per_step=2)
    assert engine.calls == 2 and engine.steps >= plan.steps and not plan.notes
    reports = command.read_reports(plan.report_dir)
    assert judge(reports, RUN, World(1)).exit_code == 0
    assert "steps checked: 76 of 76" in command.format_reports(reports)


def test_the_top_up_is_bounded_when_no_window_fills(tmp_path: Path) -> None:
    """A worker that never reports (the check not armed there) costs a bounded number of rounds,
    then the run says why; its verdict stays UNKNOWN."""
    plan, engine = _top_up(tmp_path, per_step=1, armed=False, steps=10)
    assert engine.calls == plan.top_up_rounds == 1 + math.ceil(10 * 2 / 12)
    assert plan.notes == [
        "0 of 1 worker report(s) after 3 round(s) of 12 decode tokens, enough for 10 steps at 2"
        " token(s) per step: the missing workers' windows did not fill (is the check armed there?)"
    ]
    assert judge(command.read_reports(plan.report_dir), RUN, World(1)).exit_code == 2


# -- the command in pipelines (issue 35, item 5): no engine, vLLM's parser stood in ---------------
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

    monkeypatch.setattr(command, "parse_engine_args", parse_engine_args)
    monkeypatch.setattr(command.os, "_exit", exit_)
    monkeypatch.setattr(command._Run, "stop_engine", lambda self, forced: None)
    out = io.StringIO()
    runner = command._Run(cli.parse(["verify", "M", *argv]), out)
    with pytest.raises(_Ended) as ended:
        command.run_with(runner)
    assert runner.plan is not None
    return ended.value.code, out.getvalue(), runner.plan.report_dir


@pytest.mark.parametrize(
    "stop", [command.CommandError("refused"), KeyboardInterrupt(), RuntimeError("boom")], ids=str
)
def test_the_temporary_report_directory_is_removed_at_every_end(
    monkeypatch: pytest.MonkeyPatch, stop: BaseException
) -> None:
    code, out, made = _end_early(monkeypatch, ["--json"], stop)
    found = json.loads(out)
    assert code == 3 and found["exit_code"] == 3 and found["schema"] == command.SCHEMA == 1
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
        assert stop.value.code == 3 and found["exit_code"] == 3 and found["schema"] == 1
        assert found["verdict"] == "UNKNOWN" and wanted in found["error"]
    with pytest.raises(SystemExit):  # without --json stdout stays empty
        cli.parse(["verify", "M", "--ids", "1,x"])
    assert capsys.readouterr().out == ""


def test_ids_beyond_the_models_layers_are_a_usage_error() -> None:
    command.check_ids([0, 2, 61], 61)
    with pytest.raises(command.CommandError, match="valid ids are 0 to 61"):
        command.check_ids([2, 62], 61)
    with pytest.raises(command.CommandError, match=r"\[-1\]"):
        command.check_ids([-1], 61)


def test_the_timeout_has_a_default_that_can_be_changed() -> None:
    assert cli.parse(["verify", "M"]).timeout == command.DEFAULT_TIMEOUT > 0
    assert cli.parse(["verify", "M", "--timeout", "60"]).timeout == 60
