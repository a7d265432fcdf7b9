"""The taps of the in-worker check (vllm_hotfix/verify/taps.py) and its per-id judgement
(reference.py), in this process on a small torch model whose decoder layers have vLLM's
`(positions, hidden_states, residual) -> (hidden_states, residual)` form and whose forward captures
the aux states as vLLM's backbones do (`hidden_states + residual` before layer k; the final id
after the last layer). No vLLM here: the engine and vLLM's real models are in test_verify.py,
test_verify_v32.py and test_minimax_m3_states.py. Shows the mechanics those rely on: the op
records in eager mode and inside a graph compiled by torch.compile (Inductor), a tap that did not
run gives n/a, layers of another form give n/a, the flag stops the taps, planted faults FAIL."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from vllm_hotfix.verify import taps as taps_mod  # noqa: E402
from vllm_hotfix.verify.checks import check_step  # noqa: E402

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


@pytest.fixture(autouse=True)
def _active():
    taps_mod._state["active"] = True
    yield
    taps_mod._state["active"] = True


def _check(model, taps, states=None, forward=None):
    with torch.no_grad():
        out, aux = (forward or model)(torch.randn(TOKENS, HIDDEN))
    found = check_step(
        states(aux) if states else aux, out, IDS, TOKENS, HIDDEN, None, taps=taps, final_id=LAYERS
    )
    return {e["id"]: e["status"] for e in found.per_id}, found


@pytest.mark.parametrize("form", ["pair", "none", "tensor"])
def test_every_id_ok_eager_and_compiled(form: str) -> None:
    """Layers that return the stream itself (one tensor, or (hidden_states, None)) are compared
    too: the stream is that tensor."""
    model = Backbone(form)
    taps = taps_mod.attach(model, HIDDEN, 64)
    statuses, found = _check(model, taps)
    assert statuses == {0: "ok", 1: "ok", 2: "ok", 4: "ok"} and found.ok, found.per_id
    statuses, found = _check(model, taps, forward=torch.compile(model.forward, fullgraph=True))
    assert statuses == {0: "ok", 1: "ok", 2: "ok", 4: "ok"} and found.ok, found.per_id


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
    assert {i for i, s in statuses.items() if s == "FAIL"} == expected and not found.ok, found.per_id


def test_a_tap_that_did_not_run_is_na_never_a_verdict() -> None:
    model = Backbone()
    taps = taps_mod.attach(model, HIDDEN, 64)
    with torch.no_grad():
        out, aux = model(torch.randn(TOKENS, HIDDEN))
    check_step(aux, out, IDS, TOKENS, HIDDEN, None, taps=taps, final_id=LAYERS)
    again = check_step(aux, out, IDS, TOKENS, HIDDEN, None, taps=taps, final_id=LAYERS)  # no forward
    assert {e["status"] for e in again.per_id} == {"n/a"} and again.ok
    assert "the tap did not run in this step" in again.per_id[0]["why"]


def test_after_the_window_the_taps_stop() -> None:
    model = Backbone()
    taps = taps_mod.attach(model, HIDDEN, 64)
    _check(model, taps)
    taps_mod.deactivate()
    calls = taps.meta[:, 0].clone()
    with torch.no_grad():
        model(torch.randn(TOKENS, HIDDEN))
    assert torch.equal(taps.meta[:, 0], calls)


def test_layers_of_another_form_are_na() -> None:
    """DeepSeek-V4-like layers (more than a (hidden_states, residual) pair): nothing compared."""
    for compiled in (False, True):  # the form is seen in both modes (through the op)
        model = Backbone("four")
        taps = taps_mod.attach(model, HIDDEN, 64)
        forward = torch.compile(model.forward, fullgraph=True) if compiled else model
        statuses, found = _check(model, taps, forward=forward)
        assert set(statuses.values()) == {"n/a"} and found.ok, found.per_id
        assert "Layer returns neither (hidden_states, residual) nor one" in found.per_id[1]["why"]
        assert found.per_id[0]["why"] == found.per_id[1]["why"]  # id 0 too: its layer is of that form


class _Norm(torch.nn.Module):
    def forward_native(self, x, residual=None):
        return x if residual is None else (x + residual, x + residual)


class _V2Like(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = _Norm()

    def forward(self, hidden_states, residual):
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class _V4Like(_V2Like):
    def forward(self, hidden_states, residual):
        hidden_states = self.norm(hidden_states)  # after a hyper-connection head, as DeepseekV4Model
        return hidden_states


def test_the_final_norm_check_needs_a_norm_given_the_residual() -> None:
    """DeepSeek-V4's forward ends with `self.norm(hidden_states)`: its final aux (a mean over the
    hyper-connection streams) is not that norm's input, so the final-id test says n/a, not FAIL."""
    from vllm_hotfix.verify.seam import _final_norm_note

    norm, note = _final_norm_note(_V2Like())
    assert norm is not None, note
    norm, note = _final_norm_note(_V4Like())
    assert norm is None and "takes no residual" in note


def compiled_first_in_a_fresh_process() -> dict:
    """Run in a fresh interpreter: attach, then the first forward ever is compiled with
    fullgraph=True, as vLLM traces its models (the op must already be registered then)."""
    import torch

    from tests.test_verify_taps import IDS, LAYERS, TOKENS, Backbone
    from vllm_hotfix.verify import taps as taps_mod
    from vllm_hotfix.verify.checks import check_step

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


def test_taps_only_when_the_engine_asks_the_model_for_aux_states() -> None:
    """At load nothing is tapped; the runner's call of `set_aux_hidden_state_layers` (the target
    only, and only when the engine wants aux states) attaches the taps for those ids; a draft
    loaded by the same loader is never asked and stays untapped."""
    target, draft = _Target(), _Target()
    for model in (target, draft):
        taps_mod.attach_loaded(model)
        assert taps_mod.of(model.model) is None
    target.set_aux_hidden_state_layers((1, LAYERS))
    taps = taps_mod.of(target.model)
    assert taps is not None and taps.rows == {1: 0, LAYERS: 1} and taps_mod.of(draft.model) is None
    assert "set_aux_hidden_state_layers" not in vars(target)  # vLLM's own method again
    assert target.model.aux_hidden_state_layers == (1, LAYERS)
