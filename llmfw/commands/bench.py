"""`llmfw bench MODEL`: llama-bench's tests on llmfw's backends, optionally side by side with llama.cpp and
transformers.

* ``pp`` (prompt processing): one batch of ``-p`` random tokens decoded from an empty cache, logits for the last
  token only; ``tg`` (text generation): ``-n`` one-token decodes from an empty cache. Both after a warm-up run,
  repeated ``-r`` times; the table shows the median tokens/s and the spread (sample standard deviation).
* Per backend: load time — everything before the first decode can start: the model, a context and one
  one-token decode with the cache cleared after it, so sessions or graphs built lazily at the first decode count
  as load (llama.cpp's side gets the same one-token decode; ``load_model_s`` is the model alone); the clock starts
  once llmfw's core and the backend's library are imported, as llama.cpp's starts after ``from llama_cpp import
  Llama`` —, RSS before loading (after those imports), RSS after loading, peak RSS, the weight bytes the
  backends keep, the KV cache bytes (n_ctx = p + n, like llama-bench), and the graph builds / reuses of each test.
* Each backend runs in a fresh worker process (``python -m llmfw.commands.bench --worker``), so its memory and
  thread settings are its own; ``--compare-llama-cpp PYTHON`` runs the same tests through llama-cpp-python in
  that interpreter (a subprocess given a script; llmfw never imports ``llama_cpp``) and adds the ratios;
  ``--compare-transformers PYTHON`` does the same with Hugging Face transformers in float32 (the peer the
  numpy backend's speed target is stated against), so every figure of a comparison comes from one run.
* With more than one engine the workers run side by side and take turns (``--interleave``, the default): each
  measures one piece at a time — its load, then one warm-up or one timed repetition — while the others wait
  idle on their stdin, round robin. A VM whose speed drifts over minutes then slows every engine's runs alike
  instead of whichever engine ran in the slow minute; ``--no-interleave`` runs the engines one after another.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import click
from pydantic import BaseModel, Field

from llmfw.commands.model_arg import model_from, model_option
from llmfw.core.errors import LLMFWError

from .bench_measure import (TOKEN_SEED as TOKEN_SEED, TURN_MARK as TURN_MARK, TURN_SETTLE_S as TURN_SETTLE_S,
                            TURNS_ENV as TURNS_ENV, current_rss, peak_rss, random_tokens, summarize,
                            timed_repetitions, wait_for_turn)
from .bench_peers import PEERS as PEERS, Peer, check_peer, peer_script as peer_script
from .bench_table import format_table as format_table

WORKER_FLAG = "--worker"


class BenchParams(BaseModel):
    """One benchmark run's settings (shared by the llmfw workers and the llama.cpp script)."""

    model: str
    n_prompt: int = Field(512, ge=0)
    n_gen: int = Field(128, ge=0)
    repetitions: int = Field(3, ge=1)
    n_threads: int = Field(2, ge=1)
    n_ubatch: int = Field(512, ge=1)
    json_schema: str | None = None  # with a schema: tg also with sampling, and with sampling under the schema
    #: with N > 1, also ``tg{n}x{N}``: N sequences decoding together, one token each per batch (the server's case)
    batch_seqs: int = Field(1, ge=1, le=64)

    @property
    def n_ctx(self) -> int:
        return max(self.n_prompt + self.n_gen, self.batch_seqs * self.n_gen, 1)


# ---------------------------------------------------------------------------------------------------------------
# llmfw worker
# ---------------------------------------------------------------------------------------------------------------

def _nbytes(value: Any) -> int:
    """Bytes of a numpy array / torch tensor / object holding them (``raw``, ``k``/``v``...)."""
    if hasattr(value, "nbytes") and not callable(value.nbytes) and isinstance(value.nbytes, int):
        return int(value.nbytes)
    if hasattr(value, "numel") and hasattr(value, "element_size"):
        return int(value.numel() * value.element_size())
    fields = getattr(value, "__dict__", {})
    return sum(_nbytes(v) for v in fields.values() if hasattr(v, "nbytes") or hasattr(v, "numel"))


def backend_weight_bytes(backend: Any) -> int:
    """Weight bytes a backend keeps (``Backend.weight_nbytes`` counts each buffer once)."""
    return int(backend.weight_nbytes())


def kv_cache_bytes(ctx: Any) -> int:
    return sum(_nbytes(handle) for handle in getattr(ctx, "kv_storage", {}).values())


