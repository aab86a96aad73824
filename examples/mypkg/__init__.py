"""A user's own package: a model built from symattn's layers and a dataset of its own."""
