"""The thin edges that bind the core to the world: the service (asyncio main, signals,
sd_notify, udev), the D-Bus adapter (the only module here that imports the bus library), the
engine host (which speaks to the engine worker through its pipe only) and the admin command
line (``dsr1d``)."""
