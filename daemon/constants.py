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

# Telemetry sample keys that one layer writes and another reads (the sources in plugins/, the
# mitigator, dsr1ctl watch): a key spelt two ways is a column that stays empty.
PKG_TEMP_C = "pkg_temp_c"
PKG_POWER_W = "pkg_power_w"
BUSY_MHZ = "busy_mhz"
CPU_MHZ = "cpu_mhz"
THROTTLE_COUNT = "throttle_count"
ENGINE_TOKENS_PER_S = "engine_tokens_per_s"
LOAD_1M = "load_1m"
