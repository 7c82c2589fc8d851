"""`llmfw run PROMPT`: generate a continuation, streamed to stdout; progress and timings on stderr.

With no sampling flag (and no ``sampling`` section in ``--config``) generation is **greedy** (temperature 0),
so ``llmfw run -m smollm2 "The capital of France is" -n 48`` prints llama.cpp's greedy reference
continuation. Any sampling flag (``--temp``, ``--top-k``, ``--top-p``, ``--min-p``, ``--repeat-penalty``,
``--sampler-seq``, ...) switches to llama.cpp's default chain and defaults (temp 0.8, top-k 40, top-p 0.95,
min-p 0.05, ...), with the flags given on top. The helpers here are shared with `llmfw chat`.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import click

from .model_arg import model_option
from .progress import ProgressBar

#: flag -> (SamplerParams field, click type, help)
SAMPLING_FLAGS: dict[str, tuple[str, Any, str]] = {
    "--temp": ("temp", float, "temperature (llama.cpp default 0.8; <= 0 = greedy)"),
    "--top-k": ("top_k", int, "top-k (default 40; 0 = off)"),
    "--top-p": ("top_p", float, "top-p (default 0.95; 1 = off)"),
    "--min-p": ("min_p", float, "min-p (default 0.05; 0 = off)"),
    "--typical": ("typical_p", float, "locally typical p (default 1 = off)"),
    "--top-n-sigma": ("top_n_sigma", float, "top-n-sigma (default -1 = off)"),
    "--xtc-probability": ("xtc_probability", float, "XTC probability (default 0 = off)"),
    "--xtc-threshold": ("xtc_threshold", float, "XTC threshold (default 0.1)"),
    "--repeat-penalty": ("penalty_repeat", float, "repeat penalty (default 1 = off)"),
    "--repeat-last-n": ("penalty_last_n", int, "tokens the penalties look at (default 64; -1 = n_ctx)"),
    "--presence-penalty": ("penalty_present", float, "presence penalty (default 0)"),
    "--frequency-penalty": ("penalty_freq", float, "frequency penalty (default 0)"),
    "--dry-multiplier": ("dry_multiplier", float, "DRY multiplier (default 0 = off)"),
    "--dynatemp-range": ("dynatemp_range", float, "dynamic temperature range (default 0 = off)"),
    "--mirostat": ("mirostat", int, "0 = off, 1 = mirostat, 2 = mirostat 2.0"),
    "--mirostat-lr": ("mirostat_eta", float, "mirostat learning rate eta (default 0.1)"),
    "--mirostat-ent": ("mirostat_tau", float, "mirostat target entropy tau (default 5)"),
}


#: what --backend's help says about the default (core/exec/backend.py choose_default_backend: the backends'
#: declared priorities; these are the built-in ones)
BACKEND_HELP = ("numpy, onnx, native, torch, torch:cuda, ggml. Default: torch:cuda when a CUDA GPU and torch are "
                "present, else native (its C extension built), else onnx (onnxruntime importable), else numpy; a "
                "backend that declines the model is skipped for the next; -v says which and why.")
#: llama.cpp's -n values below 0 (llmfw has no context shift, so both run until the context is full at most)
N_PREDICT_UNTIL_EOG, N_PREDICT_UNTIL_FULL = -1, -2


def _option_key(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def check_n_predict(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    """llama.cpp's -n: N >= 0 tokens, -1 until end of generation, -2 until the context is full; else an error
    (a stray -5 must not mean "no limit")."""
    if value is not None and value < N_PREDICT_UNTIL_FULL:
        raise click.BadParameter(f"{value} is not a token limit: use N >= 0, -1 (until end of generation) or -2 "
                                 "(until the context is full)", ctx=ctx, param=param)
    return value


def threads_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """``-t/--threads N``: CPU threads for the backends' kernels (``context.n_threads``); for `run`, `chat`
    and any command that builds a context (e.g. `serve`)."""
    return click.option("-t", "--threads", "threads", type=click.IntRange(min=1), default=None,
                        help="CPU threads for generation (default: the backend library's own choice).")(func)


def model_and_sampling_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """The options `run` and `chat` share: model, placement, context, sampling, config, verbosity."""
    options: list[Callable[..., Any]] = [
        model_option,
        click.option("--backend", default=None, help=BACKEND_HELP),
        click.option("-ngl", "--n-gpu-layers", "n_gpu_layers", type=int, default=None,
                     help="Layers on the GPU (-1 = all)."),
        click.option("-c", "--n-ctx", "n_ctx", type=click.IntRange(min=0), default=None,
                     help="Context size in tokens (0 = min(n_ctx_train, 4096)); rounded up to a multiple of 256 "
                          "like llama.cpp (-v shows the size used)."),
        click.option("-n", "--n-predict", "--max-tokens", "max_tokens", type=int, default=None,
                     callback=check_n_predict,
                     help="Tokens to generate: N >= 0, -1 = until end of generation, -2 = until the context is "
                          "full (default 256)."),
        threads_option,
        click.option("--stop", "stop", multiple=True, help="Stop string (repeatable; never printed)."),
        click.option("-s", "--seed", type=int, default=None, help="RNG seed (-1 = random)."),
        click.option("--sampler-seq", "--samplers", "sampler_seq", default=None,
                     help="Sampler order: llama.cpp letters (edskypmxt) or names (top_k,top_p,temp)."),
        click.option("--system", default=None, help="System prompt (chat template)."),
        click.option("--special", is_flag=True, default=None,
                     help="Print control tokens (<|im_start|>, <end_of_turn>...), like llama-cli --special."),
        click.option("--config", "config", type=click.Path(dir_okay=False), default=None,
                     help="YAML pipeline file; flags override it."),
        click.option("-v", "--verbose", is_flag=True,
                     help="Show the model, the backend and why, the context size, the sampler chain and parameters."),
        click.option("--no-progress", is_flag=True, help="No progress bars."),
    ]
    for flag, (_, kind, help_text) in SAMPLING_FLAGS.items():
        options.append(click.option(flag, _option_key(flag), type=kind, default=None, help=help_text))
    options += constraint_options()
    for option in reversed(options):
        func = option(func)
    return func


def constraint_options() -> list[Callable[..., Any]]:
    """llama.cpp's structured-output flags (plus --regex): at most one of them per run."""
    file_type = click.Path(dir_okay=False)
    return [
        click.option("--grammar", "grammar", default=None, metavar="TEXT",
                     help="GBNF (llama.cpp syntax) or Lark grammar the output must match."),
        click.option("--grammar-file", "grammar_file", type=file_type, default=None, help="Read --grammar from FILE."),
        click.option("-j", "--json-schema", "json_schema", default=None, metavar="TEXT",
                     help="JSON schema the output must match ({} = any JSON value)."),
        click.option("-jf", "--json-schema-file", "json_schema_file", type=file_type, default=None,
                     help="Read --json-schema from FILE."),
        click.option("--json", "any_json", is_flag=True, help="The output is a JSON object."),
        click.option("--regex", "regex", default=None, metavar="PATTERN",
                     help="Regular expression the output must match."),
    ]


