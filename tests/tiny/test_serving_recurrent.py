"""`llmfw serve` on hybrid models (the random-weight files of LFM2: short convolutions beside attention; Nemotron-H:
Mamba-2, attention and MLP layers), driven by the real `openai` client over a real uvicorn server on 127.0.0.1 (issue 34): answers equal the Python API's, and a
slot's cached prefix is reused only where the recurrent state can be restored — a prompt that extends what the
slot absorbed continues from its state, one that diverges inside it starts the sequence over."""
from __future__ import annotations

import openai
import pytest

from reference_gen.arch_testing import model_file, records, reference

import llmfw
from llmfw.core.generate import GenerationStats, generate
from llmfw.serving import Engine
from llmfw.serving.app import create_app
from support.live_server import TIMEOUT, LiveServer

MAX_TOKENS = 4


@pytest.fixture(scope="module", params=["lfm2", "nemotron_h"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model(tmp_path_factory, family):
    with llmfw.load_model(model_file(family, tmp_path_factory.mktemp(f"serve_{family}")), backend="numpy") as loaded:
        yield loaded


@pytest.fixture(scope="module")
def engine(model, family):
    with Engine(model, parallel=1, n_ctx=1024, alias=family) as e:  # one slot: every request meets its cache
        yield e


@pytest.fixture(scope="module")
def client(engine):
    live = LiveServer(create_app(engine))
    yield openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    live.stop()


def _complete(client, family: str, prompt: list[int]) -> str:
    reply = client.completions.create(model=family, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    return reply.choices[0].text


def _alone(model, prompt: list[int]) -> str:
    """The Python API's greedy answer on a fresh context."""
    return "".join(generate(model.new_context(n_ctx=1024), prompt, max_tokens=MAX_TOKENS, add_special=False,
                            stats=GenerationStats()))


def _prompt_tokens_decoded(engine) -> int:
    return int(engine.ctx.perf()["n_p_eval"])


def test_prefix_reuse_only_where_the_state_can_be_restored(client, engine, model, family):
    sequence = records(reference(family))[1]["sequence"]
    first = sequence[:40]
    assert _complete(client, family, first) == _alone(model, first)
    absorbed = list(engine.ctx.seq_tokens[0])
    assert absorbed[:40] == first and len(absorbed) == 40 + MAX_TOKENS - 1

    # extends what the slot absorbed: only the new tokens are decoded
    extended = absorbed + sequence[50:56]
    before = _prompt_tokens_decoded(engine)
    assert _complete(client, family, extended) == _alone(model, extended)
    assert _prompt_tokens_decoded(engine) - before == len(extended) - len(absorbed)

    # diverges at position 20, inside the slot's state (a KV cache would keep 20 tokens): decoded from the start
    diverging = first[:20] + sequence[60:70]
    before = _prompt_tokens_decoded(engine)
    assert _complete(client, family, diverging) == _alone(model, diverging)
    assert _prompt_tokens_decoded(engine) - before == len(diverging)
