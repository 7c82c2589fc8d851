"""Reasoning apart from the answer (issue "agent-ready serving", item 2).

The split is tested as a unit over scripted replies cut into pieces at every place (no small real model thinks),
the thinking budget over SmolLM2's real vocabulary, and end to end through a real server on 127.0.0.1 with the
real `openai` client: SmolLM2 is made to think by a grammar that begins its reply with ``<think>`` (a request's
grammar constrains the raw output, tags included, before the split), rendered with llama.cpp's copies of the
Qwen 3 and DeepSeek-R1 templates.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmfw.core.sampling import Candidates
from llmfw.serving import Engine
from llmfw.serving.chat_options import ChatOptions
from llmfw.serving.reasoning import COMMAND_R, HARMONY, THINK, ReasoningSplitter, ThinkingBudget, split_reasoning, \
    starts_inside_thinking, thinking_tags_for
from support.live_server import TIMEOUT, post, serve_engine

TEMPLATES = Path(__file__).parents[1] / "data" / "tool_templates"
QWEN3 = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
R1 = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
ASK = [{"role": "user", "content": "Is water wet?"}]
THINK_GRAMMAR = 'root ::= "<think>" [a-z ]{1,24} "</think>" [A-Za-z ]{1,12}'


# -- the split, as a unit -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, inside, reasoning, content", [
    ("<think>let me see</think>\n\nYes.", False, "let me see", "Yes."),
    ("  <think>\nhm\n</think>Yes", False, "hm", "Yes"),
    ("plain answer", False, None, "plain answer"),
    ("a <think> in the middle is content", False, None, "a <think> in the middle is content"),
    ("still thinking when cut", True, "still thinking when cut", ""),
    ("thought</think>answer", True, "thought", "answer"),
    ("<think>cut short", False, "cut short", ""),
    ("", False, None, ""),
])
def test_split_reasoning(text, inside, reasoning, content):
    assert split_reasoning(text, THINK, inside) == (reasoning, content)


def test_harmony_analysis_channel_is_the_reasoning():
    """gpt-oss writes its thinking in the analysis channel and the answer in the final channel."""
    reply = "<|channel|>analysis<|message|>User greets.<|end|><|start|>assistant<|channel|>final<|message|>Hello!"
    assert split_reasoning(reply, HARMONY) == ("User greets.", "Hello!")
    splitter, pieces = ReasoningSplitter(HARMONY), []
    for i in range(0, len(reply), 3):
        pieces += splitter.feed(reply[i:i + 3])
    pieces += splitter.finish()
    assert "".join(t for k, t in pieces if k == "content") == "Hello!"


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["<think>why not</think>\n\nBecause.", "No tags at all.", "<think>a<b</think>c</thi",
                        " <thin", "x</think>y"]),
       st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=40), st.booleans())
def test_streamed_split_joins_up_to_the_whole_split(text, cuts, inside):
    """However the reply is cut into pieces, the streamed pieces join up to the whole reply's split."""
    splitter, pieces, at = ReasoningSplitter(THINK, inside), [], 0
    for size in cuts:
        pieces += splitter.feed(text[at:at + size])
        at += size
    pieces += splitter.feed(text[at:]) + splitter.finish()
    reasoning, content = split_reasoning(text, THINK, inside)
    assert "".join(t for k, t in pieces if k == "content") == content
    assert "".join(t for k, t in pieces if k == "reasoning").strip() == (reasoning or "")


def test_tags_and_where_a_reply_starts():
    assert thinking_tags_for(QWEN3) == THINK and thinking_tags_for("{{ '<|START_THINKING|>' }}") == COMMAND_R
    assert thinking_tags_for((TEMPLATES / "openai-gpt-oss-120b.jinja").read_text()) == HARMONY
    assert starts_inside_thinking("<|Assistant|><think>\n", THINK)
    assert not starts_inside_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n", THINK)


# -- the budget, over SmolLM2's vocabulary -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(shared_models):
    return shared_models.get("smollm2", "numpy")


