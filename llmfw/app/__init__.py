"""Application layer: pipelines (model + backend + serving config) and the model catalog."""
