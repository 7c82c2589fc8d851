"""Samplers on hand-made distributions.

Most expected values are llama.cpp's own (tests/test-sampling.cpp): the candidates start as logits log(p)
with p filled in, one sampler runs, then (where llama.cpp's test does) dist(seed 0) renormalizes, and the
probabilities are compared in order with tolerance 1e-5.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from llmfw.core.errors import SamplerError
from llmfw.core.sampling import (
    DEFAULT_SAMPLER_ORDER,
    Candidates,
    MT19937Rng,
    SamplerChain,
    SamplerEnv,
    SamplerParams,
    build_sampler,
    parse_sampler_seq,
)
from llmfw.plugins.samplers.basic import Dist, Greedy
from llmfw.plugins.samplers.dry import DRY
from llmfw.plugins.samplers.mirostat import Mirostat, MirostatV2
from llmfw.plugins.samplers.penalties import LogitBias, Penalties
from llmfw.plugins.samplers.temperature import TempExt, Temperature
from llmfw.plugins.samplers.truncation import XTC, MinP, TopK, TopNSigma, TopP, Typical


def candidates(probs) -> Candidates:
    probs = np.asarray(probs, dtype=np.float32)
    with np.errstate(divide="ignore"):
        return Candidates(np.arange(len(probs)), np.log(probs), probs.copy())


def run(probs, *samplers, dist: bool = True) -> Candidates:
    cur = candidates(probs)
    for s in samplers:
        s.apply(cur)
    if dist:
        Dist(0).apply(cur)
    return cur


def assert_probs(cur: Candidates, expected) -> None:
    assert len(cur) == len(expected), (cur.probs, expected)
    np.testing.assert_allclose(cur.probs, expected, atol=1e-5, rtol=0)


P4 = [0.1, 0.2, 0.3, 0.4]


# -- the generator ------------------------------------------------------------------------------------------
def test_rng_is_std_mt19937():
    rng = MT19937Rng(5489)  # std::mt19937's default seed: 1st output 3499211612, 10000th 4123659995
    first = rng.next_u32()
    for _ in range(9998):
        rng.next_u32()
    assert (first, rng.next_u32()) == (3499211612, 4123659995)


def test_uniform_double_uses_two_draws_like_libstdcxx():
    a, b = MT19937Rng(7), MT19937Rng(7)
    lo, hi = b.next_u32(), b.next_u32()
    assert a.uniform_double() == (lo + hi * 2.0**32) / 2.0**64


# -- greedy / dist -----------------------------------------------------------------------------------------
def test_greedy_takes_the_first_best():
    cur = Candidates(np.arange(4), np.array([1.0, 3.0, 3.0, 2.0]))
    Greedy().apply(cur)
    assert cur.selected == 1 and cur.selected_token == 1


def test_dist_same_seed_same_choices_and_reset_replays():
    logits = np.random.default_rng(1).normal(size=500) * 2
    chain_a = SamplerChain([Dist(1234)])
    chain_b = SamplerChain([Dist(1234)])
    seq_a = [chain_a.sample(logits) for _ in range(30)]
    assert seq_a == [chain_b.sample(logits) for _ in range(30)]
    chain_a.reset()
    assert seq_a == [chain_a.sample(logits) for _ in range(30)]
    assert seq_a != [SamplerChain([Dist(4321)]).sample(logits) for _ in range(30)]
    assert chain_b.history == seq_a


def test_dist_follows_the_distribution():
    probs = np.array([0.1, 0.2, 0.7])
    chain = SamplerChain([Dist(99)])
    counts = np.bincount([chain.sample(np.log(probs)) for _ in range(3000)], minlength=3) / 3000
    np.testing.assert_allclose(counts, probs, atol=0.03)


def test_dist_picks_by_running_sum_against_uniform_times_total():
    # llama.cpp: target = u * sum(p); first index whose running sum reaches it
    rng = MT19937Rng(0)
    u = rng.uniform_double()
    probs = np.array([0.25, 0.25, 0.25, 0.25])
    cur = candidates(probs)
    Dist(0).apply(cur)
    assert cur.selected == min(int(u * 4), 3)


# -- temperature -------------------------------------------------------------------------------------------
def test_temperature_llama_cases():
    assert_probs(run(P4, Temperature(1.0)), P4)
    assert_probs(run(P4, Temperature(0.0)), [0, 0, 0, 1])
    assert_probs(run(P4, TempExt(1.0, 0.0, 1.0)), P4)
    assert_probs(run(P4, TempExt(0.0, 0.0, 1.0)), [0, 0, 0, 1])


def test_temperature_divides_logits():
    cur = Candidates(np.arange(3), np.array([1.0, 2.0, 4.0]))
    Temperature(2.0).apply(cur)
    np.testing.assert_allclose(cur.logits, [0.5, 1.0, 2.0])


def test_dynamic_temperature_follows_normalized_entropy():
    logits = np.array([2.0, 1.0, 0.0])
    p = np.exp(logits) / np.exp(logits).sum()
    entropy = -(p * np.log(p)).sum()
    for exponent in (1.0, 2.0):
        expected_t = 0.5 + 1.0 * (entropy / math.log(3)) ** exponent  # range [1 - 0.5, 1 + 0.5]
        cur = Candidates(np.arange(3), logits)
        TempExt(1.0, 0.5, exponent).apply(cur)
        np.testing.assert_allclose(cur.logits, logits / expected_t, rtol=1e-5)
        q = np.exp(logits / expected_t)
        np.testing.assert_allclose(cur.probs, q / q.sum(), rtol=1e-5)


# -- truncation --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k, expected", [
    (1, [1.0]), (3, [0.44444, 0.33333, 0.22222]), (4, [0.4, 0.3, 0.2, 0.1]), (0, P4),
])
def test_top_k(k, expected):
    assert_probs(run(P4, TopK(k)), expected)


@pytest.mark.parametrize("p, expected", [
    (0.0, [1.0]), (0.7, [0.571429, 0.428571]), (0.8, [0.44444, 0.33333, 0.22222]), (1.0, P4),
])
def test_top_p(p, expected):
    assert_probs(run(P4, TopP(p)), expected)


def test_top_p_min_keep():
    assert len(run(P4, TopP(0.0, min_keep=3))) == 3


@pytest.mark.parametrize("p, expected", [
    (0.00, P4), (0.24, P4), (0.26, [0.2 / 0.9, 0.3 / 0.9, 0.4 / 0.9]), (0.49, [0.2 / 0.9, 0.3 / 0.9, 0.4 / 0.9]),
    (0.51, [0.3 / 0.7, 0.4 / 0.7]), (0.74, [0.3 / 0.7, 0.4 / 0.7]), (0.76, [1.0]), (1.00, [1.0]), (1.05, [1.0]),
])
def test_min_p(p, expected):
    assert_probs(run(P4, MinP(p)), expected)


def test_min_p_min_keep_falls_back_to_sorted_path():
    cur = run(P4, MinP(0.76, min_keep=2))
    assert cur.ids.tolist() == [3, 2]


@pytest.mark.parametrize("threshold, expected", [
    (0.09, [0.1]), (0.19, [0.2, 0.1]), (0.29, [0.3, 0.2, 0.1]), (0.39, [0.4, 0.3, 0.2, 0.1]),
])
def test_xtc(threshold, expected):
    assert_probs(run([0.4, 0.3, 0.2, 0.1], XTC(0.99, threshold, 0, seed=0), dist=False), expected)


@pytest.mark.parametrize("sampler", [
    XTC(0.0, 0.09, seed=0),             # probability 0
    XTC(0.99, 0.6, seed=0),             # threshold > 0.5
    XTC(0.99, 0.09, min_keep=2, seed=0),  # only 1 token would remain
])
def test_xtc_disabled_cases(sampler):
    assert len(run([0.4, 0.3, 0.2, 0.1], sampler, dist=False)) == 4


@pytest.mark.parametrize("probs, p, expected", [
    ([0.97, 0.01, 0.01, 0.01], 0.5, [0.97]),
    ([0.4, 0.2, 0.2, 0.2], 0.5, [0.2, 0.2, 0.2]),
])
def test_typical(probs, p, expected):
    assert_probs(run(probs, Typical(p), dist=False), expected)


def test_typical_orders_by_distance_from_entropy():
    # H = 1.142; |-ln p - H| = 0.449, 0.062, 0.755, 1.854 -> order 1, 0, 2, 3; cumulative 0.3, 0.8, ...
    cur = run([0.5, 0.3, 0.15, 0.05], Typical(0.5), dist=False)
    assert cur.ids.tolist() == [1, 0]
    assert run([0.5, 0.3, 0.15, 0.05], Typical(0.2, min_keep=3), dist=False).ids.tolist() == [1, 0, 2]


@pytest.mark.parametrize("n, expected", [
    (1.0, {2: 0.428571, 3: 0.571429}), (0.0, dict(enumerate(P4))), (3.0, dict(enumerate(P4))),
])
def test_top_n_sigma(n, expected):
    cur = run(P4, TopNSigma(n))
    got = {int(t): float(p) for t, p in zip(cur.ids, cur.probs) if p > 0}
    assert got.keys() == expected.keys()
    for token, p in expected.items():
        assert got[token] == pytest.approx(p, abs=1e-5)


def test_top_n_sigma_ignores_minus_inf_in_statistics():
    cur = Candidates(np.arange(5), np.array([10.0, 9.0, 5.0, 0.0, -np.inf]))
    TopNSigma(1.0).apply(cur)  # mean 6, std sqrt(15.5) = 3.94 -> keep logits >= 6.06
    assert sorted(cur.ids[np.isfinite(cur.logits)].tolist()) == [0, 1]


# -- penalties and bias ------------------------------------------------------------------------------------
@pytest.mark.parametrize("last, expected, repeat, freq, present", [
    ([0], [0, 0.25, 0.25, 0.25, 0.25], 50.0, 0.0, 0.0),
    ([0, 1, 2], [0, 0, 0, 0.5, 0.5], 50.0, 0.0, 0.0),
    ([0, 1, 2, 0, 0], [0, 0, 0, 0.5, 0.5], 50.0, 0.0, 0.0),
    ([0], [0.000011, 0.249997, 0.249997, 0.249997, 0.249997], 1.0, 5.0, 5.0),
    ([0, 1, 2], [0.000023, 0.000023, 0.000023, 0.499966, 0.499966], 1.0, 5.0, 5.0),
    ([0, 1, 2, 0, 0], [0.000000, 0.000023, 0.000023, 0.499977, 0.499977], 1.0, 5.0, 5.0),
])
def test_penalties_llama_cases(last, expected, repeat, freq, present):
    sampler = Penalties(len(last), repeat, freq, present)
    for t in last:
        sampler.accept(t)
    assert_probs(run([0.2] * 5, sampler), expected)


def test_penalties_formula_and_window():
    sampler = Penalties(last_n=3, repeat=2.0, freq=0.5, present=0.25)
    for t in (1, 1, 2):
        sampler.accept(t)
    cur = Candidates(np.arange(4), np.array([2.0, 3.0, -1.0, 0.5]))
    sampler.apply(cur)
    # token 1 (count 2, positive): 3/2 - (2*0.5 + 0.25); token 2 (count 1, negative): -1*2 - 0.75
    np.testing.assert_allclose(cur.logits, [2.0, 0.25, -2.75, 0.5])
    sampler.accept(3)  # the window now holds 1, 2, 3
    cur = Candidates(np.arange(4), np.array([2.0, 3.0, -1.0, 0.5]))
    sampler.apply(cur)
    np.testing.assert_allclose(cur.logits, [2.0, 0.75, -2.75, 0.25 - 0.75])


def test_logit_bias():
    cur = Candidates(np.array([5, 0, 2]), np.array([1.0, 1.0, 1.0]))
    LogitBias({0: 5.0, 2: -np.inf, 7: 3.0}).apply(cur)
    assert cur.logits.tolist() == [1.0, 6.0, -np.inf]


# -- DRY -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("probs, last, expected, mult, base, allowed, last_n, breakers", [
    ([0.25] * 4, [0, 1], [0.25] * 4, 1.0, 1.1, 2, 4, []),
    ([0.25] * 4, [0, 1, 2, 0, 1], [0.296923, 0.296923, 0.109232, 0.296923], 1.0, 1.1, 2, 5, []),
    ([0.2] * 5, [0, 1, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 2, 6, [[3]]),
    ([0.2] * 5, [0, 1, 2, 0, 1], [0.241818, 0.241818, 0.032727, 0.241818, 0.241818], 2.0, 1.1, 2, 5, []),
    ([0.2] * 5, [0, 1, 2, 3, 4, 0, 1], [0.2] * 5, 1.0, 1.1, 4, 7, []),
])
def test_dry_llama_cases(probs, last, expected, mult, base, allowed, last_n, breakers):
    sampler = DRY(mult, base, allowed, last_n, context_size=1024, breakers=breakers)
    for t in last:
        sampler.accept(t)
    assert_probs(run(probs, sampler), expected)


def test_dry_penalty_grows_with_repeat_length():
    sampler = DRY(1.0, 2.0, 2, -1, context_size=64)
    for t in [5, 6, 7, 8, 9, 5, 6, 7, 8]:  # "5 6 7 8" repeats: 9 would extend a repeat of length 4
        sampler.accept(t)
    cur = Candidates(np.arange(10), np.zeros(10))
    sampler.apply(cur)
    assert cur.logits[9] == pytest.approx(-(2.0 ** (4 - 2)))
    assert np.count_nonzero(cur.logits) == 1


def test_dry_multi_token_breaker_limits_the_repeat():
    # breaker "3 4" sits inside the repeat: the repeat may not reach back past it
    sampler = DRY(1.0, 2.0, 2, -1, context_size=64, breakers=[[3, 4]])
    for t in [1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 4, 5, 6]:
        sampler.accept(t)
    cur = Candidates(np.arange(10), np.zeros(10))
    sampler.apply(cur)
    assert cur.logits[9] == pytest.approx(-(2.0 ** (2 - 2)))  # only "5 6" counts


# -- mirostat -------------------------------------------------------------------------------------------------
def test_mirostat_v2_truncates_by_surprise_and_updates_mu():
    sampler = MirostatV2(tau=1.0, eta=0.1, seed=3)  # mu = 2: keep p >= 0.25
    cur = run([0.5, 0.3, 0.15, 0.05], sampler, dist=False)
    assert cur.ids.tolist() == [0, 1]
    chosen_p = float(cur.probs[cur.selected])
    assert chosen_p == pytest.approx(0.5 / 0.8 if cur.selected == 0 else 0.3 / 0.8, abs=1e-6)
    assert sampler.mu == pytest.approx(2.0 - 0.1 * (-math.log2(chosen_p) - 1.0), abs=1e-6)
    sampler.reset()
    assert sampler.mu == 2.0


def test_mirostat_v1_estimates_k_from_zipf():
    s, n_vocab, tau = 1.2, 1000, 5.0
    probs = 1.0 / np.arange(1, n_vocab + 1) ** s
    probs /= probs.sum()
    sampler = Mirostat(n_vocab, tau=tau, eta=0.1, m=100, seed=1)
    cur = candidates(probs)
    cur.softmax(sort=True)
    mu = 2 * tau
    expected_k = int(((s - 1) * 2**mu / (1 - n_vocab ** (-(s - 1)))) ** (1 / s))
    assert sampler.estimate_k(cur) == expected_k
    cur = candidates(probs)
    sampler.apply(cur)
    assert len(cur) == expected_k and 0 <= cur.selected < expected_k
    assert sampler.mu == pytest.approx(mu - 0.1 * (-math.log2(float(cur.probs[cur.selected])) - tau), abs=1e-5)


# -- parameters and chains ---------------------------------------------------------------------------------
def test_default_params_are_llamas():
    p = SamplerParams()
    assert (p.temp, p.top_k, p.top_p, p.min_p, p.typical_p, p.top_n_sigma) == (0.8, 40, 0.95, 0.05, 1.0, -1.0)
    assert (p.xtc_probability, p.xtc_threshold, p.penalty_last_n, p.penalty_repeat) == (0.0, 0.1, 64, 1.0)
    assert (p.mirostat, p.mirostat_tau, p.mirostat_eta, p.dry_multiplier, p.dry_base) == (0, 5.0, 0.1, 0.0, 1.75)
    assert p.dry_sequence_breakers == ["\n", ":", "\"", "*"]
    assert p.seed == 0xFFFFFFFF


def test_default_chain_order():
    chain = SamplerChain.from_params(SamplerParams(logit_bias={1: 2.0}), n_ctx=128)
    assert chain.names == ["logit_bias", *DEFAULT_SAMPLER_ORDER, "dist"]
    assert SamplerChain.from_params(SamplerParams(temp=0.0)).names[-1] == "greedy"


@pytest.mark.parametrize("version, last", [(1, "mirostat"), (2, "mirostat_v2")])
def test_mirostat_replaces_the_tail(version, last):
    chain = SamplerChain.from_params(SamplerParams(mirostat=version, logit_bias={0: 1.0}),
                                     env=SamplerEnv(n_vocab=100))
    assert chain.names == ["logit_bias", "temperature", last]


def test_custom_order_and_aliases():
    chain = SamplerChain.from_params(SamplerParams(samplers=["Top-K", "temp", "typ_p"]))
    assert chain.names == ["top_k", "temperature", "typical", "dist"]


def test_greedy_chain_with_penalties_changes_argmax():
    params = SamplerParams(temp=0.0, penalty_repeat=10.0, penalty_last_n=8)
    chain = SamplerChain.from_params(params, n_ctx=64)
    logits = np.array([0.0, 5.0, 4.0])
    assert chain.sample(logits) == 1
    assert chain.sample(logits) == 2  # token 1 is now penalized: 5 / 10 < 4
    assert chain.history == [1, 2]


@pytest.mark.parametrize("kwargs, key", [
    ({"top_p": 1.5}, "top_p"), ({"top_p": -0.1}, "top_p"), ({"top_k": -1}, "top_k"),
    ({"temp": float("nan")}, "temp"), ({"min_p": 2}, "min_p"), ({"mirostat": 3}, "mirostat"),
    ({"penalty_repeat": 0.0}, "penalty_repeat"), ({"xtc_probability": 1.2}, "xtc_probability"),
    ({"seed": -5}, "seed"), ({"logit_bias": {-1: 1.0}}, "logit_bias"), ({"tempp": 1.0}, "tempp"),
])
def test_invalid_params_name_the_parameter(kwargs, key):
    with pytest.raises(SamplerError, match=rf"\b{key}\b"):
        SamplerParams(**kwargs)


def test_unknown_sampler_lists_known_ones():
    with pytest.raises(SamplerError, match=r"unknown sampler 'top_q'.*known: .*top_k"):
        SamplerParams(samplers=["top_q"])
    with pytest.raises(SamplerError, match="known:"):
        build_sampler("nope")


def test_llama_cpp_meanings_are_accepted():
    params = SamplerParams(temp=-1.0, top_k=0, penalty_last_n=-1, seed=-1, logit_bias={3: float("-inf")})
    assert params.greedy


def test_sampler_seq_letters_and_names():
    assert parse_sampler_seq("edskypmxt") == list(DEFAULT_SAMPLER_ORDER)
    assert parse_sampler_seq("top_k;top_p,temp") == ["top_k", "top_p", "temperature"]
    assert parse_sampler_seq("kt") == ["top_k", "temperature"]
    with pytest.raises(SamplerError, match="unknown letter 'q'"):
        parse_sampler_seq("kq")


def test_chain_without_selector_is_a_clear_error():
    with pytest.raises(SamplerError, match="selecting sampler"):
        SamplerChain.from_names(["top_k"]).sample(np.zeros(5))


def test_same_seed_same_tokens_through_full_default_chain():
    logits = np.random.default_rng(5).normal(size=2000).astype(np.float32) * 3
    def draw(seed):
        chain = SamplerChain.from_params(SamplerParams(seed=seed, penalty_repeat=1.1), n_ctx=64)
        return [chain.sample(logits) for _ in range(20)]
    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_candidates_basics():
    with pytest.raises(SamplerError, match="empty logits"):
        Candidates.from_logits([])
    with pytest.raises(SamplerError, match="one length"):
        Candidates(np.arange(3), np.zeros(2))
    cur = Candidates.from_logits([1.0, 3.0, 2.0])
    cur.softmax(sort=True)
    assert cur.ids.tolist() == [1, 2, 0] and cur.sorted
    np.testing.assert_allclose(cur.probs.sum(), 1.0, rtol=1e-6)


def test_discrete_distribution_matches_libstdcxx_rule():
    # lower_bound of u over the normalized cumulative weights, u drawn like uniform_real_distribution<double>
    a, b = MT19937Rng(11), MT19937Rng(11)
    weights = np.array([0.2, 0.5, 0.3])
    u = b.uniform_double()
    assert a.discrete(weights) == int(np.searchsorted(np.cumsum(weights / weights.sum()), u, side="left"))


@pytest.mark.parametrize("make", [
    lambda: [Greedy()],
    lambda: [LogitBias({3: -100.0, 7: 2.5, 11: -math.inf}), Greedy()],
    lambda: [LogitBias({5: 1.0}), Penalties(last_n=8, repeat=1.3, freq=0.2, present=0.1), Greedy()],
])
def test_greedy_chains_pick_as_the_candidates_path_does(make):
    """A chain of logit-only samplers ending in greedy samples on the logits vector itself (no Candidates); it
    must pick exactly what the candidates path picks, ties and banned tokens included, and record the same
    history."""
    rng = np.random.default_rng(7)
    fast, slow = SamplerChain(make()), SamplerChain(make())
    assert fast.in_vocabulary_order()
    for step in range(200):
        logits = rng.normal(size=50).astype(np.float32)
        logits[rng.integers(0, 50, 3)] = logits.max()  # ties: the first best wins
        if step % 3 == 0:
            logits[7] = logits[3] = logits.max() + 1  # a biased token leads before its bias
        cur = Candidates.from_logits(logits)
        slow.apply(cur)
        expected = cur.selected_token
        slow.accept(expected)
        assert fast.sample(logits) == expected
    assert fast.history == slow.history


def test_a_chain_with_a_truncating_or_random_sampler_uses_the_candidates():
    assert not SamplerChain([LogitBias({1: 1.0}), TopK(5), Greedy()]).in_vocabulary_order()
    assert not SamplerChain([LogitBias({1: 1.0}), Dist(0)]).in_vocabulary_order()
    assert not SamplerChain([]).in_vocabulary_order()
