"""The per-id statistic of the check cannot cry wolf, and still FAILs every planted defect class.

A seeded Monte-Carlo on CPU with the package's own projection and statistic (checks.fingerprints,
precision.relative_difference): correct bfloat16 states of a 7168-wide model whose layer output is summed by a
bfloat16 ring all-reduce over 8 ranks (each hop rounded to bfloat16, as NCCL's ring does; the path
of the repairs that all-reduce a copy, and of vLLM's non-flashinfer V3.2 branch), compared with the
tap's stream (the ranks' partial fingerprints summed in float32, plus the residual's: reference.py).

Why the statistic is |fp(state) - fp(stream)| / (the state's true row norm in fingerprint units,
or |fp(stream)| where larger, so that a zero state reads 1, not infinity):
the difference of a correct state is its rounding error e, of relative size rho = |e| / |state|
(concentrated: an average over 7168 coordinates), and its fingerprint is a Gaussian vector of K=8
entries, so the statistic is rho * chi_8 / sqrt(8), whose tail falls like exp(-x^2): the odds of
a false FAIL per comparison are P(chi2_8 > 8 (tolerance / rho)^2), computed here from the measured
rho. The former denominator, |fp(stream)|, is itself a chi_8 variable, which gave the ratio an F
tail (about 1 token in 100k over 2e-2 at TP=8; docs/verification.md). The figures are printed
(`pytest -s`) and quoted in docs/verification.md.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from vllm_hotfix.check import checks  # noqa: E402
from vllm_hotfix.judging import precision  # noqa: E402

HIDDEN, RANKS, TOKENS = 7168, 8, 512
TOLERANCE = precision.CHECK_TOLERANCE_16BIT
# Comparisons in a default `vllm-hotfix verify` run at TP=8, generously: 13,200 prompt tokens
# (lengths 16, 64, 512, 2048 in batches of 1 and 4), 20 decode tokens and at most 2 x 78 top-up
# tokens < 20,000 tokens, x 4 ids, x 8 ranks (each judges its own state).
RUN_COMPARISONS = 20_000 * 4 * RANKS


def _bf16(x):
    return x.to(torch.bfloat16).float()


def _layer(tokens: int, output: float, seed: int):
    """One layer's residual (bf16, per-token scales from 0.1 to 100) and its output as 8 ranks'
    bf16 partial sums whose total has `output` times the residual's norm."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.empty(tokens, 1).uniform_(math.log(0.1), math.log(100.0), generator=g))
    residual = _bf16(torch.randn(tokens, HIDDEN, generator=g) * scale)
    parts = [
        _bf16(torch.randn(tokens, HIDDEN, generator=g) * scale * output / RANKS**0.5) for _ in range(RANKS)
    ]
    return residual, parts, g


def _ring(parts):
    """A bf16 ring all-reduce: the sum accumulated rank by rank, rounded to bf16 at every hop."""
    total = parts[0]
    for part in parts[1:]:
        total = _bf16(total + part)
    return total


def _statistic(state, stream_print):
    """The package's statistic of `state` ([tokens, hidden]) against a stream's fingerprint."""
    proj = checks.projection(HIDDEN, "cpu")
    prints, scales, _ = checks.fingerprints([state], [True], 1, state.shape[0], proj)
    return precision.relative_difference(prints[0], stream_print, scales[0])


def _stream_print(residual, parts):
    """What reference.py compares with: the ranks' partial fingerprints summed, plus the residual's."""
    proj = checks.projection(HIDDEN, "cpu")
    return sum(part @ proj for part in parts) + residual @ proj


