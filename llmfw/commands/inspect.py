"""`llmfw inspect [-m] MODEL [--tensors] [--json]`: a GGUF model's header at a glance.

:func:`summarize` builds a JSON-ready dict from an open :class:`~llmfw.core.format.gguf.GGUFFile`; the command prints it
as text or JSON. Nothing here reads tensor data, so inspecting is as fast as opening.
"""
from __future__ import annotations

import json
from collections import Counter
from typing import Any

import click
import numpy as np

from ..core.format.catalog import DEFAULT_MODEL, resolve_model
from ..core.format.gguf import GGUFFile, GGUFValueType, most_common_type, open_gguf
from ..core.format.quants import GGMLType
from .model_arg import model_from, model_option
from .progress import ProgressBar

#: llama.cpp's `general.file_type` ids (enum llama_ftype) -> names, as llama.cpp prints them
LLAMA_FTYPE_NAMES = {
    0: "all F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K - Medium",
    11: "Q3_K - Small", 12: "Q3_K - Medium", 13: "Q3_K - Large", 14: "Q4_K - Small", 15: "Q4_K - Medium",
    16: "Q5_K - Small", 17: "Q5_K - Medium", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K - Small",
    22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M",
    30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4 MoE",
}
#: arrays longer than this are shown as "<N x TYPE>" instead of their items
MAX_LISTED_ITEMS = 64
_GENERAL_KEYS = ("name", "basename", "finetune", "size_label", "organization", "license", "type",
                 "quantization_version")


def _plain(value: Any, vtype: GGUFValueType | None = None) -> Any:
    """A metadata value as JSON-ready python (numpy -> lists/scalars; float32 shown at float32 precision)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if vtype == GGUFValueType.FLOAT32:
        return float(str(np.float32(value)))  # 1e-05, not 9.999999747378752e-06
    return value


def _array_summary(g: GGUFFile, key: str) -> Any:
    value = g.metadata[key]
    if len(value) <= MAX_LISTED_ITEMS:
        return _plain(value)
    elem = g.metadata_array_types.get(key)
    return f"<{len(value)} x {elem.name if elem else '?'}>"


def _value(g: GGUFFile, key: str) -> Any:
    if g.metadata_types[key] == GGUFValueType.ARRAY:
        return _array_summary(g, key)
    return _plain(g.metadata[key], g.metadata_types[key])


def hyperparameters(g: GGUFFile) -> dict[str, Any]:
    """Every ``{arch}.*`` key (context_length, embedding_length, block_count, attention.*, rope.*, ...), in file
    order, without the architecture prefix."""
    prefix = f"{g.architecture}."
    return {key[len(prefix):]: _value(g, key) for key in g.metadata if key.startswith(prefix)}


def tokenizer_summary(g: GGUFFile) -> dict[str, Any]:
    tokens = g.metadata.get("tokenizer.ggml.tokens")
    merges = g.metadata.get("tokenizer.ggml.merges")
    summary: dict[str, Any] = {
        "model": g.metadata.get("tokenizer.ggml.model"),
        "pre": g.metadata.get("tokenizer.ggml.pre"),
        "vocab_size": len(tokens) if tokens is not None else None,
        "merges": len(merges) if merges is not None else None,
    }
    for name in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id", "add_bos_token",
                 "add_eos_token"):
        key = f"tokenizer.ggml.{name}"
        if key in g.metadata:
            summary[name] = _value(g, key)
    summary["chat_template"] = "tokenizer.chat_template" in g.metadata
    return summary


def type_breakdown(g: GGUFFile) -> dict[str, dict[str, int]]:
    """Per tensor type: how many tensors, elements and bytes, most elements first."""
    counts: Counter[GGMLType] = Counter()
    elements: Counter[GGMLType] = Counter()
    nbytes: Counter[GGMLType] = Counter()
    for t in g.tensors.values():
        counts[t.ggml_type] += 1
        elements[t.ggml_type] += t.n_elements
        nbytes[t.ggml_type] += t.nbytes
    return {t.name: {"tensors": counts[t], "elements": elements[t], "bytes": nbytes[t]}
            for t, _ in elements.most_common()}


#: ``{arch}.*`` expert keys → the names ``experts`` uses for them
_EXPERT_KEYS = {"expert_count": "count", "expert_used_count": "used", "expert_shared_count": "shared",
                "expert_group_count": "groups", "expert_group_used_count": "groups_used",
                "expert_feed_forward_length": "feed_forward_length", "nextn_predict_layers": "mtp_layers"}


def experts_summary(g: GGUFFile) -> dict[str, Any] | None:
    """A mixture-of-experts file's expert counts (None for a dense model)."""
    found = {name: _value(g, f"{g.architecture}.{key}") for key, name in _EXPERT_KEYS.items()
             if f"{g.architecture}.{key}" in g.metadata}
    return found if found.get("count") else None


