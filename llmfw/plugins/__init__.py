"""Built-in plugins. Each sub-package registers its kind through the same hooks a third-party plugin uses."""
