"""Built-in plugins: one module per tunable, registered through the same hooks as others."""
