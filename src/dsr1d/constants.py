"""Names that several layers share and clients depend on (DESIGN.md fixes the bus names)."""

BUS_NAME = "org.dsr1d"
PATH = "/org/dsr1d"
MANAGER = "org.dsr1d.Manager1"
ENGINE_PATH = "/org/dsr1d/engine"
ENGINE = "org.dsr1d.Engine1"
ERROR = "org.dsr1d.Error."

# The engine's weight precisions and backends, as config and profiles spell them.
ENGINE_DTYPES = ("auto", "bf16", "fp32", "int8", "int4")
# The engine is llama-server; torch is the numerical reference (dsr1d model check), not a server.
ENGINE_BACKENDS = ("auto", "llamacpp")
NGRAM = "ngram"                 # draft_model = ngram: speculation from the text so far

# Telemetry sample keys that one layer writes and another reads (the sources in plugins/, the
# mitigator, dsr1ctl watch): a key spelt two ways is a column that stays empty.
PKG_TEMP_C = "pkg_temp_c"
PKG_POWER_W = "pkg_power_w"
RAM_POWER_W = "ram_power_w"          # DRAM, every domain summed (RAPL dram, turbostat RAMWatt)
BUSY_MHZ = "busy_mhz"
CPU_MHZ = "cpu_mhz"
THROTTLE_COUNT = "throttle_count"
ENGINE_TOKENS_PER_S = "engine_tokens_per_s"
ENGINE_GB_PER_TOKEN = "engine_gb_per_token"   # GB (1e9 bytes) a decoded token reads: weights + KV
LOAD_1M = "load_1m"
# what the tokens-per-joule controller reads besides the above
THROTTLE_MS = "throttle_ms"          # cumulative thermal throttle time, the most throttled CPU
ONLINE_CPUS = "online_cpus"
LIMIT_REASONS = "limit_reasons"      # MSR_CORE_PERF_LIMIT_REASONS 0x64F, low 16 bits
TJ_MAX_C = "tj_max_c"                # MSR_TEMPERATURE_TARGET 0x1A2 bits 23:16
TCC_OFFSET_C = "tcc_offset_c"        # and bits 29:24
CPU_MAX_MHZ = "cpu_max_mhz"          # cpuinfo_max_freq, the hardware's top
CPU_MIN_MHZ = "cpu_min_mhz"
UNCORE_MAX_MHZ = "uncore_max_mhz"    # the firmware's uncore range (initial_{max,min}_freq_khz)
UNCORE_MIN_MHZ = "uncore_min_mhz"
UNCORE_LIMIT_MHZ = "uncore_limit_mhz"  # the lowest max_freq_khz over the packages
CEILING_MHZ = "ceiling_mhz"          # the lowest scaling_max_freq over the online CPUs
PL1_W = "pl1_w"                      # RAPL long-term limit of package 0, as read back
PL1_PACKAGES_W = "pl1_packages_w"    # every package's, in zone order (two sockets or more)
PKG_POWER_PACKAGES_W = "pkg_power_packages_w"   # every package's power, same order
