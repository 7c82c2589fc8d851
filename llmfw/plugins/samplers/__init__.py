"""Built-in samplers, by the names used in sampler chains and YAML pipelines."""
from collections.abc import Callable

from llmfw.sdk import hookimpl

_PKG = "llmfw.plugins.samplers"

SAMPLERS: dict[str, str] = {
    "greedy": f"{_PKG}.basic:Greedy",
    "dist": f"{_PKG}.basic:Dist",
    "top_k": f"{_PKG}.truncation:TopK",
    "top_p": f"{_PKG}.truncation:TopP",
    "min_p": f"{_PKG}.truncation:MinP",
    "typical": f"{_PKG}.truncation:Typical",
    "top_n_sigma": f"{_PKG}.truncation:TopNSigma",
    "xtc": f"{_PKG}.truncation:XTC",
    "temperature": f"{_PKG}.temperature:Temperature",
    "temp_ext": f"{_PKG}.temperature:TempExt",
    "penalties": f"{_PKG}.penalties:Penalties",
    "logit_bias": f"{_PKG}.penalties:LogitBias",
    "dry": f"{_PKG}.dry:DRY",
    "mirostat": f"{_PKG}.mirostat:Mirostat",
    "mirostat_v2": f"{_PKG}.mirostat:MirostatV2",
    "grammar": f"{_PKG}.grammar:Grammar",
}


@hookimpl
def register_samplers(register: Callable[[str, str], None]) -> None:
    for name, ref in SAMPLERS.items():
        register(name, ref)
