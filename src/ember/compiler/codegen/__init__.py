"""Code generators, one per backend."""
