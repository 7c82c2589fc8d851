"""`llmfw bench`'s report: the table of every engine's numbers, beside the reference engine's."""
from __future__ import annotations

from typing import Any

def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f}"


def format_table(records: list[dict[str, Any]], reference: dict[str, Any] | None) -> str:
    """A markdown table like llama-bench's, with the llama.cpp ratio when there is a reference."""
    head = ["engine", "backend", "threads", "test", "t/s (median)", "± std"]
    if reference:
        head += ["llama.cpp t/s", "ratio"]
    head += ["graphs built/reused"]
    rows = [head, ["---"] * len(head)]
    notes: list[str] = []
    for record in records + ([reference] if reference else []):
        for test, result in record.get("tests", {}).items():
            row = [record["engine"], record["backend"], str(record["n_threads"]), test,
                   f"{result['tps_median']:.2f}", f"{result['tps_std']:.2f}"]
            if reference:
                ref = reference["tests"].get(test)
                is_ref = record is reference
                row += ["" if is_ref or not ref else f"{ref['tps_median']:.2f}",
                        "" if is_ref or not ref else f"{result['tps_median'] / ref['tps_median']:.2f}x"]
            row.append(f"{result['graph_builds']}/{result['graph_reuses']}" if "graph_builds" in result else "-")
            rows.append(row)
            if "mask_ms_per_token" in result:
                notes.append(_constraint_note(record, test, result))
            if "x" in test and test.split("x")[0] in record["tests"]:
                single = record["tests"][test.split("x")[0]]["tps_median"]
                notes.append(f"{record['engine']} {record['backend']} {test}: aggregate {result['tps_median']:.2f} t/s "
                             f"= {result['tps_median'] / single:.2f}x one sequence's {test.split('x')[0]}")
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    lines += [""] + notes
    for record in records + ([reference] if reference else []):
        if "error" in record:
            lines.append(f"{record['engine']} {record['backend']}: ERROR {record['error']}")
            continue
        extra = ""
        if "weight_bytes" in record:
            extra = (f", weights kept {_mib(record['weight_bytes'])} MiB, KV cache {_mib(record['kv_bytes'])} MiB "
                     f"(n_ctx {record['n_ctx']})")
        model_alone = f" (model alone {record['load_model_s']:.2f} s)" if "load_model_s" in record else ""
        lines.append(f"{record['engine']} {record['backend']}: load {record['load_s']:.2f} s{model_alone}, "
                     f"RSS before load "
                     f"{_mib(record['rss_base'])} MiB, after load {_mib(record['rss_after_load'])} MiB, peak "
                     f"{_mib(record['rss_peak'])} MiB{extra}")
    return "\n".join(lines)


def _constraint_note(record: dict[str, Any], test: str, result: dict[str, Any]) -> str:
    """The constrained run against the plain tg of the same record."""
    base = test.split("+")[0]
    ratios = [f"{result['tps_median'] / ref['tps_median']:.2f}x of {name}" for name in (base, f"{base}+sample")
              if (ref := record["tests"].get(name)) and ref.get("tps_median")]
    ratio = f", {', '.join(ratios)}" if ratios else ""
    return (f"{record['engine']} {record['backend']} {test}: mask {result['mask_ms_per_token']:.3f} ms/token, "
            f"grammar compile {result['grammar_compile_ms']:.1f} ms, vocabulary bridge "
            f"{result['vocab_bridge_ms']:.0f} ms (once per model){ratio}")