def constraint_overrides(opts: dict[str, Any]) -> dict[str, Any]:
    """The pipeline key (``sampling.grammar`` / ``.json_schema`` / ``.regex``) for the constraint flag given."""
    from ..core.generation.grammar import ANY_JSON_OBJECT, read_constraint_file

    given = {flag: opts.get(key) for flag, key in (("--grammar", "grammar"), ("--grammar-file", "grammar_file"),
             ("--json-schema", "json_schema"), ("--json-schema-file", "json_schema_file"), ("--json", "any_json"),
             ("--regex", "regex")) if opts.get(key) not in (None, False)}
    if len(given) > 1:
        raise click.UsageError(f"give one of {', '.join(given)}: a run has at most one output constraint")
    if not given:
        return {}
    flag, value = next(iter(given.items()))
    if flag == "--grammar-file":
        return {"sampling.grammar": read_constraint_file(value, "grammar")}
    if flag == "--json-schema-file":
        return {"sampling.json_schema": read_constraint_file(value, "JSON schema")}
    if flag == "--json":
        return {"sampling.json_schema": dict(ANY_JSON_OBJECT)}
    return {f"sampling.{flag.lstrip('-').replace('-', '_')}": value}


def config_overrides(opts: dict[str, Any]) -> dict[str, Any]:
    """Dotted pipeline keys for the flags that were given."""
    from ..core.generation.sampling import parse_sampler_seq

    overrides: dict[str, Any] = {}
    simple = {"model": "model", "backend": "backend", "n_gpu_layers": "n_gpu_layers", "n_ctx": "context.n_ctx",
              "threads": "context.n_threads", "system": "chat.system", "seed": "sampling.seed",
              "special": "tokenizer.special"}
    for option, key in simple.items():
        if opts.get(option) is not None:
            overrides[key] = opts[option]
    if opts.get("max_tokens") is not None:
        overrides["generation.max_tokens"] = None if opts["max_tokens"] < 0 else opts["max_tokens"]
    if opts.get("stop"):
        overrides["generation.stop"] = list(opts["stop"])
    for flag, (field, _, _) in SAMPLING_FLAGS.items():
        value = opts.get(_option_key(flag))
        if value is not None:
            overrides[f"sampling.{field}"] = value
    if opts.get("sampler_seq"):
        overrides["sampling.samplers"] = parse_sampler_seq(opts["sampler_seq"])
    overrides.update(constraint_overrides(opts))
    return overrides


