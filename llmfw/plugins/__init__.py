"""Built-in plugins. Each sub-package registers its kind through the same hooks a third-party plugin uses."""

#: the built-in plugin modules, one package per kind (the plugin manager registers them before entry points)
BUILTIN_PLUGINS = (
    "llmfw.plugins.architectures",
    "llmfw.plugins.backends",
    "llmfw.plugins.tokenizers",
    "llmfw.plugins.samplers",
    "llmfw.plugins.loaders",
    "llmfw.plugins.memory",
)