def _graph_counts(ctx: Any) -> tuple[int, int]:
    return ctx.n_graph_builds, ctx.n_graph_reuses


def _timed_runs(ctx: Any, params: BenchParams,
                run_once: Callable[[], object]) -> tuple[list[tuple[float, float]], dict[str, int]]:
    """Warm-up, then ``repetitions`` timed runs from an empty cache; graph builds/reuses during the timed runs."""
    after_warm_up: list[tuple[int, int]] = []
    runs = timed_repetitions(params.repetitions, ctx.memory.clear, run_once,
                             lambda: after_warm_up.append(_graph_counts(ctx)))
    (builds0, reuses0), (builds, reuses) = after_warm_up[0], _graph_counts(ctx)
    return runs, {"graph_builds": builds - builds0, "graph_reuses": reuses - reuses0}


def _check(rc: int, ctx: Any) -> None:
    if rc != 0:
        raise LLMFWError(f"decode returned {rc} during the benchmark: {ctx.last_error}")


def _import_engine(backend: str) -> None:
    """Import llmfw's core and ``backend``'s module with its runtime (torch, onnxruntime) before the clock starts:
    part of the baseline, as ``from llama_cpp import Llama`` (libllama and its ggml backends) is on llama.cpp's side."""
    from ..core.exec.backend import backend_class, parse_backend_spec
    from ..core.runtime.model import load_model  # noqa: F401 - the import is the point

    name, device = parse_backend_spec(backend)
    backend_class(name).check_available(device)


def bench_llmfw(params: BenchParams, backend: str) -> dict[str, Any]:
    """Load the model on ``backend`` in this process and run pp / tg; the result record."""
    import llmfw

    _import_engine(backend)
    wait_for_turn()  # the engines load one at a time too
    rss_base = current_rss()
    start = time.perf_counter()
    from ..core.exec.backend import backend_options_from_environment

    model = llmfw.load_model(params.model, backend=backend, backend_options=backend_options_from_environment(os.environ))
    load_model_s = time.perf_counter() - start
    try:
        ctx = model.new_context(n_ctx=params.n_ctx, n_batch=max(params.n_prompt, params.batch_seqs, 1),
                                n_seq_max=params.batch_seqs,
                                n_ubatch=min(params.n_ubatch, max(params.n_prompt, params.batch_seqs, 1)),
                                n_threads=params.n_threads)
        tokens = random_tokens(model.n_vocab, max(params.n_prompt, params.n_gen, 1))
        _check(ctx.decode(llmfw.Batch(tokens[:1])), ctx)  # what a backend builds at its first decode is load
        ctx.memory.clear()
        load_s = time.perf_counter() - start
        rss_loaded = current_rss()
        tests: dict[str, Any] = {}
        if params.n_prompt:
            prompt = tokens[:params.n_prompt]
            runs, graphs = _timed_runs(ctx, params, lambda: _check(ctx.decode(llmfw.Batch(prompt)), ctx))
            tests[f"pp{params.n_prompt}"] = {**summarize(params.n_prompt, runs), **graphs}
        if params.n_gen:
            def generate() -> None:
                for token in tokens[:params.n_gen]:
                    _check(ctx.decode(llmfw.Batch([token])), ctx)

            runs, graphs = _timed_runs(ctx, params, generate)
            tests[f"tg{params.n_gen}"] = {**summarize(params.n_gen, runs), **graphs}
            if params.batch_seqs > 1:
                tests.update(batched_decode_test(ctx, params, tokens))
            if params.json_schema is not None:
                tests.update(constrained_tests(model, ctx, params, tokens[0]))
        weights = {spec: backend_weight_bytes(b) for spec, b in model.backends.items()}
        return {
            "engine": "llmfw", "backend": backend, "model": str(model.path), "n_threads": params.n_threads,
            "n_ctx": ctx.n_ctx, "load_s": load_s, "load_model_s": load_model_s, "rss_base": rss_base,
            "rss_after_load": rss_loaded, "rss_peak": peak_rss(), "weight_bytes": sum(weights.values()),
            "weight_bytes_by_backend": weights,
            "kv_bytes": kv_cache_bytes(ctx), "tests": tests,
        }
    finally:
        model.close()


