"""The thermal plant simulator (``dsr1d simulate``): the core's mitigation controller run
against a modelled machine."""
