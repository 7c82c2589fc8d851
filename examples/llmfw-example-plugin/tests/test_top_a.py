import numpy as np
import pytest

from llmfw.core.errors import SamplerError
from llmfw.core.generation.sampling import Candidates, SamplerChain
from llmfw.plugins.samplers.basic import Dist
from llmfw_example_plugin import TopA


def make(probs):
    return Candidates(np.arange(len(probs)), np.log(np.asarray(probs, dtype=np.float32)))


def test_keeps_tokens_above_a_times_pmax_squared():
    cur = make([0.1, 0.6, 0.2, 0.1])  # threshold 0.5 * 0.36 = 0.18
    TopA(0.5).apply(cur)
    assert cur.ids.tolist() == [1, 2]


def test_flat_distribution_is_untouched():
    cur = make([0.25] * 4)  # threshold 0.5 * 0.0625 = 0.031
    TopA(0.5).apply(cur)
    assert len(cur) == 4


def test_zero_a_disables_and_min_keep_holds():
    cur = make([0.9, 0.05, 0.05])
    TopA(0.0).apply(cur)
    assert len(cur) == 3
    cur = make([0.9, 0.05, 0.05])
    TopA(1.0, min_keep=2).apply(cur)
    assert cur.ids.tolist() == [0, 1]


def test_bad_a_is_rejected():
    with pytest.raises(SamplerError, match="top_a"):
        TopA(-1.0)


def test_in_a_chain_it_only_selects_survivors():
    chain = SamplerChain([TopA(0.9), Dist(3)])
    logits = np.log(np.array([0.05, 0.7, 0.25]))
    assert {chain.sample(logits) for _ in range(50)} == {1}
