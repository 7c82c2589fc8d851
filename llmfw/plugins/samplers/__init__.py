"""Built-in samplers, by the names used in sampler chains and YAML pipelines."""
from llmfw.core.plugins import hookimpl

SAMPLERS: dict[str, str] = {
}


@hookimpl
def register_samplers(register):
    for name, ref in SAMPLERS.items():
        register(name, ref)