def batched_decode_test(ctx: Any, params: BenchParams, tokens: list[int]) -> dict[str, Any]:
    """``tg{n}x{N}``: N sequences from an empty cache, each step one batch with one new token per sequence; the
    rate counts every sequence's tokens (aggregate t/s)."""
    n_seqs = params.batch_seqs

    def generate() -> None:
        for step in range(params.n_gen):
            _check(ctx.decode(batched_step(tokens, step, n_seqs)), ctx)

    runs, graphs = _timed_runs(ctx, params, generate)
    return {f"tg{params.n_gen}x{n_seqs}": {**summarize(params.n_gen * n_seqs, runs), **graphs}}


def batched_step(tokens: list[int], step: int, n_seqs: int) -> Any:
    """Decode step ``step`` of ``tgNxS``: one token for each of ``n_seqs`` sequences from an empty cache (sequence s
    takes ``tokens[(step + 7s) % len]``), every row's logits out."""
    import llmfw

    batch = [tokens[(step + s * 7) % len(tokens)] for s in range(n_seqs)]
    return llmfw.Batch(batch, pos=[step] * n_seqs, seq_id=list(range(n_seqs)), logits=True)


def constrained_tests(model: Any, ctx: Any, params: BenchParams, first_token: int) -> dict[str, Any]:
    """``tg{n}+sample``: each step decodes the token the sampler chain (temperature 1) picked; ``tg{n}+json``: the
    same under the JSON schema, whose grammar restarts whenever it completes. Mask time per token and the
    grammar's compile time (the vocabulary bridge is built once per model before, and reported apart)."""
    import llmfw
    from llmfw.core.generation.grammar import grammar_tokenizer
    from llmfw.core.generation.sampling import SamplerChain, SamplerParams
    from llmfw.plugins.samplers.grammar import Grammar

    start = time.perf_counter()
    grammar_tokenizer(model.vocab)
    bridge_s = time.perf_counter() - start
    start = time.perf_counter()
    constrained = SamplerChain.from_params(SamplerParams(temp=1.0, seed=1, json_schema=params.json_schema),
                                           model=model)
    compile_s = time.perf_counter() - start
    results: dict[str, Any] = {}
    for name, chain in (("sample", SamplerChain.from_params(SamplerParams(temp=1.0, seed=1), model=model)),
                        ("json", constrained)):
        def generate(chain: Any = chain) -> None:
            chain.reset()
            token = first_token
            for _ in range(params.n_gen):
                _check(ctx.decode(llmfw.Batch([token])), ctx)
                token = chain.sample(ctx, -1)
                if chain.done() or model.vocab.is_eog(token):
                    chain.reset()

        runs, graphs = _timed_runs(ctx, params, generate)
        results[f"tg{params.n_gen}+{name}"] = {**summarize(params.n_gen, runs), **graphs}
    grammar = constrained.samplers[0]
    assert isinstance(grammar, Grammar)  # the chain of a JSON schema starts with its grammar
    matcher = grammar.matcher
    results[f"tg{params.n_gen}+json"].update({"mask_ms_per_token": matcher.mask_ms_per_token,
                                             "grammar_compile_ms": 1000 * compile_s,
                                             "vocab_bridge_ms": 1000 * bridge_s})
    return results


def worker_main(argv: list[str]) -> None:
    """``python -m llmfw.commands.bench --worker PARAMS_JSON BACKEND``: one JSON line on stdout."""
    import logging

    params = BenchParams.model_validate_json(argv[0])
    if os.environ.get("LLMFW_BENCH_VERBOSE"):
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        record = bench_llmfw(params, argv[1])
    except LLMFWError as exc:
        record = {"engine": "llmfw", "backend": argv[1], "error": str(exc)}
    print(json.dumps(record))


class Job(BaseModel):
    """One engine's measurement: a subprocess whose last stdout line is its JSON record."""

    what: str
    cmd: list[str]
    env: dict[str, str] | None = None


def worker_job(params: BenchParams, backend: str, verbose: bool) -> Job:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    if verbose:
        env["LLMFW_BENCH_VERBOSE"] = "1"
    cmd = [sys.executable, "-m", "llmfw.commands.bench", WORKER_FLAG, params.model_dump_json(), backend]
    return Job(what=f"llmfw worker for backend {backend!r}", cmd=cmd, env=env)


def _record(job: Job, returncode: int, lines: list[str]) -> dict[str, Any]:
    """The job's record: its last non-empty stdout line, parsed."""
    lines = [line for line in lines if line.strip()]
    if returncode != 0 or not lines:
        raise LLMFWError(f"{job.what} failed (exit code {returncode}); its messages are above")
    try:
        record: dict[str, Any] = json.loads(lines[-1])
        return record
    except json.JSONDecodeError as exc:
        raise LLMFWError(f"{job.what} printed no result record (last line: {lines[-1][:200]!r})") from exc