def test_thinking_budget_forces_the_closing_tag(model):
    vocab = model.vocab
    budget = ThinkingBudget(vocab, THINK, budget=2, inside=False)
    word = vocab.tokenize(" hm", add_special=False)[0]
    for token in vocab.tokenize("<think>", add_special=False, parse_special=True):
        budget.accept(token)
    assert budget.inside
    rng = np.random.default_rng(0)
    chosen = []
    for _ in range(2 + len(budget.close_tokens)):
        cur = Candidates.from_logits(rng.normal(size=model.n_vocab).astype(np.float32))
        budget.apply(cur)
        finite = cur.ids[np.isfinite(cur.logits)]
        token = int(finite[0]) if len(finite) == 1 else word  # free choice: the model would think on
        budget.accept(token)
        chosen.append(token)
    assert chosen[:2] == [word, word] and chosen[2:] == budget.close_tokens
    assert vocab.detokenize(chosen[2:]) == "</think>" and not budget.inside


# -- end to end --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3_server(model):
    yield from serve_engine(model, parallel=2, n_ctx=2048, alias="smol", chat_template=QWEN3)


@pytest.fixture(scope="module")
def client(qwen3_server):
    return openai.OpenAI(base_url=qwen3_server.url + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)


def thinking_request(**extra):
    return dict(model="smol", messages=ASK, temperature=0, max_tokens=60, extra_body={"grammar": THINK_GRAMMAR,
                                                                                       **extra})


def test_reasoning_content_apart_from_the_answer_whole_and_streamed(client):
    whole = client.chat.completions.create(**thinking_request()).choices[0]
    reasoning = whole.message.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    assert whole.message.content and "think>" not in whole.message.content
    chunks = list(client.chat.completions.create(stream=True, **thinking_request()))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed_reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    streamed_content = "".join(d.content or "" for d in deltas)
    assert streamed_reasoning.strip() == reasoning and streamed_content == whole.message.content
    assert sum(1 for d in deltas if (d.model_extra or {}).get("reasoning_content")) > 1  # as tokens arrive


def test_reasoning_format_none_keeps_the_thinking_in_the_content(client):
    reply = client.chat.completions.create(**thinking_request(reasoning_format="none")).choices[0].message
    assert reply.content.startswith("<think>") and "</think>" in reply.content
    assert "reasoning_content" not in (reply.model_extra or {})


def test_chat_template_kwargs_reach_the_template(client, qwen3_server):
    """Qwen 3's template closes the thinking in the prompt when enable_thinking is false: more prompt tokens."""
    body = {"messages": ASK, "max_tokens": 1, "temperature": 0}
    default = post(qwen3_server.url + "/v1/chat/completions", json=body).json()
    off = post(qwen3_server.url + "/v1/chat/completions",
               json={**body, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert off["usage"]["prompt_tokens"] > default["usage"]["prompt_tokens"]
    bad = post(qwen3_server.url + "/v1/chat/completions", json={**body, "chat_template_kwargs": [1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


def test_reasoning_budget_closes_the_thinking(client, model):
    grammar = 'root ::= "<think>" [a-z ]{1,200} "</think>" " ok"'
    reply = client.chat.completions.create(model="smol", messages=ASK, temperature=0, max_tokens=80,
                                           extra_body={"grammar": grammar, "reasoning_budget": 3}).choices[0]
    reasoning = reply.message.model_extra["reasoning_content"]
    assert reply.finish_reason == "stop" and reply.message.content == "ok"
    # "<think>" then at most 3 thinking tokens before the forced "</think>"
    assert len(model.vocab.tokenize(reasoning, add_special=False)) <= 3


def test_server_wide_template_kwargs_and_a_prompt_that_opens_the_thinking(model):
    """DeepSeek-R1's template (llama.cpp's copy) ends the prompt with ``<think>`` when enable_thinking is on (here
    server-wide, as --chat-template-kwargs sets it): the reply starts inside the thinking."""
    options = ChatOptions(template_kwargs={"enable_thinking": True})
    with Engine(model, parallel=1, n_ctx=1024, chat_template=R1, chat_options=options) as engine:
        reply = engine.chat_completion(messages=ASK, temperature=0, max_tokens=60,
                                       grammar='root ::= [a-z ]{1,24} "</think>" [A-Za-z ]{1,12}')
    message = reply["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"] and "</think>" not in message["content"]
