"""Architecture descriptions and their hyper-parameters."""
