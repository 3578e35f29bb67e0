"""The inference engine: the only package that imports torch and transformers."""
