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


def _option_key(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def model_and_sampling_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """The options `run` and `chat` share: model, placement, context, sampling, config, verbosity."""
    options = [
        click.option("-m", "--model", "model", default=None, help="Catalog name or GGUF path (default: smollm2)."),
        click.option("--backend", default=None, help="numpy, torch, torch:cuda, onnx (default: fastest)."),
        click.option("-ngl", "--n-gpu-layers", "n_gpu_layers", type=int, default=None,
                     help="Layers on the GPU (-1 = all)."),
        click.option("-c", "--n-ctx", "n_ctx", type=int, default=None, help="Context size (0 = model default)."),
        click.option("-n", "--n-predict", "--max-tokens", "max_tokens", type=int, default=None,
                     help="Maximum tokens to generate (-1 = until end of generation)."),
        click.option("--stop", "stop", multiple=True, help="Stop string (repeatable; never printed)."),
        click.option("-s", "--seed", type=int, default=None, help="RNG seed (-1 = random)."),
        click.option("--sampler-seq", "--samplers", "sampler_seq", default=None,
                     help="Sampler order: llama.cpp letters (edskypmxt) or names (top_k,top_p,temp)."),
        click.option("--system", default=None, help="System prompt (chat template)."),
        click.option("--config", "config", type=click.Path(dir_okay=False), default=None,
                     help="YAML pipeline file; flags override it."),
        click.option("-v", "--verbose", is_flag=True, help="Show the model, the sampler chain and parameters."),
        click.option("--no-progress", is_flag=True, help="No progress bars."),
    ]
    for flag, (_, kind, help_text) in SAMPLING_FLAGS.items():
        options.append(click.option(flag, _option_key(flag), type=kind, default=None, help=help_text))
    for option in reversed(options):
        func = option(func)
    return func


def config_overrides(opts: dict[str, Any]) -> dict[str, Any]:
    """Dotted pipeline keys for the flags that were given."""
    from ..core.sampling import parse_sampler_seq

    overrides: dict[str, Any] = {}
    simple = {"model": "model", "backend": "backend", "n_gpu_layers": "n_gpu_layers", "n_ctx": "context.n_ctx",
              "system": "chat.system", "seed": "sampling.seed"}
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
    return overrides


def sampling_flag_given(opts: dict[str, Any]) -> bool:
    return opts.get("sampler_seq") is not None or any(
        opts.get(_option_key(flag)) is not None for flag in SAMPLING_FLAGS)


def build_pipeline(opts: dict[str, Any], extra: dict[str, Any] | None = None) -> Any:
    """The pipeline from ``--config`` (if any) with the flags applied; greedy unless sampling is configured."""
    from ..core.pipeline import Pipeline, merge_overrides, read_yaml

    config = opts.get("config")
    data = read_yaml(config) if config else {}
    overrides = config_overrides(opts)
    if extra:
        overrides.update(extra)
    if not sampling_flag_given(opts) and "sampling" not in data:
        overrides["sampling.temp"] = 0.0  # greedy by default: reproduces llama.cpp's reference continuations
    return Pipeline.from_dict(merge_overrides(data, overrides), Path(config) if config else "<command line>")


def load_model_with_progress(pipeline: Any, show: bool) -> Any:
    """Resolve (pulling a catalog model if needed) and load the pipeline's model, with progress bars."""
    from ..core.catalog import resolve_model

    location = pipeline.model_location()
    with ProgressBar(f"pull {location}", enabled=None if show else False) as bar:
        path = resolve_model(location, progress=lambda done, total, what: bar.update(done / max(total, 1), what))
    pipeline.config.model = str(path)
    with ProgressBar(f"loading {Path(path).name}", enabled=None if show else False) as bar:
        return pipeline.load_model(progress=lambda fraction: bar.update(fraction))


def describe_setup(model: Any, ctx: Any, sampler: Any, pipeline: Any) -> None:
    describe = getattr(model, "describe", None)
    click.echo(describe() if callable(describe) else repr(model), err=True)
    click.echo(f"context: n_ctx {getattr(ctx, 'n_ctx', '?')}", err=True)
    click.echo(f"sampler chain: {' -> '.join(sampler.names)}", err=True)
    params = pipeline.config.sampling.model_dump(exclude={"samplers", "dry_sequence_breakers", "options"})
    click.echo("sampling: " + ", ".join(f"{k} = {v}" for k, v in params.items()), err=True)


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
    """
    from ..core.generate import GenerationStats, context_int

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
    model = load_model_with_progress(pipeline, not opts["no_progress"])
    ctx = pipeline.new_context(model)
    sampler = pipeline.make_sampler(model, context_int(ctx, "n_ctx"))
    if opts["verbose"]:
        describe_setup(model, ctx, sampler, pipeline)
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

