"""The contract plugins import: the hooks, the tunable and knob types, option schemas, telemetry
source types and helpers, and the hardware root every read and write goes through.

It imports nothing else of dsr1d but the shared leaves (constants)."""