def _experts_text(experts: dict[str, Any]) -> str:
    """``8 (2 used per token, 1 shared, 4 groups of which 2 used, 256 wide)``."""
    parts = [f"{experts['used']} used per token"] if "used" in experts else []
    if experts.get("shared"):
        parts.append(f"{experts['shared']} shared")
    if experts.get("groups"):
        parts.append(f"{experts['groups']} groups of which {experts.get('groups_used', '?')} used")
    if experts.get("feed_forward_length"):
        parts.append(f"{experts['feed_forward_length']} wide")
    if experts.get("mtp_layers"):  # GLM-4.5 / DeepSeek-V3: the last blocks, skipped as llama.cpp does
        parts.append(f"{experts['mtp_layers']} multi-token-prediction layer(s) after the trunk, not run")
    return f"{experts['count']} ({', '.join(parts)})" if parts else str(experts["count"])


def memory_module(architecture: str | None) -> str | None:
    """The memory module the architecture's plugin names (``kv_cache``, ``kv_cache_iswa``, ``recurrent``,
    ``hybrid``...), or None for an architecture no installed plugin serves."""
    from ..core.arch.architecture import Architecture
    from ..core.errors import LLMFWError
    from ..core.plugins import registry

    try:
        return registry("architectures").get_class(str(architecture), Architecture).memory
    except (LLMFWError, ImportError):
        return None


def summarize(g: GGUFFile, *, with_tensors: bool = False) -> dict[str, Any]:
    """Everything `llmfw inspect` shows, as a JSON-ready dict."""
    n_params = g.n_parameters
    total = g.tensor_data_bytes
    main_type = most_common_type(g.tensors.values())
    ftype_id = g.metadata.get("general.file_type")
    summary: dict[str, Any] = {
        "path": str(g.path),
        "files": [str(p) for p in g.paths],
        "gguf_version": g.version,
        "alignment": g.alignment,
        "architecture": g.architecture,
        "memory": memory_module(g.architecture),
        "general": {k: _value(g, f"general.{k}") for k in _GENERAL_KEYS if f"general.{k}" in g.metadata},
        "hyperparameters": hyperparameters(g),
        "experts": experts_summary(g),
        "tokenizer": tokenizer_summary(g),
        "file_type": main_type.name if main_type is not None else None,
        "general_file_type": ({"id": ftype_id, "name": LLAMA_FTYPE_NAMES.get(ftype_id, "unknown")}
                              if isinstance(ftype_id, int) else None),
        "metadata_keys": len(g.metadata),
        "tensor_count": len(g.tensors),
        "tensor_bytes": total,
        "parameters": n_params,
        "bits_per_weight": round(8 * total / n_params, 4) if n_params else None,
        "types": type_breakdown(g),
        "cut_tensors": list(g.cut_tensors),  # their data lies past the end of the file
    }
    if with_tensors:
        summary["tensors"] = [{"name": t.name, "type": t.ggml_type.name, "shape": list(t.shape), "bytes": t.nbytes,
                               "offset": t.offset, "file": t.file_index} for t in g.tensors.values()]
    return summary


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    raise AssertionError("unreachable")


def _human_count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M" if n >= 1e6 else str(n)


