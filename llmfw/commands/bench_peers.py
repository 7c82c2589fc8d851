"""`llmfw bench --compare-llama-cpp / --compare-transformers`: the engines measured in another interpreter."""
from __future__ import annotations

import subprocess

from pydantic import BaseModel

from llmfw.core.errors import ConfigError

from .bench_measure import (TOKEN_SEED, TURN_MARK, TURNS_ENV, current_rss, peak_rss, random_tokens, summarize,
                            timed_repetitions, wait_for_turn)

#: run by ``PYTHON -c`` with the params JSON as argv[1]; each peer script defines the same measurements from
#: source text so that the other interpreter needs nothing from llmfw
LLAMA_CPP_SCRIPT = r'''
from __future__ import annotations  # the pasted helpers' annotations name typing's types: never evaluated
import json, os, resource, statistics, sys, time
from typing import Any
import numpy as np
from llama_cpp import Llama, __version__
p = json.loads(sys.argv[1])
{helpers}
wait_for_turn()
rss_base = current_rss()
start = time.perf_counter()
llm = Llama(model_path=p["model"], n_ctx=max(p["n_prompt"] + p["n_gen"], 1), n_batch=max(p["n_prompt"], 1),
            n_ubatch=min(p["n_ubatch"], max(p["n_prompt"], 1)), n_threads=p["n_threads"],
            n_threads_batch=p["n_threads"], verbose=False)
load_model_s = time.perf_counter() - start
tokens = random_tokens(llm.n_vocab(), max(p["n_prompt"], p["n_gen"], 1))
llm.eval(tokens[:1]); llm.reset()  # the same one-token decode as the other side's counts as load
load_s = time.perf_counter() - start
rss_loaded = current_rss()
def timed(run_once):
    return timed_repetitions(p["repetitions"], llm.reset, run_once)
tests = {{}}
if p["n_prompt"]:
    tests["pp%d" % p["n_prompt"]] = summarize(p["n_prompt"], timed(lambda: llm.eval(tokens[:p["n_prompt"]])))
if p["n_gen"]:
    def generate():
        for t in tokens[:p["n_gen"]]:
            llm.eval([t])
    tests["tg%d" % p["n_gen"]] = summarize(p["n_gen"], timed(generate))
print(json.dumps({{"engine": "llama.cpp", "backend": "llama-cpp-python " + __version__, "model": p["model"],
                  "n_threads": p["n_threads"], "load_s": load_s, "load_model_s": load_model_s, "rss_base": rss_base,
                  "rss_after_load": rss_loaded,
                  "rss_peak": peak_rss(), "tests": tests}}))
'''

#: transformers loads the GGUF file itself (dequantized to float32, its GGUF support needs the ``gguf``
#: package), pp is one forward over the prompt, tg one-token forwards on its KV cache, both from an empty cache
TRANSFORMERS_SCRIPT = r'''
from __future__ import annotations  # the pasted helpers' annotations name typing's types: never evaluated
import json, os, resource, statistics, sys, time
from typing import Any
import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM
p = json.loads(sys.argv[1])
{helpers}
torch.set_num_threads(p["n_threads"])
wait_for_turn()
rss_base = current_rss()
start = time.perf_counter()
folder, name = os.path.split(os.path.abspath(p["model"]))
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
load_s = time.perf_counter() - start
rss_loaded = current_rss()
ids = torch.tensor([random_tokens(model.config.vocab_size, max(p["n_prompt"], p["n_gen"]))])
def timed(run_once):
    return timed_repetitions(p["repetitions"], lambda: None, run_once)
tests = {{}}
with torch.inference_mode():
    if p["n_prompt"]:
        prompt = ids[:, :p["n_prompt"]]
        tests["pp%d" % p["n_prompt"]] = summarize(p["n_prompt"], timed(
            lambda: model(prompt, use_cache=True, logits_to_keep=1)))
    if p["n_gen"]:
        def generate():
            cache = None
            for i in range(p["n_gen"]):
                cache = model(ids[:, i:i + 1], past_key_values=cache, use_cache=True, logits_to_keep=1).past_key_values
        tests["tg%d" % p["n_gen"]] = summarize(p["n_gen"], timed(generate))
print(json.dumps({{"engine": "transformers", "backend": "transformers " + transformers.__version__ + " f32",
                  "model": p["model"], "n_threads": p["n_threads"], "load_s": load_s, "rss_base": rss_base,
                  "rss_after_load": rss_loaded, "rss_peak": peak_rss(), "tests": tests}}))
'''


class Peer(BaseModel):
    """An engine measured in another interpreter: its option, the module that interpreter must import, the
    script it runs."""

    name: str
    option: str
    module: str
    package: str
    script: str


PEERS = {
    "llama_cpp": Peer(name="llama.cpp", option="--compare-llama-cpp", module="llama_cpp",
                      package="llama-cpp-python", script=LLAMA_CPP_SCRIPT),
    "transformers": Peer(name="transformers", option="--compare-transformers", module="transformers",
                         package="transformers, torch and gguf", script=TRANSFORMERS_SCRIPT),
}


def peer_script(peer: Peer) -> str:
    """The peer's script with the measuring helpers pasted in as source text."""
    import inspect

    helpers = "\n".join(inspect.getsource(f) for f in (current_rss, peak_rss, summarize, random_tokens,
                                                         wait_for_turn, timed_repetitions))
    helpers = helpers.replace("    import numpy as np\n\n", "")
    constants = f"TOKEN_SEED = {TOKEN_SEED}\nTURNS_ENV = {TURNS_ENV!r}\nTURN_MARK = {TURN_MARK!r}\n"
    return peer.script.format(helpers=constants + helpers)


def check_peer(peer: Peer, python: str) -> None:
    """ConfigError unless ``python`` runs and imports the peer's module (checked before any benchmark starts)."""
    try:
        probe = subprocess.run([python, "-c", f"import {peer.module}"], capture_output=True, text=True)
    except OSError as exc:
        raise ConfigError(f"{peer.option}: cannot run {python!r}: {exc}") from exc
    if probe.returncode != 0:
        tail = (probe.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise ConfigError(f"{peer.option}: {python!r} cannot import {peer.module} ({tail}); give an interpreter "
                          f"with {peer.package} installed")
