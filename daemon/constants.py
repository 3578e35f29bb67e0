"""Names that several layers share and clients depend on (DESIGN.md fixes the bus names)."""

BUS_NAME = "org.dsr1d"
PATH = "/org/dsr1d"
MANAGER = "org.dsr1d.Manager1"
ENGINE_PATH = "/org/dsr1d/engine"
ENGINE = "org.dsr1d.Engine1"
ERROR = "org.dsr1d.Error."

# The engine's weight precisions and backends, as config and profiles spell them.
ENGINE_DTYPES = ("auto", "bf16", "fp32", "int8", "int4")
ENGINE_BACKENDS = ("auto", "llamacpp", "torch")