def _environment(job: Job, turns: bool) -> dict[str, str]:
    """The job's environment, with :data:`TURNS_ENV` set exactly when it takes turns."""
    env = dict(os.environ if job.env is None else job.env)
    env.pop(TURNS_ENV, None)
    if turns:
        env[TURNS_ENV] = "1"
    return env


def run_one_at_a_time(jobs: list[Job]) -> list[dict[str, Any]]:
    """Each job alone, one after another; stderr passes through to ours."""
    records = []
    for job in jobs:
        proc = subprocess.run(job.cmd, stdout=subprocess.PIPE, stderr=None, stdin=subprocess.DEVNULL, text=True,
                              env=_environment(job, turns=False))
        records.append(_record(job, proc.returncode, proc.stdout.splitlines()))
    return records


class _TurnTaker:
    """A job's process in a run that takes turns: stdin says go, stdout says when it waits again."""

    def __init__(self, job: Job):
        self.job = job
        self.proc = subprocess.Popen(job.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None,
                                     text=True, env=_environment(job, turns=True), bufsize=1)
        self.lines: list[str] = []

    def run_until_it_waits(self) -> bool:
        """Read its output until it waits for a turn (True) or ends (False)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.rstrip("\n") == TURN_MARK:
                return True
            self.lines.append(line)
        self.proc.wait()
        return False

    def give_turn(self) -> bool:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # it ended on its own; its output says how
            pass
        return self.run_until_it_waits()

    def record(self) -> dict[str, Any]:
        return _record(self.job, self.proc.wait(), self.lines)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def run_taking_turns(jobs: list[Job]) -> list[dict[str, Any]]:
    """All jobs side by side, one measuring at a time, round robin (see the module's docstring): each starts
    and imports its engine, then loads only in its turn, and each warm-up and timed repetition is a turn."""
    takers = [_TurnTaker(job) for job in jobs]
    try:
        waiting = [taker for taker in takers if taker.run_until_it_waits()]  # started, nothing measured yet
        while waiting:
            still = []
            for taker in waiting:
                time.sleep(TURN_SETTLE_S)
                if taker.give_turn():
                    still.append(taker)
            waiting = still
        return [taker.record() for taker in takers]
    finally:
        for taker in takers:
            taker.stop()


def peer_job(peer: Peer, python: str, params: BenchParams) -> Job:
    return Job(what=f"{peer.name} benchmark", cmd=[python, "-c", peer_script(peer), params.model_dump_json()])


def _split_backends(values: tuple[str, ...]) -> list[str]:
    out = [b.strip() for v in values for b in v.split(",") if b.strip()]
    if not out:
        from llmfw.core.exec.backend import default_backend_spec

        out = [default_backend_spec()]
    return list(dict.fromkeys(out))


def bytecode_note(environ: Mapping[str, str]) -> str | None:
    """A warning when Python writes no ``.pyc`` files: the plugin modules a load needs (architecture, tokenizer,
    backend) are imported inside the load clock, so each load would also count compiling their source."""
    if not environ.get("PYTHONDONTWRITEBYTECODE"):
        return None
    return ("note: PYTHONDONTWRITEBYTECODE is set: no .pyc files are written, so every llmfw module a load imports "
            "is compiled inside its clock; unset it for the load times an install sees")


@click.command("bench")
@click.argument("model_arg", metavar="[MODEL]", required=False)
@model_option
@click.option("-p", "--n-prompt", "n_prompt", type=click.IntRange(min=0), default=512, show_default=True,
              help="Prompt tokens of the pp test (0 = skip it).")
@click.option("-n", "--n-gen", "n_gen", type=click.IntRange(min=0), default=128, show_default=True,
              help="Generated tokens of the tg test (0 = skip it).")
@click.option("-r", "--repetitions", type=click.IntRange(min=1), default=3, show_default=True,
              help="Timed repetitions of each test (after one warm-up).")
@click.option("-ub", "--ubatch-size", "n_ubatch", type=click.IntRange(min=1), default=512, show_default=True,
              help="Physical batch size.")
@click.option("--backend", "backends", multiple=True,
              help="Backend(s) to measure, comma-separated or repeated: numpy, torch, torch:cuda, onnx, native "
                   "(default: the one a plain load picks: native on a CPU where its extension is built, else onnx; "
                   "see llmfw run -v).")
@click.option("-t", "--threads", "n_threads", type=click.IntRange(min=1), default=2, show_default=True,
              help="CPU threads (llmfw and the peers alike).")
@click.option("--batch-seqs", "batch_seqs", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Also run tg with this many sequences decoding together (test tg<n>x<N>, aggregate t/s).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@click.option("--interleave/--no-interleave", default=True, show_default=True,
              help="Run the engines (backends and peers) side by side, taking turns: one warm-up or timed "
                   "repetition of one engine at a time, round robin, so a drift in the machine's speed slows them "
                   "alike; --no-interleave runs them one after another.")
@click.option("--compare-llama-cpp", "llama_python", default=None, metavar="PYTHON",
              help="Also run the tests on llama.cpp through llama-cpp-python in this interpreter; the table shows "
                   "every engine's ratio to it.")
@click.option("--compare-transformers", "transformers_python", default=None, metavar="PYTHON",
              help="Also run the tests on Hugging Face transformers (float32, loading the GGUF itself) in this "
                   "interpreter.")
@click.option("-v", "--verbose", is_flag=True, help="Log loading, placement and op fallbacks to stderr.")
@click.option("-jf", "--json-schema", "json_schema_file", type=click.Path(dir_okay=False), default=None,
              help="Also measure tg with sampling, and with sampling constrained by this JSON schema file "
                   "(mask time per token, grammar compile time).")
def bench(model_arg: str | None, model: str | None, n_prompt: int, n_gen: int, repetitions: int, n_ubatch: int,
          backends: tuple[str, ...], n_threads: int, batch_seqs: int, as_json: bool, interleave: bool,
          llama_python: str | None, transformers_python: str | None, verbose: bool,
          json_schema_file: str | None) -> None:
    """Benchmark prompt processing (pp) and generation (tg) like llama-bench, on -m MODEL (or MODEL)."""
    from llmfw.core.format.catalog import DEFAULT_MODEL
    from llmfw.core.runtime.model import resolve_model_path

    path = str(resolve_model_path(model_from(model_arg, model) or DEFAULT_MODEL))
    schema = None
    if json_schema_file is not None:
        from llmfw.core.generation.grammar import GrammarSpec, read_constraint_file

        schema = read_constraint_file(json_schema_file, "JSON schema")
        GrammarSpec.from_json_schema(schema).compile()  # a bad schema fails before any model is loaded
    params = BenchParams(model=path, n_prompt=n_prompt, n_gen=n_gen, repetitions=repetitions, n_threads=n_threads,
                         n_ubatch=n_ubatch, json_schema=schema, batch_seqs=batch_seqs)
    peers = {key: python for key, python in (("transformers", transformers_python), ("llama_cpp", llama_python))
             if python}
    for key, python in peers.items():
        check_peer(PEERS[key], python)
    names = _split_backends(backends)
    jobs = [worker_job(params, backend, verbose) for backend in names]
    jobs += [peer_job(PEERS[key], python, params) for key, python in peers.items()]
    engines = [f"llmfw {backend}" for backend in names] + [PEERS[key].name for key in peers]
    if not as_json:
        how = "side by side, taking turns" if interleave and len(jobs) > 1 else "one after another"
        click.echo(f"benchmarking {', '.join(engines)} ({how}) ...", err=True)
    note = bytecode_note(os.environ)
    if note:
        click.echo(note, err=True)
    results = run_taking_turns(jobs) if interleave and len(jobs) > 1 else run_one_at_a_time(jobs)
    records = results[:len(names)]
    measured: dict[str, Any] = dict(zip(peers, results[len(names):]))
    if as_json:
        from llmfw.commands.machine import describe_machine

        click.echo(json.dumps({"params": params.model_dump(), "machine": describe_machine(), "llmfw": records,
                               "llama_cpp": measured.get("llama_cpp"), "transformers": measured.get("transformers")},
                              indent=2))
    else:
        others = [measured["transformers"]] if "transformers" in measured else []
        click.echo(format_table(records + others, measured.get("llama_cpp")))
    failed = [r for r in records if "error" in r]
    if failed:
        raise LLMFWError("; ".join(f"backend {r['backend']}: {r['error']}" for r in failed))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == WORKER_FLAG:
        worker_main(sys.argv[2:])
    else:  # pragma: no cover - the command is reached through `llmfw bench`
        bench()
