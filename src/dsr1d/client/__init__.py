"""``dsr1ctl``, the client people and scripts type: it talks to the daemon over D-Bus only."""