def sampling_flag_given(opts: dict[str, Any]) -> bool:
    return opts.get("sampler_seq") is not None or any(
        opts.get(_option_key(flag)) is not None for flag in SAMPLING_FLAGS)


def build_pipeline(opts: dict[str, Any], extra: dict[str, Any] | None = None, *, greedy_default: bool = True) -> Any:
    """The pipeline from ``--config`` (if any) with the flags applied. With ``greedy_default`` (`run`) it is
    greedy unless sampling is configured; without (`chat`) llama.cpp's sampling defaults apply."""
    from ..app.pipeline import Pipeline, merge_overrides, read_yaml

    config = opts.get("config")
    data = read_yaml(config) if config else {}
    overrides = config_overrides(opts)
    if extra:
        overrides.update(extra)
    if greedy_default and not sampling_flag_given(opts) and "sampling" not in data:
        overrides["sampling.temp"] = 0.0  # greedy by default: reproduces llama.cpp's reference continuations
    return Pipeline.from_dict(merge_overrides(data, overrides), Path(config) if config else "<command line>",
                              overridden=frozenset(overrides))


def load_model_with_progress(pipeline: Any, show: bool, verbose: bool = False) -> Any:
    """Resolve (pulling a catalog model if needed; pip's output only with ``verbose``) and load the pipeline's
    model, with progress bars."""
    from ..core.format.catalog import resolve_model

    location = pipeline.model_location()
    with ProgressBar(f"pull {location}", enabled=None if show else False) as bar:
        path = resolve_model(location, verbose=verbose,
                             progress=lambda done, total, what: bar.update(done / max(total, 1), what))
    pipeline.config.model = str(path)
    with ProgressBar(f"loading {Path(path).name}", enabled=None if show else False) as bar:
        return pipeline.load_model(progress=lambda fraction: bar.update(fraction))


def draw_random_seed(pipeline: Any) -> bool:
    """A random seed (the default, or -1) drawn once, before the chain is built, so every sampler of the chain
    uses it, ``-v`` can print it and ``--seed N`` repeats the run; True when one was drawn."""
    from ..core.generation.sampling import DEFAULT_SEED, resolve_seed

    sampling = pipeline.config.sampling
    if sampling.seed not in (DEFAULT_SEED, -1):
        return False
    sampling.seed = resolve_seed(sampling.seed)
    return True


def describe_seed(sampler: Any, drawn: bool) -> str:
    """The seed the chain's random samplers were seeded with (each keeps its generator as ``rng``)."""
    seeds = sorted({int(s.rng.seed) for s in getattr(sampler, "samplers", []) if getattr(s, "rng", None) is not None})
    if not seeds:
        return "seed: not used (no sampler of the chain draws at random)"
    note = f" (drawn at random; --seed {seeds[0]} repeats it)" if drawn and len(seeds) == 1 else \
        " (drawn at random)" if drawn else ""
    return f"seed: {', '.join(map(str, seeds))}{note}"