def _special_tokens_text(tok: dict[str, Any]) -> str:
    """``bos 1, eos 2, unknown 0, padding 2; add_bos_token false`` — what the text view promises (docs/models.md)."""
    ids = [f"{label} {tok[key]}" for key, label in (("bos_token_id", "bos"), ("eos_token_id", "eos"),
                                                     ("unknown_token_id", "unknown"), ("padding_token_id", "padding"))
           if key in tok]
    flags = [f"{key} {str(tok[key]).lower()}" for key in ("add_bos_token", "add_eos_token") if key in tok]
    return "; ".join(part for part in (", ".join(ids), ", ".join(flags)) if part) or "none declared"


def format_text(s: dict[str, Any]) -> str:
    lines = [f"file:            {', '.join(s['files'])}",
             f"GGUF version:    {s['gguf_version']} (alignment {s['alignment']}, {s['metadata_keys']} keys)",
             f"architecture:    {s['architecture']}",
             f"memory:          {s['memory'] or 'unknown (no installed plugin serves this architecture)'}"]
    lines += [f"{k + ':':16} {v}" for k, v in s["general"].items()]
    lines.append("hyperparameters:")
    width = max((len(k) for k in s["hyperparameters"]), default=0)
    lines += [f"  {k:{width}}  {v}" for k, v in s["hyperparameters"].items()]
    if s.get("experts"):
        lines.append(f"experts:         {_experts_text(s['experts'])}")
    tok = s["tokenizer"]
    merges = f", {tok['merges']} merges" if tok["merges"] is not None else ""
    lines.append(f"tokenizer:       {tok['model']} (pre {tok['pre']}), {tok['vocab_size']} tokens{merges}")
    lines.append(f"special tokens:  {_special_tokens_text(tok)}")
    lines.append(f"chat template:   {'yes' if tok['chat_template'] else 'no (ChatML is used)'}")
    ftype = s["file_type"] or "-"
    if s["general_file_type"]:
        ftype += f" (general.file_type {s['general_file_type']['id']}: {s['general_file_type']['name']})"
    lines.append(f"file type:       {ftype}")
    bpw = f", {s['bits_per_weight']:.2f} bits per weight" if s["bits_per_weight"] else ""
    lines.append(f"tensors:         {s['tensor_count']}, {_human_bytes(s['tensor_bytes'])}, "
                 f"{_human_count(s['parameters'])} parameters{bpw}")
    if s["cut_tensors"]:
        lines.append(f"cut short:       the data of {len(s['cut_tensors'])} of {s['tensor_count']} tensors lies past "
                     "the end of the file (an interrupted download?): it cannot be loaded")
    for name, t in s["types"].items():
        lines.append(f"  {name:8} {t['tensors']:5} tensors {_human_count(t['elements']):>10} elements "
                     f"{_human_bytes(t['bytes']):>12}")
    if "tensors" in s:
        name_width = max((len(t["name"]) for t in s["tensors"]), default=4)
        lines.append(f"{'name':{name_width}}  {'type':7} {'shape':24} {'bytes':>12}")
        for t in s["tensors"]:
            shape = "[" + ", ".join(map(str, t["shape"])) + "]"
            lines.append(f"{t['name']:{name_width}}  {t['type']:7} {shape:24} {t['bytes']:>12}")
    return "\n".join(lines)


@click.command("inspect")
@click.argument("model_arg", metavar="[MODEL]", required=False)
@model_option
@click.option("--tensors", "with_tensors", is_flag=True, help="List every tensor: name, type, shape, bytes.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def inspect_cmd(model_arg: str | None, model: str | None, with_tensors: bool, as_json: bool) -> None:
    """Show MODEL's GGUF version, architecture, hyperparameters, tokenizer, file type and size.

    MODEL (-m MODEL, or the first argument) is a path to a .gguf file (the first part of a split model) or a
    catalog name. A file whose tensor data is cut short (an interrupted download) is still shown, with the
    tensors past its end counted.
    """
    model = model_from(model_arg, model) or DEFAULT_MODEL
    with ProgressBar(f"pull {model}") as bar:
        path = resolve_model(model, progress=lambda done, total, what: bar.update(done / total, what))
    with open_gguf(path, allow_cut_data=True) as g:
        summary = summarize(g, with_tensors=with_tensors)
    click.echo(json.dumps(summary, indent=2, ensure_ascii=False) if as_json else format_text(summary))
