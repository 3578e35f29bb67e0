"""The pure core: profiles and configuration, tuning (apply / switch / verify / restore), the
journal, holds and profile choice, the mitigation controller, thread placement, the plugin
registry and the telemetry sampler.

No bus library, no event loop, no torch: everything here runs the same in a test, in the admin
commands and in the daemon. It imports only the contract and the shared leaves."""