def describe_setup(model: Any, ctx: Any, sampler: Any, pipeline: Any, *, seed_drawn: bool = False) -> None:
    describe = getattr(model, "describe", None)
    click.echo(describe() if callable(describe) else repr(model), err=True)
    click.echo(f"backend: {getattr(model, 'backend_choice', '') or '?'}", err=True)
    size = ctx.describe_n_ctx() if hasattr(ctx, "describe_n_ctx") else f"n_ctx {getattr(ctx, 'n_ctx', '?')}"
    threads = pipeline.config.context.n_threads
    click.echo(f"context: {size}, threads {threads if threads else 'backend default'}", err=True)
    click.echo(f"sampler chain: {' -> '.join(sampler.names)}", err=True)
    params = pipeline.config.sampling.model_dump(exclude={"samplers", "dry_sequence_breakers", "options", "grammar",
                                                          "json_schema", "regex", "seed"})
    click.echo("sampling: " + ", ".join(f"{k} = {v}" for k, v in params.items()), err=True)
    from ..core.generation.sampling import DEFAULT_SEED

    sampling = pipeline.config.sampling
    greedy = sampling.greedy and sampling.mirostat == 0 and sampling.xtc_probability == 0
    click.echo("seed: not used (greedy)" if greedy else
               describe_seed(sampler, seed_drawn or sampling.seed in (DEFAULT_SEED, -1)), err=True)
    spec = pipeline.config.sampling.grammar_spec()
    if spec is not None:
        click.echo(f"output constraint: {spec.describe()}", err=True)


@click.command("run")
@click.argument("prompt", required=False)
@click.option("--chat", "use_chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@click.option("--prompt-cache", "prompt_cache", default=None,
              help="Save the state after the prompt to FILE; later runs decode only what differs.")
@click.option("--draft-max", "draft_max", type=click.IntRange(1, 1024), default=None,
              help="Speculative decoding: draft up to K tokens (n-gram prompt lookup unless --model-draft).")
@click.option("-md", "--model-draft", "model_draft", default=None,
              help="Speculative decoding with this draft model (same vocabulary).")
@model_and_sampling_options
def run(prompt: str | None, use_chat: bool, prompt_cache: str | None, draft_max: int | None,
        model_draft: str | None, **opts: Any) -> None:
    """Generate a continuation of PROMPT ("-" reads it from stdin).

    Greedy unless a sampling flag is given; the prompt is tokenized with special tokens parsed, not echoed.
    Ctrl-C stops the generation, prints the timing line and exits with status 130.
    """
    from ..core.generation.generate import GenerationStats

    if prompt == "-":
        prompt = sys.stdin.read()
    extra: dict[str, Any] = {"chat.enabled": True} if use_chat else {}
    if draft_max is not None:
        extra["speculative.draft_max"] = draft_max
    if model_draft is not None:
        extra["speculative.model_draft"] = model_draft
    pipeline = build_pipeline(opts, extra)
    if prompt is None and pipeline.config.generation.prompt is None:
        raise click.UsageError("give a PROMPT (or set generation.prompt in --config)")
    model = load_model_with_progress(pipeline, not opts["no_progress"], verbose=opts["verbose"])
    ctx = pipeline.new_context(model)
    seed_drawn = draw_random_seed(pipeline)
    sampler = pipeline.make_sampler(model, ctx.n_ctx)
    if opts["verbose"]:
        describe_setup(model, ctx, sampler, pipeline, seed_drawn=seed_drawn)
    if prompt_cache:
        from .prompt_cache import prime_prompt_cache

        prime_prompt_cache(pipeline, model, ctx, prompt, prompt_cache)
    stats = GenerationStats()
    out = sys.stdout
    try:
        for piece in pipeline.run(prompt, ctx=ctx, sampler=sampler, stats=stats):
            out.write(piece)
            out.flush()
    except KeyboardInterrupt:
        stats.stop_reason = "interrupted"
    out.write("\n")
    out.flush()
    click.echo(stats.summary(), err=True)
    if stats.stop_reason == "interrupted":
        sys.exit(130)  # like any program stopped by SIGINT: a script can tell an interrupted run from a finished one