def _chi2_tail(x: float, dof: int) -> float:
    """P(chi2_dof > x) for even dof: exp(-x/2) * sum_{j < dof/2} (x/2)^j / j!."""
    half = x / 2
    return math.exp(-half) * sum(half**j / math.factorial(j) for j in range(dof // 2))


def test_correct_states_after_a_bf16_ring_all_reduce_at_tp8_never_fail() -> None:
    residual, parts, _ = _layer(TOKENS, output=1.0, seed=1)  # a layer output as large as the residual
    state = _bf16(_ring(parts) + residual)  # the aux state: the all-reduced output plus the residual
    statistic = _statistic(state, _stream_print(residual, parts))
    exact = sum(part.double() for part in parts) + residual.double()
    rho = torch.linalg.vector_norm(state.double() - exact, dim=-1) / torch.linalg.vector_norm(exact, dim=-1)
    # the model of the statistic: rho * chi_K / sqrt(K), so (statistic / rho)^2 averages 1
    spread = float(((statistic.double() / rho) ** 2).mean())
    assert 0.85 < spread < 1.15, spread
    bound = 1.5 * float(rho.max())  # a margin over the largest measured rounding error
    per_comparison = _chi2_tail(checks.K * (TOLERANCE / bound) ** 2, checks.K)
    per_run = per_comparison * RUN_COMPARISONS
    print(
        f"\ncorrect bf16 states, bf16 ring all-reduce at TP={RANKS}, hidden {HIDDEN}, {TOKENS} tokens:"
        f" rho median {float(rho.median()):.3g}, max {float(rho.max()):.3g}; statistic median"
        f" {float(statistic.median()):.3g}, max {float(statistic.max()):.3g} (tolerance {TOLERANCE:g});"
        f" P(false FAIL) per comparison <= {per_comparison:.2g} at rho {bound:.3g}, per default run"
        f" ({RUN_COMPARISONS} comparisons) <= {per_run:.2g}"
    )
    assert float(statistic.max()) < TOLERANCE / 2
    assert per_run <= 1e-6


def test_every_planted_defect_class_fails_by_five_times_the_tolerance() -> None:
    """Each class as the check meets it, with a layer output of a quarter of the residual's norm
    (a defect's size scales with it: a layer that moves the stream by less than about 10% of its
    norm cannot FAIL an off-by-one or one rank's partial sum by 5x). Every token of every class
    FAILs; a step of 16 tokens (the figure is its largest token) FAILs by at least 5x the
    tolerance, and so does the median token."""
    residual, parts, g = _layer(TOKENS, output=0.25, seed=2)
    layer_out = _ring(parts)
    stream = _bf16(layer_out + residual)
    reference = _stream_print(residual, parts)
    weight = torch.empty(HIDDEN).uniform_(0.5, 1.5, generator=g)  # a norm's weights
    following = [_bf16(torch.randn(TOKENS, HIDDEN, generator=g)) for _ in range(10)]
    unit = torch.linalg.vector_norm(layer_out, dim=-1, keepdim=True) / HIDDEN**0.5

    def later(n: int):  # the stream n layers on: n more outputs of the same size
        return _bf16(stream + sum(f * unit for f in following[:n]))

    planted = {
        "scale x1.5": _bf16(stream * 1.5),
        "off-by-one layer": later(1),
        "alias to a layer 10 on": later(10),
        "zeros": torch.zeros_like(stream),
        "after the norm": _bf16(stream / stream.pow(2).mean(-1, keepdim=True).sqrt() * weight),
        "stale (the previous step's)": stream.roll(1, dims=0),
        "one rank's partial sum": _bf16(parts[0] + residual),
    }
    lines = []
    for name, state in planted.items():
        statistic = _statistic(state, reference) / TOLERANCE
        steps = statistic.reshape(-1, 16).max(dim=1).values
        prints = state @ checks.projection(HIDDEN, "cpu")  # the former: relative to the reference's print
        former = (prints - reference).norm(dim=-1) / reference.norm(dim=-1) / TOLERANCE
        lines.append(
            f"  {name}: per token min {float(statistic.min()):.3g}x, median"
            f" {float(statistic.median()):.3g}x; 16-token step min {float(steps.min()):.3g}x the tolerance"
            f" (former statistic: per token min {float(former.min()):.3g}x,"
            f" median {float(former.median()):.3g}x)"
        )
        assert float(statistic.min()) > 1, name
        assert float(statistic.median()) >= 5 and float(steps.min()) >= 5, name
    print("\nplanted defects (statistic / tolerance):\n" + "\n".join(lines))


def test_projection_in_chunks_equals_the_whole_and_never_copies_a_whole_state(monkeypatch) -> None:
    """A state is made float32 CHUNK_ROWS rows at a time (bounded memory whatever
    the step's tokens), with the same fingerprints, norms and finiteness as the whole at once."""
    import torch

    from vllm_hotfix.check import reference

    monkeypatch.setattr(reference, "CHUNK_ROWS", 7)
    state = torch.randn(30, 64, dtype=torch.bfloat16)
    matrix = reference.projection(64, "cpu")
    made: list[int] = []
    real_float = torch.Tensor.float

    def counted(self):
        made.append(self.shape[0])
        return real_float(self)

    out, norms = torch.empty(30, reference.K), torch.empty(30)
    monkeypatch.setattr(torch.Tensor, "float", counted)
    finite = reference.project(state, matrix, out, norms)
    monkeypatch.setattr(torch.Tensor, "float", real_float)
    assert made == [7, 7, 7, 7, 2]
    whole = state.float()
    assert torch.allclose(out, whole @ matrix, rtol=1e-6, atol=1e-6)
    assert torch.allclose(norms, torch.linalg.vector_norm(whole, dim=-1))
    assert bool(finite)
    state[23, 5] = float("nan")
    assert not bool(reference.project(state, matrix, out, norms))
